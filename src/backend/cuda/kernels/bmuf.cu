// BMUF: one launch per bucket and replica, after the averaging collective left the mean A in
// the params. The table is a walk table with three pointers per segment: ptrs[3s] the params
// (T), ptrs[3s + 1] the global model W and ptrs[3s + 2] the block momentum D (both S, the
// accumulation type: f32 for f32/f16/bf16, f64 for f64). The module is compiled with
// --fmad=false: every operation is rounded as written, like the host backend's, so both give
// the same bytes (formula: Backend::bmuf_update in src/backend/mod.rs).
//
// mode 0: W := widen(params), D := 0                  (bmuf_init)
// mode 1: classical block momentum                    (bmuf_step)
// mode 2: Nesterov block momentum                     (bmuf_step)

// N elements of one segment, i0 + k * step within it, k < N; `q` its three pointers. All the
// loads are issued before any is used.
template <int N, class T>
__device__ __forceinline__ void bmuf_items(const u64* q, int mode, typename Num<T>::A mu,
                                           typename Num<T>::A eta, u64 i0, u64 step) {
  typedef typename Num<T>::A S;
  T* p = (T*)q[0];
  S* w = (S*)q[1];
  S* d = (S*)q[2];
  if (mode == 0) {
    for (int k = 0; k < N; ++k) {
      w[i0 + k * step] = Num<T>::load(p[i0 + k * step]);
      d[i0 + k * step] = (S)0;
    }
    return;
  }
  S a[N], w0[N], d0[N];
  for (int k = 0; k < N; ++k) {
    a[k] = Num<T>::load(p[i0 + k * step]);
    w0[k] = w[i0 + k * step];
    d0[k] = d[i0 + k * step];
  }
  for (int k = 0; k < N; ++k) {
    const S wg = mode == 2 ? w0[k] + mu * d0[k] : w0[k];
    const S g = a[k] - wg;
    const S d1 = mu * d0[k] + eta * g;
    const S w1 = w0[k] + d1;
    d[i0 + k * step] = d1;
    w[i0 + k * step] = w1;
    p[i0 + k * step] = Num<T>::store(mode == 2 ? w1 + mu * d1 : w1);
  }
}

template <class T>
__device__ void bmuf(const Seg* segs, const u64* ptrs, int nseg, u64 total, int mode,
                     double mu_in, double eta_in) {
  typedef typename Num<T>::A S;
  const S mu = (S)mu_in, eta = (S)eta_in;
  for_each_chunk(
      segs, nseg, total,
      [&](int s, u64, u64 i0) {
        bmuf_items<ITEMS_PER_THREAD, T>(ptrs + 3 * (u64)s, mode, mu, eta, i0, blockDim.x);
      },
      [&](int s, u64, u64 i) { bmuf_items<1, T>(ptrs + 3 * (u64)s, mode, mu, eta, i, 0); });
}

#define BMUF_KERNELS(T, NAME)                                                                 \
  extern "C" __global__ void bmuf_##NAME(const Seg* segs, const u64* ptrs, int nseg,          \
                                         u64 total, int mode, double mu, double eta) {        \
    bmuf<T>(segs, ptrs, nseg, total, mode, mu, eta);                                          \
  }                                                                                           \
  DPSYNC_KERNEL(bmuf_##NAME)

BMUF_KERNELS(float, f32)
BMUF_KERNELS(double, f64)
BMUF_KERNELS(f16_t, f16)
BMUF_KERNELS(bf16_t, bf16)
