//! Messages a newcomer meets first: each names the likely mistake, not only the symptom.

mod common {
    pub mod abi;
    pub mod context;
    pub mod errors;
}

use common::{abi::*, context::*, errors::*};

/// Role and dtype passed in each other's places: the message says the role is wrong in plain
/// words and points at the swap; a wrong role alone gets no such hint.
#[test]
fn role_and_dtype_swapped_are_named() {
    let ctx = Context::host(2, None);
    let mut w = vec![0f32; 4];
    let st = ctx.register("w", F32, 0, &mut w, PARAM);
    let m = expect_err(
        st,
        INVALID_ARGUMENT,
        &["role is 0", "role and dtype look swapped"],
    );
    assert!(!m.contains("one of exactly"), "{m}");
    assert!(m.contains("DPSYNC_ROLE_PARAM/GRAD/COMPUTED/STATE"), "{m}");
    // A mask where one role is wanted, with a valid dtype: no swap hint.
    let st = ctx.register("w", PARAM | GRAD, 0, &mut w, F32);
    let m = expect_err(st, INVALID_ARGUMENT, &["role is 3", "not a mask"]);
    assert!(!m.contains("swapped"), "{m}");
    // A valid role with a role in the dtype's place (BF16's code is 3, not a role).
    let st = ctx.register("w", GRAD, 0, &mut w, PARAM);
    assert_eq!(
        st, OK,
        "GRAD with dtype code 1 (F64) is a valid registration"
    );
    check(ctx.unregister("w"), "unregister");
    let st = ctx.register("w", F64, 0, &mut w, STATE);
    expect_err(
        st,
        INVALID_ARGUMENT,
        &["dtype is 8", "role and dtype look swapped"],
    );
    assert_eq!(ctx.describe_json()["tensors"], 0, "nothing registered");
}

/// F64 over float buffers that lie side by side: the overlap message names the dtype and the
/// byte counts that disagree.
#[test]
fn overlap_from_a_wrong_dtype_names_the_dtype() {
    let ctx = Context::host(2, None);
    let mut both = [0f32; 8];
    let (a, b) = both.split_at_mut(4);
    ctx.reg("w", GRAD, 0, a, F64);
    ctx.reg("w", GRAD, 1, b, F64);
    let m = expect_err(
        ctx.allreduce_grads(SUM),
        INCONSISTENT,
        &["'w'", "overlaps", "f64", "32 bytes", "16 bytes apart"],
    );
    assert!(m.contains("dtype"), "{m}");
}

/// A replica index near SIZE_MAX (-1 passed as size_t) says so; an index just out of range
/// does not.
#[test]
fn a_negative_replica_index_is_named() {
    let ctx = Context::host(2, None);
    let mut w = vec![0f32; 4];
    let neg = ctx.register("w", PARAM, usize::MAX, &mut w, F32);
    expect_err(
        neg,
        INVALID_ARGUMENT,
        &[
            "replica 18446744073709551615",
            "(a negative index passed as size_t?)",
        ],
    );
    let m = expect_err(
        ctx.broadcast(PARAM, usize::MAX - 1),
        INVALID_ARGUMENT,
        &["negative"],
    );
    assert!(m.contains("root") || m.contains("replica"), "{m}");
    let m = expect_err(
        ctx.register("w", PARAM, 2, &mut w, F32),
        INVALID_ARGUMENT,
        &["replica 2 is out of range"],
    );
    assert!(!m.contains("negative"), "{m}");
}
