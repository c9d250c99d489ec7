//! Contexts over CUDA replicas for the GPU tests: skipped (or, under DPSYNC_REQUIRE_GPU=1, failed)
//! without a usable GPU.

use super::context::{check, last_error, Context, Options};
use super::skip::skip;
use dpsync::*;
use std::ptr;

const UNAVAILABLE: dpsync_status = dpsync_status::DPSYNC_STATUS_UNAVAILABLE;

/// A context over CUDA `ordinals`, or `None` (after printing the skip line a GPU test owes its
/// reader) when this machine has no usable CUDA device.
pub fn cuda_context(test: &str, ordinals: &[i32], configure: impl Fn(&Options)) -> Option<Context> {
    let o = Options::new();
    o.set_cuda_replicas(ordinals);
    configure(&o);
    let mut p = ptr::null_mut();
    // SAFETY: valid options and out pointer.
    let st = unsafe { dpsync_context_create(o.0, &mut p) };
    if st == UNAVAILABLE {
        // On the GPU machine (scripts/gpu-check.sh) a missing NVRTC or NCCL must fail the run,
        // not turn every GPU test into a pass that tested nothing.
        if std::env::var("DPSYNC_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!(
                "{test}: DPSYNC_REQUIRE_GPU=1, but creating the CUDA context was UNAVAILABLE: {}",
                last_error()
            );
        }
        skip(format_args!(
            "{test}: skipped: no CUDA device ({})",
            last_error()
        ));
        return None;
    }
    check(st, "dpsync_context_create (CUDA)");
    Some(Context(p))
}
