//! Worlds of one host replica per rank (the engine's own reduce-scatter and allgather, straight
//! from and into the tensors; `scripts/test.sh` runs this under the MPI build), 1 to 4 ranks,
//! and 2 and 3 without shared memory:
//! ZeRO-1 gives the bytes of allreduce; every dtype, SUM and AVG, with and without reproducible
//! sums, small buckets (one MPI allreduce per piece) and large ones (the ring through shared
//! memory): the owned pieces hold what allreduce_grads gives, every other element stays, and
//! allgather gives every rank the owners' pieces.

use super::*;
use common::mpi::{as_rank, launch, under_mpirun};

#[test]
fn shards_across_ranks_of_one_replica_each() {
    if under_mpirun() {
        return;
    }
    for ranks in [1, 2, 3, 4] {
        launch("world::world_body", ranks, 300, None);
    }
    // Without shared memory: the ring over MPI messages, and the allgather as one
    // MPI_Iallgatherv of every rank's pieces.
    let no_shm = Some(("DPSYNC_MPI_SHM", std::path::Path::new("0")));
    for ranks in [2, 3] {
        launch("world::world_body", ranks, 300, no_shm);
    }
    // Ranks of several replicas (1 + rank % 2 each), with and without shared memory.
    for (ranks, env) in [(2, None), (3, None), (3, no_shm)] {
        launch("world::local_replicas_body", ranks, 300, env);
    }
}

/// ZeRO-1 on ranks of 1 + rank % 2 host replicas: every local replica a contribution to
/// the engine's reduce-scatter, each getting its own pieces, and the allgather through
/// local replica 0; the parameters are the allreduce's on every replica (byte for byte
/// where [`sums_alike`]).
/// Then overlap steps of both shapes.
#[test]
fn local_replicas_body() {
    let Some((rank, ranks)) = as_rank("local_replicas_body") else {
        return;
    };
    let replicas_of = |r: usize| 1 + r % 2;
    let (local, offset) = (replicas_of(rank), (0..rank).map(replicas_of).sum::<usize>());
    let context = || {
        let o = Options::host(local);
        o.set_timeout_ms(60_000);
        o.set_fusion_bytes(64);
        // SAFETY: valid options; NULL is MPI_COMM_WORLD.
        check(
            unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
            "set_world_mpi",
        );
        Context::new(&o)
    };
    let (plain, _) = train_in(&context(), &Place::Host, (local, offset), false, 5);
    let (zero, _) = train_in(&context(), &Place::Host, (local, offset), true, 5);
    for r in 0..local {
        let what = format!("rank {rank} of {ranks}: replica {r}'s parameters");
        assert_sums(DType::F32, (&zero[r], &plain[r]), ranks, &what);
        assert_eq!(zero[r], zero[0], "rank {rank} of {ranks}: replicas agree");
    }
    // Started buckets serve either step here too: a reduce-scatter's release writes each
    // local replica's own pieces.
    overlap_serves_either_step(rank, ranks, (local, offset));
}

fn world_context(reproducible: bool) -> Context {
    world_context_fused(reproducible, None, 1)
}

/// Whether the reduce-scatter's sums are the allreduce's bit for bit in this world of
/// `ranks`: through shared memory (each element summed in the allreduce's order), or 2
/// ranks (one addition per element, whichever rank starts it). Without shared memory, 3
/// ranks and more sum each element from the rank after its owner on, the allreduce from
/// its block's rank on: the same up to the order of the sums, as the contract says.
fn sums_alike(ranks: usize) -> bool {
    ranks <= 2 || std::env::var("DPSYNC_MPI_SHM").map_or(true, |v| v != "0")
}

/// `got` against `want`, bytes of `dtype`: equal where [`sums_alike`], else within a few
/// roundings of the dtype of each other (integers exactly).
fn assert_sums(dtype: DType, (got, want): (&[u8], &[u8]), ranks: usize, tag: &str) {
    let tolerance = match dtype {
        _ if sums_alike(ranks) => 0.0,
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        _ => 0.0,
    };
    if tolerance == 0.0 {
        return assert_eq!(got, want, "{tag}");
    }
    let (got, want) = (
        common::place::decode(dtype, got),
        common::place::decode(dtype, want),
    );
    assert_eq!(got.len(), want.len(), "{tag}: lengths");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let bound = tolerance * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= bound,
            "{tag}: element {i}: {g} against {w}"
        );
    }
}

fn world_context_fused(reproducible: bool, fusion: Option<usize>, local: usize) -> Context {
    let o = Options::host(local);
    o.set_timeout_ms(60_000);
    if let Some(bytes) = fusion {
        o.set_fusion_bytes(bytes);
    }
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    unsafe {
        check(
            dpsync_options_set_world_mpi(o.0, ptr::null()),
            "set_world_mpi",
        );
        check(
            dpsync_options_set_reproducible(o.0, reproducible),
            "set_reproducible",
        );
    }
    Context::new(&o)
}

/// Rank `r`'s element `i` of a gradient: sums that round (so that the summation order
/// shows), small integers for integer dtypes.
fn inexact(dtype: DType, r: usize, i: usize) -> f64 {
    value(dtype, r, i)
        + match dtype {
            DType::I32 | DType::I64 => 0.0,
            _ => 0.013 * (r + 1) as f64 + 1e-3 * (i % 11) as f64,
        }
}

/// Registers tensors of `counts` elements as `role` (`prefix` names them) filled by
/// `fill(t, i)`; their memory.
fn tensors(
    ctx: &Context,
    dtype: DType,
    (role, prefix): (u32, &str),
    counts: &[usize],
    fill: impl Fn(usize, usize) -> f64,
) -> Vec<Vec<u8>> {
    let mut mems: Vec<Vec<u8>> = (counts.iter().enumerate())
        .map(|(t, &n)| encode(dtype, &(0..n).map(|i| fill(t, i)).collect::<Vec<_>>()))
        .collect();
    for (t, m) in mems.iter_mut().enumerate() {
        let st = register_raw(
            ctx.0,
            &format!("{prefix}{t}"),
            role,
            0,
            m.as_mut_ptr().cast(),
            counts[t],
            dtype.code(),
        );
        check(st, "register");
    }
    mems
}

/// Buckets started early (`dpsync_grad_ready`, every gradient marked from the second step
/// on) serve an allreduce step and a reduce-scatter step alike, whatever the previous step
/// was: the bytes of the same steps without marks. `local` replicas on this rank, world
/// replicas `offset..`.
fn overlap_serves_either_step(rank: usize, ranks: usize, (local, offset): (usize, usize)) {
    let counts = [40_000usize, 3, 20_001, 7];
    let shapes = [false, true, true, false, true, false, false, true];
    let fusion = Some(64 << 10);
    let (marked, plain) = (
        world_context_fused(false, fusion, local),
        world_context_fused(false, fusion, local),
    );
    let value = |step: usize, w: usize, t: usize, i: usize| inexact(DType::F32, w + step, i + t);
    // mems[context][t][r]: each context's tensors on each local replica.
    let mut mems: Vec<Vec<Vec<Vec<u8>>>> = vec![Vec::new(), Vec::new()];
    for (ctx, mine) in [&marked, &plain].into_iter().zip(mems.iter_mut()) {
        for (t, &n) in counts.iter().enumerate() {
            let mut row: Vec<Vec<u8>> = (0..local)
                .map(|r| {
                    let v: Vec<f64> = (0..n).map(|i| value(0, offset + r, t, i)).collect();
                    encode(DType::F32, &v)
                })
                .collect();
            for (r, m) in row.iter_mut().enumerate() {
                let (name, ptr) = (format!("g{t}"), m.as_mut_ptr().cast());
                check(register_raw(ctx.0, &name, GRAD, r, ptr, n, F32), "register");
            }
            mine.push(row);
        }
    }
    for (step, &scatter) in shapes.iter().enumerate() {
        let tag = format!("rank {rank} of {ranks}: overlap step {step} (scatter {scatter})");
        for (t, &n) in counts.iter().enumerate() {
            for r in 0..local {
                let v: Vec<f64> = (0..n).map(|i| value(step, offset + r, t, i)).collect();
                let v = encode(DType::F32, &v);
                mems[0][t][r].copy_from_slice(&v);
                mems[1][t][r].copy_from_slice(&v);
            }
        }
        if step > 0 {
            for t in (0..counts.len()).rev() {
                for r in 0..local {
                    check(marked.grad_ready(&format!("g{t}"), r), &tag);
                }
            }
            let early = marked.describe_json()["overlap"]["buckets_reduced_early_this_step"]
                .as_u64()
                .unwrap();
            assert!(early > 0, "{tag}: nothing started early");
        }
        for ctx in [&marked, &plain] {
            let st = match scatter {
                true => reduce_scatter(ctx, AVG),
                false => ctx.allreduce_grads(AVG),
            };
            check(st, &tag);
        }
        // A started bucket's sums are the allreduce's.
        for (t, (marked, plain)) in mems[0].iter().zip(&mems[1]).enumerate() {
            for (r, (m, p)) in marked.iter().zip(plain).enumerate() {
                let tag = format!("{tag}: g{t} on replica {r}");
                assert_sums(DType::F32, (m, p), ranks, &tag);
            }
        }
    }
}

#[test]
fn world_body() {
    let Some((rank, ranks)) = as_rank("world_body") else {
        return;
    };
    let tag = |what: &str| format!("rank {rank} of {ranks}: {what}");
    // ZeRO-1 across the ranks: the reduce-scatter's sums are the allreduce's (through
    // shared memory, one ring; or 2 ranks), so the parameters are byte-identical there.
    let (plain, _) = train_in(&world_context(false), &Place::Host, (1, rank), false, 5);
    let (zero, kept) = train_in(&world_context(false), &Place::Host, (1, rank), true, 5);
    let what = tag("ZeRO-1 against allreduce: the parameters");
    assert_sums(DType::F32, (&zero[0], &plain[0]), ranks, &what);
    let total: usize = SIZES.iter().sum::<usize>() * 2;
    assert!(
        kept[0] * ranks <= total + 2 * SIZES.len() * ranks,
        "{}",
        tag(&format!("optimizer state {kept:?} of {total}"))
    );
    overlap_serves_either_step(rank, ranks, (1, rank));
    for counts in [vec![13usize, 2, 5], vec![40_000, 3, 20_001]] {
        for dtype in DType::ALL {
            for (op, reproducible) in [(SUM, false), (AVG, false), (AVG, true)] {
                let what = format!("{dtype:?} op {op} reproducible {reproducible}, {counts:?}");
                let reduced = |sharded: bool| {
                    let ctx = world_context(reproducible);
                    let mut g = tensors(&ctx, dtype, (GRAD, "g"), &counts, |t, i| {
                        inexact(dtype, rank, i + t)
                    });
                    let st = match sharded {
                        true => reduce_scatter(&ctx, op),
                        false => ctx.allreduce_grads(op),
                    };
                    check(st, &tag(&what));
                    drop(ctx);
                    std::mem::take(&mut g)
                };
                let (whole, sharded) = (reduced(false), reduced(true));
                let size = dtype.size();
                for (t, &n) in counts.iter().enumerate() {
                    let before: Vec<f64> = (0..n).map(|i| inexact(dtype, rank, i + t)).collect();
                    let before = encode(dtype, &before);
                    let (at, k) = (n * rank / ranks, n * (rank + 1) / ranks - n * rank / ranks);
                    let (lo, hi) = (at * size, (at + k) * size);
                    let tag = tag(&format!("{what}: g{t}"));
                    let owned = (&sharded[t][lo..hi], &whole[t][lo..hi]);
                    assert_sums(dtype, owned, ranks, &format!("{tag}: owned"));
                    assert_eq!(sharded[t][..lo], before[..lo], "{tag}: before the piece");
                    assert_eq!(sharded[t][hi..], before[hi..], "{tag}: after the piece");
                }
            }
            // Allgather: each rank fills its pieces (the rest with its own rank's
            // values); every rank ends with every owner's.
            let ctx = world_context(false);
            let mark = |r: usize, t: usize, i: usize| ((r * 7 + t * 3 + i) % 13) as f64;
            let p = tensors(&ctx, dtype, (PARAM, "p"), &counts, |t, i| {
                let at = counts[t] * rank / ranks;
                let end = counts[t] * (rank + 1) / ranks;
                match (at..end).contains(&i) {
                    true => mark(rank, t, i),
                    false => mark(rank, t, i) + 1.0,
                }
            });
            check(allgather(&ctx, PARAM), &tag("allgather"));
            drop(ctx);
            for (t, &n) in counts.iter().enumerate() {
                let owner = |i: usize| (0..ranks).find(|&w| i < n * (w + 1) / ranks).unwrap();
                let want: Vec<f64> = (0..n).map(|i| mark(owner(i), t, i)).collect();
                assert_eq!(
                    p[t],
                    encode(dtype, &want),
                    "{}",
                    tag(&format!("allgather {dtype:?}, p{t} of {n}"))
                );
            }
        }
    }
}
