//! A world survives bad input on one rank (built with `--features mpi` only): three ways a
//! world used to time out, fail for good or change data while returning an error, each as a
//! user's program meets it, under `mpirun -n 2` and `-n 3` with uneven replica counts (rank r
//! has 1 + r % 2 host replicas):
//!
//! - arguments refused at the C boundary on one rank (an invalid op, a NULL name, invalid
//!   roles, a NaN block_lr) still take part in the agreement: that rank gets its own
//!   INVALID_ARGUMENT, the others INCONSISTENT naming it, nothing changes, the world goes on;
//! - buckets `dpsync_grad_ready` started early on some ranks only (uneven marks, or a rank whose
//!   registrations changed since the last step), in a step with a sparse gradient, complete;
//! - sparse gradients sharing an indices buffer on one rank and holding copies on another, and
//!   empty slices passed as NULL on one rank and as pointers on another, gather alike; a step
//!   that fails after buckets started early under AVG leaves every gradient as it was.
#![cfg(feature = "mpi")]
// Per-replica buffers indexed by local replica: indexed loops read best.
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod context;
    pub mod mpi;
    pub mod skip;
    pub mod sparse;
}

use std::ptr;

use common::mpi::{as_rank, launch, under_mpirun};
use common::{abi::*, context::*};

use dpsync::*;

#[test]
fn one_ranks_bad_input_fails_every_rank_and_the_world_goes_on() {
    if under_mpirun() {
        return; // a rank runs agreement_body only
    }
    for n in [2, 3] {
        launch("agreement_body", n, 240, None);
    }
}

/// This rank's place in the world: (rank, ranks, local replicas, offset, world replicas).
struct Place {
    rank: usize,
    ranks: usize,
    local: usize,
    offset: usize,
    total: usize,
}

impl Place {
    fn tag(&self, what: &str) -> String {
        format!("rank {}/{}: {what}", self.rank, self.ranks)
    }
}

fn replicas_of(rank: usize) -> usize {
    1 + rank % 2
}

#[test]
fn agreement_body() {
    let Some((rank, ranks)) = as_rank("agreement_body") else {
        return;
    };
    let at = Place {
        rank,
        ranks,
        local: replicas_of(rank),
        offset: (0..rank).map(replicas_of).sum(),
        total: (0..ranks).map(replicas_of).sum(),
    };
    refused_arguments_join_the_agreement(&at);
    uneven_early_buckets_with_a_sparse_gradient(&at);
    sparse_index_buffers_may_differ_between_ranks(&at);
    shards_across_ranks(&at);
}

fn world_context(local: usize) -> Context {
    let o = Options::host(local);
    // A hang fails within seconds, not at a world's 10-minute default.
    o.set_timeout_ms(20_000);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    check(
        unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
        "set_world_mpi",
    );
    Context::new(&o)
}

/// Every rank's status and message of one collective where only the last rank passed `bad`
/// arguments: its own INVALID_ARGUMENT naming `argument`, INCONSISTENT naming it elsewhere.
fn expect_refused(at: &Place, st: dpsync_status, case: &str, argument: &str) {
    let msg = last_error();
    let last = at.ranks - 1;
    if at.rank == last {
        assert_eq!(st, INVALID_ARGUMENT, "{}: {msg}", at.tag(case));
        assert!(msg.contains(argument), "{}: {msg}", at.tag(case));
    } else {
        assert_eq!(st, INCONSISTENT, "{}: {msg}", at.tag(case));
        assert!(
            msg.contains(&format!("rank {last}")) && msg.contains("INVALID_ARGUMENT"),
            "{}: {msg}",
            at.tag(case)
        );
    }
}

fn refused_arguments_join_the_agreement(at: &Place) {
    let ctx = world_context(at.local);
    let mut g: Vec<Vec<f32>> = (0..at.local)
        .map(|k| vec![(at.offset + k + 1) as f32; 5])
        .collect();
    let mut w: Vec<Vec<f32>> = (0..at.local)
        .map(|k| vec![(at.offset + k) as f32; 3])
        .collect();
    let mut probe: Vec<Vec<i64>> = vec![vec![0; 2]; at.local];
    for k in 0..at.local {
        ctx.reg("g", GRAD, k, &mut g[k], F32);
        ctx.reg("w", PARAM, k, &mut w[k], F32);
        ctx.reg("probe", STATE, k, &mut probe[k], I64);
    }
    let (g0, w0) = (g.clone(), w.clone());
    let bad = at.rank == at.ranks - 1;
    let null_name = || unsafe { dpsync_allreduce(ctx.0, ptr::null(), SUM) };
    type Call<'a> = Box<dyn Fn() -> dpsync_status + 'a>;
    let cases: Vec<(&str, &str, Call, Call)> = vec![
        (
            "allreduce_grads op 7",
            "op",
            Box::new(|| ctx.allreduce_grads(7)),
            Box::new(|| ctx.allreduce_grads(SUM)),
        ),
        (
            "allreduce op 7",
            "op",
            Box::new(|| ctx.allreduce("g", 7)),
            Box::new(|| ctx.allreduce("g", SUM)),
        ),
        (
            "allreduce NULL name",
            "name",
            Box::new(null_name),
            Box::new(|| ctx.allreduce("g", SUM)),
        ),
        (
            "broadcast roles 0",
            "roles",
            Box::new(|| ctx.broadcast(0, 0)),
            Box::new(|| ctx.broadcast(PARAM, 0)),
        ),
        (
            "broadcast roles 0x10",
            "roles",
            Box::new(|| ctx.broadcast(0x10, 0)),
            Box::new(|| ctx.broadcast(PARAM, 0)),
        ),
        (
            "broadcast roles 0x80000001",
            "roles",
            Box::new(|| ctx.broadcast(0x8000_0001, 0)),
            Box::new(|| ctx.broadcast(PARAM, 0)),
        ),
        (
            "average roles 0x10",
            "roles",
            Box::new(|| ctx.average(0x10)),
            Box::new(|| ctx.average(PARAM)),
        ),
        (
            "bmuf_init block_lr NaN",
            "block_lr",
            Box::new(|| ctx.bmuf_init(f64::NAN, -1.0, false)),
            Box::new(|| ctx.bmuf_init(1.0, -1.0, false)),
        ),
    ];
    for (case, argument, bad_call, good_call) in &cases {
        let st = if bad { bad_call() } else { good_call() };
        expect_refused(at, st, case, argument);
        assert_eq!(g, g0, "{}", at.tag(&format!("{case}: gradients unchanged")));
        assert_eq!(w, w0, "{}", at.tag(&format!("{case}: params unchanged")));
        // The world goes on: the next collective works on every rank.
        for p in probe.iter_mut() {
            p.fill(1);
        }
        check(
            ctx.allreduce("probe", SUM),
            &at.tag(&format!("after {case}")),
        );
        for p in &probe {
            assert_eq!(p, &vec![at.total as i64; 2], "{}", at.tag(case));
        }
    }
}

/// Rows of world replica `r` of sparse gradient `emb`: `r % 3` rows (replica 0 has none).
fn rows_of(r: usize) -> Vec<i64> {
    (0..r % 3).map(|j| ((r + 2 * j) % 10) as i64).collect()
}

/// Sets this rank's slices of `emb` (row_len 1, each row's value `scale` × its world replica
/// + 1) and checks them after the step: every world replica's rows in world order.
struct Emb {
    indices: Vec<Vec<i64>>,
    values: Vec<Vec<f32>>,
}

impl Emb {
    fn new(at: &Place, scale: f32) -> Emb {
        let indices: Vec<Vec<i64>> = (0..at.local).map(|k| rows_of(at.offset + k)).collect();
        let values = (0..at.local)
            .map(|k| vec![scale * (at.offset + k + 1) as f32; indices[k].len()])
            .collect();
        Emb { indices, values }
    }

    fn set(&self, ctx: &Context, name: &str) {
        for k in 0..self.indices.len() {
            check(
                ctx.sparse_set(name, k, &self.indices[k], &self.values[k]),
                "sparse_set",
            );
        }
    }

    fn expect(at: &Place, ctx: &Context, name: &str, value: impl Fn(usize) -> f32) {
        let indices: Vec<i64> = (0..at.total).flat_map(rows_of).collect();
        let values: Vec<f32> = (0..at.total)
            .flat_map(|r| vec![value(r); rows_of(r).len()])
            .collect();
        for k in 0..at.local {
            let got = ctx.gathered(name, k);
            assert_eq!(got.indices::<i64>(), indices, "{}", at.tag(name));
            assert_eq!(got.values::<f32>(1), values, "{}", at.tag(name));
        }
    }
}

fn fill(g: &mut [Vec<f32>], at: &Place) {
    for (k, x) in g.iter_mut().enumerate() {
        x.fill((at.offset + k + 1) as f32);
    }
}

fn expect_all(g: &[Vec<f32>], value: f32, at: &Place, what: &str) {
    for x in g {
        assert!(
            x.iter().all(|&v| v == value),
            "{}: {x:?}, want {value}",
            at.tag(what)
        );
    }
}

fn uneven_early_buckets_with_a_sparse_gradient(at: &Place) {
    let ctx = world_context(at.local);
    let mut g: Vec<Vec<f32>> = vec![vec![0.0; 6]; at.local];
    for k in 0..at.local {
        ctx.reg("g", GRAD, k, &mut g[k], F32);
    }
    ctx.reg_sparse_all("emb", 1, F32, I64, 10);
    let sum = (at.total * (at.total + 1) / 2) as f32;
    let emb = Emb::new(at, 1.0);
    // Step 1 sets the op early buckets use; no marks.
    fill(&mut g, at);
    emb.set(&ctx, "emb");
    check(ctx.allreduce_grads(SUM), &at.tag("step 1"));
    expect_all(&g, sum, at, "step 1");
    // Marks on local replica 0 only: complete (started early) on one-replica ranks, not on the
    // others.
    for step in ["replica 0 marked", "a rank's registrations changed"] {
        fill(&mut g, at);
        if step == "a rank's registrations changed" {
            // Rank 0's registry changed since the last step, so it starts nothing early.
            if at.rank == 0 {
                let mut extra = vec![0f32; 3];
                ctx.reg("extra", STATE, 0, &mut extra, F32);
                check(ctx.unregister("extra"), "unregister");
            }
            for k in 0..at.local {
                check(ctx.grad_ready("g", k), "grad_ready");
            }
        } else {
            check(ctx.grad_ready("g", 0), "grad_ready");
        }
        emb.set(&ctx, "emb");
        check(ctx.allreduce_grads(SUM), &at.tag(step));
        expect_all(&g, sum, at, step);
        Emb::expect(at, &ctx, "emb", |r| (r + 1) as f32);
    }
    // The same under AVG (early buckets then average as well).
    let mean = sum / at.total as f32;
    let scaled = Emb::new(at, at.total as f32);
    for step in ["AVG, no marks", "AVG, replica 0 marked"] {
        fill(&mut g, at);
        if step.ends_with("marked") {
            check(ctx.grad_ready("g", 0), "grad_ready");
        }
        scaled.set(&ctx, "emb");
        check(ctx.allreduce_grads(AVG), &at.tag(step));
        expect_all(&g, mean, at, step);
        Emb::expect(at, &ctx, "emb", |r| (r + 1) as f32);
    }
}

fn sparse_index_buffers_may_differ_between_ranks(at: &Place) {
    let ctx = world_context(at.local);
    let mut g: Vec<Vec<f32>> = vec![vec![0.0; 4]; at.local];
    for k in 0..at.local {
        ctx.reg("g", GRAD, k, &mut g[k], F32);
    }
    ctx.reg_sparse_all("a", 1, F32, I64, 10);
    ctx.reg_sparse_all("b", 1, F32, I64, 10);
    let emb = Emb::new(at, 1.0);
    // Rank 0 passes one indices buffer for both, the others a copy each; empty slices are NULL
    // on rank 0 and pointers elsewhere.
    let copies = emb.indices.clone();
    let empty = [0i64; 1];
    let set = |name: &str, own: bool| {
        for k in 0..at.local {
            let rows = emb.indices[k].len();
            let indices = match (rows, at.rank, own) {
                (0, 0, _) => ptr::null(),
                (0, _, _) => empty.as_ptr(),
                (_, 0, _) | (_, _, false) => emb.indices[k].as_ptr(),
                _ => copies[k].as_ptr(),
            };
            let values = match rows {
                0 if at.rank == 0 => ptr::null(),
                0 => empty.as_ptr().cast(),
                _ => emb.values[k].as_ptr().cast(),
            };
            check(
                ctx.sparse_set_raw(name, k, indices.cast(), values, rows),
                "sparse_set",
            );
        }
    };
    for op in [SUM, AVG] {
        fill(&mut g, at);
        set("a", false);
        set("b", true);
        check(
            ctx.allreduce_grads(op),
            &at.tag("shared and copied indices"),
        );
        let divisor = if op == AVG { at.total as f32 } else { 1.0 };
        for name in ["a", "b"] {
            Emb::expect(at, &ctx, name, |r| (r + 1) as f32 / divisor);
        }
    }
    // The previous step was AVG: buckets marked now start early under AVG on one-replica ranks.
    // An index out of range on the last rank fails the step everywhere, and no gradient
    // changes (a failed step used to write the undivided sums of the early buckets).
    fill(&mut g, at);
    let before = g.clone();
    check(ctx.grad_ready("g", 0), "grad_ready");
    let last = at.ranks - 1;
    let mut bad = emb.indices.clone();
    if at.rank == last {
        bad = bad.into_iter().map(|_| vec![10]).collect();
    }
    for k in 0..at.local {
        let v = vec![1f32; bad[k].len()];
        check(ctx.sparse_set("a", k, &bad[k], &v), "sparse_set");
        check(ctx.sparse_set("b", k, &bad[k], &v), "sparse_set");
    }
    let st = ctx.allreduce_grads(AVG);
    let msg = last_error();
    assert_eq!(st, INCONSISTENT, "{}: {msg}", at.tag("index out of range"));
    assert_eq!(
        msg.contains(&format!("rank {last}")),
        at.rank != last,
        "{}: {msg}",
        at.tag("index out of range")
    );
    assert_eq!(
        g,
        before,
        "{}",
        at.tag("a failed step leaves every gradient")
    );
    Emb::expect(at, &ctx, "a", |r| (r + 1) as f32 / at.total as f32);
    // The next step works.
    set("a", false);
    set("b", true);
    check(ctx.allreduce_grads(AVG), &at.tag("the step after"));
    let mean = (at.total + 1) as f32 / 2.0;
    expect_all(&g, mean, at, "the step after");
}

/// Shards across ranks: reduce-scatter writes each world replica's piece only (exact sums of
/// small integers), allgather gives every replica the owners' pieces, and a rank calling
/// allreduce_grads (or an invalid op) while the others reduce-scatter fails every rank with
/// nothing changed.
fn shards_across_ranks(at: &Place) {
    let ctx = world_context(at.local);
    let n = 11;
    let mut g: Vec<Vec<f32>> = vec![vec![0.0; n]; at.local];
    let mut p: Vec<Vec<f32>> = vec![vec![0.0; n]; at.local];
    for k in 0..at.local {
        ctx.reg("g", GRAD, k, &mut g[k], F32);
        ctx.reg("p", PARAM, k, &mut p[k], F32);
    }
    let piece = |w: usize| (n * w / at.total, n * (w + 1) / at.total);
    let grads = |g: &mut Vec<Vec<f32>>| {
        for (k, x) in g.iter_mut().enumerate() {
            for (i, v) in x.iter_mut().enumerate() {
                *v = (at.offset + k + 1 + i) as f32;
            }
        }
    };
    grads(&mut g);
    let before = g.clone();
    // Another call, then an invalid op, on the last rank: every rank fails, nothing changes.
    let last = at.rank == at.ranks - 1;
    for (case, other) in [("allreduce_grads", SUM), ("op 7", 7)] {
        let st = match (last, case) {
            (true, "allreduce_grads") => ctx.allreduce_grads(other),
            (true, _) => unsafe { dpsync_reduce_scatter_grads(ctx.0, other) },
            (false, _) => unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) },
        };
        let want = if last && case == "op 7" {
            INVALID_ARGUMENT
        } else {
            INCONSISTENT
        };
        assert_eq!(st, want, "{}: {}", at.tag(case), last_error());
        assert_eq!(g, before, "{}", at.tag(case));
    }
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) },
        &at.tag("reduce-scatter"),
    );
    let world_sum = |i: usize| (1..=at.total).map(|w| (w + i) as f32).sum::<f32>();
    for k in 0..at.local {
        let (lo, hi) = piece(at.offset + k);
        for i in 0..n {
            let want = if (lo..hi).contains(&i) {
                world_sum(i)
            } else {
                before[k][i]
            };
            assert_eq!(
                g[k][i],
                want,
                "{}",
                at.tag(&format!("g[{i}] on replica {k}"))
            );
        }
        for i in lo..hi {
            p[k][i] = ((at.offset + k) * 100 + i) as f32;
        }
    }
    // SAFETY: a live context.
    check(
        unsafe { dpsync_allgather(ctx.0, PARAM) },
        &at.tag("allgather"),
    );
    let owner = |i: usize| (0..at.total).find(|&w| (piece(w).0..piece(w).1).contains(&i));
    for x in &p {
        for (i, &v) in x.iter().enumerate() {
            assert_eq!(
                v,
                (owner(i).unwrap() * 100 + i) as f32,
                "{}",
                at.tag("allgather")
            );
        }
    }
}
