//! Ranks that leave a world (`dpsync_leave`, uneven inputs) and elastic worlds' creation
//! (built with `--features mpi` only), under `mpirun -n 2` and `-n 3`, through shared memory
//! and over MPI messages, rank r with 1 + r % 2 host replicas:
//!
//! - the last rank leaves at the others' `allreduce_grads`: they finish it over the remaining
//!   replicas, renumbered and recounted (rank, world replicas, loss scale, epoch), and go on
//!   with a broadcast; the leaver refuses collectives and still answers queries;
//! - rank 0 leaves while the others' buckets were started early by `dpsync_grad_ready`;
//! - several ranks leave at once; every rank leaves;
//! - CUDA replicas (on the fake driver and NCCL, or a GPU): the last rank leaves; the others'
//!   NCCL clique is made again over them (or they stage through MPI, with PEER_COPY);
//! - elastic worlds: options that differ between ranks are INCONSISTENT naming "elastic",
//!   more min_ranks than ranks INVALID_ARGUMENT, and on an MPI without ULFM UNAVAILABLE (made
//!   on one with it).
#![cfg(feature = "mpi")]
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod float16;
    pub mod lcg;
    pub mod mpi;
    pub mod place;
    pub mod skip;
}

use std::path::Path;
use std::ptr;

use common::mpi::{as_rank, launch, under_mpirun};
use common::place::{synchronize, Place};
use common::{abi::*, context::*, cuda_context::*};

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
    // A hang fails within seconds, not at a world's 10-minute default; two buckets of g's
    // tensors, so that marks start one early.
    Options::world_of_ranks(local, 30_000)
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
        o.set_elastic(min_ranks);
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
    // An MPI with ULFM (Open MPI 5) makes it; one without (Open MPI 4.1) says how to get one.
    // SAFETY: a NUL-terminated name looked up in the loaded objects.
    let ulfm = !unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"MPIX_Comm_iagree".as_ptr()) }.is_null();
    let (st, msg) = create(1);
    if ulfm {
        assert_eq!(st, OK, "rank {rank}: elastic on ULFM: {msg}");
    } else {
        assert_eq!(st, UNAVAILABLE, "rank {rank}: elastic: {msg}");
        assert!(
            msg.contains("User-Level Failure Mitigation") && msg.contains("--with-ft ulfm"),
            "rank {rank}: {msg}"
        );
    }
}

#[test]
fn cuda_ranks_leave() {
    if under_mpirun() {
        return; // a rank runs cuda_leave_body only
    }
    // Each launch compiles the kernels on every rank: two layouts keep it short.
    for (n, transport) in [(3, "nccl"), (2, "peer_copy")] {
        let env = Some(("DPSYNC_TEST_TRANSPORT", Path::new(transport)));
        launch("cuda_leave_body", n, 300, env);
    }
}

/// Rank r's CUDA replicas: r + 1 of them over the fake driver's two GPUs (all on GPU 0 where
/// there is one).
fn cuda_layout(rank: usize) -> Vec<i32> {
    let gpus = common::place::device_count().clamp(1, 2) as i32;
    (0..=rank as i32).map(|k| k % gpus).collect()
}

#[test]
fn cuda_leave_body() {
    let Some((rank, ranks)) = as_rank("cuda_leave_body") else {
        return;
    };
    let Some(place) = Place::gpus("cuda_leave_body", 1) else {
        return;
    };
    let nccl = std::env::var("DPSYNC_TEST_TRANSPORT").as_deref() == Ok("nccl");
    let shared_gpu = ranks > 1 && common::place::device_count() == 1;
    if nccl && shared_gpu && std::env::var_os("NCCL_MULTI_RANK_GPU_ENABLE").is_none() {
        eprintln!(
            "cuda_leave_body: skipped: NCCL across ranks sharing one GPU needs \
             NCCL_MULTI_RANK_GPU_ENABLE=1"
        );
        return;
    }
    let ordinals = cuda_layout(rank);
    let local = ordinals.len();
    let offset: usize = (0..rank).map(|r| cuda_layout(r).len()).sum();
    let Some(ctx) = cuda_context("cuda_leave_body", &ordinals, |o| {
        o.set_timeout_ms(120_000);
        o.set_transport(if nccl { T_NCCL } else { T_PEER_COPY });
        // SAFETY: valid options; NULL is MPI_COMM_WORLD.
        check(
            unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
            "set_world_mpi",
        );
    }) else {
        return;
    };
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let n = 300;
    let init = |w: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (((w + 1) * (i + 1)) as f32).to_ne_bytes())
            .collect()
    };
    let mut g: Vec<_> = (0..local)
        .map(|k| place.mem_on(ordinals[k], &init(offset + k)))
        .collect();
    for k in 0..local {
        let st = register_raw(ctx.0, "g", GRAD, k, g[k].ptr() as *mut _, n, F32);
        check(st, &tag("register"));
    }
    let last = ranks - 1;
    if rank == last {
        assert_eq!(leave(&ctx), OK, "{}: {}", tag("leave"), last_error());
        assert_eq!(
            ctx.allreduce_grads(SUM),
            INVALID_STATE,
            "{}",
            tag("after leaving")
        );
        return;
    }
    let staying: usize = (0..last).map(|r| cuda_layout(r).len()).sum();
    for round in 0..2 {
        assert_eq!(
            ctx.allreduce_grads(SUM),
            OK,
            "{}: {}",
            tag("step"),
            last_error()
        );
        assert_eq!(
            synchronize(&ctx),
            OK,
            "{}: {}",
            tag("synchronize"),
            last_error()
        );
        let sum = |i: usize| ((i + 1) * staying * (staying + 1) / 2) as f32;
        for k in 0..local {
            let bytes = g[k].read();
            for i in 0..n {
                let x = f32::from_ne_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
                assert_eq!(x, sum(i), "{}", tag(&format!("round {round}: g[{k}][{i}]")));
            }
            g[k].write(&init(offset + k));
        }
    }
    let d = ctx.describe_json();
    assert_eq!(d["world"]["ranks"], last, "{}", tag("ranks"));
    let cross = if nccl { "nccl" } else { "mpi_staged" };
    assert_eq!(
        d["world"]["cross_rank"],
        cross,
        "{}: {d}",
        tag("across the ranks")
    );
}
