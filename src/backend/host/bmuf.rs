//! Host kernels of the BMUF primitives. One pass per call: block by block, the params are
//! widened into an L1-resident buffer, the filter runs over it and the state, and the result is
//! rounded back into the params while their cache lines are still hot. Memory traffic per element
//! is one read and one write of the param, `W` and `D`: a copy of the bytes the update touches.
//! Large buckets are split over threads like the allreduce (`HostBackend::for_each_span`).

use std::ops::{Add, Mul, Sub};

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::kernels::BLOCK;
use super::HostBackend;
use crate::backend::{bmuf_state_dtype, BmufFilter, BmufSpan, BucketView, Segment};
use crate::types::DType;

/// The type `W` and `D` are kept in (f32 or f64).
trait StateFloat:
    Copy + Default + Send + Sync + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self>
{
    fn from_f64(x: f64) -> Self;
}

impl StateFloat for f32 {
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
}

impl StateFloat for f64 {
    fn from_f64(x: f64) -> f64 {
        x
    }
}

/// A PARAM element type and the conversions between it and its state type.
trait ParamFloat: Copy + Send + Sync + 'static {
    type S: StateFloat;
    /// Exact.
    fn widen(src: &[Self], dst: &mut [Self::S]);
    /// Round to nearest even.
    fn narrow(src: &[Self::S], dst: &mut [Self]);
}

macro_rules! same_width {
    ($t:ty) => {
        impl ParamFloat for $t {
            type S = $t;
            fn widen(src: &[$t], dst: &mut [$t]) {
                dst.copy_from_slice(src);
            }
            fn narrow(src: &[$t], dst: &mut [$t]) {
                dst.copy_from_slice(src);
            }
        }
    };
}
same_width!(f32);
same_width!(f64);

macro_rules! half_in_f32 {
    ($t:ty) => {
        impl ParamFloat for $t {
            type S = f32;
            fn widen(src: &[$t], dst: &mut [f32]) {
                src.convert_to_f32_slice(dst);
            }
            fn narrow(src: &[f32], dst: &mut [$t]) {
                dst.convert_from_f32_slice(src);
            }
        }
    };
}
half_in_f32!(f16);
half_in_f32!(bf16);

/// `w = widen(params)`, `d = 0` over `len` elements.
///
/// # Safety
/// The three ranges are valid for `len` elements and touched by no other thread.
unsafe fn load_range<P: ParamFloat>(params: *const P, w: *mut P::S, d: *mut P::S, len: usize) {
    P::widen(
        std::slice::from_raw_parts(params, len),
        std::slice::from_raw_parts_mut(w, len),
    );
    std::slice::from_raw_parts_mut(d, len).fill(P::S::default());
}

/// The filter over `len` elements (formula: `Backend::bmuf_update`). `NESTEROV` is a constant
/// so that each variant compiles to its own branch-free, vectorised loop.
///
/// # Safety
/// As for [`load_range`].
unsafe fn update_range<P: ParamFloat, const NESTEROV: bool>(
    params: *mut P,
    w: *mut P::S,
    d: *mut P::S,
    len: usize,
    mu: P::S,
    eta: P::S,
) {
    let mut buf = [P::S::default(); BLOCK];
    let mut done = 0;
    while done < len {
        let n = BLOCK.min(len - done);
        let p = std::slice::from_raw_parts_mut(params.add(done), n);
        let w = std::slice::from_raw_parts_mut(w.add(done), n);
        let d = std::slice::from_raw_parts_mut(d.add(done), n);
        let a = &mut buf[..n];
        P::widen(p, a);
        for ((a, w), d) in a.iter_mut().zip(w.iter_mut()).zip(d.iter_mut()) {
            let wg = if NESTEROV { *w + mu * *d } else { *w };
            let g = *a - wg;
            let d_new = mu * *d + eta * g;
            let w_new = *w + d_new;
            *d = d_new;
            *w = w_new;
            *a = if NESTEROV { w_new + mu * d_new } else { w_new };
        }
        P::narrow(a, p);
        done += n;
    }
}

/// The spans as a bucket whose "replicas" are the three streams (params, W, D) of one element,
/// so that the allreduce's splitter threads them: `ptrs[0]`, `[1]`, `[2]`.
fn streams(spans: &[BmufSpan]) -> Vec<[usize; 3]> {
    spans.iter().map(|s| [s.params, s.w, s.d]).collect()
}

fn as_bucket<'a>(dtype: DType, spans: &[BmufSpan], ptrs: &'a [[usize; 3]]) -> BucketView<'a> {
    BucketView {
        dtype,
        segments: spans
            .iter()
            .zip(ptrs)
            .map(|(s, p)| Segment {
                ptrs: p,
                count: s.count,
            })
            .collect(),
    }
}

/// Element `start` of stream `k` of a segment, typed.
fn at<T>(seg: &Segment<'_>, k: usize, start: usize) -> *mut T {
    (seg.ptrs[k] as *mut T).wrapping_add(start)
}

impl HostBackend {
    /// Bytes read plus written per element by the filter (params, W, D), for the threading rule.
    fn bmuf_bytes_per_element(dtype: DType) -> usize {
        let state = bmuf_state_dtype(dtype).map_or(0, DType::size);
        2 * (dtype.size() + 2 * state)
    }

    /// `Backend::bmuf_load` on host memory.
    ///
    /// # Safety
    /// As for `Backend::bmuf_load`.
    pub(super) unsafe fn host_bmuf_load(&self, dtype: DType, spans: &[BmufSpan]) {
        let ptrs = streams(spans);
        let bucket = as_bucket(dtype, spans, &ptrs);
        macro_rules! run {
            ($t:ty) => {
                self.for_each_span(
                    &bucket,
                    Self::bmuf_bytes_per_element(dtype),
                    |seg, start, len| unsafe {
                        load_range::<$t>(
                            at(seg, 0, start),
                            at(seg, 1, start),
                            at(seg, 2, start),
                            len,
                        )
                    },
                )
            };
        }
        match dtype {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::F16 => run!(f16),
            DType::Bf16 => run!(bf16),
            // exec refuses integer PARAMs at bmuf_init; reaching this is a defect there.
            DType::I32 | DType::I64 => unreachable!("BMUF state for an integer PARAM"),
        }
    }

    /// `Backend::bmuf_update` on host memory.
    ///
    /// # Safety
    /// As for `Backend::bmuf_update`.
    pub(super) unsafe fn host_bmuf_update(
        &self,
        dtype: DType,
        spans: &[BmufSpan],
        filter: &BmufFilter,
    ) {
        let ptrs = streams(spans);
        let bucket = as_bucket(dtype, spans, &ptrs);
        macro_rules! run {
            ($t:ty, $nesterov:literal) => {{
                type S = <$t as ParamFloat>::S;
                let mu = S::from_f64(filter.block_momentum);
                let eta = S::from_f64(filter.block_lr);
                self.for_each_span(
                    &bucket,
                    Self::bmuf_bytes_per_element(dtype),
                    |seg, start, len| unsafe {
                        update_range::<$t, $nesterov>(
                            at(seg, 0, start),
                            at(seg, 1, start),
                            at(seg, 2, start),
                            len,
                            mu,
                            eta,
                        )
                    },
                )
            }};
            ($t:ty) => {
                if filter.nesterov {
                    run!($t, true)
                } else {
                    run!($t, false)
                }
            };
        }
        match dtype {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::F16 => run!(f16),
            DType::Bf16 => run!(bf16),
            DType::I32 | DType::I64 => unreachable!("BMUF update of an integer PARAM"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

    fn spans_of<P, S>(params: &mut [P], w: &mut [S], d: &mut [S]) -> Vec<BmufSpan> {
        // Two spans over one buffer: the second starts mid-block, as tensors in a bucket do.
        let split = params.len() / 3;
        let p = params.as_mut_ptr();
        let (wp, dp) = (w.as_mut_ptr(), d.as_mut_ptr());
        vec![
            BmufSpan {
                params: p as usize,
                w: wp as usize,
                d: dp as usize,
                count: split,
            },
            BmufSpan {
                params: p.wrapping_add(split) as usize,
                w: wp.wrapping_add(split) as usize,
                d: dp.wrapping_add(split) as usize,
                count: params.len() - split,
            },
        ]
    }

    #[test]
    fn classical_and_nesterov_steps_follow_the_formula_exactly() {
        // Values chosen so that every operation is exact in f32: the expected bytes are known.
        let backend = HostBackend::new();
        for nesterov in [false, true] {
            let n = BLOCK + 7;
            let mut params: Vec<f32> = (0..n).map(|i| (i % 16) as f32).collect();
            let (mut w, mut d) = (vec![9.0f32; n], vec![9.0f32; n]);
            let spans = spans_of(&mut params, &mut w, &mut d);
            unsafe { backend.bmuf_load(0, DType::F32, &spans).unwrap() };
            assert!(w.iter().zip(0..).all(|(x, i)| *x == (i % 16) as f32));
            assert!(d.iter().all(|x| *x == 0.0));
            // Block 1: local training moved every param by +2 (A = W + 2).
            params.iter_mut().for_each(|p| *p += 2.0);
            let filter = BmufFilter {
                block_lr: 1.0,
                block_momentum: 0.5,
                nesterov,
                default_momentum: false,
            };
            unsafe { backend.bmuf_update(1, DType::F32, &spans, &filter).unwrap() };
            for i in 0..n {
                let w0 = (i % 16) as f32;
                // G = 2, D = 2, W = w0 + 2; Nesterov shows W + 0.5 D = w0 + 3.
                assert_eq!(d[i], 2.0);
                assert_eq!(w[i], w0 + 2.0);
                assert_eq!(params[i], if nesterov { w0 + 3.0 } else { w0 + 2.0 });
            }
            // Block 2: no local progress (A = the model the block started from): G = 0, so
            // D halves and W still moves by it.
            unsafe { backend.bmuf_update(1, DType::F32, &spans, &filter).unwrap() };
            for i in 0..n {
                let w0 = (i % 16) as f32;
                assert_eq!(d[i], 1.0, "nesterov {nesterov}");
                assert_eq!(w[i], w0 + 3.0);
                assert_eq!(params[i], if nesterov { w0 + 3.5 } else { w0 + 3.0 });
            }
        }
    }

    #[test]
    fn half_params_keep_f32_state_and_round_once() {
        let backend = HostBackend::new();
        let mut params = vec![bf16::from_f32(1.0); 30];
        let (mut w, mut d) = (vec![0f32; 30], vec![0f32; 30]);
        let spans = spans_of(&mut params, &mut w, &mut d);
        unsafe { backend.bmuf_load(0, DType::Bf16, &spans).unwrap() };
        // A block moved the params by one bf16 ulp at 1.0 (2^-7); eta = 0.25 keeps a quarter of
        // it in W, which only f32 state can hold; the param rounds back to 1.0.
        params
            .iter_mut()
            .for_each(|p| *p = bf16::from_f32(1.0 + 2f32.powi(-7)));
        let filter = BmufFilter {
            block_lr: 0.25,
            block_momentum: 0.0,
            nesterov: false,
            default_momentum: false,
        };
        unsafe {
            backend
                .bmuf_update(0, DType::Bf16, &spans, &filter)
                .unwrap()
        };
        assert!(w.iter().all(|x| *x == 1.0 + 2f32.powi(-9)));
        assert!(params.iter().all(|p| *p == bf16::from_f32(1.0)));
    }

    #[test]
    fn large_buckets_are_threaded_with_the_same_result() {
        // 200 000 f32 elements touch 4.8 MB: split over threads when there are several.
        let n = 200_000;
        let run = |threads: usize| {
            let backend = HostBackend {
                max_threads: threads,
                ..HostBackend::new()
            };
            let mut params: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
            let (mut w, mut d) = (vec![0f32; n], vec![0f32; n]);
            let spans = spans_of(&mut params, &mut w, &mut d);
            unsafe { backend.bmuf_load(0, DType::F32, &spans).unwrap() };
            params.iter_mut().for_each(|p| *p = *p * 0.75 + 0.125);
            let filter = BmufFilter {
                block_lr: 0.9,
                block_momentum: 0.7,
                nesterov: true,
                default_momentum: false,
            };
            unsafe { backend.bmuf_update(0, DType::F32, &spans, &filter).unwrap() };
            (params, w, d)
        };
        assert_eq!(run(1), run(4));
    }
}
