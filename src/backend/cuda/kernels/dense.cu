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

// Shards of replicas on one device (dpsync_shard.h: replica w of W owns elements
// [count * w / W, count * (w + 1) / W) of every tensor): the owner of element i of a segment of
// `count` elements, the largest w whose piece starts at or before i.
__device__ __forceinline__ int owner_of(u64 i, u64 count, int nrep) {
  const u64 w = ((i + 1) * (u64)nrep - 1) / count;
  return w < (u64)nrep ? (int)w : nrep - 1;
}

// N elements of one segment of `count` (as walk_items): with `scatter`, the sum over the
// replicas in their order (walk's, so the allreduce's bytes) written to the owner alone;
// otherwise the owner's value copied to every other replica. Owners are monotone in the
// element, so when the first and the last of the N share one (the usual case: pieces are far
// larger than a chunk) it owns them all: two 64-bit divisions instead of N. Every load is
// issued before any store: the compiler cannot tell a store to one replica from a later load
// of another, so interleaving them left one load in flight per thread.
template <int N, class T>
__device__ __forceinline__ void owned_items(const u64* p, int nrep, u64 count, int scatter,
                                            int avg, double divisor, u64 i0, u64 step) {
  typedef typename Num<T>::A A;
  int o[N];
  o[0] = owner_of(i0, count, nrep);
  const int last = N > 1 ? owner_of(i0 + (N - 1) * step, count, nrep) : o[0];
  for (int k = 1; k < N; ++k) o[k] = last == o[0] ? o[0] : owner_of(i0 + k * step, count, nrep);
  T out[N];
  if (!scatter) {
    for (int k = 0; k < N; ++k) out[k] = ((const T*)p[o[k]])[i0 + k * step];
    for (int r = 0; r < nrep; ++r)
      for (int k = 0; k < N; ++k)
        if (r != o[k]) ((T*)p[r])[i0 + k * step] = out[k];
    return;
  }
  A v[N];
  for (int k = 0; k < N; ++k) v[k] = Num<T>::load(((const T*)p[0])[i0 + k * step]);
  for (int r = 1; r < nrep; ++r)
    for (int k = 0; k < N; ++k) v[k] += Num<T>::load(((const T*)p[r])[i0 + k * step]);
  for (int k = 0; k < N; ++k)
    ((T*)p[o[k]])[i0 + k * step] = Num<T>::store(avg ? divide(v[k], divisor) : v[k]);
}

template <class T>
__device__ void owned(const Seg* segs, const u64* ptrs, int nseg, int nrep, u64 total,
                      int scatter, int avg, double divisor) {
  for_each_chunk(
      segs, nseg, total,
      [&](int s, u64 e0, u64 i0) {
        owned_items<ITEMS_PER_THREAD, T>(ptrs + (u64)s * nrep, nrep, segs[s].count, scatter, avg,
                                         divisor, i0, blockDim.x);
      },
      [&](int s, u64 e, u64 i) {
        owned_items<1, T>(ptrs + (u64)s * nrep, nrep, segs[s].count, scatter, avg, divisor, i, 0);
      });
}

#define DENSE_KERNELS(T, NAME)                                                                   \
  extern "C" __global__ void walk_##NAME(const Seg* segs, const u64* ptrs, int nseg,         \
                                         int nrep, u64 total, T* fusion, int mode, int avg,  \
                                         double divisor) {                                   \
    walk<T>(segs, ptrs, nseg, nrep, total, fusion, mode, avg, divisor);                      \
  }                                                                                          \
  extern "C" __global__ void add_##NAME(T* dst, const T* src, u64 n) { add<T>(dst, src, n); } \
  extern "C" __global__ void owned_##NAME(const Seg* segs, const u64* ptrs, int nseg,        \
                                          int nrep, u64 total, int scatter, int avg,         \
                                          double divisor) {                                  \
    owned<T>(segs, ptrs, nseg, nrep, total, scatter, avg, divisor);                          \
  }                                                                                          \
  DPSYNC_KERNEL(walk_##NAME)                                                                  \
  DPSYNC_KERNEL(add_##NAME)                                                                   \
  DPSYNC_KERNEL(owned_##NAME)

DENSE_KERNELS(float, f32)
DENSE_KERNELS(double, f64)
DENSE_KERNELS(f16_t, f16)
DENSE_KERNELS(bf16_t, bf16)
DENSE_KERNELS(int, i32)
DENSE_KERNELS(i64, i64)

// Reproducible sums (dpsync_options_set_reproducible) of replicas on one device: the host's
// arithmetic (backend/host/repro.rs) element by element, so the same bytes. Per element, E is
// the largest exponent field over the replicas (at least 1); each value is scaled onto the grid
// 2^(E - bias - 49) and rounded to an integer (ties to even: adding 1.5 * 2^52 leaves it in the
// low mantissa bits), the integers are summed exactly (u64: wrapping, as the host's), and the
// sum is scaled back once (AVG divided), then rounded to the dtype. An all-ones field (an
// infinity or NaN among the values) counts NaNs, +infs and -infs instead, which decide.
// F32 and F64: the host stages F16 and BF16, whose one rounding from double has no device
// instruction here.
template <class T> struct Cut;
template <> struct Cut<float> {
  enum { FRAC = 23, EXPB = 8, BIAS = 127, SPECIAL = 255 };
  static __device__ __forceinline__ u64 bits(float x) { return __float_as_uint(x); }
  static __device__ __forceinline__ double widen(float x) { return (double)x; }
  static __device__ __forceinline__ float narrow(double x) { return (float)x; }
  // The host's f64::NAN as f32, written as bits: conversions may give another NaN.
  static __device__ __forceinline__ float nan() { return __uint_as_float(0x7fc00000u); }
};
template <> struct Cut<double> {
  enum { FRAC = 52, EXPB = 11, BIAS = 1023, SPECIAL = 2047 };
  static __device__ __forceinline__ u64 bits(double x) { return (u64)__double_as_longlong(x); }
  static __device__ __forceinline__ double widen(double x) { return x; }
  static __device__ __forceinline__ double narrow(double x) { return x; }
  static __device__ __forceinline__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }
};

// 2^k for k in the normal range.
__device__ __forceinline__ double pow2(int k) { return __longlong_as_double((i64)(k + 1023) << 52); }

template <class T> __device__ __forceinline__ int field(T x) {
  int f = (int)((Cut<T>::bits(x) >> Cut<T>::FRAC) & (u64)Cut<T>::SPECIAL);
  return f > 1 ? f : 1;
}

// x on the grid of field e (not the all-ones one); f64 grids scale in two exact steps.
template <class T> __device__ __forceinline__ u64 cut(T x, int e) {
  const int k = Cut<T>::BIAS + 49 - e;
  double y = Cut<T>::widen(x);
  if (Cut<T>::EXPB > 8) {
    const int half = k / 2;
    y = y * pow2(k - half) * pow2(half);
  } else {
    y = y * pow2(k);
  }
  const double magic = 6755399441055744.0;  // 1.5 * 2^52
  return (u64)__double_as_longlong(y + magic) - (u64)__double_as_longlong(magic);
}

// What x counts for when the element's field is the all-ones one.
template <class T> __device__ __forceinline__ u64 cut_special(T x) {
  const u64 b = Cut<T>::bits(x);
  if (field(x) != Cut<T>::SPECIAL) return 0;
  if (b & ((1ull << Cut<T>::FRAC) - 1)) return 1ull << 32;                    // NaN
  return ((b >> (Cut<T>::FRAC + Cut<T>::EXPB)) & 1) ? (1ull << 16) : 1ull;  // -inf, +inf
}

template <class T> __device__ __forceinline__ T uncut(i64 s, int e, int avg, double divisor) {
  if (e == Cut<T>::SPECIAL) {
    const i64 nans = (s >> 32) & 0xFFFF, pos = s & 0xFFFF, neg = (s >> 16) & 0xFFFF;
    if (nans == 0 && pos == 0) return Cut<T>::narrow(__longlong_as_double((i64)0xfff0000000000000ull));
    if (nans == 0 && neg == 0) return Cut<T>::narrow(__longlong_as_double(0x7ff0000000000000LL));
    return Cut<T>::nan();
  }
  const int k = e - Cut<T>::BIAS - 49;
  double v = (double)s;
  if (Cut<T>::EXPB > 8) {
    // Below the normal range (f64 grids reach 2^-1071): the first step exact, the second
    // rounding once.
    const int first = k > -1000 ? k : -1000;
    v = v * pow2(first) * pow2(k - first);
  } else {
    v = v * pow2(k);
  }
  return Cut<T>::narrow(avg ? v / divisor : v);
}

// N elements of one segment (as walk_items): every replica := the reproducible sum.
template <int N, class T>
__device__ __forceinline__ void repro_items(const u64* p, int nrep, int avg, double divisor,
                                            u64 i0, u64 step) {
  int fields[N];
  for (int k = 0; k < N; ++k) fields[k] = 1;
  for (int r = 0; r < nrep; ++r)
    for (int k = 0; k < N; ++k) {
      const int f = field(((const T*)p[r])[i0 + k * step]);
      fields[k] = f > fields[k] ? f : fields[k];
    }
  u64 acc[N];
  for (int k = 0; k < N; ++k) acc[k] = 0;
  for (int r = 0; r < nrep; ++r)
    for (int k = 0; k < N; ++k) {
      const T x = ((const T*)p[r])[i0 + k * step];
      acc[k] += fields[k] == Cut<T>::SPECIAL ? cut_special(x) : cut(x, fields[k]);
    }
  T out[N];
  for (int k = 0; k < N; ++k) out[k] = uncut<T>((i64)acc[k], fields[k], avg, divisor);
  for (int r = 0; r < nrep; ++r)
    for (int k = 0; k < N; ++k) ((T*)p[r])[i0 + k * step] = out[k];
}

template <class T>
__device__ void repro(const Seg* segs, const u64* ptrs, int nseg, int nrep, u64 total, int avg,
                      double divisor) {
  for_each_chunk(
      segs, nseg, total,
      [&](int s, u64 e0, u64 i0) {
        repro_items<ITEMS_PER_THREAD, T>(ptrs + (u64)s * nrep, nrep, avg, divisor, i0,
                                         blockDim.x);
      },
      [&](int s, u64 e, u64 i) { repro_items<1, T>(ptrs + (u64)s * nrep, nrep, avg, divisor, i, 0); });
}

#define REPRO_KERNEL(T, NAME)                                                                  \
  extern "C" __global__ void repro_##NAME(const Seg* segs, const u64* ptrs, int nseg,         \
                                          int nrep, u64 total, int avg, double divisor) {     \
    repro<T>(segs, ptrs, nseg, nrep, total, avg, divisor);                                    \
  }                                                                                            \
  DPSYNC_KERNEL(repro_##NAME)

REPRO_KERNEL(float, f32)
REPRO_KERNEL(double, f64)

// Reproducible sums over several devices (exec/repro_clique.rs, where many replicas share a
// GPU): the same arithmetic as `repro` in three passes over a device's local replicas, around
// two NCCL allreduces (ncclMax of the fields, ncclSum of the i64 sums), so only the fields and
// the integers cross the devices. Per bucket element e:
//   mode 0: fields[e] := the largest field over the local replicas (at least 1);
//   mode 1: sums[e] := Σ over the local replicas of x cut onto the grid of fields[e] (now the
//           clique's maximum), wrapping as `repro`'s: its integer sum is exact in any grouping;
//   mode 2: every local replica := sums[e] (now the clique's) converted back, AVG divided.
// A field travels as F: f32's 8 bits as a byte (ncclUint8); f64's 11 bits as the bits of a
// positive normal half, 0x400 + field (ncclFloat16: NCCL has no 16-bit integer, and the max of
// such halves is the max of their bits).
template <class T> struct Field;
template <> struct Field<float> {
  typedef unsigned char F;
  static __device__ __forceinline__ int get(F f) { return (int)f; }
  static __device__ __forceinline__ F put(int e) { return (F)e; }
};
template <> struct Field<double> {
  typedef unsigned short F;
  static __device__ __forceinline__ int get(F f) { return (int)f - 0x400; }
  static __device__ __forceinline__ F put(int e) { return (F)(0x400 + e); }
};

// N elements of one segment (as walk_items; e0 the first's bucket element).
template <int N, class T>
__device__ __forceinline__ void stage_items(const u64* p, int nrep, u64* sums,
                                            typename Field<T>::F* fields, int mode, int avg,
                                            double divisor, u64 e0, u64 i0, u64 step) {
  int f[N];
  if (mode == 0) {
    for (int k = 0; k < N; ++k) f[k] = 1;
    for (int r = 0; r < nrep; ++r)
      for (int k = 0; k < N; ++k) {
        const int x = field(((const T*)p[r])[i0 + k * step]);
        f[k] = x > f[k] ? x : f[k];
      }
    for (int k = 0; k < N; ++k) fields[e0 + k * step] = Field<T>::put(f[k]);
    return;
  }
  for (int k = 0; k < N; ++k) f[k] = Field<T>::get(fields[e0 + k * step]);
  if (mode == 1) {
    u64 acc[N];
    for (int k = 0; k < N; ++k) acc[k] = 0;
    for (int r = 0; r < nrep; ++r)
      for (int k = 0; k < N; ++k) {
        const T x = ((const T*)p[r])[i0 + k * step];
        acc[k] += f[k] == Cut<T>::SPECIAL ? cut_special(x) : cut(x, f[k]);
      }
    for (int k = 0; k < N; ++k) sums[e0 + k * step] = acc[k];
    return;
  }
  T out[N];
  for (int k = 0; k < N; ++k) out[k] = uncut<T>((i64)sums[e0 + k * step], f[k], avg, divisor);
  for (int r = 0; r < nrep; ++r)
    for (int k = 0; k < N; ++k) ((T*)p[r])[i0 + k * step] = out[k];
}

template <class T>
__device__ void repro_stage(const Seg* segs, const u64* ptrs, int nseg, int nrep, u64 total,
                            u64* sums, typename Field<T>::F* fields, int mode, int avg,
                            double divisor) {
  for_each_chunk(
      segs, nseg, total,
      [&](int s, u64 e0, u64 i0) {
        stage_items<ITEMS_PER_THREAD, T>(ptrs + (u64)s * nrep, nrep, sums, fields, mode, avg,
                                         divisor, e0, i0, blockDim.x);
      },
      [&](int s, u64 e, u64 i) {
        stage_items<1, T>(ptrs + (u64)s * nrep, nrep, sums, fields, mode, avg, divisor, e, i, 0);
      });
}

#define REPRO_STAGE_KERNEL(T, NAME)                                                            \
  extern "C" __global__ void repro_stage_##NAME(const Seg* segs, const u64* ptrs, int nseg,   \
                                                int nrep, u64 total, u64* sums,               \
                                                Field<T>::F* fields, int mode, int avg,       \
                                                double divisor) {                             \
    repro_stage<T>(segs, ptrs, nseg, nrep, total, sums, fields, mode, avg, divisor);          \
  }                                                                                            \
  DPSYNC_KERNEL(repro_stage_##NAME)

REPRO_STAGE_KERNEL(float, f32)
REPRO_STAGE_KERNEL(double, f64)
