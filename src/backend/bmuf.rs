//! What the BMUF primitives ([`super::Backend::bmuf_load`], [`super::Backend::bmuf_update`])
//! receive: the filter's constants and, per PARAM tensor of a bucket, where its elements and its
//! share of the filter state live on one replica. The algorithm around them is
//! `exec/bmuf.rs`; the host kernels are `host/bmuf.rs`.

use crate::types::DType;

/// One PARAM tensor's elements and its slice of the BMUF state, on one replica.
///
/// `params` holds `count` elements of the bucket's dtype (caller memory); `w` and `d` hold
/// `count` elements of [`bmuf_state_dtype`] of that dtype (library memory from
/// [`super::Backend::alloc`] on the same replica).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BmufSpan {
    pub params: usize,
    pub w: usize,
    pub d: usize,
    pub count: usize,
}

/// The constants of the filter, already checked: `0 <= block_momentum < 1` (the default
/// `1 - 1/N` already resolved), `block_lr > 0`, both finite.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BmufFilter {
    /// `eta`.
    pub block_lr: f64,
    /// `mu`.
    pub block_momentum: f64,
    pub nesterov: bool,
    /// `mu` is the default `1 - 1/N`: recounted when the world's replicas change.
    pub default_momentum: bool,
}

/// The element type of the global model `W` and the block momentum `D` kept for PARAMs of
/// `dtype`: f32 for f32, f16 and bf16 (half-precision state would lose the small block
/// updates), f64 for f64; `None` for integer types, which BMUF does not filter.
pub fn bmuf_state_dtype(dtype: DType) -> Option<DType> {
    match dtype {
        DType::F32 | DType::F16 | DType::Bf16 => Some(DType::F32),
        DType::F64 => Some(DType::F64),
        DType::I32 | DType::I64 => None,
    }
}
