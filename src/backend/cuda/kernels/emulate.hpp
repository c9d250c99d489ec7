// Host emulation of the CUDA subset dpsync's kernels use, for the tests only
// (src/backend/cuda/emulate.rs, tests/fakecuda). The kernel files are included after this header
// and compiled by the host C++ compiler into a shared library; a launch runs every block in turn,
// each CUDA thread as a coroutine (ucontext) of one OS thread, switched round-robin at every
// __syncthreads(), which is therefore a true block-wide barrier. So the kernels' indexing,
// shared-memory handshakes, atomics and arithmetic run as written. Not emulated (and not used by
// the kernels): warps, several blocks at once, memory spaces.
#include <ucontext.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define DPSYNC_EMULATE 1
#define __device__
#define __forceinline__ inline
#define __global__
// A launch runs in one OS thread, one block at a time (launches on different threads run
// concurrently, as kernels on different streams do), so a function-local thread_local is the
// block's shared memory, and the launch's dimensions are thread_local too.
#define __shared__ static thread_local

struct dim3_t { unsigned x = 0, y = 0, z = 0; };
static thread_local dim3_t blockIdx, threadIdx;
static thread_local dim3_t blockDim, gridDim;

namespace emu {
// The running block's coroutines: the scheduler's context and one per CUDA thread.
struct Block {
  ucontext_t scheduler;
  std::vector<ucontext_t> threads;
  std::vector<std::vector<char>> stacks;
  std::vector<bool> done;
  unsigned running = 0;
};
// Blocks (each with its coroutine stacks, 256 KiB per CUDA thread) are kept for reuse by later
// launches on any thread; a launch holds one.
inline thread_local Block* running_block = nullptr;
inline Block& block() { return *running_block; }
struct Lease {
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }
  static std::vector<Block*>& free() {
    static std::vector<Block*> f;
    return f;
  }
  Lease() {
    std::lock_guard<std::mutex> g(lock());
    if (free().empty()) {
      running_block = new Block;
    } else {
      running_block = free().back();
      free().pop_back();
    }
  }
  ~Lease() {
    std::lock_guard<std::mutex> g(lock());
    free().push_back(running_block);
    running_block = nullptr;
  }
};
using Entry = std::function<void(void**)>;
inline std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
template <class... A, std::size_t... I>
void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<A*>(p[I])...);
}
template <class... A>
Entry entry(void (*f)(A...)) {
  return [f](void** p) { call(f, p, std::index_sequence_for<A...>{}); };
}
// A launch queued for later (the fake driver's FAKE_CUDA_ASYNC streams): cuLaunchKernel copies
// the argument values at the call, as the real driver does, so the caller's may go away.
using Bound = std::function<void()>;
using Binder = std::function<Bound(const Entry*, unsigned, unsigned, void**)>;
inline std::map<const Entry*, Binder>& binders() {
  static std::map<const Entry*, Binder> b;
  return b;
}
template <class... A, std::size_t... I>
Bound bind(const Entry* e, unsigned grid, unsigned block, void** p, std::index_sequence<I...>);
template <class... A>
Binder binder(void (*)(A...)) {
  return [](const Entry* e, unsigned grid, unsigned block, void** p) {
    return bind<std::decay_t<A>...>(e, grid, block, p, std::index_sequence_for<A...>{});
  };
}
// The values of a launch's pointer-typed arguments and their pointees' alignments, for the fake
// driver's check that a kernel only reaches memory its device can, aligned as a GPU needs
// (tests/fakecuda/fake_cuda.cpp).
using Pointers = std::function<int(void**, const void**, unsigned*, int)>;
inline std::map<const Entry*, Pointers>& pointer_lists() {
  static std::map<const Entry*, Pointers> l;
  return l;
}
template <class... A, std::size_t... I>
int list_pointers(void** p, const void** out, unsigned* align, int max,
                  std::index_sequence<I...>) {
  int n = 0;
  auto one = [&](auto* arg) {
    using T = std::remove_reference_t<decltype(*arg)>;
    if constexpr (std::is_pointer_v<T>) {
      if (n < max) {
        align[n] = alignof(std::remove_pointer_t<T>);
        out[n++] = static_cast<const void*>(*arg);
      }
    }
  };
  (one(static_cast<A*>(p[I])), ...);
  return n;
}
template <class... A>
Pointers pointers(void (*)(A...)) {
  return [](void** p, const void** out, unsigned* align, int max) {
    return list_pointers<std::decay_t<A>...>(p, out, align, max,
                                             std::index_sequence_for<A...>{});
  };
}
struct Reg {
  Reg(const char* name, Entry e, Binder b, Pointers l) {
    const Entry* at = &registry().emplace(name, std::move(e)).first->second;
    binders().emplace(at, std::move(b));
    pointer_lists().emplace(at, std::move(l));
  }
};
}  // namespace emu

// Back to the scheduler, which runs every other thread of the block up to this barrier first.
inline void __syncthreads() {
  emu::Block& b = emu::block();
  swapcontext(&b.threads[b.running], &b.scheduler);
}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long u) { double f; std::memcpy(&f, &u, 8); return f; }
inline long long __double_as_longlong(double f) { long long u; std::memcpy(&u, &f, 8); return u; }

// _Float16 conversions round to nearest even, as cvt.rn.f16.f32 does.
inline float f16_to_f32(unsigned short x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }
inline unsigned short f32_to_f16(float a) {
  _Float16 h = (_Float16)a;
  unsigned short x;
  std::memcpy(&x, &h, 2);
  return x;
}

inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST,
                                                 __ATOMIC_SEQ_CST)) {
  }
  return old;
}

#define DPSYNC_KERNEL(name) \
  static emu::Reg emu_reg_##name(#name, emu::entry(&name), emu::binder(&name), \
                                 emu::pointers(&name));

// The emulator's C entry points (src/backend/cuda/emulate.rs).
extern "C" const void* dpsync_emu_find(const char* name) {
  auto it = emu::registry().find(name);
  return it == emu::registry().end() ? nullptr : &it->second;
}

// Up to `max` of the launch's pointer arguments into `out`, their pointees' alignments into
// `align`; how many there were.
extern "C" int dpsync_emu_pointer_args(const void* kernel, void** params, const void** out,
                                       unsigned* align, int max) {
  auto e = static_cast<const emu::Entry*>(kernel);
  return emu::pointer_lists().at(e)(params, out, align, max);
}

namespace emu {
inline thread_local const Entry* launching = nullptr;
inline thread_local void** launch_params = nullptr;
inline void thread_main() {
  (*launching)(launch_params);
  block().done[block().running] = true;  // returns to the scheduler through uc_link
}
}  // namespace emu

extern "C" void dpsync_emu_launch(const void* kernel, unsigned grid, unsigned block,
                                  void** params) {
  emu::Lease lease;
  emu::launching = static_cast<const emu::Entry*>(kernel);
  emu::launch_params = params;
  gridDim.x = grid;
  blockDim.x = block;
  emu::Block& b = emu::block();
  b.threads.resize(block);
  b.stacks.resize(block);
  b.done.assign(block, false);
  for (unsigned x = 0; x < grid; ++x) {
    blockIdx.x = x;
    for (unsigned t = 0; t < block; ++t) {
      b.stacks[t].resize(256 * 1024);
      getcontext(&b.threads[t]);
      b.threads[t].uc_stack.ss_sp = b.stacks[t].data();
      b.threads[t].uc_stack.ss_size = b.stacks[t].size();
      b.threads[t].uc_link = &b.scheduler;
      makecontext(&b.threads[t], emu::thread_main, 0);
      b.done[t] = false;
    }
    // Round-robin: each pass runs every unfinished thread up to its next barrier (or its end).
    for (bool any = true; any;) {
      any = false;
      for (unsigned t = 0; t < block; ++t) {
        if (b.done[t]) continue;
        any = true;
        b.running = t;
        threadIdx.x = t;
        swapcontext(&b.scheduler, &b.threads[t]);
      }
    }
  }
}

namespace emu {
template <class... A, std::size_t... I>
Bound bind(const Entry* e, unsigned grid, unsigned block, void** p, std::index_sequence<I...>) {
  auto args = std::make_shared<std::tuple<A...>>(*static_cast<A*>(p[I])...);
  return [e, grid, block, args] {
    void* q[sizeof...(A) + 1] = {static_cast<void*>(&std::get<I>(*args))..., nullptr};
    dpsync_emu_launch(e, grid, block, q);
  };
}
}  // namespace emu

// The launch `kernel<<<grid, block>>>(params...)` with its arguments copied, to run later.
inline std::function<void()> dpsync_emu_bind(const void* kernel, unsigned grid, unsigned block,
                                             void** params) {
  auto e = static_cast<const emu::Entry*>(kernel);
  return emu::binders().at(e)(e, grid, block, params);
}
