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
    pub mod fake_nccl;
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

/// Worlds of host replicas (tests/shards/world.rs).
#[cfg(feature = "mpi")]
#[path = "shards/world.rs"]
mod world;

/// NCCL cliques: `ncclReduceScatter` and `ncclAllGather` over owner-packed blocks, and what
/// they send (the fake NCCL's counts).
#[path = "shards/nccl.rs"]
mod nccl;
