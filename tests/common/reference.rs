//! The reference reduction of every dtype, and byte-exact comparison of buffers.

use super::abi::AVG;
use super::buf::{Buf, DType};
use super::float16::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Element-wise sum of `vs` in replica order, divided by `divisor` when given.
fn sum_in_order<T>(vs: &[&Vec<T>], len: usize, divisor: Option<T>) -> Vec<T>
where
    T: Copy + std::ops::Add<Output = T> + std::ops::Div<Output = T>,
{
    (0..len)
        .map(|i| {
            let s = vs[1..].iter().fold(vs[0][i], |s, v| s + v[i]);
            divisor.map_or(s, |d| s / d)
        })
        .collect()
}

/// Widening and rounding conversions of a 16-bit float format.
type HalfConv = (fn(u16) -> f32, fn(f32) -> u16);

/// The reference allreduce of /tmp/spec/semantics.md: replicas summed in order
/// ((r0 + r1) + r2) + ...; f32 in f32, f64 in f64; f16/bf16 accumulated in f32, divided by N for
/// AVG, rounded once; i32 summed in i64 and i64 in i128, SUM wrapping to the type, AVG the wide
/// sum divided by N truncated toward zero.
pub fn reference_allreduce(inputs: &[&Buf], op: u32) -> Buf {
    let n = inputs.len();
    assert!(n >= 1);
    let len = inputs[0].len();
    let avg = op == AVG;
    macro_rules! collect {
        ($variant:ident) => {{
            let vs: Vec<_> = inputs
                .iter()
                .map(|b| match b {
                    Buf::$variant(v) => v,
                    _ => panic!("mixed dtypes"),
                })
                .collect();
            for v in &vs {
                assert_eq!(v.len(), len);
            }
            vs
        }};
    }
    match inputs[0].dtype() {
        DType::F32 => Buf::F32(sum_in_order(&collect!(F32), len, avg.then_some(n as f32))),
        DType::F64 => Buf::F64(sum_in_order(&collect!(F64), len, avg.then_some(n as f64))),
        DType::F16 | DType::BF16 => {
            let is_f16 = inputs[0].dtype() == DType::F16;
            let vs: Vec<&Vec<u16>> = inputs
                .iter()
                .map(|b| match b {
                    Buf::F16(v) | Buf::BF16(v) => v,
                    _ => panic!("mixed dtypes"),
                })
                .collect();
            let (to, from): HalfConv = if is_f16 {
                (f16_to_f32, f32_to_f16)
            } else {
                (bf16_to_f32, f32_to_bf16)
            };
            let out: Vec<u16> = (0..len)
                .map(|i| {
                    let mut s = to(vs[0][i]);
                    for v in &vs[1..] {
                        s += to(v[i]);
                    }
                    if avg {
                        s /= n as f32;
                    }
                    from(s)
                })
                .collect();
            if is_f16 {
                Buf::F16(out)
            } else {
                Buf::BF16(out)
            }
        }
        DType::I32 => {
            let vs = collect!(I32);
            Buf::I32(
                (0..len)
                    .map(|i| {
                        let s: i64 = vs.iter().map(|v| v[i] as i64).sum();
                        if avg {
                            (s / n as i64) as i32
                        } else {
                            s as i32
                        }
                    })
                    .collect(),
            )
        }
        DType::I64 => {
            let vs = collect!(I64);
            Buf::I64(
                (0..len)
                    .map(|i| {
                        let s: i128 = vs.iter().map(|v| v[i] as i128).sum();
                        if avg {
                            (s / n as i128) as i64
                        } else {
                            s as i64
                        }
                    })
                    .collect(),
            )
        }
    }
}

/// Asserts two buffers hold the same bytes, reporting the first differing element.
// tests/sequences compares with its own NaN-aware check instead.
#[allow(dead_code)]
#[track_caller]
pub fn assert_same_bytes(got: &Buf, want: &Buf, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got.bytes() != want.bytes() {
        let sz = got.dtype().size();
        let (gb, wb) = (got.bytes(), want.bytes());
        let i = (0..got.len())
            .find(|&i| gb[i * sz..(i + 1) * sz] != wb[i * sz..(i + 1) * sz])
            .unwrap();
        panic!(
            "{what}: element {i} of {} differs: got {}, want {}",
            got.len(),
            elem_str(got, i),
            elem_str(want, i)
        );
    }
}

pub fn elem_str(b: &Buf, i: usize) -> String {
    match b {
        Buf::F32(v) => format!("{:e} ({:#010x})", v[i], v[i].to_bits()),
        Buf::F64(v) => format!("{:e} ({:#018x})", v[i], v[i].to_bits()),
        Buf::F16(v) => format!("{} ({:#06x})", f16_to_f32(v[i]), v[i]),
        Buf::BF16(v) => format!("{} ({:#06x})", bf16_to_f32(v[i]), v[i]),
        Buf::I32(v) => v[i].to_string(),
        Buf::I64(v) => v[i].to_string(),
    }
}
