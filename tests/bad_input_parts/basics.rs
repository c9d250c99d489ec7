//! Bad input to the entry points without a context: status names, the version, the per-thread last
//! error, options.

use super::*;

// ------------------------------------------------------------------ statuses, version, last error

#[test]
fn status_names_and_version() {
    let names = [
        "DPSYNC_STATUS_OK",
        "DPSYNC_STATUS_INVALID_ARGUMENT",
        "DPSYNC_STATUS_NOT_FOUND",
        "DPSYNC_STATUS_CONFLICT",
        "DPSYNC_STATUS_INCONSISTENT",
        "DPSYNC_STATUS_INVALID_STATE",
        "DPSYNC_STATUS_UNAVAILABLE",
        "DPSYNC_STATUS_BACKEND_ERROR",
        "DPSYNC_STATUS_TIMEOUT",
        "DPSYNC_STATUS_PANIC",
        "DPSYNC_STATUS_RANK_LOST",
    ];
    for (i, want) in names.iter().enumerate() {
        assert_eq!(status_name(i as u32), *want, "status {i}");
    }
    assert_eq!(
        status_name(dpsync_status::DPSYNC_STATUS_PANIC as u32),
        "DPSYNC_STATUS_PANIC"
    );
    assert_eq!(
        status_name(dpsync_status::DPSYNC_STATUS_OK as u32),
        "DPSYNC_STATUS_OK"
    );
    for unknown in [11u32, 12, 100, 0x8000_0000, 0xFFFF_FFFF] {
        assert_eq!(status_name(unknown), "UNKNOWN", "status {unknown}");
    }
    let v = unsafe { std::ffi::CStr::from_ptr(dpsync_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    // static strings: the same pointer every time
    let (a, b) = (dpsync_version(), dpsync_version());
    assert_eq!(a, b);
}

#[test]
fn last_error_is_per_thread_and_kept_across_successes() {
    std::thread::spawn(|| {
        assert_eq!(last_error(), "", "a fresh thread has no error");
    })
    .join()
    .unwrap();

    let o = Options::new();
    let st = unsafe { dpsync_options_set_host_replicas(o.0, 0) };
    let mine = expect_err(st, INVALID_ARGUMENT, &["count"]);

    let theirs = std::thread::spawn(|| {
        assert_eq!(
            last_error(),
            "",
            "another thread's failure is not visible here"
        );
        let st = unsafe { dpsync_options_set_transport(ptr::null_mut(), T_HOST) };
        let m = expect_err(st, INVALID_ARGUMENT, &["options"]);
        // and a success on this thread does not clear it
        let o = Options::host(2);
        drop(o);
        assert_eq!(last_error(), m);
        m
    })
    .join()
    .unwrap();
    assert_ne!(mine, theirs);
    assert_eq!(last_error(), mine, "this thread's message is unchanged");

    // Successful calls do not clear it either.
    let ctx = Context::host(2, None);
    assert_eq!(ctx.replica_count(), 2);
    assert_eq!(last_error(), mine);

    // Many threads failing at once each see their own message.
    let handles: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let o = Options::host(2);
                for _ in 0..200 {
                    let name = format!("thread_{t}_tensor");
                    let ctx = Context::new(&o);
                    let st = ctx.allreduce(&name, SUM);
                    let m = expect_err(st, NOT_FOUND, &[name.as_str()]);
                    assert!(!m.contains(&format!("thread_{}_", (t + 1) % 8)), "{m}");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(last_error(), mine);
}

// ------------------------------------------------------------------ options

/// plan_describe of the options, to see that a failed setter changed nothing.
fn plan_of(o: &Options) -> String {
    o.plan()
        .unwrap_or_else(|(s, m)| panic!("plan_describe: {s:?}: {m}"))
}

#[test]
fn options_new_and_setters_reject_null() {
    let st = unsafe { dpsync_options_new(ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["out"]);
    unsafe { dpsync_options_free(ptr::null_mut()) };

    let nul: *mut dpsync_options = ptr::null_mut();
    let ords = [0i32, 1];
    let m = [1u8; 4];
    let cases: Vec<(&str, dpsync_status)> = unsafe {
        vec![
            (
                "set_host_replicas",
                dpsync_options_set_host_replicas(nul, 2),
            ),
            (
                "set_cuda_replicas",
                dpsync_options_set_cuda_replicas(nul, ords.as_ptr(), 2),
            ),
            ("set_transport", dpsync_options_set_transport(nul, T_HOST)),
            ("set_fusion_bytes", dpsync_options_set_fusion_bytes(nul, 10)),
            ("set_timeout_ms", dpsync_options_set_timeout_ms(nul, 10)),
            (
                "set_peer_access",
                dpsync_options_set_peer_access(nul, m.as_ptr(), 2),
            ),
        ]
    };
    for (what, st) in cases {
        assert_eq!(st, INVALID_ARGUMENT, "{what}(NULL)");
    }
    // the message of the last one
    assert!(last_error().contains("options"), "{}", last_error());
    // and each individually names "options"
    let st = unsafe { dpsync_options_set_fusion_bytes(nul, 10) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
    let st = unsafe { dpsync_options_set_timeout_ms(nul, 10) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
    let st = unsafe { dpsync_options_set_host_replicas(nul, 2) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
    let st = unsafe { dpsync_options_set_cuda_replicas(nul, ords.as_ptr(), 2) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
    let st = unsafe { dpsync_options_set_peer_access(nul, m.as_ptr(), 2) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
}

#[test]
fn options_setters_reject_bad_values_and_change_nothing() {
    let o = Options::host(3);
    o.set_fusion_bytes(1000);
    let plan0 = plan_of(&o);
    let j0: serde_json::Value = serde_json::from_str(&plan0).unwrap();
    assert_eq!(j0["replicas"].as_array().map(|a| a.len()), Some(3));

    for count in [0usize, 4097, usize::MAX] {
        let st = unsafe { dpsync_options_set_host_replicas(o.0, count) };
        expect_err(st, INVALID_ARGUMENT, &["count"]);
        assert_eq!(
            plan_of(&o),
            plan0,
            "set_host_replicas({count}) changed the options"
        );
    }

    let ords = vec![0i32; 4097];
    let st = unsafe { dpsync_options_set_cuda_replicas(o.0, ptr::null(), 2) };
    expect_err(st, INVALID_ARGUMENT, &["ordinals"]);
    let st = unsafe { dpsync_options_set_cuda_replicas(o.0, ords.as_ptr(), 0) };
    expect_err(st, INVALID_ARGUMENT, &["count"]);
    let st = unsafe { dpsync_options_set_cuda_replicas(o.0, ords.as_ptr(), 4097) };
    expect_err(st, INVALID_ARGUMENT, &["count"]);
    let neg = [0i32, -1, 2];
    let st = unsafe { dpsync_options_set_cuda_replicas(o.0, neg.as_ptr(), 3) };
    expect_err(st, INVALID_ARGUMENT, &["ordinal"]);
    assert_eq!(
        plan_of(&o),
        plan0,
        "failed set_cuda_replicas changed the options"
    );

    for t in [4u32, 5, 0xFFFF_FFFF] {
        let st = unsafe { dpsync_options_set_transport(o.0, t) };
        expect_err(st, INVALID_ARGUMENT, &["transport"]);
    }
    assert_eq!(
        plan_of(&o),
        plan0,
        "failed set_transport changed the options"
    );

    let m3 = [1u8; 9];
    let m2 = [1u8; 4];
    let st = unsafe { dpsync_options_set_peer_access(o.0, ptr::null(), 3) };
    expect_err(st, INVALID_ARGUMENT, &["matrix"]);
    let st = unsafe { dpsync_options_set_peer_access(o.0, m2.as_ptr(), 2) };
    expect_err(st, INVALID_ARGUMENT, &["n", "3"]);
    let st = unsafe { dpsync_options_set_peer_access(o.0, m3.as_ptr(), 4) };
    expect_err(st, INVALID_ARGUMENT, &["n", "3"]);
    assert_eq!(
        plan_of(&o),
        plan0,
        "failed set_peer_access changed the options"
    );

    // Any fusion size and timeout is valid.
    for f in [0usize, 1, usize::MAX] {
        check(unsafe { dpsync_options_set_fusion_bytes(o.0, f) }, "fusion");
    }
    for t in [0u64, 1, u64::MAX] {
        check(unsafe { dpsync_options_set_timeout_ms(o.0, t) }, "timeout");
    }
    check(
        unsafe { dpsync_options_set_host_replicas(o.0, 4096) },
        "4096 replicas",
    );
    check(
        unsafe { dpsync_options_set_host_replicas(o.0, 1) },
        "1 replica",
    );
}

#[test]
fn peer_matrix_is_checked_again_when_the_replica_count_changed() {
    let o = Options::new();
    o.set_cuda_replicas(&[0, 1]);
    o.set_peer_access(&[1, 1, 1, 1], 2);
    assert!(o.plan().is_ok());
    o.set_cuda_replicas(&[0, 1, 2]);
    let (st, msg) = o.plan().expect_err("a 2x2 matrix for 3 replicas");
    assert_eq!(st, INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains('3'), "message names the replica count: {msg}");
}
