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
// streams once every rank's stream reaches them (a deadlock there aborts after 60 s). Ranks are
// matched inside one thread's group (one thread driving every rank, as dpsync does), so
// one-thread-per-rank use does not work here.
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

#include <algorithm>
#include <chrono>
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
struct Clique { int nranks = 0; std::vector<Comm*> ranks; };
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

// Reduces rank 0, 1, .. n-1 in that order into a temporary, then writes every recv buffer (so
// send == recv works).
template <class T> void reduce(const std::vector<const Op*>& rk) {
  size_t count = rk[0]->count;
  int op = rk[0]->arg;
  std::vector<typename T::C> acc(count);
  for (size_t i = 0; i < count; i++) acc[i] = T::load(rk[0]->send, i);
  for (size_t r = 1; r < rk.size(); r++)
    for (size_t i = 0; i < count; i++) acc[i] = T::round(combine(op, acc[i], T::load(rk[r]->send, i)));
  if (op == 4)
    for (auto& v : acc) v = T::round(v / typename T::C(rk.size()));
  for (const Op* o : rk)
    for (size_t i = 0; i < count; i++) T::store(o->recv, i, acc[i]);
}

void allreduce(const std::vector<const Op*>& rk) {
  switch (rk[0]->dtype) {
    case 0: return reduce<Native<int8_t>>(rk);
    case 1: return reduce<Native<uint8_t>>(rk);
    case 2: return reduce<Native<int32_t>>(rk);
    case 3: return reduce<Native<uint32_t>>(rk);
    case 4: return reduce<Native<int64_t>>(rk);
    case 5: return reduce<Native<uint64_t>>(rk);
    case 6: return reduce<Short<half_to_float, float_to_half>>(rk);
    case 7: return reduce<Native<float>>(rk);
    case 8: return reduce<Native<double>>(rk);
    case 9: return reduce<Short<bf16_to_float, float_to_bf16>>(rk);
  }
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

// --- matching and running a group -----------------------------------------------------------
// One clique's ops of a group: collectives by rank in order; sends and recvs by (from, to).
struct Plan {
  std::vector<std::vector<const Op*>> coll;
  std::map<std::pair<int, int>, std::vector<const Op*>> sends, recvs;
};

std::string describe(const Op* o) {
  return fmt("%s of %zu %s (%s)", kind_name[o->kind], o->count, type_name[o->dtype],
             o->kind == AllReduce ? op_name[o->arg] : fmt("root %d", o->arg).c_str());
}

// What disagrees, or "" when every rank's ops pair up.
std::string match(Clique* q, const std::vector<const Op*>& ops, Plan& p) {
  int n = q->nranks;
  int joined = n - int(std::count(q->ranks.begin(), q->ranks.end(), nullptr));
  if (joined < n)
    return fmt("fake NCCL: only %d of the %d ranks of the communicator were initialised", joined, n);
  p.coll.assign(n, {});
  for (const Op* o : ops) {
    int r = o->comm->rank;
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

void execute(const Plan& p) {
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
  std::vector<std::pair<void*, std::vector<char>>> moves;  // every send is read before any recv
  for (auto& [link, s] : p.sends)
    for (size_t k = 0; k < s.size(); k++) {
      const char* from = static_cast<const char*>(s[k]->send);
      moves.emplace_back(p.recvs.at(link)[k]->recv, std::vector<char>(from, from + bytes(*s[k])));
    }
  for (auto& [to, data] : moves)
    if (!data.empty()) std::memcpy(to, data.data(), data.size());
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
    execute(l->plan);
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

void launch_on_streams(Clique* q, const std::vector<const Op*>& ops, const Cuda* cu) {
  auto* l = new Launch;
  for (const Op* o : ops) l->ops.push_back(*o);
  std::vector<const Op*> mine;
  for (const Op& o : l->ops) mine.push_back(&o);
  match(q, mine, l->plan);  // matched before: cannot fail now
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
    const Cuda* cu = ops.empty() ? nullptr : cuda(ops[0]->comm);
    if (cu && cu->async()) launch_on_streams(q, ops, cu);
    else execute(p);
    if (fault == "hang")
      for (const Op* o : ops) o->comm->hang = true;
    for (const Op* o : ops)
      if (!o->comm->connected) o->comm->connected = true, setup_delay(o->comm);
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
  std::snprintf(id.internal, sizeof id.internal, "fake NCCL unique id %llu", ++ids_issued);
  cliques[std::string(id.internal, sizeof id.internal)] = new Clique;
  return id;
}

// One rank joins its clique (device < 0: the current context's). Under the lock.
int init(void** out, int nranks, const ncclUniqueId& id, int rank, bool blocking, int device) {
  if (!out) return fail(nullptr, InvalidArgument, "fake NCCL: init with a null communicator pointer");
  // FAKE_NCCL_INIT_FAULT=1: NCCL loads but no communicator initialises (a broken network or
  // driver setup), which sends AUTO to peer copies.
  if (const char* f = std::getenv("FAKE_NCCL_INIT_FAULT"); f && std::string(f) == "1")
    return fail(nullptr, SystemError, "fake NCCL: injected init failure (FAKE_NCCL_INIT_FAULT=1)");
  auto it = cliques.find(std::string(id.internal, sizeof id.internal));
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
  if (comm) live(comm)->dead = true;
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
