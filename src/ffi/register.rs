//! Registering caller-owned tensor memory.

use std::ffi::{c_char, c_void};

use super::boundary::{dpsync_context, try_enum, try_name, with_context};
use super::status::dpsync_status;
use crate::error::Error;
use crate::types::{DType, Role};

const DTYPES: &str = "DPSYNC_DTYPE_F32/F64/F16/BF16/I32/I64 (0..5)";
const ROLES: &str = "DPSYNC_ROLE_PARAM/GRAD/COMPUTED/STATE (1, 2, 4, 8; one role, not a mask)";

/// Register `count` elements at `data` as tensor `name` of `role` (exactly one DPSYNC_ROLE_*
/// value) on `replica`.
/// Registering the identical (name, role, replica, data, count, dtype) again is a no-op
/// (a duplicate initialiser is not an error); any other difference is CONFLICT.
/// The registration order of GRAD tensors is their production order in the forward pass;
/// gradients are reduced in reverse order. Every name must be registered on every replica
/// with the same role, count and dtype before the first collective that touches it
/// (otherwise INCONSISTENT, naming the tensor and the replica). Registering between
/// collectives is normal: the plan is rebuilt on the next collective. `data` must be aligned
/// to the dtype's size (INVALID_ARGUMENT otherwise: a GPU faults on misaligned elements).
#[no_mangle]
pub unsafe extern "C" fn dpsync_register(
    context: *mut dpsync_context,
    name: *const c_char,
    role: u32,
    replica: usize,
    data: *mut c_void,
    count: usize,
    dtype: u32,
) -> dpsync_status {
    with_context(context, |ctx| {
        let name = try_name(name, "name")?;
        // A role that is a dtype's code beside a dtype that is a role's: the two swapped.
        let swapped = |mut e: Error| {
            if DType::from_code(role).is_some() && Role::from_code(dtype).is_some() {
                e.message.push_str(
                    "; role and dtype look swapped: the arguments are (context, name, role, \
                     replica, data, count, dtype)",
                );
            }
            e
        };
        let role = try_enum(role, Role::from_code, "role", ROLES).map_err(swapped)?;
        if data.is_null() {
            return Err(Error::invalid(format!(
                "data is NULL (tensor '{name}', replica {replica})"
            )));
        }
        if count == 0 {
            return Err(Error::invalid(format!(
                "count is 0 (tensor '{name}', replica {replica})"
            )));
        }
        let dtype = try_enum(dtype, DType::from_code, "dtype", DTYPES).map_err(swapped)?;
        ctx.register(name, role, replica, data as usize, count, dtype)
    })
}

/// Remove tensor `name` (a dense tensor or a sparse gradient) from every replica. NOT_FOUND if it
/// is not registered.
#[no_mangle]
pub unsafe extern "C" fn dpsync_unregister(
    context: *mut dpsync_context,
    name: *const c_char,
) -> dpsync_status {
    with_context(context, |ctx| ctx.unregister(try_name(name, "name")?))
}
