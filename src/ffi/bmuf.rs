//! Blockwise model-update filtering over the PARAM tensors. The boundary only refuses a
//! non-finite block_lr; the ranges and the default momentum are the context's.

use super::boundary::{dpsync_context, try_finite, with_collective, with_context};
use super::status::dpsync_status;
use crate::context::Context;

/// Starts blockwise model-update filtering (BMUF; Chen & Huo, ICASSP 2016) over all PARAM
/// tensors, or restarts it (e.g. at the end of a warm-up phase).
/// block_momentum < 0 (-INFINITY included) selects the default 1 - 1/N (N = replicas in the
/// world); otherwise 0 <= block_momentum < 1. block_lr > 0 and finite, usually 1. Other values
/// and NaN are INVALID_ARGUMENT. No PARAM registered is INVALID_STATE; an integer PARAM is
/// INVALID_ARGUMENT.
/// Broadcasts PARAMs from replica 0, takes them as the global model W and zeroes the block
/// momentum D (state kept on every replica: f32 for f32/f16/bf16 params, f64 for f64).
/// The PARAM tensors must then stay as they are: registering or unregistering one makes the
/// next dpsync_bmuf_step fail with INVALID_STATE until dpsync_bmuf_init is called again.
/// On failure nothing changes (the previous filter, if any, stays in place).
#[no_mangle]
pub unsafe extern "C" fn dpsync_bmuf_init(
    context: *mut dpsync_context,
    block_lr: f64,
    block_momentum: f64,
    nesterov: bool,
) -> dpsync_status {
    with_collective(
        context,
        "dpsync_bmuf_init",
        || try_finite(block_lr, "block_lr"),
        |ctx, block_lr| ctx.bmuf_init(block_lr, block_momentum, nesterov),
    )
}

/// One BMUF step, typically after k local optimizer steps. With A = mean of each PARAM over all
/// replicas, mu = block_momentum, eta = block_lr and Wg = W + (nesterov ? mu * D : 0) the model
/// the block started from:
///     G = A - Wg;  D = mu * D + eta * G;  W = W + D;
///     every replica's PARAMs := W + (nesterov ? mu * D : 0)
/// Every replica ends with identical bytes. INVALID_STATE before dpsync_bmuf_init, or when PARAM
/// tensors were registered or unregistered since (call dpsync_bmuf_init again).
#[no_mangle]
pub unsafe extern "C" fn dpsync_bmuf_step(context: *mut dpsync_context) -> dpsync_status {
    with_context(context, |ctx| ctx.world_call(Context::bmuf_step))
}
