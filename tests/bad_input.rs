//! Every bad input of every exported entry point: the exact status, a last-error message that
//! names the culprit (argument name, or the tensor name and "replica N"), and nothing changed:
//! tensor bytes of every replica as before, the registry as before (describe), and a valid
//! collective afterwards still works. Also dpsync_status_name, dpsync_version and the per-thread
//! last error.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
    pub mod skip;
}

use common::{abi::*, buf::*, context::*, errors::*, reference::*, skip::*};
use dpsync::*;
use std::ffi::{c_char, c_void};
use std::ptr;

// ------------------------------------------------------------------ fixture

/// A 3-replica context with one tensor of every role (and three GRAD dtypes).
struct Fx {
    ctx: Context,
    n: usize,
    /// (name, role, per-replica buffers)
    tensors: Vec<(String, u32, Vec<Buf>)>,
}

impl Fx {
    fn new() -> Fx {
        let n = 3;
        let ctx = Context::host(n, Some(64));
        let mut fx = Fx {
            ctx,
            n,
            tensors: Vec::new(),
        };
        fx.add("w", PARAM, DType::F32, 5);
        fx.add("g", GRAD, DType::F32, 4);
        fx.add("gi", GRAD, DType::I32, 3);
        fx.add("gh", GRAD, DType::F16, 6);
        fx.add("bn", COMPUTED, DType::F64, 2);
        fx.add("it", STATE, DType::I64, 1);
        fx
    }

    fn add(&mut self, name: &str, role: u32, d: DType, count: usize) {
        let mut bufs: Vec<Buf> = (0..self.n)
            .map(|r| Buf::random(d, count, (self.tensors.len() * 10 + r) as u64))
            .collect();
        for (r, b) in bufs.iter_mut().enumerate() {
            self.ctx.reg_buf(name, role, r, b);
        }
        self.tensors.push((name.to_owned(), role, bufs));
    }

    fn snapshot(&self) -> Vec<Vec<Buf>> {
        self.tensors.iter().map(|t| t.2.clone()).collect()
    }

    #[track_caller]
    fn assert_unchanged(&self, before: &[Vec<Buf>], what: &str) {
        for ((name, _, bufs), pre) in self.tensors.iter().zip(before) {
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                assert_same_bytes(b, p, &format!("{what}: '{name}' on replica {r} changed"));
            }
        }
    }

    /// Valid collectives still work on the fixture, with exact results.
    #[track_caller]
    fn assert_usable(&mut self, what: &str) {
        let before = self.snapshot();
        check(
            self.ctx.allreduce_grads(SUM),
            &format!("{what}: allreduce_grads afterwards"),
        );
        check(
            self.ctx.broadcast(PARAM | STATE, 1),
            &format!("{what}: broadcast afterwards"),
        );
        check(
            self.ctx.average(COMPUTED),
            &format!("{what}: average afterwards"),
        );
        for ((name, role, bufs), pre) in self.tensors.iter().zip(&before) {
            let want: Vec<Buf> = match *role {
                GRAD => vec![reference_allreduce(&pre.iter().collect::<Vec<_>>(), SUM); self.n],
                COMPUTED => vec![reference_allreduce(&pre.iter().collect::<Vec<_>>(), AVG); self.n],
                _ => vec![pre[1].clone(); self.n],
            };
            for (r, (b, w)) in bufs.iter().zip(&want).enumerate() {
                assert_same_bytes(b, w, &format!("{what}: '{name}' on replica {r} afterwards"));
            }
        }
        check(
            unsafe { dpsync_synchronize(self.ctx.0) },
            &format!("{what}: synchronize"),
        );
    }
}

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

// ------------------------------------------------------------------ collectives

#[test]
fn collectives_reject_bad_arguments_and_change_nothing() {
    let mut fx = Fx::new();
    let n = fx.n;
    let before = fx.snapshot();
    let nul: *mut dpsync_context = ptr::null_mut();
    let g = cstr("g");
    unsafe {
        expect_err(
            dpsync_allreduce_grads(nul, SUM),
            INVALID_ARGUMENT,
            &["context"],
        );
        for op in [2u32, 3, 0xFFFF_FFFF] {
            expect_err(
                dpsync_allreduce_grads(fx.ctx.0, op),
                INVALID_ARGUMENT,
                &["op"],
            );
            expect_err(
                dpsync_allreduce(fx.ctx.0, g.as_ptr(), op),
                INVALID_ARGUMENT,
                &["op"],
            );
        }
        expect_err(
            dpsync_allreduce(nul, g.as_ptr(), SUM),
            INVALID_ARGUMENT,
            &["context"],
        );
        expect_err(
            dpsync_allreduce(fx.ctx.0, ptr::null(), SUM),
            INVALID_ARGUMENT,
            &["name"],
        );
        expect_err(
            dpsync_broadcast(nul, PARAM, 0),
            INVALID_ARGUMENT,
            &["context"],
        );
        expect_err(
            dpsync_average(nul, COMPUTED),
            INVALID_ARGUMENT,
            &["context"],
        );
    }
    for roles in [0u32, 0x10, 0x1F, 0x20, 0xFFFF_FFFF] {
        expect_err(fx.ctx.broadcast(roles, 0), INVALID_ARGUMENT, &["roles"]);
        expect_err(fx.ctx.average(roles), INVALID_ARGUMENT, &["roles"]);
    }
    for root in [n, n + 5, usize::MAX] {
        expect_err(
            fx.ctx.broadcast(PARAM, root),
            INVALID_ARGUMENT,
            &["root_replica"],
        );
    }
    expect_err(fx.ctx.allreduce("nope", SUM), NOT_FOUND, &["nope"]);
    expect_err(fx.ctx.allreduce("g ", SUM), NOT_FOUND, &[]);
    fx.assert_unchanged(&before, "failed collectives");
    fx.assert_usable("after failed collectives");
}

/// One way of registering a tensor 'bad' so that the replicas disagree.
#[derive(Clone, Copy, Debug)]
enum Bad {
    /// f32 x4 on replicas 0 and 1, f32 x5 on replica 2
    Count,
    /// f32 x4 on replicas 0 and 1, i32 x4 on replica 2
    Dtype,
    /// GRAD on replicas 0 and 1, COMPUTED on replica 2
    Role,
    /// on replicas 0 and 1 only
    MissingOnLast,
    /// on replicas 1 and 2 only
    MissingOnFirst,
    /// replica 1's memory overlaps replica 0's
    Overlap,
}

impl Bad {
    const ALL: [Bad; 6] = [
        Bad::Count,
        Bad::Dtype,
        Bad::Role,
        Bad::MissingOnLast,
        Bad::MissingOnFirst,
        Bad::Overlap,
    ];

    /// Registers 'bad' this way on a 3-replica context from `ptrs` (three buffers of 6 f32):
    /// the replica the collectives' messages name.
    fn register(self, ctx: *mut dpsync_context, ptrs: &[*mut c_void], what: &str) -> &'static str {
        let reg = |r: usize, p: *mut c_void, role: u32, count: usize, dtype: u32| {
            check(register_raw(ctx, "bad", role, r, p, count, dtype), what);
        };
        match self {
            Bad::Count => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 5, F32);
                "replica 2"
            }
            Bad::Dtype => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 4, I32);
                "replica 2"
            }
            Bad::Role => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], COMPUTED, 4, F32);
                "replica 2"
            }
            Bad::MissingOnLast => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                "replica 2"
            }
            Bad::MissingOnFirst => {
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 4, F32);
                "replica 0"
            }
            Bad::Overlap => {
                reg(0, ptrs[0], GRAD, 4, F32);
                // replica 1 registers elements 2..6 of replica 0's buffer
                let p = unsafe { (ptrs[0] as *mut f32).add(2) } as *mut c_void;
                reg(1, p, GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 4, F32);
                "replica"
            }
        }
    }
}

#[test]
fn inconsistent_registrations_fail_the_collective_that_touches_them() {
    for bad in Bad::ALL {
        let what = format!("{bad:?}");
        let mut fx = Fx::new();
        let mut bufs: Vec<Vec<f32>> = vec![
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
            vec![100.0, 200.0, 300.0, 400.0, 500.0, 600.0],
        ];
        let copies = bufs.clone();
        let ptrs: Vec<*mut c_void> = bufs.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let culprit = bad.register(fx.ctx.0, &ptrs, &what);
        let before = fx.snapshot();
        let desc = fx.ctx.describe();

        let st = fx.ctx.allreduce_grads(SUM);
        expect_err(st, INCONSISTENT, &["'bad'", culprit]);
        let st = fx.ctx.allreduce("bad", AVG);
        expect_err(st, INCONSISTENT, &["'bad'", culprit]);
        let st = fx.ctx.broadcast(GRAD, 0);
        expect_err(st, INCONSISTENT, &["'bad'"]);
        assert_eq!(
            bufs, copies,
            "{what}: 'bad' buffers changed by a failed collective"
        );
        fx.assert_unchanged(&before, &what);

        // describe reports it
        let j: serde_json::Value = serde_json::from_str(&desc).unwrap();
        let problems = j["problems"].as_array().expect("problems");
        assert!(
            problems
                .iter()
                .any(|p| p.as_str().unwrap_or("").contains("'bad'")),
            "{what}: describe problems {problems:?}"
        );

        // Collectives that do not touch 'bad' still work.
        check(
            fx.ctx.broadcast(PARAM, 2),
            &format!("{what}: broadcast(PARAM)"),
        );
        check(
            fx.ctx.allreduce("g", SUM),
            &format!("{what}: allreduce('g')"),
        );
        // Unregistering it makes the context fully usable again.
        check(fx.ctx.unregister("bad"), &what);
        fx.assert_usable(&what);
        assert_eq!(
            bufs, copies,
            "{what}: 'bad' buffers changed after unregister"
        );
    }
}

#[test]
fn only_touched_tensors_are_checked() {
    let fx = Fx::new();
    // an inconsistent PARAM (missing on replica 2) does not fail allreduce_grads or average
    let mut p0 = vec![1.0f32; 3];
    let mut p1 = vec![2.0f32; 3];
    fx.ctx.reg("badp", PARAM, 0, &mut p0, F32);
    fx.ctx.reg("badp", PARAM, 1, &mut p1, F32);
    let before = fx.snapshot();
    let st = fx.ctx.broadcast(PARAM, 0);
    expect_err(st, INCONSISTENT, &["'badp'", "replica 2"]);
    let st = fx.ctx.broadcast(PARAM | COMPUTED, 1);
    expect_err(st, INCONSISTENT, &["'badp'", "replica 2"]);
    fx.assert_unchanged(&before, "failed broadcast");
    assert_eq!((p0.clone(), p1.clone()), (vec![1.0; 3], vec![2.0; 3]));

    let gbefore: Vec<Buf> = fx.tensors[1].2.clone();
    check(
        fx.ctx.allreduce_grads(SUM),
        "allreduce_grads ignores PARAMs",
    );
    let want = reference_allreduce(&gbefore.iter().collect::<Vec<_>>(), SUM);
    for r in 0..fx.n {
        assert_same_bytes(&fx.tensors[1].2[r], &want, "'g'");
    }
    check(fx.ctx.average(COMPUTED), "average(COMPUTED) ignores PARAMs");
    check(
        fx.ctx.broadcast(STATE, 2),
        "broadcast(STATE) ignores PARAMs",
    );
    assert_eq!((p0.clone(), p1.clone()), (vec![1.0; 3], vec![2.0; 3]));

    // completing the registration makes broadcast(PARAM) work
    let mut p2 = vec![3.0f32; 3];
    fx.ctx.reg("badp", PARAM, 2, &mut p2, F32);
    check(
        fx.ctx.broadcast(PARAM, 1),
        "broadcast after completing 'badp'",
    );
    assert_eq!((p0, p1, p2), (vec![2.0; 3], vec![2.0; 3], vec![2.0; 3]));
}

/// Two GRAD tensors sharing memory on a replica would be reduced twice by allreduce_grads: it
/// (and dpsync_grad_ready) refuse with INCONSISTENT naming both, changing nothing. A single
/// tensor's allreduce, and aliasing among other roles, stay allowed.
#[test]
fn grads_sharing_memory_are_refused_by_allreduce_grads() {
    let ctx = Context::host(2, None);
    let mut r0 = [1f32; 8];
    let mut r1 = [2f32; 8];
    ctx.reg("flat", GRAD, 0, &mut r0[..], F32);
    ctx.reg("flat", GRAD, 1, &mut r1[..], F32);
    // A view into the flat buffer, also as a GRAD.
    ctx.reg("view", GRAD, 0, &mut r0[2..4], F32);
    ctx.reg("view", GRAD, 1, &mut r1[2..4], F32);
    expect_err(
        ctx.allreduce_grads(SUM),
        INCONSISTENT,
        &["'flat'", "'view'", "share memory", "twice"],
    );
    assert!(r0.iter().all(|&x| x == 1.0) && r1.iter().all(|&x| x == 2.0));
    // dpsync_reduce_scatter_grads validates as dpsync_allreduce_grads does (docs/API.md).
    expect_err(
        reduce_scatter(ctx.0, SUM),
        INCONSISTENT,
        &["'flat'", "'view'", "share memory"],
    );
    assert!(r0.iter().all(|&x| x == 1.0) && r1.iter().all(|&x| x == 2.0));
    expect_err(
        ctx.grad_ready("view", 0),
        INCONSISTENT,
        &["'flat'", "'view'"],
    );
    check(ctx.allreduce("view", SUM), "one tensor's allreduce");
    assert_eq!((r0[2], r1[3], r0[0]), (3.0, 3.0, 1.0));
    check(ctx.unregister("view"), "unregister");
    check(
        ctx.allreduce_grads(SUM),
        "allreduce_grads without the alias",
    );
    assert_eq!((r0[0], r1[2]), (3.0, 6.0));
    // PARAMs may alias: broadcasting twice gives the same bytes.
    let mut p0 = [5f32; 4];
    let mut p1 = vec![0f32; 4];
    ctx.reg("p", PARAM, 0, &mut p0[..], F32);
    ctx.reg("p", PARAM, 1, &mut p1[..], F32);
    ctx.reg("p_view", PARAM, 0, &mut p0[1..3], F32);
    ctx.reg("p_view", PARAM, 1, &mut p1[1..3], F32);
    check(ctx.broadcast(PARAM, 0), "broadcast of aliased PARAMs");
    assert_eq!(p1, vec![5f32; 4]);
}

/// Replicas are separate copies: two tensors whose memory is shared between different replicas
/// make every collective over both their roles (broadcast, average, BMUF) INCONSISTENT naming
/// both, changing nothing; before, broadcast returned OK and left the replicas different.
#[test]
fn tensors_sharing_memory_across_replicas_are_refused() {
    let ctx = Context::host(2, None);
    let mut a = [1f32; 4];
    let mut b = [2f32; 4];
    let mut c = [3f32; 4];
    // p: a on replica 0, b on replica 1; q: c on replica 0, a on replica 1.
    ctx.reg("p", PARAM, 0, &mut a[..], F32);
    ctx.reg("p", PARAM, 1, &mut b[..], F32);
    ctx.reg("q", STATE, 0, &mut c[..], F32);
    ctx.reg("q", STATE, 1, &mut a[..], F32);
    let needles = [
        "'p' (replica 0)",
        "'q' (replica 1)",
        "share memory",
        "separate copies",
    ];
    expect_err(ctx.broadcast(PARAM | STATE, 0), INCONSISTENT, &needles);
    expect_err(ctx.average(PARAM | STATE), INCONSISTENT, &needles);
    expect_err(allgather(ctx.0, PARAM | STATE), INCONSISTENT, &needles);
    assert_eq!(
        (a, b, c),
        ([1f32; 4], [2f32; 4], [3f32; 4]),
        "nothing changed"
    );
    // Over one of the two roles, each tensor's own bytes come out right.
    check(ctx.broadcast(PARAM, 0), "broadcast of PARAM only");
    assert_eq!(b, [1f32; 4]);
    // Two PARAMs so placed refuse BMUF too.
    check(ctx.unregister("q"), "unregister q");
    ctx.reg("q", PARAM, 0, &mut c[..], F32);
    ctx.reg("q", PARAM, 1, &mut a[..], F32);
    expect_err(ctx.bmuf_init(1.0, -1.0, false), INCONSISTENT, &needles[..3]);
    expect_err(ctx.broadcast(PARAM, 0), INCONSISTENT, &needles[..3]);
    assert_eq!(
        (a, b, c),
        ([1f32; 4], [1f32; 4], [3f32; 4]),
        "nothing changed"
    );
}

// --------------------------------------------- sparse slices whose byte size overflows

/// `dpsync_sparse_set` checks the byte size of both halves of a slice, `rows × index size` and
/// `rows × row_len × value size`: either one overflowing or above `isize::MAX` is refused at
/// once with INVALID_ARGUMENT naming `rows`, the gradient and the replica, and nothing is
/// recorded (before, a slice whose index bytes alone overflowed was accepted and only
/// dpsync_allreduce_grads refused it). Self-contained: only the C ABI and std.
#[test]
fn sparse_set_refuses_a_slice_whose_index_or_value_bytes_overflow() {
    use dpsync_dtype::*;
    use dpsync_status::*;

    /// (status, last error) of one call.
    fn call(status: dpsync_status) -> (dpsync_status, String) {
        // SAFETY: dpsync_last_error returns a NUL-terminated string valid until the next call.
        let message = unsafe { std::ffi::CStr::from_ptr(dpsync_last_error()) };
        (status, message.to_string_lossy().into_owned())
    }

    #[track_caller]
    fn ok(status: dpsync_status, what: &str) {
        let (status, message) = call(status);
        assert_eq!(status, DPSYNC_STATUS_OK, "{what}: {message}");
    }

    // (row_len, value dtype, index dtype, rows): what overflows or exceeds isize::MAX.
    let half = 1usize << (usize::BITS - 1); // isize::MAX + 1
    let cases = [
        // The fuzzer's case: 2^61 i64 indices are 2^64 bytes; the f16 values only 2^62.
        (1, DPSYNC_DTYPE_F16, DPSYNC_DTYPE_I64, 1usize << 61),
        // Values overflow (8 f64 per row), indices (i64) are 2^62 bytes.
        (8, DPSYNC_DTYPE_F64, DPSYNC_DTYPE_I64, 1usize << 59),
        // Index bytes exactly isize::MAX + 1, values 2^61 bytes.
        (1, DPSYNC_DTYPE_F16, DPSYNC_DTYPE_I64, half / 8),
        // Value bytes exactly isize::MAX + 1, indices (i32) half of that.
        (1, DPSYNC_DTYPE_F64, DPSYNC_DTYPE_I32, half / 8),
    ];
    for (row_len, value_dtype, index_dtype, rows) in cases {
        let case = format!("row_len {row_len}, {value_dtype:?}, {index_dtype:?}, rows {rows}");
        unsafe {
            let mut options = ptr::null_mut();
            ok(dpsync_options_new(&mut options), "options_new");
            ok(
                dpsync_options_set_host_replicas(options, 1),
                "host_replicas",
            );
            let mut ctx = ptr::null_mut();
            ok(dpsync_context_create(options, &mut ctx), "context_create");
            dpsync_options_free(options);
            let name = c"emb".as_ptr();
            ok(
                dpsync_register_sparse(
                    ctx,
                    name,
                    0,
                    row_len,
                    value_dtype as u32,
                    index_dtype as u32,
                    22,
                ),
                "register_sparse",
            );
            // Aligned for every dtype; never read by dpsync_sparse_set.
            let idx = [0u64; 2];
            let val = [0f64; 8];
            let (i, v) = (idx.as_ptr().cast::<c_void>(), val.as_ptr().cast::<c_void>());

            let (status, message) = call(dpsync_sparse_set(ctx, name, 0, i, v, rows));
            assert_eq!(status, DPSYNC_STATUS_INVALID_ARGUMENT, "{case}: {message}");
            for needle in ["rows", "'emb'", "replica 0"] {
                assert!(
                    message.contains(needle),
                    "{case}: {needle:?} not in {message:?}"
                );
            }
            // Nothing was recorded: the step still lacks a slice.
            let (status, message) = call(dpsync_allreduce_grads(ctx, 0));
            assert_eq!(status, DPSYNC_STATUS_INCONSISTENT, "{case}: {message}");
            assert!(message.contains("no slice set"), "{case}: {message}");

            // A valid slice (one row of index 3) still works.
            let idx = [3u64; 2];
            ok(
                dpsync_sparse_set(ctx, name, 0, idx.as_ptr().cast(), v, 1),
                "sparse_set",
            );
            ok(dpsync_allreduce_grads(ctx, 0), "allreduce_grads");
            let (mut gi, mut gv, mut n) = (ptr::null(), ptr::null(), usize::MAX);
            ok(
                dpsync_sparse_get(ctx, name, 0, &mut gi, &mut gv, &mut n),
                "sparse_get",
            );
            assert_eq!(n, 1, "{case}: gathered rows");
            let index = match index_dtype {
                DPSYNC_DTYPE_I32 => *gi.cast::<i32>() as i64,
                _ => *gi.cast::<i64>(),
            };
            assert_eq!(index, 3, "{case}: gathered index");
            ok(dpsync_context_destroy(ctx), "context_destroy");
        }
    }
}

// ------------------------------------------------------------------ shards (ZeRO stage 1)

/// dpsync_reduce_scatter_grads(ctx, op).
fn reduce_scatter(ctx: *mut dpsync_context, op: u32) -> dpsync_status {
    // SAFETY: the handle is valid or NULL (refused).
    unsafe { dpsync_reduce_scatter_grads(ctx, op) }
}

/// dpsync_allgather(ctx, roles).
fn allgather(ctx: *mut dpsync_context, roles: u32) -> dpsync_status {
    // SAFETY: the handle is valid or NULL (refused).
    unsafe { dpsync_allgather(ctx, roles) }
}

/// dpsync_shard of `name` on `replica`: the status and the outputs (sentinels where unwritten).
fn shard(ctx: *const dpsync_context, name: &str, replica: usize) -> (dpsync_status, usize, usize) {
    let c = cstr(name);
    let (mut offset, mut count) = (0xDEAD_usize, 0xBEEF_usize);
    // SAFETY: valid handle, name and out pointers.
    let st = unsafe { dpsync_shard(ctx, c.as_ptr(), replica, &mut offset, &mut count) };
    (st, offset, count)
}

/// The contract's rule: world replica `w` of `total` owns `[count * w / total, count * (w + 1)
/// / total)`, as (first element, elements).
fn owned(count: usize, w: usize, total: usize) -> (usize, usize) {
    let at = |w: usize| count * w / total;
    (at(w), at(w + 1) - at(w))
}

/// `b` with elements `[at, at + k)` taken from `src`.
fn spliced(b: &Buf, src: &Buf, at: usize, k: usize) -> Buf {
    let size = b.dtype().size();
    let mut bytes = b.bytes();
    bytes[at * size..(at + k) * size].copy_from_slice(&src.bytes()[at * size..(at + k) * size]);
    let mut out = Buf::zeros(b.dtype(), b.len());
    // SAFETY: `out` holds exactly `bytes.len()` bytes.
    unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), out.ptr().cast::<u8>(), bytes.len()) };
    out
}

impl Fx {
    /// A reduce-scatter (SUM) and an allgather of the GRADs work on the fixture, with exact
    /// results: the owned pieces get the reduction and nothing else changes, then every replica
    /// holds the whole reduction; other roles untouched throughout.
    #[track_caller]
    fn assert_shards_usable(&mut self, what: &str) {
        let n = self.n;
        let before = self.snapshot();
        check(
            reduce_scatter(self.ctx.0, SUM),
            &format!("{what}: reduce_scatter_grads afterwards"),
        );
        for ((name, role, bufs), pre) in self.tensors.iter().zip(&before) {
            let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), SUM);
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                let expect = match *role {
                    GRAD => {
                        let (at, k) = owned(p.len(), r, n);
                        spliced(p, &want, at, k)
                    }
                    _ => p.clone(),
                };
                let tag = format!("{what}: '{name}' on replica {r} after reduce_scatter_grads");
                assert_same_bytes(b, &expect, &tag);
            }
        }
        check(
            allgather(self.ctx.0, GRAD),
            &format!("{what}: allgather(GRAD) afterwards"),
        );
        for ((name, role, bufs), pre) in self.tensors.iter().zip(&before) {
            let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), SUM);
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                let expect = if *role == GRAD { &want } else { p };
                let tag = format!("{what}: '{name}' on replica {r} after allgather(GRAD)");
                assert_same_bytes(b, expect, &tag);
            }
        }
    }
}

/// dpsync_shard: NOT_FOUND for an unknown name (and for a sparse gradient, which is gathered
/// whole), INVALID_ARGUMENT naming the argument for a replica out of range, a NULL out pointer,
/// a NULL name and a NULL context; the outputs are untouched on failure and nothing else
/// changes. Valid calls follow the contract's rule for every tensor of every role.
#[test]
fn shard_rejects_bad_arguments_and_changes_nothing() {
    let mut fx = Fx::new();
    let n = fx.n;
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    let ctx = fx.ctx.0;
    let w = cstr("w");
    let (mut offset, mut count) = (0xDEAD_usize, 0xBEEF_usize);
    let untouched = |offset: usize, count: usize, what: &str| {
        assert_eq!(
            (offset, count),
            (0xDEAD, 0xBEEF),
            "{what}: outputs written by a failed dpsync_shard"
        );
    };

    for name in ["nope", "W", "w ", "g\u{e9}"] {
        let (st, o, c) = shard(ctx, name, 0);
        expect_err(st, NOT_FOUND, &[name]);
        untouched(o, c, name);
    }
    for replica in [n, n + 5, usize::MAX] {
        let (st, o, c) = shard(ctx, "w", replica);
        let m = expect_err(st, INVALID_ARGUMENT, &["replica", "'w'"]);
        untouched(o, c, &m);
    }
    // The replica out of range is named by its number.
    let (st, _, _) = shard(ctx, "g", n);
    expect_err(st, INVALID_ARGUMENT, &[&format!("replica {n}"), "'g'"]);
    // SAFETY: valid handle and name; the NULL pointers are what is tested.
    unsafe {
        let st = dpsync_shard(ctx, w.as_ptr(), 0, ptr::null_mut(), &mut count);
        expect_err(st, INVALID_ARGUMENT, &["offset"]);
        untouched(offset, count, "NULL offset");
        let st = dpsync_shard(ctx, w.as_ptr(), 0, &mut offset, ptr::null_mut());
        expect_err(st, INVALID_ARGUMENT, &["count"]);
        untouched(offset, count, "NULL count");
        let st = dpsync_shard(ctx, w.as_ptr(), 0, ptr::null_mut(), ptr::null_mut());
        assert_eq!(st, INVALID_ARGUMENT, "both out pointers NULL");
        let st = dpsync_shard(ctx, ptr::null(), 0, &mut offset, &mut count);
        expect_err(st, INVALID_ARGUMENT, &["name"]);
        untouched(offset, count, "NULL name");
        let st = dpsync_shard(ptr::null(), w.as_ptr(), 0, &mut offset, &mut count);
        expect_err(st, INVALID_ARGUMENT, &["context"]);
        untouched(offset, count, "NULL context");
        let bad_utf8 = [0x66u8, 0xff, 0xfe, 0x00];
        let st = dpsync_shard(ctx, bad_utf8.as_ptr().cast(), 0, &mut offset, &mut count);
        expect_err(st, INVALID_ARGUMENT, &["name"]);
        untouched(offset, count, "name not UTF-8");
        // A sparse gradient is gathered whole, not sharded.
        let emb = cstr("emb");
        let st = dpsync_register_sparse(ctx, emb.as_ptr(), 0, 2, F32, I64, 0);
        check(st, "register_sparse");
        let st = dpsync_shard(ctx, emb.as_ptr(), 0, &mut offset, &mut count);
        expect_err(st, NOT_FOUND, &["'emb'", "sparse"]);
        untouched(offset, count, "sparse gradient");
        check(fx.ctx.unregister("emb"), "unregister 'emb'");
    }
    assert_eq!(
        fx.ctx.describe(),
        desc,
        "failed shard calls changed the registry"
    );
    fx.assert_unchanged(&before, "failed shard calls");

    // Valid calls: the rule, for every role and dtype, the pieces covering each tensor once.
    for (name, _, bufs) in &fx.tensors {
        let len = bufs[0].len();
        let mut next = 0;
        for r in 0..n {
            let (st, o, c) = shard(ctx, name, r);
            check(st, &format!("dpsync_shard '{name}' on replica {r}"));
            assert_eq!(
                (o, c),
                owned(len, r, n),
                "'{name}' ({len} elements) on replica {r}"
            );
            assert_eq!(o, next, "'{name}': pieces in replica order");
            next += c;
        }
        assert_eq!(next, len, "'{name}': the pieces cover it");
    }
    fx.assert_usable("after failed shard calls");
    fx.assert_shards_usable("after failed shard calls");
}

/// dpsync_reduce_scatter_grads with a NULL context or an op other than SUM and AVG, and
/// dpsync_allgather with a NULL context or roles 0 or outside the four roles: INVALID_ARGUMENT
/// naming the argument, nothing changed, and both still work afterwards.
#[test]
fn reduce_scatter_and_allgather_reject_bad_arguments_and_change_nothing() {
    let mut fx = Fx::new();
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    let nul: *mut dpsync_context = ptr::null_mut();
    expect_err(reduce_scatter(nul, SUM), INVALID_ARGUMENT, &["context"]);
    expect_err(reduce_scatter(nul, 7), INVALID_ARGUMENT, &[]);
    for op in [2u32, 3, 7, 0x8000_0000, 0xFFFF_FFFF] {
        expect_err(reduce_scatter(fx.ctx.0, op), INVALID_ARGUMENT, &["op"]);
        // the status allreduce_grads gives for the same op
        let ar = fx.ctx.allreduce_grads(op);
        assert_eq!(ar, INVALID_ARGUMENT, "allreduce_grads op {op}");
    }
    fx.assert_unchanged(&before, "reduce_scatter_grads with a bad op");
    expect_err(allgather(nul, PARAM), INVALID_ARGUMENT, &["context"]);
    for roles in [0u32, 0x10, 0x1F, 0x20, 0x8000_0001, 0xFFFF_FFFF] {
        expect_err(allgather(fx.ctx.0, roles), INVALID_ARGUMENT, &["roles"]);
        fx.assert_unchanged(&before, &format!("allgather(roles={roles:#x})"));
    }
    assert_eq!(fx.ctx.describe(), desc, "the context is unchanged");
    fx.assert_unchanged(&before, "failed reduce_scatter_grads and allgather");
    fx.assert_shards_usable("after failed shard collectives");
    fx.assert_usable("after failed shard collectives");
}

/// Registrations that disagree between replicas fail dpsync_reduce_scatter_grads exactly as they
/// fail dpsync_allreduce_grads (INCONSISTENT naming the tensor and the replica), and
/// dpsync_allgather over their role as dpsync_broadcast: nothing changed on any replica. After
/// unregistering, both work again.
#[test]
fn inconsistent_registrations_fail_reduce_scatter_and_allgather() {
    for bad in Bad::ALL {
        let what = format!("{bad:?}");
        let mut fx = Fx::new();
        let mut bufs: Vec<Vec<f32>> = vec![
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
            vec![100.0, 200.0, 300.0, 400.0, 500.0, 600.0],
        ];
        let copies = bufs.clone();
        let ptrs: Vec<*mut c_void> = bufs.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let culprit = bad.register(fx.ctx.0, &ptrs, &what);
        let before = fx.snapshot();
        let desc = fx.ctx.describe();

        let st = fx.ctx.allreduce_grads(SUM);
        let ar = expect_err(st, INCONSISTENT, &["'bad'", culprit]);
        for op in [SUM, AVG] {
            let st = reduce_scatter(fx.ctx.0, op);
            let rs = expect_err(st, INCONSISTENT, &["'bad'", culprit]);
            assert_eq!(
                rs.replace("dpsync_reduce_scatter_grads", "dpsync_allreduce_grads"),
                ar,
                "{what}: the same message as allreduce_grads"
            );
        }
        let roles = match bad {
            Bad::Role => vec![GRAD, COMPUTED, GRAD | COMPUTED, GRAD | PARAM],
            _ => vec![GRAD, GRAD | PARAM | STATE | COMPUTED],
        };
        for roles in roles {
            let want = fx.ctx.broadcast(roles, 0);
            assert_eq!(want, INCONSISTENT, "{what}: broadcast({roles:#x})");
            let st = allgather(fx.ctx.0, roles);
            expect_err(st, INCONSISTENT, &["'bad'"]);
        }
        assert_eq!(
            bufs, copies,
            "{what}: 'bad' buffers changed by a failed collective"
        );
        fx.assert_unchanged(&before, &what);
        assert_eq!(fx.ctx.describe(), desc, "{what}: the context is unchanged");

        // An allgather of roles 'bad' does not have still works, and changes only those.
        if !matches!(bad, Bad::Role) {
            check(
                allgather(fx.ctx.0, COMPUTED),
                &format!("{what}: allgather(COMPUTED)"),
            );
        }
        check(
            allgather(fx.ctx.0, STATE),
            &format!("{what}: allgather(STATE)"),
        );
        assert_eq!(bufs, copies, "{what}: 'bad' buffers changed");

        check(fx.ctx.unregister("bad"), &what);
        fx.assert_shards_usable(&what);
        assert_eq!(
            bufs, copies,
            "{what}: 'bad' buffers changed after unregister"
        );
    }
}

/// dpsync_allgather touches only the roles asked: each replica's owned piece of every such
/// tensor is copied to every other replica, every other tensor keeps its bytes.
#[test]
fn allgather_touches_only_the_roles_asked() {
    for roles in [
        PARAM,
        STATE,
        COMPUTED,
        GRAD,
        PARAM | STATE,
        PARAM | GRAD | STATE | COMPUTED,
    ] {
        let fx = Fx::new();
        let n = fx.n;
        let before = fx.snapshot();
        check(
            allgather(fx.ctx.0, roles),
            &format!("allgather({roles:#x})"),
        );
        for ((name, role, bufs), pre) in fx.tensors.iter().zip(&before) {
            // Element i comes from the replica that owns it.
            let len = pre[0].len();
            let mut want = pre[0].clone();
            for (w, src) in pre.iter().enumerate() {
                let (at, k) = owned(len, w, n);
                want = spliced(&want, src, at, k);
            }
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                let expect = if roles & role != 0 { &want } else { p };
                let tag = format!("allgather({roles:#x}): '{name}' on replica {r}");
                assert_same_bytes(b, expect, &tag);
            }
        }
    }
}

// ------------------------------------------------------------------ shards: the owned pieces only

/// Filled around and between the registered tensors: a write outside them shows.
const SENTINEL: u8 = 0xA5;
/// Sentinel bytes before and after each tensor (a multiple of 8, so every tensor stays aligned).
const GAP: usize = 40;

/// One replica's tensors in one allocation, each between sentinel gaps.
struct Arena {
    words: Vec<u64>,
    /// Byte offset of each tensor.
    at: Vec<usize>,
}

impl Arena {
    fn new(tensors: &[Buf]) -> Arena {
        let mut at = Vec::new();
        let mut end = GAP;
        for t in tensors {
            at.push(end);
            end += (t.len() * t.dtype().size()).next_multiple_of(8) + GAP;
        }
        let mut arena = Arena {
            words: vec![u64::from_ne_bytes([SENTINEL; 8]); end / 8],
            at,
        };
        for (i, t) in tensors.iter().enumerate() {
            arena.write(i, t);
        }
        arena
    }

    fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    fn write(&mut self, i: usize, t: &Buf) {
        let b = t.bytes();
        assert!(self.at[i] + b.len() <= self.words.len() * 8);
        // SAFETY: in bounds of the words (checked above); registered memory is only written
        // by the library inside a call, and no call runs now.
        unsafe { ptr::copy_nonoverlapping(b.as_ptr(), self.ptr(i).cast::<u8>(), b.len()) };
    }

    fn ptr(&mut self, i: usize) -> *mut c_void {
        // SAFETY: the offset is inside the words.
        unsafe { self.words.as_mut_ptr().cast::<u8>().add(self.at[i]).cast() }
    }

    /// What byte `b` of the arena belongs to, for a failure message.
    fn locate(&self, b: usize, names: &[String], sizes: &[usize]) -> String {
        for (i, &at) in self.at.iter().enumerate() {
            if b >= at && b < at + sizes[i] {
                return format!("'{}' byte {}", names[i], b - at);
            }
        }
        format!("a sentinel gap (arena byte {b})")
    }
}

/// dpsync_reduce_scatter_grads writes only the owned pieces of the GRADs: every replica's memory
/// around and between the tensors is filled with a sentinel, and after the call each replica's
/// whole allocation holds exactly its inputs with only its owned pieces replaced by the
/// reduction (dpsync_allreduce_grads' bytes): the sentinels, the other elements and the other
/// roles are as they were. Every dtype, SUM and AVG, 1 to 7 replicas (pieces that are empty when
/// a tensor has fewer elements than replicas), fusion off, small and the default, the host's
/// threaded path (a tensor over a MiB), and a second step whose gradients were marked ready.
/// dpsync_allgather then gives every replica the whole reduction, sentinels still intact.
#[test]
fn reduce_scatter_writes_only_the_owned_pieces() {
    let shapes: [(&str, u32, DType, usize); 11] = [
        ("g_one", GRAD, DType::F32, 1),
        ("g_two", GRAD, DType::F32, 2),
        ("g_f16", GRAD, DType::F16, 5),
        ("g_bf16", GRAD, DType::BF16, 9),
        ("p", PARAM, DType::F32, 6),
        ("g_f64", GRAD, DType::F64, 3),
        ("g_i32", GRAD, DType::I32, 7),
        ("s", STATE, DType::I64, 3),
        ("g_i64", GRAD, DType::I64, 4),
        ("g_f32", GRAD, DType::F32, 13),
        ("g_large", GRAD, DType::F32, 300_000 + 7),
    ];
    let names: Vec<String> = shapes.iter().map(|s| s.0.to_owned()).collect();
    let sizes: Vec<usize> = shapes.iter().map(|s| s.3 * s.2.size()).collect();
    for (n, fusion) in [
        (1, None),
        (2, Some(0)),
        (3, Some(48)),
        (3, None),
        (4, Some(0)),
        (7, Some(64)),
    ] {
        for op in [SUM, AVG] {
            let what = format!("{n} replicas, fusion {fusion:?}, op {op}");
            let ctx = Context::host(n, fusion);
            let input = |step: usize| -> Vec<Vec<Buf>> {
                (0..n)
                    .map(|r| {
                        (shapes.iter().enumerate())
                            .map(|(t, &(_, _, d, count))| {
                                Buf::random(d, count, (step * 1000 + r * 50 + t) as u64)
                            })
                            .collect()
                    })
                    .collect()
            };
            let first = input(0);
            let inputs = first.clone();
            let mut arenas: Vec<Arena> = inputs.iter().map(|ts| Arena::new(ts)).collect();
            for (r, arena) in arenas.iter_mut().enumerate() {
                for (t, &(name, role, d, count)) in shapes.iter().enumerate() {
                    let p = arena.ptr(t);
                    check(
                        register_raw(ctx.0, name, role, r, p, count, d.code()),
                        &what,
                    );
                }
            }
            let expect = |inputs: &[Vec<Buf>], gathered: bool| -> Vec<Vec<u8>> {
                let mut want: Vec<Arena> = inputs.iter().map(|ts| Arena::new(ts)).collect();
                for (t, &(_, role, _, count)) in shapes.iter().enumerate() {
                    if role != GRAD {
                        continue;
                    }
                    let per: Vec<&Buf> = inputs.iter().map(|ts| &ts[t]).collect();
                    let red = reference_allreduce(&per, op);
                    for (r, a) in want.iter_mut().enumerate() {
                        let (at, k) = if gathered {
                            (0, count)
                        } else {
                            owned(count, r, n)
                        };
                        a.write(t, &spliced(&inputs[r][t], &red, at, k));
                    }
                }
                want.iter().map(Arena::bytes).collect()
            };
            let compare = |arenas: &[Arena], want: &[Vec<u8>], when: &str| {
                for (r, (a, w)) in arenas.iter().zip(want).enumerate() {
                    let got = a.bytes();
                    if let Some(b) = (0..got.len()).find(|&b| got[b] != w[b]) {
                        panic!(
                            "{what}, {when}: replica {r}: {} is {:#04x}, want {:#04x}",
                            a.locate(b, &names, &sizes),
                            got[b],
                            w[b]
                        );
                    }
                }
            };

            check(reduce_scatter(ctx.0, op), &what);
            compare(
                &arenas,
                &expect(&inputs, false),
                "after reduce_scatter_grads",
            );
            for (t, &(name, _, _, count)) in shapes.iter().enumerate() {
                for r in 0..n {
                    let (st, o, c) = shard(ctx.0, name, r);
                    check(st, &format!("{what}: shard '{name}' on replica {r}"));
                    assert_eq!((o, c), owned(count, r, n), "{what}: '{name}' #{t}");
                }
            }
            check(allgather(ctx.0, GRAD), &what);
            compare(&arenas, &expect(&inputs, true), "after allgather(GRAD)");

            // Step 2: new gradients, every one marked ready (nothing starts early after a
            // reduce-scatter step), then a reduce-scatter again.
            let inputs = input(1);
            for (r, a) in arenas.iter_mut().enumerate() {
                for (t, &(name, role, _, _)) in shapes.iter().enumerate() {
                    if role == GRAD {
                        a.write(t, &inputs[r][t]);
                        check(ctx.grad_ready(name, r), &format!("{what}: grad_ready"));
                    }
                }
            }
            // The other roles keep step 0's bytes.
            let mut mixed = inputs.clone();
            for (t, &(_, role, _, _)) in shapes.iter().enumerate() {
                if role != GRAD {
                    for r in 0..n {
                        mixed[r][t] = first[r][t].clone();
                    }
                }
            }
            check(reduce_scatter(ctx.0, op), &format!("{what}: step 2"));
            compare(
                &arenas,
                &expect(&mixed, false),
                "step 2, after reduce_scatter_grads",
            );
            drop(ctx);
            compare(
                &arenas,
                &expect(&mixed, false),
                "step 2, after context_destroy",
            );
        }
    }
}
