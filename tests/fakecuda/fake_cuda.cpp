// A stand-in for libcuda.so.1 that runs on the CPU, so that the GPU tests (tests/cuda*.rs) can
// drive the whole CUDA backend — contexts, streams, events, memory, peer copies, pointer
// attributes, kernel launches — on a machine without a GPU. Built and used by
// scripts/fake-cuda.sh; never shipped.
//
// By default everything is synchronous: a launch or copy is complete when the call returns, so
// stream and event ordering are trivially satisfied, and tests of asynchrony skip.
//
// FAKE_CUDA_ASYNC=1 makes streams asynchronous, as on a GPU: every stream (and each device's
// legacy default stream) is a worker thread that runs its queue in order after a random pause of
// up to 100 µs, so work on different streams interleaves differently from run to run
// (FAKE_CUDA_SEED=n fixes the pauses, though not the OS's scheduling). Events
// complete when their stream reaches them, cuStreamWaitEvent queues a wait, cuEventQuery says
// CUDA_ERROR_NOT_READY until then. The rules a caller can get wrong are the driver's: kernels and
// copies between device (or pinned) memory run later, with their arguments copied at the call;
// a copy from pageable host memory is staged at the call; a copy to pageable host memory returns
// when done; the legacy default stream waits for, and is waited for by, the device's blocking
// streams (not by CU_STREAM_NON_BLOCKING ones); cuMemFree waits for the device's streams, then
// poisons the memory. So a missing event wait shows up as wrong values, which the synchronous
// mode can never show. It still proves nothing about the hardware, NCCL's transports or speed.
//
// "Device memory" is host memory that the driver remembers, so cuPointerGetAttribute can tell it
// from host memory. Kernels are found by name among those compiled in: dpsync's (kernels/*.cu
// under kernels/emulate.hpp) and the tests'. FAKE_CUDA_DEVICES sets the device count (default 1,
// at most 8). FAKE_CUDA_PEER sets which devices can access each other: unset, every pair of
// distinct devices; "0", none; a list of pairs such as "1-2,0-3", exactly those pairs (both ways).
// FAKE_CUDA_PEER_LIMIT=n: cuCtxEnablePeerAccess enables at most n peers per device, then answers
// CUDA_ERROR_TOO_MANY_PEERS, as hardware with a peer limit does.
//
// In both modes the fake enforces the driver's context rules for several devices, as the CUDA
// programming guide states them (wrong results would not reveal a breach): an event is recorded only
// on a stream of its own context; a kernel launches only from a module loaded in the current
// context, on a stream of that context; allocations, events, default streams and
// cuCtxSynchronize need a current context; peer access is enabled only where
// cuDeviceCanAccessPeer allows it, and enabling it twice is CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
// a kernel's pointer arguments are its own device's memory, a peer's whose access its context
// enabled, or page-locked host memory, aligned to their element type (on a GPU anything else
// faults). A breach returns the driver's error and names the rule on stderr. Not checked:
// pointers a kernel reads out of a table in memory (the emulator dereferences whatever it is
// given).
//
// fake_cuda_fault(code), called by a test, makes every later call that touches the device
// (launches, copies, events, waits, synchronisation, allocation) return `code`, as a device
// fault does on a GPU; fake_cuda_fault(0) clears it.
//
// FAKE_CUDA_NOEXEC=1 skips the work itself (kernels, copies, memsets), so that a benchmark on
// the fake measures dpsync's own host-side cost of issuing work; FAKE_CUDA_STATS=1 prints, at
// exit, how many driver calls of each kind were made (benches/cuda_allreduce.rs --issue).
//
// The fake NCCL (fake_nccl.cpp, libnccl.so.2) checks its callers' buffers, streams and contexts
// through the fake_cuda_* functions at the end, and queues its ops on the streams with
// fake_cuda_enqueue.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct FakeCtx { int device; };
typedef FakeCtx* CUcontext;
namespace { struct Queue; }
struct FakeStream { CUcontext ctx; Queue* queue; };  // queue: FAKE_CUDA_ASYNC only
typedef FakeStream* CUstream;
// Where the event was last recorded (FAKE_CUDA_ASYNC): complete once `queue` ran `seq` tasks.
struct FakeEvent {
  CUcontext ctx;  // the current context at cuEventCreate
  Queue* queue = nullptr;
  unsigned long long seq = 0;
  std::shared_ptr<std::atomic<double>> ms = std::make_shared<std::atomic<double>>(0.0);
};
typedef FakeEvent* CUevent;
// A module is loaded into the current context; its functions launch only from that context.
struct FakeFunction { const void* kernel; CUcontext ctx; };
struct FakeModule { CUcontext ctx; std::map<std::string, FakeFunction> functions; };
typedef FakeModule* CUmodule;
typedef FakeFunction* CUfunction;

enum : int {
  OK = 0, INVALID_VALUE = 1, INVALID_DEVICE = 101, INVALID_CONTEXT = 201, PEER_UNSUPPORTED = 217,
  INVALID_HANDLE = 400, NOT_FOUND = 500, NOT_READY = 600, ILLEGAL_ADDRESS = 700, PEER_ALREADY = 704,
  TOO_MANY_PEERS = 711
};
// A sticky device fault, set by a test through fake_cuda_fault (a kernel that faulted on a GPU
// leaves its context unusable: every later call that touches the device returns that error).
std::atomic<int> sticky_fault{0};

#include "fake_cuda_state.hpp"

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
CUresult cuCtxSynchronize() {
  if (int fault = sticky_fault.load()) return fault;
  if (!current) return misuse(INVALID_CONTEXT, "cuCtxSynchronize", "no current context");
  counts.syncs++;
  if (async_mode) drain(current->device);
  return OK;
}
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags) {
  if (!current) return misuse(INVALID_CONTEXT, "cuCtxEnablePeerAccess", "no current context");
  if (flags) return misuse(INVALID_VALUE, "cuCtxEnablePeerAccess", "flags must be 0");
  if (!peer || peer->device == current->device)
    return misuse(INVALID_DEVICE, "cuCtxEnablePeerAccess", "the peer is the current device");
  if (!peer_access(current->device, peer->device))
    return misuse(PEER_UNSUPPORTED, "cuCtxEnablePeerAccess",
                  "cuDeviceCanAccessPeer says this pair has no peer access");
  std::lock_guard<std::mutex> g(lock);
  if (enabled_peers.count({current->device, peer->device})) return PEER_ALREADY;
  // FAKE_CUDA_PEER_LIMIT=n: a device enables at most n peers (the hardware's limit).
  if (const char* v = std::getenv("FAKE_CUDA_PEER_LIMIT")) {
    long mine = std::count_if(enabled_peers.begin(), enabled_peers.end(),
                              [&](const std::pair<int, int>& e) { return e.first == current->device; });
    if (mine >= std::atol(v)) return TOO_MANY_PEERS;
  }
  enabled_peers.insert({current->device, peer->device});
  return OK;
}

CUresult cuStreamCreate(CUstream* s, unsigned flags) {
  if (!current) return INVALID_CONTEXT;
  Queue* q = nullptr;
  if (async_mode) {
    std::lock_guard<std::mutex> g(streams_lock);
    q = new Queue(current->device, false, !(flags & 1), seeds++);  // 1: CU_STREAM_NON_BLOCKING
    live_queues.push_back(q);
  }
  *s = new FakeStream{current, q};
  return OK;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned f, int) { return cuStreamCreate(s, f); }
CUresult cuStreamDestroy_v2(CUstream s) {
  if (Queue* q = s->queue) {
    {
      std::lock_guard<std::mutex> g(streams_lock);
      live_queues.erase(std::find(live_queues.begin(), live_queues.end(), q));
    }
    q->retire();
  }
  delete s;
  return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
  if (int fault = sticky_fault.load()) return fault;
  counts.syncs++;
  if (async_mode) {
    Queue* q = queue_of(s);
    q->wait(q->queued());
  }
  return OK;
}
// Waits per waiting stream, for tests of which streams are made to wait.
std::map<uintptr_t, long> waits_by_stream;
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
  if (int fault = sticky_fault.load()) return fault;
  // An event of another device is fine (the programming guide); a default stream needs a context.
  if (!context_of(s)) return misuse(INVALID_CONTEXT, "cuStreamWaitEvent", "a default stream with no current context");
  counts.waits++;
  {
    std::lock_guard<std::mutex> g(lock);
    waits_by_stream[(uintptr_t)s]++;
  }
  // The event as recorded now: a later record does not change what this wait waits for.
  if (Queue* on = e->queue; on && !on->reached(e->seq))
    submit(queue_of(s), [on, seq = e->seq] { on->wait(seq); });
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

CUresult cuEventCreate(CUevent* e, unsigned) {
  if (!current) return misuse(INVALID_CONTEXT, "cuEventCreate", "no current context");
  *e = new FakeEvent{current};
  return OK;
}
CUresult cuEventDestroy_v2(CUevent e) { delete e; return OK; }
CUresult cuEventRecord(CUevent e, CUstream s) {
  if (int fault = sticky_fault.load()) return fault;
  CUcontext on = context_of(s);
  if (!on) return misuse(INVALID_CONTEXT, "cuEventRecord", "a default stream with no current context");
  if (on != e->ctx)
    return misuse(INVALID_HANDLE, "cuEventRecord", "the event and the stream belong to different devices");
  counts.records++;
  if (!async_mode) {
    *e->ms = now_ms();
    return OK;
  }
  Queue* q = queue_of(s);
  e->seq = submit(q, [ms = e->ms] { *ms = now_ms(); });
  e->queue = q;
  return OK;
}
bool complete(CUevent e) { return !e->queue || e->queue->reached(e->seq); }
CUresult cuEventQuery(CUevent e) {
  if (int fault = sticky_fault.load()) return fault;
  counts.queries++;
  return complete(e) ? OK : NOT_READY;
}
CUresult cuEventSynchronize(CUevent e) {
  if (int fault = sticky_fault.load()) return fault;
  counts.syncs++;
  if (e->queue) e->queue->wait(e->seq);
  return OK;
}
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
  if (a->ctx != b->ctx)
    return misuse(INVALID_HANDLE, "cuEventElapsedTime", "the events belong to different devices");
  if (!complete(a) || !complete(b)) return NOT_READY;
  *ms = float(b->ms->load() - a->ms->load());
  return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

// Allocations made by this thread, for tests (other tests may run on other threads).
thread_local long thread_allocs = 0;
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  if (int fault = sticky_fault.load()) return fault;
  counts.allocs++;
  thread_allocs++;
  return remember((void**)p, n, true);
}
// cuMemFree waits for the device's work (the driver's implicit synchronisation), no other's.
CUresult cuMemFree_v2(CUdeviceptr p) {
  if (int fault = sticky_fault.load()) return fault;
  counts.frees++;
  if (async_mode) drain(std::max(device_of_memory((void*)p), 0));
  return forget((void*)p);
}
// Page-locked allocations made by this thread, for tests.
thread_local long thread_host_allocs = 0;
CUresult cuMemAllocHost_v2(void** p, size_t n) {
  thread_host_allocs++;
  return remember(p, n, false);
}
CUresult cuMemFreeHost(void* p) {
  if (async_mode) drain(-1);
  return forget(p);
}
CUresult memset_on(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
  if (int fault = sticky_fault.load()) return fault;
  counts.memsets++;
  if (noexec) return OK;
  if (async_mode) submit(queue_of(s), [p, v, n] { std::memset((void*)p, v, n); });
  else std::memset((void*)p, v, n);
  return OK;
}
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { return memset_on(p, v, n, nullptr); }
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) { return memset_on(p, v, n, s); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return copy_bytes(d, s, n, st); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { return copy_now(d, (CUdeviceptr)s, n); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, CUstream st) {
  return copy_bytes(d, (CUdeviceptr)s, n, st);
}
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { return copy_now((CUdeviceptr)d, s, n); }
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, CUstream st) {
  return copy_bytes((CUdeviceptr)d, s, n, st);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_now(d, s, n); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  return copy_bytes(d, s, n, st);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext, CUdeviceptr s, CUcontext, size_t n, CUstream st) {
  return copy_bytes(d, s, n, st);
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
  switch (e) {
    case OK: *s = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case PEER_UNSUPPORTED: *s = "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"; break;
    case INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
    case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
    case NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
    case ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case PEER_ALREADY: *s = "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"; break;
    case TOO_MANY_PEERS: *s = "CUDA_ERROR_TOO_MANY_PEERS"; break;
    default: *s = "CUDA_ERROR_(fake driver)";
  }
  return OK;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == OK ? "no error" : "an error of the fake CUDA driver";
  return OK;
}

// Modules: the image is not executed; functions are the kernels compiled into this library.
const void* dpsync_emu_find(const char* name);
void dpsync_emu_launch(const void* kernel, unsigned grid, unsigned block, void** params);
CUresult cuModuleLoadData(CUmodule* m, const void*) {
  if (int fault = sticky_fault.load()) return fault;
  if (!current) return misuse(INVALID_CONTEXT, "cuModuleLoadData", "no current context");
  *m = new FakeModule{current, {}};
  return OK;
}
CUresult cuModuleUnload(CUmodule m) {
  delete m;
  return OK;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  const void* kernel = dpsync_emu_find(name);
  if (!kernel) return NOT_FOUND;
  std::lock_guard<std::mutex> g(lock);
  *f = &m->functions.emplace(name, FakeFunction{kernel, m->ctx}).first->second;
  return OK;
}
// A kernel may only dereference memory of its own device, of a peer whose access its context
// enabled (cuCtxEnablePeerAccess), or page-locked host memory, through pointers aligned to their
// element type; anything else faults on a GPU (CUDA_ERROR_ILLEGAL_ADDRESS, 700, or
// CUDA_ERROR_MISALIGNED_ADDRESS, 716) while the emulator would read it happily. Checked on the
// launch's pointer arguments (not on pointers stored inside tables in device memory).
static CUresult check_reach(CUfunction f, void** params) {
  const void* ptrs[16];
  unsigned align[16];
  int n = dpsync_emu_pointer_args(f->kernel, params, ptrs, align, 16);
  int here = current->device;
  std::lock_guard<std::mutex> g(lock);
  for (int i = 0; i < n; ++i) {
    if (!ptrs[i]) continue;
    if ((uintptr_t)ptrs[i] % align[i])
      return misuse(716, "cuLaunchKernel", "a pointer argument is not aligned to its element type");
    uintptr_t base = 0;
    const Alloc* a = find((uintptr_t)ptrs[i], &base);
    if (!a) return misuse(700, "cuLaunchKernel", "a pointer argument is neither device nor page-locked memory");
    if (a->device_memory && a->device != here && !enabled_peers.count({here, a->device}))
      return misuse(700, "cuLaunchKernel",
                    "a pointer argument is another device's memory and peer access to it is not enabled");
  }
  return OK;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned, unsigned, unsigned bx, unsigned,
                        unsigned, unsigned, CUstream s, void** params, void**) {
  if (int fault = sticky_fault.load()) return fault;
  if (!current) return misuse(INVALID_CONTEXT, "cuLaunchKernel", "no current context");
  if (f->ctx != current)
    return misuse(INVALID_HANDLE, "cuLaunchKernel", "the function's module was loaded on another device");
  if (context_of(s) != current)
    return misuse(INVALID_HANDLE, "cuLaunchKernel", "the stream belongs to another device than the current context");
  if (CUresult r = check_reach(f, params)) return r;
  counts.launches++;
  if (noexec) return OK;
  if (async_mode) submit(queue_of(s), dpsync_emu_bind(f->kernel, gx, bx, params));
  else dpsync_emu_launch(f->kernel, gx, bx, params);
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
// For tests: device (cuMemAlloc) and page-locked (cuMemAllocHost) allocations made by the
// calling thread so far, to assert that steady-state steps make none while other tests run on
// other threads.
long fake_cuda_allocations() { return thread_allocs; }
long fake_cuda_host_allocations() { return thread_host_allocs; }
// For tests: from now on every call that touches the device returns `code` (0 clears it).
void fake_cuda_fault(int code) { sticky_fault.store(code); }
// For tests: how often `s` was made to wait on an event (cuStreamWaitEvent).
long fake_cuda_waits_on(void* s) {
  std::lock_guard<std::mutex> g(lock);
  auto it = waits_by_stream.find((uintptr_t)s);
  return it == waits_by_stream.end() ? 0 : it->second;
}
// For the fake NCCL: whether streams are asynchronous (FAKE_CUDA_ASYNC=1), and queueing its ops
// on a stream (a default stream: `device`'s).
int fake_cuda_async() { return async_mode; }
void fake_cuda_enqueue(void* s, int device, void (*fn)(void*), void* arg) {
  submit(queue_of((CUstream)s, device), [fn, arg] { fn(arg); });
}
// The current context's device, or -1 when none is current.
int fake_cuda_current_device() { return current ? current->device : -1; }
// For the fake NCCL: what the CUDA runtime's cudaSetDevice(cudaGetDevice()) leaves current,
// as NCCL's group launch and its destroy and abort do: the primary context of the current
// context's device, or device 0's when none was current.
void fake_cuda_runtime_restore() { current = &primaries[current ? current->device : 0]; }
// The device of a stream's context; the default streams (0, 1, 2) are the current context's.
int fake_cuda_stream_device(void* s) {
  if ((uintptr_t)s <= 2) return fake_cuda_current_device();
  return ((CUstream)s)->ctx->device;
}
}
