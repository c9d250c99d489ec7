/* The few CUDA driver entry points the CUDA examples use, opened with dlopen so that they build
 * on machines without CUDA, and a probe that says whether dpsync can drive the requested GPUs
 * (the examples exit 77 — CTest's "skipped" — when not). */
#ifndef DPSYNC_EXAMPLE_CUDA_DRIVER_H
#define DPSYNC_EXAMPLE_CUDA_DRIVER_H

#include <dpsync.h>

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { CUDA_SKIP = 77 };

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(int *, int);
  CUresult (*device_count)(int *);
  CUresult (*primary_retain)(CUcontext *, int);
  CUresult (*set_current)(CUcontext);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*htod_async)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*dtoh_async)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*stream_create)(CUstream *, unsigned);
  CUresult (*stream_sync)(CUstream);
  CUresult (*stream_destroy)(CUstream);
} cu;

static inline int load_cuda(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) return 0;
#define SYM(field, name) *(void **)(&cu.field) = dlsym(lib, name); if (!cu.field) return 0
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(device_count, "cuDeviceGetCount");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(set_current, "cuCtxSetCurrent");
  SYM(mem_alloc, "cuMemAlloc_v2");
  SYM(mem_free, "cuMemFree_v2");
  SYM(htod_async, "cuMemcpyHtoDAsync_v2");
  SYM(dtoh_async, "cuMemcpyDtoHAsync_v2");
  SYM(stream_create, "cuStreamCreate");
  SYM(stream_sync, "cuStreamSynchronize");
  SYM(stream_destroy, "cuStreamDestroy_v2");
#undef SYM
  return cu.init(0) == 0;
}

#define CU(call)                                                                        \
  do {                                                                                  \
    CUresult r_ = (call);                                                               \
    if (r_ != 0) {                                                                      \
      fprintf(stderr, "%s:%d: %s failed: CUresult %d\n", __FILE__, __LINE__, #call, r_); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

/* Makes GPU `ordinal`'s primary context current on this thread. */
static inline void use_gpu(int32_t ordinal) {
  CUcontext c;
  int dev;
  CU(cu.device_get(&dev, ordinal));
  CU(cu.primary_retain(&c, dev));
  CU(cu.set_current(c));
}

/* Says why the run is skipped and returns 0 — or, under DPSYNC_REQUIRE_GPU=1 (the GPU
 * machine's check, scripts/gpu-check.sh), fails, so that a missing piece is not a pass. */
static inline int cuda_skip(const char *name, const char *why) {
  const char *require = getenv("DPSYNC_REQUIRE_GPU");
  if (require && strcmp(require, "1") == 0) {
    fprintf(stderr, "%s: DPSYNC_REQUIRE_GPU=1, but %s\n", name, why);
    exit(1);
  }
  printf("%s: skipped: %s\n", name, why);
  return 0;
}

/* 1 when the driver loads, the GPUs named exist and dpsync can make a context on `gpus`;
 * otherwise prints "<name>: skipped: <why>" and returns 0. */
static inline int cuda_usable(const char *name, const int32_t *gpus, size_t n) {
  if (!load_cuda()) return cuda_skip(name, "no CUDA driver");
  int count = 0;
  CU(cu.device_count(&count));
  for (size_t i = 0; i < n; i++) {
    if (gpus[i] >= count) {
      /* Not a failure: CTest names GPUs a one-GPU machine lacks (the multi-GPU runs). */
      printf("%s: skipped: needs GPU %d, found %d GPU(s)\n", name, (int)gpus[i], count);
      return 0;
    }
  }
  dpsync_options *probe = NULL;
  dpsync_context *ctx = NULL;
  if (dpsync_options_new(&probe) != DPSYNC_STATUS_OK ||
      dpsync_options_set_cuda_replicas(probe, gpus, n) != DPSYNC_STATUS_OK) {
    fprintf(stderr, "%s: options: %s\n", name, dpsync_last_error());
    exit(1);
  }
  dpsync_status st = dpsync_context_create(probe, &ctx);
  dpsync_options_free(probe);
  if (st == DPSYNC_STATUS_UNAVAILABLE) return cuda_skip(name, dpsync_last_error());
  if (st != DPSYNC_STATUS_OK) {
    fprintf(stderr, "%s: dpsync_context_create: %s\n", name, dpsync_last_error());
    exit(1);
  }
  dpsync_context_destroy(ctx);
  return 1;
}

/* "0,0,1" into `gpus` (at most `max`); the count, or 0 for a bad list. */
static inline size_t parse_gpus(char *text, int32_t *gpus, size_t max) {
  size_t n = 0;
  for (char *p = strtok(text, ","); p; p = strtok(NULL, ",")) {
    char *end = NULL;
    long v = strtol(p, &end, 10);
    if (n == max || *end != '\0' || v < 0 || v > INT32_MAX) return 0;
    gpus[n++] = (int32_t)v;
  }
  return n;
}

/* "auto" | "nccl" | "peer_copy" as a transport; 0 with *ok = 0 for anything else. */
static inline uint32_t parse_transport(const char *text, int *ok) {
  *ok = 1;
  if (!strcmp(text, "nccl")) return DPSYNC_TRANSPORT_NCCL;
  if (!strcmp(text, "peer_copy")) return DPSYNC_TRANSPORT_PEER_COPY;
  if (!strcmp(text, "auto")) return DPSYNC_TRANSPORT_AUTO;
  *ok = 0;
  return 0;
}

#endif
