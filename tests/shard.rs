//! Shards (ZeRO stage 1) through the C ABI, on host replicas and, where a CUDA driver is found
//! (scripts/fake-cuda.sh runs this file on the fake driver and NCCL, synchronous and
//! asynchronous streams), on CUDA replicas:
//!
//! - Adam trained both ways on 1, 2, 3 and 4 replicas (allreduce + the update on every replica,
//!   or reduce-scatter + the update of the owned pieces with state for them alone + allgather)
//!   gives byte-identical parameters, with about 1/W of the optimizer state per replica;
//! - every dtype, SUM and AVG: the owned pieces hold what allreduce_grads gives, every other
//!   element is left as it was;
//! - bad input: the documented statuses, nothing changed.
// Per-replica buffers indexed by replica: indexed loops read best.
#![allow(clippy::needless_range_loop)]

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod float16;
    pub mod lcg;
    #[cfg(feature = "mpi")]
    pub mod mpi;
    pub mod place;
    pub mod skip;
}

use std::ffi::c_void;
use std::ptr;

use common::buf::DType;
use common::place::{synchronize, Mem, Place};
use common::{abi::*, context::*};
use dpsync::*;

/// Each test on the host, then where a CUDA driver is found on every GPU (the replicas spread
/// over them) and, with several GPUs, on GPU 0 alone (its own reduce-scatter and allgather
/// kernels).
fn places(test: &str) -> Vec<Place> {
    let mut places = vec![Place::Host];
    if let Some(Place::Gpu(streams)) = Place::gpu(test) {
        if streams.len() > 1 {
            places.push(Place::Gpu(streams[..1].to_vec()));
        }
        places.push(Place::Gpu(streams));
    }
    places
}

/// The GPU of replica `r`: spread over every visible GPU (four on the fake driver's
/// multi-GPU runs: NCCL, peer copies and staged copies between them).
fn ordinal(place: &Place, r: usize) -> i32 {
    match place {
        Place::Host => 0,
        Place::Gpu(streams) => (r % streams.len()) as i32,
    }
}

fn context(place: &Place, test: &str, replicas: usize) -> Context {
    let ordinals: Vec<i32> = (0..replicas).map(|r| ordinal(place, r)).collect();
    place
        .context(test, &ordinals, T_AUTO, false)
        .expect("a context where the place was made")
}

fn shard_of(ctx: &Context, name: &str, replica: usize) -> (usize, usize) {
    let (mut offset, mut count) = (usize::MAX, usize::MAX);
    let c = cstr(name);
    // SAFETY: valid handle, name and out pointers.
    let st = unsafe { dpsync_shard(ctx.0, c.as_ptr(), replica, &mut offset, &mut count) };
    check(st, &format!("dpsync_shard '{name}' on replica {replica}"));
    (offset, count)
}

fn reduce_scatter(ctx: &Context, op: u32) -> dpsync_status {
    // SAFETY: valid handle.
    unsafe { dpsync_reduce_scatter_grads(ctx.0, op) }
}

fn allgather(ctx: &Context, roles: u32) -> dpsync_status {
    // SAFETY: valid handle.
    unsafe { dpsync_allgather(ctx.0, roles) }
}

fn settle(place: &Place, ctx: &Context) {
    if let Place::Gpu(_) = place {
        check(synchronize(ctx), "dpsync_synchronize");
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

const SIZES: [usize; 4] = [10, 7, 3, 1];

/// World replica `r`'s gradient of tensor `t` at step `s`.
fn grad(s: usize, r: usize, t: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((s * 31 + r * 17 + t * 7 + i * 13) % 23) as f32 * 0.1 - 1.1)
        .collect()
}

/// Adam on `p` from `g`, state `m`, `v` (as long as `p`), step `t` from 1.
fn adam(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], t: i32) {
    let (lr, b1, b2, eps) = (0.01f32, 0.9f32, 0.999f32, 1e-8f32);
    for i in 0..p.len() {
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        let mh = m[i] / (1.0 - b1.powi(t));
        let vh = v[i] / (1.0 - b2.powi(t));
        p[i] -= lr * mh / (vh.sqrt() + eps);
    }
}

/// Trains the model `steps` steps on `replicas` replicas, sharded or not: every replica's final
/// parameters (bytes) and the optimizer-state elements each replica kept.
fn train(
    place: &Place,
    replicas: usize,
    sharded: bool,
    steps: usize,
) -> (Vec<Vec<u8>>, Vec<usize>) {
    let ctx = context(place, "zero1_gives_the_bytes_of_allreduce", replicas);
    train_in(&ctx, place, (replicas, 0), sharded, steps)
}

/// [`train`] in `ctx`, whose `replicas` local replicas are world replicas `offset..` (their
/// gradients).
fn train_in(
    ctx: &Context,
    place: &Place,
    (replicas, offset): (usize, usize),
    sharded: bool,
    steps: usize,
) -> (Vec<Vec<u8>>, Vec<usize>) {
    let init = |t: usize, n: usize| -> Vec<f32> {
        (0..n).map(|i| (i % 5) as f32 * 0.01 + t as f32).collect()
    };
    let mut params: Vec<Vec<Mem>> = Vec::new();
    let mut grads: Vec<Vec<Mem>> = Vec::new();
    for (t, &n) in SIZES.iter().enumerate() {
        params.push(
            (0..replicas)
                .map(|r| place.mem_on(ordinal(place, r), &bytes_of(&init(t, n))))
                .collect(),
        );
        grads.push(
            (0..replicas)
                .map(|r| place.mem_on(ordinal(place, r), &bytes_of(&vec![0.0; n])))
                .collect(),
        );
        for r in 0..replicas {
            let (p, g) = (params[t][r].ptr(), grads[t][r].ptr());
            check(
                register_raw(ctx.0, &format!("p{t}"), PARAM, r, p as *mut c_void, n, F32),
                "register",
            );
            check(
                register_raw(ctx.0, &format!("g{t}"), GRAD, r, g as *mut c_void, n, F32),
                "register",
            );
        }
    }
    // Optimizer state per (tensor, replica): for the owned piece only when sharded.
    let piece = |t: usize, r: usize| match sharded {
        true => shard_of(ctx, &format!("p{t}"), r),
        false => (0, SIZES[t]),
    };
    let mut state: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..SIZES.len())
        .map(|t| {
            (0..replicas)
                .map(|r| (vec![0.0; piece(t, r).1], vec![0.0; piece(t, r).1]))
                .collect()
        })
        .collect();
    for s in 0..steps {
        for (t, &n) in SIZES.iter().enumerate() {
            for r in 0..replicas {
                grads[t][r].write(&bytes_of(&grad(s, offset + r, t, n)));
            }
        }
        let st = if sharded {
            reduce_scatter(ctx, AVG)
        } else {
            ctx.allreduce_grads(AVG)
        };
        check(st, "gradient step");
        settle(place, ctx);
        for t in 0..SIZES.len() {
            for r in 0..replicas {
                let g = f32s(&grads[t][r].read());
                let mut p = f32s(&params[t][r].read());
                let (at, n) = piece(t, r);
                let (m, v) = &mut state[t][r];
                adam(&mut p[at..at + n], &g[at..at + n], m, v, s as i32 + 1);
                params[t][r].write(&bytes_of(&p));
            }
        }
        if sharded {
            check(allgather(ctx, PARAM), "allgather");
            settle(place, ctx);
        }
    }
    let finals = (0..replicas)
        .map(|r| params.iter().flat_map(|p| p[r].read()).collect())
        .collect();
    let kept = (0..replicas)
        .map(|r| state.iter().map(|s| s[r].0.len() + s[r].1.len()).sum())
        .collect();
    (finals, kept)
}

#[test]
fn zero1_gives_the_bytes_of_allreduce() {
    for place in places("zero1_gives_the_bytes_of_allreduce") {
        for replicas in 1..=4 {
            let (plain, full) = train(&place, replicas, false, 5);
            let (zero, kept) = train(&place, replicas, true, 5);
            for r in 0..replicas {
                assert_eq!(
                    zero[r], plain[r],
                    "{replicas} replicas: replica {r}'s parameters"
                );
                assert_eq!(zero[r], zero[0], "{replicas} replicas: replicas agree");
            }
            let total: usize = SIZES.iter().sum::<usize>() * 2;
            assert_eq!(full, vec![total; replicas]);
            assert_eq!(
                kept.iter().sum::<usize>(),
                total,
                "{replicas}: every element once"
            );
            for k in &kept {
                // About 1/W: each tensor's piece within one element of count / W.
                assert!(
                    k * replicas <= total + 2 * SIZES.len() * replicas,
                    "{replicas}: {kept:?}"
                );
            }
        }
    }
}

/// Small values of `dtype` (exact sums), replica `r`'s element `i`.
fn value(dtype: DType, r: usize, i: usize) -> f64 {
    let v = ((r * 5 + i * 3) % 7) as f64;
    match dtype {
        DType::I32 | DType::I64 => v - 3.0,
        _ => v * 0.5,
    }
}

fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    match dtype {
        DType::I32 => v.iter().flat_map(|&x| (x as i32).to_ne_bytes()).collect(),
        DType::I64 => v.iter().flat_map(|&x| (x as i64).to_ne_bytes()).collect(),
        _ => common::place::encode(dtype, v),
    }
}

#[test]
fn owned_pieces_get_the_allreduce_and_the_rest_stays() {
    for place in places("owned_pieces_get_the_allreduce_and_the_rest_stays") {
        for dtype in DType::ALL {
            for op in [SUM, AVG] {
                let replicas = 3;
                let n = [13usize, 2, 5];
                let run = |sharded: bool| -> Vec<Vec<Vec<u8>>> {
                    let ctx = context(&place, "owned_pieces", replicas);
                    let mems: Vec<Vec<Mem>> = (n.iter().enumerate())
                        .map(|(t, &count)| {
                            (0..replicas)
                                .map(|r| {
                                    let v: Vec<f64> =
                                        (0..count).map(|i| value(dtype, r, i + t)).collect();
                                    place.mem_on(ordinal(&place, r), &encode(dtype, &v))
                                })
                                .collect()
                        })
                        .collect();
                    for (t, per) in mems.iter().enumerate() {
                        for (r, m) in per.iter().enumerate() {
                            let st = register_raw(
                                ctx.0,
                                &format!("g{t}"),
                                GRAD,
                                r,
                                m.ptr() as *mut c_void,
                                n[t],
                                dtype.code(),
                            );
                            check(st, "register");
                        }
                    }
                    let st = if sharded {
                        reduce_scatter(&ctx, op)
                    } else {
                        ctx.allreduce_grads(op)
                    };
                    check(st, &format!("{dtype:?} op {op}"));
                    settle(&place, &ctx);
                    mems.iter()
                        .map(|per| per.iter().map(Mem::read).collect())
                        .collect()
                };
                let (whole, sharded) = (run(false), run(true));
                let size = dtype.size();
                for (t, &count) in n.iter().enumerate() {
                    for r in 0..replicas {
                        let before: Vec<f64> = (0..count).map(|i| value(dtype, r, i + t)).collect();
                        let before = encode(dtype, &before);
                        // The contract's rule, written out.
                        let (at, k) = (
                            count * r / replicas,
                            count * (r + 1) / replicas - count * r / replicas,
                        );
                        let tag = format!("{dtype:?} op {op}: g{t} on replica {r}");
                        let (lo, hi) = (at * size, (at + k) * size);
                        assert_eq!(sharded[t][r][lo..hi], whole[t][r][lo..hi], "{tag}: owned");
                        assert_eq!(sharded[t][r][..lo], before[..lo], "{tag}: before the piece");
                        assert_eq!(sharded[t][r][hi..], before[hi..], "{tag}: after the piece");
                    }
                }
            }
        }
    }
}

/// The gradients' first values again, in place (their registered addresses stay).
fn refill(g: &mut [Vec<f32>; 2]) {
    g[0].fill(1.0);
    g[1].fill(3.0);
}

#[test]
fn bad_input_gets_its_status_and_changes_nothing() {
    let ctx = Context::host(2, None);
    let mut p = [vec![1.0f32; 5], vec![2.0f32; 5]];
    let mut g = [vec![1.0f32; 5], vec![3.0f32; 5]];
    for r in 0..2 {
        ctx.reg("p", PARAM, r, &mut p[r], F32);
        ctx.reg("g", GRAD, r, &mut g[r], F32);
    }
    let (mut offset, mut count) = (0usize, 0usize);
    let name = cstr("p");
    let unknown = cstr("nope");
    // SAFETY: valid handle; the NULL pointers are what is tested.
    unsafe {
        assert_eq!(
            dpsync_shard(ctx.0, unknown.as_ptr(), 0, &mut offset, &mut count),
            NOT_FOUND
        );
        assert!(last_error().contains("nope"), "{}", last_error());
        assert_eq!(
            dpsync_shard(ctx.0, name.as_ptr(), 2, &mut offset, &mut count),
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("replica 2"), "{}", last_error());
        assert_eq!(
            dpsync_shard(ctx.0, name.as_ptr(), 0, ptr::null_mut(), &mut count),
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("offset"), "{}", last_error());
        assert_eq!(
            dpsync_shard(ctx.0, name.as_ptr(), 0, &mut offset, ptr::null_mut()),
            INVALID_ARGUMENT
        );
        assert_eq!(
            dpsync_shard(ctx.0, ptr::null(), 0, &mut offset, &mut count),
            INVALID_ARGUMENT
        );
        assert_eq!(
            dpsync_shard(ptr::null(), name.as_ptr(), 0, &mut offset, &mut count),
            INVALID_ARGUMENT
        );
    }
    for roles in [0, 0x10, 0x8000_0001] {
        assert_eq!(allgather(&ctx, roles), INVALID_ARGUMENT, "roles {roles:#x}");
        assert!(last_error().contains("roles"), "{}", last_error());
    }
    assert_eq!(reduce_scatter(&ctx, 7), INVALID_ARGUMENT);
    assert!(last_error().contains("op"), "{}", last_error());
    assert_eq!(p, [vec![1.0; 5], vec![2.0; 5]], "nothing changed");
    assert_eq!(g, [vec![1.0; 5], vec![3.0; 5]], "nothing changed");
    // A gradient registered differently on the replicas: INCONSISTENT naming it.
    let mut h = [vec![0f32; 4], vec![0f32; 3]];
    ctx.reg("h", GRAD, 0, &mut h[0], F32);
    ctx.reg("h", GRAD, 1, &mut h[1], F32);
    assert_eq!(reduce_scatter(&ctx, SUM), INCONSISTENT);
    assert!(last_error().contains("'h'"), "{}", last_error());
    assert_eq!(g, [vec![1.0; 5], vec![3.0; 5]], "nothing changed");
    check(ctx.unregister("h"), "unregister");
    // After an allreduce step, buckets marked ready are reduced whole early: finishing that
    // step with a reduce-scatter is refused, nothing changed; allreduce_grads ends it.
    check(ctx.allreduce_grads(SUM), "allreduce");
    assert_eq!(g, [vec![4.0; 5], vec![4.0; 5]]);
    refill(&mut g);
    for r in 0..2 {
        check(ctx.grad_ready("g", r), "grad_ready");
    }
    assert_eq!(reduce_scatter(&ctx, SUM), INVALID_STATE);
    assert!(
        last_error().contains("dpsync_allreduce_grads"),
        "{}",
        last_error()
    );
    check(ctx.allreduce_grads(SUM), "the step ends");
    // After a reduce-scatter step early buckets reduce-scatter (onto the owned pieces alone),
    // and either call may end the step: an allreduce gathers their pieces.
    let scattered = [vec![4.0, 4.0, 1.0, 1.0, 1.0], vec![3.0, 3.0, 4.0, 4.0, 4.0]];
    refill(&mut g);
    check(reduce_scatter(&ctx, SUM), "reduce-scatter");
    assert_eq!(g, scattered);
    for end_with_allreduce in [false, true] {
        refill(&mut g);
        for r in 0..2 {
            check(ctx.grad_ready("g", r), "grad_ready");
        }
        assert_eq!(
            ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"],
            1
        );
        assert_eq!(g, scattered, "reduce-scattered by grad_ready");
        match end_with_allreduce {
            false => {
                check(reduce_scatter(&ctx, SUM), "reduce-scatter after marks");
                assert_eq!(g, scattered);
            }
            true => {
                check(ctx.allreduce_grads(SUM), "allreduce after marks");
                assert_eq!(g, [vec![4.0; 5], vec![4.0; 5]]);
            }
        }
    }
    check(allgather(&ctx, GRAD), "allgather");
    assert_eq!(g[0], g[1]);
}

/// Worlds of one host replica per rank (the engine's own reduce-scatter and allgather, straight
/// from and into the tensors; `scripts/test.sh` runs this under the MPI build), 1 to 4 ranks,
/// and 2 and 3 without shared memory:
/// ZeRO-1 gives the bytes of allreduce; every dtype, SUM and AVG, with and without reproducible
/// sums, small buckets (one MPI allreduce per piece) and large ones (the ring through shared
/// memory): the owned pieces hold what allreduce_grads gives, every other element stays, and
/// allgather gives every rank the owners' pieces.
#[cfg(feature = "mpi")]
mod world {
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
        let value =
            |step: usize, w: usize, t: usize, i: usize| inexact(DType::F32, w + step, i + t);
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
                        let before: Vec<f64> =
                            (0..n).map(|i| inexact(dtype, rank, i + t)).collect();
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
}
