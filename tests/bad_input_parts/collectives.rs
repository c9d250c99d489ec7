//! Bad input to the collectives: bad arguments, inconsistent registrations, shared memory, sparse
//! slices whose byte size overflows.

use super::*;

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
