// clock64() for the tests' own kernels (tests/fakecuda/spin.cu) on the fake CUDA driver: a clock
// that runs fast, so that a spinning kernel costs nothing per emulated thread — except for the
// first thread of the first block under FAKE_CUDA_ASYNC=1, whose clock is real time at 2 GHz, so
// that a spinning kernel really keeps its stream busy (once per launch, not once per thread).
#include <chrono>
#include <cstdlib>

inline long long clock64() {
  static const bool real = std::getenv("FAKE_CUDA_ASYNC") && std::getenv("FAKE_CUDA_ASYNC")[0] == '1';
  if (real && blockIdx.x == 0 && threadIdx.x == 0)
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count() * 2;
  static thread_local long long t = 0;
  return t += 100000000;
}
