//! Port of Caffe2's data_parallel_model_test equivalence check: the same small model (a 2-layer
//! MLP on synthetic data, four PARAM and four GRAD tensors registered in forward order) trained
//! with SGD on 1, 2, 4 and 8 host replicas. The global batch is split across replicas, each local
//! loss is scaled by dpsync_loss_scale and gradients are SUMmed by dpsync_allreduce_grads. The
//! final weights must be close to the 1-replica run, bytewise identical on every replica, bytewise
//! identical whatever fusion_bytes is, and identical run after run.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod close;
    pub mod context;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
}

use common::{abi::*, buf::*, close::*, context::*, lcg::*, reference::*};

const D: usize = 6; // inputs
const H: usize = 5; // hidden units
const GLOBAL_BATCH: usize = 16;
const STEPS: usize = 30;
const LR: f32 = 0.1;

const PARAM_NAMES: [&str; 4] = ["fc1_w", "fc1_b", "fc2_w", "fc2_b"];
const GRAD_NAMES: [&str; 4] = ["fc1_w_grad", "fc1_b_grad", "fc2_w_grad", "fc2_b_grad"];
const SHAPES: [usize; 4] = [H * D, H, H, 1];

/// One replica's tensors: params and grads in forward order.
struct Replica {
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
}

impl Replica {
    fn new(seed: u64) -> Self {
        let mut g = Lcg::new(seed);
        let params = SHAPES
            .iter()
            .map(|&n| (0..n).map(|_| g.uniform(-0.5, 0.5) as f32).collect())
            .collect();
        let grads = SHAPES.iter().map(|&n| vec![0.0f32; n]).collect();
        Replica { params, grads }
    }
}

/// The global batch of step `step`: GLOBAL_BATCH inputs and targets.
fn batch(step: usize) -> (Vec<[f32; D]>, Vec<f32>) {
    let mut g = Lcg::new(1000 + step as u64);
    let mut xs = Vec::new();
    let mut ts = Vec::new();
    for _ in 0..GLOBAL_BATCH {
        let mut x = [0f32; D];
        for v in x.iter_mut() {
            *v = g.uniform(-1.0, 1.0) as f32;
        }
        let t = x[0].sin() + 0.5 * x[1] - 0.3 * x[2] * x[3] + 0.1;
        xs.push(x);
        ts.push(t);
    }
    (xs, ts)
}

/// Forward pass for one sample: hidden activations and output.
fn forward(p: &[Vec<f32>], x: &[f32; D]) -> ([f32; H], f32) {
    let mut h = [0f32; H];
    for (j, hj) in h.iter_mut().enumerate() {
        let mut z = p[1][j];
        for (k, xk) in x.iter().enumerate() {
            z += p[0][j * D + k] * xk;
        }
        *hj = z.tanh();
    }
    let mut y = p[3][0];
    for (j, hj) in h.iter().enumerate() {
        y += p[2][j] * hj;
    }
    (h, y)
}

/// Mean squared error / 2 over a batch (for the sanity check that training learns).
fn loss(p: &[Vec<f32>], xs: &[[f32; D]], ts: &[f32]) -> f32 {
    let s: f32 = xs
        .iter()
        .zip(ts)
        .map(|(x, t)| {
            let (_, y) = forward(p, x);
            0.5 * (y - t) * (y - t)
        })
        .sum();
    s / xs.len() as f32
}

/// Writes d(scale * sum of 0.5 (y - t)^2 over the samples)/d(params) into `grads`.
fn backward(p: &[Vec<f32>], grads: &mut [Vec<f32>], xs: &[[f32; D]], ts: &[f32], scale: f32) {
    for g in grads.iter_mut() {
        g.iter_mut().for_each(|v| *v = 0.0);
    }
    for (x, t) in xs.iter().zip(ts) {
        let (h, y) = forward(p, x);
        let dy = (y - t) * scale;
        grads[3][0] += dy;
        for j in 0..H {
            grads[2][j] += dy * h[j];
            let dz = dy * p[2][j] * (1.0 - h[j] * h[j]);
            grads[1][j] += dz;
            for k in 0..D {
                grads[0][j * D + k] += dz * x[k];
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Cfg {
    replicas: usize,
    fusion: Option<usize>,
    /// SUM with losses scaled by dpsync_loss_scale, or AVG with unscaled losses.
    op: u32,
}

struct Outcome {
    /// Final params of every replica.
    params: Vec<Vec<Vec<f32>>>,
    initial_loss: f32,
    final_loss: f32,
}

fn train(cfg: Cfg) -> Outcome {
    let n = cfg.replicas;
    let ctx = Context::host(n, cfg.fusion);
    assert_eq!(ctx.replica_count(), n);
    let loss_scale = ctx.loss_scale();
    assert_eq!(loss_scale, 1.0 / n as f64, "loss_scale for {n} replicas");

    // Replica 0 has the model everyone must start from; the others are initialised differently
    // (as a framework's per-device init would) and must be overwritten by the broadcast.
    let mut reps: Vec<Replica> = (0..n)
        .map(|r| Replica::new(if r == 0 { 1 } else { 100 + r as u64 }))
        .collect();
    let init0 = reps[0].params.clone();

    // Forward order: each layer's param, then its grad.
    for (r, rep) in reps.iter_mut().enumerate() {
        for i in 0..4 {
            ctx.reg(PARAM_NAMES[i], PARAM, r, &mut rep.params[i], F32);
            ctx.reg(GRAD_NAMES[i], GRAD, r, &mut rep.grads[i], F32);
        }
    }
    check(ctx.broadcast(PARAM, 0), "broadcast params");
    for (r, rep) in reps.iter().enumerate() {
        assert_eq!(rep.params, init0, "replica {r} after the initial broadcast");
    }

    let (x0, t0) = batch(0);
    let initial_loss = loss(&reps[0].params, &x0, &t0);

    let local = GLOBAL_BATCH / n;
    let scale = if cfg.op == SUM {
        (loss_scale as f32) / local as f32
    } else {
        1.0 / local as f32
    };
    for step in 0..STEPS {
        let (xs, ts) = batch(step);
        for (r, rep) in reps.iter_mut().enumerate() {
            let rng = r * local..(r + 1) * local;
            let p = rep.params.clone();
            backward(&p, &mut rep.grads, &xs[rng.clone()], &ts[rng], scale);
        }
        // Exact expectation: every element summed over replicas in replica order.
        let want: Vec<Buf> = (0..4)
            .map(|i| {
                let ins: Vec<Buf> = reps.iter().map(|r| Buf::F32(r.grads[i].clone())).collect();
                let refs: Vec<&Buf> = ins.iter().collect();
                reference_allreduce(&refs, cfg.op)
            })
            .collect();
        check(ctx.allreduce_grads(cfg.op), "allreduce_grads");
        for (r, rep) in reps.iter().enumerate() {
            for i in 0..4 {
                assert_same_bytes(
                    &Buf::F32(rep.grads[i].clone()),
                    &want[i],
                    &format!("step {step}: '{}' on replica {r}", GRAD_NAMES[i]),
                );
            }
        }
        for rep in reps.iter_mut() {
            for i in 0..4 {
                let g = rep.grads[i].clone();
                for (w, gv) in rep.params[i].iter_mut().zip(g) {
                    *w -= LR * gv;
                }
            }
        }
    }
    for (r, rep) in reps.iter().enumerate().skip(1) {
        for (i, name) in PARAM_NAMES.iter().enumerate() {
            assert_eq!(
                f32_bytes(&rep.params[i]),
                f32_bytes(&reps[0].params[i]),
                "final '{name}' on replica {r} differs from replica 0 ({n} replicas)"
            );
        }
    }
    let final_loss = loss(&reps[0].params, &x0, &t0);
    drop(ctx);
    Outcome {
        params: reps.into_iter().map(|r| r.params).collect(),
        initial_loss,
        final_loss,
    }
}

fn assert_close_to(single: &Outcome, multi: &Outcome, what: &str) {
    for (i, name) in PARAM_NAMES.iter().enumerate() {
        assert_allclose(
            &multi.params[0][i],
            &single.params[0][i],
            1e-4,
            1e-5,
            &format!("{what}: '{name}'"),
        );
    }
}

fn bytes_of(o: &Outcome) -> Vec<Vec<u8>> {
    o.params[0].iter().map(|p| f32_bytes(p)).collect()
}

#[test]
fn single_replica_training_learns() {
    let o = train(Cfg {
        replicas: 1,
        fusion: None,
        op: SUM,
    });
    assert!(
        o.final_loss < 0.5 * o.initial_loss,
        "training should reduce the loss: {} -> {}",
        o.initial_loss,
        o.final_loss
    );
}

#[test]
fn sum_of_scaled_losses_matches_single_replica_for_every_fusion_size() {
    let single = train(Cfg {
        replicas: 1,
        fusion: None,
        op: SUM,
    });
    for n in [2, 4, 8] {
        let mut per_fusion: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
        for fusion in [None, Some(0), Some(16), Some(GIB)] {
            let what = format!("{n} replicas, fusion {fusion:?}");
            let o = train(Cfg {
                replicas: n,
                fusion,
                op: SUM,
            });
            assert!(o.final_loss < 0.5 * o.initial_loss, "{what}: did not learn");
            assert_close_to(&single, &o, &what);
            per_fusion.push((what, bytes_of(&o)));
        }
        // Fusion only changes how tensors are packed, never the per-element summation order.
        for (what, b) in &per_fusion[1..] {
            assert_eq!(
                b, &per_fusion[0].1,
                "{what} differs from {}",
                per_fusion[0].0
            );
        }
    }
}

#[test]
fn avg_of_unscaled_losses_matches_single_replica() {
    let single = train(Cfg {
        replicas: 1,
        fusion: None,
        op: SUM,
    });
    for n in [2, 4, 8] {
        for fusion in [Some(0), Some(16), Some(GIB)] {
            let o = train(Cfg {
                replicas: n,
                fusion,
                op: AVG,
            });
            assert_close_to(
                &single,
                &o,
                &format!("AVG, {n} replicas, fusion {fusion:?}"),
            );
        }
    }
}

#[test]
fn same_inputs_give_same_bytes_run_after_run() {
    for (n, fusion) in [(2, Some(0)), (4, Some(16)), (8, Some(GIB)), (8, None)] {
        let cfg = Cfg {
            replicas: n,
            fusion,
            op: SUM,
        };
        let a = bytes_of(&train(cfg));
        for run in 1..3 {
            let b = bytes_of(&train(cfg));
            assert_eq!(a, b, "run {run} with {n} replicas, fusion {fusion:?}");
        }
    }
}

/// The multi-replica runs really are different from "no reduction at all": a replica that trained
/// only on its own shard would end elsewhere, so the equality checks above are meaningful.
#[test]
fn multi_replica_differs_from_training_on_one_shard() {
    let multi = train(Cfg {
        replicas: 4,
        fusion: Some(16),
        op: SUM,
    });
    let mut shard = Replica::new(1);
    for step in 0..STEPS {
        let (xs, ts) = batch(step);
        let p = shard.params.clone();
        backward(&p, &mut shard.grads, &xs[0..4], &ts[0..4], 0.25);
        for i in 0..4 {
            let g = shard.grads[i].clone();
            for (w, gv) in shard.params[i].iter_mut().zip(g) {
                *w -= LR * gv;
            }
        }
    }
    let differs = (0..4).any(|i| {
        shard.params[i]
            .iter()
            .zip(&multi.params[0][i])
            .any(|(a, b)| (a - b).abs() > 1e-3)
    });
    assert!(
        differs,
        "4-replica training must use every replica's gradients"
    );
}
