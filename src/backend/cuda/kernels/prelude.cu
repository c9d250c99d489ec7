// Shared by every dpsync kernel: element types, accumulation types and segment-table helpers.
// No CUDA headers (NVRTC ships none for fp16 before some versions): f16 conversions are inline
// PTX and bf16 rounding is done on the bits (round to nearest even).
//
// The same source also compiles as host C++ under kernels/emulate.hpp (DPSYNC_EMULATE), which
// runs the kernels on CPU threads for the tests: keep device-only constructs behind the two
// hooks below.
#ifndef DPSYNC_EMULATE
__device__ __forceinline__ float f16_to_f32(unsigned short x) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float a) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(a)); return h;
}
// Registers a kernel with the emulator; nothing on the device.
#define DPSYNC_KERNEL(name)
#endif

// Elements each thread takes of a chunk (for_each_chunk). dpsync passes
// -DITEMS_PER_THREAD=<ITEMS of kernels.rs> to NVRTC and to the emulator's build; this default,
// which a unit test in kernels.rs keeps equal to ITEMS, serves a build that passes none (the fake
// CUDA driver of scripts/fake-cuda.sh).
#ifndef ITEMS_PER_THREAD
#define ITEMS_PER_THREAD 4
#endif

typedef unsigned long long u64;
typedef long long i64;
struct f16_t { unsigned short x; };
struct bf16_t { unsigned short x; };
struct Seg { u64 offset; u64 count; };

template <class T> struct Num;
template <> struct Num<float> {
  typedef float A;
  static __device__ __forceinline__ A load(float v) { return v; }
  static __device__ __forceinline__ float store(A a) { return a; }
};
template <> struct Num<double> {
  typedef double A;
  static __device__ __forceinline__ A load(double v) { return v; }
  static __device__ __forceinline__ double store(A a) { return a; }
};
template <> struct Num<int> {
  typedef i64 A;
  static __device__ __forceinline__ A load(int v) { return (A)v; }
  static __device__ __forceinline__ int store(A a) { return (int)a; }
};
// i64 accumulates in 128 bits, like the host: an AVG whose sum overflows i64 is still exact.
template <> struct Num<i64> {
  typedef __int128 A;
  static __device__ __forceinline__ A load(i64 v) { return (A)v; }
  static __device__ __forceinline__ i64 store(A a) { return (i64)a; }
};
template <> struct Num<f16_t> {
  typedef float A;
  static __device__ __forceinline__ A load(f16_t v) { return f16_to_f32(v.x); }
  static __device__ __forceinline__ f16_t store(A a) {
    f16_t h;
    h.x = f32_to_f16(a);
    return h;
  }
};
template <> struct Num<bf16_t> {
  typedef float A;
  static __device__ __forceinline__ A load(bf16_t v) {
    return __uint_as_float(((unsigned)v.x) << 16);
  }
  static __device__ __forceinline__ bf16_t store(A a) {
    unsigned u = __float_as_uint(a);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) { b.x = (unsigned short)((u >> 16) | 0x40u); return b; }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.x = (unsigned short)(u >> 16);
    return b;
  }
};

template <class A> __device__ __forceinline__ A divide(A a, double d) { return a / (A)d; }
// Integer division truncates toward zero, as on the host; the divisor is a small replica count.
template <> __device__ __forceinline__ __int128 divide(__int128 a, double d) {
  return a / (__int128)(long long)d;
}

// The segment holding bucket element e, searching from s (elements only move forward).
__device__ __forceinline__ int seek(const Seg* segs, int nseg, int s, u64 e) {
  while (s + 1 < nseg && e >= segs[s + 1].offset) ++s;
  return s;
}

// First segment of a chunk by binary search.
__device__ __forceinline__ int find(const Seg* segs, int nseg, u64 e) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (segs[mid].offset <= e) lo = mid; else hi = mid - 1;
  }
  return lo;
}


// Visits every element of a table of `nseg` segments holding `total` elements. Blocks take
// chunks of blockDim.x * ITEMS_PER_THREAD consecutive elements (grid-stride), threads take every
// blockDim.x-th element of a chunk, so neighbouring threads touch neighbouring addresses. A
// chunk that lies inside one segment (the usual case: tensors are far larger than a chunk) goes
// to whole(segment, the thread's first bucket element, that element within the segment): its
// elements are those plus k * blockDim.x, k < ITEMS_PER_THREAD, so the thread can have all
// their loads in flight (one load at a time left an H100's memory idle part of the time).
// Other chunks go element by element to f(segment, bucket element, element within the
// segment). The branch is the same for every thread of a block.
template <class W, class F>
__device__ __forceinline__ void for_each_chunk(const Seg* segs, int nseg, u64 total, W whole,
                                               F f) {
  const u64 chunk = (u64)blockDim.x * ITEMS_PER_THREAD;
  const u64 chunks = (total + chunk - 1) / chunk;
  __shared__ int first;
  for (u64 c = blockIdx.x; c < chunks; c += gridDim.x) {
    __syncthreads();
    if (threadIdx.x == 0) first = find(segs, nseg, c * chunk);
    __syncthreads();
    int s = first;
    const u64 begin = c * chunk, end = begin + chunk;
    if (end <= total && end <= segs[s].offset + segs[s].count) {
      whole(s, begin + threadIdx.x, begin + threadIdx.x - segs[s].offset);
      continue;
    }
    for (int k = 0; k < ITEMS_PER_THREAD; ++k) {
      u64 e = begin + (u64)k * blockDim.x + threadIdx.x;
      if (e >= total) break;
      s = seek(segs, nseg, s, e);
      f(s, e, e - segs[s].offset);
    }
  }
}
