//! Bad input to context creation, queries, describe, registration and unregistration.

use super::*;

// ------------------------------------------------------------------ context

#[test]
fn context_create_bad_input_leaves_out_untouched() {
    let o = Options::host(2);
    let sentinel = 0x5a5a_usize as *mut dpsync_context;

    let mut out = sentinel;
    let st = unsafe { dpsync_context_create(ptr::null(), &mut out) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
    assert_eq!(out, sentinel);

    let st = unsafe { dpsync_context_create(o.0, ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["out"]);

    // Without a driver, CUDA replicas are UNAVAILABLE, naming what is missing (a GPU machine
    // has a driver: tests/cuda.rs covers it there).
    let cu = Options::new();
    cu.set_cuda_replicas(&[0, 1]);
    let st = unsafe { dpsync_context_create(cu.0, &mut out) };
    if st == UNAVAILABLE {
        let msg = last_error();
        assert!(msg.contains("libcuda"), "{msg}");
        assert_eq!(out, sentinel);
    } else {
        skip(format_args!(
            "cuda UNAVAILABLE path: skipped: a CUDA driver is present ({st:?})"
        ));
        if st == OK {
            unsafe { dpsync_context_destroy(out) };
            out = sentinel;
        }
    }
    // ... and they can always be planned.
    assert!(cu.plan().is_ok());

    // A transport that does not fit host replicas.
    for t in [T_PEER_COPY, T_NCCL] {
        let h = Options::host(2);
        h.set_transport(t);
        let st = unsafe { dpsync_context_create(h.0, &mut out) };
        expect_err(st, INVALID_ARGUMENT, &["transport"]);
        assert_eq!(out, sentinel);
        let (st, msg) = h.plan().expect_err("plan with a wrong transport");
        assert_eq!(st, INVALID_ARGUMENT);
        assert!(msg.contains("transport"), "{msg}");
    }
    // HOST does not fit CUDA replicas.
    cu.set_transport(T_HOST);
    let (st, msg) = cu.plan().expect_err("HOST transport with CUDA replicas");
    assert_eq!(st, INVALID_ARGUMENT);
    assert!(msg.contains("transport"), "{msg}");

    // HOST and AUTO fit host replicas.
    for t in [T_HOST, T_AUTO] {
        let h = Options::host(2);
        h.set_transport(t);
        let c = Context::new(&h);
        assert_eq!(c.describe_json()["transport"].as_str(), Some("host"));
    }

    // set_host_replicas replaces a CUDA replica list (and vice versa for planning).
    let swap = Options::new();
    swap.set_cuda_replicas(&[0, 1, 2]);
    swap.set_host_replicas(2);
    let c = Context::new(&swap);
    assert_eq!(c.replica_count(), 2);
    assert_eq!(
        c.describe_json()["replicas"][1]["device"].as_str(),
        Some("host")
    );
    drop(c);

    // The options are not consumed: a context can still be made from them.
    let c = Context::new(&o);
    assert_eq!(c.replica_count(), 2);
    check(
        unsafe { dpsync_context_destroy(ptr::null_mut()) },
        "destroy(NULL)",
    );
}

#[test]
fn context_queries_bad_input() {
    let ctx = Context::host(3, None);
    let nul: *mut dpsync_context = ptr::null_mut();

    let mut count = 12345usize;
    let st = unsafe { dpsync_replica_count(nul, &mut count) };
    expect_err(st, INVALID_ARGUMENT, &["context"]);
    assert_eq!(count, 12345);
    let st = unsafe { dpsync_replica_count(ctx.0, ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["out"]);

    let mut scale = -7.0f64;
    let st = unsafe { dpsync_loss_scale(nul, &mut scale) };
    expect_err(st, INVALID_ARGUMENT, &["context"]);
    assert_eq!(scale, -7.0);
    let st = unsafe { dpsync_loss_scale(ctx.0, ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["out"]);

    let st = unsafe { dpsync_synchronize(nul) };
    expect_err(st, INVALID_ARGUMENT, &["context"]);

    // set_stream: host replicas have no stream; out of range is an error too.
    let fake_stream = 0x1000usize as *mut c_void;
    let st = unsafe { dpsync_set_stream(nul, 0, ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["context"]);
    for r in 0..3 {
        for s in [ptr::null_mut(), fake_stream] {
            let st = unsafe { dpsync_set_stream(ctx.0, r, s) };
            expect_err(st, INVALID_ARGUMENT, &["replica"]);
        }
    }
    for r in [3usize, usize::MAX] {
        let st = unsafe { dpsync_set_stream(ctx.0, r, ptr::null_mut()) };
        expect_err(st, INVALID_ARGUMENT, &["replica"]);
    }

    assert_eq!(ctx.replica_count(), 3);
    assert_eq!(ctx.loss_scale(), 1.0 / 3.0);
    check(unsafe { dpsync_synchronize(ctx.0) }, "synchronize");
}

#[test]
fn describe_bad_input() {
    let fx = Fx::new();
    let desc = fx.ctx.describe();
    let mut buf = vec![0xAAu8; 64];
    let mut len = 777usize;
    let b = buf.as_mut_ptr() as *mut c_char;

    let st = unsafe { dpsync_describe(ptr::null(), b, 64, &mut len) };
    expect_err(st, INVALID_ARGUMENT, &["context"]);
    let st = unsafe { dpsync_describe(fx.ctx.0, b, 64, ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["length"]);
    let st = unsafe { dpsync_describe(fx.ctx.0, ptr::null_mut(), 10, &mut len) };
    expect_err(st, INVALID_ARGUMENT, &["buffer"]);
    assert_eq!(len, 777, "*length untouched on failure");
    assert!(
        buf.iter().all(|&x| x == 0xAA),
        "buffer untouched on failure"
    );

    let o = Options::host(2);
    let st = unsafe { dpsync_plan_describe(ptr::null(), b, 64, &mut len) };
    expect_err(st, INVALID_ARGUMENT, &["options"]);
    let st = unsafe { dpsync_plan_describe(o.0, b, 64, ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["length"]);
    let st = unsafe { dpsync_plan_describe(o.0, ptr::null_mut(), 10, &mut len) };
    expect_err(st, INVALID_ARGUMENT, &["buffer"]);
    assert_eq!(len, 777);
    assert!(buf.iter().all(|&x| x == 0xAA));

    // (NULL, 0) sizes
    check(
        unsafe { dpsync_describe(fx.ctx.0, ptr::null_mut(), 0, &mut len) },
        "size",
    );
    assert_eq!(len, desc.len());
    assert_eq!(fx.ctx.describe(), desc);
}

// ------------------------------------------------------------------ registration

#[test]
fn an_empty_name_is_invalid_argument_for_every_call_that_takes_one() {
    // A failing call with another message, so each check sees its own call's message.
    fn set_last_error_to_something_else() {
        // SAFETY: NULL options is refused with a message naming "options".
        let st = unsafe { dpsync_options_set_host_replicas(ptr::null_mut(), 2) };
        assert_eq!(st, INVALID_ARGUMENT);
        assert!(!last_error().contains("empty"));
    }
    // Nothing can be registered under "", so a lookup answering NOT_FOUND would be misleading:
    // every call says the name itself is bad (docs/API.md, "Names").
    let fx = Fx::new();
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    let ctx = fx.ctx.0;
    let empty = cstr("");
    let mut data = [1.0f32; 4];
    let (idx, vals) = ([0i64; 1], [0f32; 2]);
    let (mut pi, mut pv, mut rows) = (ptr::null(), ptr::null(), 0usize);
    let (mut offset, mut count) = (77usize, 88usize);
    let e = empty.as_ptr();
    // Each status and message checked right after its call (the message is per call).
    let check = |call: &str, st: dpsync_status| {
        let m = last_error();
        assert_eq!(st, INVALID_ARGUMENT, "{call}(\"\"): {st:?} ({m})");
        assert!(m.contains("name") && m.contains("empty"), "{call}: {m}");
        set_last_error_to_something_else();
    };
    // SAFETY: valid handle, strings and buffers.
    unsafe {
        let st = dpsync_register(ctx, e, GRAD, 0, data.as_mut_ptr().cast(), 4, F32);
        check("register", st);
        check("unregister", dpsync_unregister(ctx, e));
        check("allreduce", dpsync_allreduce(ctx, e, SUM));
        check("grad_ready", dpsync_grad_ready(ctx, e, 0));
        check(
            "register_sparse",
            dpsync_register_sparse(ctx, e, 0, 2, F32, I64, 0),
        );
        let (i, v) = (idx.as_ptr().cast(), vals.as_ptr().cast());
        check("sparse_set", dpsync_sparse_set(ctx, e, 0, i, v, 1));
        let st = dpsync_sparse_get(ctx, e, 0, &mut pi, &mut pv, &mut rows);
        check("sparse_get", st);
        check("shard", dpsync_shard(ctx, e, 0, &mut offset, &mut count));
    }
    assert_eq!((offset, count), (77, 88), "shard's outputs untouched");
    assert!(
        pi.is_null() && pv.is_null() && rows == 0,
        "outputs untouched"
    );
    fx.assert_unchanged(&before, "calls with an empty name");
    assert_eq!(fx.ctx.describe(), desc, "the context is unchanged");
}

#[test]
fn register_rejects_bad_arguments_and_changes_nothing() {
    let mut fx = Fx::new();
    let n = fx.n;
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    let mut data = vec![1.0f32; 4];
    let d = data.as_mut_ptr() as *mut c_void;
    let name = cstr("newt");
    let ctx = fx.ctx.0;

    // (case, status, message, argument the message must name)
    let mut results: Vec<(String, dpsync_status, String, &str)> = Vec::new();
    let mut run = |what: String, needle: &'static str, st: dpsync_status| {
        results.push((what, st, last_error(), needle));
    };
    let empty = cstr("");
    let bad_utf8 = [0x66u8, 0xff, 0xfe, 0x00];
    unsafe {
        let st = dpsync_register(ptr::null_mut(), name.as_ptr(), GRAD, 0, d, 4, F32);
        run("context NULL".into(), "context", st);
        let st = dpsync_register(ctx, ptr::null(), GRAD, 0, d, 4, F32);
        run("name NULL".into(), "name", st);
        let st = dpsync_register(ctx, empty.as_ptr(), GRAD, 0, d, 4, F32);
        run("name empty".into(), "name", st);
        let st = dpsync_register(ctx, bad_utf8.as_ptr().cast(), GRAD, 0, d, 4, F32);
        run("name not UTF-8".into(), "name", st);
        for role in [0u32, 3, 5, 6, 15, 16, 0xFFFF_FFFF] {
            let st = dpsync_register(ctx, name.as_ptr(), role, 0, d, 4, F32);
            run(format!("role {role}"), "role", st);
        }
        for replica in [n, n + 1, usize::MAX] {
            let st = dpsync_register(ctx, name.as_ptr(), GRAD, replica, d, 4, F32);
            run(format!("replica {replica}"), "replica", st);
        }
        let st = dpsync_register(ctx, name.as_ptr(), GRAD, 0, ptr::null_mut(), 4, F32);
        run("data NULL".into(), "data", st);
        let st = dpsync_register(ctx, name.as_ptr(), GRAD, 0, d, 0, F32);
        run("count 0".into(), "count", st);
        // Byte sizes that wrap (SIZE_MAX/4 + 2 floats are 4 bytes modulo 2^64), or that run past
        // the end of the address space: refused here, not left to crash a collective.
        for (count, dtype) in [
            (usize::MAX / 4 + 2, F32),
            (usize::MAX, I64),
            (1usize << 62, F32),
        ] {
            let st = dpsync_register(ctx, name.as_ptr(), GRAD, 0, d, count, dtype);
            run(format!("count {count} of dtype {dtype}"), "count", st);
        }
        let top = (usize::MAX - 8) as *mut c_void;
        let st = dpsync_register(ctx, name.as_ptr(), GRAD, 0, top, 4, F32);
        run("data near the top of the address space".into(), "count", st);
        for dtype in [6u32, 7, 0xFFFF_FFFF] {
            let st = dpsync_register(ctx, name.as_ptr(), GRAD, 0, d, 4, dtype);
            run(format!("dtype {dtype}"), "dtype", st);
        }
        // Elements are loaded through typed pointers (a misaligned one faults on a GPU).
        for (offset, dtype) in [(2usize, F32), (1, F16), (1, I32)] {
            let st = dpsync_register(ctx, name.as_ptr(), GRAD, 0, d.byte_add(offset), 2, dtype);
            run(
                format!("data misaligned by {offset} for dtype {dtype}"),
                "aligned",
                st,
            );
        }
    }
    for (what, st, msg, needle) in &results {
        assert_eq!(*st, INVALID_ARGUMENT, "register with {what} ({msg})");
        assert!(
            msg.contains(needle),
            "register with {what}: message {msg:?} should name {needle:?}"
        );
    }
    assert_eq!(
        fx.ctx.describe(),
        desc,
        "failed registrations changed the registry"
    );
    assert!(data.iter().all(|&x| x == 1.0));
    fx.assert_unchanged(&before, "failed registrations");
    // 'newt' is registered nowhere, so GRAD collectives are consistent; a real registration works.
    fx.assert_usable("after failed registrations");
    assert_eq!(fx.ctx.allreduce("newt", SUM), NOT_FOUND);
}

#[test]
fn conflicting_registration_keeps_the_original() {
    let mut fx = Fx::new();
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    // 'w' is PARAM f32 x5 on every replica; 'g' is GRAD f32 x4.
    let w1 = fx.tensors[0].2[1].clone();
    let mut other = vec![0f32; 5];
    let wp = match &mut fx.tensors[0].2[1] {
        Buf::F32(v) => v.as_mut_ptr() as *mut c_void,
        _ => unreachable!(),
    };
    let ctx = fx.ctx.0;
    let attempts: Vec<(&str, dpsync_status)> = vec![
        ("another role", register_raw(ctx, "w", GRAD, 1, wp, 5, F32)),
        ("another role", register_raw(ctx, "w", STATE, 1, wp, 5, F32)),
        (
            "another count",
            register_raw(ctx, "w", PARAM, 1, wp, 4, F32),
        ),
        (
            "another dtype",
            register_raw(ctx, "w", PARAM, 1, wp, 5, I32),
        ),
        (
            "another pointer",
            register_raw(ctx, "w", PARAM, 1, other.as_mut_ptr().cast(), 5, F32),
        ),
    ];
    for (what, st) in attempts {
        assert_eq!(st, CONFLICT, "'w' on replica 1 with {what}");
    }
    // each message names the tensor and the replica
    for (role, count, dtype) in [(GRAD, 5, F32), (PARAM, 4, F32), (PARAM, 5, I32)] {
        let st = register_raw(ctx, "w", role, 1, wp, count, dtype);
        expect_err(st, CONFLICT, &["'w'", "replica 1"]);
    }
    let st = register_raw(ctx, "w", PARAM, 1, other.as_mut_ptr().cast(), 5, F32);
    expect_err(st, CONFLICT, &["'w'", "replica 1"]);

    // A GRAD re-registered with fewer elements on replica 0.
    let gp = fx.tensors[1].2[0].ptr();
    let st = register_raw(ctx, "g", GRAD, 0, gp, 3, F32);
    expect_err(st, CONFLICT, &["'g'", "replica 0"]);

    assert_eq!(
        fx.ctx.describe(),
        desc,
        "a conflicting registration changed the registry"
    );
    fx.assert_unchanged(&before, "conflicting registrations");
    assert!(other.iter().all(|&x| x == 0.0));

    // The original registrations are in force: 'w' broadcasts from replica 1's own buffer and
    // 'g' is reduced over all 4 elements (assert_usable checks both exactly).
    fx.assert_usable("after conflicts");
    for r in 0..fx.n {
        assert_same_bytes(
            &fx.tensors[0].2[r],
            &w1,
            "'w' from replica 1's original buffer",
        );
    }
    assert!(
        other.iter().all(|&x| x == 0.0),
        "the rejected buffer was never written"
    );
    // and the identical registration is still fine
    check(
        register_raw(ctx, "w", PARAM, 1, wp, 5, F32),
        "identical re-registration",
    );
}

#[test]
fn unregister_bad_input() {
    let mut fx = Fx::new();
    let desc = fx.ctx.describe();
    let name = cstr("g");
    let st = unsafe { dpsync_unregister(ptr::null_mut(), name.as_ptr()) };
    expect_err(st, INVALID_ARGUMENT, &["context"]);
    let st = unsafe { dpsync_unregister(fx.ctx.0, ptr::null()) };
    expect_err(st, INVALID_ARGUMENT, &["name"]);
    let st = fx.ctx.unregister("nope");
    expect_err(st, NOT_FOUND, &["nope"]);
    let st = fx.ctx.unregister("G");
    expect_err(st, NOT_FOUND, &["G"]);
    assert_eq!(fx.ctx.describe(), desc);
    fx.assert_usable("after failed unregisters");
}
