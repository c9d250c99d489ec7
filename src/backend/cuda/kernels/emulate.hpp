// Host emulation of the CUDA subset dpsync's kernels use, for the tests only
// (src/backend/cuda/emulate.rs). The kernel files are included after this header and compiled by
// the host C++ compiler into a shared library; a launch runs every block in turn, each as
// blockDim.x OS threads that meet at __syncthreads() on a barrier, so the kernels' indexing,
// shared-memory handshakes, atomics and arithmetic run as written. Not emulated (and not used by
// the kernels): warps, several blocks at once, memory spaces.
#include <atomic>
#include <barrier>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#define DPSYNC_EMULATE 1
#define __device__
#define __forceinline__ inline
#define __global__
// One block runs at a time, so a function-local static is the block's shared memory.
#define __shared__ static

struct dim3_t { unsigned x = 0, y = 0, z = 0; };
static thread_local dim3_t blockIdx, threadIdx;
static dim3_t blockDim, gridDim;

namespace emu {
inline std::barrier<>*& block_barrier() {
  static std::barrier<>* b = nullptr;
  return b;
}
using Entry = std::function<void(void**)>;
inline std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
struct Reg {
  Reg(const char* name, Entry e) { registry().emplace(name, std::move(e)); }
};
template <class... A, std::size_t... I>
void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(*static_cast<A*>(p[I])...);
}
template <class... A>
Entry entry(void (*f)(A...)) {
  return [f](void** p) { call(f, p, std::index_sequence_for<A...>{}); };
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier()->arrive_and_wait(); }

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

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

#define DPSYNC_KERNEL(name) static emu::Reg emu_reg_##name(#name, emu::entry(&name));

// The emulator's C entry points (src/backend/cuda/emulate.rs).
extern "C" const void* dpsync_emu_find(const char* name) {
  auto it = emu::registry().find(name);
  return it == emu::registry().end() ? nullptr : &it->second;
}

extern "C" void dpsync_emu_launch(const void* kernel, unsigned grid, unsigned block,
                                  void** params) {
  // One launch at a time: the grid dimensions, the barrier and the "shared memory" are global.
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> lock(one_at_a_time);
  const emu::Entry& run = *static_cast<const emu::Entry*>(kernel);
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> barrier(block);
    emu::block_barrier() = &barrier;
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([&run, params, b, t] {
        blockIdx.x = b;
        threadIdx.x = t;
        run(params);
      });
    }
    for (auto& th : threads) th.join();
  }
}
