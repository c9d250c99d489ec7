// Dense collectives: one table walk per fusion bucket, and the cross-device add.

// mode 0: every local replica := sum (optionally / divisor)           (one-device allreduce)
// mode 1: fusion[e] := sum of local replicas                          (pack before a transport)
// mode 2: every local replica := fusion[e] (optionally / divisor)     (unpack after it)
template <class T>
__device__ void walk(const Seg* segs, const u64* ptrs, int nseg, int nrep, u64 total,
                     T* fusion, int mode, int avg, double divisor) {
  typedef typename Num<T>::A A;
  for_each_element(segs, nseg, total, [&](int s, u64 e, u64 i) {
    const u64* p = ptrs + (u64)s * nrep;
    if (mode == 2) {
      A v = Num<T>::load(fusion[e]);
      if (avg) v = divide(v, divisor);
      T out = Num<T>::store(v);
      for (int r = 0; r < nrep; ++r) ((T*)p[r])[i] = out;
      return;
    }
    A acc = Num<T>::load(((const T*)p[0])[i]);
    for (int r = 1; r < nrep; ++r) acc += Num<T>::load(((const T*)p[r])[i]);
    if (mode == 1) { fusion[e] = Num<T>::store(acc); return; }
    if (avg) acc = divide(acc, divisor);
    T out = Num<T>::store(acc);
    for (int r = 0; r < nrep; ++r) ((T*)p[r])[i] = out;
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
