//! BMUF through the C ABI: dpsync_bmuf_init / dpsync_bmuf_step against an independent
//! double-precision reference of the formula (the one `Backend::bmuf_update` documents), Caffe2's own
//! assertion for two replicas, restart by a second init, every bad input, and the rule for
//! PARAM tensors registered or unregistered after init.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
}

use common::{abi::*, buf::*, context::*, errors::*, float16::*, lcg::*, reference::*};

// ------------------------------------------------------------------ reference and helpers

/// The paper's filter for one tensor, in f64, written from the formula alone.
struct Reference {
    w: Vec<f64>,
    d: Vec<f64>,
    mu: f64,
    eta: f64,
    nesterov: bool,
}

impl Reference {
    fn new(start: Vec<f64>, mu: f64, eta: f64, nesterov: bool) -> Reference {
        Reference {
            d: vec![0.0; start.len()],
            w: start,
            mu,
            eta,
            nesterov,
        }
    }

    /// One block given the replicas' mean `a`; returns the params every replica must hold.
    fn step(&mut self, a: &[f64]) -> Vec<f64> {
        let look = if self.nesterov { self.mu } else { 0.0 };
        (0..a.len())
            .map(|i| {
                let wg = self.w[i] + look * self.d[i];
                let g = a[i] - wg;
                self.d[i] = self.mu * self.d[i] + self.eta * g;
                self.w[i] += self.d[i];
                self.w[i] + look * self.d[i]
            })
            .collect()
    }
}

fn to_f64(b: &Buf) -> Vec<f64> {
    match b {
        Buf::F32(v) => v.iter().map(|x| *x as f64).collect(),
        Buf::F64(v) => v.clone(),
        Buf::F16(v) => v.iter().map(|x| f16_to_f32(*x) as f64).collect(),
        Buf::BF16(v) => v.iter().map(|x| bf16_to_f32(*x) as f64).collect(),
        Buf::I32(_) | Buf::I64(_) => panic!("not a float buffer"),
    }
}

/// Stores `v` rounded to the buffer's type, in place (the registered pointer stays valid).
fn store(b: &mut Buf, v: &[f64]) {
    match b {
        Buf::F32(x) => x.iter_mut().zip(v).for_each(|(x, v)| *x = *v as f32),
        Buf::F64(x) => x.copy_from_slice(v),
        Buf::F16(x) => x
            .iter_mut()
            .zip(v)
            .for_each(|(x, v)| *x = f32_to_f16(*v as f32)),
        Buf::BF16(x) => x
            .iter_mut()
            .zip(v)
            .for_each(|(x, v)| *x = f32_to_bf16(*v as f32)),
        Buf::I32(_) | Buf::I64(_) => panic!("not a float buffer"),
    }
}

/// Distance allowed between the library's params and the f64 reference: f32 and f64 state
/// round at every operation (a few units in the last place over a handful of blocks); half
/// params are additionally rounded once to their type.
fn tolerance(dtype: DType, got: f64, want: f64) -> f64 {
    let ulp = |x: f64, mantissa_bits: i32, min_exp: i32| {
        let e = if x == 0.0 {
            min_exp
        } else {
            (x.abs().log2().floor() as i32).max(min_exp)
        };
        2f64.powi(e - mantissa_bits)
    };
    let state = 4e-6 * (1.0 + want.abs());
    match dtype {
        DType::F32 => state,
        DType::F64 => 1e-13 * (1.0 + want.abs()),
        DType::F16 => ulp(got.abs().max(want.abs()), 10, -14) + state,
        DType::BF16 => ulp(got.abs().max(want.abs()), 7, -126) + state,
        DType::I32 | DType::I64 => unreachable!(),
    }
}

#[track_caller]
fn assert_close(dtype: DType, got: &[f64], want: &[f64], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = tolerance(dtype, *g, *w);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g:e}, reference {w:e} (|diff| {:e} > {tol:e})",
            (g - w).abs()
        );
    }
}

/// PARAM tensors on `n` host replicas, registered through the C ABI.
struct Model {
    ctx: Context,
    n: usize,
    /// (name, per-replica buffers)
    tensors: Vec<(String, Vec<Buf>)>,
}

impl Model {
    /// Every replica starts from different values, so that init's broadcast is visible.
    fn new(n: usize, fusion: Option<usize>, specs: &[(&str, DType, usize)], seed: u64) -> Model {
        let ctx = Context::host(n, fusion);
        let mut g = Lcg::new(seed);
        let mut tensors = Vec::new();
        for (name, dtype, count) in specs {
            let mut bufs: Vec<Buf> = (0..n)
                .map(|_| {
                    let mut b = Buf::zeros(*dtype, *count);
                    let v: Vec<f64> = (0..*count).map(|_| g.uniform(-2.0, 2.0)).collect();
                    store(&mut b, &v);
                    b
                })
                .collect();
            for (r, b) in bufs.iter_mut().enumerate() {
                ctx.reg_buf(name, PARAM, r, b);
            }
            tensors.push((name.to_string(), bufs));
        }
        Model { ctx, n, tensors }
    }

    fn snapshot(&self) -> Vec<Vec<Buf>> {
        self.tensors.iter().map(|t| t.1.clone()).collect()
    }

    #[track_caller]
    fn assert_unchanged(&self, before: &[Vec<Buf>], what: &str) {
        for ((name, bufs), pre) in self.tensors.iter().zip(before) {
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                assert_same_bytes(b, p, &format!("{what}: '{name}' on replica {r} changed"));
            }
        }
    }

    #[track_caller]
    fn assert_replicas_identical(&self, what: &str) {
        for (name, bufs) in &self.tensors {
            for (r, b) in bufs.iter().enumerate().skip(1) {
                assert_same_bytes(b, &bufs[0], &format!("{what}: '{name}' replica {r} vs 0"));
            }
        }
    }

    /// Local training: every replica moves every element by its own amount (different scale
    /// and bias per replica), rounded to the param type.
    fn drift(&mut self, g: &mut Lcg) {
        for (_, bufs) in &mut self.tensors {
            for (r, b) in bufs.iter_mut().enumerate() {
                let scale = 0.05 * (r + 1) as f64;
                let bias = 0.02 * r as f64 - 0.01;
                let v: Vec<f64> = to_f64(b)
                    .into_iter()
                    .map(|x| x + scale * g.uniform(-1.0, 1.0) + bias)
                    .collect();
                store(b, &v);
            }
        }
    }

    /// `A` for tensor `t`: the mean over replicas as the averaging collective stores it. For
    /// f32/f64 the exact mean (the collective's own rounding is far inside the tolerance); f16
    /// and bf16 params can only hold the mean rounded to their type, which is what the filter
    /// then reads (docs/API.md), so that rounding is part of the reference.
    fn mean(&self, t: usize) -> Vec<f64> {
        let bufs = &self.tensors[t].1;
        match bufs[0].dtype() {
            DType::F16 | DType::BF16 => {
                to_f64(&reference_allreduce(&bufs.iter().collect::<Vec<_>>(), AVG))
            }
            _ => {
                let vals: Vec<Vec<f64>> = bufs.iter().map(to_f64).collect();
                (0..vals[0].len())
                    .map(|i| vals.iter().map(|v| v[i]).sum::<f64>() / self.n as f64)
                    .collect()
            }
        }
    }

    /// Starts one reference per tensor from replica 0's current values.
    fn references(&self, mu: f64, eta: f64, nesterov: bool) -> Vec<Reference> {
        self.tensors
            .iter()
            .map(|(_, bufs)| Reference::new(to_f64(&bufs[0]), mu, eta, nesterov))
            .collect()
    }

    /// `blocks` rounds of drift + dpsync_bmuf_step, each checked against the references.
    #[track_caller]
    fn run_blocks(&mut self, refs: &mut [Reference], blocks: usize, g: &mut Lcg, label: &str) {
        for block in 0..blocks {
            self.drift(g);
            let means: Vec<Vec<f64>> = (0..self.tensors.len()).map(|t| self.mean(t)).collect();
            check(self.ctx.bmuf_step(), &format!("{label}: bmuf_step {block}"));
            let what = format!("{label}, block {block}");
            self.assert_replicas_identical(&what);
            for (t, (name, bufs)) in self.tensors.iter().enumerate() {
                let want = refs[t].step(&means[t]);
                let dtype = bufs[0].dtype();
                assert_close(
                    dtype,
                    &to_f64(&bufs[0]),
                    &want,
                    &format!("{what}, '{name}'"),
                );
            }
        }
    }
}

/// A tensor of 60 000 elements touches over 1 MiB per step: the host backend threads it.
const SHAPES: [(&str, usize); 4] = [("fc_b", 3), ("fc_w", 700), ("conv", 1030), ("big", 60_000)];

/// N = 1..4, classical and Nesterov, default and explicit constants, small and default fusion
/// buckets, for the given dtypes (one tensor of each shape per dtype).
fn reference_matrix(dtypes: &[DType], seed: u64) {
    let mut case = 0;
    for n in 1..=4 {
        for nesterov in [false, true] {
            // (block_lr, block_momentum as passed, momentum the library must use)
            let default = 1.0 - 1.0 / n as f64;
            for (eta, mu_arg, mu) in [(1.0, -1.0, default), (0.8, 0.6, 0.6)] {
                case += 1;
                let fusion = if case % 2 == 0 { Some(4096) } else { None };
                let names: Vec<String> = dtypes
                    .iter()
                    .flat_map(|d| SHAPES.iter().map(move |(s, _)| format!("{s}_{}", d.name())))
                    .collect();
                let specs: Vec<(&str, DType, usize)> = dtypes
                    .iter()
                    .flat_map(|d| SHAPES.iter().map(move |(_, c)| (*d, *c)))
                    .zip(&names)
                    .map(|((d, c), name)| (name.as_str(), d, c))
                    .collect();
                let mut m = Model::new(n, fusion, &specs, seed + case);
                let mut refs = m.references(mu, eta, nesterov);
                let label = format!(
                    "N={n} nesterov={nesterov} block_lr={eta} block_momentum={mu_arg} fusion={fusion:?}"
                );
                check(m.ctx.bmuf_init(eta, mu_arg, nesterov), &label);
                let json = m.ctx.describe_json();
                assert_eq!(
                    json["bmuf"]["block_momentum"], mu,
                    "{label}: resolved momentum"
                );
                m.assert_replicas_identical(&format!("{label}: after init"));
                let mut g = Lcg::new(seed * 31 + case);
                m.run_blocks(&mut refs, 5, &mut g, &label);
            }
        }
    }
}

// ------------------------------------------------------------------ the formula

#[test]
fn f32_params_follow_the_double_precision_reference() {
    reference_matrix(&[DType::F32], 100);
}

#[test]
fn bf16_params_follow_the_double_precision_reference() {
    reference_matrix(&[DType::BF16], 200);
}

#[test]
fn mixed_float_types_in_one_model_follow_the_reference() {
    // f64 keeps f64 state; f16 and bf16 keep f32 state; buckets are per dtype.
    let specs = [
        ("a_f64", DType::F64, 2000),
        ("b_f16", DType::F16, 1500),
        ("c_f32", DType::F32, 900),
        ("d_bf16", DType::BF16, 700),
    ];
    for nesterov in [false, true] {
        let mut m = Model::new(3, Some(2048), &specs, 7);
        let mut refs = m.references(0.45, 1.2, nesterov);
        check(m.ctx.bmuf_init(1.2, 0.45, nesterov), "bmuf_init");
        let json = m.ctx.describe_json();
        // W and D: f64 for 2000 elements, f32 for the 3100 others.
        assert_eq!(
            json["bmuf"]["state_bytes_per_replica"],
            2 * (2000 * 8 + 3100 * 4)
        );
        assert_eq!(json["bmuf"]["tensors"], 4);
        let mut g = Lcg::new(8);
        m.run_blocks(&mut refs, 6, &mut g, &format!("mixed, nesterov={nesterov}"));
    }
}

#[test]
fn caffe2_assertion_two_replicas_default_momentum() {
    // Caffe2's data_parallel_model_test.test_parallelize_bmuf, with its exact equalities:
    //   v = 0.5 * v_prev + ((p0 + p1) / 2 - g_prev);  then p0 == p1 == g == g_prev + v.
    // Every operation there is the library's own in f32 (mu = 0.5 and eta = 1 are exact), so the
    // bytes must match exactly.
    let mut m = Model::new(
        2,
        None,
        &[("fc_w", DType::F32, 16), ("fc_b", DType::F32, 1)],
        42,
    );
    check(m.ctx.bmuf_init(1.0, -1.0, false), "bmuf_init");
    let f32s = |b: &Buf| match b {
        Buf::F32(v) => v.clone(),
        _ => unreachable!(),
    };
    let mut g_prev: Vec<Vec<f32>> = m.tensors.iter().map(|t| f32s(&t.1[0])).collect();
    let mut v_prev: Vec<Vec<f32>> = g_prev.iter().map(|g| vec![0.0; g.len()]).collect();
    let mut rng = Lcg::new(3);
    for block in 0..4 {
        m.drift(&mut rng);
        let before: Vec<(Vec<f32>, Vec<f32>)> = m
            .tensors
            .iter()
            .map(|t| (f32s(&t.1[0]), f32s(&t.1[1])))
            .collect();
        check(m.ctx.bmuf_step(), "bmuf_step");
        for (t, (name, bufs)) in m.tensors.iter().enumerate() {
            let (p0, p1) = &before[t];
            let v: Vec<f32> = (0..p0.len())
                .map(|i| 0.5 * v_prev[t][i] + ((p0[i] + p1[i]) / 2.0 - g_prev[t][i]))
                .collect();
            let g: Vec<f32> = (0..v.len()).map(|i| g_prev[t][i] + v[i]).collect();
            for (r, b) in bufs.iter().enumerate() {
                assert_same_bytes(
                    b,
                    &Buf::F32(g.clone()),
                    &format!("block {block}: '{name}' on replica {r} vs the global model"),
                );
            }
            v_prev[t] = v;
            g_prev[t] = g;
        }
    }
}

#[test]
fn init_broadcasts_replica_0_and_a_second_init_restarts_the_filter() {
    let specs = [("w", DType::F32, 300), ("e", DType::BF16, 200)];
    let mut m = Model::new(3, None, &specs, 11);
    let replica0 = m.snapshot();
    check(m.ctx.bmuf_init(1.0, -1.0, true), "bmuf_init");
    for (t, (name, bufs)) in m.tensors.iter().enumerate() {
        for (r, b) in bufs.iter().enumerate() {
            assert_same_bytes(
                b,
                &replica0[t][0],
                &format!("'{name}' on replica {r} after init"),
            );
        }
    }
    let mut refs = m.references(2.0 / 3.0, 1.0, true);
    let mut g = Lcg::new(12);
    m.run_blocks(&mut refs, 3, &mut g, "first filter");

    // Warm-up over: the replicas drift apart, then init again with other constants. The new
    // filter starts from replica 0's current params with D = 0, forgetting the old momentum.
    m.drift(&mut g);
    let replica0 = m.snapshot();
    check(m.ctx.bmuf_init(0.9, 0.3, false), "second bmuf_init");
    for (t, (name, bufs)) in m.tensors.iter().enumerate() {
        for (r, b) in bufs.iter().enumerate() {
            assert_same_bytes(
                b,
                &replica0[t][0],
                &format!("'{name}' replica {r} after re-init"),
            );
        }
    }
    let mut refs = m.references(0.3, 0.9, false);
    m.run_blocks(&mut refs, 3, &mut g, "restarted filter");
    assert_eq!(m.ctx.describe_json()["bmuf"]["block_momentum"], 0.3);
}

// ------------------------------------------------------------------ bad input

#[test]
fn bmuf_step_before_init_is_invalid_state_and_changes_nothing() {
    let m = Model::new(3, None, &[("w", DType::F32, 10)], 1);
    let before = m.snapshot();
    expect_err(m.ctx.bmuf_step(), INVALID_STATE, &["dpsync_bmuf_init"]);
    m.assert_unchanged(&before, "bmuf_step before init");
    assert!(m.ctx.describe_json().get("bmuf").is_none());
}

#[test]
fn no_param_registered_is_invalid_state() {
    let ctx = Context::host(2, None);
    expect_err(ctx.bmuf_init(1.0, -1.0, false), INVALID_STATE, &["PARAM"]);
    expect_err(ctx.bmuf_step(), INVALID_STATE, &["dpsync_bmuf_init"]);
    // Other roles do not count.
    let mut g: Vec<Vec<f32>> = vec![vec![1.0; 4], vec![2.0; 4]];
    for (r, b) in g.iter_mut().enumerate() {
        ctx.reg("g", GRAD, r, b, F32);
    }
    expect_err(ctx.bmuf_init(1.0, -1.0, false), INVALID_STATE, &["PARAM"]);
    expect_err(ctx.bmuf_step(), INVALID_STATE, &[]);
    assert_eq!(g, vec![vec![1.0; 4], vec![2.0; 4]]);
}

#[test]
fn bad_constants_are_invalid_arguments_naming_them_and_change_nothing() {
    let mut m = Model::new(3, None, &[("w", DType::F32, 10), ("e", DType::BF16, 7)], 2);
    let cases = [
        (0.0, 0.5, "block_lr"),
        (-1.0, 0.5, "block_lr"),
        (f64::NAN, 0.5, "block_lr"),
        (f64::INFINITY, 0.5, "block_lr"),
        (f64::NEG_INFINITY, 0.5, "block_lr"),
        (1.0, 1.0, "block_momentum"),
        (1.0, 1.5, "block_momentum"),
        (1.0, f64::NAN, "block_momentum"),
        (1.0, f64::INFINITY, "block_momentum"),
    ];
    let before = m.snapshot();
    for (lr, mu, argument) in cases {
        for nesterov in [false, true] {
            let st = m.ctx.bmuf_init(lr, mu, nesterov);
            expect_err(st, INVALID_ARGUMENT, &[argument]);
            // The replicas hold different params: a broadcast would show.
            m.assert_unchanged(&before, &format!("bmuf_init({lr}, {mu})"));
            expect_err(m.ctx.bmuf_step(), INVALID_STATE, &["dpsync_bmuf_init"]);
        }
    }
    // -inf is a negative momentum like any other (the contract's "< 0 selects the default").
    check(
        m.ctx.bmuf_init(1.0, f64::NEG_INFINITY, false),
        "bmuf_init(1, -inf)",
    );
    assert_eq!(
        m.ctx.describe_json()["bmuf"]["block_momentum"],
        1.0 - 1.0 / 3.0
    );
    // A failed init leaves a running filter as it was.
    check(m.ctx.bmuf_init(1.0, 0.5, true), "bmuf_init");
    let mut refs = m.references(0.5, 1.0, true);
    let mut g = Lcg::new(5);
    m.run_blocks(&mut refs, 2, &mut g, "before the failed re-init");
    let before = m.snapshot();
    expect_err(
        m.ctx.bmuf_init(1.0, 2.0, false),
        INVALID_ARGUMENT,
        &["block_momentum"],
    );
    m.assert_unchanged(&before, "failed re-init");
    m.run_blocks(&mut refs, 2, &mut g, "after the failed re-init");

    // NULL context.
    let st = unsafe { dpsync::dpsync_bmuf_init(std::ptr::null_mut(), 1.0, -1.0, false) };
    expect_err(st, INVALID_ARGUMENT, &["context is NULL"]);
    let st = unsafe { dpsync::dpsync_bmuf_step(std::ptr::null_mut()) };
    expect_err(st, INVALID_ARGUMENT, &["context is NULL"]);
}

#[test]
fn integer_and_inconsistent_params_are_refused_by_init() {
    // An integer PARAM: INVALID_ARGUMENT naming it, before anything is broadcast.
    let m = Model::new(2, None, &[("w", DType::F32, 8)], 3);
    let mut counter: Vec<Vec<i32>> = vec![vec![1, 2], vec![3, 4]];
    for (r, c) in counter.iter_mut().enumerate() {
        m.ctx.reg("step_count", PARAM, r, c, I32);
    }
    let before = m.snapshot();
    expect_err(
        m.ctx.bmuf_init(1.0, -1.0, false),
        INVALID_ARGUMENT,
        &["'step_count'", "i32"],
    );
    m.assert_unchanged(&before, "integer PARAM");
    assert_eq!(counter, vec![vec![1, 2], vec![3, 4]]);

    // A PARAM missing on a replica: INCONSISTENT naming it and the replica.
    let m = Model::new(3, None, &[("w", DType::F32, 8)], 4);
    let mut partial = [vec![0.5f32; 4], vec![1.5f32; 4]];
    for (r, p) in partial.iter_mut().enumerate() {
        m.ctx.reg("late", PARAM, r, p, F32);
    }
    let before = m.snapshot();
    expect_err(
        m.ctx.bmuf_init(1.0, -1.0, false),
        INCONSISTENT,
        &["'late'", "replica 2"],
    );
    m.assert_unchanged(&before, "inconsistent PARAM");
    assert_eq!(partial, [vec![0.5f32; 4], vec![1.5f32; 4]]);
}

// ------------------------------------------------------------------ registration after init

#[test]
fn params_registered_or_unregistered_after_init_stop_the_filter_until_init() {
    let mut m = Model::new(3, None, &[("w", DType::F32, 50), ("b", DType::BF16, 9)], 6);
    check(m.ctx.bmuf_init(1.0, -1.0, false), "bmuf_init");
    let mut refs = m.references(2.0 / 3.0, 1.0, false);
    let mut g = Lcg::new(7);
    m.run_blocks(&mut refs, 1, &mut g, "first block");

    // Tensors of other roles come and go freely.
    let mut grads: Vec<Vec<f32>> = vec![vec![0.0; 5]; 3];
    for (r, b) in grads.iter_mut().enumerate() {
        m.ctx.reg("w_grad", GRAD, r, b, F32);
    }
    m.run_blocks(&mut refs, 1, &mut g, "after registering a GRAD");

    // A new PARAM, registered on every replica: refused, nothing changes.
    let mut late: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32; 6]).collect();
    for (r, b) in late.iter_mut().enumerate() {
        m.ctx.reg("late", PARAM, r, b, F32);
    }
    m.drift(&mut g);
    let before = m.snapshot();
    expect_err(
        m.ctx.bmuf_step(),
        INVALID_STATE,
        &["'late'", "was registered", "dpsync_bmuf_init"],
    );
    m.assert_unchanged(&before, "step with a new PARAM");
    assert_eq!(late[2], vec![2.0; 6]);
    // Half-registered, it is INCONSISTENT like for every collective.
    check(m.ctx.unregister("late"), "unregister late");
    m.ctx.reg("late", PARAM, 0, &mut late[0], F32);
    expect_err(m.ctx.bmuf_step(), INCONSISTENT, &["'late'"]);
    m.assert_unchanged(&before, "step with a half-registered PARAM");
    // Gone again: the PARAM set is the one init took, so the filter goes on where it was.
    check(m.ctx.unregister("late"), "unregister late");
    let means: Vec<Vec<f64>> = (0..2).map(|t| m.mean(t)).collect();
    check(m.ctx.bmuf_step(), "bmuf_step after unregistering 'late'");
    for (t, (name, bufs)) in m.tensors.iter().enumerate() {
        let want = refs[t].step(&means[t]);
        assert_close(bufs[0].dtype(), &to_f64(&bufs[0]), &want, name);
    }
    m.assert_replicas_identical("after unregistering 'late'");

    // An original PARAM unregistered, then registered on other memory: refused both times.
    check(m.ctx.unregister("b"), "unregister b");
    expect_err(
        m.ctx.bmuf_step(),
        INVALID_STATE,
        &["'b'", "was unregistered"],
    );
    let mut moved: Vec<Buf> = m.tensors[1].1.clone();
    for (r, buf) in moved.iter_mut().enumerate() {
        m.ctx.reg_buf("b", PARAM, r, buf);
    }
    let before = m.snapshot();
    expect_err(
        m.ctx.bmuf_step(),
        INVALID_STATE,
        &["'b'", "registered again", "dpsync_bmuf_init"],
    );
    m.assert_unchanged(&before, "step after moving 'b'");

    // Init again: the filter restarts over the new set.
    m.tensors[1].1 = moved;
    check(
        m.ctx.bmuf_init(1.0, 0.25, true),
        "bmuf_init after the change",
    );
    let mut refs = m.references(0.25, 1.0, true);
    m.run_blocks(&mut refs, 2, &mut g, "after re-init");

    // Every PARAM unregistered: the step has nothing to filter, and init has nothing to start.
    check(m.ctx.unregister("w"), "unregister w");
    check(m.ctx.unregister("b"), "unregister b");
    expect_err(m.ctx.bmuf_step(), INVALID_STATE, &["was unregistered"]);
    expect_err(m.ctx.bmuf_init(1.0, -1.0, false), INVALID_STATE, &["PARAM"]);
}
