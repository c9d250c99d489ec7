// Dense collectives: one table walk per fusion bucket, and the cross-device add.

// N elements of one segment: i0 + k * step within it (bucket elements e0 + k * step), k < N;
// `p` the segment's replica pointers. All N loads of a replica are issued before any is used.
template <int N, class T>
__device__ __forceinline__ void walk_items(const u64* p, int nrep, T* fusion, int mode, int avg,
                                           double divisor, u64 e0, u64 i0, u64 step) {
  typedef typename Num<T>::A A;
  A v[N];
  if (mode == 2) {
    for (int k = 0; k < N; ++k) v[k] = Num<T>::load(fusion[e0 + k * step]);
  } else {
    for (int k = 0; k < N; ++k) v[k] = Num<T>::load(((const T*)p[0])[i0 + k * step]);
    for (int r = 1; r < nrep; ++r)
      for (int k = 0; k < N; ++k) v[k] += Num<T>::load(((const T*)p[r])[i0 + k * step]);
    if (mode == 1) {
      for (int k = 0; k < N; ++k) fusion[e0 + k * step] = Num<T>::store(v[k]);
      return;
    }
  }
  T out[N];
  for (int k = 0; k < N; ++k) out[k] = Num<T>::store(avg ? divide(v[k], divisor) : v[k]);
  for (int r = 0; r < nrep; ++r)
    for (int k = 0; k < N; ++k) ((T*)p[r])[i0 + k * step] = out[k];
}

// mode 0: every local replica := sum (optionally / divisor)           (one-device allreduce)
// mode 1: fusion[e] := sum of local replicas                          (pack before a transport)
// mode 2: every local replica := fusion[e] (optionally / divisor)     (unpack after it)
template <class T>
__device__ void walk(const Seg* segs, const u64* ptrs, int nseg, int nrep, u64 total,
                     T* fusion, int mode, int avg, double divisor) {
  for_each_chunk(
      segs, nseg, total,
      [&](int s, u64 e0, u64 i0) {
        walk_items<ITEMS_PER_THREAD>(ptrs + (u64)s * nrep, nrep, fusion, mode, avg, divisor, e0,
                                     i0, blockDim.x);
      },
      [&](int s, u64 e, u64 i) {
        walk_items<1>(ptrs + (u64)s * nrep, nrep, fusion, mode, avg, divisor, e, i, 0);
      });
}

// dst[i] += src[i] over a contiguous buffer (cross-device sums of fusion buffers).
template <class T>
__device__ void add(T* dst, const T* src, u64 n) {
  typedef typename Num<T>::A A;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    A v = Num<T>::load(dst[i]) + Num<T>::load(src[i]);
    dst[i] = Num<T>::store(v);
  }
}

#define DENSE_KERNELS(T, NAME)                                                                   \
  extern "C" __global__ void walk_##NAME(const Seg* segs, const u64* ptrs, int nseg,         \
                                         int nrep, u64 total, T* fusion, int mode, int avg,  \
                                         double divisor) {                                   \
    walk<T>(segs, ptrs, nseg, nrep, total, fusion, mode, avg, divisor);                      \
  }                                                                                          \
  extern "C" __global__ void add_##NAME(T* dst, const T* src, u64 n) { add<T>(dst, src, n); } \
  DPSYNC_KERNEL(walk_##NAME)                                                                  \
  DPSYNC_KERNEL(add_##NAME)

DENSE_KERNELS(float, f32)
DENSE_KERNELS(double, f64)
DENSE_KERNELS(f16_t, f16)
DENSE_KERNELS(bf16_t, bf16)
DENSE_KERNELS(int, i32)
DENSE_KERNELS(i64, i64)
