// Sparse gradients: the device index range check, coalescing (the sort runs on the host, see
// CudaBackend::coalesce; the device sums the rows of each run) and division under AVG.

// found[0] := the smallest row whose index is outside [0, bound), if smaller than found[0]
// (initialised to ~0 by the host). A negative index wraps to 2^63 or more and the host passes
// a bound of at most 2^63 (IndexCheck::unsigned_limit): one comparison covers both ends.
template <class I>
__device__ void index_check(const I* idx, u64 rows, u64 bound, u64* found) {
  for (u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
       r += (u64)gridDim.x * blockDim.x) {
    if ((u64)(i64)idx[r] >= bound) atomicMin(found, r);
  }
}

// found[1] := the index at row found[0] (one thread, after index_check in stream order).
template <class I>
__device__ void index_report(const I* idx, u64* found) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && found[0] != ~0ull) found[1] = (u64)(i64)idx[found[0]];
}

// Values are floating-point (the registry's rule).

// Output row k (of `runs`) := the sum of input rows positions[bounds[k] .. bounds[k + 1]], added
// in that order and rounded once (f16/bf16 accumulate in f32, integers in i64): the host's rule.
template <class T>
__device__ void sum_runs(const T* src, const u64* positions, const u64* bounds, u64 runs,
                         u64 row_len, T* dst) {
  typedef typename Num<T>::A A;
  const u64 n = runs * row_len;
  for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (u64)gridDim.x * blockDim.x) {
    const u64 k = e / row_len, j = e - k * row_len;
    const u64 begin = bounds[k], end = bounds[k + 1];
    A acc = Num<T>::load(src[positions[begin] * row_len + j]);
    for (u64 q = begin + 1; q < end; ++q) acc += Num<T>::load(src[positions[q] * row_len + j]);
    dst[e] = Num<T>::store(acc);
  }
}

// x[i] := x[i] / divisor, computed in the accumulation type and rounded once.
template <class T>
__device__ void divide_all(T* x, u64 n, double divisor) {
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (u64)gridDim.x * blockDim.x) {
    x[i] = Num<T>::store(divide(Num<T>::load(x[i]), divisor));
  }
}

#define SPARSE_INDEX_KERNELS(I, NAME)                                                         \
  extern "C" __global__ void index_check_##NAME(const I* idx, u64 rows, u64 bound,            \
                                                u64* found) {                                 \
    index_check<I>(idx, rows, bound, found);                                                  \
  }                                                                                           \
  extern "C" __global__ void index_report_##NAME(const I* idx, u64* found) {                  \
    index_report<I>(idx, found);                                                              \
  }                                                                                           \
  DPSYNC_KERNEL(index_check_##NAME)                                                           \
  DPSYNC_KERNEL(index_report_##NAME)

// Every dtype: sparse values under AVG, and dense buckets summed early (dpsync_grad_ready).
#define DIVIDE_KERNEL(T, NAME)                                                                \
  extern "C" __global__ void divide_##NAME(T* x, u64 n, double divisor) {                     \
    divide_all<T>(x, n, divisor);                                                             \
  }                                                                                           \
  DPSYNC_KERNEL(divide_##NAME)

#define SPARSE_VALUE_KERNELS(T, NAME)                                                         \
  extern "C" __global__ void sum_runs_##NAME(const T* src, const u64* positions,              \
                                             const u64* bounds, u64 runs, u64 row_len,        \
                                             T* dst) {                                        \
    sum_runs<T>(src, positions, bounds, runs, row_len, dst);                                  \
  }                                                                                           \
  DPSYNC_KERNEL(sum_runs_##NAME)                                                              \
  DIVIDE_KERNEL(T, NAME)

SPARSE_INDEX_KERNELS(int, i32)
SPARSE_INDEX_KERNELS(i64, i64)
SPARSE_VALUE_KERNELS(float, f32)
SPARSE_VALUE_KERNELS(double, f64)
SPARSE_VALUE_KERNELS(f16_t, f16)
SPARSE_VALUE_KERNELS(bf16_t, bf16)
DIVIDE_KERNEL(int, i32)
DIVIDE_KERNEL(i64, i64)
