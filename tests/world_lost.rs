//! Elastic worlds that lose ranks (built with `--features mpi` only; run under an Open MPI with
//! User-Level Failure Mitigation named by `DPSYNC_ULFM`, else skipped): 3 ranks, rank r with
//! 1 + r % 2 host replicas, elastic with min_ranks 2.
//!
//! - every rank starts its gradient buckets early (`dpsync_grad_ready`; one of 100 000 floats
//!   crosses the ring over MPI messages), then the last rank kills itself (SIGKILL) instead of
//!   its second `allreduce_grads`: every
//!   survivor gets RANK_LOST naming it, the world is renumbered and recounted (rank, world
//!   replicas, loss scale, epoch, describe's "lost"), and the redo sums exactly the survivors'
//!   replicas, AVG dividing by their count;
//! - then, while both survivors alternate steps and broadcasts (through shared memory by
//!   default, whose waits watch the peers' processes), a thread kills rank 1 at a moment of its
//!   own: rank 0 alone is fewer than min_ranks, so it gets RANK_LOST naming rank 1 and its
//!   context is failed (INVALID_STATE after), its PARAM untouched.
//!
//! Both with and without `DPSYNC_MPI_SHM=0`.
//!
//! A mark learns of a loss (`mark_body`): `dpsync_grad_ready` that would start a bucket after
//! the world failed answers RANK_LOST itself, and the world goes on.
//!
//! And nothing half-written (`kept_body`): while the ranks alternate `broadcast`, `average`
//! and `bmuf_step` over a PARAM of 1 MiB per replica, a thread kills rank 2 at a moment of its
//! own. Every survivor's call answers alike: OK with every replica's new bytes, or RANK_LOST
//! with every replica's bytes as before the call; the survivors lost it at the same call; and
//! the redone `bmuf_step` matches a model of the filter that never saw the interrupted step.
//!
//! Sparse gathers' outputs through a loss: tests/world_lost_parts/sparse.rs.
#![cfg(feature = "mpi")]
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod context;
    pub mod mpi;
    pub mod skip;
    pub mod sparse;
}

use common::mpi::{as_rank, launch_ulfm, ulfm_venv, under_mpirun};
use common::{abi::*, context::*};

use dpsync::*;

const RANK_LOST: dpsync_status = dpsync_status::DPSYNC_STATUS_RANK_LOST;

#[test]
fn a_lost_rank_and_the_others_go_on() {
    if under_mpirun() {
        return; // a rank runs lost_body only
    }
    let Some(venv) = ulfm_venv("a_lost_rank_and_the_others_go_on") else {
        return;
    };
    // Rank 2 dies, then rank 1: rank 0 alone passes to the end.
    launch_ulfm("lost_body", 3, 300, &venv, &[], 1);
    launch_ulfm("lost_body", 3, 300, &venv, &[("DPSYNC_MPI_SHM", "0")], 1);
}

#[test]
fn a_loss_mid_call_leaves_nothing_half_written() {
    if under_mpirun() {
        return; // a rank runs kept_body only
    }
    let Some(venv) = ulfm_venv("a_loss_mid_call_leaves_nothing_half_written") else {
        return;
    };
    launch_ulfm("kept_body", 3, 300, &venv, &[], 2);
    launch_ulfm("kept_body", 3, 300, &venv, &[("DPSYNC_MPI_SHM", "0")], 2);
}

#[test]
fn a_mark_learns_of_a_loss() {
    if under_mpirun() {
        return; // a rank runs mark_body only
    }
    let Some(venv) = ulfm_venv("a_mark_learns_of_a_loss") else {
        return;
    };
    launch_ulfm("mark_body", 2, 300, &venv, &[], 1);
    launch_ulfm("mark_body", 2, 300, &venv, &[("DPSYNC_MPI_SHM", "0")], 1);
}

/// `dpsync_grad_ready` answers RANK_LOST itself (2 ranks, rank 0 with 2 replicas, rank 1 with
/// 1, min_ranks 1): after a step of both, rank 1 dies; rank 0 marks "b" (the first bucket),
/// which starts early and cannot cross; once its engine says so (describe's world "failed",
/// polled: bounded by the launcher's limit only), marking "a" on its last replica, which would
/// start the next bucket, answers RANK_LOST naming rank 1. The world is then rank 0's alone
/// (epoch 1, describe's "lost"), and the step made again sums its replicas.
#[test]
fn mark_body() {
    let Some((rank, ranks)) = as_rank("mark_body") else {
        return;
    };
    assert_eq!(ranks, 2, "mark_body runs on 2 ranks");
    let (local, tag) = (2 - rank, |what: &str| format!("rank {rank}: {what}"));
    let o = Options::world_of_ranks(local, 120_000);
    o.set_elastic(1);
    let ctx = Context::new(&o);
    // World replica w holds w + 1 in "a", 10 (w + 1) in "b" (rank 0: 0 and 1; rank 1: 2).
    let mut a = vec![vec![0f32; 16]; local];
    let mut b = vec![vec![0f32; 16]; local];
    for k in 0..local {
        ctx.reg("a", GRAD, k, &mut a[k], F32);
        ctx.reg("b", GRAD, k, &mut b[k], F32);
    }
    let reset = |a: &mut Vec<Vec<f32>>, b: &mut Vec<Vec<f32>>| {
        for k in 0..local {
            let w = (2 * rank + k + 1) as f32;
            a[k].fill(w);
            b[k].fill(10.0 * w);
        }
    };
    let expect = |a: &[Vec<f32>], b: &[Vec<f32>], sum: f32, what: &str| {
        for k in 0..local {
            assert!(
                a[k].iter().all(|&x| x == sum),
                "{}: a {:?}",
                tag(what),
                a[k]
            );
            let b_sum = 10.0 * sum;
            assert!(
                b[k].iter().all(|&x| x == b_sum),
                "{}: b {:?}",
                tag(what),
                b[k]
            );
        }
    };
    reset(&mut a, &mut b);
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(st, OK, "{}: {}", tag("first step"), last_error());
    expect(&a, &b, 6.0, "first step");
    if rank == 1 {
        die();
    }
    reset(&mut a, &mut b);
    for k in 0..local {
        let st = ctx.grad_ready("b", k);
        assert_eq!(st, OK, "{}: {}", tag("mark b"), last_error());
    }
    while world_of(&ctx)["failed"].is_null() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let st = ctx.grad_ready("a", 0);
    assert_eq!(st, OK, "{}: {}", tag("mark a on replica 0"), last_error());
    let st = ctx.grad_ready("a", 1);
    let msg = last_error();
    assert_eq!(st, RANK_LOST, "{}: {msg}", tag("the mark that starts a"));
    assert!(msg.contains("rank 1"), "{}: {msg}", tag("names rank 1"));
    assert_eq!(place(&ctx), (0, 1, 2, 0), "{}", tag("renumbered"));
    assert_eq!(epoch(&ctx), 1, "{}", tag("epoch"));
    let lost = &world_of(&ctx)["lost"];
    assert_eq!(*lost, serde_json::json!([1]), "{}", tag("describe lost"));
    // The step made again, its gradients computed again: over rank 0's replicas.
    reset(&mut a, &mut b);
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(st, OK, "{}: {}", tag("the step again"), last_error());
    expect(&a, &b, 3.0, "the step again");
    drop(ctx);
    println!("\nSURVIVED mark_body");
}

fn replicas_of(rank: usize) -> usize {
    1 + rank % 2
}

fn options(local: usize) -> Options {
    // Generous: the busy machine must not make a survivor time out.
    let o = Options::world_of_ranks(local, 120_000);
    o.set_elastic(2);
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

fn epoch(ctx: &Context) -> u64 {
    let (mut epoch, mut first) = (99u64, 99usize);
    // SAFETY: as above.
    check(
        unsafe { dpsync_world_epoch(ctx.0, &mut epoch, &mut first) },
        "world_epoch",
    );
    epoch
}

fn world_of(ctx: &Context) -> serde_json::Value {
    ctx.describe_json()["world"].clone()
}

fn die() -> ! {
    // SAFETY: ends this process at once, as a crash would (no MPI_Finalize, no destructor).
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL returned");
}

/// Gradients "a" and "b" (16 floats each, two buckets), world replica `w` (at creation)
/// holding `w + 1` and `10 (w + 1)`; a PARAM "p" holding `w`.
struct Model {
    a: Vec<Vec<f32>>,
    b: Vec<Vec<f32>>,
    /// Large enough for the ring over MPI messages (not the agreement's inline data).
    c: Vec<Vec<f32>>,
    p: Vec<Vec<f32>>,
    offset: usize,
}

impl Model {
    fn new(ctx: &Context, local: usize, offset: usize) -> Box<Model> {
        let mut m = Box::new(Model {
            a: vec![Vec::new(); local],
            b: vec![Vec::new(); local],
            c: vec![Vec::new(); local],
            p: (0..local).map(|k| vec![(offset + k) as f32; 4]).collect(),
            offset,
        });
        m.reset();
        for k in 0..local {
            ctx.reg("a", GRAD, k, &mut m.a[k], F32);
            ctx.reg("b", GRAD, k, &mut m.b[k], F32);
            ctx.reg("c", GRAD, k, &mut m.c[k], F32);
            ctx.reg("p", PARAM, k, &mut m.p[k], F32);
        }
        m
    }

    /// The gradients computed again (in place: their registrations stay valid).
    fn reset(&mut self) {
        for k in 0..self.a.len() {
            let w = (self.offset + k + 1) as f32;
            self.a[k].resize(16, 0.0);
            self.b[k].resize(16, 0.0);
            self.c[k].resize(C_LEN, 0.0);
            self.a[k].fill(w);
            self.b[k].fill(10.0 * w);
            self.c[k].fill(100.0 * w);
        }
    }

    /// Every replica's gradients: the sum over the creation world replicas `from`, divided by
    /// `divisor`.
    fn expect(&self, from: &[usize], divisor: f32, tag: &str) {
        let sum: f32 = from.iter().map(|&w| (w + 1) as f32).sum::<f32>() / divisor;
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

const C_LEN: usize = 100_000;

/// The world replicas (at creation) of ranks `0..ranks`.
fn replicas_below(ranks: usize) -> Vec<usize> {
    (0..(0..ranks).map(replicas_of).sum()).collect()
}

#[test]
fn lost_body() {
    let Some((rank, ranks)) = as_rank("lost_body") else {
        return;
    };
    assert_eq!(ranks, 3, "lost_body runs on 3 ranks");
    let local = replicas_of(rank);
    let offset: usize = (0..rank).map(replicas_of).sum();
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let ctx = Context::new(&options(local));
    let world = &ctx.describe_json()["world"];
    assert_eq!(world["elastic"], 2, "{}", tag("describe elastic"));
    let mut m = Model::new(&ctx, local, offset);

    // 1. A step of all three ranks.
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(st, OK, "{}: {}", tag("first step"), last_error());
    m.expect(&replicas_below(3), 1.0, &tag("first step"));

    // 2. Every rank starts its buckets early (the progress thread moves them), then rank 2
    //    dies instead of its step: the others get RANK_LOST naming it.
    m.reset();
    for name in ["a", "b", "c"] {
        for k in 0..local {
            let st = ctx.grad_ready(name, k);
            assert_eq!(st, OK, "{}: {}", tag("grad_ready"), last_error());
        }
    }
    if rank == 2 {
        die();
    }
    // Figures, not assertions (docs/PERFORMANCE.md): the ranks left step 1 together, so this
    // call starts about when rank 2 dies.
    let started = std::time::Instant::now();
    let st = ctx.allreduce_grads(SUM);
    let detected = started.elapsed();
    let msg = last_error();
    assert_eq!(st, RANK_LOST, "{}: {msg}", tag("step with rank 2 dead"));
    assert!(
        msg.contains("rank 2"),
        "{}: {msg}",
        tag("names the lost rank")
    );
    let remaining = replicas_below(2);
    assert_eq!(
        place(&ctx),
        (rank, 2, remaining.len(), offset),
        "{}",
        tag("renumbered")
    );
    assert_eq!(epoch(&ctx), 1, "{}", tag("epoch"));
    assert_eq!(
        ctx.loss_scale(),
        1.0 / remaining.len() as f64,
        "{}",
        tag("loss scale")
    );
    let world = &ctx.describe_json()["world"];
    assert_eq!(
        world["lost"],
        serde_json::json!([2]),
        "{}",
        tag("describe lost")
    );
    assert_eq!(world["epoch"], 1, "{}", tag("describe epoch"));

    // 3. The redo, then an AVG step: over the survivors' replicas exactly.
    m.reset();
    let st = ctx.allreduce_grads(SUM);
    let redone = started.elapsed();
    assert_eq!(st, OK, "{}: {}", tag("redo"), last_error());
    m.expect(&remaining, 1.0, &tag("redo"));
    println!(
        "rank {rank}: RANK_LOST {:.1} ms after the step began, the redo done at {:.1} ms",
        detected.as_secs_f64() * 1e3,
        redone.as_secs_f64() * 1e3
    );
    m.reset();
    let st = ctx.allreduce_grads(AVG);
    assert_eq!(st, OK, "{}: {}", tag("AVG"), last_error());
    m.expect(&remaining, remaining.len() as f32, &tag("AVG recounted"));

    // 4. Rank 1 dies at a moment of its own (a thread kills it 50 ms on) while both ranks
    //    alternate steps and broadcasts, so the loss may come in any part of a call (the
    //    agreement, pieces through shared memory or over MPI, the vote): rank 0 alone is fewer
    //    than min_ranks 2.
    let shm = world_of(&ctx)["shared_memory"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let shm_wanted = std::env::var("DPSYNC_MPI_SHM").map_or(true, |v| v != "0");
    assert_eq!(
        shm.starts_with("on"),
        shm_wanted,
        "{}: {shm}",
        tag("shared memory")
    );
    if rank == 1 {
        std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            die();
        });
    }
    let mut st = OK;
    for i in 0..100_000 {
        m.reset();
        st = match i % 2 {
            0 => ctx.allreduce_grads(SUM),
            _ => ctx.broadcast(PARAM, 0),
        };
        if st != OK {
            break;
        }
        if i % 2 == 0 {
            m.expect(&remaining, 1.0, &tag("a step before the loss"));
        }
    }
    if rank == 1 {
        die(); // not reached: the thread killed it first (100 000 calls last seconds)
    }
    let msg = last_error();
    assert_eq!(st, RANK_LOST, "{}: {msg}", tag("calls with rank 1 dying"));
    assert!(msg.contains("rank 1"), "{}: {msg}", tag("names rank 1"));
    assert!(
        msg.contains("min_ranks"),
        "{}: {msg}",
        tag("below min_ranks")
    );
    assert!(m.p[0].iter().all(|&x| x == 0.0), "{}", tag("PARAM kept"));
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(
        st,
        INVALID_STATE,
        "{}: {}",
        tag("failed context"),
        last_error()
    );
    let world = &ctx.describe_json()["world"];
    assert_eq!(
        world["lost"],
        serde_json::json!([1, 2]),
        "{}",
        tag("describe lost")
    );
    drop(ctx);
    println!("SURVIVED lost_body");
}

/// Elements of `kept_body`'s PARAM (f64): 1 MiB per replica, so that a call's data is in flight
/// for a while.
const Q_LEN: usize = 131_072;

/// `kept_body`'s PARAM value on world replica `w` (at creation) before call `i`.
fn q_value(i: usize, w: usize) -> f64 {
    ((i % 7) * 8 + w + 1) as f64
}

/// BMUF's filter as the backend computes it (block_lr 1, block_momentum 0.5, no Nesterov):
/// `w`, `d` after a step over the mean `a`.
fn bmuf_model(w: &mut f64, d: &mut f64, a: f64) {
    let g = a - *w;
    *d = 0.5 * *d + g;
    *w += *d;
}

fn close(x: f64, want: f64) -> bool {
    (x - want).abs() <= 1e-9 * want.abs().max(1.0)
}

#[test]
fn kept_body() {
    let Some((rank, ranks)) = as_rank("kept_body") else {
        return;
    };
    assert_eq!(ranks, 3, "kept_body runs on 3 ranks");
    let local = replicas_of(rank);
    let offset: usize = (0..rank).map(replicas_of).sum();
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let ctx = Context::new(&options(local));
    let mut q: Vec<Vec<f64>> = (0..local)
        .map(|k| vec![q_value(0, offset + k); Q_LEN])
        .collect();
    let mut n: Vec<Vec<f32>> = vec![vec![0.0]; local];
    for k in 0..local {
        ctx.reg("q", PARAM, k, &mut q[k], F64);
        ctx.reg("n", COMPUTED, k, &mut n[k], F32);
    }
    let st = ctx.bmuf_init(1.0, 0.5, false);
    assert_eq!(st, OK, "{}: {}", tag("bmuf_init"), last_error());
    let (mut w, mut d) = (q_value(0, 0), 0.0);
    let mut present = replicas_below(3);
    if rank == 2 {
        std::thread::spawn(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |t| t.subsec_nanos());
            std::thread::sleep(std::time::Duration::from_micros(
                1_000 + (nanos % 40_000) as u64,
            ));
            die();
        });
    }
    let mean = |i: usize, from: &[usize]| {
        from.iter().map(|&v| q_value(i, v)).sum::<f64>() / from.len() as f64
    };
    let mut lost_at = None;
    for i in 1..100_000 {
        for k in 0..local {
            q[k].fill(q_value(i, offset + k));
        }
        let (st, what) = match i % 3 {
            0 => (ctx.broadcast(PARAM, 0), "broadcast"),
            1 => (ctx.average(PARAM), "average"),
            _ => (ctx.bmuf_step(), "bmuf_step"),
        };
        let want = match st {
            OK if what == "broadcast" => q_value(i, 0),
            OK if what == "average" => mean(i, &present),
            OK => {
                bmuf_model(&mut w, &mut d, mean(i, &present));
                w
            }
            RANK_LOST => f64::NAN,
            other => panic!("{}: {other:?}: {}", tag(what), last_error()),
        };
        for k in 0..local {
            let kept = q_value(i, offset + k);
            let want = if st == OK { want } else { kept };
            let bad = q[k].iter().position(|&x| !close(x, want));
            assert!(
                bad.is_none(),
                "{}: {what} call {i} answered {st:?}: q[{k}][{}] is {} (wanted {want})",
                tag("all new or all kept"),
                bad.unwrap_or(0),
                q[k][bad.unwrap_or(0)]
            );
        }
        if st == RANK_LOST {
            assert!(last_error().contains("rank 2"), "{}", tag(&last_error()));
            lost_at = Some((i, what));
            break;
        }
    }
    let (i, what) = lost_at.expect("rank 2 was lost within 100 000 calls");
    present = replicas_below(2);
    // The survivors lost the same call: the sum of its number over their replicas.
    for k in 0..local {
        n[k][0] = i as f32;
    }
    let st = ctx.allreduce("n", SUM);
    assert_eq!(st, OK, "{}: {}", tag("allreduce n"), last_error());
    let want = (i * present.len()) as f32;
    assert!(
        n.iter().all(|x| x[0] == want),
        "{}: {n:?}, wanted {want}",
        tag("the same call lost everywhere")
    );
    // The redo of a step: BMUF's state is as before the interrupted call.
    for k in 0..local {
        q[k].fill(q_value(i, offset + k));
    }
    let st = ctx.bmuf_step();
    assert_eq!(st, OK, "{}: {}", tag("bmuf_step redo"), last_error());
    bmuf_model(&mut w, &mut d, mean(i, &present));
    for k in 0..local {
        assert!(
            q[k].iter().all(|&x| close(x, w)),
            "{}: q[{k}][0] {} wanted {w}",
            tag(&format!("bmuf redo after a lost {what}")),
            q[k][0]
        );
    }
    println!("rank {rank}: rank 2 lost during call {i} ({what})");
    drop(ctx);
    println!("SURVIVED kept_body");
}

/// Sparse gathers' outputs through a loss (tests/world_lost_parts/sparse.rs).
#[path = "world_lost_parts/sparse.rs"]
mod sparse;
