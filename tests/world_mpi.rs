//! Worlds of processes over MPI, through the C ABI (built with `--features mpi` only).
//!
//! `worlds_of_two_three_and_four_ranks` starts this same test binary under
//! `mpirun --allow-run-as-root --oversubscribe -n N` (N = 2, 3, then 4), where `rank_body` runs as
//! every rank: rank r has r + 1 host replicas, so the ranks differ in their local counts. It
//! checks rank / world_replicas / loss_scale, exact allreduce SUM and AVG values (f32, i64,
//! f16, bf16), a broadcast from a world root on the last rank (not its local replica 0), describe's
//! "world" and ranks level, agreement failures (registrations, a call that fails on one rank,
//! ranks making different calls: another reduce op, another operation) with nothing changed,
//! and an options disagreement at context creation.
#![cfg(feature = "mpi")]
// Element i of every tensor has an expected value computed from i: indexed loops read best.
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod context;
    pub mod float16;
    pub mod mpi;
    pub mod skip;
    pub mod sparse;
}

use std::ptr;

use common::mpi::{as_rank, launch, under_mpirun};
use common::{abi::*, context::*, float16::*};

use dpsync::*;

fn world_options(replicas: usize) -> Options {
    let o = Options::host(replicas);
    o.set_timeout_ms(120_000);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    check(
        unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
        "set_world_mpi",
    );
    o
}

/// World replica `w`'s value of element `i`.
fn value(w: usize, i: usize) -> i64 {
    ((w + 1) * (i + 1)) as i64
}

/// f16 values of world replica `w`, element `i`: in [1/16, 1), so that any sum of a few of them
/// is exact in f32 and the only rounding is the final one to f16.
fn half_value(w: usize, i: usize) -> f32 {
    let bits = (w * 7919 + i * 104_729) % 960; // 960 steps of 1/1024 from 64/1024
    f16_to_f32(f32_to_f16((64 + bits) as f32 / 1024.0))
}

/// f16 and bf16 SUM and AVG across ranks with several local replicas: the f32 sum over the whole
/// world is rounded once (a local f16 sum first would round twice, and differ on some elements).
fn half_sums_round_once(ctx: &Context, rank: usize, local: usize, offset: usize, total: usize) {
    // 16 elements: the data rides in the agreement (the inline path), 4096: the MPI stage.
    for n in [16, 4096] {
        half_sums_of(ctx, rank, local, offset, total, n);
    }
}

fn half_sums_of(ctx: &Context, rank: usize, local: usize, offset: usize, total: usize, n: usize) {
    let exact = |i: usize| (0..total).map(|w| half_value(w, i)).sum::<f32>();
    for (op, name) in [(SUM, "sum"), (AVG, "avg")] {
        let mut h: Vec<Vec<u16>> = (0..local)
            .map(|k| {
                (0..n)
                    .map(|i| f32_to_f16(half_value(offset + k, i)))
                    .collect()
            })
            .collect();
        let mut b: Vec<Vec<u16>> = (0..local)
            .map(|k| {
                (0..n)
                    .map(|i| f32_to_bf16(half_value(offset + k, i)))
                    .collect()
            })
            .collect();
        for k in 0..local {
            ctx.reg("half_h", STATE, k, &mut h[k], F16);
            ctx.reg("half_b", STATE, k, &mut b[k], BF16);
        }
        check(ctx.allreduce("half_h", op), "allreduce f16");
        check(ctx.allreduce("half_b", op), "allreduce bf16");
        for k in 0..local {
            for i in 0..n {
                let want = if op == SUM {
                    exact(i)
                } else {
                    exact(i) / total as f32
                };
                assert_eq!(
                    h[k][i],
                    f32_to_f16(want),
                    "rank {rank}: f16 {name} [{k}][{i}]: {} vs {want}",
                    f16_to_f32(h[k][i])
                );
                // bf16 holds only 8 bits: the values themselves were rounded on the way in.
                let want_b: f32 = (0..total)
                    .map(|w| bf16_to_f32(f32_to_bf16(half_value(w, i))))
                    .sum::<f32>()
                    / if op == SUM { 1.0 } else { total as f32 };
                assert_eq!(b[k][i], f32_to_bf16(want_b), "rank {rank}: bf16 {name}");
            }
        }
        check(ctx.unregister("half_h"), "unregister");
        check(ctx.unregister("half_b"), "unregister");
    }
}

/// BMUF across the ranks: init broadcasts world replica 0's params, the default momentum counts
/// the world's replicas, and each step averages over every replica of every rank.
fn bmuf_over_the_world(ctx: &Context, rank: usize, local: usize, offset: usize, total: usize) {
    let n = 5;
    let mut p: Vec<Vec<f64>> = (0..local)
        .map(|k| (0..n).map(|i| ((offset + k) * 10 + i) as f64).collect())
        .collect();
    check(ctx.unregister("p"), "unregister p");
    for (k, buf) in p.iter_mut().enumerate() {
        ctx.reg("bmuf_p", PARAM, k, buf, F64);
    }
    // Arguments that differ between ranks: INCONSISTENT everywhere, no filter started.
    let lr = if rank == 1 { 0.5 } else { 1.0 };
    assert_eq!(ctx.bmuf_init(lr, -1.0, false), INCONSISTENT, "rank {rank}");
    assert!(last_error().contains("block_lr=0.5"), "{}", last_error());
    assert_eq!(p[0][1], (offset * 10 + 1) as f64, "nothing changed");
    assert_eq!(ctx.bmuf_step(), INVALID_STATE, "no filter yet");

    check(ctx.bmuf_init(1.0, -1.0, false), "bmuf_init");
    let mu = 1.0 - 1.0 / total as f64;
    assert_eq!(ctx.describe_json()["bmuf"]["block_momentum"], mu);
    for buf in &p {
        for (i, &x) in buf.iter().enumerate() {
            assert_eq!(
                x, i as f64,
                "rank {rank}: init broadcast world replica 0's params"
            );
        }
    }
    // Two steps, each replica moving its params by (w + 1): the mean move is g each time.
    let g = (total + 1) as f64 / 2.0;
    let (mut w, mut d) = (vec![0.0; n], vec![0.0; n]);
    w.iter_mut().enumerate().for_each(|(i, x)| *x = i as f64);
    for step in 0..2 {
        for (k, buf) in p.iter_mut().enumerate() {
            buf.iter_mut().for_each(|x| *x += (offset + k + 1) as f64);
        }
        check(ctx.bmuf_step(), "bmuf_step");
        for i in 0..n {
            let a = w[i] + g;
            d[i] = mu * d[i] + (a - w[i]);
            w[i] += d[i];
        }
        for buf in &p {
            for i in 0..n {
                assert!(
                    (buf[i] - w[i]).abs() <= 1e-12 * w[i].abs().max(1.0),
                    "rank {rank} step {step}: param[{i}] {} vs {}",
                    buf[i],
                    w[i]
                );
            }
        }
    }
    check(ctx.unregister("bmuf_p"), "unregister bmuf_p");
}

/// Rows of world replica `w` (some replicas have none), and their indices (shared between the
/// two gradients; they repeat across replicas, so coalescing has rows to merge).
fn sparse_rows(w: usize) -> Vec<i64> {
    let rows = [2, 0, 3, 1, 4, 2][w % 6];
    (0..rows).map(|j| ((w * 3 + j * 7) % 10) as i64).collect()
}

/// Sparse gradients across the ranks give exactly the bytes one process with every replica of
/// the world gives (world order; coalescing: each replica's rows, then the world's, summed in
/// world order), for SUM and AVG, two gradients sharing one indices buffer. Then an index out
/// of range on rank 0 fails the step on every rank, nothing changed.
fn sparse_over_the_world(rank: usize, local: usize, offset: usize, total: usize, coalesce: bool) {
    let o = world_options(local);
    o.set_sparse_coalesce(coalesce);
    let ctx = Context::new(&o);
    let r = Options::host(total);
    r.set_sparse_coalesce(coalesce);
    let reference = Context::new(&r);
    let (len32, len64) = (3, 2);
    for c in [&ctx, &reference] {
        c.reg_sparse_all("emb", len32, F32, I64, 10);
        c.reg_sparse_all("emb64", len64, F64, I64, 10);
    }
    let tag = format!("rank {rank}, coalesce {coalesce}");
    let indices: Vec<Vec<i64>> = (0..total).map(sparse_rows).collect();
    let v32: Vec<Vec<f32>> = (0..total)
        .map(|w| {
            (0..indices[w].len() * len32)
                .map(|c| (w * 100 + c) as f32 + 0.25)
                .collect()
        })
        .collect();
    let v64: Vec<Vec<f64>> = (0..total)
        .map(|w| {
            (0..indices[w].len() * len64)
                .map(|c| (w * 1000 + c) as f64 / 3.0)
                .collect()
        })
        .collect();
    for op in [SUM, AVG] {
        for w in 0..total {
            check(reference.sparse_set("emb", w, &indices[w], &v32[w]), "set");
            check(
                reference.sparse_set("emb64", w, &indices[w], &v64[w]),
                "set",
            );
        }
        for k in 0..local {
            let w = offset + k;
            check(ctx.sparse_set("emb", k, &indices[w], &v32[w]), "set");
            check(ctx.sparse_set("emb64", k, &indices[w], &v64[w]), "set");
        }
        check(reference.allreduce_grads(op), "reference step");
        check(ctx.allreduce_grads(op), &format!("{tag}: world step"));
        let (want32, want64) = (reference.gathered("emb", 0), reference.gathered("emb64", 0));
        assert!(want32.rows > 0);
        for k in 0..local {
            let (got32, got64) = (ctx.gathered("emb", k), ctx.gathered("emb64", k));
            assert_eq!(got32.rows, want32.rows, "{tag}: rows");
            assert_eq!(
                got32.indices::<i64>(),
                want32.indices::<i64>(),
                "{tag}: indices"
            );
            assert_eq!(
                got64.indices::<i64>(),
                want32.indices::<i64>(),
                "{tag}: shared"
            );
            let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(got32.values::<f32>(len32)),
                bits(want32.values::<f32>(len32)),
                "{tag}: f32 values on replica {k}"
            );
            assert_eq!(
                got64.values::<f64>(len64),
                want64.values::<f64>(len64),
                "{tag}: f64 values on replica {k}"
            );
        }
    }
    // Rank 0's index 10 is out of [0, 10): its own error there, INCONSISTENT elsewhere.
    let before = ctx.gathered("emb", 0).indices::<i64>();
    let bad: Vec<Vec<i64>> = (0..local)
        .map(|k| {
            let mut b = indices[offset + k].clone();
            if rank == 0 && !b.is_empty() {
                b[0] = 10;
            }
            b
        })
        .collect();
    for k in 0..local {
        let w = offset + k;
        check(ctx.sparse_set("emb", k, &bad[k], &v32[w]), "set");
        check(ctx.sparse_set("emb64", k, &bad[k], &v64[w]), "set");
    }
    let st = ctx.allreduce_grads(SUM);
    let msg = last_error();
    if rank == 0 {
        assert_eq!(st, INCONSISTENT, "{tag}: {msg}");
        assert!(
            msg.contains("index 10") && !msg.contains("rank 0"),
            "{tag}: {msg}"
        );
    } else {
        assert_eq!(st, INCONSISTENT, "{tag}: {msg}");
        assert!(msg.contains("rank 0"), "{msg}");
    }
    assert_eq!(
        ctx.gathered("emb", 0).indices::<i64>(),
        before,
        "{tag}: nothing changed"
    );
}

/// Worlds of 2, 3 and 4 ranks (`rank_body`).
#[path = "world_mpi_parts/ranks.rs"]
mod ranks;

/// Buckets in pieces.
#[path = "world_mpi_parts/pieces.rs"]
mod pieces;

/// Early buckets across the ranks.
#[path = "world_mpi_parts/overlap.rs"]
mod overlap;

/// Early results written into the gradients, put back when the step fails.
#[path = "world_mpi_parts/early_writes.rs"]
mod early_writes;

/// Early buckets in a reproducible world.
#[path = "world_mpi_parts/repro_overlap.rs"]
mod repro_overlap;

/// Timelines per rank.
#[path = "world_mpi_parts/timeline.rs"]
mod timeline;

/// Stuck and stopped ranks.
#[path = "world_mpi_parts/timeouts.rs"]
mod timeouts;
