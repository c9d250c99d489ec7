//! Dense collectives. Each validates every tensor it will touch before writing a byte, and
//! returns once its work is done (host) or queued (devices).

use std::ffi::c_char;

use super::boundary::{dpsync_context, try_enum, try_name, with_collective, with_context};
use super::status::dpsync_status;
use crate::error::{Error, Result};
use crate::types::{ReduceOp, RoleMask};

pub(super) fn reduce_op(op: u32) -> Result<ReduceOp> {
    try_enum(
        op,
        ReduceOp::from_code,
        "op",
        "DPSYNC_REDUCE_SUM/AVG (0, 1)",
    )
}

pub(super) fn role_mask(roles: u32) -> Result<RoleMask> {
    RoleMask::from_bits(roles).ok_or_else(|| {
        Error::invalid(format!(
            "roles is {roles:#x}: a non-empty mask of DPSYNC_ROLE_* bits (0x1..0xF)"
        ))
    })
}

/// Reduce every GRAD tensor across all replicas (and ranks), fused into buckets, last
/// registered first, and gather the sparse gradients set for this step (see
/// dpsync_sparse_set / dpsync_sparse_get). Every replica ends with identical bytes. Everything
/// is checked first (dense registrations, every sparse slice set on every replica, sparse index
/// ranges): a failed call changes no tensor, dense or sparse, and consumes no slice. (On CUDA
/// replicas the index ranges are checked by a kernel in stream order: the call returns OK and
/// the next dpsync_synchronize reports an index out of range as INCONSISTENT.) Buckets
/// already reduced this step by dpsync_grad_ready are not reduced again (under AVG they are
/// divided); the step then ends.
#[no_mangle]
pub unsafe extern "C" fn dpsync_allreduce_grads(
    context: *mut dpsync_context,
    op: u32,
) -> dpsync_status {
    with_collective(
        context,
        "dpsync_allreduce_grads",
        || reduce_op(op),
        |ctx, op| ctx.allreduce_grads(op),
    )
}

/// Reduce one tensor (any role) across all replicas in place.
#[no_mangle]
pub unsafe extern "C" fn dpsync_allreduce(
    context: *mut dpsync_context,
    name: *const c_char,
    op: u32,
) -> dpsync_status {
    with_collective(
        context,
        "dpsync_allreduce",
        || Ok((try_name(name, "name")?, reduce_op(op)?)),
        |ctx, (name, op)| ctx.allreduce(name, op),
    )
}

/// Copy every tensor whose role is in `roles` (a mask of `DPSYNC_ROLE_*` bits, e.g.
/// `DPSYNC_ROLE_PARAM | DPSYNC_ROLE_STATE` for a checkpoint) from `root_replica` to all other
/// replicas. In a world, `root_replica` is a world replica index: rank 0's replicas first,
/// then rank 1's, and so on; out of range is `DPSYNC_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn dpsync_broadcast(
    context: *mut dpsync_context,
    roles: u32,
    root_replica: usize,
) -> dpsync_status {
    with_collective(
        context,
        "dpsync_broadcast",
        || role_mask(roles),
        |ctx, roles| ctx.broadcast(roles, root_replica),
    )
}

/// Replace every tensor whose role is in `roles` by its mean over all replicas.
#[no_mangle]
pub unsafe extern "C" fn dpsync_average(context: *mut dpsync_context, roles: u32) -> dpsync_status {
    with_collective(
        context,
        "dpsync_average",
        || role_mask(roles),
        |ctx, roles| ctx.average(roles),
    )
}

/// Overlap: tell the library that GRAD tensor `name` is final on `replica` for this step. A
/// bucket starts reducing as soon as all its tensors are ready on all replicas (on host
/// replicas within this call; on CUDA replicas it is queued after the work already on the
/// replicas' streams, which are not made to wait for it); dpsync_allreduce_grads then only
/// finishes what is left, makes the streams wait, and ends the step. Optional: without these
/// calls everything starts in dpsync_allreduce_grads. Early buckets use the op of the previous
/// dpsync_allreduce_grads (before the first, nothing starts early); if the op changes, SUM
/// buckets are divided for AVG, and AVG buckets make a SUM INVALID_STATE (docs/API.md,
/// "Overlap"). Declaring a tensor twice in a step is a no-op. NOT_FOUND for an unregistered name;
/// INVALID_ARGUMENT for a replica out of range or a tensor that is not a dense GRAD;
/// INCONSISTENT while any GRAD is inconsistent across replicas (as dpsync_allreduce_grads
/// would report). While a bucket of the step has been reduced early, registering (other than
/// identically) or unregistering dense tensors is INVALID_STATE.
#[no_mangle]
pub unsafe extern "C" fn dpsync_grad_ready(
    context: *mut dpsync_context,
    name: *const c_char,
    replica: usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        ctx.grad_ready(try_name(name, "name")?, replica)
    })
}
