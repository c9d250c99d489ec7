/* dpsync-info: the run-time libraries dpsync would load (driver, NVRTC, NCCL, MPI), the GPUs. */
#define _GNU_SOURCE
#include "dpsync_info.h"

#include <ctype.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ the run-time libraries */

/* The file that defines `symbol`, symbolic links resolved (libcuda.so.1 -> libcuda.so.580.65.06). */
void set_path_of(probe *p, void *symbol) {
  Dl_info info;
  if (!symbol || !dladdr(symbol, &info) || !info.dli_fname) return;
  char *real = realpath(info.dli_fname, NULL);
  snprintf(p->path, sizeof p->path, "%s", real ? real : info.dli_fname);
  free(real);
}

/* dlopen of each name in turn. On failure p->reason lists the names and the loader's last
 * message. */
static void *open_any(probe *p, const char *const *names) {
  char tried[1024] = "";
  const char *why = NULL;
  for (const char *const *name = names; *name; name++) {
    void *lib = dlopen(*name, RTLD_NOW | RTLD_LOCAL);
    if (lib) return lib;
    why = dlerror();
    size_t used = strlen(tried);
    snprintf(tried + used, sizeof tried - used, "%s%s", used ? ", " : "", *name);
  }
  snprintf(p->reason, sizeof p->reason, "tried %s (%s)", tried, why ? why : "no message");
  return NULL;
}

/* The environment variable's value, trimmed as dpsync trims it; NULL when unset or empty. */
static const char *env_path(const char *name, char *buf, size_t cap) {
  const char *v = getenv(name);
  if (!v) return NULL;
  while (isspace((unsigned char)*v)) v++;
  snprintf(buf, cap, "%s", v);
  size_t n = strlen(buf);
  while (n && isspace((unsigned char)buf[n - 1])) buf[--n] = '\0';
  return n ? buf : NULL;
}

typedef int CUresult;
static struct {
  void *lib;
  CUresult (*init)(unsigned);
  CUresult (*driver_version)(int *);
  CUresult (*device_count)(int *);
  CUresult (*device_get)(int *, int);
  CUresult (*device_name)(char *, int, int);
  CUresult (*attribute)(int *, int, int);
  CUresult (*total_mem)(size_t *, int);
  CUresult (*can_access_peer)(int *, int, int);
  CUresult (*error_name)(CUresult, const char **);
} cu;

#define SYM(lib, field, name) (*(void **)(&(field)) = dlsym((lib), (name)))

/* The driver, by cudarc's names (dpsync loads it through cudarc) in cudarc's order; drivers
 * install libcuda.so.1, and libcuda.so with the development files. */
void probe_driver(probe *p) {
  static const char *const names[] = {"libcuda.so",    "libcuda.so.13", "libcuda.so.12",
                                      "libcuda.so.11", "libcuda.so.10", "libcuda.so.9",
                                      "libcuda.so.1",  NULL};
  cu.lib = open_any(p, names);
  if (!cu.lib) return;
  SYM(cu.lib, cu.init, "cuInit");
  SYM(cu.lib, cu.driver_version, "cuDriverGetVersion");
  SYM(cu.lib, cu.device_count, "cuDeviceGetCount");
  SYM(cu.lib, cu.device_get, "cuDeviceGet");
  SYM(cu.lib, cu.device_name, "cuDeviceGetName");
  SYM(cu.lib, cu.attribute, "cuDeviceGetAttribute");
  SYM(cu.lib, cu.total_mem, "cuDeviceTotalMem_v2"); /* optional */
  SYM(cu.lib, cu.can_access_peer, "cuDeviceCanAccessPeer");
  SYM(cu.lib, cu.error_name, "cuGetErrorName"); /* optional */
  if (!cu.init || !cu.driver_version || !cu.device_count || !cu.device_get || !cu.device_name ||
      !cu.attribute || !cu.can_access_peer) {
    snprintf(p->reason, sizeof p->reason, "a library named libcuda was found but lacks "
             "the CUDA driver's entry points");
    cu.lib = NULL;
    return;
  }
  int v = 0;
  p->found = 1;
  p->reason[0] = '\0';
  if (cu.driver_version(&v) == 0)
    snprintf(p->version, sizeof p->version, "%d.%d", v / 1000, (v % 1000) / 10);
  set_path_of(p, *(void **)&cu.init);
}

/* NVRTC as dpsync gets it: the file DPSYNC_NVRTC_LIBRARY names is loaded first (RTLD_GLOBAL),
 * then cudarc opens the first of its names that loads, which is that file when its soname
 * (libnvrtc.so.13) comes before any other NVRTC on the loader path. */
void probe_nvrtc(probe *p) {
  char named[4096], named_real[4096] = "";
  if (env_path("DPSYNC_NVRTC_LIBRARY", named, sizeof named)) {
    if (dlopen(named, RTLD_NOW | RTLD_GLOBAL) && realpath(named, named_real)) {
      p->via = "DPSYNC_NVRTC_LIBRARY";
    } else {
      const char *why = dlerror();
      snprintf(p->named, sizeof p->named, "DPSYNC_NVRTC_LIBRARY=%.1000s did not load (%.1000s)",
               named, why ? why : "realpath failed");
    }
  }
  static const char *const names[] = {"libnvrtc.so",    "libnvrtc.so.13", "libnvrtc.so.12",
                                      "libnvrtc.so.11", "libnvrtc.so.10", "libnvrtc.so.9",
                                      "libnvrtc.so.1",  NULL};
  void *lib = open_any(p, names);
  if (!lib) return;
  int (*version)(int *, int *) = NULL;
  SYM(lib, version, "nvrtcVersion");
  int major = 0, minor = 0;
  if (!version || version(&major, &minor) != 0) {
    snprintf(p->reason, sizeof p->reason, "a library named libnvrtc was found but nvrtcVersion "
             "did not answer");
    return;
  }
  p->found = 1;
  p->reason[0] = '\0';
  snprintf(p->version, sizeof p->version, "%d.%d", major, minor);
  set_path_of(p, *(void **)&version);
  if (p->via && strcmp(p->path, named_real) != 0) {
    snprintf(p->named, sizeof p->named, "not the file DPSYNC_NVRTC_LIBRARY names (%.1900s): "
             "this one comes first on the loader path", named_real);
    p->via = NULL;
  }
}

/* NCCL: DPSYNC_NCCL_LIBRARY alone when set, else libnccl.so.2, else libnccl.so. */
void probe_nccl(probe *p) {
  char named[4096];
  void *lib;
  if (env_path("DPSYNC_NCCL_LIBRARY", named, sizeof named)) {
    const char *const one[] = {named, NULL};
    p->via = "DPSYNC_NCCL_LIBRARY";
    lib = open_any(p, one);
  } else {
    static const char *const names[] = {"libnccl.so.2", "libnccl.so", NULL};
    lib = open_any(p, names);
  }
  if (!lib) return;
  int (*version)(int *) = NULL;
  SYM(lib, version, "ncclGetVersion");
  int v = 0;
  if (!version || version(&v) != 0) {
    snprintf(p->reason, sizeof p->reason, "a library named libnccl was found but ncclGetVersion "
             "did not answer");
    return;
  }
  p->found = 1;
  p->reason[0] = '\0';
  /* NCCL's encoding changed at 2.9: 2.8.4 is 2804, 2.27.3 is 22703. */
  if (v >= 10000) snprintf(p->version, sizeof p->version, "%d.%d.%d", v / 10000, v / 100 % 100, v % 100);
  else snprintf(p->version, sizeof p->version, "%d.%d.%d", v / 1000, v / 100 % 10, v % 100);
  set_path_of(p, *(void **)&version);
}

/* MPI: only a library built with it links one; ask the MPI already loaded with it.
 * MPI_Get_library_version may be called before MPI_Init. */
void probe_mpi(probe *p, int built_in) {
  if (!built_in) {
    p->absent = "not built in";
    snprintf(p->reason, sizeof p->reason, "this build of dpsync has no MPI (scripts/install.sh "
             "--features mpi, or cargo build --features mpi)");
    return;
  }
  int (*version)(char *, int *) = NULL;
  SYM(RTLD_DEFAULT, version, "MPI_Get_library_version");
  static char text[8192]; /* at least MPI_MAX_LIBRARY_VERSION_STRING in Open MPI and MPICH */
  int len = 0;
  if (!version || version(text, &len) != 0) {
    snprintf(p->reason, sizeof p->reason, "dpsync was built with MPI, but no MPI library is "
             "loaded in this process");
    return;
  }
  text[len > 0 && len < (int)sizeof text ? len : (int)sizeof text - 1] = '\0';
  text[strcspn(text, "\n")] = '\0';
  p->found = 1;
  snprintf(p->version, sizeof p->version, "%.*s", (int)sizeof p->version - 1, text);
  set_path_of(p, *(void **)&version);
}

/* ------------------------------------------------------------------ GPUs */

static void cu_reason(char *out, size_t cap, const char *call, CUresult r) {
  const char *name = NULL;
  if (cu.error_name) cu.error_name(r, &name);
  snprintf(out, cap, "%s returned %d%s%s%s", call, r, name ? " (" : "", name ? name : "",
           name ? ")" : "");
}

void probe_gpus(gpus *g, const probe *driver) {
  g->count = 0;
  if (!driver->found) {
    snprintf(g->reason, sizeof g->reason, "the CUDA driver library was not found");
    return;
  }
  CUresult r = cu.init(0);
  if (r != 0) {
    cu_reason(g->reason, sizeof g->reason, "cuInit", r);
    return;
  }
  int n = 0;
  r = cu.device_count(&n);
  if (r != 0) {
    cu_reason(g->reason, sizeof g->reason, "cuDeviceGetCount", r);
    return;
  }
  if (n == 0) {
    snprintf(g->reason, sizeof g->reason, "the driver reports 0 devices");
    return;
  }
  if (n > MAX_GPUS) n = MAX_GPUS;
  int dev[MAX_GPUS];
  for (int i = 0; i < n; i++) {
    r = cu.device_get(&dev[i], i);
    if (r != 0) {
      cu_reason(g->reason, sizeof g->reason, "cuDeviceGet", r);
      return;
    }
    if (cu.device_name(g->name[i], (int)sizeof g->name[i], dev[i]) != 0) g->name[i][0] = '\0';
    cu.attribute(&g->cc_major[i], 75, dev[i]); /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    cu.attribute(&g->cc_minor[i], 76, dev[i]); /* ..._MINOR */
    if (!cu.total_mem || cu.total_mem(&g->memory[i], dev[i]) != 0) g->memory[i] = 0;
  }
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) {
      int can = i == j;
      if (i != j && cu.can_access_peer(&can, dev[i], dev[j]) != 0) can = 0;
      g->peer[i][j] = can;
    }
  g->count = n;
}
