//! Reproducible sums (`dpsync_options_set_reproducible`), the host's kernels. Per element, `E`
//! is the largest exponent field over every contribution in the world; each contribution is
//! cut to an `i64` on the grid `2^(E - bias - 49)` (rounded to nearest, ties to even), the
//! integers are summed exactly, and the sum is turned back into the dtype once. Integer
//! addition is associative, so the result is a function of the multiset of contributions: any
//! order, thread split, engine or arrangement of replicas gives the same bytes.
//! docs/ARCHITECTURE.md "Reproducible sums" gives the error bound and the cost.
//!
//! The pieces are separate ([`exponents`], [`cut_sum`], [`uncut`]) so that a world can take
//! the maximum of `E` and the sum of the integers across its ranks between them;
//! [`reduce_span`] runs all three block by block while the block is in cache (one process).

use half::{bf16, f16};

use crate::backend::{BucketView, Segment};
use crate::types::DType;

/// Grid bits below the leading bit of the element's largest possible contribution: a
/// contribution is below `2^(E - bias + 1)`, so its integer is at most `2^50`, and 4096 of them
/// sum below `2^62`.
const GRID: i32 = 49;

/// `y + MAGIC`, for `|y| < 2^51`, is a double whose low mantissa bits are `y` rounded to the
/// nearest integer (ties to even): a rounding conversion SSE2 vectorizes, unlike `as i64`.
const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52

/// An infinity or NaN among the contributions makes `E` the all-ones field; each contribution
/// then counts as one of these (at most 4096 of each fit in 16 bits), and the counts decide.
const POS_INF: i64 = 1;
const NEG_INF: i64 = 1 << 16;
const NAN: i64 = 1 << 32;

/// Elements per block of [`reduce_span`]: exponents, integers and the result of a block stay
/// in L1 while every replica's block is read twice. On the 2-core development VM 256 measured
/// 1.41-1.46x the plain allreduce, 128 alike, 512 1.62x, 1024 1.66-1.89x (benches/repro.rs).
const BLOCK: usize = 256;

/// `$body` with `$t` naming the Rust type of a float `$dtype`; `$int` for the integer dtypes
/// (their sums are exact without cutting).
macro_rules! for_float {
    ($dtype:expr, $t:ident => $body:expr, _ => $int:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            DType::Bf16 => {
                type $t = half::bf16;
                $body
            }
            DType::I32 | DType::I64 => $int,
        }
    };
}
pub(crate) use for_float;

/// A floating-point dtype's bit layout.
pub(crate) trait Cut: Copy + Default + Send + Sync + 'static {
    /// Explicit fraction bits.
    const FRAC: u32;
    /// Exponent field bits.
    const EXP_BITS: u32;
    const BIAS: i32;
    fn bits(self) -> u64;
    fn widen(self) -> f64;
    /// One rounding to nearest, ties to even.
    fn narrow(x: f64) -> Self;
    /// The all-ones exponent field.
    const SPECIAL: u16 = ((1u32 << Self::EXP_BITS) - 1) as u16;
}

macro_rules! cut {
    ($t:ty, $frac:expr, $exp:expr, $bias:expr, $bits:expr, $widen:expr, $narrow:expr) => {
        impl Cut for $t {
            const FRAC: u32 = $frac;
            const EXP_BITS: u32 = $exp;
            const BIAS: i32 = $bias;
            #[inline(always)]
            fn bits(self) -> u64 {
                $bits(self) as u64
            }
            #[inline(always)]
            fn widen(self) -> f64 {
                $widen(self)
            }
            #[inline(always)]
            fn narrow(x: f64) -> $t {
                $narrow(x)
            }
        }
    };
}
cut!(f32, 23, 8, 127, f32::to_bits, f64::from, |x| x as f32);
cut!(f64, 52, 11, 1023, f64::to_bits, |x| x, |x| x);
cut!(f16, 10, 5, 15, f16::to_bits, f16::to_f64, f16::from_f64);
// Widened exactly: a bf16 is the top half of an f32.
cut!(
    bf16,
    7,
    8,
    127,
    bf16::to_bits,
    |x: bf16| f64::from(f32::from_bits((x.to_bits() as u32) << 16)),
    bf16::from_f64
);

/// The exponent field of `x`, at least 1 (subnormals and zeros share the smallest normal
/// exponent's scale).
#[inline(always)]
fn field<T: Cut>(x: T) -> u16 {
    (((x.bits() >> T::FRAC) as u32 & T::SPECIAL as u32) as u16).max(1)
}

/// `2^k` for `k` in the normal range.
#[inline(always)]
fn pow2(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// `x * 2^k`: one multiplication where `2^k` is a normal double (every dtype but f64), two
/// where it may not be (f64 grids reach `2^1071`); exact until the product is far below the
/// grid, where it rounds to 0 either way.
#[inline(always)]
fn scale<T: Cut>(x: f64, k: i32) -> f64 {
    if T::EXP_BITS > 8 {
        let half = k / 2;
        x * pow2(k - half) * pow2(half)
    } else {
        x * pow2(k)
    }
}

/// `x` on the grid of exponent field `e` (not the all-ones field).
#[inline(always)]
fn cut<T: Cut>(x: T, e: u16) -> i64 {
    let y = scale::<T>(x.widen(), T::BIAS + GRID - e as i32);
    ((y + MAGIC).to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64)
}

/// What `x` counts for when the element's field is the all-ones one.
#[inline]
fn cut_special<T: Cut>(x: T) -> i64 {
    let bits = x.bits();
    let frac = bits & ((1u64 << T::FRAC) - 1);
    let negative = bits >> (T::FRAC + T::EXP_BITS) & 1 == 1;
    match (field(x) == T::SPECIAL, frac != 0, negative) {
        (false, ..) => 0,
        (true, true, _) => NAN,
        (true, false, false) => POS_INF,
        (true, false, true) => NEG_INF,
    }
}

/// The sum `s` on the grid of field `e`, divided by `avg` when given, in the dtype.
#[inline]
fn uncut<T: Cut>(s: i64, e: u16, avg: Option<usize>) -> T {
    if e == T::SPECIAL {
        let count = |unit: i64| (s / unit) & 0xFFFF;
        let v = match (count(NAN), count(POS_INF), count(NEG_INF)) {
            (0, 0, _) => f64::NEG_INFINITY,
            (0, _, 0) => f64::INFINITY,
            _ => f64::NAN,
        };
        return T::narrow(v);
    }
    uncut_finite(s, e, avg)
}

/// [`uncut`] of a field that is not the all-ones one, without branches (it vectorizes).
#[inline(always)]
fn uncut_finite<T: Cut>(s: i64, e: u16, avg: Option<usize>) -> T {
    let k = e as i32 - T::BIAS - GRID;
    let v = s as f64;
    // f64 grids go below the normal range (to 2^-1071): there the sum is scaled in two steps,
    // the first exact, the second rounding once; elsewhere the second step is a times 1.
    let v = if T::EXP_BITS > 8 {
        let first = k.max(-1000);
        v * pow2(first) * pow2(k - first)
    } else {
        v * pow2(k)
    };
    T::narrow(match avg {
        Some(w) => v / w as f64,
        None => v,
    })
}

/// `exps[i] := max(exps[i], field(src[i]))`.
#[inline]
fn max_fields<T: Cut>(src: &[T], exps: &mut [u16]) {
    for (e, &x) in exps.iter_mut().zip(src) {
        *e = (*e).max(field(x));
    }
}

/// `acc[i] += cut(src[i], exps[i])`, or `=` for the `first` contribution (the integers are
/// not read: at a few bytes per element, that is a pass over memory saved); `special`: some
/// element's field is the all-ones one.
#[inline]
fn cut_add<T: Cut>(src: &[T], exps: &[u16], acc: &mut [i64], (special, first): (bool, bool)) {
    let items = acc.iter_mut().zip(src).zip(exps);
    let any = |x: T, e: u16| match e == T::SPECIAL {
        true => cut_special(x),
        false => cut(x, e),
    };
    // Separate loops so that each is free of branches.
    match (special, first) {
        (true, true) => items.for_each(|((a, &x), &e)| *a = any(x, e)),
        (true, false) => items.for_each(|((a, &x), &e)| *a = a.wrapping_add(any(x, e))),
        (false, true) => items.for_each(|((a, &x), &e)| *a = cut(x, e)),
        (false, false) => items.for_each(|((a, &x), &e)| *a = a.wrapping_add(cut(x, e))),
    }
}

/// `$name`: `$inner` compiled for AVX-512 and AVX2 besides the baseline, the widest the CPU
/// runs picked at each call. The same operations at any width (no contraction into fused
/// multiply-adds, every conversion rounding to nearest), so every variant gives the same bytes.
macro_rules! widest {
    (unsafe $name:ident, $inner:ident, ($($arg:ident: $ty:ty),*)) => {
        /// # Safety
        /// As for the function it runs.
        #[inline]
        unsafe fn $name<T: Cut>($($arg: $ty),*) {
            #[allow(unused_unsafe)]
            unsafe { widest!(@body $inner, ($($arg),*), ($($arg: $ty),*)) }
        }
    };
    ($name:ident, $inner:ident, ($($arg:ident: $ty:ty),*)) => {
        #[inline]
        fn $name<T: Cut>($($arg: $ty),*) {
            #[allow(unused_unsafe)]
            unsafe { widest!(@body $inner, ($($arg),*), ($($arg: $ty),*)) }
        }
    };
    (@body $inner:ident, ($($a:ident),*), ($($arg:ident: $ty:ty),*)) => {{
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl")]
                unsafe fn avx512<T: Cut>($($arg: $ty),*) {
                    #[allow(unused_unsafe)]
                    unsafe { $inner::<T>($($a),*) }
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2<T: Cut>($($arg: $ty),*) {
                    #[allow(unused_unsafe)]
                    unsafe { $inner::<T>($($a),*) }
                }
                // The CPU runs the features each variant was compiled for.
                if std::arch::is_x86_feature_detected!("avx512dq") {
                    return avx512::<T>($($a),*);
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    return avx2::<T>($($a),*);
                }
            }
            $inner::<T>($($a),*)
    }};
}

widest!(max_fields_wide, max_fields, (src: &[T], exps: &mut [u16]));
widest!(cut_add_wide, cut_add, (src: &[T], exps: &[u16], acc: &mut [i64], flags: (bool, bool)));
widest!(uncut_wide, uncut_block, (acc: &[i64], exps: &[u16], avg: Option<usize>, out: &mut [T], special: bool));

/// `out[i] := uncut(acc[i], exps[i])`; `special`: some field is the all-ones one.
#[inline(always)]
fn uncut_block<T: Cut>(
    acc: &[i64],
    exps: &[u16],
    avg: Option<usize>,
    out: &mut [T],
    special: bool,
) {
    let items = out.iter_mut().zip(acc).zip(exps);
    match (special, avg) {
        (true, _) => items.for_each(|((o, &s), &e)| *o = uncut(s, e, avg)),
        // Separate loops so that each is free of branches.
        (false, None) => items.for_each(|((o, &s), &e)| *o = uncut_finite(s, e, None)),
        (false, Some(w)) => items.for_each(|((o, &s), &e)| *o = uncut_finite(s, e, Some(w))),
    }
}

/// Reduces elements `[start, start + len)` of one segment in one pass: each block's exponents
/// over `members`, their integers, and the result written to every replica of `write`.
///
/// # Safety
/// As for [`super::kernels::reduce_span`].
pub(super) unsafe fn reduce_span<T: Cut>(
    ptrs: &[usize],
    (members, write): (&[usize], &[usize]),
    start: usize,
    len: usize,
    avg: Option<usize>,
) {
    reduce_span_wide::<T>(ptrs, (members, write), start, len, avg)
}

/// [`reduce_span`] of one float dtype's elements `[0, len)` of `ptrs` (every contribution),
/// the result written to `ptrs[write]`: the MPI engine's reduction of a ring block whose
/// contributions sit in the ranks' slots of shared memory (backend/mpi/ring.rs).
///
/// # Safety
/// Every pointer holds `len` aligned elements of `dtype`; `ptrs[write]` is writable.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) unsafe fn reduce_ptrs(
    dtype: DType,
    ptrs: &[usize],
    write: usize,
    len: usize,
    avg: Option<usize>,
) {
    let members: Vec<usize> = (0..ptrs.len()).collect();
    let mw = (&members[..], &[write][..]);
    for_float!(dtype, T => reduce_span::<T>(ptrs, mw, 0, len, avg),
        _ => unreachable!("integer sums are exact without cutting"))
}

widest!(unsafe reduce_span_wide, reduce_span_any, (
    ptrs: &[usize],
    mw: (&[usize], &[usize]),
    start: usize,
    len: usize,
    avg: Option<usize>
));

#[inline(always)]
unsafe fn reduce_span_any<T: Cut>(
    ptrs: &[usize],
    (members, write): (&[usize], &[usize]),
    start: usize,
    len: usize,
    avg: Option<usize>,
) {
    let mut exps = [0u16; BLOCK];
    let mut acc = [0i64; BLOCK];
    let mut out = [T::default(); BLOCK];
    let mut done = 0;
    while done < len {
        let n = BLOCK.min(len - done);
        let at = |replica: usize| (ptrs[replica] as *mut T).add(start + done);
        let block = |replica: usize| std::slice::from_raw_parts(at(replica), n);
        exps[..n].fill(1);
        for &r in members {
            max_fields(block(r), &mut exps[..n]);
        }
        let special = exps[..n].contains(&T::SPECIAL);
        for (k, &r) in members.iter().enumerate() {
            cut_add(block(r), &exps[..n], &mut acc[..n], (special, k == 0));
        }
        uncut_block(&acc[..n], &exps[..n], avg, &mut out[..n], special);
        for &r in write {
            std::ptr::copy_nonoverlapping(out.as_ptr(), at(r), n);
        }
        done += n;
    }
}

/// A coalesced sparse gradient's run of rows with one index (`positions` into `src`, rows of
/// `row_len`) summed reproducibly into `dst`.
///
/// # Safety
/// `src` holds every position's row, `dst` one row, as `T`.
pub(super) unsafe fn sum_rows<T: Cut>(src: usize, positions: &[usize], row_len: usize, dst: usize) {
    let size = std::mem::size_of::<T>();
    let mut ptrs: Vec<usize> = (positions.iter())
        .map(|p| src + p * row_len * size)
        .collect();
    ptrs.push(dst);
    let members: Vec<usize> = (0..positions.len()).collect();
    reduce_span::<T>(&ptrs, (&members, &[positions.len()]), 0, row_len, None);
}

/// The exponent fields as they cross the ranks: one byte each where the field fits (every
/// dtype but f64), two otherwise.
pub(crate) fn field_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F64 => 2,
        _ => 1,
    }
}

/// [`super::for_each_range`] with at least 64 Ki elements per thread.
fn for_each_range<F>(bucket: &BucketView<'_>, threads: usize, f: F)
where
    F: Fn(&Segment<'_>, usize, usize, usize) + Sync,
{
    let threads = threads.clamp(1, (bucket.elements() / (64 << 10)).max(1));
    super::for_each_range(bucket, threads, f)
}

/// A mutable slice shared by threads that write disjoint ranges of it.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// # Safety
    /// `[at, at + n)` is inside the slice and no other thread touches it.
    unsafe fn range<'a>(self, at: usize, n: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), n)
    }
}

macro_rules! by_float {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::Bf16 => $f::<bf16>($($arg),*),
            DType::I32 | DType::I64 => unreachable!("integer sums are exact already"),
        }
    };
}

/// `exps[i] := max(exps[i], field of element i on each of `members`)` over the bucket
/// (`exps` starts at 1s, or at another rank's maxima).
///
/// # Safety
/// Every member's pointers are valid host memory for their segments.
pub(crate) unsafe fn exponents(
    bucket: &BucketView<'_>,
    members: &[usize],
    exps: &mut [u16],
    threads: usize,
) {
    unsafe fn run<T: Cut>(b: &BucketView<'_>, m: &[usize], e: Shared<u16>, threads: usize) {
        for_each_range(b, threads, |seg, start, n, at| {
            let exps = e.range(at, n);
            for &r in m {
                let src = std::slice::from_raw_parts((seg.ptrs[r] as *const T).add(start), n);
                max_fields_wide(src, exps);
            }
        });
    }
    by_float!(
        bucket.dtype,
        run,
        bucket,
        members,
        Shared(exps.as_mut_ptr()),
        threads
    )
}

/// `acc[i] := Σ over members of element i cut on the grid of `exps[i]`.
///
/// # Safety
/// As for [`exponents`].
pub(crate) unsafe fn cut_sum(
    bucket: &BucketView<'_>,
    members: &[usize],
    exps: &[u16],
    acc: &mut [i64],
    threads: usize,
) {
    unsafe fn run<T: Cut>(
        b: &BucketView<'_>,
        m: &[usize],
        (exps, a): (&[u16], Shared<i64>),
        threads: usize,
    ) {
        for_each_range(b, threads, |seg, start, n, at| {
            let (exps, acc) = (&exps[at..at + n], a.range(at, n));
            let special = exps.contains(&T::SPECIAL);
            for (k, &r) in m.iter().enumerate() {
                let src = std::slice::from_raw_parts((seg.ptrs[r] as *const T).add(start), n);
                cut_add_wide(src, exps, acc, (special, k == 0));
            }
        });
    }
    by_float!(
        bucket.dtype,
        run,
        bucket,
        members,
        (exps, Shared(acc.as_mut_ptr())),
        threads
    )
}

/// Every member's element i := `acc[i]` on the grid of `exps[i]` in the dtype, divided by
/// `avg` when given.
///
/// # Safety
/// As for [`exponents`], the members' memory writable.
pub(crate) unsafe fn write_sums(
    bucket: &BucketView<'_>,
    members: &[usize],
    (acc, exps): (&[i64], &[u16]),
    avg: Option<usize>,
    threads: usize,
) {
    unsafe fn run<T: Cut>(
        b: &BucketView<'_>,
        m: &[usize],
        (acc, exps): (&[i64], &[u16]),
        (avg, threads): (Option<usize>, usize),
    ) {
        for_each_range(b, threads, |seg, start, n, at| {
            let (acc, exps) = (&acc[at..at + n], &exps[at..at + n]);
            let special = exps.contains(&T::SPECIAL);
            let (first, rest) = m.split_first().expect("a replica to write");
            let out = std::slice::from_raw_parts_mut((seg.ptrs[*first] as *mut T).add(start), n);
            uncut_wide(acc, exps, avg, out, special);
            for &r in rest {
                let to = (seg.ptrs[r] as *mut T).add(start);
                std::ptr::copy_nonoverlapping(out.as_ptr(), to, n);
            }
        });
    }
    by_float!(
        bucket.dtype,
        run,
        bucket,
        members,
        (acc, exps),
        (avg, threads)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reproducible sum of `values` (one contribution each) in one block.
    fn sum<T: Cut>(values: &[T], avg: Option<usize>) -> T {
        let mut replicas: Vec<Vec<T>> = values.iter().map(|&v| vec![v]).collect();
        let ptrs: Vec<usize> = replicas
            .iter_mut()
            .map(|r| r.as_mut_ptr() as usize)
            .collect();
        let members: Vec<usize> = (0..ptrs.len()).collect();
        unsafe { reduce_span::<T>(&ptrs, (&members, &members), 0, 1, avg) };
        let out = replicas[0][0];
        assert!(replicas.iter().all(|r| r[0].bits() == out.bits()));
        out
    }

    #[test]
    fn sums_are_exact_where_the_grid_holds_every_bit() {
        assert_eq!(sum(&[1.0f32, 2.0, 3.5], None), 6.5);
        assert_eq!(sum(&[1.0f32, -1.0], None), 0.0);
        assert_eq!(sum(&[3.0f64, 4.0, 5.0], Some(3)), 4.0);
        assert_eq!(
            sum(&[f16::from_f32(2048.0), f16::ONE, f16::ONE], None).to_f32(),
            2050.0
        );
        assert_eq!(
            sum(&[bf16::from_f32(3.0), bf16::from_f32(4.0)], Some(2)).to_f32(),
            3.5
        );
        // Subnormals and zeros.
        let tiny = f32::from_bits(1);
        assert_eq!(sum(&[tiny, tiny, 0.0], None), f32::from_bits(2));
        assert_eq!(sum(&[f32::MAX, -f32::MAX], None), 0.0);
    }

    #[test]
    fn order_does_not_matter_where_plain_sums_differ() {
        let v = [1.0e8f32, 1.0, -1.0e8, 1.0, 3.0e-3, 7.0];
        let first = sum(&v, None);
        let mut w = v;
        w.reverse();
        assert_eq!(sum(&w, None).to_bits(), first.to_bits());
        w.swap(0, 3);
        assert_eq!(sum(&w, None).to_bits(), first.to_bits());
        // Exact sum is 2 + 0.003 + 7 = 9.003: within one ulp.
        assert!((first - 9.003).abs() <= f32::EPSILON * 16.0, "{first}");
    }

    #[test]
    fn infinities_and_nans_propagate() {
        assert_eq!(sum(&[1.0f32, f32::INFINITY], None), f32::INFINITY);
        assert_eq!(sum(&[f32::NEG_INFINITY, 5.0], None), f32::NEG_INFINITY);
        assert!(sum(&[f32::INFINITY, f32::NEG_INFINITY], None).is_nan());
        assert!(sum(&[f64::NAN, 1.0], None).is_nan());
        assert!(sum(&[f16::NAN, f16::ONE], None).is_nan());
        assert_eq!(sum(&[f64::INFINITY, f64::MAX], Some(2)), f64::INFINITY);
    }

    /// Every vector width the CPU offers gives the baseline's bytes.
    fn widths_agree<T: Cut>(make: impl Fn(f64) -> T) {
        let (replicas, n) = (5, 3001);
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let data: Vec<Vec<T>> = (0..replicas)
            .map(|_| {
                (0..n)
                    .map(|_| make((next() - 0.5) * 2f64.powi((next() * 60.0) as i32 - 30)))
                    .collect()
            })
            .collect();
        for avg in [None, Some(replicas)] {
            let run = |wide: bool| {
                let mut copy = data.clone();
                let ptrs: Vec<usize> = copy.iter_mut().map(|r| r.as_mut_ptr() as usize).collect();
                let m: Vec<usize> = (0..replicas).collect();
                match wide {
                    true => unsafe { reduce_span::<T>(&ptrs, (&m, &m), 0, n, avg) },
                    false => unsafe { reduce_span_any::<T>(&ptrs, (&m, &m), 0, n, avg) },
                }
                copy[0].iter().map(|x| x.bits()).collect::<Vec<u64>>()
            };
            assert_eq!(run(true), run(false));
        }
    }

    #[test]
    fn every_vector_width_gives_the_same_bytes() {
        widths_agree(|x| x as f32);
        widths_agree(|x| x);
        widths_agree(f16::from_f64);
        widths_agree(bf16::from_f64);
    }

    #[test]
    fn f64_grids_cover_the_whole_exponent_range() {
        let tiny = f64::from_bits(1);
        // Grid 2^-1071 for subnormal maxima: a lone subnormal is within 2^-1072 of itself.
        assert!((sum(&[tiny * 1000.0, tiny * 24.0], None) - tiny * 1024.0).abs() <= tiny * 4.0);
        let (big, half) = (2f64.powi(1023), 2f64.powi(1022));
        assert_eq!(sum(&[big, half], None), big + half);
        // 53 bits do not all fit the grid: within 2^-36 of the largest contribution.
        assert!((sum(&[1.0e300f64, 1.0e300], Some(2)) - 1.0e300).abs() <= 1.0e300 * 2f64.powi(-36));
    }
}
