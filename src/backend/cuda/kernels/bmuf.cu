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
template <class T>
__device__ void bmuf(const Seg* segs, const u64* ptrs, int nseg, u64 total, int mode,
                     double mu_in, double eta_in) {
  typedef typename Num<T>::A S;
  const S mu = (S)mu_in, eta = (S)eta_in;
  for_each_element(segs, nseg, total, [&](int s, u64 e, u64 i) {
    T* p = (T*)ptrs[3 * (u64)s] + i;
    S* w = (S*)ptrs[3 * (u64)s + 1] + i;
    S* d = (S*)ptrs[3 * (u64)s + 2] + i;
    if (mode == 0) {
      *w = Num<T>::load(*p);
      *d = (S)0;
      return;
    }
    const S a = Num<T>::load(*p), w0 = *w, d0 = *d;
    const S wg = mode == 2 ? w0 + mu * d0 : w0;
    const S g = a - wg;
    const S d1 = mu * d0 + eta * g;
    const S w1 = w0 + d1;
    *d = d1;
    *w = w1;
    *p = Num<T>::store(mode == 2 ? w1 + mu * d1 : w1);
  });
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
