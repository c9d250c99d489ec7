//! Ranks that leave a world (`dpsync_leave`, uneven inputs) and elastic worlds' creation
//! (built with `--features mpi` only), under `mpirun -n 2` and `-n 3`, through shared memory
//! and over MPI messages, rank r with 1 + r % 2 host replicas:
//!
//! - the last rank leaves at the others' `allreduce_grads`: they finish it over the remaining
//!   replicas, renumbered and recounted (rank, world replicas, loss scale, epoch), and go on
//!   with a broadcast; the leaver refuses collectives and still answers queries;
//! - rank 0 leaves while the others' buckets were started early by `dpsync_grad_ready`;
//! - several ranks leave at once; every rank leaves;
//! - elastic worlds: options that differ between ranks are INCONSISTENT naming "elastic",
//!   more min_ranks than ranks INVALID_ARGUMENT, and on an MPI without ULFM UNAVAILABLE.
#![cfg(feature = "mpi")]
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod context;
    pub mod mpi;
    pub mod skip;
}

use std::path::Path;
use std::ptr;

use common::mpi::{as_rank, launch, under_mpirun};
use common::{abi::*, context::*};

use dpsync::*;

#[test]
fn ranks_leave_and_the_others_go_on() {
    if under_mpirun() {
        return; // a rank runs leave_body only
    }
    for n in [2, 3] {
        launch("leave_body", n, 240, None);
        launch(
            "leave_body",
            n,
            240,
            Some(("DPSYNC_MPI_SHM", Path::new("0"))),
        );
    }
}

fn replicas_of(rank: usize) -> usize {
    1 + rank % 2
}

fn options(local: usize) -> Options {
    let o = Options::host(local);
    // A hang fails within seconds, not at a world's 10-minute default.
    o.set_timeout_ms(30_000);
    // Two buckets of g's tensors, so that marks start one early.
    o.set_fusion_bytes(64);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    check(
        unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
        "set_world_mpi",
    );
    o
}

fn place(ctx: &Context) -> (usize, usize, usize, usize) {
    let (mut rank, mut ranks, mut total, mut offset) = (0, 0, 0, 0);
    // SAFETY: a live context and valid out pointers.
    unsafe {
        check(dpsync_rank(ctx.0, &mut rank, &mut ranks), "rank");
        check(
            dpsync_world_replicas(ctx.0, &mut total, &mut offset),
            "world_replicas",
        );
    }
    (rank, ranks, total, offset)
}

fn epoch(ctx: &Context) -> (u64, usize) {
    let (mut epoch, mut first) = (99u64, 99usize);
    // SAFETY: as above.
    check(
        unsafe { dpsync_world_epoch(ctx.0, &mut epoch, &mut first) },
        "world_epoch",
    );
    (epoch, first)
}

fn leave(ctx: &Context) -> dpsync_status {
    // SAFETY: a live context.
    unsafe { dpsync_leave(ctx.0) }
}

/// Gradients "a" (16 floats, bucket 1) and "b" (16 floats, bucket 0), world replica `w` holding
/// `w + 1` in a and `10 (w + 1)` in b; a PARAM "p" holding `w`.
struct Model {
    a: Vec<Vec<f32>>,
    b: Vec<Vec<f32>>,
    p: Vec<Vec<f32>>,
}

impl Model {
    fn new(ctx: &Context, local: usize, offset: usize) -> Box<Model> {
        let mut m = Box::new(Model {
            a: (0..local)
                .map(|k| vec![(offset + k + 1) as f32; 16])
                .collect(),
            b: (0..local)
                .map(|k| vec![10.0 * (offset + k + 1) as f32; 16])
                .collect(),
            p: (0..local).map(|k| vec![(offset + k) as f32; 4]).collect(),
        });
        for k in 0..local {
            ctx.reg("a", GRAD, k, &mut m.a[k], F32);
            ctx.reg("b", GRAD, k, &mut m.b[k], F32);
            ctx.reg("p", PARAM, k, &mut m.p[k], F32);
        }
        m
    }

    /// The gradients as at the start, for another step.
    fn reset(&mut self, offset: usize) {
        for k in 0..self.a.len() {
            self.a[k].fill((offset + k + 1) as f32);
            self.b[k].fill(10.0 * (offset + k + 1) as f32);
        }
    }

    /// Every replica's gradients: the sums over the creation world replicas `staying`.
    fn expect_sums(&self, staying: &[usize], tag: &str) {
        let sum: f32 = staying.iter().map(|&w| (w + 1) as f32).sum();
        for k in 0..self.a.len() {
            assert!(
                self.a[k].iter().all(|&x| x == sum),
                "{tag}: a[{k}] {:?}",
                self.a[k]
            );
            let b = 10.0 * sum;
            assert!(
                self.b[k].iter().all(|&x| x == b),
                "{tag}: b[{k}] {:?}",
                self.b[k]
            );
        }
    }
}

/// The world replicas (at creation) of the ranks not in `gone`.
fn staying(ranks: usize, gone: &[usize]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut w = 0;
    for r in 0..ranks {
        for _ in 0..replicas_of(r) {
            if !gone.contains(&r) {
                out.push(w);
            }
            w += 1;
        }
    }
    out
}

#[test]
fn leave_body() {
    let Some((rank, ranks)) = as_rank("leave_body") else {
        return;
    };
    let local = replicas_of(rank);
    let offset: usize = (0..rank).map(replicas_of).sum();
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");

    // 1. The last rank leaves at the others' allreduce_grads.
    let ctx = Context::new(&options(local));
    let m = Model::new(&ctx, local, offset);
    assert_eq!(epoch(&ctx), (0, rank), "{}", tag("epoch at creation"));
    let last = ranks - 1;
    if rank == last {
        assert_eq!(leave(&ctx), OK, "{}: {}", tag("leave"), last_error());
        assert_eq!(
            ctx.allreduce_grads(SUM),
            INVALID_STATE,
            "{}",
            tag("after leaving")
        );
        assert!(last_error().contains("left its world"), "{}", last_error());
        assert_eq!(leave(&ctx), INVALID_STATE, "{}", tag("leaving twice"));
        assert_eq!(place(&ctx).0, rank, "{}", tag("queries still answer"));
        assert_eq!(epoch(&ctx), (1, rank), "{}", tag("the leaver's epoch"));
        let world = &ctx.describe_json()["world"];
        assert_eq!(
            world["left"],
            serde_json::json!([last]),
            "{}",
            tag("describe")
        );
        drop(ctx);
    } else {
        assert_eq!(
            ctx.allreduce_grads(SUM),
            OK,
            "{}: {}",
            tag("step"),
            last_error()
        );
        m.expect_sums(&staying(ranks, &[last]), &tag("sums without the leaver"));
        let (r, n, total, off) = place(&ctx);
        let remaining: usize = (0..last).map(replicas_of).sum();
        assert_eq!(
            (r, n, total, off),
            (rank, last, remaining, offset),
            "{}",
            tag("place")
        );
        assert_eq!(
            ctx.loss_scale(),
            1.0 / remaining as f64,
            "{}",
            tag("loss scale")
        );
        assert_eq!(epoch(&ctx), (1, rank), "{}", tag("epoch"));
        let world = &ctx.describe_json()["world"];
        assert_eq!(world["epoch"], 1, "{}", tag("describe epoch"));
        assert_eq!(
            world["left"],
            serde_json::json!([last]),
            "{}",
            tag("describe left")
        );
        assert_eq!(world["elastic"], 0, "{}", tag("describe elastic"));
        // The world goes on: world replica 0's params everywhere.
        assert_eq!(
            ctx.broadcast(PARAM, 0),
            OK,
            "{}: {}",
            tag("broadcast"),
            last_error()
        );
        assert!(
            m.p.iter().all(|p| p.iter().all(|&x| x == 0.0)),
            "{}",
            tag("params")
        );
        // The world replica index past the remaining ones is out of range now.
        assert_eq!(
            ctx.broadcast(PARAM, remaining),
            INVALID_ARGUMENT,
            "{}",
            tag("root")
        );
        drop(ctx);
    }
    drop(m);

    // 2. Rank 0 leaves while the others started buckets early (marks on every replica).
    let ctx = Context::new(&options(local));
    let mut m = Model::new(&ctx, local, offset);
    if rank == 0 {
        assert_eq!(
            leave(&ctx),
            OK,
            "{}: {}",
            tag("leave with marks"),
            last_error()
        );
    } else {
        for k in 0..local {
            assert_eq!(
                ctx.grad_ready("b", k),
                OK,
                "{}: {}",
                tag("mark"),
                last_error()
            );
        }
        assert_eq!(
            ctx.allreduce_grads(SUM),
            OK,
            "{}: {}",
            tag("step"),
            last_error()
        );
        m.expect_sums(&staying(ranks, &[0]), &tag("sums without rank 0"));
        assert_eq!(place(&ctx).0, rank - 1, "{}", tag("renumbered"));
        // The next step, marked again, runs in the smaller world.
        m.reset(offset);
        for k in 0..local {
            assert_eq!(
                ctx.grad_ready("b", k),
                OK,
                "{}: {}",
                tag("mark 2"),
                last_error()
            );
        }
        assert_eq!(
            ctx.allreduce_grads(SUM),
            OK,
            "{}: {}",
            tag("step 2"),
            last_error()
        );
        m.expect_sums(&staying(ranks, &[0]), &tag("second step"));
    }
    drop(ctx);
    drop(m);

    // 3. Every rank but the middle one leaves at once (with 2 ranks: both leave).
    let ctx = Context::new(&options(local));
    let m = Model::new(&ctx, local, offset);
    if ranks == 3 && rank == 1 {
        assert_eq!(
            ctx.allreduce_grads(SUM),
            OK,
            "{}: {}",
            tag("alone"),
            last_error()
        );
        m.expect_sums(&staying(ranks, &[0, 2]), &tag("sums of one rank"));
        assert_eq!(place(&ctx).1, 1, "{}", tag("a world of one"));
        assert_eq!(epoch(&ctx), (1, 1), "{}", tag("epoch"));
    } else {
        assert_eq!(
            leave(&ctx),
            OK,
            "{}: {}",
            tag("leave together"),
            last_error()
        );
    }
    drop(ctx);
    drop(m);

    // 4. Every rank leaves: the world ends, every dpsync_leave is OK.
    let ctx = Context::new(&options(local));
    assert_eq!(leave(&ctx), OK, "{}: {}", tag("all leave"), last_error());
    assert_eq!(epoch(&ctx), (1, rank), "{}", tag("epoch after all left"));
    drop(ctx);

    elastic_creation(rank, ranks, local);
}

/// Elastic worlds' creation: what every rank gets for bad or unsupported options.
fn elastic_creation(rank: usize, ranks: usize, local: usize) {
    let create = |min_ranks: usize| {
        let o = options(local);
        // SAFETY: valid options.
        check(
            unsafe { dpsync_options_set_elastic(o.0, min_ranks) },
            "set_elastic",
        );
        let mut p = ptr::null_mut();
        // SAFETY: valid options and out pointer.
        let st = unsafe { dpsync_context_create(o.0, &mut p) };
        if !p.is_null() {
            // SAFETY: made just now.
            unsafe { dpsync_context_destroy(p) };
        }
        (st, last_error())
    };
    let (st, msg) = create(1 + rank);
    assert_eq!(st, INCONSISTENT, "rank {rank}: differing min_ranks: {msg}");
    assert!(msg.contains("elastic"), "rank {rank}: {msg}");
    let (st, msg) = create(ranks + 1);
    assert_eq!(
        st, INVALID_ARGUMENT,
        "rank {rank}: too many min_ranks: {msg}"
    );
    assert!(msg.contains("min_ranks"), "rank {rank}: {msg}");
    let (st, msg) = create(1);
    assert_eq!(st, UNAVAILABLE, "rank {rank}: elastic: {msg}");
    assert!(
        msg.contains("User-Level Failure Mitigation"),
        "rank {rank}: {msg}"
    );
}
