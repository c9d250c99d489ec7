//! Sparse gradients: registration, slices, and the gathered result.

use super::context::{check, cstr, last_error, Context};
use dpsync::*;
use std::ffi::c_void;
use std::ptr;

const OK: dpsync_status = dpsync_status::DPSYNC_STATUS_OK;

/// The gathered slice of a sparse gradient on one replica, as `dpsync_sparse_get` returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseOut {
    pub indices: *const c_void,
    pub values: *const c_void,
    pub rows: usize,
}

// Each binary reads the gathered slices its tests check.
#[allow(dead_code)]
impl SparseOut {
    /// A copy of the gathered indices (`T` = i32 or i64, as registered).
    pub fn indices<T: Copy>(&self) -> Vec<T> {
        if self.rows == 0 {
            return Vec::new();
        }
        // SAFETY: the library keeps `rows` indices at this address until the next step.
        unsafe { std::slice::from_raw_parts(self.indices.cast::<T>(), self.rows) }.to_vec()
    }

    /// A copy of the gathered values: `rows × row_len` elements of `T` (u16 for f16/bf16).
    pub fn values<T: Copy>(&self, row_len: usize) -> Vec<T> {
        if self.rows == 0 {
            return Vec::new();
        }
        // SAFETY: as for indices.
        unsafe { std::slice::from_raw_parts(self.values.cast::<T>(), self.rows * row_len) }.to_vec()
    }
}

// A wrapper per sparse-gradient call: each binary makes the calls of its subject.
#[allow(dead_code)]
impl Context {
    pub fn register_sparse(
        &self,
        name: &str,
        replica: usize,
        row_len: usize,
        value_dtype: u32,
        index_dtype: u32,
        num_embeddings: usize,
    ) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: valid handle and name.
        unsafe {
            dpsync_register_sparse(
                self.0,
                c.as_ptr(),
                replica,
                row_len,
                value_dtype,
                index_dtype,
                num_embeddings,
            )
        }
    }

    /// Registers a sparse gradient on every replica and asserts success.
    #[track_caller]
    pub fn reg_sparse_all(
        &self,
        name: &str,
        row_len: usize,
        value_dtype: u32,
        index_dtype: u32,
        num_embeddings: usize,
    ) {
        for r in 0..self.replica_count() {
            let st =
                self.register_sparse(name, r, row_len, value_dtype, index_dtype, num_embeddings);
            check(st, &format!("register_sparse '{name}' on replica {r}"));
        }
    }

    pub fn sparse_set_raw(
        &self,
        name: &str,
        replica: usize,
        indices: *const c_void,
        values: *const c_void,
        rows: usize,
    ) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: the caller keeps the buffers valid until allreduce_grads returns.
        unsafe { dpsync_sparse_set(self.0, c.as_ptr(), replica, indices, values, rows) }
    }

    /// Sets `indices.len()` rows (NULL pointers when there are none).
    pub fn sparse_set<I, V>(
        &self,
        name: &str,
        replica: usize,
        indices: &[I],
        values: &[V],
    ) -> dpsync_status {
        let rows = indices.len();
        let (i, v) = if rows == 0 {
            (ptr::null(), ptr::null())
        } else {
            (indices.as_ptr().cast(), values.as_ptr().cast())
        };
        self.sparse_set_raw(name, replica, i, v, rows)
    }

    /// `dpsync_sparse_get`, or the failing status.
    pub fn sparse_get(&self, name: &str, replica: usize) -> Result<SparseOut, dpsync_status> {
        let c = cstr(name);
        let mut out = SparseOut {
            indices: ptr::null(),
            values: ptr::null(),
            rows: 0,
        };
        // SAFETY: valid handle, name and out pointers.
        let st = unsafe {
            dpsync_sparse_get(
                self.0,
                c.as_ptr(),
                replica,
                &mut out.indices,
                &mut out.values,
                &mut out.rows,
            )
        };
        if st == OK {
            Ok(out)
        } else {
            Err(st)
        }
    }

    /// `dpsync_sparse_get`, asserting success.
    #[track_caller]
    pub fn gathered(&self, name: &str, replica: usize) -> SparseOut {
        self.sparse_get(name, replica).unwrap_or_else(|st| {
            panic!(
                "sparse_get '{name}' on replica {replica}: {st:?}: {}",
                last_error()
            )
        })
    }
}
