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
    /// Whether a reduce-scatter sums [`LANES`] elements at a time in registers
    /// ([`reduce_span`] with `only`): the types whose accumulator is the element itself.
    const IN_REGISTERS: bool = false;
    fn load(src: &[Self], acc: &mut [Self::Acc]);
    fn accumulate(src: &[Self], acc: &mut [Self::Acc]);
    /// `out = round(acc)` for SUM, `round(acc / divisor)` for AVG.
    fn store(acc: &[Self::Acc], op: ReduceOp, divisor: usize, out: &mut [Self]);
}

macro_rules! float_exact {
    ($t:ty) => {
        impl Reducible for $t {
            type Acc = $t;
            const IN_REGISTERS: bool = true;
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

/// Elements a reduce-scatter of an `IN_REGISTERS` type sums at a time: an accumulator of
/// 32 f32 fits the SSE registers, so each element costs one load per replica and one store
/// (the L1 accumulator of [`BLOCK`] costs a load and a store per replica more, which is what
/// a reduce-scatter, writing one replica, would otherwise spend its time on; in a standalone
/// copy of the kernel on the 2-core development VM, 16 and 64 were slower).
pub(crate) const LANES: usize = 32;

/// Reduces elements `[start, start + len)` of one segment: replicas summed in `order`, the
/// result written to every replica in `ptrs`, or to replica `only` alone (a reduce-scatter).
/// Every element is summed in the same order and rounded once either way, so both give the
/// same bytes.
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
    if let (Some(replica), true) = (only, T::IN_REGISTERS) {
        return reduce_span_to::<T>(ptrs, order, start, len, op, divisor, replica);
    }
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

/// [`reduce_span`] written to replica `only` alone, [`LANES`] elements at a time.
///
/// # Safety
/// As for [`reduce_span`].
unsafe fn reduce_span_to<T: Reducible>(
    ptrs: &[usize],
    order: &[usize],
    start: usize,
    len: usize,
    op: ReduceOp,
    divisor: usize,
    only: usize,
) {
    let mut done = 0;
    while done + LANES <= len {
        lanes::<T, LANES>(ptrs, order, start + done, op, divisor, only);
        done += LANES;
    }
    // The tail, one element at a time.
    while done < len {
        lanes::<T, 1>(ptrs, order, start + done, op, divisor, only);
        done += 1;
    }
}

/// Elements `[at, at + N)` of replica `only` := their sum over `order`.
///
/// # Safety
/// As for [`reduce_span`].
#[inline(always)]
unsafe fn lanes<T: Reducible, const N: usize>(
    ptrs: &[usize],
    order: &[usize],
    at: usize,
    op: ReduceOp,
    divisor: usize,
    only: usize,
) {
    let slice = |replica: usize| std::slice::from_raw_parts((ptrs[replica] as *const T).add(at), N);
    let mut acc = [T::Acc::default(); N];
    T::load(slice(order[0]), &mut acc);
    for &r in &order[1..] {
        T::accumulate(slice(r), &mut acc);
    }
    let out = std::slice::from_raw_parts_mut((ptrs[only] as *mut T).add(at), N);
    T::store(&acc, op, divisor, out);
}

/// Copies `bytes` from `src` to `dst`: with non-temporal stores where the target has them
/// (x86-64), so that a large copy writes memory without reading the destination first; the
/// copy is complete and ordered before this returns.
///
/// # Safety
/// Both ranges are valid and do not overlap; no other thread writes them.
pub unsafe fn copy_streaming(src: *const u8, dst: *mut u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Up to the destination's first 16-byte boundary, then 64 bytes a step (SSE2 is part
        // of x86-64), then the tail: plain copies.
        let head = dst.align_offset(16).min(bytes);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= bytes {
            let load = |k: usize| _mm_loadu_si128(src.add(i + k) as *const __m128i);
            let (a, b, c, d) = (load(0), load(16), load(32), load(48));
            _mm_stream_si128(dst.add(i) as *mut __m128i, a);
            _mm_stream_si128(dst.add(i + 16) as *mut __m128i, b);
            _mm_stream_si128(dst.add(i + 32) as *mut __m128i, c);
            _mm_stream_si128(dst.add(i + 48) as *mut __m128i, d);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), bytes - i);
        // Non-temporal stores are weakly ordered: fenced before anyone else may read them.
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src, dst, bytes);
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

    /// The reduce-scatter kernel gives the allreduce's bytes, element by element, and writes
    /// nothing of the other replicas.
    fn owned_equals_whole<T: Reducible + PartialEq + std::fmt::Debug>(
        make: impl Fn(usize, usize) -> T,
    ) {
        let n = BLOCK + LANES * 3 + 5;
        let order = [2, 0, 3, 1];
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let mut whole: Vec<Vec<T>> = (0..4)
                .map(|r| (0..n).map(|i| make(r, i)).collect())
                .collect();
            let mut owned = whole.clone();
            let before = owned.clone();
            let ptrs = |v: &mut Vec<Vec<T>>| -> Vec<usize> {
                v.iter_mut().map(|r| r.as_mut_ptr() as usize).collect()
            };
            let (pw, po) = (ptrs(&mut whole), ptrs(&mut owned));
            unsafe { reduce_span::<T>(&pw, &order, 0, n, op, 3, None) };
            let cut = [0, 7, LANES + 9, n - 3, n];
            for r in 0..4 {
                let (a, b) = (cut[r], cut[r + 1]);
                unsafe { reduce_span::<T>(&po, &order, a, b - a, op, 3, Some(r)) };
            }
            for r in 0..4 {
                for i in 0..n {
                    let mine = (cut[r]..cut[r + 1]).contains(&i);
                    let want = if mine { whole[r][i] } else { before[r][i] };
                    assert_eq!(owned[r][i], want, "{op:?} replica {r} element {i}");
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_gives_the_allreduce_bytes() {
        owned_equals_whole::<f32>(|r, i| (i as f32 * 0.1 + r as f32).sin() * 1e3);
        owned_equals_whole::<f64>(|r, i| (i as f64 * 0.1 - r as f64).cos() * 1e-3);
        owned_equals_whole::<f16>(|r, i| f16::from_f32((i + r) as f32 * 0.37));
        owned_equals_whole::<bf16>(|r, i| bf16::from_f32((i * r) as f32 * 0.37));
        owned_equals_whole::<i32>(|r, i| (i as i32).wrapping_mul(0x3fff_ffff) - r as i32);
        owned_equals_whole::<i64>(|r, i| (i as i64) << 40 | r as i64);
    }

    #[test]
    fn streaming_copies_are_exact_at_any_alignment() {
        let src: Vec<u8> = (0..1000).map(|i| (i * 7 % 251) as u8).collect();
        for (from, to, len) in [(0, 0, 1000), (3, 5, 900), (1, 0, 70), (0, 9, 63), (2, 2, 0)] {
            let mut dst = vec![0u8; 1000];
            unsafe { copy_streaming(src[from..].as_ptr(), dst[to..].as_mut_ptr(), len) };
            assert_eq!(&dst[to..to + len], &src[from..from + len]);
            assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0));
        }
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
