//! NCCL setup and failure: slow setup, an unusable or failing NCCL, two NCCL ranks on one GPU.

use super::*;

/// A GRAD "g" of `n` ones on replica 0 (GPU 0) and replica 1 (GPU 1), with its streams.
fn ones_on_gpus_0_and_1(
    ctx: &Context,
    n: usize,
) -> Vec<(
    cudarc::driver::CudaSlice<f32>,
    std::sync::Arc<cudarc::driver::CudaStream>,
)> {
    (0..2)
        .map(|r| {
            let stream = default_stream(r as i32);
            let d = stream.clone_htod(&vec![1.0f32; n]).unwrap();
            register_device(ctx, "g", GRAD, r, dptr(&stream, &d), n, F32);
            stream.synchronize().unwrap();
            (d, stream)
        })
        .collect()
}

/// Creating NCCL communicators and a set's first group (where NCCL connects the ranks) take
/// seconds on a multi-GPU machine; a collective timeout set for steady-state steps must not cut
/// them short. The fake NCCL stretches both with FAKE_NCCL_SETUP_MS (scripts/fake-cuda.sh);
/// elsewhere this prints that it was skipped. With a timeout a quarter of that, AUTO still
/// chooses NCCL, and the first collectives of both transports succeed with the right sums.
#[test]
fn slow_nccl_setup_is_not_a_collective_timeout() {
    let Some(setup_ms) = std::env::var("FAKE_NCCL_SETUP_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms >= 8)
    else {
        skip(format_args!(
            "slow_nccl_setup_is_not_a_collective_timeout: skipped: needs the fake NCCL's slow \
             setup (FAKE_NCCL_SETUP_MS; scripts/fake-cuda.sh)"
        ));
        return;
    };
    assert!(
        Place::gpus("slow_nccl_setup", 2).is_some(),
        "the fake has 2+ GPUs"
    );
    for transport in [T_AUTO, T_NCCL] {
        let ctx = cuda_context("slow nccl setup", &[0, 1], |o| {
            o.set_transport(transport);
            o.set_timeout_ms(setup_ms / 4);
        })
        .expect("the fake CUDA driver and NCCL are loaded");
        let json = ctx.describe_json();
        assert_eq!(json["transport"], "nccl", "transport {transport}: {json}");
        two_sums_of_ones(&ctx, &format!("transport {transport}"));
    }
}

/// Registers 1000 ones on GPUs 0 and 1 and checks that two SUM steps give 2, then 4. Each step
/// has run on the GPUs (waited for without a timeout) before dpsync looks for its completion, so
/// a short collective timeout (slow_nccl_setup_is_not_a_collective_timeout's) cannot expire on
/// steady-state work that a busy machine merely delays.
fn two_sums_of_ones(ctx: &Context, what: &str) {
    let n = 1000;
    let keep = ones_on_gpus_0_and_1(ctx, n);
    for step in 1..=2 {
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        for ordinal in 0..2 {
            let gpu = cudarc::driver::CudaContext::new(ordinal).unwrap();
            gpu.synchronize().expect("cuCtxSynchronize");
        }
        check(synchronize(ctx), "synchronize");
        for (r, (d, stream)) in keep.iter().enumerate() {
            let got = stream.clone_dtoh(d).unwrap();
            let want = (1u32 << step) as f32;
            assert_eq!(got, vec![want; n], "{what}, step {step}, replica {r}");
        }
    }
}

/// NCCL that cannot be used: a DPSYNC_NCCL_LIBRARY that does not load (that library alone is
/// tried, never another NCCL the loader finds), or an NCCL whose communicators fail to
/// initialise (the fake NCCL's FAKE_NCCL_INIT_FAULT=1). AUTO uses peer copies and says why;
/// NCCL asked for explicitly is UNAVAILABLE (a bad path, at creation) or fails its collective
/// naming NCCL's error. scripts/fake-cuda.sh runs both cases; elsewhere this prints that it was
/// skipped.
/// Log lines kept by `keep_line` (dpsync_set_log_callback).
static LOGGED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn keep_line(
    _level: u32,
    line: *const std::ffi::c_char,
    _: *mut std::ffi::c_void,
) {
    let text = std::ffi::CStr::from_ptr(line)
        .to_string_lossy()
        .into_owned();
    LOGGED.lock().unwrap().push(text);
}

#[test]
fn unusable_nccl_sends_auto_to_peer_copy_and_fails_an_explicit_request() {
    let missing = std::env::var("DPSYNC_NCCL_LIBRARY")
        .ok()
        .filter(|p| !p.is_empty() && !std::path::Path::new(p).exists());
    let init_fault = std::env::var("FAKE_NCCL_INIT_FAULT").as_deref() == Ok("1");
    let want_reason = match (&missing, init_fault) {
        (Some(path), _) => path.clone(),
        (None, true) => "injected init failure".to_owned(),
        (None, false) => {
            skip(format_args!(
                "unusable_nccl_sends_auto_to_peer_copy: skipped: needs DPSYNC_NCCL_LIBRARY naming \
                 a missing file, or the fake NCCL's FAKE_NCCL_INIT_FAULT=1 (scripts/fake-cuda.sh)"
            ));
            return;
        }
    };
    if Place::gpus("unusable_nccl", 2).is_none() {
        return; // scripts/fake-cuda.sh gives it two fake GPUs
    }
    // The fallback is logged (a framework's logger gets it through the callback).
    // SAFETY: a callable function; its lines go to a static.
    unsafe {
        check(
            dpsync_set_log_callback(Some(keep_line), std::ptr::null_mut(), 2),
            "log",
        )
    };
    let auto = cuda_context("unusable nccl", &[0, 1], |_| {}).expect("AUTO falls back");
    // SAFETY: NULL restores the default.
    unsafe {
        check(
            dpsync_set_log_callback(None, std::ptr::null_mut(), 0),
            "log off",
        )
    };
    let warned = LOGGED.lock().unwrap().clone();
    assert!(
        warned
            .iter()
            .any(|l| l.starts_with("NCCL is not used") && l.contains(&want_reason)),
        "{warned:?}"
    );
    let json = auto.describe_json();
    assert_eq!(json["transport"], "peer_copy", "{json}");
    let reason = json["transport_reason"].as_str().unwrap_or_default();
    assert!(reason.contains(&want_reason), "{reason}");
    two_sums_of_ones(&auto, "AUTO without a usable NCCL");
    drop(auto);
    let o = Options::new();
    o.set_cuda_replicas(&[0, 1]);
    o.set_transport(T_NCCL);
    let mut p = std::ptr::null_mut();
    // SAFETY: valid options and out pointer.
    let st = unsafe { dpsync_context_create(o.0, &mut p) };
    if missing.is_some() {
        expect_err(st, UNAVAILABLE, &["DPSYNC_NCCL_LIBRARY", &want_reason]);
        return;
    }
    check(
        st,
        "an explicit NCCL context (communicators are made at first use)",
    );
    let ctx = Context(p);
    let _keep = ones_on_gpus_0_and_1(&ctx, 16);
    let st = ctx.allreduce_grads(SUM);
    assert_ne!(st, OK, "a collective without communicators");
    assert!(
        last_error().contains(&want_reason),
        "{st:?}: {}",
        last_error()
    );
}

/// A failing NCCL, provoked by the fake NCCL of scripts/fake-cuda.sh (FAKE_NCCL_FAULT=hang: the
/// communicators stay in progress forever; =error: they report an asynchronous error): the
/// collective returns TIMEOUT or BACKEND_ERROR, the communicators are aborted, the context
/// refuses further collectives and is destroyed cleanly. A real NCCL cannot be made to fail on
/// demand, so elsewhere this prints that it was skipped.
#[test]
fn a_failing_nccl_collective_poisons_the_context() {
    let fault = std::env::var("FAKE_NCCL_FAULT").unwrap_or_default();
    let want = match fault.as_str() {
        "hang" => (TIMEOUT, "did not get ready in time"),
        "error" => (
            dpsync_status::DPSYNC_STATUS_BACKEND_ERROR,
            "injected failure",
        ),
        _ => {
            skip(format_args!(
                "a_failing_nccl_collective_poisons_the_context: skipped: needs the fake NCCL's \
                 fault injection (FAKE_NCCL_FAULT=hang or error; scripts/fake-cuda.sh)"
            ));
            return;
        }
    };
    assert!(
        Place::gpus("a_failing_nccl_collective", 2).is_some(),
        "the fake has 2+ GPUs"
    );
    // The healthy part (creating the communicators, a first collective without the fault: the
    // fake reads it per group) runs in a context with a generous timeout, so that a busy machine
    // cannot time it out. The fault hits a second context over the same GPUs, which shares those
    // communicators (made, so nothing of its own waits on setup) and has a short timeout: a hang
    // is reported after the longer of it and nccl::setup_time(), which scripts/fake-cuda.sh
    // shortens for this test (DPSYNC_NCCL_SETUP_TIMEOUT_MS; its default is a minute).
    std::env::remove_var("FAKE_NCCL_FAULT");
    let healthy = cuda_context("nccl before the fault", &[0, 1], |o| {
        o.set_transport(T_NCCL);
        o.set_timeout_ms(60_000);
    })
    .expect("the fake CUDA driver and NCCL are loaded");
    let n = 1000;
    let mut keep: Vec<_> = (ones_on_gpus_0_and_1(&healthy, n).into_iter())
        .map(|(d, _)| d)
        .collect();
    check(
        healthy.allreduce_grads(SUM),
        "allreduce_grads before the fault",
    );
    check(synchronize(&healthy), "synchronize before the fault");
    let ctx = cuda_context("nccl fault", &[0, 1], |o| {
        o.set_transport(T_NCCL);
        o.set_timeout_ms(100);
    })
    .unwrap();
    for (r, d) in keep.iter().enumerate() {
        register_device(
            &ctx,
            "g",
            GRAD,
            r,
            dptr(&default_stream(r as i32), d),
            n,
            F32,
        );
    }
    std::env::set_var("FAKE_NCCL_FAULT", &fault);
    expect_err(ctx.allreduce_grads(SUM), want.0, &[want.1]);
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    expect_err(synchronize(&ctx), INVALID_STATE, &["destroy"]);
    drop(ctx);
    // The communicators it aborted were the healthy context's too, which now refuses to use
    // them (this also shows the faulty context made none of its own).
    std::env::remove_var("FAKE_NCCL_FAULT");
    expect_err(
        healthy.allreduce_grads(SUM),
        dpsync_status::DPSYNC_STATUS_BACKEND_ERROR,
        &["aborted"],
    );
    drop(healthy);
    // The aborted communicators are not reused: a new context builds its own (and the fake
    // aborts the process on any use of an aborted one).
    let again = cuda_context("after an NCCL fault", &[0, 1], |o| o.set_transport(T_NCCL)).unwrap();
    for (r, d) in keep.iter_mut().enumerate() {
        let stream = default_stream(r as i32);
        stream.memcpy_htod(&vec![1.0f32; n], d).unwrap();
        stream.synchronize().unwrap();
        register_device(&again, "g", GRAD, r, dptr(&stream, d), n, F32);
    }
    check(
        again.allreduce_grads(SUM),
        "allreduce_grads after the fault",
    );
    check(synchronize(&again), "synchronize");
    let got = default_stream(1).clone_dtoh(&keep[1]).unwrap();
    assert_eq!(got, vec![2.0f32; n], "the new communicators reduce");
}

/// Two NCCL ranks on the one GPU ([`rank_per_replica`]): a 2-rank communicator on one GPU.
#[test]
fn two_nccl_ranks_on_one_gpu_when_enabled() {
    if !rank_per_replica("two_nccl_ranks_on_one_gpu_when_enabled") {
        return;
    }
    let Some(ctx) = cuda_context("two NCCL ranks", &[0, 0], |o| o.set_transport(T_NCCL)) else {
        return;
    };
    let plan = ctx.describe_json();
    let ranks = plan["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["op"] == "nccl_allreduce")
        .count();
    assert_eq!(ranks, 2, "one NCCL rank per replica: {plan}");
    // Its contexts get the same two-rank plan (the variable is read per options): every dtype,
    // fused gradients, broadcast and average over real NCCL calls on one GPU.
    for n in [1usize, 12_345, 1 << 20] {
        assert!(allreduce_every_dtype(&[0, 0], T_NCCL, n));
    }
    fused_gradients_broadcast_and_average_on(&[0, 0], T_NCCL);
}
