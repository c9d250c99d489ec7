//! Faults: a stuck collective, a device fault and a stuck caller stream fail their context alone,
//! and destroy still returns.

use super::*;

#[test]
fn a_stuck_collective_times_out_and_poisons_only_its_context() {
    let Some(stuck) = StuckCaller::new("a_stuck_collective_times_out", |o| o.set_timeout_ms(50))
    else {
        return;
    };
    let (ctx, caller) = (&stuck.ctx, &stuck.caller);
    let n = 1024;
    let g0 = caller.alloc_zeros::<f32>(n).unwrap();
    let g1 = caller.alloc_zeros::<f32>(n).unwrap();
    caller.synchronize().unwrap();
    register_device(ctx, "g", GRAD, 0, dptr(caller, &g0), n, F32);
    register_device(ctx, "g", GRAD, 1, dptr(caller, &g1), n, F32);
    set_stream(ctx, 0, caller);
    set_stream(ctx, 1, caller);
    stuck.spin_until_released_then_fill(&g0, 1.0);
    check(ctx.allreduce_grads(SUM), "allreduce_grads (queued)");
    expect_err(synchronize(ctx), TIMEOUT, &["timeout"]);
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    assert!(
        stuck.still_busy(),
        "the caller stream is stuck until released"
    );
    stuck.release();
    caller.synchronize().unwrap();
    // Another context is unaffected.
    let other = cuda_context("timeout", &[0], |_| {}).unwrap();
    check(synchronize(&other), "synchronize on a fresh context");
}

/// A device fault (on a GPU: a kernel's illegal address, after which every call on that context
/// fails) is reported as BACKEND_ERROR naming the driver's error; the context then refuses
/// collectives with INVALID_STATE, and destroying it neither hangs nor aborts the process. The
/// fake driver's `fake_cuda_fault` provokes it; on a real driver this prints that it was skipped.
#[test]
fn a_device_fault_fails_the_context_and_destroy_still_returns() {
    // Across two GPUs too (AUTO: NCCL communicators, aborted by the failure), where there are
    // two. (device_count needs a driver: asked only once the first run found one.)
    if device_fault_on(&[0, 0]) && device_count() >= 2 {
        device_fault_on(&[0, 1]);
    }
}

/// The fault on `ordinals`; false when it could not run here (no GPU, or a real driver).
fn device_fault_on(ordinals: &[i32]) -> bool {
    let test = "a_device_fault_fails_the_context";
    // The timeout only bounds a wait that would otherwise hang: the fault shows as an error.
    let Some(ctx) = cuda_context(test, ordinals, |o| o.set_timeout_ms(60_000)) else {
        return false;
    };
    // SAFETY: the fake's `void fake_cuda_fault(int)`.
    let Some(fault) = (unsafe { fake_driver_fn::<extern "C" fn(i32)>(test, "fake_cuda_fault") })
    else {
        return false;
    };
    let n = 4096;
    let bufs: Vec<_> = (ordinals.iter().enumerate())
        .map(|(r, &ordinal)| {
            let stream = default_stream(ordinal);
            let d = stream.clone_htod(&vec![1.0f32; n]).unwrap();
            register_device(&ctx, "g", GRAD, r, dptr(&stream, &d), n, F32);
            stream.synchronize().unwrap();
            d
        })
        .collect();
    check(ctx.allreduce_grads(SUM), "allreduce_grads before the fault");
    check(synchronize(&ctx), "synchronize before the fault");
    // Cleared however the test ends: the fault is process-wide.
    struct Cleared(extern "C" fn(i32));
    impl Drop for Cleared {
        fn drop(&mut self) {
            (self.0)(0);
        }
    }
    let cleared = Cleared(fault);
    fault(700); // CUDA_ERROR_ILLEGAL_ADDRESS
                // The fault shows in the next call that issues or waits, whichever comes first.
    let st = match ctx.allreduce_grads(SUM) {
        OK => synchronize(&ctx),
        st => st,
    };
    let msg = last_error();
    let later = [ctx.allreduce_grads(SUM), synchronize(&ctx)];
    let later_msg = last_error();
    // Destroyed while the device still fails every call, as a faulted GPU context does.
    drop(ctx);
    drop(cleared);
    drop(bufs);
    assert_eq!(st, dpsync_status::DPSYNC_STATUS_BACKEND_ERROR, "{msg}");
    assert!(msg.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{msg}");
    assert_eq!(later, [INVALID_STATE; 2], "{later_msg}");
    assert!(later_msg.contains("destroy"), "{later_msg}");
    // The process goes on: a new context works.
    let again = cuda_context(test, ordinals, |_| {}).expect("a fresh context after the fault");
    check(synchronize(&again), "synchronize on a fresh context");
    true
}

/// Host tensors on CUDA replicas wait on the host for the callers' streams; a stream that does
/// not get there in time fails the context like any collective that timed out (its queued
/// waits may never end), and the host tensors stay as they were.
#[test]
fn a_stuck_caller_stream_times_out_the_host_tensors_wait_and_fails_the_context() {
    let Some(stuck) = StuckCaller::new("a_stuck_caller_stream_times_out", |o| {
        o.set_timeout_ms(50);
    }) else {
        return;
    };
    let (ctx, caller) = (&stuck.ctx, &stuck.caller);
    let n = 256;
    let scratch = caller.alloc_zeros::<f32>(n).unwrap();
    caller.synchronize().unwrap();
    let mut host = [vec![1.0f32; n], vec![2.0f32; n]];
    for (r, h) in host.iter_mut().enumerate() {
        ctx.reg("cpu_grad", GRAD, r, h, F32);
        set_stream(ctx, r, caller);
    }
    stuck.spin_until_released_then_fill(&scratch, 1.0);
    expect_err(
        ctx.allreduce_grads(SUM),
        TIMEOUT,
        &["replica 0", "callers' streams", "50 ms"],
    );
    assert!(
        stuck.still_busy(),
        "returned while the caller stream was stuck"
    );
    assert!(
        host[0].iter().all(|&x| x == 1.0) && host[1].iter().all(|&x| x == 2.0),
        "the host tensors were touched"
    );
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    stuck.release();
    caller.synchronize().unwrap();
    drop(stuck);
}
