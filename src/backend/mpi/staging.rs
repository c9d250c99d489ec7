//! Elements between the caller's buffers and the engine's stages: a piece's local contributions
//! summed in MPI's type on the way in, divided and rounded once into the outputs on the way
//! out, or a broadcast's bytes copied. MPI never sees the caller's memory (a timed-out request
//! may still use its buffers), and f16/bf16 cross as f32 (MPI has no sum for them), so this is
//! where every dtype's conversions live ([`Summed`]).

use half::{bf16, f16};
use mpi::ffi;

use super::pieces::Walk;
use crate::backend::host::copy_streaming;
use crate::backend::Segment;
use crate::types::DType;

/// A dtype's element type, and how it is summed in the type MPI sums it in.
pub(super) trait Summed: Copy + 'static {
    /// The type MPI sums it in ([`mpi_type`]).
    type Acc: Copy + Default + 'static;
    fn widen(x: Self) -> Self::Acc;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn divide(a: Self::Acc, d: usize) -> Self::Acc;
    /// One rounding.
    fn narrow(a: Self::Acc) -> Self;
}

// `#[inline]` throughout: called once per element from generic loops, some in other files (the
// ring's sums), where an out-of-line call would cost more than the element's own work.

macro_rules! float_exact {
    ($t:ty) => {
        impl Summed for $t {
            type Acc = $t;
            #[inline]
            fn widen(x: $t) -> $t {
                x
            }
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline]
            fn divide(a: $t, d: usize) -> $t {
                a / d as $t
            }
            #[inline]
            fn narrow(a: $t) -> $t {
                a
            }
        }
    };
}
float_exact!(f32);
float_exact!(f64);

macro_rules! int_wrapping {
    ($t:ty) => {
        impl Summed for $t {
            type Acc = $t;
            #[inline]
            fn widen(x: $t) -> $t {
                x
            }
            /// Wraps on overflow (two's complement) instead of panicking in a debug build.
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline]
            fn divide(a: $t, d: usize) -> $t {
                a / d as $t
            }
            #[inline]
            fn narrow(a: $t) -> $t {
                a
            }
        }
    };
}
int_wrapping!(i32);
int_wrapping!(i64);

macro_rules! half_in_f32 {
    ($t:ty) => {
        impl Summed for $t {
            type Acc = f32;
            #[inline]
            fn widen(x: $t) -> f32 {
                x.to_f32()
            }
            #[inline]
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            #[inline]
            fn divide(a: f32, d: usize) -> f32 {
                a / d as f32
            }
            #[inline]
            fn narrow(a: f32) -> $t {
                <$t>::from_f32(a)
            }
        }
    };
}
half_in_f32!(f16);
half_in_f32!(bf16);

/// The MPI type a dtype is summed in, and its size (f16/bf16: f32, rounded once at the end).
pub(super) fn mpi_type(dtype: DType) -> (ffi::MPI_Datatype, usize) {
    // SAFETY: link-time constants of the MPI library.
    unsafe {
        match dtype {
            DType::F32 => (ffi::RSMPI_FLOAT, 4),
            DType::F64 => (ffi::RSMPI_DOUBLE, 8),
            DType::I32 => (ffi::RSMPI_INT32_T, 4),
            DType::I64 => (ffi::RSMPI_INT64_T, 8),
            DType::F16 | DType::Bf16 => (ffi::RSMPI_FLOAT, 4),
        }
    }
}

/// Whether `T` and `A` are one type (then widening and narrowing are the identity).
fn same_type<T: 'static, A: 'static>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<A>()
}

/// `dst[..count]` := the sum of `count` elements of `T` from element `skip` of every pointer of
/// `srcs`, widened to `T::Acc` (the type MPI sums).
///
/// # Safety
/// Every source holds `skip + count` aligned `T`, `dst` room for `count` aligned `T::Acc`.
unsafe fn gather_in<T: Summed>((srcs, skip): (&[usize], usize), dst: *mut u8, count: usize) {
    let out = std::slice::from_raw_parts_mut(dst.cast::<T::Acc>(), count);
    for (k, &src) in srcs.iter().enumerate() {
        let xs = std::slice::from_raw_parts((src as *const T).add(skip), count);
        if k == 0 && same_type::<T, T::Acc>() {
            // The widening is the identity: libc's copy beats the element loop on large
            // stages (MPI's ring, fused ResNet-50 on the 2-core VM: 33 against 36 ms).
            std::ptr::copy_nonoverlapping(xs.as_ptr().cast::<T::Acc>(), out.as_mut_ptr(), count);
        } else if k == 0 {
            out.iter_mut().zip(xs).for_each(|(o, &x)| *o = T::widen(x));
        } else {
            out.iter_mut()
                .zip(xs)
                .for_each(|(o, &x)| *o = T::add(*o, T::widen(x)));
        }
    }
}

/// `dst[skip..skip + count]` := `count` elements of `T::Acc` at `src`, divided by `avg` if
/// given, as `T` (one rounding).
///
/// # Safety
/// As for [`gather_in`], the other way round.
unsafe fn scatter_out<T: Summed>(
    src: *const u8,
    (dst, skip): (usize, usize),
    count: usize,
    avg: Option<usize>,
) {
    let (xs, out) = (
        std::slice::from_raw_parts(src.cast::<T::Acc>(), count),
        std::slice::from_raw_parts_mut((dst as *mut T).add(skip), count),
    );
    match avg {
        None if same_type::<T, T::Acc>() => {
            std::ptr::copy_nonoverlapping(xs.as_ptr().cast::<T>(), out.as_mut_ptr(), count)
        }
        None => out.iter_mut().zip(xs).for_each(|(o, &x)| *o = T::narrow(x)),
        Some(d) => (out.iter_mut().zip(xs)).for_each(|(o, &x)| *o = T::narrow(T::divide(x, d))),
    }
}

/// Elements `range` = `(start, n)` of the segments laid end to end, each segment's
/// contributions summed into `send` in MPI's type.
///
/// # Safety
/// As for [`gather_in`]; `send` holds `n` elements.
pub(super) unsafe fn stage_in(
    dtype: DType,
    segments: &[Segment<'_>],
    walk: &mut Walk,
    range: (usize, usize),
    send: *mut u8,
) {
    let size = mpi_type(dtype).1;
    walk.parts(
        |k| segments[k].count,
        segments.len(),
        range,
        |k, skip, n, at| {
            let (src, dst) = ((segments[k].ptrs, skip), send.add(at * size));
            match dtype {
                DType::F32 => gather_in::<f32>(src, dst, n),
                DType::F64 => gather_in::<f64>(src, dst, n),
                DType::F16 => gather_in::<f16>(src, dst, n),
                DType::Bf16 => gather_in::<bf16>(src, dst, n),
                DType::I32 => gather_in::<i32>(src, dst, n),
                DType::I64 => gather_in::<i64>(src, dst, n),
            }
        },
    );
}

/// `recv`, elements `range` = `(start, n)` of the outputs `(ptr, count)` laid end to end,
/// divided by `avg` and rounded once into them; an output of null `ptr` is not written (a
/// reduce-scatter's elements another rank owns, [`outputs`]).
///
/// # Safety
/// As for [`scatter_out`]; `recv` holds `n` elements.
pub(super) unsafe fn stage_out(
    dtype: DType,
    recv: *const u8,
    (outs, walk): (&[(usize, usize)], &mut Walk),
    range: (usize, usize),
    avg: Option<usize>,
) {
    let size = mpi_type(dtype).1;
    walk.parts(
        |k| outs[k].1,
        outs.len(),
        range,
        |k, skip, n, at| {
            if outs[k].0 == 0 {
                return;
            }
            let (src, dst) = (recv.add(at * size), (outs[k].0, skip));
            match dtype {
                DType::F32 => scatter_out::<f32>(src, dst, n, avg),
                DType::F64 => scatter_out::<f64>(src, dst, n, avg),
                DType::F16 => scatter_out::<f16>(src, dst, n, avg),
                DType::Bf16 => scatter_out::<bf16>(src, dst, n, avg),
                DType::I32 => scatter_out::<i32>(src, dst, n, avg),
                DType::I64 => scatter_out::<i64>(src, dst, n, avg),
            }
        },
    );
}

/// As [`stage_out`] for results in the dtype's own bytes, divided already (an exchange's
/// sums, `alltoall.rs`): copied as they are.
///
/// # Safety
/// As for [`stage_out`].
pub(super) unsafe fn copy_out(
    dtype: DType,
    recv: *const u8,
    (outs, walk): (&[(usize, usize)], &mut Walk),
    range: (usize, usize),
) {
    let size = dtype.size();
    walk.parts(
        |k| outs[k].1,
        outs.len(),
        range,
        |k, skip, n, at| {
            if outs[k].0 != 0 {
                let dst = (outs[k].0 as *mut u8).add(skip * size);
                std::ptr::copy_nonoverlapping(recv.add(at * size), dst, n * size);
            }
        },
    );
}

/// The outputs `(ptr, count)` of `segments` laid end to end, for [`stage_out`]: each
/// segment's `ptrs[0]`, or with `owned` each contribution's own elements ([`only_owned`]).
pub(super) fn outputs(
    dtype: DType,
    segments: &[Segment<'_>],
    owned: Option<&[(usize, usize)]>,
) -> Vec<(usize, usize)> {
    match owned {
        None => segments.iter().map(|s| (s.ptrs[0], s.count)).collect(),
        Some(owned) => only_owned(dtype, segments.iter().map(|s| (s.ptrs, s.count)), owned),
    }
}

/// The outputs of a reduce-scatter: segments given as (contributions, count), and `owned`
/// the `(first, count)` of every contribution of every segment in order (segment after
/// segment), ascending within a segment; each contribution's own elements are written to it,
/// the rest are null outputs, not written.
pub(super) fn only_owned<'a>(
    dtype: DType,
    segments: impl Iterator<Item = (&'a [usize], usize)>,
    owned: &[(usize, usize)],
) -> Vec<(usize, usize)> {
    let mut outs = Vec::with_capacity(3 * owned.len());
    let mut pieces = owned.iter();
    for (ptrs, count) in segments {
        let mut at = 0;
        for &ptr in ptrs {
            let &(first, n) = pieces.next().expect("a piece per contribution");
            debug_assert!(
                first >= at && first + n <= count,
                "ascending pieces within it"
            );
            outs.extend([(0, first - at), (ptr + first * dtype.size(), n)]);
            at = first + n;
        }
        outs.push((0, count - at));
    }
    outs
}

/// Which way [`copy_spans`] copies.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// Into the stage.
    In,
    /// Into the stage with non-temporal stores: a copy kept for a rare use (`aside.rs`),
    /// written without reading its lines from memory first.
    Keep,
    /// Out of it into the spans; `streaming`: with non-temporal stores, so that a large
    /// transfer writes spans this core has not read without reading them from memory first.
    Out { streaming: bool },
}

/// Bytes `range` = `(start, n)` of the spans `(ptr, bytes)` laid end to end, copied into the
/// stage at `stage` or out of it (`way`); a span of null `ptr` is skipped (an allgather's
/// bytes another rank owns).
///
/// # Safety
/// Every span is valid for its bytes; `stage` for `n`.
pub(super) unsafe fn copy_spans(
    (spans, walk): (&[(usize, usize)], &mut Walk),
    range: (usize, usize),
    stage: *mut u8,
    way: Way,
) {
    walk.parts(
        |k| spans[k].1,
        spans.len(),
        range,
        |k, skip, n, at| {
            if spans[k].0 == 0 {
                return;
            }
            let span = (spans[k].0 as *mut u8).add(skip);
            match way {
                Way::In => std::ptr::copy_nonoverlapping(span, stage.add(at), n),
                Way::Keep => copy_streaming(span, stage.add(at), n),
                Way::Out { streaming: false } => {
                    std::ptr::copy_nonoverlapping(stage.add(at), span, n)
                }
                Way::Out { streaming: true } => copy_streaming(stage.add(at), span, n),
            }
        },
    );
}
