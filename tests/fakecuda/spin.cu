// The tests' own kernels: tests/common/gpu.rs compiles this file with NVRTC (SPIN); on the fake
// CUDA driver scripts/fake-cuda.sh builds it, after tests/fakecuda/clock64.hpp, into the driver,
// whose kernel emulator (src/backend/cuda/kernels/emulate.hpp) defines DPSYNC_KERNEL to register
// each kernel by name. NVRTC sees no such macro: there it names nothing.
#ifndef DPSYNC_KERNEL
#define DPSYNC_KERNEL(name)
#endif
extern "C" __global__ void spin_then_fill(float* out, unsigned long long n, float value,
                                          long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) out[i] = value;
}
// Keeps its stream busy until the host writes non-zero into `*release` (page-locked host memory)
// or, as a safety net, `cycles` pass; then fills `out`. One thread waits: the stream is busy
// until every thread is done. Read through volatile, so each look sees the host's write.
extern "C" __global__ void spin_until_released_then_fill(float* out, unsigned long long n,
                                                         float value, const int* release,
                                                         long long cycles) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    long long start = clock64();
    while (*(const volatile int*)release == 0 && clock64() - start < cycles) { }
  }
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) out[i] = value;
}
extern "C" __global__ void copy_out(const float* in, float* out, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) out[i] = in[i];
}
DPSYNC_KERNEL(spin_then_fill)
DPSYNC_KERNEL(spin_until_released_then_fill)
DPSYNC_KERNEL(copy_out)
