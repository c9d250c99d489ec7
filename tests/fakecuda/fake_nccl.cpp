// A stand-in for libnccl.so.2 that runs on the CPU beside the fake CUDA driver (fake_cuda.cpp),
// so that dpsync's NCCL transport (src/backend/cuda/nccl.rs) — communicators made in a group,
// non-blocking polling, allreduce, broadcast, reduce-scatter, allgather, send/recv, timeouts and
// aborts — can be tested on a machine without a GPU. Built by scripts/fake-cuda.sh into target/fakecuda/libnccl.so.2; never
// shipped.
//
// It is stricter than real NCCL where real NCCL would hang or corrupt memory, so caller bugs are
// loud: the ops of one group are matched per clique (the communicators of one unique id) when the
// outermost ncclGroupEnd runs; a rank missing, a different kind/count/dtype/op/root, an unpaired
// send or recv (or a recv whose count or dtype differs from its send's) fails that clique with ncclInvalidUsage and a last-error text that names it. Every
// buffer must lie in fake device memory on the communicator's device (a reduce-scatter's send
// buffer and an allgather's recv buffer hold a block per rank), the two buffers of a
// reduce-scatter or an allgather must be apart or in place (the smaller is the rank's own block
// of the larger), and the stream and the current context must be that device's. A reduce-scatter
// sums each block in the ring's order (from the rank after the block's round to it), not the
// allreduce's rank order, as NCCL's orders differ. fake_nccl_sent_bytes and fake_nccl_calls count
// what this process's ranks sent (a ring algorithm's share) and called, by kind. A destroyed or aborted communicator used again aborts
// the process (a use-after-free in real NCCL); they are kept as tombstones, never freed.
//
// What it cannot prove: anything about real NCCL's transports or speed. Ops run synchronously,
// in the calling thread, at group end — or, under the fake driver's FAKE_CUDA_ASYNC=1, on their
// streams once every rank's stream reaches them (a deadlock there aborts after 60 s). Ranks of
// one process are matched inside one thread's group (one thread driving every rank, as dpsync
// does), so one-thread-per-rank use does not work here.
//
// Across processes (a world: each process initialises only its own ranks of a unique id made by
// one of them and sent by MPI): a clique still missing ranks when its init group ends spans
// processes. Its ranks meet in shared memory (/dev/shm/fake-nccl-<id>: a slot per rank with the
// op it posted, and a data file per rank); its non-blocking communicators report ncclInProgress
// until every rank joined. Each collective is a numbered round: every rank writes its op and
// data, waits for all the others', checks that they match (kind, count, dtype, op or root; a
// difference fails the round on every process with ncclInvalidUsage naming both ranks), and
// computes the result itself in rank order, so every process writes the same bytes. A rank
// aborted or destroyed in another process, or whose process ended (killed: its slot keeps its pid),
// fails the others' rounds with ncclRemoteError; a round
// that waits 60 s for a rank aborts the process (a hang in real NCCL). A group's sends and
// receives on a clique across processes, where one has a peer in another process, form one more
// round that every rank joins (those among one process's ranks run there, as in one process) (p2p_across:
// each rank posts its list of sends and recvs with the sends' data; every process checks every
// link's pairing, count and dtype, so all fail alike; a rank of the clique that posts none is a
// hang, as a send without its recv is in real NCCL). Without FAKE_CUDA_ASYNC a round runs inside the
// call that queues it and waits there for the other processes, so a process cannot queue a
// collective ahead of the others and go on (real NCCL can); with it, rounds run on the streams. Each process's fake GPUs are distinct devices, so
// no duplicate-GPU check spans processes.
// Non-blocking communicators (config->blocking == 0) report ncclInProgress from
// ncclCommGetAsyncError once after init and after every group that touched them, then success, so
// the callers' polling loops run; their ncclGroupEnd returns ncclInProgress, as real NCCL may.
//
// FAKE_NCCL_SETUP_MS=n: a non-blocking communicator stays in progress for n ms after its init
// and again after the first group that gives it ops, as real NCCL's setup and its lazy
// connection of the ranks (NCCL_RUNTIME_CONNECT) take seconds on a multi-GPU machine.
// FAKE_NCCL_FAULT, read whenever a group with ops runs (never at init): "hang" = the ops run but
// their communicators report ncclInProgress until aborted (a stuck collective); "error" = the ops
// do not run and the communicators report ncclSystemError ("fake NCCL: injected failure").
// FAKE_NCCL_INIT_FAULT=1: every communicator init fails with ncclSystemError.
// FAKE_NCCL_QUIET_PEERS=1: a rank whose process is gone is not reported (process_gone says how).
// ncclCommShrink (NCCL 2.27+) makes the survivors' child clique as an init of it (see there).
// Several ranks of a clique on one device are refused, as by NCCL, unless
// NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30; this fake reports 2.30.0).
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

enum : int {
  Success = 0, UnhandledCudaError = 1, SystemError = 2, InternalError = 3, InvalidArgument = 4,
  InvalidUsage = 5, RemoteError = 6, InProgress = 7
};
struct ncclUniqueId { char internal[128]; };
struct ConfigHead { size_t size; unsigned magic; unsigned version; int blocking; };  // ncclConfig_t

namespace {
const size_t type_size[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
const char* type_name[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64",
                           "float16", "float32", "float64", "bfloat16"};
const char* op_name[] = {"sum", "prod", "max", "min", "avg"};
// Collectives first, then the point-to-point kinds (kind >= Send).
enum Kind { AllReduce, Broadcast, ReduceScatter, AllGather, Send, Recv };
const char* kind_name[] = {"allreduce", "broadcast", "reducescatter", "allgather", "send", "recv"};

struct Clique;
struct Comm {
  Clique* clique;
  int rank, device;
  bool blocking;
  bool dead = false, finalized = false, hang = false, pending = false;
  bool shrunk_abort = false;  // ncclCommShrink with NCCL_SHRINK_ABORT ended its ops: only free it
  bool connected = false;  // its first group with ops ran (FAKE_NCCL_SETUP_MS)
  std::chrono::steady_clock::time_point busy_until{};
  int error = Success;
  std::string last;  // ncclGetLastError
};
struct Shared;
struct Clique {
  int nranks = 0;
  std::vector<Comm*> ranks;  // this process's ranks; null where another process has them
  std::string id;
  // Across processes (see the header): the shared slots, the data files, the rounds issued.
  Shared* shared = nullptr;
  std::string path;
  std::vector<int> files;
  uint64_t rounds = 0;
};
// An op as queued: arg is the reduction op, the broadcast root or the peer (0 for an
// allgather). count is per rank: a reduce-scatter's recvcount, an allgather's sendcount.
struct Op {
  Kind kind; Comm* comm; const void* send; void* recv; size_t count; int dtype, arg;
  void* stream = nullptr;
};

// FAKE_NCCL_SETUP_MS: `c` reports ncclInProgress for that long from now.
void setup_delay(Comm* c) {
  if (c->blocking) return;
  const char* v = std::getenv("FAKE_NCCL_SETUP_MS");
  if (v && std::atoi(v) > 0)
    c->busy_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::atoi(v));
}

// Real NCCL's group launch, destroy and abort set each rank's device through the CUDA runtime
// and restore the runtime's idea of the previous one, which can change the calling thread's
// current context (fake_cuda_runtime_restore says how): callers must keep their own.
void runtime_restore();

std::mutex mu;  // guards everything below; every entry point takes it
std::map<std::string, Clique*> cliques;  // by unique id; like the comms, never freed
std::set<Comm*> comms;                   // every comm ever made, to recognise handles
std::string last_global;                 // ncclGetLastError(NULL)
unsigned long long ids_issued = 0;

// The calling thread's group: ops and touched comms wait for the outermost ncclGroupEnd.
struct Group {
  std::vector<Op> ops;
  std::vector<Comm*> touched;
  std::map<Clique*, std::string> broken;  // cliques with a failed call in this group
  int code = Success;                     // the first failed init's code
};
thread_local int depth = 0;
thread_local Group group;

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

int fail(Comm* c, int code, const std::string& text) {
  last_global = text;
  if (c) c->last = text;
  if (c && code == InvalidUsage && c->error == Success) c->error = code;
  return code;
}

// The handle, unless it is not live: using a destroyed one is a use-after-free in real NCCL.
Comm* live(void* handle) {
  auto* c = static_cast<Comm*>(handle);
  if (!comms.count(c)) std::fprintf(stderr, "fake NCCL: %p is not a communicator\n", handle);
  else if (c->dead) std::fprintf(stderr, "fake NCCL: use of a destroyed or aborted communicator\n");
  else return c;
  std::abort();
}

// The fake driver's helpers. cudarc opens libcuda.so.1 RTLD_LOCAL, so the global lookup misses
// them; then ask the copy already loaded (RTLD_NOLOAD never loads another one).
struct Cuda {
  int (*device_of)(const void*, size_t);
  int (*current_device)();
  int (*stream_device)(void*);
  int (*async)();
  void (*enqueue)(void*, int, void (*)(void*), void*);
  void (*runtime_restore)();
};
void* cuda_sym(const char* name) {
  if (void* p = dlsym(RTLD_DEFAULT, name)) return p;
  for (const char* lib : {"libcuda.so.1", "libcuda.so"})
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD))
      if (void* p = dlsym(h, name)) return p;  // the handle stays open: p must stay valid
  return nullptr;
}
const Cuda* cuda(Comm* c);
void runtime_restore() {
  if (const Cuda* cu = cuda(nullptr)) cu->runtime_restore();
}
const Cuda* cuda(Comm* c) {
  static Cuda api{};
  if (!api.device_of) {
    Cuda got{(int (*)(const void*, size_t))cuda_sym("fake_cuda_device_of"),
             (int (*)())cuda_sym("fake_cuda_current_device"),
             (int (*)(void*))cuda_sym("fake_cuda_stream_device"),
             (int (*)())cuda_sym("fake_cuda_async"),
             (void (*)(void*, int, void (*)(void*), void*))cuda_sym("fake_cuda_enqueue"),
             (void (*)())cuda_sym("fake_cuda_runtime_restore")};
    if (!got.device_of || !got.current_device || !got.stream_device || !got.async || !got.enqueue ||
        !got.runtime_restore) {
      fail(c, UnhandledCudaError,
           "fake NCCL: the fake CUDA driver's fake_cuda_* helpers were not found; load "
           "target/fakecuda/libcuda.so.1 before using the fake NCCL");
      return nullptr;
    }
    api = got;
  }
  return &api;
}

#include "fake_nccl_math.hpp"

size_t bytes(const Op& o) { return o.count * type_size[o.dtype]; }
// The bytes an op's send and recv buffers span, in a clique of n.
size_t send_bytes(const Op& o, int n) { return o.kind == ReduceScatter ? n * bytes(o) : bytes(o); }
size_t recv_bytes(const Op& o, int n) { return o.kind == AllGather ? n * bytes(o) : bytes(o); }
bool reduces(int kind) { return kind == AllReduce || kind == ReduceScatter; }

// Test aid: what this process's ranks sent, by kind, in the ops that ran (fake_nccl_sent_bytes).
std::atomic<uint64_t> sent[6], calls[6];

// Rank `rank`'s part of a collective that ran: the bytes a ring algorithm has it send (an
// allreduce 2 (n-1)/n of the buffer, a broadcast (n-1)/n, a reduce-scatter and an allgather
// (n-1) blocks: half an allreduce each), counted as sent.
void count_sent(const Op& o, int n) {
  uint64_t b = bytes(o), m = uint64_t(n - 1);
  uint64_t by[] = {2 * m * b / n, m * b / n, m * b, m * b, b, 0};
  sent[o.kind] += by[o.kind];
  calls[o.kind] += 1;
}

// Runs one matched collective of a clique of n: `srcs[r]` is rank r's send data (null where it
// is not needed), `outs` this process's ranks' ops. A reduce-scatter sums block r of every
// rank in the ring's order, from rank r + 1 round to r (NCCL's ring gives each block another
// order than its allreduce does); results are computed before any is written, so the in-place
// forms work.
void run(int n, const std::vector<const void*>& srcs, const std::vector<const Op*>& outs) {
  const Op& o = *outs[0];
  size_t b = bytes(o);
  for (const Op* x : outs) count_sent(*x, n);
  if (!b) return;
  if (o.kind == AllReduce) {
    std::vector<void*> to;
    for (const Op* x : outs) to.push_back(x->recv);
    return allreduce(o.dtype, srcs, to, o.count, o.arg);
  }
  std::vector<std::vector<char>> res;
  for (const Op* x : outs) {
    int r = x->comm->rank;
    if (o.kind == Broadcast) {
      const char* from = static_cast<const char*>(srcs[o.arg]);
      res.emplace_back(from, from + b);
    } else if (o.kind == AllGather) {
      res.emplace_back(n * b);
      for (int k = 0; k < n; k++) std::memcpy(res.back().data() + k * b, srcs[k], b);
    } else {  // ReduceScatter
      std::vector<const void*> ring;
      for (int k = 1; k <= n; k++) ring.push_back(static_cast<const char*>(srcs[(r + k) % n]) + r * b);
      res.emplace_back(b);
      allreduce(o.dtype, ring, {res.back().data()}, o.count, o.arg);
    }
  }
  for (size_t i = 0; i < outs.size(); i++) std::memcpy(outs[i]->recv, res[i].data(), res[i].size());
}

// --- checks at the call -------------------------------------------------------------------
// Whether the op may be queued; if not, the comm has the error code and text.
int check_op(const Op& o, void* stream) {
  Comm* c = o.comm;
  int n = c->clique->nranks;
  const char* what = kind_name[o.kind];
  if (c->finalized)
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s after ncclCommFinalize", c->rank, what));
  if (c->shrunk_abort)
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s after ncclCommShrink with "
                                     "NCCL_SHRINK_ABORT (only ncclCommAbort or ncclCommDestroy may "
                                     "follow)", c->rank, what));
  if (c->error != Success) return c->error;  // errors stick, as in real NCCL
  if (o.dtype < 0 || o.dtype > 9)
    return fail(c, InvalidArgument,
                fmt("fake NCCL: rank %d's %s: bad datatype %d", c->rank, what, o.dtype));
  if (reduces(o.kind) && (o.arg < 0 || o.arg > 4))
    return fail(c, InvalidArgument, fmt("fake NCCL: rank %d's %s: bad op %d", c->rank, what, o.arg));
  if (!reduces(o.kind) && o.kind != AllGather && (o.arg < 0 || o.arg >= n))
    return fail(c, InvalidArgument, fmt("fake NCCL: rank %d's %s: %s %d is not a rank of %d", c->rank,
                                        what, o.kind == Broadcast ? "root" : "peer", o.arg, n));
  if (o.count > SIZE_MAX / 8 / size_t(n))
    return fail(c, InvalidArgument, fmt("fake NCCL: rank %d's %s: count %zu", c->rank, what, o.count));
  const Cuda* cu = cuda(c);
  if (!cu) return UnhandledCudaError;
  auto dev = [](int d) { return d < 0 ? std::string("no context") : fmt("cuda:%d", d); };
  int cur = cu->current_device(), sd = cu->stream_device(stream);
  if (cur != c->device)
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s was called with %s current, but the "
                                     "communicator is on cuda:%d",
                                     c->rank, what, dev(cur).c_str(), c->device));
  if (sd != c->device)
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s was queued on a stream of %s, but the "
                                     "communicator is on cuda:%d",
                                     c->rank, what, dev(sd).c_str(), c->device));
  if (o.count == 0) return Success;  // no bytes: no buffer needed
  const void* bufs[] = {o.send, o.recv};
  size_t sizes[] = {send_bytes(o, n), recv_bytes(o, n)};
  for (int b = 0; b < 2; b++) {
    // A broadcast reads the send buffer on the root only.
    bool used = b == 0 ? o.kind != Recv && (o.kind != Broadcast || o.arg == c->rank) : o.kind != Send;
    if (!used || cu->device_of(bufs[b], sizes[b]) == c->device) continue;
    int at = cu->device_of(bufs[b], 1);
    std::string where = at < 0 ? "not in fake device memory"
                        : at == c->device ? "overrunning its allocation" : fmt("on cuda:%d", at);
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s %s buffer %p (%zu bytes) is %s; the "
                                     "communicator is on cuda:%d", c->rank, what, b ? "recv" : "send",
                                     bufs[b], sizes[b], where.c_str(), c->device));
  }
  // The two buffers of a reduce-scatter or an allgather are apart, or in place: the smaller one
  // is the rank's own block of the larger (NCCL leaves any other overlap undefined).
  if (o.kind == ReduceScatter || o.kind == AllGather) {
    const char *s = static_cast<const char*>(o.send), *r = static_cast<const char*>(o.recv);
    bool apart = s + sizes[0] <= r || r + sizes[1] <= s;
    bool in_place = o.kind == ReduceScatter ? r == s + c->rank * bytes(o) : s == r + c->rank * bytes(o);
    if (!apart && !in_place)
      return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s buffers overlap, but the %s buffer "
                                       "is not rank %d's block of the %s buffer (in place)", c->rank,
                                       what, o.kind == ReduceScatter ? "recv" : "send", c->rank,
                                       o.kind == ReduceScatter ? "send" : "recv"));
  }
  return Success;
}

std::string describe(const Op* o) {
  return fmt("%s of %zu %s (%s)", kind_name[o->kind], o->count, type_name[o->dtype],
             reduces(o->kind) ? op_name[o->arg]
             : o->kind == AllGather ? "per rank"
             : fmt("%s %d", o->kind == Broadcast ? "root" : "peer", o->arg).c_str());
}

#include "fake_nccl_across.hpp"
#include "fake_nccl_group.hpp"

// One op: queued in the open group, or run at once as a group of one.
int submit(const Op& o, void* stream) {
  std::lock_guard<std::mutex> guard(mu);
  if (!o.comm)
    return fail(nullptr, InvalidArgument,
                fmt("fake NCCL: %s on a null communicator", kind_name[o.kind]));
  live(o.comm);
  int rc = check_op(o, stream);
  if (rc == Success) {
    group.ops.push_back(o);
    group.ops.back().stream = stream;
  } else {
    group.broken.emplace(o.comm->clique, o.comm->last);
  }
  group.touched.push_back(o.comm);
  if (depth > 0) return rc;
  int end = run_group();
  return rc != Success ? rc : end;
}

ncclUniqueId new_id() {
  // The clock at this process's first id besides its pid: a process killed in a test leaves its
  // cliques' files in /dev/shm, and a later process given the same pid (pid_max is 32768 here)
  // would otherwise open them, stale rounds and all.
  static const unsigned long long born =
      (unsigned long long)std::chrono::system_clock::now().time_since_epoch().count();
  ncclUniqueId id{};
  std::snprintf(id.internal, sizeof id.internal, "fake NCCL unique id %d.%llu.%llx", int(getpid()),
                ++ids_issued, born);
  std::string key(id.internal, sizeof id.internal);
  cliques[key] = new Clique;
  cliques[key]->id = id.internal;
  return id;
}

// One rank joins its clique (device < 0: the current context's). Under the lock.
int init(void** out, int nranks, const ncclUniqueId& id, int rank, bool blocking, int device) {
  if (!out) return fail(nullptr, InvalidArgument, "fake NCCL: init with a null communicator pointer");
  // FAKE_NCCL_INIT_FAULT=1: NCCL loads but no communicator initialises (a broken network or
  // driver setup), which sends AUTO to peer copies.
  if (const char* f = std::getenv("FAKE_NCCL_INIT_FAULT"); f && std::string(f) == "1")
    return fail(nullptr, SystemError, "fake NCCL: injected init failure (FAKE_NCCL_INIT_FAULT=1)");
  std::string key(id.internal, sizeof id.internal);
  auto it = cliques.find(key);
  int maker = 0;
  if (it == cliques.end() && std::sscanf(id.internal, "fake NCCL unique id %d.", &maker) == 1 &&
      maker != int(getpid())) {
    // Made by another process and sent here (by MPI, say): this process's part of the clique.
    it = cliques.emplace(key, new Clique).first;
    it->second->id = std::string(id.internal, strnlen(id.internal, sizeof id.internal));
  }
  if (it == cliques.end())
    return fail(nullptr, InvalidArgument, "fake NCCL: the unique id was not made by ncclGetUniqueId");
  Clique* q = it->second;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(nullptr, InvalidArgument,
                fmt("fake NCCL: rank %d of %d is out of range", rank, nranks));
  if (!q->nranks) q->nranks = nranks, q->ranks.assign(nranks, nullptr);
  if (q->nranks != nranks)
    return fail(nullptr, InvalidArgument, fmt("fake NCCL: rank %d was initialised with nranks %d, but "
                                              "its unique id with %d", rank, nranks, q->nranks));
  if (q->ranks[rank])
    return fail(nullptr, InvalidArgument,
                fmt("fake NCCL: rank %d of %d was initialised twice", rank, nranks));
  if (device < 0) {
    const Cuda* cu = cuda(nullptr);
    if (!cu) return UnhandledCudaError;
    if ((device = cu->current_device()) < 0)
      return fail(nullptr, InvalidUsage, fmt("fake NCCL: rank %d of %d was initialised with no CUDA "
                                             "context current", rank, nranks));
  }
  Comm* c = new Comm{q, rank, device, blocking};
  setup_delay(c);
  comms.insert(c);
  q->ranks[rank] = c;
  if (q->shared) create_data_file(q, rank), q->shared->slot[rank].joined.store(1);  // a late one
  *out = c;
  group.touched.push_back(c);
  // Complete: real NCCL refuses two ranks on one GPU unless allowed (NCCL >= 2.30).
  const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  if (std::count(q->ranks.begin(), q->ranks.end(), nullptr) || (multi && !std::strcmp(multi, "1")))
    return Success;
  for (int a = 0; a < nranks; a++)
    for (int b = a + 1; b < nranks; b++) {
      if (q->ranks[a]->device != q->ranks[b]->device) continue;
      std::string why = fmt("fake NCCL: ranks %d and %d of %d are both on cuda:%d (duplicate GPU; "
                            "NCCL_MULTI_RANK_GPU_ENABLE=1 allows it)",
                            a, b, nranks, q->ranks[a]->device);
      for (Comm* x : q->ranks) x->error = InvalidUsage, x->last = why;
      return fail(nullptr, InvalidUsage, why);
    }
  return Success;
}

// Ends an init-like call: in a group its failure waits for ncclGroupEnd, else the group of one runs.
int finish(int rc) {
  if (depth > 0) {
    if (group.code == Success) group.code = rc;
    return rc;
  }
  int end = run_group();
  return rc != Success ? rc : end;
}

#include "fake_nccl_shrink.hpp"

template <class T> int comm_info(void* comm, T* out, T value_of(Comm*)) {
  std::lock_guard<std::mutex> guard(mu);
  if (!comm || !out) return fail(nullptr, InvalidArgument, "fake NCCL: null argument");
  *out = value_of(live(comm));
  return Success;
}
}  // namespace

extern "C" {
int ncclGetVersion(int* v) {
  if (!v) return InvalidArgument;
  *v = 23000;  // 2.30.0
  return Success;
}
const char* ncclGetErrorString(int code) {
  switch (code) {
    case Success: return "no error";
    case UnhandledCudaError: return "unhandled cuda error";
    case SystemError: return "unhandled system error";
    case InternalError: return "internal error";
    case InvalidArgument: return "invalid argument";
    case InvalidUsage: return "invalid usage";
    case RemoteError: return "remote process exited or there was a network error";
    case InProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
const char* ncclGetLastError(void* comm) {
  std::lock_guard<std::mutex> guard(mu);
  return comm ? live(comm)->last.c_str() : last_global.c_str();
}
int ncclGetUniqueId(ncclUniqueId* id) {
  std::lock_guard<std::mutex> guard(mu);
  if (!id) return fail(nullptr, InvalidArgument, "fake NCCL: ncclGetUniqueId(NULL)");
  *id = new_id();
  return Success;
}
int ncclCommInitRankConfig(void** comm, int nranks, ncclUniqueId id, int rank,
                           const ConfigHead* config) {
  std::lock_guard<std::mutex> guard(mu);
  if (config && config->magic != 0xcafebeef)
    return finish(fail(nullptr, InvalidArgument, "fake NCCL: the ncclConfig_t was not made with "
                                                 "NCCL_CONFIG_INITIALIZER"));
  return finish(init(comm, nranks, id, rank, !config || config->blocking != 0, -1));
}
int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
  std::lock_guard<std::mutex> guard(mu);
  return finish(init(comm, nranks, id, rank, true, -1));
}
int ncclCommInitAll(void** comm, int ndev, const int* devlist) {
  std::lock_guard<std::mutex> guard(mu);
  if (!comm || ndev < 1)
    return finish(fail(nullptr, InvalidArgument, "fake NCCL: ncclCommInitAll: no devices"));
  ncclUniqueId id = new_id();
  int rc = Success;
  for (int i = 0; i < ndev && rc == Success; i++)
    rc = init(&comm[i], ndev, id, i, true, devlist ? devlist[i] : i);
  return finish(rc);
}
int ncclCommFinalize(void* comm) {
  std::lock_guard<std::mutex> guard(mu);
  if (!comm) return finish(fail(nullptr, InvalidArgument, "fake NCCL: ncclCommFinalize(NULL)"));
  Comm* c = live(comm);
  int rc = Success;
  if (c->finalized) rc = fail(c, InvalidUsage, fmt("fake NCCL: rank %d was finalized twice", c->rank));
  c->finalized = true;
  group.touched.push_back(c);
  return finish(rc);
}
// Destroyed or aborted comms stay as tombstones, so a later use is caught (see live()).
int ncclCommDestroy(void* comm) {
  std::lock_guard<std::mutex> guard(mu);
  if (comm) live(comm)->dead = true, leave(static_cast<Comm*>(comm));
  runtime_restore();
  return Success;
}
int ncclCommAbort(void* comm) { return ncclCommDestroy(comm); }
int ncclCommShrink(void* comm, int* exclude, int count, void** newcomm, const ConfigHead* config,
                   int flags) {
  return shrink(comm, exclude, count, newcomm, config, flags);
}
int ncclCommGetAsyncError(void* comm, int* state) {
  std::lock_guard<std::mutex> guard(mu);
  if (!comm || !state)
    return fail(nullptr, InvalidArgument, "fake NCCL: ncclCommGetAsyncError: null argument");
  Comm* c = live(comm);
  if (c->hang) *state = InProgress;  // a stuck collective: until ncclCommAbort
  else if (c->error != Success) *state = c->error;
  else if (c->clique->shared && joined_ranks(c->clique) < c->clique->nranks) *state = InProgress;
  else if (std::chrono::steady_clock::now() < c->busy_until) *state = InProgress;
  else *state = c->pending ? InProgress : Success;
  c->pending = false;
  return Success;
}
int ncclCommCount(void* comm, int* n) {
  return comm_info<int>(comm, n, [](Comm* c) { return c->clique->nranks; });
}
int ncclCommCuDevice(void* comm, int* d) {
  return comm_info<int>(comm, d, [](Comm* c) { return c->device; });
}
int ncclCommUserRank(void* comm, int* r) {
  return comm_info<int>(comm, r, [](Comm* c) { return c->rank; });
}

int ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, void* comm,
                  void* stream) {
  return submit(Op{AllReduce, static_cast<Comm*>(comm), send, recv, count, dtype, op}, stream);
}
int ncclBroadcast(const void* send, void* recv, size_t count, int dtype, int root, void* comm,
                  void* stream) {
  return submit(Op{Broadcast, static_cast<Comm*>(comm), send, recv, count, dtype, root}, stream);
}
int ncclReduceScatter(const void* send, void* recv, size_t recvcount, int dtype, int op, void* comm,
                      void* stream) {
  return submit(Op{ReduceScatter, static_cast<Comm*>(comm), send, recv, recvcount, dtype, op}, stream);
}
int ncclAllGather(const void* send, void* recv, size_t sendcount, int dtype, void* comm,
                  void* stream) {
  return submit(Op{AllGather, static_cast<Comm*>(comm), send, recv, sendcount, dtype, 0}, stream);
}
int ncclSend(const void* send, size_t count, int dtype, int peer, void* comm, void* stream) {
  return submit(Op{Send, static_cast<Comm*>(comm), send, nullptr, count, dtype, peer}, stream);
}
int ncclRecv(void* recv, size_t count, int dtype, int peer, void* comm, void* stream) {
  return submit(Op{Recv, static_cast<Comm*>(comm), nullptr, recv, count, dtype, peer}, stream);
}
// Test aids: the bytes this process's ranks sent (count_sent: a ring algorithm's share) and the
// calls that ran, of one kind ("allreduce", "broadcast", "reducescatter", "allgather", "send",
// "recv"; NULL: every kind) since the library was loaded. Read them after the ops completed
// (dpsync_synchronize): under FAKE_CUDA_ASYNC ops run on their streams.
uint64_t fake_nccl_sent_bytes(const char* kind) {
  uint64_t total = 0;
  for (int k = 0; k < 6; k++)
    if (!kind || !std::strcmp(kind, kind_name[k])) total += sent[k];
  return total;
}
// Test aid: this process dies (SIGKILL) before it posts its next round across processes.
void fake_nccl_die_at_next_round() { die_next.store(true); }
// Test aid: this process dies (SIGKILL) `delay_us` µs after its next round across processes
// is done here.
void fake_nccl_die_after_next_round(unsigned delay_us) { die_after_us = delay_us, die_after = true; }
uint64_t fake_nccl_calls(const char* kind) {
  uint64_t total = 0;
  for (int k = 0; k < 6; k++)
    if (!kind || !std::strcmp(kind, kind_name[k])) total += calls[k];
  return total;
}
int ncclGroupStart() {
  depth++;
  return Success;
}
int ncclGroupEnd() {
  std::lock_guard<std::mutex> guard(mu);
  if (depth == 0) return fail(nullptr, InvalidUsage, "fake NCCL: ncclGroupEnd without ncclGroupStart");
  if (--depth > 0) return Success;
  int rc = run_group();
  runtime_restore();
  return rc;
}
}
