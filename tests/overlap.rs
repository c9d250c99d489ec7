//! `dpsync_grad_ready` on host replicas: a bucket is reduced as soon as every replica declared
//! all its tensors final (with the op of the previous `dpsync_allreduce_grads`; nothing starts
//! early before the first), `dpsync_allreduce_grads` finishes the rest, and the step ends with
//! the same bytes as a step without the calls.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
    pub mod sparse;
}

use common::{abi::*, buf::*, context::*, errors::*, reference::*};

/// Tensors of the model, in registration (forward) order: name, dtype, elements. With 64-byte
/// buckets the plan fuses them, last registered first, into buckets by dtype and size.
const MODEL: [(&str, DType, usize); 6] = [
    ("w0", DType::F32, 5),
    ("w1", DType::F32, 7),
    ("h0", DType::F16, 9),
    ("w2", DType::F32, 3),
    ("i0", DType::I64, 4),
    ("w3", DType::F32, 11),
];
const FUSION: usize = 64;

/// One step's gradients of replica r (deterministic, different per replica and step).
fn grads(step: u64) -> Vec<Vec<Buf>> {
    (0..3)
        .map(|r| {
            (MODEL.iter().enumerate())
                .map(|(i, &(_, dt, n))| Buf::random(dt, n, 1000 * step + 10 * r + i as u64))
                .collect()
        })
        .collect()
}

/// A context with the model registered on `bufs` (replica-major).
fn context(bufs: &mut [Vec<Buf>]) -> Context {
    let ctx = Context::host(bufs.len(), Some(FUSION));
    for (r, per) in bufs.iter_mut().enumerate() {
        for (i, b) in per.iter_mut().enumerate() {
            ctx.reg_buf(MODEL[i].0, GRAD, r, b);
        }
    }
    ctx
}

/// Overwrites `bufs` with step `step`'s gradients (the registered pointers stay).
fn refill(bufs: &mut [Vec<Buf>], step: u64) {
    for (per, new) in bufs.iter_mut().zip(grads(step)) {
        for (b, n) in per.iter_mut().zip(&new) {
            b.copy_from(n);
        }
    }
}

/// A context after one step with `op` (so early buckets know their op), holding step `step`'s
/// gradients.
fn warm_context(bufs: &mut [Vec<Buf>], op: u32, step: u64) -> Context {
    let ctx = context(bufs);
    check(ctx.allreduce_grads(op), "the first step");
    refill(bufs, step);
    ctx
}

/// The buckets of the plan as lists of tensor names (describe), in reduction order.
fn buckets(ctx: &Context) -> Vec<Vec<String>> {
    let d = ctx.describe_json();
    (d["buckets"].as_array().unwrap().iter())
        .map(|b| {
            (b["tensors"].as_array().unwrap().iter())
                .map(|t| t.as_str().unwrap().to_owned())
                .collect()
        })
        .collect()
}

fn index(name: &str) -> usize {
    MODEL.iter().position(|m| m.0 == name).unwrap()
}

/// What the step gives without dpsync_grad_ready.
fn reference(step: u64, op: u32) -> Vec<Vec<Buf>> {
    let mut bufs = grads(step);
    let ctx = context(&mut bufs);
    check(ctx.allreduce_grads(op), "reference allreduce_grads");
    drop(ctx);
    bufs
}

#[test]
fn a_bucket_is_reduced_when_its_last_tensor_is_declared_on_the_last_replica() {
    let mut bufs = grads(0);
    let inputs = grads(1);
    let ctx = warm_context(&mut bufs, SUM, 1);
    let plan = buckets(&ctx);
    assert!(
        plan.len() >= 3,
        "the model should make several buckets: {plan:?}"
    );
    let first = &plan[0];
    // Declare the first bucket's tensors everywhere except the last tensor on replica 2.
    for r in 0..3 {
        for (k, name) in first.iter().enumerate() {
            if r == 2 && k == first.len() - 1 {
                continue;
            }
            check(ctx.grad_ready(name, r), "grad_ready");
            check(ctx.grad_ready(name, r), "grad_ready twice is a no-op");
        }
    }
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(
                b,
                &inputs[r][i],
                "nothing reduced before the bucket is complete",
            );
        }
    }
    check(ctx.grad_ready(first.last().unwrap(), 2), "the last mark");
    for name in first {
        let i = index(name);
        let ins: Vec<&Buf> = inputs.iter().map(|per| &per[i]).collect();
        let want = reference_allreduce(&ins, SUM);
        for (r, per) in bufs.iter().enumerate() {
            assert_same_bytes(
                &per[i],
                &want,
                &format!("'{name}' on replica {r}, summed early"),
            );
        }
    }
    for name in plan[1..].iter().flatten() {
        let i = index(name);
        for (r, per) in bufs.iter().enumerate() {
            assert_same_bytes(&per[i], &inputs[r][i], &format!("'{name}' not yet reduced"));
        }
    }
    let d = ctx.describe_json();
    assert_eq!(d["overlap"]["buckets_reduced_early_this_step"], 1);
    // allreduce_grads finishes the others and does not reduce the first bucket again.
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let want = reference(1, SUM);
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(b, &want[r][i], &format!("'{}' replica {r}", MODEL[i].0));
        }
    }
    let d = ctx.describe_json();
    assert_eq!(d["overlap"]["buckets_reduced_early_last_step"], 1);
    assert_eq!(d["overlap"]["marks_this_step"], 0, "the step ended");
}

/// Every tensor declared on every replica, in backward order, for several steps: the first
/// step reduces nothing early (the op is not known yet), the others reduce every bucket early,
/// and every step ends with the bytes of a step without grad_ready, for SUM and AVG and every
/// dtype (f16 values near its limit included: an AVG is computed as an AVG).
#[test]
fn steps_declaring_everything_match_steps_without_it() {
    for op in [SUM, AVG] {
        let mut bufs = grads(0);
        let ctx = context(&mut bufs);
        let all = buckets(&ctx).len();
        for step in 1..5u64 {
            refill(&mut bufs, step);
            for &(name, _, _) in MODEL.iter().rev() {
                for r in 0..3 {
                    check(ctx.grad_ready(name, r), "grad_ready");
                }
            }
            let early = ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"].clone();
            assert_eq!(early, if step == 1 { 0 } else { all }, "step {step}");
            check(ctx.allreduce_grads(op), "allreduce_grads");
            let want = reference(step, op);
            for (r, per) in bufs.iter().enumerate() {
                for (i, b) in per.iter().enumerate() {
                    let what = format!("op {op} step {step} '{}' replica {r}", MODEL[i].0);
                    assert_same_bytes(b, &want[r][i], &what);
                }
            }
        }
    }
}

/// The op changes: buckets summed early are divided for an AVG (f32 with 3 replicas: exactly
/// what AVG computes); buckets averaged early cannot become sums, so SUM is refused, changing
/// nothing, and AVG then finishes the step.
#[test]
fn changing_the_op_divides_early_sums_and_refuses_to_undo_averages() {
    let mut bufs = grads(0);
    let inputs = grads(1);
    let ctx = warm_context(&mut bufs, SUM, 1);
    let f32_bucket = (buckets(&ctx).into_iter())
        .find(|b| b.iter().all(|n| MODEL[index(n)].1 == DType::F32))
        .expect("an f32 bucket");
    let declare = |bucket: &[String]| {
        for name in bucket {
            for r in 0..3 {
                check(ctx.grad_ready(name, r), "grad_ready");
            }
        }
    };
    declare(&f32_bucket);
    check(ctx.allreduce_grads(AVG), "AVG after SUM buckets");
    let want = reference(1, AVG);
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(b, &want[r][i], &format!("'{}' replica {r}", MODEL[i].0));
        }
    }
    // Now the op is AVG: a bucket averaged early, then SUM.
    refill(&mut bufs, 1);
    declare(&f32_bucket);
    let early: Vec<Vec<u8>> = (bufs.iter().flatten()).map(|b| b.bytes()).collect();
    expect_err(
        ctx.allreduce_grads(SUM),
        INVALID_STATE,
        &["op", "DPSYNC_REDUCE_AVG"],
    );
    let after: Vec<Vec<u8>> = (bufs.iter().flatten()).map(|b| b.bytes()).collect();
    assert_eq!(early, after, "the refused call changed nothing");
    for name in MODEL
        .iter()
        .map(|m| m.0)
        .filter(|n| !f32_bucket.iter().any(|b| b == n))
    {
        let i = index(name);
        for (r, per) in bufs.iter().enumerate() {
            assert_same_bytes(&per[i], &inputs[r][i], &format!("'{name}' not reduced"));
        }
    }
    check(ctx.allreduce_grads(AVG), "AVG finishes the step");
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(b, &want[r][i], &format!("'{}' replica {r}", MODEL[i].0));
        }
    }
}

#[test]
fn grad_ready_bad_input_changes_nothing() {
    let mut bufs = grads(0);
    let inputs = grads(1);
    let ctx = warm_context(&mut bufs, SUM, 1);
    let mut p = [1.0f32; 4];
    for r in 0..3 {
        ctx.reg("p", PARAM, r, &mut p[r..r + 1], F32);
    }
    ctx.reg_sparse_all("emb", 2, F32, I64, 0);
    expect_err(ctx.grad_ready("nope", 0), NOT_FOUND, &["'nope'"]);
    expect_err(ctx.grad_ready("w0", 3), INVALID_ARGUMENT, &["replica 3"]);
    expect_err(
        ctx.grad_ready("p", 0),
        INVALID_ARGUMENT,
        &["'p'", "PARAM", "GRAD"],
    );
    expect_err(
        ctx.grad_ready("emb", 0),
        INVALID_ARGUMENT,
        &["'emb'", "sparse"],
    );
    let name = cstr("w0");
    // SAFETY: NULL handle and name are what is being tested.
    unsafe {
        let st = dpsync::dpsync_grad_ready(std::ptr::null_mut(), name.as_ptr(), 0);
        expect_err(st, INVALID_ARGUMENT, &["context"]);
        let st = dpsync::dpsync_grad_ready(ctx.0, std::ptr::null(), 0);
        expect_err(st, INVALID_ARGUMENT, &["name"]);
    }
    // A GRAD missing on one replica: grad_ready refuses as allreduce_grads would.
    let mut g = vec![0f32; 2];
    ctx.reg("half_registered", GRAD, 0, &mut g, F32);
    let plan = buckets(&ctx);
    for name in &plan[0] {
        for r in 0..3 {
            expect_err(
                ctx.grad_ready(name, r),
                INCONSISTENT,
                &["'half_registered'", "replica"],
            );
        }
    }
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(b, &inputs[r][i], "failed grad_ready calls reduce nothing");
        }
    }
    assert_eq!(ctx.describe_json()["overlap"]["marks_this_step"], 0);
}

/// Registrations that would change the buckets are refused while a bucket of the step was
/// reduced early (it would be reduced twice, or not at all); before that they only forget the
/// marks, and the step is still right.
#[test]
fn registrations_wait_for_the_end_of_a_step_with_early_buckets() {
    let mut bufs = grads(0);
    let ctx = warm_context(&mut bufs, SUM, 1);
    let plan = buckets(&ctx);
    let mut extra = [vec![0f32; 3], vec![0f32; 3], vec![0f32; 3]];
    // Marks without a complete bucket: registering is fine, the marks are forgotten.
    check(ctx.grad_ready(&plan[0][0], 0), "grad_ready");
    for (r, e) in extra.iter_mut().enumerate() {
        ctx.reg("extra", GRAD, r, e, F32);
    }
    assert_eq!(ctx.describe_json()["overlap"]["marks_this_step"], 0);
    check(ctx.unregister("extra"), "unregister with no bucket reduced");
    // A complete bucket: now registering and unregistering dense tensors wait for the step.
    for name in &plan[0] {
        for r in 0..3 {
            check(ctx.grad_ready(name, r), "grad_ready");
        }
    }
    expect_err(
        ctx.register("extra", GRAD, 0, &mut extra[0], F32),
        INVALID_STATE,
        &["'extra'", "dpsync_allreduce_grads"],
    );
    expect_err(
        ctx.unregister("w0"),
        INVALID_STATE,
        &["'w0'", "dpsync_allreduce_grads"],
    );
    // An identical registration is a no-op, also mid-step.
    ctx.reg_buf("w0", GRAD, 0, &mut bufs[0][index("w0")]);
    // Sparse gradients do not change the buckets.
    ctx.reg_sparse_all("emb", 2, F32, I64, 0);
    check(ctx.unregister("emb"), "unregister a sparse gradient");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let want = reference(1, SUM);
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(b, &want[r][i], &format!("'{}' replica {r}", MODEL[i].0));
        }
    }
    ctx.reg("extra", GRAD, 0, &mut extra[0], F32);
}

/// A failed allreduce_grads (a sparse slice missing) leaves the early buckets reduced and the
/// step open: the retry finishes it without reducing them again.
#[test]
fn a_failed_allreduce_grads_keeps_the_step_open() {
    let mut bufs = grads(0);
    let ctx = context(&mut bufs);
    ctx.reg_sparse_all("emb", 1, F32, I64, 0);
    let (idx, val) = ([0i64], [1f32]);
    for r in 0..3 {
        check(ctx.sparse_set("emb", r, &idx, &val), "sparse_set");
    }
    check(ctx.allreduce_grads(SUM), "the first step");
    refill(&mut bufs, 1);
    let plan = buckets(&ctx);
    for name in &plan[0] {
        for r in 0..3 {
            check(ctx.grad_ready(name, r), "grad_ready");
        }
    }
    for r in 0..2 {
        check(ctx.sparse_set("emb", r, &idx, &val), "sparse_set");
    }
    expect_err(
        ctx.allreduce_grads(SUM),
        INCONSISTENT,
        &["'emb'", "replica 2"],
    );
    check(ctx.sparse_set("emb", 2, &idx, &val), "sparse_set");
    check(ctx.allreduce_grads(SUM), "the retry");
    let want = reference(1, SUM);
    for (r, per) in bufs.iter().enumerate() {
        for (i, b) in per.iter().enumerate() {
            assert_same_bytes(b, &want[r][i], &format!("'{}' replica {r}", MODEL[i].0));
        }
    }
}
