// The fake CUDA driver's state and helpers (the device table, allocations, the FAKE_CUDA_ASYNC
// stream queues, copies, peer rules), in an anonymous namespace: part of fake_cuda.cpp, which
// includes it once after its types and before its driver entry points (extern "C"); its header
// describes the fake.
namespace {
int device_count() {
  const char* v = std::getenv("FAKE_CUDA_DEVICES");
  int n = v ? std::atoi(v) : 1;
  return n < 1 ? 1 : (n > 8 ? 8 : n);
}
FakeCtx primaries[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
thread_local CUcontext current = nullptr;

struct Alloc { size_t bytes; int device; bool device_memory; };
// Leaked, like everything worker threads touch: they may still run while the process exits.
std::mutex& lock = *new std::mutex;
std::map<uintptr_t, Alloc>& allocs = *new std::map<uintptr_t, Alloc>;

const Alloc* find(uintptr_t p, uintptr_t* base) {
  auto it = allocs.upper_bound(p);
  if (it == allocs.begin()) return nullptr;
  --it;
  if (p >= it->first + (it->second.bytes ? it->second.bytes : 1)) return nullptr;
  *base = it->first;
  return &it->second;
}

// Device and page-locked host memory alike belong to the current context.
CUresult remember(void** out, size_t bytes, bool device_memory) {
  if (!current) return INVALID_CONTEXT;
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
  // Poisoned, so that a late reader of freed memory sees garbage rather than the old values.
  std::memset(p, 0xa5, it->second.bytes);
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

// --- FAKE_CUDA_ASYNC: streams as worker threads (see the top) --------------------------------
const bool async_mode = flag("FAKE_CUDA_ASYNC");

struct Queue {
  int device;
  bool legacy;    // the device's legacy default stream (stream 0)
  bool blocking;  // created without CU_STREAM_NON_BLOCKING: synchronises with the legacy stream
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  unsigned long long pushed = 0, done = 0;
  bool retired = false;
  std::thread worker;

  Queue(int d, bool l, bool b, unsigned seed) : device(d), legacy(l), blocking(b) {
    worker = std::thread([this, seed] { run(seed); });
  }
  void run(unsigned seed) {
    std::minstd_rand jitter(seed);
    std::unique_lock<std::mutex> l(m);
    for (;;) {
      cv.wait(l, [&] { return retired || !tasks.empty(); });
      if (tasks.empty()) return;  // retired and drained
      auto task = std::move(tasks.front());
      tasks.pop_front();
      l.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 100));
      task();
      l.lock();
      done++;
      cv.notify_all();
    }
  }
  unsigned long long push(std::function<void()> task) {
    std::lock_guard<std::mutex> g(m);
    if (retired) {
      std::fprintf(stderr, "fake CUDA: work queued on a destroyed stream\n");
      std::abort();
    }
    tasks.push_back(std::move(task));
    cv.notify_all();
    return ++pushed;
  }
  unsigned long long queued() {
    std::lock_guard<std::mutex> g(m);
    return pushed;
  }
  bool reached(unsigned long long seq) {
    std::lock_guard<std::mutex> g(m);
    return done >= seq;
  }
  void wait(unsigned long long seq) {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return done >= seq; });
  }
  // cuStreamDestroy: the queued work still runs; the thread ends. The Queue itself is kept (never
  // freed), since events recorded on the stream may still be asked about.
  void retire() {
    {
      std::lock_guard<std::mutex> g(m);
      retired = true;
      cv.notify_all();
    }
    worker.join();
  }
};

std::mutex& streams_lock = *new std::mutex;
std::vector<Queue*>& live_queues = *new std::vector<Queue*>;  // every stream not destroyed
Queue* legacy_queues[8] = {};
// The streams' jitter: different in every process unless FAKE_CUDA_SEED is set.
unsigned seeds = std::getenv("FAKE_CUDA_SEED") ? unsigned(std::atoi(std::getenv("FAKE_CUDA_SEED")))
                                               : std::random_device{}();

Queue* legacy_queue(int device) {
  std::lock_guard<std::mutex> g(streams_lock);
  Queue*& q = legacy_queues[device];
  if (!q) {
    q = new Queue(device, true, true, seeds++);
    live_queues.push_back(q);
  }
  return q;
}

// The queue of a stream handle; the default streams (0, 1 legacy, 2 per-thread — treated as the
// legacy one) belong to `device`, or to the current context's when device < 0.
Queue* queue_of(CUstream s, int device = -1) {
  if ((uintptr_t)s > 2) return s->queue;
  if (device < 0) device = current ? current->device : 0;
  return legacy_queue(device);
}

// Queues `task` on `q` after the implicit synchronisation with the legacy default stream: work on
// the legacy stream waits for the device's blocking streams, and theirs for the legacy stream.
unsigned long long submit(Queue* q, std::function<void()> task) {
  std::vector<std::pair<Queue*, unsigned long long>> fences;
  {
    std::lock_guard<std::mutex> g(streams_lock);
    for (Queue* o : live_queues)
      if (o != q && o->device == q->device && o->blocking && q->blocking && (o->legacy || q->legacy))
        fences.emplace_back(o, o->queued());
  }
  for (auto& [o, seq] : fences)
    if (!o->reached(seq)) {
      q->push([o = o, seq = seq] { o->wait(seq); });
    }
  return q->push(std::move(task));
}

// Every stream of `device` (all devices when device < 0) has run what was queued so far.
void drain(int device) {
  std::vector<std::pair<Queue*, unsigned long long>> all;
  {
    std::lock_guard<std::mutex> g(streams_lock);
    for (Queue* q : live_queues)
      if (device < 0 || q->device == device) all.emplace_back(q, q->queued());
  }
  for (auto& [q, seq] : all) q->wait(seq);
}

// The device of memory the driver allocated (device or pinned host memory), or -1 for pageable
// host memory.
int device_of_memory(const void* p) {
  std::lock_guard<std::mutex> g(lock);
  uintptr_t base = 0;
  const Alloc* a = find((uintptr_t)p, &base);
  return a ? a->device : -1;
}

// A copy on `stream` (see the top for the pageable-memory rules); synchronous without
// FAKE_CUDA_ASYNC.
CUresult copy_bytes(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream stream) {
  if (int fault = sticky_fault.load()) return fault;
  counts.copies++;
  if (noexec) return OK;
  if (!async_mode) {
    std::memmove((void*)d, (void*)s, n);
    return OK;
  }
  Queue* q = queue_of(stream);
  bool from_pageable = device_of_memory((void*)s) < 0, to_pageable = device_of_memory((void*)d) < 0;
  if (from_pageable && to_pageable) {
    std::memmove((void*)d, (void*)s, n);
  } else if (from_pageable) {  // staged now: the caller may reuse its buffer at once
    auto staged = std::make_shared<std::vector<char>>((char*)s, (char*)s + n);
    submit(q, [d, staged] { std::memcpy((void*)d, staged->data(), staged->size()); });
  } else if (to_pageable) {  // returns once copied
    q->wait(submit(q, [d, s, n] { std::memmove((void*)d, (void*)s, n); }));
  } else {
    submit(q, [d, s, n] { std::memmove((void*)d, (void*)s, n); });
  }
  return OK;
}

// The synchronous cuMemcpy* calls: on the legacy stream, returning when done.
CUresult copy_now(CUdeviceptr d, CUdeviceptr s, size_t n) {
  if (int fault = sticky_fault.load()) return fault;
  CUresult rc = copy_bytes(d, s, n, nullptr);
  if (async_mode) {
    Queue* q = queue_of(nullptr);
    q->wait(q->queued());
  }
  return rc;
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

// The context of a stream; the default streams (0, 1 legacy, 2 per-thread) are the current
// context's, so nullptr when none is current.
CUcontext context_of(CUstream s) { return (uintptr_t)s <= 2 ? current : s->ctx; }

// A breach of the driver's context rules (see the top): the driver's error, and why on stderr,
// since the caller (dpsync) only reports the code.
CUresult misuse(CUresult code, const char* call, const char* rule) {
  std::fprintf(stderr, "fake CUDA: %s: %s\n", call, rule);
  return code;
}

// Pairs (from device, to device) whose peer access was enabled: process-wide, as primary
// contexts are.
std::set<std::pair<int, int>> enabled_peers;
}  // namespace
