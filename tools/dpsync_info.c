/*
 * dpsync-info — what this machine offers dpsync, and the plan dpsync makes for a set of replicas.
 *
 * Prints the library's version and build (MPI or not), the run-time libraries dpsync would load
 * (CUDA driver, NVRTC, NCCL, MPI: version and path, or why not found), the GPUs and which pairs
 * have peer access, and the allreduce plan dpsync_plan_describe gives for the options (a dry run
 * that touches no device). --check also creates a context with those options, as a program
 * would, and prints what dpsync chose, or its error (exit 1).
 *
 *   dpsync-info [--cuda 0,0,1 | --host N] [--transport auto|nccl|peer_copy|host]
 *               [--peer-access 1,0,0/0,1,1/0,1,1] [--fusion-bytes N] [--check] [--json]
 *
 * Uses only dpsync's public API; the run-time libraries are opened here by the names dpsync uses
 * (docs/API.md, "CUDA libraries"). Exit codes: 0, 1 (--check failed),
 * 2 (bad arguments, usage on stderr).
 */
#define _GNU_SOURCE
#include <dpsync.h>

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REPLICAS 4096
#define MAX_GPUS 64

static void usage(FILE *out) {
  fprintf(out,
          "usage: dpsync-info [--cuda ORDINALS | --host N] [--transport auto|nccl|peer_copy|host]\n"
          "                   [--peer-access MATRIX] [--fusion-bytes N] [--check] [--json]\n"
          "  --cuda 0,0,1         one CUDA replica per entry (device ordinals, may repeat)\n"
          "  --host N             N host replicas\n"
          "                       (neither: one CUDA replica per GPU found, else --host 2)\n"
          "  --peer-access M      override peer access between replicas: rows split by '/',\n"
          "                       entries 0 or 1 split by ',', e.g. 1,0,0/0,1,1/0,1,1\n"
          "  --fusion-bytes N     fusion bucket capacity (0: no fusion)\n"
          "  --check              also create a context with these options and show what dpsync\n"
          "                       chose, or its error (exit 1)\n"
          "  --json               one JSON object instead of tables (\"plan\": dpsync_plan_describe's)\n");
}

static void bad_usage(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("dpsync-info: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n", stderr);
  va_end(ap);
  usage(stderr);
  exit(2);
}

/* ------------------------------------------------------------------ a small JSON reader */

/* Enough JSON for dpsync's describe output: a tree of values, strings with escapes as bytes. */
typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } json_type;
typedef struct json {
  json_type type;
  double num;
  char *str;
  size_t n;
  struct json *items; /* array items, or object values */
  char **keys;        /* object keys */
} json;

typedef struct {
  const char *p;
  int ok;
} json_reader;

static void skip_ws(json_reader *r) {
  while (*r->p && isspace((unsigned char)*r->p)) r->p++;
}

static char *parse_string(json_reader *r) {
  size_t cap = 16, len = 0;
  char *s = malloc(cap);
  if (!s) exit(1);
  r->p++; /* opening quote */
  while (*r->p && *r->p != '"') {
    char c = *r->p++;
    if (c == '\\') {
      c = *r->p++;
      switch (c) {
        case 'n': c = '\n'; break;
        case 't': c = '\t'; break;
        case 'r': c = '\r'; break;
        case 'b': c = '\b'; break;
        case 'f': c = '\f'; break;
        case 'u': {
          /* dpsync writes \u only for control characters: keep one byte, '?' otherwise. */
          unsigned v = 0;
          for (int i = 0; i < 4 && isxdigit((unsigned char)*r->p); i++, r->p++)
            v = v * 16 + (unsigned)(isdigit((unsigned char)*r->p) ? *r->p - '0'
                                                                  : (tolower(*r->p) - 'a' + 10));
          c = v < 0x80 ? (char)v : '?';
          break;
        }
        case '\0': r->ok = 0; r->p--; c = 0; break;
        default: break; /* \" \\ \/ */
      }
    }
    if (len + 2 > cap) {
      cap *= 2;
      s = realloc(s, cap);
      if (!s) exit(1);
    }
    s[len++] = c;
  }
  if (*r->p == '"') r->p++;
  else r->ok = 0;
  s[len] = '\0';
  return s;
}

static void parse_value(json_reader *r, json *out);

static void push(json *v, json *item, char *key) {
  v->items = realloc(v->items, (v->n + 1) * sizeof *v->items);
  if (!v->items) exit(1);
  v->items[v->n] = *item;
  if (v->type == J_OBJ) {
    v->keys = realloc(v->keys, (v->n + 1) * sizeof *v->keys);
    if (!v->keys) exit(1);
    v->keys[v->n] = key;
  }
  v->n++;
}

static void parse_container(json_reader *r, json *out, json_type type, char close) {
  out->type = type;
  r->p++;
  skip_ws(r);
  if (*r->p == close) {
    r->p++;
    return;
  }
  while (r->ok) {
    char *key = NULL;
    if (type == J_OBJ) {
      skip_ws(r);
      if (*r->p != '"') break;
      key = parse_string(r);
      skip_ws(r);
      if (*r->p != ':') {
        free(key);
        break;
      }
      r->p++;
    }
    json item = {0};
    parse_value(r, &item);
    push(out, &item, key);
    skip_ws(r);
    if (*r->p == ',') {
      r->p++;
      continue;
    }
    if (*r->p == close) {
      r->p++;
      return;
    }
    break;
  }
  r->ok = 0;
}

static void parse_value(json_reader *r, json *out) {
  skip_ws(r);
  memset(out, 0, sizeof *out);
  char c = *r->p;
  if (c == '{') {
    parse_container(r, out, J_OBJ, '}');
  } else if (c == '[') {
    parse_container(r, out, J_ARR, ']');
  } else if (c == '"') {
    out->type = J_STR;
    out->str = parse_string(r);
  } else if (strncmp(r->p, "true", 4) == 0 || strncmp(r->p, "false", 5) == 0) {
    out->type = J_BOOL;
    out->num = c == 't';
    r->p += c == 't' ? 4 : 5;
  } else if (strncmp(r->p, "null", 4) == 0) {
    out->type = J_NULL;
    r->p += 4;
  } else {
    char *end = NULL;
    out->type = J_NUM;
    out->num = strtod(r->p, &end);
    if (end == r->p) r->ok = 0;
    else r->p = end;
  }
}

static void json_free(json *v) {
  for (size_t i = 0; i < v->n; i++) {
    json_free(&v->items[i]);
    if (v->keys) free(v->keys[i]);
  }
  free(v->items);
  free(v->keys);
  free(v->str);
}

static int json_parse(const char *text, json *out) {
  json_reader r = {text, 1};
  parse_value(&r, out);
  skip_ws(&r);
  if (!r.ok || *r.p) {
    json_free(out);
    return 0;
  }
  return 1;
}

static const json *get(const json *obj, const char *key) {
  if (!obj || obj->type != J_OBJ) return NULL;
  for (size_t i = 0; i < obj->n; i++)
    if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
  return NULL;
}

static const char *str_of(const json *v) { return v && v->type == J_STR ? v->str : ""; }

/* Writes a value compactly on one line: strings bare, lists in brackets. */
static void print_compact(const json *v) {
  if (!v) return;
  switch (v->type) {
    case J_NULL: printf("null"); break;
    case J_BOOL: printf(v->num ? "true" : "false"); break;
    case J_NUM: printf("%.10g", v->num); break;
    case J_STR: printf("%s", v->str); break;
    case J_ARR:
      printf("[");
      for (size_t i = 0; i < v->n; i++) {
        if (i) printf(", ");
        print_compact(&v->items[i]);
      }
      printf("]");
      break;
    case J_OBJ:
      printf("{");
      for (size_t i = 0; i < v->n; i++) {
        printf(i ? ", %s: " : "%s: ", v->keys[i]);
        print_compact(&v->items[i]);
      }
      printf("}");
      break;
  }
}

/* Writes `s` as a JSON string literal. */
static void put_json_string(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if (*p < 0x20) printf("\\u%04x", *p);
    else putchar(*p);
  }
  putchar('"');
}

/* ------------------------------------------------------------------ the run-time libraries */

typedef struct {
  int found;
  char version[256];
  char path[4096];
  char reason[2048];
  const char *via; /* how it was named: an environment variable, or NULL for the loader path */
  char named[2048]; /* what went wrong with the file a variable names, if anything */
  const char *absent; /* how a missing one is reported: NULL for "not found" */
} probe;

/* The file that defines `symbol`, symbolic links resolved (libcuda.so.1 -> libcuda.so.580.65.06). */
static void set_path_of(probe *p, void *symbol) {
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
static void probe_driver(probe *p) {
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
static void probe_nvrtc(probe *p) {
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
static void probe_nccl(probe *p) {
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
static void probe_mpi(probe *p, int built_in) {
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

typedef struct {
  int count;
  char reason[512];
  char name[MAX_GPUS][256];
  int cc_major[MAX_GPUS], cc_minor[MAX_GPUS];
  size_t memory[MAX_GPUS]; /* 0: unknown */
  int peer[MAX_GPUS][MAX_GPUS];
} gpus;

static void cu_reason(char *out, size_t cap, const char *call, CUresult r) {
  const char *name = NULL;
  if (cu.error_name) cu.error_name(r, &name);
  snprintf(out, cap, "%s returned %d%s%s%s", call, r, name ? " (" : "", name ? name : "",
           name ? ")" : "");
}

static void probe_gpus(gpus *g, const probe *driver) {
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

/* ------------------------------------------------------------------ options */

typedef struct {
  int32_t cuda[MAX_REPLICAS];
  size_t cuda_n, host_n;
  int have_transport;
  uint32_t transport;
  uint8_t *peer; /* replicas x replicas, or NULL */
  size_t peer_n;
  const char *peer_text;
  int have_fusion;
  size_t fusion_bytes;
  int check, json;
  char described[16384]; /* the options, as a command line */
} args;

static int parse_size(const char *text, size_t *out) {
  char *end = NULL;
  if (!text || !isdigit((unsigned char)*text)) return 0;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno || *end || v > SIZE_MAX) return 0;
  *out = (size_t)v;
  return 1;
}

static void parse_cuda(const char *text, args *a) {
  a->cuda_n = 0;
  const char *p = text;
  for (;;) {
    char *end = NULL;
    if (!isdigit((unsigned char)*p)) bad_usage("--cuda %s: expected device ordinals like 0,0,1", text);
    errno = 0;
    long v = strtol(p, &end, 10);
    if (errno || v > INT32_MAX || a->cuda_n == MAX_REPLICAS)
      bad_usage("--cuda %s: an ordinal or the count is out of range", text);
    a->cuda[a->cuda_n++] = (int32_t)v;
    if (*end == '\0') return;
    if (*end != ',') bad_usage("--cuda %s: expected device ordinals like 0,0,1", text);
    p = end + 1;
  }
}

/* "1,0,0/0,1,1/0,1,1": rows split by '/', 0 or 1 split by ','; must be square. */
static void parse_peer(const char *text, args *a) {
  size_t rows = 1, entries = 0, row_len = 0, first_len = 0;
  for (const char *p = text; *p; p++) {
    if (*p == '0' || *p == '1') {
      entries++, row_len++;
      if (p[1] != '\0' && p[1] != ',' && p[1] != '/') goto bad;
    } else if (*p == '/') {
      if (rows == 1) first_len = row_len;
      if (row_len == 0 || row_len != first_len) goto bad;
      rows++, row_len = 0;
    } else if (*p != ',' || p == text || p[1] == '\0' || p[1] == ',' || p[1] == '/') {
      goto bad;
    }
  }
  if (rows == 1) first_len = row_len;
  if (row_len != first_len || rows != first_len || entries == 0) goto bad;
  a->peer = malloc(entries);
  if (!a->peer) exit(1);
  a->peer_n = rows;
  size_t k = 0;
  for (const char *p = text; *p; p++)
    if (*p == '0' || *p == '1') a->peer[k++] = (uint8_t)(*p - '0');
  return;
bad:
  bad_usage("--peer-access %s: expected a square 0/1 matrix like 1,0,0/0,1,1/0,1,1", text);
}

static void append(char *buf, size_t cap, const char *fmt, ...) {
  size_t used = strlen(buf);
  if (used + 1 >= cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + used, cap - used, fmt, ap);
  va_end(ap);
}

static void parse_args(int argc, char **argv, args *a) {
  static const char *const transports[] = {"auto", "nccl", "peer_copy", "host"};
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i];
    if (strcmp(o, "-h") == 0 || strcmp(o, "--help") == 0) {
      usage(stdout);
      exit(0);
    }
    if (strcmp(o, "--check") == 0) {
      a->check = 1;
      continue;
    }
    if (strcmp(o, "--json") == 0) {
      a->json = 1;
      continue;
    }
    const char *v = i + 1 < argc ? argv[++i] : NULL;
    if (strcmp(o, "--cuda") == 0 || strcmp(o, "--host") == 0 || strcmp(o, "--transport") == 0 ||
        strcmp(o, "--peer-access") == 0 || strcmp(o, "--fusion-bytes") == 0) {
      if (!v) bad_usage("%s needs a value", o);
    } else {
      bad_usage("unknown argument '%s'", o);
    }
    if (strcmp(o, "--cuda") == 0) {
      parse_cuda(v, a);
    } else if (strcmp(o, "--host") == 0) {
      if (!parse_size(v, &a->host_n) || a->host_n == 0) bad_usage("--host %s: expected N >= 1", v);
    } else if (strcmp(o, "--transport") == 0) {
      size_t t = 0;
      while (t < 4 && strcmp(v, transports[t]) != 0) t++;
      if (t == 4) bad_usage("--transport %s: expected auto, nccl, peer_copy or host", v);
      a->have_transport = 1;
      a->transport = (uint32_t)t; /* DPSYNC_TRANSPORT_AUTO..HOST are 0..3 in this order */
    } else if (strcmp(o, "--peer-access") == 0) {
      free(a->peer);
      parse_peer(v, a);
      a->peer_text = v;
    } else {
      if (!parse_size(v, &a->fusion_bytes)) bad_usage("--fusion-bytes %s: expected N >= 0", v);
      a->have_fusion = 1;
    }
    if (strcmp(o, "--cuda") == 0) a->host_n = 0;
    if (strcmp(o, "--host") == 0) a->cuda_n = 0;
  }
}

/* ------------------------------------------------------------------ dpsync calls */

/* The status's name and dpsync's message, for a failed call. */
static void failure(char *out, size_t cap, const char *call, dpsync_status s) {
  snprintf(out, cap, "%s: %s: %s", call, dpsync_status_name((uint32_t)s), dpsync_last_error());
}

/* Options from the arguments; NULL with `error` set when dpsync refuses one. */
static dpsync_options *make_options(const args *a, char *error, size_t cap) {
  dpsync_options *o = NULL;
  dpsync_status s = dpsync_options_new(&o);
  if (s != DPSYNC_STATUS_OK) return failure(error, cap, "dpsync_options_new", s), NULL;
#define TRY(fn, ...)                           \
  do {                                         \
    s = fn(__VA_ARGS__);                       \
    if (s != DPSYNC_STATUS_OK) {               \
      failure(error, cap, #fn, s);             \
      dpsync_options_free(o);                  \
      return NULL;                             \
    }                                          \
  } while (0)
  if (a->cuda_n) TRY(dpsync_options_set_cuda_replicas, o, a->cuda, a->cuda_n);
  if (a->host_n) TRY(dpsync_options_set_host_replicas, o, a->host_n);
  if (a->have_transport) TRY(dpsync_options_set_transport, o, a->transport);
  if (a->have_fusion) TRY(dpsync_options_set_fusion_bytes, o, a->fusion_bytes);
  if (a->peer) TRY(dpsync_options_set_peer_access, o, a->peer, a->peer_n);
#undef TRY
  return o;
}

/* The whole JSON text of dpsync_plan_describe / dpsync_describe (sized first), or NULL. */
static char *describe_text(dpsync_status (*fn)(const void *, char *, size_t, size_t *),
                           const void *object, const char *call, char *error, size_t cap) {
  size_t len = 0;
  dpsync_status s = fn(object, NULL, 0, &len);
  if (s != DPSYNC_STATUS_OK) return failure(error, cap, call, s), NULL;
  char *text = malloc(len + 1);
  if (!text) exit(1);
  s = fn(object, text, len + 1, &len);
  if (s != DPSYNC_STATUS_OK) {
    free(text);
    return failure(error, cap, call, s), NULL;
  }
  return text;
}

static dpsync_status plan_describe(const void *o, char *b, size_t c, size_t *l) {
  return dpsync_plan_describe((const dpsync_options *)o, b, c, l);
}
static dpsync_status context_describe(const void *x, char *b, size_t c, size_t *l) {
  return dpsync_describe((const dpsync_context *)x, b, c, l);
}

/* ------------------------------------------------------------------ tables */

static void print_probe(const char *what, const probe *p) {
  if (p->found) {
    printf("  %-12s %-10s %s%s%s%s\n", what, p->version[0] ? p->version : "?", p->path,
           p->via ? " (" : "", p->via ? p->via : "", p->via ? ")" : "");
  } else {
    printf("  %-12s %s: %s\n", what, p->absent ? p->absent : "not found", p->reason);
  }
  if (p->named[0]) printf("  %-12s note: %s\n", "", p->named);
}

static void print_matrix(const char *indent, size_t n, int (*at)(const void *, size_t, size_t),
                         const void *m) {
  printf("%s    ", indent);
  for (size_t j = 0; j < n; j++) printf(" %3zu", j);
  printf("\n");
  for (size_t i = 0; i < n; i++) {
    printf("%s%3zu ", indent, i);
    for (size_t j = 0; j < n; j++) printf(" %3d", at(m, i, j) ? 1 : 0);
    printf("\n");
  }
}

static int gpu_peer_at(const void *m, size_t i, size_t j) {
  return ((const gpus *)m)->peer[i][j];
}
static int json_matrix_at(const void *m, size_t i, size_t j) {
  const json *row = &((const json *)m)->items[i];
  return j < row->n && row->items[j].num != 0;
}

static void print_gpus(const gpus *g) {
  printf("\nGPUs\n");
  if (g->count == 0) {
    printf("  no CUDA device: %s\n", g->reason);
    return;
  }
  printf("  %-4s %-40s %-8s %s\n", "GPU", "name", "compute", "memory");
  for (int i = 0; i < g->count; i++) {
    char memory[32] = "?";
    if (g->memory[i])
      snprintf(memory, sizeof memory, "%.1f GiB", (double)g->memory[i] / (1024.0 * 1024 * 1024));
    printf("  %-4d %-40s %d.%-6d %s\n", i, g->name[i], g->cc_major[i], g->cc_minor[i], memory);
  }
  printf("  peer access (row GPU reads column GPU's memory directly; cuDeviceCanAccessPeer):\n");
  print_matrix("  ", (size_t)g->count, gpu_peer_at, g);
}

static void print_levels(const json *levels) {
  if (!levels || levels->type != J_ARR) return;
  for (size_t i = 0; i < levels->n; i++) {
    const json *l = &levels->items[i];
    printf(i ? "                " : "  levels        ");
    printf("%s:", str_of(get(l, "level")));
    for (size_t k = 0; l->type == J_OBJ && k < l->n; k++) {
      if (strcmp(l->keys[k], "level") == 0) continue;
      printf(" %s ", l->keys[k]);
      print_compact(&l->items[k]);
    }
    printf("\n");
  }
}

static void print_plan(const json *plan, const char *options) {
  const json *replicas = get(plan, "replicas");
  printf("\nplan for %s (dpsync_plan_describe: a dry run, no device touched)\n", options);
  printf("  replicas      ");
  for (size_t i = 0; replicas && i < replicas->n; i++) {
    const json *r = &replicas->items[i];
    const json *rank = get(r, "rank");
    printf("%s%g:%s", i ? "  " : "", get(r, "index") ? get(r, "index")->num : (double)i,
           str_of(get(r, "device")));
    if (rank && rank->num != 0) printf("@rank%g", rank->num);
  }
  printf("\n  transport     %s: %s\n", str_of(get(plan, "transport")),
         str_of(get(plan, "transport_reason")));
  const json *peer = get(plan, "peer_access");
  if (peer && peer->type == J_ARR && peer->n) {
    printf("  peer access   %s (row replica reads column replica's memory directly)\n",
           str_of(get(plan, "peer_access_source")));
    print_matrix("              ", peer->n, json_matrix_at, peer);
  }
  const json *fusion = get(plan, "fusion_bytes"), *scale = get(plan, "loss_scale");
  if (fusion) printf("  fusion        %.0f bytes per bucket%s\n", fusion->num, fusion->num ? "" : " (no fusion)");
  if (scale) printf("  loss scale    %.6g\n", scale->num);
  print_levels(get(plan, "levels"));
  const json *problems = get(plan, "problems");
  for (size_t i = 0; problems && i < problems->n; i++)
    printf("  problem       %s\n", str_of(&problems->items[i]));
  const json *steps = get(plan, "steps");
  printf("  allreduce steps (ops of one round are independent)\n");
  printf("    %-6s %-15s %4s %4s  %s\n", "round", "op", "src", "dst", "via");
  for (size_t i = 0; steps && i < steps->n; i++) {
    const json *s = &steps->items[i];
    const json *rank = get(s, "rank");
    printf("    %-6g %-15s %4g %4g  %s", get(s, "round") ? get(s, "round")->num : 0,
           str_of(get(s, "op")), get(s, "src") ? get(s, "src")->num : -1,
           get(s, "dst") ? get(s, "dst")->num : -1, str_of(get(s, "via")));
    if (rank) printf(" (NCCL rank %g)", rank->num);
    printf("\n");
  }
  if (!steps || steps->n == 0) printf("    (none: one replica)\n");
}

static void print_check(const json *d) {
  printf("  %-19s %s: %s\n", "created", str_of(get(d, "transport")),
         str_of(get(d, "transport_reason")));
  const json *backend = get(d, "backend");
  for (size_t k = 0; backend && backend->type == J_OBJ && k < backend->n; k++) {
    const json *v = &backend->items[k];
    if (v->type == J_ARR) {
      for (size_t i = 0; i < v->n; i++) {
        printf("  %-19s ", i ? "" : backend->keys[k]);
        print_compact(&v->items[i]);
        printf("\n");
      }
    } else {
      printf("  %-19s ", backend->keys[k]);
      print_compact(v);
      printf("\n");
    }
  }
}

/* ------------------------------------------------------------------ JSON output */

static void put_probe(const char *key, const probe *p, int last) {
  printf("    ");
  put_json_string(key);
  printf(": {\"found\": %s", p->found ? "true" : "false");
  if (p->found) {
    printf(", \"version\": ");
    put_json_string(p->version);
    printf(", \"path\": ");
    put_json_string(p->path);
    if (p->via) {
      printf(", \"named_by\": ");
      put_json_string(p->via);
    }
  } else {
    printf(", \"reason\": ");
    put_json_string(p->reason);
  }
  if (p->named[0]) {
    printf(", \"note\": ");
    put_json_string(p->named);
  }
  printf("}%s\n", last ? "" : ",");
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
  args a = {0};
  parse_args(argc, argv, &a);

  /* The library itself. */
  char header_version[32];
  snprintf(header_version, sizeof header_version, "%d.%d.%d", DPSYNC_VERSION_MAJOR,
           DPSYNC_VERSION_MINOR, DPSYNC_VERSION_PATCH);
  probe self = {0};
  const char *(*version_fn)(void) = dpsync_version;
  set_path_of(&self, *(void **)&version_fn);
  char error[4096] = "";
  /* Setting a world is refused with UNAVAILABLE by a build without MPI; NULL names
   * MPI_COMM_WORLD and initialises nothing yet. */
  dpsync_options *probe_options = NULL;
  int mpi_built_in = 0;
  if (dpsync_options_new(&probe_options) == DPSYNC_STATUS_OK) {
    mpi_built_in = dpsync_options_set_world_mpi(probe_options, NULL) == DPSYNC_STATUS_OK;
    dpsync_options_free(probe_options);
  }

  probe driver = {0}, nvrtc = {0}, nccl = {0}, mpi = {0};
  probe_driver(&driver);
  probe_nvrtc(&nvrtc);
  probe_nccl(&nccl);
  probe_mpi(&mpi, mpi_built_in);
  static gpus g;
  probe_gpus(&g, &driver);

  /* Default replicas: one per GPU found, else two on the host. */
  if (!a.cuda_n && !a.host_n) {
    if (g.count) {
      for (int i = 0; i < g.count; i++) a.cuda[a.cuda_n++] = i;
    } else {
      a.host_n = 2;
    }
  }
  if (a.cuda_n) {
    append(a.described, sizeof a.described, "--cuda ");
    for (size_t i = 0; i < a.cuda_n; i++)
      append(a.described, sizeof a.described, "%s%d", i ? "," : "", a.cuda[i]);
  } else {
    append(a.described, sizeof a.described, "--host %zu", a.host_n);
  }
  if (a.have_transport) {
    static const char *const names[] = {"auto", "nccl", "peer_copy", "host"};
    append(a.described, sizeof a.described, " --transport %s", names[a.transport]);
  }
  /* Without --peer-access, CUDA replicas on GPUs found here are planned with the access the
   * driver reports (the dry run would otherwise assume none between distinct GPUs). */
  static char detected[8192];
  if (!a.peer && a.cuda_n && a.cuda_n <= 64) {
    int known = 1;
    for (size_t i = 0; i < a.cuda_n; i++) known &= a.cuda[i] < g.count;
    if (known) {
      a.peer = malloc(a.cuda_n * a.cuda_n);
      if (!a.peer) exit(1);
      a.peer_n = a.cuda_n;
      for (size_t i = 0; i < a.cuda_n; i++)
        for (size_t j = 0; j < a.cuda_n; j++) {
          int on = a.cuda[i] == a.cuda[j] || g.peer[a.cuda[i]][a.cuda[j]];
          a.peer[i * a.cuda_n + j] = (uint8_t)on;
          append(detected, sizeof detected, "%s%d", j ? "," : i ? "/" : "", on);
        }
      a.peer_text = detected;
    }
  }
  if (a.peer) append(a.described, sizeof a.described, " --peer-access %s", a.peer_text);
  if (a.have_fusion) append(a.described, sizeof a.described, " --fusion-bytes %zu", a.fusion_bytes);

  dpsync_options *options = make_options(&a, error, sizeof error);
  char *plan_text = options ? describe_text(plan_describe, options, "dpsync_plan_describe", error,
                                            sizeof error)
                            : NULL;
  if (!plan_text) {
    /* The options do not fit together (dpsync says why): a usage error. */
    dpsync_options_free(options);
    free(a.peer);
    bad_usage("%s", error);
  }
  json plan;
  if (!json_parse(plan_text, &plan)) {
    fprintf(stderr, "dpsync-info: dpsync_plan_describe wrote JSON this program cannot read\n");
    return 1;
  }

  /* --check: a context, as a program would create it. */
  int check_ok = 0;
  char *check_text = NULL;
  char check_error[4096] = "";
  if (a.check) {
    dpsync_context *ctx = NULL;
    dpsync_status s = dpsync_context_create(options, &ctx);
    if (s != DPSYNC_STATUS_OK) {
      failure(check_error, sizeof check_error, "dpsync_context_create", s);
    } else {
      check_text = describe_text(context_describe, ctx, "dpsync_describe", check_error,
                                 sizeof check_error);
      check_ok = check_text != NULL;
      dpsync_context_destroy(ctx);
    }
  }
  dpsync_options_free(options);

  if (a.json) {
    printf("{\n  \"version\": ");
    put_json_string(dpsync_version());
    printf(",\n  \"header_version\": ");
    put_json_string(header_version);
    printf(",\n  \"library\": ");
    put_json_string(self.path);
    printf(",\n  \"mpi\": %s,\n  \"libraries\": {\n", mpi_built_in ? "true" : "false");
    put_probe("cuda_driver", &driver, 0);
    put_probe("nvrtc", &nvrtc, 0);
    put_probe("nccl", &nccl, 0);
    put_probe("mpi", &mpi, 1);
    printf("  },\n  \"gpus\": [");
    for (int i = 0; i < g.count; i++) {
      printf("%s\n    {\"index\": %d, \"name\": ", i ? "," : "", i);
      put_json_string(g.name[i]);
      printf(", \"compute_capability\": \"%d.%d\", \"memory_bytes\": %zu, \"peer_access\": [",
             g.cc_major[i], g.cc_minor[i], g.memory[i]);
      for (int j = 0; j < g.count; j++) printf("%s%d", j ? ", " : "", g.peer[i][j]);
      printf("]}");
    }
    printf("%s],\n", g.count ? "\n  " : "");
    if (!g.count) {
      printf("  \"gpus_reason\": ");
      put_json_string(g.reason);
      printf(",\n");
    }
    printf("  \"options\": ");
    put_json_string(a.described);
    printf(",\n  \"plan\": %s", plan_text);
    if (a.check) {
      printf(",\n  \"check\": {\"ok\": %s, ", check_ok ? "true" : "false");
      if (check_ok) {
        printf("\"describe\": %s}", check_text);
      } else {
        printf("\"error\": ");
        put_json_string(check_error);
        printf("}");
      }
    }
    printf("\n}\n");
  } else {
    printf("dpsync %s\n", dpsync_version());
    printf("  library      %s\n", self.path[0] ? self.path : "(linked into this program)");
    printf("  header       %s%s\n", header_version,
           strcmp(header_version, dpsync_version()) == 0 ? "" : " (differs from the library)");
    printf("  MPI worlds   %s\n", mpi_built_in ? "built in" : "not built in");
    printf("\nrun-time libraries (found as dpsync finds them; docs/API.md, \"CUDA libraries\")\n");
    print_probe("CUDA driver", &driver);
    print_probe("NVRTC", &nvrtc);
    print_probe("NCCL", &nccl);
    print_probe("MPI", &mpi);
    print_gpus(&g);
    print_plan(&plan, a.described);
    if (a.check) {
      printf("\ncheck: dpsync_context_create with %s\n", a.described);
      json d;
      if (check_ok && json_parse(check_text, &d)) {
        print_check(&d);
        json_free(&d);
      } else {
        printf("  %-19s %s\n", "failed", check_error[0] ? check_error : "unreadable JSON");
      }
    }
  }
  json_free(&plan);
  free(plan_text);
  free(check_text);
  free(a.peer);
  return a.check && !check_ok ? 1 : 0;
}
