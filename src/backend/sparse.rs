//! Argument and result types of the sparse-gradient primitives ([`super::Backend::coalesce`],
//! [`super::Backend::check_indices`], [`super::Backend::divide`]), and the coalescing order
//! that every backend shares.

use super::Allocation;
use crate::error::Error;
use crate::types::DType;

/// One range check: every one of `rows` indices of `dtype` (I32 or I64) at `indices` on
/// `replica` must lie in `[0, bound)`. `tensor` names the sparse gradient in the error.
#[derive(Clone, Copy, Debug)]
pub struct IndexCheck<'a> {
    pub tensor: &'a str,
    pub replica: usize,
    pub dtype: DType,
    pub indices: usize,
    pub rows: usize,
    pub bound: u64,
}

impl IndexCheck<'_> {
    /// The bound the backends compare an index, cast from i64 to u64, against: a negative index
    /// wraps to 2^63 or more, so one unsigned comparison covers both ends only while the bound
    /// is at most 2^63 (every i64 index is below that anyway).
    pub fn unsigned_limit(&self) -> u64 {
        self.bound.min(1 << 63)
    }

    /// INCONSISTENT: index `value` at `row` is out of range (the same text on every backend).
    pub fn error(&self, row: usize, value: i64) -> Error {
        Error::inconsistent(format!(
            "sparse gradient '{}': index {value} at row {row} on replica {} is outside [0, {}) \
             (num_embeddings)",
            self.tensor, self.replica, self.bound
        ))
    }
}

/// The `rows` indices of `dtype` (I32 or I64, the registry's rule) at `ptr` in host memory,
/// widened to i64.
///
/// # Safety
/// `ptr` is valid for `rows` aligned elements of `dtype`.
pub unsafe fn widen_indices(dtype: DType, ptr: usize, rows: usize) -> Vec<i64> {
    if rows == 0 {
        return Vec::new();
    }
    match dtype {
        DType::I32 => std::slice::from_raw_parts(ptr as *const i32, rows)
            .iter()
            .map(|&i| i64::from(i))
            .collect(),
        DType::I64 => std::slice::from_raw_parts(ptr as *const i64, rows).to_vec(),
        other => unreachable!("the registry admits only i32/i64 indices, got {other}"),
    }
}

/// `keys` back in `dtype`, as bytes: exact, since every key was widened from that dtype.
pub fn narrow_indices(dtype: DType, keys: &[i64]) -> Vec<u8> {
    match dtype {
        DType::I32 => keys
            .iter()
            .flat_map(|&k| (k as i32).to_ne_bytes())
            .collect(),
        _ => keys.iter().flat_map(|&k| k.to_ne_bytes()).collect(),
    }
}

/// How to coalesce `keys` (a slice's indices, widened): the unique keys ascending; `positions`,
/// the input rows sorted by (key, position); and `bounds`, where run k of equal keys is
/// `positions[bounds[k]..bounds[k + 1]]`. Equal keys keep input order, so every run is summed
/// in world order whatever the sort algorithm, and every backend gives the same bytes.
pub fn coalescing_order(keys: &[i64]) -> (Vec<i64>, Vec<usize>, Vec<usize>) {
    let mut order: Vec<(i64, usize)> = keys.iter().copied().zip(0..).collect();
    // Stable by key = ordered by (key, position). The stable sort also finds existing runs: the
    // root's input is the concatenation of already coalesced (sorted) slices, which it merges.
    order.sort_by_key(|&(key, _)| key);
    let positions: Vec<usize> = order.iter().map(|&(_, p)| p).collect();
    let mut unique: Vec<i64> = Vec::new();
    let mut bounds: Vec<usize> = Vec::new();
    for (k, &(key, _)) in order.iter().enumerate() {
        if unique.last() != Some(&key) {
            unique.push(key);
            bounds.push(k);
        }
    }
    bounds.push(order.len());
    (unique, positions, bounds)
}

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
