//! Shards (ZeRO stage 1): `dpsync_shard`, `dpsync_reduce_scatter_grads`, `dpsync_allgather`.

use std::ffi::c_char;

use super::boundary::{dpsync_context, try_mut, try_name, with_collective, with_context};
use super::collectives::{reduce_op, role_mask};
use super::status::dpsync_status;

/// The piece of tensor `name` owned by local replica `replica` (world replica offset +
/// replica): its first element and its element count. With W replicas in the world, world
/// replica w owns elements [count * w / W, count * (w + 1) / W) of every dense tensor of
/// `count` elements (a piece may be empty when count < W): a parameter and its gradient are cut
/// alike. NOT_FOUND for an unknown name, INVALID_ARGUMENT for a replica out of range or a NULL
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn dpsync_shard(
    context: *const dpsync_context,
    name: *const c_char,
    replica: usize,
    offset: *mut usize,
    count: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let name = try_name(name, "name")?;
        let (offset, count) = (try_mut(offset, "offset")?, try_mut(count, "count")?);
        (*offset, *count) = ctx.shard(name, replica)?;
        Ok(())
    })
}

/// Like dpsync_allreduce_grads (the same validation and agreement across ranks, the same fusion
/// buckets in reverse registration order, every dtype, SUM or AVG, sparse gradients gathered
/// whole), except that each replica ends with the reduced values only in the pieces it owns
/// (dpsync_shard); every other element of its GRAD tensors is left as it was. Each element is
/// summed as dpsync_allreduce_grads sums it. Buckets reduced early by dpsync_grad_ready follow
/// the previous step's call: after a reduce-scatter step they are reduce-scattered (and an
/// allreduce_grads ending the step gathers their pieces: the same bytes); a step whose buckets
/// were reduced whole early (after an allreduce step) must end with dpsync_allreduce_grads
/// (INVALID_STATE here, nothing changed). In a world of host replicas a bucket started early
/// writes nothing until the step agrees, so it serves either call.
#[no_mangle]
pub unsafe extern "C" fn dpsync_reduce_scatter_grads(
    context: *mut dpsync_context,
    op: u32,
) -> dpsync_status {
    with_collective(
        context,
        "dpsync_reduce_scatter_grads",
        || reduce_op(op),
        |ctx, op| ctx.reduce_scatter_grads(op),
    )
}

/// For every tensor whose role is in `roles` (a non-empty mask of DPSYNC_ROLE_* bits): each
/// replica's owned piece (dpsync_shard) is copied to every other replica, of every rank, so
/// that all replicas end with identical tensors. Tensors of other roles are not touched.
/// Roles 0 or outside the four roles are INVALID_ARGUMENT.
#[no_mangle]
pub unsafe extern "C" fn dpsync_allgather(
    context: *mut dpsync_context,
    roles: u32,
) -> dpsync_status {
    with_collective(
        context,
        "dpsync_allgather",
        || role_mask(roles),
        |ctx, roles| ctx.allgather(roles),
    )
}
