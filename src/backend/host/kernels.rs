//! Per-dtype block kernels: load one replica's block into an accumulator, add the others, and
//! round the result once. f16/bf16 accumulate in f32, i32 in i64, i64 in i128, so a sum is
//! rounded (or wrapped) exactly once whatever the replica count.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::types::ReduceOp;

/// Elements per block: every replica's block plus the accumulator and output blocks stay in
/// L1 (4 replicas x 2 KiB + 2 x 2 KiB for f32). 512..4096 measured alike within noise on the
/// 2-core development VM; 512 was best there (docs/PERFORMANCE.md).
pub(crate) const BLOCK: usize = 512;

pub trait Reducible: Copy + Default + Send + Sync + 'static {
    type Acc: Copy + Default;
    fn load(src: &[Self], acc: &mut [Self::Acc]);
    fn accumulate(src: &[Self], acc: &mut [Self::Acc]);
    /// `out = round(acc)` for SUM, `round(acc / divisor)` for AVG.
    fn store(acc: &[Self::Acc], op: ReduceOp, divisor: usize, out: &mut [Self]);
}

macro_rules! float_exact {
    ($t:ty) => {
        impl Reducible for $t {
            type Acc = $t;
            fn load(src: &[$t], acc: &mut [$t]) {
                acc.copy_from_slice(src);
            }
            fn accumulate(src: &[$t], acc: &mut [$t]) {
                for (a, s) in acc.iter_mut().zip(src) {
                    *a += *s;
                }
            }
            fn store(acc: &[$t], op: ReduceOp, divisor: usize, out: &mut [$t]) {
                match op {
                    ReduceOp::Sum => out.copy_from_slice(acc),
                    ReduceOp::Avg => {
                        let d = divisor as $t;
                        for (o, a) in out.iter_mut().zip(acc) {
                            *o = *a / d;
                        }
                    }
                }
            }
        }
    };
}
float_exact!(f32);
float_exact!(f64);

macro_rules! half_in_f32 {
    ($t:ty) => {
        impl Reducible for $t {
            type Acc = f32;
            fn load(src: &[$t], acc: &mut [f32]) {
                src.convert_to_f32_slice(acc);
            }
            fn accumulate(src: &[$t], acc: &mut [f32]) {
                let mut tmp = [0f32; BLOCK];
                let tmp = &mut tmp[..src.len()];
                src.convert_to_f32_slice(tmp);
                for (a, s) in acc.iter_mut().zip(tmp.iter()) {
                    *a += *s;
                }
            }
            fn store(acc: &[f32], op: ReduceOp, divisor: usize, out: &mut [$t]) {
                match op {
                    ReduceOp::Sum => out.convert_from_f32_slice(acc),
                    ReduceOp::Avg => {
                        let mut tmp = [0f32; BLOCK];
                        let tmp = &mut tmp[..acc.len()];
                        let d = divisor as f32;
                        for (t, a) in tmp.iter_mut().zip(acc) {
                            *t = *a / d;
                        }
                        out.convert_from_f32_slice(tmp);
                    }
                }
            }
        }
    };
}
half_in_f32!(f16);
half_in_f32!(bf16);

macro_rules! int_widened {
    ($t:ty, $wide:ty) => {
        impl Reducible for $t {
            type Acc = $wide;
            fn load(src: &[$t], acc: &mut [$wide]) {
                for (a, s) in acc.iter_mut().zip(src) {
                    *a = <$wide>::from(*s);
                }
            }
            fn accumulate(src: &[$t], acc: &mut [$wide]) {
                for (a, s) in acc.iter_mut().zip(src) {
                    *a = a.wrapping_add(<$wide>::from(*s));
                }
            }
            fn store(acc: &[$wide], op: ReduceOp, divisor: usize, out: &mut [$t]) {
                match op {
                    // Two's-complement wrap, as NCCL's integer sums.
                    ReduceOp::Sum => {
                        for (o, a) in out.iter_mut().zip(acc) {
                            *o = *a as $t;
                        }
                    }
                    ReduceOp::Avg => {
                        let d = divisor as $wide;
                        for (o, a) in out.iter_mut().zip(acc) {
                            *o = (*a / d) as $t;
                        }
                    }
                }
            }
        }
    };
}
int_widened!(i32, i64);
int_widened!(i64, i128);

/// Reduces elements `[start, start + len)` of one segment: replicas summed in `order`, the
/// result written to every replica in `ptrs`, or to replica `only` alone (a reduce-scatter).
///
/// # Safety
/// Every `ptrs[r]` is valid for `start + len` elements of `T`; replicas do not overlap; no other
/// thread touches this range.
pub unsafe fn reduce_span<T: Reducible>(
    ptrs: &[usize],
    order: &[usize],
    start: usize,
    len: usize,
    op: ReduceOp,
    divisor: usize,
    only: Option<usize>,
) {
    let mut acc = [T::Acc::default(); BLOCK];
    let mut out = [T::default(); BLOCK];
    let mut done = 0;
    while done < len {
        let n = BLOCK.min(len - done);
        let at = |replica: usize| (ptrs[replica] as *mut T).add(start + done);
        T::load(std::slice::from_raw_parts(at(order[0]), n), &mut acc[..n]);
        for &r in &order[1..] {
            T::accumulate(std::slice::from_raw_parts(at(r), n), &mut acc[..n]);
        }
        match only {
            Some(replica) => T::store(
                &acc[..n],
                op,
                divisor,
                std::slice::from_raw_parts_mut(at(replica), n),
            ),
            None => {
                T::store(&acc[..n], op, divisor, &mut out[..n]);
                for replica in 0..ptrs.len() {
                    std::ptr::copy_nonoverlapping(out.as_ptr(), at(replica), n);
                }
            }
        }
        done += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce<T: Reducible>(mut replicas: Vec<Vec<T>>, op: ReduceOp) -> Vec<Vec<T>> {
        let ptrs: Vec<usize> = replicas
            .iter_mut()
            .map(|r| r.as_mut_ptr() as usize)
            .collect();
        let order: Vec<usize> = (0..ptrs.len()).collect();
        let len = replicas[0].len();
        unsafe { reduce_span::<T>(&ptrs, &order, 0, len, op, ptrs.len(), None) };
        replicas
    }

    #[test]
    fn halves_accumulate_in_f32_and_round_once() {
        // 2048 + 1 + 1 in f16 step by step rounds back to 2048 twice; in f32 it is 2050.
        let r = reduce(
            vec![vec![f16::from_f32(2048.0)], vec![f16::ONE], vec![f16::ONE]],
            ReduceOp::Sum,
        );
        assert!(r.iter().all(|v| v[0] == f16::from_f32(2050.0)));
        let r = reduce(
            vec![vec![bf16::from_f32(3.0)], vec![bf16::from_f32(4.0)]],
            ReduceOp::Avg,
        );
        assert!(r.iter().all(|v| v[0] == bf16::from_f32(3.5)));
    }

    #[test]
    fn integers_wrap_on_sum_and_truncate_on_average() {
        let r = reduce(vec![vec![i32::MAX, -7], vec![1, 0]], ReduceOp::Sum);
        assert_eq!(r[1], vec![i32::MIN, -7]);
        let r = reduce(vec![vec![i32::MAX, -7], vec![i32::MAX, 0]], ReduceOp::Avg);
        assert_eq!(r[0], vec![i32::MAX, -3]);
        let r = reduce(
            vec![vec![i64::MAX], vec![i64::MAX], vec![i64::MAX]],
            ReduceOp::Avg,
        );
        assert_eq!(r[2], vec![i64::MAX]);
    }

    #[test]
    fn spans_longer_than_a_block_are_reduced_everywhere() {
        let n = BLOCK * 2 + 3;
        let replicas: Vec<Vec<f64>> = (0..3)
            .map(|r| (0..n).map(|i| (i * 3 + r) as f64).collect())
            .collect();
        let r = reduce(replicas, ReduceOp::Sum);
        for v in &r {
            for (i, x) in v.iter().enumerate() {
                assert_eq!(*x, (9 * i + 3) as f64);
            }
        }
    }
}
