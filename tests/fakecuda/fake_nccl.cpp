// A stand-in for libnccl.so.2 that runs on the CPU beside the fake CUDA driver (fake_cuda.cpp),
// so that dpsync's NCCL transport (src/backend/cuda/nccl.rs) — communicators made in a group,
// non-blocking polling, allreduce, broadcast, send/recv, timeouts and aborts — can be tested on a
// machine without a GPU. Built by scripts/fake-cuda.sh into target/fakecuda/libnccl.so.2; never
// shipped.
//
// It is stricter than real NCCL where real NCCL would hang or corrupt memory, so caller bugs are
// loud: the ops of one group are matched per clique (the communicators of one unique id) when the
// outermost ncclGroupEnd runs; a rank missing, a different kind/count/dtype/op/root, an unpaired
// send or recv fails that clique with ncclInvalidUsage and a last-error text that names it. Every
// buffer must lie in fake device memory on the communicator's device, and the stream and the
// current context must be that device's. A destroyed or aborted communicator used again aborts
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
// aborted or destroyed in another process fails the others' rounds with ncclRemoteError; a round
// that waits 60 s for a rank aborts the process (a hang in real NCCL). Sends and receives across
// processes are refused (dpsync makes none). Without FAKE_CUDA_ASYNC a round runs inside the
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
// Several ranks of a clique on one device are refused, as by NCCL, unless
// NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30; this fake reports 2.30.0).
#include <dlfcn.h>
#include <fcntl.h>
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
enum Kind { AllReduce, Broadcast, Send, Recv };
const char* kind_name[] = {"allreduce", "broadcast", "send", "recv"};

struct Clique;
struct Comm {
  Clique* clique;
  int rank, device;
  bool blocking;
  bool dead = false, finalized = false, hang = false, pending = false;
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
// An op as queued: arg is the reduction op, the broadcast root or the peer.
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

// --- arithmetic -----------------------------------------------------------------------------
float half_to_float(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float f = e == 0 ? std::ldexp(float(m), -24)
                   : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(float(m | 0x400), e - 25);
  return h & 0x8000 ? -f : f;
}
// Round to nearest even (nearbyint in the default rounding mode); float holds every sum of two
// halves or bfloat16s exactly enough (24 >= 2*11+2 bits) that this double rounding is exact.
uint16_t float_to_half(float f) {
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;                                  // rounds to infinity
  if (a < 0x1p-14f) return sign | uint16_t(std::nearbyint(a * 0x1p24f));  // subnormal
  int e;
  float q = std::nearbyint(std::ldexp(std::frexp(a, &e), 11));  // 1024..2048; 2048 carries
  return sign | uint16_t(((e + 14) << 10) + int(q) - 1024);
}
float bf16_to_float(uint16_t h) {
  uint32_t x = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (std::isnan(f)) return uint16_t(x >> 16) | 0x40;
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

// An element type: C is what it computes in; round() is the store-and-reload of each step.
template <class T> struct Native {
  using C = T;
  static C load(const void* p, size_t i) { return static_cast<const T*>(p)[i]; }
  static void store(void* p, size_t i, C v) { static_cast<T*>(p)[i] = v; }
  static C round(C v) { return v; }
};
template <float (*From)(uint16_t), uint16_t (*To)(float)> struct Short {
  using C = float;
  static C load(const void* p, size_t i) { return From(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, size_t i, C v) { static_cast<uint16_t*>(p)[i] = To(v); }
  static C round(C v) { return From(To(v)); }
};

template <class C> C combine(int op, C a, C b) {
  if constexpr (std::is_integral_v<C>) {  // integers wrap, as on the GPU
    using U = std::make_unsigned_t<C>;
    if (op == 0 || op == 4) return C(U(a) + U(b));
    if (op == 1) return C(U(a) * U(b));
  } else {
    if (op == 0 || op == 4) return a + b;
    if (op == 1) return a * b;
  }
  return op == 2 ? std::max(a, b) : std::min(a, b);
}

// Reduces the sources (rank 0, 1, .. n-1) in that order into a temporary, then writes every
// output (so send == recv works).
template <class T>
void reduce(const std::vector<const void*>& srcs, const std::vector<void*>& outs, size_t count,
            int op) {
  std::vector<typename T::C> acc(count);
  for (size_t i = 0; i < count; i++) acc[i] = T::load(srcs[0], i);
  for (size_t r = 1; r < srcs.size(); r++)
    for (size_t i = 0; i < count; i++) acc[i] = T::round(combine(op, acc[i], T::load(srcs[r], i)));
  if (op == 4)
    for (auto& v : acc) v = T::round(v / typename T::C(srcs.size()));
  for (void* out : outs)
    for (size_t i = 0; i < count; i++) T::store(out, i, acc[i]);
}

void allreduce(int dtype, const std::vector<const void*>& srcs, const std::vector<void*>& outs,
               size_t count, int op) {
  switch (dtype) {
    case 0: return reduce<Native<int8_t>>(srcs, outs, count, op);
    case 1: return reduce<Native<uint8_t>>(srcs, outs, count, op);
    case 2: return reduce<Native<int32_t>>(srcs, outs, count, op);
    case 3: return reduce<Native<uint32_t>>(srcs, outs, count, op);
    case 4: return reduce<Native<int64_t>>(srcs, outs, count, op);
    case 5: return reduce<Native<uint64_t>>(srcs, outs, count, op);
    case 6: return reduce<Short<half_to_float, float_to_half>>(srcs, outs, count, op);
    case 7: return reduce<Native<float>>(srcs, outs, count, op);
    case 8: return reduce<Native<double>>(srcs, outs, count, op);
    case 9: return reduce<Short<bf16_to_float, float_to_bf16>>(srcs, outs, count, op);
  }
}

void allreduce(const std::vector<const Op*>& rk) {
  std::vector<const void*> srcs;
  std::vector<void*> outs;
  for (const Op* o : rk) srcs.push_back(o->send), outs.push_back(o->recv);
  allreduce(rk[0]->dtype, srcs, outs, rk[0]->count, rk[0]->arg);
}

size_t bytes(const Op& o) { return o.count * type_size[o.dtype]; }

// --- checks at the call -------------------------------------------------------------------
// Whether the op may be queued; if not, the comm has the error code and text.
int check_op(const Op& o, void* stream) {
  Comm* c = o.comm;
  int n = c->clique->nranks;
  const char* what = kind_name[o.kind];
  if (c->finalized)
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s after ncclCommFinalize", c->rank, what));
  if (c->error != Success) return c->error;  // errors stick, as in real NCCL
  if (o.dtype < 0 || o.dtype > 9)
    return fail(c, InvalidArgument,
                fmt("fake NCCL: rank %d's %s: bad datatype %d", c->rank, what, o.dtype));
  if (o.kind == AllReduce && (o.arg < 0 || o.arg > 4))
    return fail(c, InvalidArgument, fmt("fake NCCL: rank %d's allreduce: bad op %d", c->rank, o.arg));
  if (o.kind != AllReduce && (o.arg < 0 || o.arg >= n))
    return fail(c, InvalidArgument, fmt("fake NCCL: rank %d's %s: %s %d is not a rank of %d", c->rank,
                                        what, o.kind == Broadcast ? "root" : "peer", o.arg, n));
  if (o.count > SIZE_MAX / 8)
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
  for (int b = 0; b < 2; b++) {
    // A broadcast reads the send buffer on the root only.
    bool used = b == 0 ? o.kind != Recv && (o.kind != Broadcast || o.arg == c->rank) : o.kind != Send;
    if (!used || cu->device_of(bufs[b], bytes(o)) == c->device) continue;
    int at = cu->device_of(bufs[b], 1);
    std::string where = at < 0 ? "not in fake device memory"
                        : at == c->device ? "overrunning its allocation" : fmt("on cuda:%d", at);
    return fail(c, InvalidUsage, fmt("fake NCCL: rank %d's %s %s buffer %p (%zu bytes) is %s; the "
                                     "communicator is on cuda:%d", c->rank, what, b ? "recv" : "send",
                                     bufs[b], bytes(o), where.c_str(), c->device));
  }
  return Success;
}

std::string describe(const Op* o) {
  return fmt("%s of %zu %s (%s)", kind_name[o->kind], o->count, type_name[o->dtype],
             o->kind == AllReduce ? op_name[o->arg] : fmt("root %d", o->arg).c_str());
}

// --- across processes (see the header) ---------------------------------------------------
constexpr int kMaxRanks = 512;
// A rank's slot: whether it joined, the last round it posted (with that round's op) and the last
// it finished reading; written by the rank's process only.
struct Slot {
  std::atomic<int> joined, aborted;
  std::atomic<uint64_t> posted, consumed;
  int kind, dtype, arg;
  uint64_t count;
};
struct Shared { Slot slot[kMaxRanks]; };
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

int joined_ranks(Clique* q) {
  int n = 0;
  for (int r = 0; r < q->nranks; r++) n += q->shared->slot[r].joined.load();
  return n;
}

// Rank r's data file. A rank's process creates it when the rank joins (before the rank counts
// as joined), and the first round opens every rank's, so a rank destroyed (its file unlinked)
// while another process still reads its last round's data is no problem.
std::string data_path(Clique* q, int r) { return q->path + ".r" + std::to_string(r); }
void create_data_file(Clique* q, int r) {
  q->files[r] = open(data_path(q, r).c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
}
int data_file(Clique* q, int r) {
  for (int x = 0; x < q->nranks; x++)
    if (q->files[x] < 0) q->files[x] = open(data_path(q, x).c_str(), O_RDONLY);
  return q->files[r];
}

// The clique's shared slots (created by whichever process comes first; zeroed by the kernel).
// Under the lock.
std::string share(Clique* q) {
  if (q->nranks > kMaxRanks) return fmt("fake NCCL: %d ranks across processes (at most %d)",
                                        q->nranks, kMaxRanks);
  std::string name;
  for (char ch : q->id) name += std::isalnum((unsigned char)ch) ? ch : '-';
  q->path = "/dev/shm/fake-nccl-" + name;
  int fd = open(q->path.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, sizeof(Shared)) != 0)
    return fmt("fake NCCL: cannot make %s: %s", q->path.c_str(), std::strerror(errno));
  void* at = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (at == MAP_FAILED) return fmt("fake NCCL: cannot map %s", q->path.c_str());
  q->shared = static_cast<Shared*>(at);
  q->files.assign(q->nranks, -1);
  for (int r = 0; r < q->nranks; r++)
    if (q->ranks[r]) create_data_file(q, r), q->shared->slot[r].joined.store(1);
  return "";
}

// Rank r's data file, opened for writing (its own) or reading.
bool whole_io(bool write, int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  for (size_t done = 0; done < n;) {
    ssize_t k = write ? pwrite(fd, p + done, n - done, done) : pread(fd, p + done, n - done, done);
    if (k <= 0) return false;
    done += size_t(k);
  }
  return true;
}

// Waits until every rank's `field` reaches `round`; "" or why not (a rank aborted). 60 s: a hang.
std::string wait_all(Clique* q, std::atomic<uint64_t> Slot::*field, uint64_t round,
                     const char* what) {
  auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < q->nranks;) {
    Slot& s = q->shared->slot[r];
    if ((s.*field).load(std::memory_order_acquire) >= round) { r++; continue; }
    if (s.aborted.load()) return fmt("fake NCCL: rank %d was aborted or destroyed in its process "
                                     "while rank(s) here waited for it (%s)", r, what);
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
      std::fprintf(stderr, "fake NCCL: round %llu waited 60 s for rank %d (%s): a hang in real "
                   "NCCL\n", (unsigned long long)round, r, what);
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return "";
}

// One collective across processes: `local` are this process's ranks' ops (all alike).
std::string round_across(Clique* q, uint64_t round, const std::vector<const Op*>& local) {
  const Op& mine = *local[0];
  size_t n = bytes(mine);
  if (auto why = wait_all(q, &Slot::consumed, round - 1, "the previous round"); !why.empty())
    return why;
  for (const Op* o : local) {
    Slot& s = q->shared->slot[o->comm->rank];
    s.kind = o->kind, s.dtype = o->dtype, s.arg = o->arg, s.count = o->count;
    bool sends = o->kind == AllReduce || o->arg == o->comm->rank;
    int fd = sends && n ? data_file(q, o->comm->rank) : 0;
    if (fd < 0 || (sends && n && !whole_io(true, fd, const_cast<void*>(o->send), n)))
      return fmt("fake NCCL: rank %d cannot write its data: %s", o->comm->rank, std::strerror(errno));
    s.posted.store(round, std::memory_order_release);
  }
  if (auto why = wait_all(q, &Slot::posted, round, describe(&mine).c_str()); !why.empty())
    return why;
  const Slot& ref = q->shared->slot[0];
  for (int r = 1; r < q->nranks; r++) {
    const Slot& s = q->shared->slot[r];
    if (s.kind != ref.kind || s.count != ref.count || s.dtype != ref.dtype || s.arg != ref.arg) {
      Op a{Kind(s.kind), nullptr, nullptr, nullptr, s.count, s.dtype, s.arg};
      Op b{Kind(ref.kind), nullptr, nullptr, nullptr, ref.count, ref.dtype, ref.arg};
      return fmt("fake NCCL: round %llu across processes differs: rank %d queued %s, rank 0 %s",
                 (unsigned long long)round, r, describe(&a).c_str(), describe(&b).c_str());
    }
  }
  // Every rank's bytes, in rank order: this process's from its buffers, the others' from files.
  std::vector<std::vector<char>> read(q->nranks);
  std::vector<const void*> srcs(q->nranks, nullptr);
  for (const Op* o : local) srcs[o->comm->rank] = o->send;
  std::vector<void*> outs;
  for (const Op* o : local) outs.push_back(o->recv);
  for (int r = 0; r < q->nranks && n; r++) {
    bool needed = mine.kind == AllReduce || r == mine.arg;
    if (!needed || srcs[r]) continue;
    read[r].resize(n);
    int fd = data_file(q, r);
    if (fd < 0 || !whole_io(false, fd, read[r].data(), n))
      return fmt("fake NCCL: cannot read rank %d's data: %s", r, std::strerror(errno));
    srcs[r] = read[r].data();
  }
  if (n && mine.kind == AllReduce) {
    allreduce(mine.dtype, srcs, outs, mine.count, mine.arg);
  } else if (n) {  // broadcast: through a copy, so the root's send == recv is fine
    const char* from = static_cast<const char*>(srcs[mine.arg]);
    std::vector<char> data(from, from + n);
    for (void* out : outs) std::memcpy(out, data.data(), n);
  }
  for (const Op* o : local) q->shared->slot[o->comm->rank].consumed.store(round);
  return "";
}

// A rank leaves: the others' rounds stop waiting for it; its data file goes.
void leave(Comm* c) {
  Clique* q = c->clique;
  if (!q->shared) return;
  q->shared->slot[c->rank].aborted.store(1);
  unlink(data_path(q, c->rank).c_str());
  if (c->rank == 0) unlink(q->path.c_str());  // mapped by every process that joined
}

// --- matching and running a group -----------------------------------------------------------
// One clique's ops of a group: collectives by rank in order; sends and recvs by (from, to).
struct Plan {
  Clique* clique = nullptr;
  uint64_t first_round = 0;  // across processes: the round of the first collective
  std::vector<std::vector<const Op*>> coll;
  std::map<std::pair<int, int>, std::vector<const Op*>> sends, recvs;
};

// What disagrees, or "" when every rank's ops pair up.
std::string match(Clique* q, const std::vector<const Op*>& ops, Plan& p) {
  int n = q->nranks;
  int joined = q->shared ? joined_ranks(q)
                         : n - int(std::count(q->ranks.begin(), q->ranks.end(), nullptr));
  if (joined < n)
    return fmt("fake NCCL: only %d of the %d ranks of the communicator were initialised", joined, n);
  p.clique = q;
  p.coll.assign(n, {});
  for (const Op* o : ops) {
    int r = o->comm->rank;
    if (q->shared && o->kind >= Send && !q->ranks[o->arg])
      return fmt("fake NCCL: rank %d's %s %s rank %d, which is in another process: this fake "
                 "moves only collectives between processes", r, kind_name[o->kind],
                 o->kind == Send ? "to" : "from", o->arg);
    if (o->kind == Send) p.sends[{r, o->arg}].push_back(o);
    else if (o->kind == Recv) p.recvs[{o->arg, r}].push_back(o);
    else p.coll[r].push_back(o);
  }
  size_t most = 0;
  for (auto& v : p.coll) most = std::max(most, v.size());
  for (size_t i = 0; i < most; i++) {
    const Op* ref = nullptr;  // the lowest rank's i-th collective is the one the others must match
    for (auto& v : p.coll)
      if (!ref && i < v.size()) ref = v[i];
    int rr = ref->comm->rank;
    for (int r = 0; r < n; r++) {
      if (!q->ranks[r]) continue;  // another process's: matched in the round (shared memory)
      if (i >= p.coll[r].size())
        return fmt("fake NCCL: rank %d of %d queued no %s to pair with rank %d's (count %zu)%s", r, n,
                   kind_name[ref->kind], rr, ref->count,
                   q->ranks[r]->dead ? "; it was destroyed or aborted" : "");
      const Op* o = p.coll[r][i];
      if (o->kind != ref->kind || o->count != ref->count || o->dtype != ref->dtype ||
          o->arg != ref->arg)
        return fmt("fake NCCL: collective #%zu of the group differs: rank %d of %d queued %s, "
                   "rank %d %s", i, r, n, describe(o).c_str(), rr, describe(ref).c_str());
    }
  }
  std::set<std::pair<int, int>> links;
  for (auto& [link, _] : p.sends) links.insert(link);
  for (auto& [link, _] : p.recvs) links.insert(link);
  for (auto [a, b] : links) {
    auto &s = p.sends[{a, b}], &r = p.recvs[{a, b}];
    if (s.size() != r.size())
      return fmt("fake NCCL: rank %d queued %zu send(s) to rank %d, but rank %d queued %zu "
                 "recv(s) from rank %d", a, s.size(), b, b, r.size(), a);
    for (size_t k = 0; k < s.size(); k++)
      if (bytes(*s[k]) != bytes(*r[k]))
        return fmt("fake NCCL: send #%zu from rank %d to rank %d is %zu bytes, the recv it "
                   "pairs with %zu", k, a, b, bytes(*s[k]), bytes(*r[k]));
  }
  // Sends and recvs of a group run concurrently on a GPU: a recv buffer shared with another
  // p2p buffer of the group is a data race there, whatever order this fake would pick.
  for (const Op* o : ops) {
    if (o->kind != Recv || !o->count) continue;
    for (const Op* x : ops) {
      const char* xb = static_cast<const char*>(x->kind == Send ? x->send : x->recv);
      const char* ob = static_cast<const char*>(o->recv);
      if (x == o || x->kind < Send || !x->count) continue;
      if (xb >= ob + bytes(*o) || ob >= xb + bytes(*x)) continue;
      return fmt("fake NCCL: rank %d's recv buffer (from rank %d) overlaps rank %d's %s buffer "
                 "(%s rank %d) in the same group: a data race on a GPU", o->comm->rank, o->arg,
                 x->comm->rank, kind_name[x->kind], x->kind == Send ? "to" : "from", x->arg);
    }
  }
  return "";
}

// Runs a matched plan: "" or why it failed (a round across processes).
std::string execute(const Plan& p) {
  Clique* q = p.clique;
  if (q->shared) {
    size_t rounds = 0;
    for (auto& v : p.coll) rounds = std::max(rounds, v.size());
    for (size_t i = 0; i < rounds; i++) {
      std::vector<const Op*> local;
      for (auto& v : p.coll)
        if (!v.empty()) local.push_back(v[i]);
      if (auto why = round_across(q, p.first_round + i, local); !why.empty()) return why;
    }
  } else {
    for (size_t i = 0; i < p.coll[0].size(); i++) {
      std::vector<const Op*> rk;
      for (auto& v : p.coll) rk.push_back(v[i]);
      if (rk[0]->kind == AllReduce) {
        allreduce(rk);
      } else {  // broadcast: through a copy, so the root's send == recv (or any overlap) is fine
        const char* from = static_cast<const char*>(rk[rk[0]->arg]->send);
        std::vector<char> data(from, from + bytes(*rk[0]));
        for (const Op* o : rk)
          if (!data.empty()) std::memcpy(o->recv, data.data(), data.size());
      }
    }
  }
  std::vector<std::pair<void*, std::vector<char>>> moves;  // every send is read before any recv
  for (auto& [link, s] : p.sends)
    for (size_t k = 0; k < s.size(); k++) {
      const char* from = static_cast<const char*>(s[k]->send);
      moves.emplace_back(p.recvs.at(link)[k]->recv, std::vector<char>(from, from + bytes(*s[k])));
    }
  for (auto& [to, data] : moves)
    if (!data.empty()) std::memcpy(to, data.data(), data.size());
  return "";
}

// A failed round: every communicator of the clique here says why (under the lock).
void fail_clique(Clique* q, const std::string& why) {
  int code = why.find("aborted or destroyed") != std::string::npos ? RemoteError : InvalidUsage;
  for (Comm* c : q->ranks)
    if (c && !c->dead && c->error == Success) c->error = code, c->last = why;
  last_global = why;
}

// The rounds of a matched plan across processes, numbered in issue order (under the lock).
void number_rounds(Plan& p) {
  size_t rounds = 0;
  for (auto& v : p.coll) rounds = std::max(rounds, v.size());
  p.first_round = p.clique->rounds + 1;
  p.clique->rounds += rounds;
}

// Under FAKE_CUDA_ASYNC: one clique's ops of a group, queued on every stream they name and run
// once all those streams reached them (as NCCL's kernels wait for their peers), by the last
// stream to arrive; the others wait until it is done. A stream that waits 60 s is a deadlock on
// a GPU too (say, one rank's stream waits for an event recorded after its peer's collective).
struct Launch {
  std::vector<Op> ops;  // fixed before `plan` points into it
  Plan plan;
  std::mutex m;
  std::condition_variable cv;
  size_t streams = 0, arrived = 0, left = 0;
  bool done = false;
};

void arrive(void* arg) {
  auto* l = static_cast<Launch*>(arg);
  std::unique_lock<std::mutex> g(l->m);
  if (++l->arrived == l->streams) {
    g.unlock();
    if (auto why = execute(l->plan); !why.empty()) {
      std::lock_guard<std::mutex> guard(mu);
      fail_clique(l->plan.clique, why);
    }
    g.lock();
    l->done = true;
    l->cv.notify_all();
  } else if (!l->cv.wait_for(g, std::chrono::seconds(60), [&] { return l->done; })) {
    std::fprintf(stderr, "fake NCCL: a %s of the group waited 60 s for the other ranks' streams "
                 "(%zu of %zu arrived): the ranks' streams wait for each other, a deadlock on a "
                 "GPU too\n", kind_name[l->ops[0].kind], l->arrived, l->streams);
    std::abort();
  }
  bool last = ++l->left == l->streams;
  g.unlock();
  if (last) delete l;
}

void launch_on_streams(Clique* q, const std::vector<const Op*>& ops, const Cuda* cu,
                       uint64_t first_round) {
  auto* l = new Launch;
  for (const Op* o : ops) l->ops.push_back(*o);
  std::vector<const Op*> mine;
  for (const Op& o : l->ops) mine.push_back(&o);
  match(q, mine, l->plan);  // matched before: cannot fail now
  l->plan.first_round = first_round;
  std::vector<std::pair<void*, int>> streams;  // (stream, device of a default stream)
  for (const Op& o : l->ops) {
    std::pair<void*, int> at{o.stream, o.comm->device};
    if (std::find(streams.begin(), streams.end(), at) == streams.end()) streams.push_back(at);
  }
  l->streams = streams.size();
  for (auto [stream, device] : streams) cu->enqueue(stream, device, arrive, l);
}

// Runs the calling thread's group (the outermost ncclGroupEnd, or one call outside a group).
int run_group() {
  Group g = std::move(group);
  group = Group{};
  std::vector<Clique*> order;
  auto add = [&](Clique* q) {
    if (std::find(order.begin(), order.end(), q) == order.end()) order.push_back(q);
  };
  for (const Op& o : g.ops) add(live(o.comm)->clique);  // destroyed since queued: abort
  for (auto& [q, _] : g.broken) add(q);
  int rc = g.code;
  for (Clique* q : order) {
    std::vector<const Op*> ops;
    for (const Op& o : g.ops)
      if (o.comm->clique == q) ops.push_back(&o);
    Plan p;
    std::string why = g.broken.count(q) ? g.broken[q] : match(q, ops, p);
    if (!why.empty()) {
      // None of the clique's ops run and all its comms say why (real NCCL would hang).
      for (Comm* c : q->ranks)
        if (c && !c->dead && c->error == Success) c->error = InvalidUsage, c->last = why;
      last_global = why;
      rc = InvalidUsage;
      continue;
    }
    const char* env = std::getenv("FAKE_NCCL_FAULT");
    std::string fault = env ? env : "";
    if (fault == "error") {
      for (const Op* o : ops)
        o->comm->error = SystemError, o->comm->last = "fake NCCL: injected failure";
      continue;
    }
    if (!fault.empty() && fault != "hang") {
      std::fprintf(stderr, "fake NCCL: FAKE_NCCL_FAULT=%s: expected hang or error\n", env);
      std::abort();
    }
    if (q->shared) number_rounds(p);
    const Cuda* cu = ops.empty() ? nullptr : cuda(ops[0]->comm);
    if (cu && cu->async()) launch_on_streams(q, ops, cu, p.first_round);
    else if (auto why = execute(p); !why.empty()) fail_clique(q, why), rc = InvalidUsage;
    if (fault == "hang")
      for (const Op* o : ops) o->comm->hang = true;
    for (const Op* o : ops)
      if (!o->comm->connected) o->comm->connected = true, setup_delay(o->comm);
  }
  // A clique still missing ranks when its init group ends spans processes.
  for (Comm* c : g.touched) {
    Clique* q = c->clique;
    if (c->dead || q->shared || !std::count(q->ranks.begin(), q->ranks.end(), nullptr)) continue;
    if (auto why = share(q); !why.empty()) {
      fail_clique(q, why);
      rc = SystemError;
    }
  }
  bool nonblocking = false;
  for (Comm* c : g.touched) {
    if (c->dead) continue;
    if (!c->blocking) {
      nonblocking = true;
      c->pending = c->error == Success;  // so the caller's polling loop runs at least once
    } else if (rc == Success) {
      rc = c->error;  // a blocking comm reports at once
    }
  }
  return rc == Success && nonblocking ? InProgress : rc;
}

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
  ncclUniqueId id{};
  std::snprintf(id.internal, sizeof id.internal, "fake NCCL unique id %d.%llu", int(getpid()),
                ++ids_issued);
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
int ncclSend(const void* send, size_t count, int dtype, int peer, void* comm, void* stream) {
  return submit(Op{Send, static_cast<Comm*>(comm), send, nullptr, count, dtype, peer}, stream);
}
int ncclRecv(void* recv, size_t count, int dtype, int peer, void* comm, void* stream) {
  return submit(Op{Recv, static_cast<Comm*>(comm), nullptr, recv, count, dtype, peer}, stream);
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
