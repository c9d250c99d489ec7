//! Host buffers of the model: random contents, element views and the model's exact arithmetic
//! on them.

use std::ffi::c_void;

use crate::common::{buf::*, float16::*, lcg::*};

pub(crate) fn dtype_of(code: u32) -> Option<DType> {
    DType::ALL.into_iter().find(|d| d.code() == code)
}

pub(crate) fn is_float(d: DType) -> bool {
    !matches!(d, DType::I32 | DType::I64)
}

/// The address of a buffer's first element.
pub(crate) fn addr(b: &Buf) -> usize {
    match b {
        Buf::F32(v) => v.as_ptr() as usize,
        Buf::F64(v) => v.as_ptr() as usize,
        Buf::F16(v) | Buf::BF16(v) => v.as_ptr() as usize,
        Buf::I32(v) => v.as_ptr() as usize,
        Buf::I64(v) => v.as_ptr() as usize,
    }
}

/// Small integers in [-8, 8] in every dtype: sums over 5 replicas (and coalesced sparse rows)
/// are exact even in bf16, so only the documented division rounds.
pub(crate) fn fill_small(b: &mut Buf, g: &mut Lcg) {
    let mut next = || g.below(17) as i32 - 8;
    match b {
        Buf::F32(v) => v.iter_mut().for_each(|x| *x = next() as f32),
        Buf::F64(v) => v.iter_mut().for_each(|x| *x = next() as f64),
        Buf::F16(v) => v.iter_mut().for_each(|x| *x = f32_to_f16(next() as f32)),
        Buf::BF16(v) => v.iter_mut().for_each(|x| *x = f32_to_bf16(next() as f32)),
        Buf::I32(v) => v.iter_mut().for_each(|x| *x = next()),
        Buf::I64(v) => v.iter_mut().for_each(|x| *x = next() as i64),
    }
}

/// Fresh contents: mostly small integers, sometimes the common helper's wide values (f16 near
/// its limit, full-range integers that wrap, floats whose sum depends on the order).
pub(crate) fn refill(b: &mut Buf, g: &mut Lcg) {
    if g.below(4) == 0 {
        b.fill_random(g.next_u64());
    } else {
        fill_small(b, g);
    }
}

pub(crate) fn is_nan(b: &Buf, i: usize) -> bool {
    match b {
        Buf::F32(v) => v[i].is_nan(),
        Buf::F64(v) => v[i].is_nan(),
        Buf::F16(v) => f16_to_f32(v[i]).is_nan(),
        Buf::BF16(v) => bf16_to_f32(v[i]).is_nan(),
        Buf::I32(_) | Buf::I64(_) => false,
    }
}

/// The first element where `got` differs from `want` (NaN matches any NaN: the model's NaN
/// payload is not the point), or a length/dtype mismatch as element 0.
pub(crate) fn first_difference(got: &Buf, want: &Buf) -> Option<usize> {
    if got.dtype() != want.dtype() || got.len() != want.len() {
        return Some(0);
    }
    let sz = got.dtype().size();
    let (gb, wb) = (got.bytes(), want.bytes());
    (0..got.len()).find(|&i| {
        gb[i * sz..(i + 1) * sz] != wb[i * sz..(i + 1) * sz] && !(is_nan(got, i) && is_nan(want, i))
    })
}

/// docs/API.md: a stored value divided by N for AVG as a collective divides its sum: f32/f64 in
/// their own type, f16/bf16 widened to f32, divided and rounded once, integers truncated
/// toward zero.
pub(crate) fn divide_each(b: &Buf, n: usize) -> Buf {
    match b {
        Buf::F32(v) => Buf::F32(v.iter().map(|x| x / n as f32).collect()),
        Buf::F64(v) => Buf::F64(v.iter().map(|x| x / n as f64).collect()),
        Buf::F16(v) => Buf::F16(
            v.iter()
                .map(|&x| f32_to_f16(f16_to_f32(x) / n as f32))
                .collect(),
        ),
        Buf::BF16(v) => Buf::BF16(
            v.iter()
                .map(|&x| f32_to_bf16(bf16_to_f32(x) / n as f32))
                .collect(),
        ),
        Buf::I32(v) => Buf::I32(v.iter().map(|x| x / n as i32).collect()),
        Buf::I64(v) => Buf::I64(v.iter().map(|x| x / n as i64).collect()),
    }
}

/// Element `i` as f64 (sparse values are small integers: exact).
pub(crate) fn value_at(b: &Buf, i: usize) -> f64 {
    match b {
        Buf::F32(v) => v[i] as f64,
        Buf::F64(v) => v[i],
        Buf::F16(v) => f16_to_f32(v[i]) as f64,
        Buf::BF16(v) => bf16_to_f32(v[i]) as f64,
        Buf::I32(v) => v[i] as f64,
        Buf::I64(v) => v[i] as f64,
    }
}

/// A float buffer of `dtype` holding `vals` (exactly representable small integers).
pub(crate) fn buf_of(dtype: DType, vals: &[f64]) -> Buf {
    match dtype {
        DType::F32 => Buf::F32(vals.iter().map(|&x| x as f32).collect()),
        DType::F64 => Buf::F64(vals.to_vec()),
        DType::F16 => Buf::F16(vals.iter().map(|&x| f32_to_f16(x as f32)).collect()),
        DType::BF16 => Buf::BF16(vals.iter().map(|&x| f32_to_bf16(x as f32)).collect()),
        DType::I32 => Buf::I32(vals.iter().map(|&x| x as i32).collect()),
        DType::I64 => Buf::I64(vals.iter().map(|&x| x as i64).collect()),
    }
}

pub(crate) fn index_at(b: &Buf, i: usize) -> i64 {
    match b {
        Buf::I32(v) => v[i] as i64,
        Buf::I64(v) => v[i],
        _ => unreachable!("index buffers are I32 or I64"),
    }
}

/// Copies `n` elements of `dtype` from library memory.
///
/// # Safety
/// `p` points to `n` valid elements (`dpsync_sparse_get`'s promise).
pub(crate) unsafe fn read_buf(dtype: DType, p: *const c_void, n: usize) -> Buf {
    match dtype {
        DType::F32 => Buf::F32(std::slice::from_raw_parts(p.cast::<f32>(), n).to_vec()),
        DType::F64 => Buf::F64(std::slice::from_raw_parts(p.cast::<f64>(), n).to_vec()),
        DType::F16 => Buf::F16(std::slice::from_raw_parts(p.cast::<u16>(), n).to_vec()),
        DType::BF16 => Buf::BF16(std::slice::from_raw_parts(p.cast::<u16>(), n).to_vec()),
        DType::I32 => Buf::I32(std::slice::from_raw_parts(p.cast::<i32>(), n).to_vec()),
        DType::I64 => Buf::I64(std::slice::from_raw_parts(p.cast::<i64>(), n).to_vec()),
    }
}

pub(crate) fn indices_list(b: &Buf) -> Vec<i64> {
    (0..b.len()).map(|k| index_at(b, k)).collect()
}
