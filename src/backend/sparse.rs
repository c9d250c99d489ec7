//! Argument and result types of the sparse-gradient primitives ([`super::Backend::coalesce`],
//! [`super::Backend::find_index_out_of_range`], [`super::Backend::divide`]).

use super::Allocation;
use crate::types::DType;

/// One values array of a sparse slice: `rows × row_len` elements of `dtype` at `ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValuesRef {
    pub ptr: usize,
    pub dtype: DType,
    pub row_len: usize,
}

impl ValuesRef {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_len * self.dtype.size()
    }
}

/// A sparse slice on one replica: `rows` indices of `index_dtype` (I32 or I64) at `indices`, and
/// one or more values arrays that share those indices (row `i` of every array belongs to
/// `indices[i]`).
#[derive(Clone, Copy, Debug)]
pub struct SliceRef<'a> {
    pub index_dtype: DType,
    pub indices: usize,
    pub rows: usize,
    pub values: &'a [ValuesRef],
}

/// A coalesced slice in library-owned memory on the replica it was made on: `rows` unique
/// indices in ascending order and one values array per input values array, in the same order.
#[derive(Debug)]
pub struct Coalesced {
    pub rows: usize,
    pub indices: Allocation,
    pub values: Vec<Allocation>,
}
