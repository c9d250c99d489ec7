//! Checkpoint sync, ported from Caffe2's data_parallel_model_test (test_checkpoint_params, the
//! duplicate-initialiser fix, momentum blobs created by the optimizer after the model):
//! params, optimizer state and the ITER counter are broadcast from a (non-zero) root by role
//! mask; COMPUTED tensors are left alone by that broadcast and then averaged; registering the
//! identical thing again is a no-op; tensors registered after collectives are included in later
//! ones; unregistered tensors are ignored.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
}

use common::{abi::*, buf::*, context::*, errors::*, reference::*};
use std::collections::BTreeMap;

/// Named tensors on every replica, with their roles, kept at stable addresses.
struct Model {
    n: usize,
    /// name -> (role, one buffer per replica)
    tensors: BTreeMap<String, (u32, Vec<Buf>)>,
    /// registration order of names
    order: Vec<String>,
}

impl Model {
    fn new(n: usize) -> Self {
        Model {
            n,
            tensors: BTreeMap::new(),
            order: Vec::new(),
        }
    }

    /// Adds a tensor with distinct random contents on every replica.
    fn add(&mut self, name: &str, role: u32, dtype: DType, count: usize, seed: u64) {
        let bufs = (0..self.n)
            .map(|r| Buf::random(dtype, count, seed * 1000 + r as u64))
            .collect();
        self.tensors.insert(name.to_owned(), (role, bufs));
        self.order.push(name.to_owned());
    }

    fn register(&mut self, ctx: &Context, name: &str) {
        let (role, bufs) = self.tensors.get_mut(name).unwrap();
        for (r, b) in bufs.iter_mut().enumerate() {
            ctx.reg_buf(name, *role, r, b);
        }
    }

    fn register_all(&mut self, ctx: &Context) {
        for name in self.order.clone() {
            self.register(ctx, &name);
        }
    }

    fn buf(&self, name: &str, r: usize) -> &Buf {
        &self.tensors[name].1[r]
    }

    fn snapshot(&self) -> BTreeMap<String, Vec<Buf>> {
        self.tensors
            .iter()
            .map(|(k, (_, b))| (k.clone(), b.clone()))
            .collect()
    }

    fn role(&self, name: &str) -> u32 {
        self.tensors[name].0
    }

    /// Refills every replica of `name` with new distinct contents, in place.
    fn refill(&mut self, name: &str, seed: u64) {
        for (r, b) in self.tensors.get_mut(name).unwrap().1.iter_mut().enumerate() {
            b.fill_random(seed * 1000 + r as u64);
        }
    }
}

/// A Caffe2-like model: two FC layers with momentum, the ITER counter, BN running statistics
/// and gradients.
fn caffe2_model(n: usize) -> Model {
    let mut m = Model::new(n);
    m.add("fc1_w", PARAM, DType::F32, 12, 1);
    m.add("fc1_w_grad", GRAD, DType::F32, 12, 2);
    m.add("fc1_b", PARAM, DType::F32, 3, 3);
    m.add("fc1_b_grad", GRAD, DType::F32, 3, 4);
    m.add("bn_running_mean", COMPUTED, DType::F32, 3, 5);
    m.add("bn_running_var", COMPUTED, DType::F64, 3, 6);
    m.add("fc2_w", PARAM, DType::BF16, 6, 7);
    m.add("fc2_w_grad", GRAD, DType::BF16, 6, 8);
    m.add("fc1_w_momentum", STATE, DType::F32, 12, 9);
    m.add("fc1_b_momentum", STATE, DType::F32, 3, 10);
    m.add("optimizer_iteration", STATE, DType::I64, 1, 11);
    for (r, b) in m
        .tensors
        .get_mut("optimizer_iteration")
        .unwrap()
        .1
        .iter_mut()
        .enumerate()
    {
        *b = Buf::I64(vec![1000 * r as i64 + 7]);
    }
    m
}

#[test]
fn checkpoint_broadcast_from_nonzero_root_by_role_mask() {
    let n = 4;
    let root = 2;
    let ctx = Context::host(n, Some(64));
    let mut m = caffe2_model(n);
    m.register_all(&ctx);
    let before = m.snapshot();

    check(ctx.broadcast(PARAM | STATE, root), "broadcast(PARAM|STATE)");
    for name in &m.order {
        for r in 0..n {
            let what = format!("'{name}' on replica {r}");
            match m.role(name) {
                PARAM | STATE => assert_same_bytes(m.buf(name, r), &before[name][root], &what),
                _ => assert_same_bytes(m.buf(name, r), &before[name][r], &what),
            }
        }
    }
    // The ITER counter is an i64 STATE tensor: copied exactly.
    for r in 0..n {
        assert_eq!(m.buf("optimizer_iteration", r), &Buf::I64(vec![2007]));
    }

    // Computed params are then averaged; nothing else moves.
    let after_bcast = m.snapshot();
    check(ctx.average(COMPUTED), "average(COMPUTED)");
    for name in &m.order {
        let want = if m.role(name) == COMPUTED {
            let refs: Vec<&Buf> = after_bcast[name].iter().collect();
            Some(reference_allreduce(&refs, AVG))
        } else {
            None
        };
        for (r, pre) in after_bcast[name].iter().enumerate() {
            let what = format!("'{name}' on replica {r} after average");
            match &want {
                Some(w) => assert_same_bytes(m.buf(name, r), w, &what),
                None => assert_same_bytes(m.buf(name, r), pre, &what),
            }
        }
    }
}

#[test]
fn broadcast_only_touches_the_roles_in_the_mask() {
    let n = 3;
    let ctx = Context::host(n, None);
    let mut m = caffe2_model(n);
    m.register_all(&ctx);
    let before = m.snapshot();
    check(ctx.broadcast(PARAM, n - 1), "broadcast(PARAM)");
    for name in &m.order {
        for r in 0..n {
            let src = if m.role(name) == PARAM { n - 1 } else { r };
            assert_same_bytes(
                m.buf(name, r),
                &before[name][src],
                &format!("'{name}' on {r}"),
            );
        }
    }
    let before = m.snapshot();
    check(
        ctx.broadcast(STATE | COMPUTED, 1),
        "broadcast(STATE|COMPUTED)",
    );
    for name in &m.order {
        for r in 0..n {
            let role = m.role(name);
            let src = if role == STATE || role == COMPUTED {
                1
            } else {
                r
            };
            assert_same_bytes(
                m.buf(name, r),
                &before[name][src],
                &format!("'{name}' on {r}"),
            );
        }
    }
    // GRAD by mask too (all four bits at once).
    let before = m.snapshot();
    check(
        ctx.broadcast(PARAM | GRAD | COMPUTED | STATE, 0),
        "broadcast(all)",
    );
    for name in &m.order {
        for r in 0..n {
            assert_same_bytes(
                m.buf(name, r),
                &before[name][0],
                &format!("'{name}' on {r}"),
            );
        }
    }
}

#[test]
fn identical_reregistration_is_a_noop() {
    let n = 3;
    let ctx = Context::host(n, Some(1024));
    let mut m = caffe2_model(n);
    m.register_all(&ctx);
    let desc = ctx.describe();
    // A duplicate initialiser registers everything again, even several times.
    m.register_all(&ctx);
    m.register_all(&ctx);
    assert_eq!(ctx.describe(), desc, "re-registration changed the registry");
    let json = ctx.describe_json();
    let listed: Vec<String> = json["buckets"]
        .as_array()
        .expect("buckets")
        .iter()
        .flat_map(|b| b["tensors"].as_array().unwrap().clone())
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    let mut sorted = listed.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        listed.len(),
        "a GRAD listed twice: {listed:?}"
    );
    assert_eq!(listed.len(), 3, "three GRAD tensors: {listed:?}");

    // Reduced once, not once per registration.
    let before = m.snapshot();
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    for name in ["fc1_w_grad", "fc1_b_grad", "fc2_w_grad"] {
        let refs: Vec<&Buf> = before[name].iter().collect();
        let want = reference_allreduce(&refs, SUM);
        for r in 0..n {
            assert_same_bytes(m.buf(name, r), &want, &format!("'{name}' on {r}"));
        }
    }
}

#[test]
fn tensors_registered_after_collectives_are_included() {
    let n = 3;
    let ctx = Context::host(n, Some(32));
    let mut m = Model::new(n);
    m.add("w", PARAM, DType::F32, 8, 1);
    m.add("w_grad", GRAD, DType::F32, 8, 2);
    m.register_all(&ctx);
    check(ctx.broadcast(PARAM, 0), "initial broadcast");
    check(ctx.allreduce_grads(SUM), "first step");

    // The optimizer creates its state (and the model a new layer) after the first step.
    m.add("w_momentum", STATE, DType::F32, 8, 3);
    m.add("iter", STATE, DType::I64, 1, 4);
    m.add("late_grad", GRAD, DType::F64, 5, 5);
    for name in ["w_momentum", "iter", "late_grad"] {
        m.register(&ctx, name);
    }
    m.refill("w", 6);
    let before = m.snapshot();
    check(ctx.broadcast(PARAM | STATE, 1), "checkpoint broadcast");
    for name in ["w", "w_momentum", "iter"] {
        for r in 0..n {
            assert_same_bytes(
                m.buf(name, r),
                &before[name][1],
                &format!("'{name}' on {r}"),
            );
        }
    }
    for name in ["w_grad", "late_grad"] {
        for (r, pre) in before[name].iter().enumerate() {
            assert_same_bytes(m.buf(name, r), pre, &format!("'{name}' on {r}"));
        }
    }

    check(ctx.allreduce_grads(SUM), "second step");
    for name in ["w_grad", "late_grad"] {
        let refs: Vec<&Buf> = before[name].iter().collect();
        let want = reference_allreduce(&refs, SUM);
        for r in 0..n {
            assert_same_bytes(m.buf(name, r), &want, &format!("'{name}' on {r}"));
        }
    }
    // The plan was rebuilt: the new GRAD is reduced first (registered last).
    let json = ctx.describe_json();
    let first = &json["buckets"][0]["tensors"][0];
    assert_eq!(
        first.as_str(),
        Some("late_grad"),
        "buckets: {}",
        json["buckets"]
    );
}

#[test]
fn unregistered_tensors_are_ignored() {
    let n = 3;
    let ctx = Context::host(n, Some(GIB));
    let mut m = Model::new(n);
    m.add("bn_mean", COMPUTED, DType::F32, 4, 1);
    m.add("g1", GRAD, DType::F32, 5, 2);
    m.add("g2", GRAD, DType::F32, 6, 3);
    m.add("p", PARAM, DType::F32, 2, 4);
    m.register_all(&ctx);

    check(ctx.unregister("bn_mean"), "unregister bn_mean");
    check(ctx.unregister("g1"), "unregister g1");
    let before = m.snapshot();

    check(
        ctx.average(COMPUTED),
        "average(COMPUTED) with no COMPUTED tensor",
    );
    check(
        ctx.broadcast(COMPUTED, 0),
        "broadcast(COMPUTED) with no COMPUTED tensor",
    );
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let refs: Vec<&Buf> = before["g2"].iter().collect();
    let want = reference_allreduce(&refs, SUM);
    for name in ["bn_mean", "g1", "p"] {
        for (r, pre) in before[name].iter().enumerate() {
            assert_same_bytes(m.buf(name, r), pre, &format!("'{name}' on {r} untouched"));
        }
    }
    for r in 0..n {
        assert_same_bytes(m.buf("g2", r), &want, "g2");
    }
    assert_eq!(ctx.allreduce("bn_mean", AVG), NOT_FOUND);
    assert!(last_error().contains("bn_mean"), "{}", last_error());
    assert_eq!(ctx.unregister("g1"), NOT_FOUND, "second unregister");

    let json = ctx.describe_json();
    let listed: Vec<&str> = json["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["tensors"].as_array().unwrap())
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(listed, vec!["g2"], "only g2 is left");

    // Unregister removed the name from every replica: registering it again on replica 0 only
    // makes it inconsistent (not silently paired with the old registrations).
    {
        let (role, bufs) = m.tensors.get_mut("bn_mean").unwrap();
        ctx.reg_buf("bn_mean", *role, 0, &mut bufs[0]);
    }
    let st = ctx.average(COMPUTED);
    expect_err(st, INCONSISTENT, &["'bn_mean'", "replica 1"]);
    check(ctx.unregister("bn_mean"), "unregister bn_mean again");

    // A name may come back with new memory after unregister (no CONFLICT).
    let mut fresh: Vec<Buf> = (0..n)
        .map(|r| Buf::random(DType::F32, 5, 77 + r as u64))
        .collect();
    for (r, b) in fresh.iter_mut().enumerate() {
        ctx.reg_buf("g1", GRAD, r, b);
    }
    let before_fresh = fresh.clone();
    let before_g1 = m.snapshot()["g1"].clone();
    check(
        ctx.allreduce_grads(SUM),
        "allreduce_grads with re-registered g1",
    );
    let refs: Vec<&Buf> = before_fresh.iter().collect();
    let want = reference_allreduce(&refs, SUM);
    for r in 0..n {
        assert_same_bytes(&fresh[r], &want, "new g1 buffer");
        assert_same_bytes(m.buf("g1", r), &before_g1[r], "old g1 buffer untouched");
    }
}
