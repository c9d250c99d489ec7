//! Worlds of processes with CUDA replicas (built with `--features mpi`): NCCL across the ranks
//! (one clique over every rank's GPUs; the fake NCCL meets across processes in shared memory)
//! and the staged path (each process's sum through page-locked host memory and MPI).
//! scripts/test.sh runs it on the fake CUDA driver and NCCL (target/fakecuda, two fake GPUs per
//! rank), with synchronous and asynchronous streams; on a machine without a CUDA driver every
//! rank prints that it was skipped.
//!
//! `cuda_worlds_of_two_and_three_ranks` starts this binary under `mpirun -n 2` and `-n 3`, with
//! transport PEER_COPY (staged), NCCL and AUTO (NCCL); as every rank, `cuda_rank_body` has a
//! different layout of CUDA replicas: rank 0 two replicas on GPU 0 (one group), rank 1 one on
//! GPU 0 and one on GPU 1 (two groups), rank 2 one on GPU 1. It checks exact SUM and AVG (f32,
//! f64, i64), a broadcast from the last world replica, BMUF over the world, describe's path
//! across the ranks, and sparse gathers (plain and coalesced) against one host process holding
//! every replica of the world. `a_rank_that_cannot_join_nccl`: one rank's NCCL init fails.
//! `host_tensors_on_cuda_replicas_across_ranks` (world_cuda_parts/host_memory.rs): host-memory
//! tensors on 3 staged ranks of 1, 2 (on two GPUs) and 1 CUDA replicas.
#![cfg(feature = "mpi")]
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod fake_nccl;
    pub mod float16;
    pub mod lcg;
    pub mod mpi;
    pub mod place;
    pub mod skip;
    pub mod sparse;
}

use std::ptr;

use common::mpi::{as_rank, launch, under_mpirun};
use common::place::{Mem, Place};
use common::{abi::*, context::*, cuda_context::*};
use dpsync::*;

#[test]
fn cuda_worlds_of_two_and_three_ranks() {
    if under_mpirun() {
        return;
    }
    for n in [2, 3] {
        for transport in ["peer_copy", "nccl", "auto"] {
            let env = Some(("DPSYNC_TEST_TRANSPORT", std::path::Path::new(transport)));
            launch("cuda_rank_body", n, 300, env);
        }
    }
}

/// The transport the launcher asked for, and how the ranks must then be crossed: staged with
/// PEER_COPY, NCCL when asked, and by AUTO where NCCL takes every rank's GPUs: the fake NCCL
/// always; a real NCCL refuses ranks sharing the one GPU ("Duplicate GPU detected") unless
/// NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30), and AUTO then stages.
fn transport(ranks: usize) -> (u32, &'static str) {
    let shared_gpu = ranks > 1
        && common::place::device_count() == 1
        && std::env::var_os("NCCL_MULTI_RANK_GPU_ENABLE").is_none();
    match std::env::var("DPSYNC_TEST_TRANSPORT").as_deref() {
        Ok("nccl") => (T_NCCL, "nccl"),
        Ok("auto") if shared_gpu => (T_AUTO, "mpi_staged"),
        Ok("auto") => (T_AUTO, "nccl"),
        _ => (T_PEER_COPY, "mpi_staged"),
    }
}

/// Each rank's CUDA ordinals. On a machine with one GPU (a real one: the fakes give each rank
/// two) every replica is on GPU 0: the staged path runs as it does across GPUs, while NCCL then
/// needs several ranks on one GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1).
fn layout(rank: usize) -> Vec<i32> {
    let gpus = common::place::device_count().clamp(1, 2) as i32;
    [&[0, 0][..], &[0, 1][..], &[1][..]][rank]
        .iter()
        .map(|&d| d % gpus)
        .collect()
}

/// Options of a world over MPI_COMM_WORLD with `transport` (a 2-minute timeout).
fn world(o: &Options, transport: u32) {
    o.set_timeout_ms(120_000);
    o.set_transport(transport);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    check(
        unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
        "set_world_mpi",
    );
}

/// This rank's replicas, the world's, and the world index of this rank's first.
fn counts(rank: usize, ranks: usize) -> (usize, usize, usize) {
    let sizes: Vec<usize> = (0..ranks).map(|r| layout(r).len()).collect();
    (sizes[rank], sizes.iter().sum(), sizes[..rank].iter().sum())
}

/// Distinct GPUs of a rank: its NCCL ranks.
fn local_groups(rank: usize) -> usize {
    let mut o = layout(rank);
    o.dedup();
    o.len()
}

fn value(w: usize, i: usize) -> i64 {
    ((w + 1) * (i + 1)) as i64
}

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain numbers.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        .to_vec()
}

fn from_bytes<T: Copy + Default>(b: &[u8]) -> Vec<T> {
    let mut out = vec![T::default(); b.len() / std::mem::size_of::<T>()];
    // SAFETY: `out` holds exactly these bytes.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), out.as_mut_ptr().cast::<u8>(), b.len()) };
    out
}

#[test]
fn cuda_rank_body() {
    let Some((rank, ranks)) = as_rank("cuda_rank_body") else {
        return;
    };
    let Some(place) = Place::gpus("cuda_rank_body", 1) else {
        return;
    };
    let (local, total, offset) = counts(rank, ranks);
    let ordinals = &layout(rank);
    let (asked, cross) = transport(ranks);
    let Some(ctx) = cuda_context("cuda_rank_body", ordinals, |o| world(o, asked)) else {
        return;
    };
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let d = ctx.describe_json();
    assert_eq!(d["world"]["cross_rank"], cross, "{d}");
    let levels = d["levels"].as_array().unwrap();
    assert_eq!(levels.last().unwrap()["via"], cross, "{d}");
    if cross == "nccl" && ranks > 1 {
        // One NCCL rank per distinct GPU of each rank (each process's fake GPUs are its own).
        let groups: usize = (0..ranks).map(local_groups).sum();
        assert_eq!(levels.last().unwrap()["nccl_ranks"], groups, "{d}");
        assert_eq!(
            d["backend"]["nccl_communicators"],
            local_groups(rank),
            "{d}"
        );
    }

    // Dense gradients: f32 (two tensors, one bucket), i64.
    let (n32, n64) = (1000, 5);
    let init32 = |w: usize, sign: f32| -> Vec<u8> {
        bytes_of(
            &(0..n32)
                .map(|i| sign * value(w, i) as f32)
                .collect::<Vec<f32>>(),
        )
    };
    let init64 = |w: usize| bytes_of(&(0..n64).map(|i| value(w, i) << 40).collect::<Vec<i64>>());
    let mut w32: Vec<Mem> = (0..local)
        .map(|k| place.mem_on(ordinals[k], &init32(offset + k, 1.0)))
        .collect();
    let b32: Vec<Mem> = (0..local)
        .map(|k| place.mem_on(ordinals[k], &init32(offset + k, -1.0)))
        .collect();
    let mut s64: Vec<Mem> = (0..local)
        .map(|k| place.mem_on(ordinals[k], &init64(offset + k)))
        .collect();
    for k in 0..local {
        for (name, mem, count, dtype) in [
            ("w_grad", &w32[k], n32, F32),
            ("b_grad", &b32[k], n32, F32),
            ("s_grad", &s64[k], n64, I64),
        ] {
            let st = register_raw(ctx.0, name, GRAD, k, mem.ptr() as *mut _, count, dtype);
            check(st, &tag(name));
        }
    }
    let sum = |i: usize| ((i + 1) * total * (total + 1) / 2) as i64;
    check(ctx.allreduce_grads(SUM), &tag("allreduce_grads SUM"));
    for k in 0..local {
        let (w, b, s) = (
            from_bytes::<f32>(&w32[k].read()),
            from_bytes::<f32>(&b32[k].read()),
            from_bytes::<i64>(&s64[k].read()),
        );
        for i in 0..n32 {
            assert_eq!(w[i], sum(i) as f32, "{}", tag(&format!("w[{k}][{i}]")));
            assert_eq!(b[i], -sum(i) as f32, "{}", tag("b"));
        }
        for i in 0..n64 {
            assert_eq!(s[i], sum(i) << 40, "{}", tag("s"));
        }
    }
    for k in 0..local {
        w32[k].write(&init32(offset + k, 1.0));
        s64[k].write(&init64(offset + k));
    }
    check(ctx.allreduce_grads(AVG), &tag("allreduce_grads AVG"));
    for k in 0..local {
        let (w, s) = (
            from_bytes::<f32>(&w32[k].read()),
            from_bytes::<i64>(&s64[k].read()),
        );
        for i in 0..n32 {
            assert_eq!(
                w[i],
                (sum(i) as f64 / total as f64) as f32,
                "{}",
                tag("w avg")
            );
        }
        for i in 0..n64 {
            assert_eq!(s[i], (sum(i) << 40) / total as i64, "{}", tag("s avg"));
        }
    }

    // f16 through the staged path: summed in f32 over every replica of the world and rounded
    // once. World replica 0 holds 1024, the others 0.5: on 2 ranks the sum 1025.5 rounds to
    // 1026, while rounding each process's sum first (1024.5 -> 1024, then 1024 + 1.0) would
    // give 1025.
    if cross == "mpi_staged" {
        use common::float16::{f16_to_f32, f32_to_f16};
        let h: Vec<Mem> = (0..local)
            .map(|k| {
                let x = if offset + k == 0 { 1024.0 } else { 0.5 };
                place.mem_on(ordinals[k], &bytes_of(&[f32_to_f16(x); 3]))
            })
            .collect();
        for (k, mem) in h.iter().enumerate() {
            check(
                register_raw(ctx.0, "h_grad", GRAD, k, mem.ptr() as *mut _, 3, F16),
                "register h",
            );
        }
        check(ctx.allreduce_grads(SUM), &tag("allreduce_grads f16"));
        let want = f16_to_f32(f32_to_f16(1024.0 + 0.5 * (total - 1) as f32));
        for mem in &h {
            for x in from_bytes::<u16>(&mem.read()) {
                assert_eq!(f16_to_f32(x), want, "{}", tag("f16 rounded once"));
            }
        }
    }

    // Broadcast from the last world replica (on the last rank).
    let p: Vec<Mem> = (0..local)
        .map(|k| {
            let v: Vec<f64> = (0..7).map(|i| ((offset + k) * 100 + i) as f64).collect();
            place.mem_on(ordinals[k], &bytes_of(&v))
        })
        .collect();
    for (k, mem) in p.iter().enumerate() {
        check(
            register_raw(ctx.0, "p", PARAM, k, mem.ptr() as *mut _, 7, F64),
            "register p",
        );
    }
    let root = total - 1;
    check(ctx.broadcast(PARAM, root), &tag("broadcast"));
    for mem in &p {
        let got = from_bytes::<f64>(&mem.read());
        for (i, &x) in got.iter().enumerate() {
            assert_eq!(x, (root * 100 + i) as f64, "{}", tag("broadcast value"));
        }
    }

    // BMUF over the world: init takes world replica 0's params, a step averages every rank's.
    let mut p = p;
    for (k, mem) in p.iter_mut().enumerate() {
        let v: Vec<f64> = (0..7).map(|i| ((offset + k) * 10 + i) as f64).collect();
        mem.write(&bytes_of(&v));
    }
    check(ctx.bmuf_init(1.0, 0.0, false), &tag("bmuf_init"));
    for mem in &p {
        let got = from_bytes::<f64>(&mem.read());
        assert_eq!(got[3], 3.0, "{}", tag("bmuf_init broadcast"));
    }
    for (k, mem) in p.iter_mut().enumerate() {
        let v: Vec<f64> = (0..7).map(|i| (i + offset + k + 1) as f64).collect();
        mem.write(&bytes_of(&v));
    }
    check(ctx.bmuf_step(), &tag("bmuf_step"));
    // Momentum 0, block_lr 1: the new model is the mean of the world's params.
    let g = (total + 1) as f64 / 2.0;
    for mem in &p {
        let got = from_bytes::<f64>(&mem.read());
        for (i, &x) in got.iter().enumerate() {
            assert_eq!(x, i as f64 + g, "{}", tag("bmuf step"));
        }
    }

    check(common::place::synchronize(&ctx), &tag("synchronize"));
    drop(ctx);
    for coalesce in [false, true] {
        sparse_across_ranks(&place, rank, ranks, coalesce);
    }
}

#[test]
fn a_rank_that_cannot_join_nccl() {
    if under_mpirun() {
        return;
    }
    launch("nccl_join_failure_body", 2, 300, None);
}

/// Rank 1's NCCL communicator fails to initialise (the fake NCCL's FAKE_NCCL_INIT_FAULT, set on
/// that rank only) while rank 0's is under way: with AUTO every rank leaves the clique and stages
/// through MPI (and an allreduce is right); with NCCL asked for, creation fails on every rank at
/// once (rank 1 with its own error, rank 0 INCONSISTENT naming rank 1), not by a timeout.
#[test]
fn nccl_join_failure_body() {
    let Some((rank, _)) = as_rank("nccl_join_failure_body") else {
        return;
    };
    let Some(place) = Place::gpus("nccl_join_failure_body", 1) else {
        return;
    };
    if rank == 1 {
        std::env::set_var("FAKE_NCCL_INIT_FAULT", "1");
    }
    let Some(ctx) = cuda_context("nccl_join_failure_body", &[0], |o| world(o, T_AUTO)) else {
        return;
    };
    let d = ctx.describe_json();
    assert_eq!(d["world"]["cross_rank"], "mpi_staged", "rank {rank}: {d}");
    let mem = place.mem_on(0, &bytes_of(&[rank as f32 + 1.0; 4]));
    check(
        register_raw(ctx.0, "g", GRAD, 0, mem.ptr() as *mut _, 4, F32),
        "register",
    );
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    check(common::place::synchronize(&ctx), "synchronize");
    assert_eq!(
        from_bytes::<f32>(&mem.read()),
        vec![3.0f32; 4],
        "rank {rank}"
    );
    drop(ctx);

    let o = Options::new();
    o.set_cuda_replicas(&[0]);
    world(&o, T_NCCL);
    let mut p = ptr::null_mut();
    // SAFETY: valid options and out pointer.
    let st = unsafe { dpsync_context_create(o.0, &mut p) };
    let message = last_error();
    assert!(p.is_null(), "rank {rank}: no context");
    if rank == 0 {
        assert_eq!(st, INCONSISTENT, "{message}");
        assert!(
            message.contains("rank 1") && message.contains("NCCL"),
            "{message}"
        );
    } else {
        assert_ne!(st, OK, "{message}");
        assert!(message.contains("injected init failure"), "{message}");
    }
}

#[test]
fn cuda_overlap_across_ranks_over_nccl() {
    if under_mpirun() {
        return;
    }
    for n in [2, 3] {
        launch("nccl_overlap_body", n, 300, None);
    }
}

/// `dpsync_grad_ready` on CUDA replicas with NCCL across the ranks (the layouts of
/// `cuda_rank_body`, a bucket per gradient): buckets start early in bucket order on every rank
/// (each packed into buffers of its own, nothing written before `allreduce_grads` agrees);
/// ranks that started different numbers of buckets still match; another collective while
/// buckets are in flight fails on every rank and changes nothing; a failed agreement drains the
/// started buckets (stand-ins on the ranks that did not start them) and writes nothing.
/// Started buckets serve a reduce-scatter step too, and start after one.
#[test]
fn nccl_overlap_body() {
    let Some((rank, ranks)) = as_rank("nccl_overlap_body") else {
        return;
    };
    let Some(place) = Place::gpus("nccl_overlap_body", 1) else {
        return;
    };
    let (local, total, offset) = counts(rank, ranks);
    let ordinals = &layout(rank);
    let Some(ctx) = cuda_context("nccl_overlap_body", ordinals, |o| {
        world(o, T_AUTO);
        // 1000 f32: a bucket per gradient.
        o.set_fusion_bytes(4000);
    }) else {
        return;
    };
    let tag = format!("rank {rank}/{ranks}");
    assert_eq!(ctx.describe_json()["world"]["cross_rank"], "nccl");
    let mut g = Grads::new(&ctx, &place, ordinals, (local, total, offset), tag);
    let (now, last) = (
        "buckets_reduced_early_this_step",
        "buckets_reduced_early_last_step",
    );

    // Step 1 (no op yet: nothing starts early).
    check(ctx.allreduce_grads(SUM), &g.tag("step 1"));
    g.expect("step 1");

    // Step 2: every rank marks everything, in backward order: every bucket starts early, and
    // nothing is written before allreduce_grads.
    g.refill();
    g.mark(&[2, 1, 0]);
    assert_eq!(g.early(now), 3, "{}", g.tag("step 2 started"));
    g.untouched("step 2: nothing written before allreduce_grads");
    check(ctx.allreduce_grads(SUM), &g.tag("step 2"));
    g.expect("step 2");
    assert_eq!(g.early(last), 3, "{}", g.tag("step 2 early"));

    // Steps 2b and 2c: started buckets serve a reduce-scatter step (each replica's own pieces
    // copied out of their buffers, nothing else written), and after one they start early
    // again and serve an allreduce step.
    g.refill();
    g.mark(&[2, 1, 0]);
    assert_eq!(g.early(now), 3, "{}", g.tag("step 2b started"));
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) },
        &g.tag("step 2b"),
    );
    g.expect_owned("step 2b");
    assert_eq!(g.early(last), 3, "{}", g.tag("step 2b early"));
    g.refill();
    g.mark(&[2, 1, 0]);
    assert_eq!(
        g.early(now),
        3,
        "{}",
        g.tag("step 2c started after a reduce-scatter")
    );
    check(ctx.allreduce_grads(SUM), &g.tag("step 2c"));
    g.expect("step 2c");

    // Ranks that start different buckets need streams that run apart from the host: the fake
    // NCCL's synchronous mode runs a collective across processes inside the call that queues
    // it, until every process queued it.
    if std::env::var("FAKE_CUDA_ASYNC").as_deref() != Ok("1") {
        println!("nccl_overlap_body: steps 3 to 5 skipped: they need FAKE_CUDA_ASYNC=1");
        return;
    }

    // Step 3: rank 0 starts every bucket, the others none; another collective meanwhile fails
    // on every rank (rank 0 refuses it, the others name rank 0) and changes nothing; then the
    // step completes with the same collectives on every rank.
    g.refill();
    if rank == 0 {
        g.mark(&[0, 1, 2]);
    }
    let st = ctx.allreduce("g0", SUM);
    let msg = last_error();
    assert_eq!(
        st,
        if rank == 0 {
            INVALID_STATE
        } else {
            INCONSISTENT
        },
        "{}",
        g.tag(&msg)
    );
    assert!(msg.contains("dpsync_allreduce_grads"), "{}", g.tag(&msg));
    if rank != 0 {
        // Rank 0's started buckets wait for the others' until allreduce_grads: synchronizing
        // there now would wait for them.
        g.untouched("step 3: nothing written by the refused collective");
    }
    check(ctx.allreduce_grads(SUM), &g.tag("step 3"));
    g.expect("step 3");

    // Step 4: rank 0 starts every bucket, then the step's agreement fails on every rank (the
    // last rank registered another gradient): the started buckets are drained, nothing is
    // written; after the other gradient goes, the step succeeds.
    g.refill();
    if rank == 0 {
        g.mark(&[0, 1, 2]);
    }
    g.failed_agreement((&place, ordinals), (rank, ranks), "step 4");

    // Step 5: rank 0 starts every bucket, the others none, in a step with a sparse gradient
    // (gathered through the host across the ranks): the others start the same buckets before
    // the gather, so the clique and the gather meet in the same order on every rank.
    g.refill();
    ctx.reg_sparse_all("emb", 2, F32, I64, 7);
    let slices: Vec<(Mem, Mem, usize)> = (0..local)
        .map(|k| {
            let (i, v) = rows_of(offset + k);
            let rows = i.len();
            let on = |b: &[u8]| place.mem_on(ordinals[k], b);
            (on(&bytes_of(&i)), on(&bytes_of(&v)), rows)
        })
        .collect();
    for (k, (i, v, rows)) in slices.iter().enumerate() {
        let st = ctx.sparse_set_raw("emb", k, i.ptr() as *const _, v.ptr() as *const _, *rows);
        check(st, &g.tag("sparse_set"));
    }
    if rank == 0 {
        g.mark(&[0, 1, 2]);
    }
    check(ctx.allreduce_grads(SUM), &g.tag("step 5"));
    g.expect("step 5");
    let rows: usize = (0..total).map(|w| rows_of(w).0.len()).sum();
    assert_eq!(
        ctx.gathered("emb", 0).rows,
        rows,
        "{}",
        g.tag("step 5: sparse rows")
    );
}

/// Sparse gathers across the ranks (tests/world_cuda_parts/sparse.rs).
#[path = "world_cuda_parts/sparse.rs"]
mod sparse;
use sparse::{rows_of, sparse_across_ranks};

/// Shards with NCCL across the ranks (tests/world_cuda_parts/shards.rs).
#[path = "world_cuda_parts/shards.rs"]
mod shards;

/// Host-memory tensors on CUDA replicas across the ranks (tests/world_cuda_parts/host_memory.rs).
#[path = "world_cuda_parts/host_memory.rs"]
mod host_memory;

/// The overlap tests' gradients (tests/world_cuda_parts/grads.rs).
#[path = "world_cuda_parts/grads.rs"]
mod grads;
use grads::Grads;

/// Overlap on the staged route (tests/world_cuda_parts/staged_overlap.rs).
#[path = "world_cuda_parts/staged_overlap.rs"]
mod staged_overlap;

/// Overlap in reproducible worlds, staged and over NCCL (tests/world_cuda_parts/repro_overlap.rs).
#[path = "world_cuda_parts/repro_overlap.rs"]
mod repro_overlap;
