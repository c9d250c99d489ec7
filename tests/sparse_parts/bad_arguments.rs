//! register_sparse, sparse_set and sparse_get refuse bad arguments; unregister removes a sparse
//! gradient.

use super::*;

#[test]
fn register_sparse_rejects_bad_arguments_and_changes_nothing() {
    let ctx = Context::host(3, None);
    let name = cstr("emb");
    let empty = cstr("");
    // SAFETY: deliberate NULL and bad arguments; valid otherwise.
    unsafe {
        let st = dpsync_register_sparse(ptr::null_mut(), name.as_ptr(), 0, 4, F32, I64, 0);
        expect_err(st, INVALID_ARGUMENT, &["context is NULL"]);
        let st = dpsync_register_sparse(ctx.0, ptr::null(), 0, 4, F32, I64, 0);
        expect_err(st, INVALID_ARGUMENT, &["name is NULL"]);
        let st = dpsync_register_sparse(ctx.0, empty.as_ptr(), 0, 4, F32, I64, 0);
        expect_err(st, INVALID_ARGUMENT, &["name is empty"]);
    }
    let cases: [(usize, usize, u32, u32, &[&str]); 7] = [
        (3, 4, F32, I64, &["replica 3", "3 replicas"]),
        (1, 0, F32, I64, &["row_len is 0", "'emb'", "replica 1"]),
        (1, 4, I32, I64, &["value_dtype is 4", "'emb'", "replica 1"]),
        (2, 4, 99, I64, &["value_dtype is 99", "'emb'", "replica 2"]),
        (
            0,
            4,
            F32,
            F32,
            &["index_dtype is 0", "I32/I64", "'emb'", "replica 0"],
        ),
        (0, 4, F32, 6, &["index_dtype is 6", "'emb'"]),
        (
            1,
            usize::MAX,
            F64,
            I64,
            &["row_len", "too large", "'emb'", "replica 1"],
        ),
    ];
    for (replica, row_len, vd, id, needles) in cases {
        let st = ctx.register_sparse("emb", replica, row_len, vd, id, 0);
        expect_err(st, INVALID_ARGUMENT, needles);
    }
    let json = ctx.describe_json();
    assert_eq!(json["sparse"], serde_json::json!([]), "nothing registered");
    assert_eq!(json["problems"], serde_json::json!([]));
    // Identical again: no-op. Different on the same replica: CONFLICT, the first one kept.
    check(ctx.register_sparse("emb", 1, 4, F32, I64, 0), "register");
    check(
        ctx.register_sparse("emb", 1, 4, F32, I64, 0),
        "identical again",
    );
    let st = ctx.register_sparse("emb", 1, 4, F32, I64, 5);
    expect_err(
        st,
        CONFLICT,
        &["'emb'", "replica 1", "num_embeddings 0", "num_embeddings 5"],
    );
    let st = ctx.register_sparse("emb", 1, 4, BF16, I64, 0);
    expect_err(st, CONFLICT, &["'emb'", "replica 1"]);
    ctx.reg_sparse_all("emb", 4, F32, I64, 0);
    // Dense and sparse names are one namespace.
    let mut dense = vec![0f32; 4];
    ctx.reg("w_grad", GRAD, 0, &mut dense, F32);
    let st = ctx.register_sparse("w_grad", 0, 4, F32, I64, 0);
    expect_err(st, CONFLICT, &["'w_grad'", "dense"]);
    let st = ctx.register("emb", GRAD, 0, &mut dense, F32);
    expect_err(st, CONFLICT, &["'emb'", "sparse gradient"]);
    let json = ctx.describe_json();
    assert_eq!(json["sparse"].as_array().unwrap().len(), 1);
    assert_eq!(json["sparse"][0]["num_embeddings"], 0);
}

/// (name, replica, indices, values, rows, expected status, message needles)
type SetCase<'a> = (
    &'a str,
    usize,
    *const c_void,
    *const c_void,
    usize,
    dpsync_status,
    &'a [&'a str],
);

#[test]
fn sparse_set_rejects_bad_arguments_and_keeps_the_slice_already_set() {
    let ctx = Context::host(3, None);
    ctx.reg_sparse_all("emb", 2, F32, I64, 0);
    check(
        ctx.register_sparse("partial", 0, 2, F32, I64, 0),
        "register",
    );
    let mut dense = [vec![1f32], vec![1f32], vec![1f32]];
    for (r, d) in dense.iter_mut().enumerate() {
        ctx.reg("w_grad", GRAD, r, d, F32);
    }
    let idx = [4i64, 5];
    let vals = [1f32, 2., 3., 4.];
    let good: Vec<(Vec<i64>, Vec<f32>)> = (0..3)
        .map(|r| (vec![r as i64], vec![r as f32; 2]))
        .collect();
    for (r, (i, v)) in good.iter().enumerate() {
        check(ctx.sparse_set("emb", r, i, v), "set");
    }
    let (ip, vp) = (
        idx.as_ptr().cast::<c_void>(),
        vals.as_ptr().cast::<c_void>(),
    );
    let cases: [SetCase; 8] = [
        (
            "emb",
            1,
            ip,
            ptr::null(),
            2,
            INVALID_ARGUMENT,
            &["values is NULL", "'emb'", "replica 1"],
        ),
        (
            "emb",
            2,
            ptr::null(),
            vp,
            1,
            INVALID_ARGUMENT,
            &["indices is NULL", "'emb'", "replica 2"],
        ),
        (
            "emb",
            3,
            ip,
            vp,
            2,
            INVALID_ARGUMENT,
            &["replica 3", "3 replicas"],
        ),
        (
            "nope",
            0,
            ip,
            vp,
            2,
            NOT_FOUND,
            &["'nope'", "not registered"],
        ),
        ("w_grad", 0, ip, vp, 2, NOT_FOUND, &["'w_grad'", "dense"]),
        (
            "partial",
            2,
            ip,
            vp,
            2,
            INCONSISTENT,
            &["'partial'", "not registered on replica 2"],
        ),
        (
            "emb",
            0,
            ip.wrapping_byte_add(4),
            vp,
            1,
            INVALID_ARGUMENT,
            &["indices", "aligned", "'emb'"],
        ),
        (
            "emb",
            0,
            ip,
            vp.wrapping_byte_add(2),
            1,
            INVALID_ARGUMENT,
            &["values", "aligned", "replica 0"],
        ),
    ];
    for (name, replica, i, v, rows, want, needles) in cases {
        expect_err(ctx.sparse_set_raw(name, replica, i, v, rows), want, needles);
    }
    let st = ctx.sparse_set_raw("emb", 0, ip, vp, usize::MAX / 2);
    expect_err(st, INVALID_ARGUMENT, &["too large", "'emb'", "replica 0"]);
    let c = cstr("emb");
    // SAFETY: deliberate NULL context and name.
    unsafe {
        expect_err(
            dpsync_sparse_set(ptr::null_mut(), c.as_ptr(), 0, ip, vp, 1),
            INVALID_ARGUMENT,
            &["context is NULL"],
        );
        expect_err(
            dpsync_sparse_set(ctx.0, ptr::null(), 0, ip, vp, 1),
            INVALID_ARGUMENT,
            &["name is NULL"],
        );
    }
    check(ctx.unregister("partial"), "unregister");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let out = ctx.gathered("emb", 0);
    assert_eq!(
        out.indices::<i64>(),
        vec![0, 1, 2],
        "the failed sets changed no slice"
    );
    assert_eq!(out.values::<f32>(2), vec![0., 0., 1., 1., 2., 2.]);
}

#[test]
fn sparse_get_rejects_bad_arguments_and_writes_no_output() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("emb", 1, F32, I32, 0);
    let c = cstr("emb");
    let sentinel = 0x5a5a as *const c_void;
    let (mut i, mut v, mut rows) = (sentinel, sentinel, 77usize);
    // SAFETY: valid handle and out pointers; deliberate bad arguments.
    let get = |name: *const std::ffi::c_char, replica, i: *mut *const c_void, v, rows| unsafe {
        dpsync_sparse_get(ctx.0, name, replica, i, v, rows)
    };
    expect_err(
        get(c.as_ptr(), 0, &mut i, &mut v, &mut rows),
        INVALID_STATE,
        &["'emb'", "dpsync_allreduce_grads"],
    );
    check(ctx.sparse_set("emb", 0, &[1i32], &[1f32]), "set");
    check(ctx.sparse_set("emb", 1, &[2i32], &[2f32]), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    // The dense collective on a sparse name says what the name is.
    expect_err(
        ctx.allreduce("emb", SUM),
        NOT_FOUND,
        &["'emb'", "sparse gradient"],
    );
    let nope = cstr("nope");
    expect_err(
        get(nope.as_ptr(), 0, &mut i, &mut v, &mut rows),
        NOT_FOUND,
        &["'nope'"],
    );
    expect_err(
        get(c.as_ptr(), 2, &mut i, &mut v, &mut rows),
        INVALID_ARGUMENT,
        &["replica 2"],
    );
    expect_err(
        get(ptr::null(), 0, &mut i, &mut v, &mut rows),
        INVALID_ARGUMENT,
        &["name is NULL"],
    );
    expect_err(
        get(c.as_ptr(), 0, ptr::null_mut(), &mut v, &mut rows),
        INVALID_ARGUMENT,
        &["indices is NULL"],
    );
    expect_err(
        get(c.as_ptr(), 0, &mut i, ptr::null_mut(), &mut rows),
        INVALID_ARGUMENT,
        &["values is NULL"],
    );
    expect_err(
        get(c.as_ptr(), 0, &mut i, &mut v, ptr::null_mut()),
        INVALID_ARGUMENT,
        &["rows is NULL"],
    );
    assert_eq!(
        (i, v, rows),
        (sentinel, sentinel, 77),
        "outputs are written only on success"
    );
    // SAFETY: deliberate NULL context.
    let st =
        unsafe { dpsync_sparse_get(ptr::null_mut(), c.as_ptr(), 0, &mut i, &mut v, &mut rows) };
    expect_err(st, INVALID_ARGUMENT, &["context is NULL"]);
    check(get(c.as_ptr(), 1, &mut i, &mut v, &mut rows), "get");
    assert_eq!(rows, 2);
    // SAFETY: NULL options.
    let st = unsafe { dpsync_options_set_sparse_coalesce(ptr::null_mut(), true) };
    expect_err(st, INVALID_ARGUMENT, &["options is NULL"]);
}

#[test]
fn unregister_removes_a_sparse_gradient() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("emb", 1, F32, I64, 0);
    ctx.reg_sparse_all("keep", 1, F32, I64, 0);
    for r in 0..2 {
        check(ctx.sparse_set("emb", r, &[r as i64], &[1f32]), "set");
        check(ctx.sparse_set("keep", r, &[r as i64], &[2f32]), "set");
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let old = ctx.gathered("emb", 1);
    check(ctx.unregister("emb"), "unregister");
    expect_err(ctx.unregister("emb"), NOT_FOUND, &["'emb'"]);
    assert_eq!(ctx.sparse_get("emb", 0), Err(NOT_FOUND));
    // Its outputs stay readable until the next step, as the contract promises.
    assert_eq!(old.values::<f32>(1), vec![1., 1.]);
    assert_eq!(ctx.gathered("keep", 0).values::<f32>(1), vec![2., 2.]);
    // Registered again: a new gradient, not gathered yet.
    ctx.reg_sparse_all("emb", 3, F64, I32, 0);
    expect_err(
        ctx.sparse_get("emb", 0).map(|_| OK).unwrap_or_else(|s| s),
        INVALID_STATE,
        &["'emb'"],
    );
    for r in 0..2 {
        check(
            ctx.sparse_set("emb", r, &[] as &[i32], &[] as &[f64]),
            "set",
        );
        check(
            ctx.sparse_set("keep", r, &[] as &[i64], &[] as &[f32]),
            "set",
        );
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    assert_eq!(ctx.gathered("emb", 0).rows, 0);
    // A dense name is unregistered as before.
    let mut d = [vec![0f32], vec![0f32]];
    for (r, b) in d.iter_mut().enumerate() {
        ctx.reg("dense", GRAD, r, b, F32);
    }
    check(ctx.unregister("dense"), "unregister dense");
}
