//! Typed host buffers for every dtype: zeros, deterministic contents, bytes, copies.

use super::abi::{BF16, F16, F32, F64, I32, I64};
use super::context::{check, register_raw, Context};
use super::float16::{f32_to_bf16, f32_to_f16};
use super::lcg::Lcg;
use std::ffi::c_void;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
}

// Each binary uses the few views of a dtype it needs.
#[allow(dead_code)]
impl DType {
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
    ];

    pub fn code(self) -> u32 {
        match self {
            DType::F32 => F32,
            DType::F64 => F64,
            DType::F16 => F16,
            DType::BF16 => BF16,
            DType::I32 => I32,
            DType::I64 => I64,
        }
    }

    /// The name describe uses.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

/// A host tensor of one dtype (f16/bf16 stored as raw bits).
#[derive(Clone, Debug, PartialEq)]
pub enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<u16>),
    BF16(Vec<u16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

// A buffer's operations: each binary uses those its tests need.
#[allow(dead_code)]
impl Buf {
    pub fn zeros(dtype: DType, n: usize) -> Buf {
        match dtype {
            DType::F32 => Buf::F32(vec![0.0; n]),
            DType::F64 => Buf::F64(vec![0.0; n]),
            DType::F16 => Buf::F16(vec![0; n]),
            DType::BF16 => Buf::BF16(vec![0; n]),
            DType::I32 => Buf::I32(vec![0; n]),
            DType::I64 => Buf::I64(vec![0; n]),
        }
    }

    /// Deterministic contents that stress the reduction rules: wide magnitudes for floats (order
    /// matters), values near the f16 limit (a sum in f16 would overflow, one in f32 does not),
    /// full-range integers (sums overflow the type).
    pub fn random(dtype: DType, n: usize, seed: u64) -> Buf {
        let mut b = Buf::zeros(dtype, n);
        b.fill_random(seed);
        b
    }

    /// Overwrites the contents in place (the pointer stays the same).
    pub fn fill_random(&mut self, seed: u64) {
        let mut g = Lcg::new(seed);
        match self {
            Buf::F32(v) => v.iter_mut().for_each(|x| *x = (g.spread() * 8.0) as f32),
            Buf::F64(v) => v
                .iter_mut()
                .for_each(|x| *x = g.spread() * 8.0 + g.spread() * 1e-9),
            Buf::F16(v) => v.iter_mut().enumerate().for_each(|(i, x)| {
                let f = if i % 13 == 5 {
                    g.uniform(30000.0, 60000.0) * if g.below(2) == 0 { 1.0 } else { -1.0 }
                } else {
                    g.spread() * 4.0
                };
                *x = f32_to_f16(f as f32)
            }),
            Buf::BF16(v) => v
                .iter_mut()
                .for_each(|x| *x = f32_to_bf16((g.spread() * 100.0) as f32)),
            Buf::I32(v) => v.iter_mut().enumerate().for_each(|(i, x)| {
                *x = if i % 3 == 0 {
                    g.below(2001) as i32 - 1000
                } else {
                    g.next_u32() as i32
                }
            }),
            Buf::I64(v) => v.iter_mut().enumerate().for_each(|(i, x)| {
                *x = if i % 3 == 0 {
                    g.below(2001) as i64 - 1000
                } else {
                    g.next_u64() as i64
                }
            }),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::F64(_) => DType::F64,
            Buf::F16(_) => DType::F16,
            Buf::BF16(_) => DType::BF16,
            Buf::I32(_) => DType::I32,
            Buf::I64(_) => DType::I64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buf::F32(v) => v.len(),
            Buf::F64(v) => v.len(),
            Buf::F16(v) | Buf::BF16(v) => v.len(),
            Buf::I32(v) => v.len(),
            Buf::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ptr(&mut self) -> *mut c_void {
        match self {
            Buf::F32(v) => v.as_mut_ptr().cast(),
            Buf::F64(v) => v.as_mut_ptr().cast(),
            Buf::F16(v) | Buf::BF16(v) => v.as_mut_ptr().cast(),
            Buf::I32(v) => v.as_mut_ptr().cast(),
            Buf::I64(v) => v.as_mut_ptr().cast(),
        }
    }

    /// The raw bytes (native endianness).
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Buf::F32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::F64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::F16(v) | Buf::BF16(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::I32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::I64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        }
    }

    /// Copies `other`'s contents into self without reallocating (same dtype and length).
    pub fn copy_from(&mut self, other: &Buf) {
        match (self, other) {
            (Buf::F32(a), Buf::F32(b)) => a.copy_from_slice(b),
            (Buf::F64(a), Buf::F64(b)) => a.copy_from_slice(b),
            (Buf::F16(a), Buf::F16(b)) | (Buf::BF16(a), Buf::BF16(b)) => a.copy_from_slice(b),
            (Buf::I32(a), Buf::I32(b)) => a.copy_from_slice(b),
            (Buf::I64(a), Buf::I64(b)) => a.copy_from_slice(b),
            _ => panic!("copy_from between different dtypes"),
        }
    }
}

// For the host tests that register `Buf`s; the GPU tests register device memory.
#[allow(dead_code)]
impl Context {
    /// Registers a typed buffer and asserts success.
    #[track_caller]
    pub fn reg_buf(&self, name: &str, role: u32, replica: usize, buf: &mut Buf) {
        let st = register_raw(
            self.0,
            name,
            role,
            replica,
            buf.ptr(),
            buf.len(),
            buf.dtype().code(),
        );
        check(st, &format!("register '{name}' on replica {replica}"));
    }
}
