// A stand-in for libcuda.so.1 that runs on the CPU, so that the GPU tests (tests/cuda*.rs) can
// drive the whole CUDA backend — contexts, streams, events, memory, peer copies, pointer
// attributes, kernel launches — on a machine without a GPU. Built and used by
// scripts/fake-cuda.sh; never shipped.
//
// Everything is synchronous: a launch or copy is complete when the call returns, so stream and
// event ordering are trivially satisfied. Tests that need real asynchrony (stream-order negative
// controls, timeouts) skip under it (DPSYNC_FAKE_CUDA=1). "Device memory" is host memory that the
// driver remembers, so cuPointerGetAttribute can tell it from host memory. Kernels are found by
// name among those compiled in: dpsync's (kernels/*.cu under kernels/emulate.hpp) and the tests'.
// FAKE_CUDA_DEVICES sets the device count (default 1, at most 8). FAKE_CUDA_PEER sets which
// devices can access each other: unset, every pair of distinct devices; "0", none; a list of
// pairs such as "1-2,0-3", exactly those pairs (both ways).
//
// FAKE_CUDA_NOEXEC=1 skips the work itself (kernels, copies, memsets), so that a benchmark on
// the fake measures dpsync's own host-side cost of issuing work; FAKE_CUDA_STATS=1 prints, at
// exit, how many driver calls of each kind were made (benches/cuda_allreduce.rs --issue).
//
// The fake NCCL (fake_nccl.cpp, libnccl.so.2) checks its callers' buffers, streams and contexts
// through the fake_cuda_* functions at the end.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct FakeCtx { int device; };
typedef FakeCtx* CUcontext;
struct FakeStream { CUcontext ctx; };
typedef FakeStream* CUstream;
struct FakeEvent { double ms = 0; };
typedef FakeEvent* CUevent;
typedef void* CUmodule;
typedef const void* CUfunction;

enum : int {
  OK = 0, INVALID_VALUE = 1, INVALID_DEVICE = 101, INVALID_CONTEXT = 201, NOT_FOUND = 500,
  PEER_ALREADY = 704
};

namespace {
int device_count() {
  const char* v = std::getenv("FAKE_CUDA_DEVICES");
  int n = v ? std::atoi(v) : 1;
  return n < 1 ? 1 : (n > 8 ? 8 : n);
}
FakeCtx primaries[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
thread_local CUcontext current = nullptr;

struct Alloc { size_t bytes; int device; bool device_memory; };
std::mutex lock;
std::map<uintptr_t, Alloc> allocs;

const Alloc* find(uintptr_t p, uintptr_t* base) {
  auto it = allocs.upper_bound(p);
  if (it == allocs.begin()) return nullptr;
  --it;
  if (p >= it->first + (it->second.bytes ? it->second.bytes : 1)) return nullptr;
  *base = it->first;
  return &it->second;
}

CUresult remember(void** out, size_t bytes, bool device_memory) {
  if (!current && device_memory) return INVALID_CONTEXT;
  void* p = std::aligned_alloc(256, ((bytes ? bytes : 1) + 255) / 256 * 256);
  if (!p) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  std::lock_guard<std::mutex> g(lock);
  allocs[(uintptr_t)p] = Alloc{bytes, current ? current->device : 0, device_memory};
  *out = p;
  return OK;
}

CUresult forget(void* p) {
  std::lock_guard<std::mutex> g(lock);
  auto it = allocs.find((uintptr_t)p);
  if (it == allocs.end()) return INVALID_VALUE;
  allocs.erase(it);
  std::free(p);
  return OK;
}

bool flag(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '1';
}
const bool noexec = flag("FAKE_CUDA_NOEXEC");

// Driver calls that queue work or order streams, counted for FAKE_CUDA_STATS.
struct Counts {
  std::atomic<long> launches{0}, copies{0}, memsets{0}, records{0}, waits{0}, queries{0};
  // Calls that block the host on a real GPU: device allocations and frees (cuMemFree waits for
  // the device) and explicit synchronisations.
  std::atomic<long> allocs{0}, frees{0}, syncs{0};
  ~Counts() {
    if (!flag("FAKE_CUDA_STATS")) return;
    std::fprintf(stderr,
                 "fake CUDA calls: %ld kernel launches, %ld copies, %ld memsets, %ld event "
                 "records, %ld stream waits, %ld event queries; %ld device allocations, %ld "
                 "frees, %ld host synchronisations\n",
                 launches.load(), copies.load(), memsets.load(), records.load(), waits.load(),
                 queries.load(), allocs.load(), frees.load(), syncs.load());
  }
} counts;

CUresult copy_bytes(CUdeviceptr d, CUdeviceptr s, size_t n) {
  counts.copies++;
  if (!noexec) std::memmove((void*)d, (void*)s, n);
  return OK;
}

// FAKE_CUDA_PEER (see the top); a malformed list aborts, so a test never runs on a wrong matrix.
bool peer_access(int a, int b) {
  const char* v = std::getenv("FAKE_CUDA_PEER");
  if (a == b) return false;
  if (!v || !std::strchr(v, '-')) return !(v && v[0] == '0');
  for (const char* p = v;;) {
    int x, y, used = 0;
    if (std::sscanf(p, "%d-%d%n", &x, &y, &used) != 2 || (p[used] && p[used] != ',')) {
      std::fprintf(stderr, "fake CUDA: FAKE_CUDA_PEER=%s: expected 0 or pairs like 1-2,0-3\n", v);
      std::abort();
    }
    if ((x == a && y == b) || (x == b && y == a)) return true;
    if (!p[used]) return false;
    p += used + 1;
  }
}

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}
}  // namespace

extern "C" {
CUresult cuInit(unsigned) { return OK; }
// NVRTC opens libcuda.so.1 itself and asks for the driver's private tables: none here.
CUresult cuGetExportTable(const void** table, const void*) {
  *table = nullptr;
  return 801;  // CUDA_ERROR_NOT_SUPPORTED
}
CUresult cuDriverGetVersion(int* v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = device_count(); return OK; }
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
  *d = ordinal;
  return OK;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  std::snprintf(name, len, "dpsync fake CUDA device %d (CPU)", d);
  return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
  switch (attribute) {
    case 75: *v = 9; break;   // compute capability major
    case 76: *v = 0; break;   // minor
    case 16: *v = 2; break;   // multiprocessors: small grids keep the emulation fast
    default: *v = 0;          // memory pools and everything else: not supported
  }
  return OK;
}
CUresult cuDeviceCanAccessPeer(int* can, CUdevice a, CUdevice b) {
  *can = peer_access(a, b);
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) { *c = &primaries[d]; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
CUresult cuCtxGetCurrent(CUcontext* c) { *c = current; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return OK; }
CUresult cuCtxSynchronize() { counts.syncs++; return OK; }
CUresult cuCtxEnablePeerAccess(CUcontext, unsigned) { return OK; }

CUresult cuStreamCreate(CUstream* s, unsigned) {
  if (!current) return INVALID_CONTEXT;
  *s = new FakeStream{current};
  return OK;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned f, int) { return cuStreamCreate(s, f); }
CUresult cuStreamDestroy_v2(CUstream s) { delete s; return OK; }
CUresult cuStreamSynchronize(CUstream) { counts.syncs++; return OK; }
// Waits per waiting stream, for tests of which streams are made to wait.
std::map<uintptr_t, long> waits_by_stream;
CUresult cuStreamWaitEvent(CUstream s, CUevent, unsigned) {
  counts.waits++;
  std::lock_guard<std::mutex> g(lock);
  waits_by_stream[(uintptr_t)s]++;
  return OK;
}
CUresult cuStreamGetCtx(CUstream s, CUcontext* c) {
  // The legacy (0) and per-thread (2) default streams belong to the current context.
  if ((uintptr_t)s <= 2) {
    if (!current) return INVALID_CONTEXT;
    *c = current;
  } else {
    *c = s->ctx;
  }
  return OK;
}

CUresult cuEventCreate(CUevent* e, unsigned) { *e = new FakeEvent; return OK; }
CUresult cuEventDestroy_v2(CUevent e) { delete e; return OK; }
CUresult cuEventRecord(CUevent e, CUstream) { counts.records++; e->ms = now_ms(); return OK; }
CUresult cuEventQuery(CUevent) { counts.queries++; return OK; }
CUresult cuEventSynchronize(CUevent) { counts.syncs++; return OK; }
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) { *ms = float(b->ms - a->ms); return OK; }
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  counts.allocs++;
  return remember((void**)p, n, true);
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  counts.frees++;
  return forget((void*)p);
}
CUresult cuMemAllocHost_v2(void** p, size_t n) { return remember(p, n, false); }
CUresult cuMemFreeHost(void* p) { return forget(p); }
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
  counts.memsets++;
  if (!noexec) std::memset((void*)p, v, n);
  return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream) { return cuMemsetD8_v2(p, v, n); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) { return copy_bytes(d, s, n); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { return copy_bytes(d, (CUdeviceptr)s, n); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, CUstream) { return cuMemcpyHtoD_v2(d, s, n); }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { return copy_bytes((CUdeviceptr)d, s, n); }
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, CUstream) { return cuMemcpyDtoH_v2(d, s, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_bytes(d, s, n); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) { return copy_bytes(d, s, n); }
CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext, CUdeviceptr s, CUcontext, size_t n, CUstream) {
  return copy_bytes(d, s, n);
}

CUresult cuPointerGetAttribute(void* out, int attribute, CUdeviceptr p) {
  std::lock_guard<std::mutex> g(lock);
  uintptr_t base = 0;
  const Alloc* a = find((uintptr_t)p, &base);
  if (!a) return INVALID_VALUE;  // memory the driver does not know: pageable host memory
  switch (attribute) {
    case 1: *(CUcontext*)out = &primaries[a->device]; break;          // context
    case 2: *(unsigned*)out = a->device_memory ? 2u : 1u; break;      // memory type
    case 8: *(unsigned*)out = 0; break;                               // is managed
    case 9: *(int*)out = a->device; break;                            // device ordinal
    default: return INVALID_VALUE;
  }
  return OK;
}

CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = e == OK ? "CUDA_SUCCESS" : "CUDA_ERROR_(fake driver)";
  return OK;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == OK ? "no error" : "an error of the fake CUDA driver";
  return OK;
}

// Modules: the image is not executed; functions are the kernels compiled into this library.
const void* dpsync_emu_find(const char* name);
void dpsync_emu_launch(const void* kernel, unsigned grid, unsigned block, void** params);
CUresult cuModuleLoadData(CUmodule* m, const void*) { static int module; *m = &module; return OK; }
CUresult cuModuleUnload(CUmodule) { return OK; }
CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
  *f = dpsync_emu_find(name);
  return *f ? OK : NOT_FOUND;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned, unsigned, unsigned bx, unsigned,
                        unsigned, unsigned, CUstream, void** params, void**) {
  counts.launches++;
  if (!noexec) dpsync_emu_launch(f, gx, bx, params);
  return OK;
}

// For the fake NCCL. The device whose allocation holds all of [p, p + bytes), or -1 (host or
// unknown memory, or past the allocation's end).
int fake_cuda_device_of(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> g(lock);
  uintptr_t base = 0;
  const Alloc* a = find((uintptr_t)p, &base);
  if (!a || !a->device_memory || bytes > a->bytes || (uintptr_t)p - base > a->bytes - bytes) return -1;
  return a->device;
}
// For tests: device allocations so far (cuMemAlloc), to assert that steady-state steps make none.
long fake_cuda_allocations() { return counts.allocs.load(); }
// For tests: how often `s` was made to wait on an event (cuStreamWaitEvent).
long fake_cuda_waits_on(void* s) {
  std::lock_guard<std::mutex> g(lock);
  auto it = waits_by_stream.find((uintptr_t)s);
  return it == waits_by_stream.end() ? 0 : it->second;
}
// The current context's device, or -1 when none is current.
int fake_cuda_current_device() { return current ? current->device : -1; }
// The device of a stream's context; the default streams (0, 1, 2) are the current context's.
int fake_cuda_stream_device(void* s) {
  if ((uintptr_t)s <= 2) return fake_cuda_current_device();
  return ((CUstream)s)->ctx->device;
}
}
