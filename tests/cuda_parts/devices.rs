//! GPUs and contexts: the caller's current context, describe and the peer matrix, a peer limit,
//! set_stream's handles, memory of another GPU.

use super::*;

/// dpsync leaves the calling thread's current CUDA context as it found it, also through NCCL,
/// whose group launches, aborts and destroys may switch it (the fake NCCL does what the CUDA
/// runtime would). On a thread with no context current, every call must leave none current.
#[test]
fn the_callers_current_context_is_left_as_it_was() {
    let test = "the_callers_current_context_is_left_as_it_was";
    if Place::gpu(test).is_none() {
        return;
    }
    let layout: Vec<i32> = if device_count() >= 2 {
        vec![0, 1]
    } else {
        vec![0, 0]
    };
    let n = 1000;
    let mems: Vec<_> = layout
        .iter()
        .map(|&ordinal| {
            let stream = default_stream(ordinal);
            let d = stream.clone_htod(&vec![1.0f32; n]).unwrap();
            stream.synchronize().unwrap();
            (dptr(&stream, &d), d)
        })
        .collect();
    let ptrs: Vec<usize> = mems.iter().map(|m| m.0).collect();
    std::thread::spawn(move || {
        let current = || {
            let mut c = std::ptr::null_mut();
            // SAFETY: plain query.
            unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
            c
        };
        assert!(current().is_null(), "a new thread has no current context");
        for_each_transport(&[&layout], |ordinals, transport| {
            let Some(ctx) = cuda_context(test, ordinals, |o| o.set_transport(transport)) else {
                return false;
            };
            let after = |what: &str| {
                assert!(
                    current().is_null(),
                    "transport {transport}: {what} left a context current"
                )
            };
            after("dpsync_context_create");
            for (r, &p) in ptrs.iter().enumerate() {
                register_device(&ctx, "g", GRAD, r, p, n, F32);
            }
            after("dpsync_register");
            check(ctx.allreduce_grads(SUM), "allreduce_grads");
            after("dpsync_allreduce_grads");
            check(ctx.broadcast(GRAD, 1), "broadcast");
            after("dpsync_broadcast");
            check(synchronize(&ctx), "synchronize");
            after("dpsync_synchronize");
            drop(ctx);
            after("dpsync_context_destroy");
            true
        });
    })
    .join()
    .expect("the checks on a thread without a current context pass");
    drop(mems);
}

#[test]
fn describe_of_a_live_context_matches_the_dry_run() {
    for transport in [T_NCCL, T_PEER_COPY] {
        let Some(ctx) = cuda_context("describe", &[0, 0, 0, 0], |o| o.set_transport(transport))
        else {
            continue;
        };
        let live = ctx.describe_json();
        let o = Options::new();
        o.set_cuda_replicas(&[0, 0, 0, 0]);
        o.set_transport(transport);
        let dry = o.plan_json();
        assert_eq!(live["steps"], dry["steps"], "live {live}\ndry {dry}");
        assert_eq!(live["peer_access"], dry["peer_access"]);
        assert_eq!(live["peer_access_source"], "detected");
        assert_eq!(live["backend"]["name"], "cuda");
    }
}

/// A device out of peer connections (CUDA_ERROR_TOO_MANY_PEERS when enabling one more) is not
/// a failure: those pairs count as without access and use staged copies. The fake driver's
/// FAKE_CUDA_PEER_LIMIT provokes it (scripts/fake-cuda.sh); elsewhere this prints that it was
/// skipped.
#[test]
fn a_peer_limit_falls_back_to_staged_copies() {
    let test = "a_peer_limit_falls_back_to_staged_copies";
    let Some(limit) = std::env::var("FAKE_CUDA_PEER_LIMIT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    else {
        skip(format_args!(
            "{test}: skipped: needs the fake driver's FAKE_CUDA_PEER_LIMIT (scripts/fake-cuda.sh)"
        ));
        return;
    };
    if Place::gpus(test, 4).is_none() {
        return;
    }
    let ordinals = [0, 1, 2, 3];
    let ctx = cuda_context(test, &ordinals, |o| o.set_transport(T_PEER_COPY)).unwrap();
    let live = ctx.describe_json();
    let rows = live["peer_access"].as_array().expect("peer_access");
    for (i, row) in rows.iter().enumerate() {
        let peers = (row.as_array().unwrap().iter().enumerate())
            .filter(|&(j, v)| j != i && v == 1)
            .count();
        assert!(
            peers <= limit,
            "replica {i} has {peers} peers over the limit {limit}: {live}"
        );
    }
    assert!(
        rows.iter()
            .flat_map(|r| r.as_array().unwrap())
            .any(|v| v == 0),
        "some pairs went without access: {live}"
    );
    drop(ctx);
    assert!(allreduce_every_dtype(&ordinals, T_PEER_COPY, 1000));
}

/// Several GPUs: the live context detects the peer matrix (under scripts/fake-cuda.sh, the one
/// FAKE_CUDA_PEER describes, so the other multi-GPU tests really ran on that pattern) and
/// executes the plan a dry run gives for that matrix. With an override, it shows the override and, beside it, what it detected.
#[test]
fn describe_across_gpus_shows_the_detected_peer_matrix_and_its_plan() {
    if Place::gpus("describe_across_gpus", 4).is_none() {
        return;
    }
    for ordinals in [&[0, 1, 2][..], &[0, 1, 2, 3], &[1, 1, 2]] {
        let Some(ctx) = cuda_context("describe", ordinals, |o| o.set_transport(T_PEER_COPY)) else {
            return;
        };
        let live = ctx.describe_json();
        // GPUs of one kind share one compiled kernel image (the fake's are all sm_90): NVRTC ran
        // once in this process (twice where the CUBIN fails and PTX follows), not once per GPU.
        let devices = live["backend"]["devices"].as_array().expect("devices");
        assert!(devices.len() > 1, "{live}");
        assert!(
            devices
                .iter()
                .all(|d| d["kernels"] == devices[0]["kernels"]),
            "{live}"
        );
        let compiles = live["backend"]["nvrtc_compiles"]
            .as_u64()
            .expect("nvrtc_compiles");
        assert!((1..=2).contains(&compiles), "{live}");
        let n = ordinals.len();
        let matrix: Vec<u8> = live["peer_access"]
            .as_array()
            .expect("peer_access")
            .iter()
            .flat_map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u8)
            })
            .collect();
        assert_eq!(matrix.len(), n * n, "{live}");
        if let Ok(pairs) = std::env::var("FAKE_CUDA_PEER") {
            let access = |a: i32, b: i32| match pairs.as_str() {
                "0" => false,
                "" => a != b,
                _ => pairs
                    .split(',')
                    .any(|p| p == format!("{a}-{b}") || p == format!("{b}-{a}")),
            };
            for i in 0..n {
                for j in 0..n {
                    let (a, b) = (ordinals[i], ordinals[j]);
                    // Replicas on one GPU always reach each other's memory.
                    let want = a == b || access(a, b);
                    assert_eq!(
                        matrix[i * n + j] == 1,
                        want,
                        "{ordinals:?} [{i}][{j}]: {live}"
                    );
                }
            }
        }
        let o = Options::new();
        o.set_cuda_replicas(ordinals);
        o.set_transport(T_PEER_COPY);
        o.set_peer_access(&matrix, n);
        let dry = o.plan_json();
        assert_eq!(live["steps"], dry["steps"], "live {live}\ndry {dry}");
        assert!(live["peer_access_detected"].is_null(), "{live}");
        // An override (no access between different GPUs, always allowed) replaces the matrix;
        // the detected one is still shown.
        let only_own: Vec<u8> = (0..n * n)
            .map(|k| u8::from(ordinals[k / n] == ordinals[k % n]))
            .collect();
        let Some(restricted) = cuda_context("describe override", ordinals, |o| {
            o.set_transport(T_PEER_COPY);
            o.set_peer_access(&only_own, n);
        }) else {
            return;
        };
        let json = restricted.describe_json();
        assert_eq!(json["peer_access_source"], "override", "{json}");
        assert_eq!(json["peer_access_detected"], live["peer_access"], "{json}");
        for step in json["steps"].as_array().expect("steps") {
            let (src, dst) = (step["src"].as_u64().unwrap(), step["dst"].as_u64().unwrap());
            if ordinals[src as usize] != ordinals[dst as usize] {
                assert_eq!(step["via"], "staged", "no access, staged copies: {json}");
            }
        }
    }
}

#[test]
fn set_stream_checks_its_arguments() {
    let Some(ctx) = cuda_context("set_stream", &[0], |_| {}) else {
        return;
    };
    // SAFETY: a live context; the stream values are never dereferenced on failure.
    unsafe {
        expect_err(
            dpsync_set_stream(ctx.0, 1, std::ptr::null_mut()),
            INVALID_ARGUMENT,
            &["replica"],
        );
        check(
            dpsync_set_stream(ctx.0, 0, std::ptr::null_mut()),
            "legacy stream",
        );
    }
}

/// The special stream handles: cudaStreamLegacy (0x1) is the replica's legacy default stream
/// whatever context the calling thread has current (none here, or GPU 0's for a replica on GPU
/// 1); cudaStreamPerThread (0x2) is refused, naming it, since it is another stream on every
/// thread.
#[test]
fn set_stream_takes_the_legacy_handle_and_refuses_the_per_thread_one() {
    let test = "set_stream_takes_the_legacy_handle_and_refuses_the_per_thread_one";
    if Place::gpu(test).is_none() {
        return;
    }
    let two = device_count() >= 2;
    std::thread::spawn(move || {
        let ordinals: &[i32] = if two { &[0, 1] } else { &[0] };
        let ctx = cuda_context(test, ordinals, |_| {}).unwrap();
        let last = ordinals.len() - 1;
        // No context current on this new thread; then, with two GPUs, GPU 0's.
        let mut bound_gpu0 = None;
        for round in 0..if two { 2 } else { 1 } {
            if round == 1 {
                let gpu0 = gpu();
                gpu0.bind_to_thread().unwrap();
                bound_gpu0 = Some(gpu0);
            }
            // SAFETY: a live context; the special handles are never dereferenced.
            unsafe {
                check(
                    dpsync_set_stream(ctx.0, last, std::ptr::without_provenance_mut(0x1)),
                    "cudaStreamLegacy",
                );
                expect_err(
                    dpsync_set_stream(ctx.0, 0, std::ptr::without_provenance_mut(0x2)),
                    INVALID_ARGUMENT,
                    &["cudaStreamPerThread", "replica 0"],
                );
            }
            let json = ctx.describe_json();
            assert!(
                json["backend"]["caller_streams"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|s| s == "legacy default"),
                "round {round}: {json}"
            );
        }
        drop(bound_gpu0);
    })
    .join()
    .expect("the special handles behave");
}

/// Memory of another GPU than the replica's is refused at once, naming the tensor, the
/// argument and both devices: a dense tensor's `data`, a sparse slice's `indices` or `values`.
#[test]
fn memory_of_another_gpu_is_refused_across_gpus() {
    let test = "memory_of_another_gpu_is_refused_across_gpus";
    let Some(place) = Place::gpus(test, 2) else {
        return;
    };
    let Some(ctx) = cuda_context(test, &[0, 1], |_| {}) else {
        return;
    };
    let on0 = place.mem_on(0, &[0u8; 64]);
    let on1 = place.mem_on(1, &[0u8; 64]);
    let st = register_raw(ctx.0, "w", GRAD, 0, on1.ptr() as _, 4, F32);
    expect_err(
        st,
        INVALID_ARGUMENT,
        &["'w'", "data", "cuda:1", "replica 0", "cuda:0"],
    );
    ctx.reg_sparse_all("e", 1, F32, I64, 0);
    let (good, bad) = (on0.ptr() as *const _, on1.ptr() as *const _);
    for (what, indices, values) in [("indices", bad, good), ("values", good, bad)] {
        let st = ctx.sparse_set_raw("e", 0, indices, values, 2);
        expect_err(st, INVALID_ARGUMENT, &["'e'", what, "cuda:1", "replica 0"]);
    }
}
