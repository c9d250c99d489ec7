//! Sparse gradient slices (embedding gradients): registration, this step's slice, and the
//! gathered slice after `dpsync_allreduce_grads`.

use std::ffi::{c_char, c_void};

use super::boundary::{dpsync_context, try_enum, try_mut, try_name, with_context};
use super::status::dpsync_status;
use crate::error::Error;
use crate::registry::sparse::{SparseSlice, SparseSpec};

/// Names the gradient and replica in a message about one of their arguments.
fn about(name: &str, replica: usize) -> impl Fn(Error) -> Error + '_ {
    move |e| {
        Error::new(
            e.kind,
            format!(
                "{} (sparse gradient '{name}', replica {replica})",
                e.message
            ),
        )
    }
}

/// A sparse gradient: per step, each replica supplies `rows` indices and rows x row_len values.
/// value_dtype is DPSYNC_DTYPE_F32, F64, F16 or BF16; index_dtype is DPSYNC_DTYPE_I32 or
/// DPSYNC_DTYPE_I64 (others are INVALID_ARGUMENT). num_embeddings > 0 enables index range checks
/// (0 <= index < num_embeddings, checked by dpsync_allreduce_grads). Re-registration follows
/// dpsync_register's rules: identical is a no-op, different is CONFLICT; a name used by a dense
/// tensor is CONFLICT too. Replicas that disagree (row_len, dtypes, num_embeddings, or a replica
/// without it) make dpsync_allreduce_grads return INCONSISTENT naming it and the replica.
/// Every registered sparse gradient must be set on every replica before each
/// dpsync_allreduce_grads (rows may be 0, then indices/values may be NULL).
/// dpsync_unregister removes it.
#[no_mangle]
pub unsafe extern "C" fn dpsync_register_sparse(
    context: *mut dpsync_context,
    name: *const c_char,
    replica: usize,
    row_len: usize,
    value_dtype: u32,
    index_dtype: u32,
    num_embeddings: usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let name = try_name(name, "name")?;
        let value_dtype = try_enum(
            value_dtype,
            SparseSpec::value_dtype_from_code,
            "value_dtype",
            "DPSYNC_DTYPE_F32/F64/F16/BF16 (0..3)",
        )
        .map_err(about(name, replica))?;
        let index_dtype = try_enum(
            index_dtype,
            SparseSpec::index_dtype_from_code,
            "index_dtype",
            "DPSYNC_DTYPE_I32/I64 (4, 5)",
        )
        .map_err(about(name, replica))?;
        let spec = SparseSpec {
            row_len,
            value_dtype,
            index_dtype,
            num_embeddings,
        };
        ctx.register_sparse(name, replica, spec)
    })
}

/// This step's slice on `replica`: `rows` indices and rows x row_len values. The buffers must
/// stay valid until dpsync_allreduce_grads returns; they are read by it (not by this call), so
/// they may be filled after this call. Setting a slice again before the step replaces it.
/// A successful dpsync_allreduce_grads consumes every slice: set them again for the next step.
/// NULL indices or values with rows > 0, or buffers not aligned to their dtype, are
/// INVALID_ARGUMENT; a name registered on other replicas but not this one is INCONSISTENT.
#[no_mangle]
pub unsafe extern "C" fn dpsync_sparse_set(
    context: *mut dpsync_context,
    name: *const c_char,
    replica: usize,
    indices: *const c_void,
    values: *const c_void,
    rows: usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let name = try_name(name, "name")?;
        if rows > 0 {
            for (argument, ptr) in [("indices", indices), ("values", values)] {
                if ptr.is_null() {
                    return Err(Error::invalid(format!(
                        "{argument} is NULL but rows is {rows} (sparse gradient '{name}', replica {replica})"
                    )));
                }
            }
        }
        let slice = SparseSlice {
            indices: indices as usize,
            values: values as usize,
            rows,
        };
        ctx.sparse_set(name, replica, slice)
    })
}

/// After dpsync_allreduce_grads: the gathered slice on `replica`: every replica's rows in world
/// order (rank 0 replica 0, rank 0 replica 1, ..., rank 1 replica 0, ...), or coalesced (unique
/// ascending indices, rows summed) when dpsync_options_set_sparse_coalesce is set. Under
/// DPSYNC_REDUCE_AVG the values are divided by the replicas in the world. The buffers belong
/// to the library, live in the replica's memory, and stay valid until the next
/// dpsync_allreduce_grads or destroy. Slices set with the same indices buffer on every replica
/// share one index gather (the same *indices), and *rows always equals the number of gathered
/// value rows. When *rows is 0, *indices and *values are NULL.
/// INVALID_STATE before the first dpsync_allreduce_grads that included `name`. The outputs are
/// written only on success.
#[no_mangle]
pub unsafe extern "C" fn dpsync_sparse_get(
    context: *mut dpsync_context,
    name: *const c_char,
    replica: usize,
    indices: *mut *const c_void,
    values: *mut *const c_void,
    rows: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let name = try_name(name, "name")?;
        let indices = try_mut(indices, "indices")?;
        let values = try_mut(values, "values")?;
        let rows = try_mut(rows, "rows")?;
        let (i, v, n) = ctx.sparse_get(name, replica)?;
        *indices = i as *const c_void;
        *values = v as *const c_void;
        *rows = n;
        Ok(())
    })
}
