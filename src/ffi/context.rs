//! `dpsync_context_*` and the calls about a context as a whole.

use std::ffi::c_void;

use super::boundary::{dpsync_context, entry, try_mut, try_ref, with_context};
use super::options::dpsync_options;
use super::status::dpsync_status;
use crate::context::Context;

/// Creates a context driving every replica the options name. `*out` is set only on success.
/// The options are copied: they may be changed or freed afterwards.
/// With CUDA replicas it loads the CUDA driver, NVRTC and (transport NCCL or AUTO) NCCL:
/// DPSYNC_STATUS_UNAVAILABLE, naming what is missing, when the driver or NVRTC cannot be
/// loaded, an ordinal has no device, or NCCL was required and is missing.
#[no_mangle]
pub unsafe extern "C" fn dpsync_context_create(
    options: *const dpsync_options,
    out: *mut *mut dpsync_context,
) -> dpsync_status {
    entry(|| {
        let options = try_ref(options, "options")?;
        let out = try_mut(out, "out")?;
        let context = Context::new(&options.inner)?;
        *out = Box::into_raw(Box::new(dpsync_context::new(context)));
        Ok(())
    })
}

/// Destroys a context. Registered memory is not touched (it belongs to the caller).
/// NULL is accepted.
#[no_mangle]
pub unsafe extern "C" fn dpsync_context_destroy(context: *mut dpsync_context) -> dpsync_status {
    entry(|| {
        if !context.is_null() {
            // SAFETY: the pointer came from Box::into_raw in dpsync_context_create.
            drop(Box::from_raw(context));
        }
        Ok(())
    })
}

/// Number of replicas this context drives.
#[no_mangle]
pub unsafe extern "C" fn dpsync_replica_count(
    context: *const dpsync_context,
    out: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        *try_mut(out, "out")? = ctx.replica_count();
        Ok(())
    })
}

/// 1 / (total replicas in the world): the factor to scale each replica's loss by when
/// gradients are SUMmed.
#[no_mangle]
pub unsafe extern "C" fn dpsync_loss_scale(
    context: *const dpsync_context,
    out: *mut f64,
) -> dpsync_status {
    with_context(context, |ctx| {
        *try_mut(out, "out")? = ctx.loss_scale();
        Ok(())
    })
}

/// The caller's CUDA stream (cudaStream_t / CUstream, NULL = legacy default stream) for a CUDA
/// replica. Collectives start after work already queued on it and work queued on it afterwards
/// waits for them, through events, without blocking the host. INVALID_ARGUMENT for host replicas.
/// cudaStreamLegacy (0x1) is the same as NULL; cudaStreamPerThread (0x2) is INVALID_ARGUMENT, as
/// it names another stream on every thread: pass the stream's own handle.
#[no_mangle]
pub unsafe extern "C" fn dpsync_set_stream(
    context: *mut dpsync_context,
    replica: usize,
    cuda_stream: *mut c_void,
) -> dpsync_status {
    with_context(context, |ctx| ctx.set_stream(replica, cuda_stream as usize))
}

/// Block the host until every collective issued so far has completed; reports deferred errors
/// (a device or NCCL failure, a timeout, a sparse index out of range found on the device).
/// Host collectives are complete when they return.
#[no_mangle]
pub unsafe extern "C" fn dpsync_synchronize(context: *mut dpsync_context) -> dpsync_status {
    with_context(context, |ctx| ctx.synchronize())
}
