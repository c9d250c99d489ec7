//! Sparse gradient slices on host replicas, through the C ABI:
//!
//! - Caffe2's `test_equiv_sparse`: an embedding-bag model trained with sparse SGD on 1, 2 and 4
//!   replicas ends with the same table (allclose), with both index dtypes, coalescing on and off.
//! - Caffe2's `test_sparse_shared_indices`: three slices sharing one indices buffer; on 1, 2, 4
//!   and 8 replicas every replica's gathered slices have equal lengths, one shared index gather,
//!   and exactly as many gathered indices as value rows.
//! - Uneven and zero row counts, i32/i64 indices, f16/bf16/f64 values, AVG, coalesced results
//!   against a reference.
//! - Every bad input: the status, a message naming the gradient and replica, and nothing
//!   changed (dense gradients, previous outputs, the slices already set).

mod common {
    pub mod abi;
    pub mod buf;
    pub mod close;
    pub mod context;
    pub mod cuda_context;
    pub mod embedding;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod place;
    pub mod skip;
    pub mod sparse;
}

use common::{abi::*, context::*, errors::*, float16::*, lcg::*, sparse::*};
use dpsync::*;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr;

const INVALID_STATE: dpsync_status = dpsync_status::DPSYNC_STATUS_INVALID_STATE;

// ------------------------------------------------------------------ index buffers of either dtype

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Idx {
    I32,
    I64,
}

impl Idx {
    fn code(self) -> u32 {
        match self {
            Idx::I32 => I32,
            Idx::I64 => I64,
        }
    }
}

/// Indices in the registered dtype, kept alive until the step that reads them.
#[derive(Clone, Debug)]
enum IdxBuf {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl IdxBuf {
    fn new(kind: Idx, v: &[i64]) -> IdxBuf {
        match kind {
            Idx::I32 => IdxBuf::I32(v.iter().map(|&i| i as i32).collect()),
            Idx::I64 => IdxBuf::I64(v.to_vec()),
        }
    }

    fn len(&self) -> usize {
        match self {
            IdxBuf::I32(v) => v.len(),
            IdxBuf::I64(v) => v.len(),
        }
    }

    fn ptr(&self) -> *const c_void {
        if self.len() == 0 {
            return ptr::null();
        }
        match self {
            IdxBuf::I32(v) => v.as_ptr().cast(),
            IdxBuf::I64(v) => v.as_ptr().cast(),
        }
    }
}

/// The gathered indices widened to i64.
fn gathered_indices(out: &SparseOut, kind: Idx) -> Vec<i64> {
    match kind {
        Idx::I32 => out.indices::<i32>().into_iter().map(i64::from).collect(),
        Idx::I64 => out.indices::<i64>(),
    }
}

/// The reference coalescing: each replica's rows of equal index summed in input order, then the
/// replicas' sums in world order; each level accumulates in `A` and rounds once to `T`.
fn coalesce_ref<T: Copy, A: Copy + std::ops::Add<Output = A>>(
    parts: &[(Vec<i64>, Vec<T>)],
    row_len: usize,
    widen: fn(T) -> A,
    narrow: fn(A) -> T,
) -> (Vec<i64>, Vec<T>) {
    fn sum_into<T: Copy, A: Copy + std::ops::Add<Output = A>>(
        map: &mut BTreeMap<i64, Vec<A>>,
        index: i64,
        row: &[T],
        widen: fn(T) -> A,
    ) {
        match map.get_mut(&index) {
            Some(acc) => acc
                .iter_mut()
                .zip(row)
                .for_each(|(a, &x)| *a = *a + widen(x)),
            None => {
                map.insert(index, row.iter().map(|&x| widen(x)).collect());
            }
        }
    }
    let mut total: BTreeMap<i64, Vec<A>> = BTreeMap::new();
    for (indices, values) in parts {
        let mut local: BTreeMap<i64, Vec<A>> = BTreeMap::new();
        for (k, &i) in indices.iter().enumerate() {
            sum_into(
                &mut local,
                i,
                &values[k * row_len..(k + 1) * row_len],
                widen,
            );
        }
        for (i, acc) in local {
            let rounded: Vec<T> = acc.into_iter().map(narrow).collect();
            sum_into(&mut total, i, &rounded, widen);
        }
    }
    let keys = total.keys().copied().collect();
    let values = total
        .into_values()
        .flat_map(|acc| acc.into_iter().map(narrow))
        .collect();
    (keys, values)
}

fn id_f32(x: f32) -> f32 {
    x
}

fn id_f64(x: f64) -> f64 {
    x
}

fn sparse_stats(ctx: &Context) -> serde_json::Value {
    ctx.describe_json()["sparse_last_step"].clone()
}

/// Gathers: Caffe2's tests, row counts, dtypes, AVG, outputs, describe.
#[path = "sparse_parts/gathers.rs"]
mod gathers;

/// Bad input that fails the step.
#[path = "sparse_parts/bad_steps.rs"]
mod bad_steps;

/// Bad arguments to the sparse calls, and unregister.
#[path = "sparse_parts/bad_arguments.rs"]
mod bad_arguments;
