//! Reproducible sums (`dpsync_options_set_reproducible`) through the C ABI: the same
//! contributions give the same bytes whatever the arrangement.
//!
//! - One process, 1..8 host replicas: permuting which replica holds which contribution, fusion
//!   64 bytes or 1 MiB, `dpsync_grad_ready` before the step, and the calls that sum
//!   (allreduce_grads, reduce_scatter_grads, allreduce, average) give identical bytes, for
//!   every float dtype, SUM and AVG; without the option some arrangement differs (so the data
//!   does exercise the summation order).
//! - Accuracy against the exact sum (integer arithmetic) on data spanning 40 binades with
//!   cancelling elements; NaN and infinities propagate; integers are untouched.
//! - CUDA replicas (where a driver is found: scripts/fake-cuda.sh runs this file on the fake
//!   driver and NCCL, synchronous and asynchronous streams) give the host's bytes: on one GPU,
//!   over 2-4 GPUs (raw blocks to their owners), and 7, 8 and 9 replicas on two GPUs (exponent
//!   fields and integer sums across the GPUs); the fake NCCL's counts show each route's bytes.
//! - Worlds (`--features mpi`): 8 replicas as 2 ranks of 5+3, 3 of 3+3+2, 4 of 2 and 8 of 1
//!   give the bytes of one process of 8; ranks that disagree on the option create no context.
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
    pub mod sparse;
}

use common::buf::DType;
use common::cuda_context::cuda_context;
use common::fake_nccl;
use common::float16::{f32_to_bf16, f32_to_f16};
use common::lcg::Lcg;
use common::place::{decode, synchronize, Mem, Place};
use common::{abi::*, context::*};
use dpsync::*;

/// Held by this binary's tests that use the GPUs: the fake NCCL's byte counters are the
/// process's, so a test counting them must not share the process's NCCL with another test
/// (the harness runs tests on several threads).
static GPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn gpus_alone() -> std::sync::MutexGuard<'static, ()> {
    GPUS.lock().unwrap_or_else(|e| e.into_inner())
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
/// Elements per tensor: several blocks of the host kernels, and not a multiple of any.
const N: usize = 1283;

/// The dtype's bytes of `v` (rounded to nearest).
fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|&x| (x as f32).to_ne_bytes()).collect(),
        DType::F64 => v.iter().flat_map(|&x| x.to_ne_bytes()).collect(),
        DType::F16 => (v.iter())
            .flat_map(|&x| f32_to_f16(x as f32).to_ne_bytes())
            .collect(),
        DType::BF16 => (v.iter())
            .flat_map(|&x| f32_to_bf16(x as f32).to_ne_bytes())
            .collect(),
        DType::I32 => v.iter().flat_map(|&x| (x as i32).to_ne_bytes()).collect(),
        DType::I64 => v.iter().flat_map(|&x| (x as i64).to_ne_bytes()).collect(),
    }
}

/// Contribution `c` of `w` for `dtype`: magnitudes over 40 binades (f16: 20, its range), both
/// signs, and every 5th element cancelling (contributions of opposite signs around a small
/// remainder), as the dtype holds them.
fn contribution(dtype: DType, c: usize, w: usize, seed: u64) -> Vec<u8> {
    contribution_of(dtype, (c, w), seed, N)
}

/// [`contribution`] of `n` elements.
fn contribution_of(dtype: DType, (c, w): (usize, usize), seed: u64, n: usize) -> Vec<u8> {
    let span = if dtype == DType::F16 { 10 } else { 20 };
    let mut lcg = Lcg::new(seed * 7919 + dtype.code() as u64);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // The same draws for every contribution, then this contribution's own.
        let base = lcg.uniform(-1.0, 1.0) * 2f64.powi(lcg.below(2 * span) as i32 - span as i32);
        let mut own = Lcg::new(seed ^ ((c as u64) << 32) ^ i as u64);
        let mine = own.uniform(-1.0, 1.0) * 2f64.powi(own.below(2 * span) as i32 - span as i32);
        let v = match (i % 5, dtype) {
            (0, _) if w > 1 => match c % 2 {
                0 => base + mine * 2f64.powi(-12),
                _ => -base,
            },
            (_, DType::I32 | DType::I64) => (own.below(2001) as f64) - 1000.0,
            _ => mine,
        };
        out.push(v);
    }
    encode(dtype, &out)
}

/// The contributions as f64 (exactly: every dtype widens exactly).
fn values(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    decode(dtype, bytes)
}

/// One run: replica r holds contribution `arrangement[r]` of every dtype's tensor `g_<dtype>`
/// (GRAD) and `w_<dtype>` (PARAM, the same values); `call` reduces; the result of replica 0
/// per tensor, in FLOATS order then I32, after checking that every replica holds it.
struct Run {
    mems: Vec<Vec<Mem>>, // [tensor][replica]
    ctx: Context,
}

const TENSORS: [DType; 5] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32];

fn name(role: &str, dtype: DType) -> String {
    format!("{role}_{}", dtype.name())
}

impl Run {
    /// `w`: the world's replica count (the contributions depend on it).
    fn new(ctx: Context, place: &Place, arrangement: &[usize], w: usize) -> Run {
        Run::sized(ctx, place, arrangement, w, N)
    }

    /// [`Run::new`] with tensors of `n` elements.
    fn sized(ctx: Context, place: &Place, arrangement: &[usize], w: usize, n: usize) -> Run {
        let mut mems = Vec::new();
        for dtype in TENSORS {
            for role in ["g", "w"] {
                let mut per_replica = Vec::new();
                for (r, &c) in arrangement.iter().enumerate() {
                    let bytes = contribution_of(dtype, (c, w), 1, n);
                    let mem = place.mem_on(ordinal(place, r), &bytes);
                    let role_code = if role == "g" { GRAD } else { PARAM };
                    let ptr = mem.ptr() as *mut std::ffi::c_void;
                    let st = register_raw(
                        ctx.0,
                        &name(role, dtype),
                        role_code,
                        r,
                        ptr,
                        n,
                        dtype.code(),
                    );
                    check(st, "register");
                    per_replica.push(mem);
                }
                mems.push(per_replica);
            }
        }
        Run { mems, ctx }
    }

    /// Tensor `t` (index into TENSORS) of `role` on replica `r`.
    fn read(&self, t: usize, role: usize, r: usize) -> Vec<u8> {
        synchronize(&self.ctx);
        self.mems[t * 2 + role][r].read()
    }

    /// Every replica's copy of the role's tensors, checked equal; replica 0's.
    fn result(&self, role: usize) -> Vec<Vec<u8>> {
        let replicas = self.mems[0].len();
        (0..TENSORS.len())
            .map(|t| {
                let first = self.read(t, role, 0);
                for r in 1..replicas {
                    assert_eq!(self.read(t, role, r), first, "{:?} replica {r}", TENSORS[t]);
                }
                first
            })
            .collect()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // The context goes before the memory it names.
        synchronize(&self.ctx);
    }
}

fn ordinal(place: &Place, r: usize) -> i32 {
    match place {
        Place::Host => 0,
        Place::Gpu(streams) => (r % streams.len()) as i32,
    }
}

fn context(
    place: &Place,
    test: &str,
    replicas: usize,
    reproducible: bool,
    fusion: usize,
) -> Context {
    context_over(place, test, replicas, (reproducible, fusion), T_AUTO)
}

fn context_over(
    place: &Place,
    test: &str,
    replicas: usize,
    (reproducible, fusion): (bool, usize),
    transport: u32,
) -> Context {
    let configure = |o: &Options| {
        o.set_fusion_bytes(fusion);
        if let Place::Gpu(_) = place {
            o.set_transport(transport);
        }
        // SAFETY: valid options.
        check(
            unsafe { dpsync_options_set_reproducible(o.0, reproducible) },
            "set_reproducible",
        );
    };
    match place {
        Place::Host => {
            let o = Options::host(replicas);
            configure(&o);
            Context::new(&o)
        }
        Place::Gpu(_) => {
            let ordinals: Vec<i32> = (0..replicas).map(|r| ordinal(place, r)).collect();
            cuda_context(test, &ordinals, configure).expect("a CUDA context where one was made")
        }
    }
}

const DEFAULT_FUSION: usize = 1 << 20;

/// allreduce_grads' result (GRAD tensors) for `arrangement`.
fn grads(
    place: &Place,
    arrangement: &[usize],
    op: u32,
    reproducible: bool,
    fusion: usize,
) -> Vec<Vec<u8>> {
    let ctx = context(place, "grads", arrangement.len(), reproducible, fusion);
    let run = Run::new(ctx, place, arrangement, arrangement.len());
    check(run.ctx.allreduce_grads(op), "allreduce_grads");
    run.result(0)
}

fn permutation(w: usize, seed: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..w).collect();
    let mut lcg = Lcg::new(seed);
    for i in (1..w).rev() {
        p.swap(i, lcg.below(i as u64 + 1) as usize);
    }
    p
}

/// The exact sum of `w` contributions of element i, as an integer at scale 2^90 (every
/// contribution of the test data is a multiple of 2^-90 below 2^30), and the largest
/// contribution's magnitude.
fn exact(dtype: DType, contributions: &[Vec<f64>], i: usize) -> (f64, f64) {
    let mut sum: i128 = 0;
    let mut largest: f64 = 0.0;
    for c in contributions {
        let scaled = c[i] * 2f64.powi(90);
        assert_eq!(scaled.fract(), 0.0, "{dtype:?}: test data finer than 2^-90");
        sum += scaled as i128;
        largest = largest.max(c[i].abs());
    }
    (sum as f64 * 2f64.powi(-90), largest)
}

/// One unit in the last place of `x` in `dtype`.
fn ulp(dtype: DType, x: f64) -> f64 {
    let (frac, min_exp) = match dtype {
        DType::F32 => (23, -126),
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
        _ => unreachable!(),
    };
    let e = if x == 0.0 {
        min_exp
    } else {
        (x.abs().log2().floor() as i32).max(min_exp)
    };
    2f64.powi(e - frac)
}

/// Every element of `result` is within the contract's bound of the exact sum (divided by `w`
/// for AVG).
fn check_accuracy(dtype: DType, result: &[u8], w: usize, avg: bool) {
    let contributions: Vec<Vec<f64>> = (0..w)
        .map(|c| values(dtype, &contribution(dtype, c, w, 1)))
        .collect();
    let got = values(dtype, result);
    for i in 0..N {
        let (sum, largest) = exact(dtype, &contributions, i);
        let want = if avg { sum / w as f64 } else { sum };
        let err = (got[i] - want).abs();
        let ok = match dtype {
            DType::F64 => err <= largest * 2f64.powi(-36) / if avg { w as f64 } else { 1.0 },
            _ if sum.abs() < largest * 2f64.powi(-12) => true, // cancels: outside the bound
            _ => err <= ulp(dtype, want) * 1.0000001,
        };
        assert!(
            ok,
            "{dtype:?} element {i} of {w}: got {} want {want} (largest {largest})",
            got[i]
        );
    }
}

#[test]
fn host_arrangements_fusion_and_order_give_the_same_bytes() {
    let place = Place::Host;
    for w in [1, 2, 3, 5, 8] {
        for (op, avg) in [(SUM, false), (AVG, true)] {
            let identity: Vec<usize> = (0..w).collect();
            let reference = grads(&place, &identity, op, true, DEFAULT_FUSION);
            for (k, dtype) in FLOATS.iter().enumerate() {
                check_accuracy(*dtype, &reference[k], w, avg);
            }
            for seed in 1..3 {
                for fusion in [64, DEFAULT_FUSION] {
                    let p = permutation(w, seed);
                    let got = grads(&place, &p, op, true, fusion);
                    for (t, dtype) in TENSORS.iter().enumerate() {
                        assert_eq!(
                            got[t], reference[t],
                            "{w} replicas {p:?} fusion {fusion} {dtype:?} op {op}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn without_the_option_the_arrangement_shows() {
    let identity: Vec<usize> = (0..8).collect();
    let plain = grads(&Place::Host, &identity, SUM, false, DEFAULT_FUSION);
    let differs = (1..6).any(|seed| {
        let got = grads(
            &Place::Host,
            &permutation(8, seed),
            SUM,
            false,
            DEFAULT_FUSION,
        );
        got[0] != plain[0]
    });
    assert!(
        differs,
        "plain f32 sums of this data should depend on the order"
    );
    // Integers are exact either way.
    let repro = grads(&Place::Host, &identity, SUM, true, DEFAULT_FUSION);
    assert_eq!(repro[4], plain[4]);
}

#[test]
fn every_summing_call_agrees_with_allreduce_grads() {
    let place = Place::Host;
    let w = 5;
    let arrangement = permutation(w, 9);
    let want = grads(&place, &arrangement, AVG, true, DEFAULT_FUSION);
    // grad_ready before the step.
    let run = Run::new(
        context(&place, "ready", w, true, 64),
        &place,
        &arrangement,
        w,
    );
    for dtype in TENSORS {
        for r in 0..w {
            check(run.ctx.grad_ready(&name("g", dtype), r), "grad_ready");
        }
    }
    check(run.ctx.allreduce_grads(AVG), "allreduce_grads");
    assert_eq!(run.result(0), want, "after grad_ready");
    // The named allreduce and average of the PARAM copies.
    for dtype in TENSORS {
        check(run.ctx.allreduce(&name("w", dtype), AVG), "allreduce");
    }
    assert_eq!(run.result(1), want, "dpsync_allreduce");
    let run = Run::new(
        context(&place, "average", w, true, DEFAULT_FUSION),
        &place,
        &arrangement,
        w,
    );
    check(run.ctx.average(PARAM), "average");
    assert_eq!(run.result(1), want, "dpsync_average");
    // reduce_scatter_grads: each replica's pieces hold those bytes.
    let run = Run::new(
        context(&place, "shards", w, true, DEFAULT_FUSION),
        &place,
        &arrangement,
        w,
    );
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(run.ctx.0, AVG) },
        "reduce_scatter_grads",
    );
    for (t, dtype) in TENSORS.iter().enumerate() {
        for r in 0..w {
            let (mut offset, mut count) = (0usize, 0usize);
            let c = cstr(&name("g", *dtype));
            // SAFETY: valid handle, name and out pointers.
            check(
                unsafe { dpsync_shard(run.ctx.0, c.as_ptr(), r, &mut offset, &mut count) },
                "shard",
            );
            let s = dtype.size();
            let got = run.read(t, 0, r);
            assert_eq!(
                got[offset * s..(offset + count) * s],
                want[t][offset * s..(offset + count) * s],
                "{dtype:?} replica {r}'s piece"
            );
        }
    }
}

#[test]
fn infinities_and_nans_propagate() {
    let o = Options::host(3);
    // SAFETY: valid options.
    check(unsafe { dpsync_options_set_reproducible(o.0, true) }, "set");
    let ctx = Context::new(&o);
    let rows = [
        [1.0f32, f32::INFINITY, f32::INFINITY, f32::NAN, 2.0],
        [2.0, 1.0, f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY],
        [3.0, 5.0, 0.0, 0.0, 1.0e30],
    ];
    let mut data: Vec<Vec<f32>> = rows.iter().map(|r| r.to_vec()).collect();
    for r in 0..3 {
        ctx.reg("g", GRAD, r, &mut data[r], F32);
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    for r in 0..3 {
        let d = &data[r];
        assert_eq!((d[0], d[1]), (6.0, f32::INFINITY), "replica {r}");
        assert!(d[2].is_nan() && d[3].is_nan(), "replica {r}: {d:?}");
        assert_eq!(d[4], f32::NEG_INFINITY, "replica {r}");
    }
}

#[test]
fn describe_and_plan_show_the_option() {
    let o = Options::host(2);
    assert_eq!(o.plan_json()["reproducible"], false);
    // SAFETY: valid options.
    check(unsafe { dpsync_options_set_reproducible(o.0, true) }, "set");
    assert_eq!(o.plan_json()["reproducible"], true);
    let ctx = Context::new(&o);
    assert_eq!(ctx.describe_json()["reproducible"], true);
    // SAFETY: NULL options are refused.
    let st = unsafe { dpsync_options_set_reproducible(std::ptr::null_mut(), true) };
    assert_eq!(st, INVALID_ARGUMENT);
}

#[test]
fn cuda_replicas_across_gpus_give_the_hosts_bytes() {
    let _alone = gpus_alone();
    let Some(gpu) = Place::gpu("cuda_replicas_across_gpus_give_the_hosts_bytes") else {
        return;
    };
    // Replicas over every GPU (staged through the host), and every replica on GPU 0 (F32 and
    // F64 summed by the device's kernel, F16 and BF16 staged).
    let first = match &gpu {
        Place::Gpu(streams) => Place::Gpu(streams[..1].to_vec()),
        Place::Host => unreachable!("a GPU place"),
    };
    for (place, w, transport) in [
        (&gpu, 4, T_AUTO),
        (&gpu, 3, T_PEER_COPY),
        (&first, 3, T_AUTO),
    ] {
        let arrangement = permutation(w, 4);
        for op in [SUM, AVG] {
            let host = grads(&Place::Host, &arrangement, op, true, DEFAULT_FUSION);
            let ctx = context_over(place, "cuda", w, (true, DEFAULT_FUSION), transport);
            let run = Run::new(ctx, place, &permutation(w, 5), w);
            let sent = fake_nccl::sent_by(&run.ctx, "allreduce_grads (CUDA)", || {
                run.ctx.allreduce_grads(op)
            });
            let devices = match place {
                Place::Gpu(streams) => streams.len(),
                Place::Host => 0,
            };
            assert_eq!(
                run.result(0),
                host,
                "{w} CUDA replicas on {devices} GPU(s), op {op}"
            );
            if let Some(sent) = sent.filter(|s| s[fake_nccl::ALLREDUCE].1 > 0) {
                over_nccl_moves_the_plain_bytes(&sent, devices.min(w), w);
            }
        }
    }
}

#[test]
fn many_replicas_across_two_gpus_give_the_hosts_bytes() {
    let _alone = gpus_alone();
    let Some(Place::Gpu(streams)) = Place::gpu("many_replicas_across_two_gpus") else {
        return;
    };
    if streams.len() < 2 {
        eprintln!("many_replicas_across_two_gpus: skipped: one GPU");
        return;
    }
    // Replicas alternate over two GPUs: 4 + 4, 5 + 4, 4 + 3. F64 sums its integers over NCCL
    // in all three, F32 with 8 and 9 (above 3.5 replicas per GPU).
    let place = Place::Gpu(streams[..2].to_vec());
    for w in [8, 9, 7] {
        for op in [SUM, AVG] {
            let host = grads(&Place::Host, &permutation(w, 6), op, true, DEFAULT_FUSION);
            let ctx = context_over(&place, "many", w, (true, DEFAULT_FUSION), T_AUTO);
            let run = Run::new(ctx, &place, &permutation(w, 7), w);
            let sent = fake_nccl::sent_by(&run.ctx, "allreduce_grads (CUDA)", || {
                run.ctx.allreduce_grads(op)
            });
            assert_eq!(run.result(0), host, "{w} CUDA replicas on 2 GPUs, op {op}");
            if let Some(sent) = sent.filter(|s| s[fake_nccl::ALLREDUCE].1 > 0) {
                over_nccl_moves_the_plain_bytes(&sent, 2, w);
            }
        }
    }
}

/// Whether a float bucket of `size`-byte elements over `w` replicas on `gpus` GPUs sums its
/// integers over NCCL (exponent fields by `ncclMax`, then i64 by `ncclSum`) rather than
/// sending its raw blocks to their owners: where that moves fewer bytes (exec/repro_clique.rs
/// `fields_pay`; a field is a byte for F32, two for F64).
fn by_fields(size: usize, w: usize, gpus: usize) -> bool {
    let field = if size == 8 { 2 } else { 1 };
    (w + gpus) * size > 2 * gpus * (field + 8)
}

/// The fake NCCL's counts of one reproducible `allreduce_grads` over an NCCL clique of
/// `gpus` GPUs holding `w` replicas (the I32 bucket took the plain `ncclAllReduce`): each
/// float bucket went either raw to its owners by `ncclSend`/`ncclRecv` and back by
/// `ncclAllGather`, or as exponent fields (`ncclMax`) and i64 sums (`ncclSum`), moving at most
/// 2.25 times what the plain ring allreduce of those buckets moves (2 (n-1)/n of a bucket per
/// GPU), none through the host stage.
fn over_nccl_moves_the_plain_bytes(sent: &[(u64, u64); 6], gpus: usize, w: usize) {
    use fake_nccl::{ALLGATHER, ALLREDUCE, RECV, SEND};
    let (sends, recvs, gathers, reduces) =
        (sent[SEND], sent[RECV], sent[ALLGATHER], sent[ALLREDUCE]);
    let (g, n) = (gpus as u64, N as u64);
    // The fake's count of one allreduce of `bytes` over the clique: 2 (g-1)/g of it per rank.
    let ring = |bytes: u64| g * (2 * (g - 1) * bytes / g);
    let (mut plain, mut calls, mut fields_bytes) = (0, (0, 0, g), 0);
    let mut routes = Vec::new();
    for (name, size) in [("F32", 4u64), ("F64", 8)] {
        plain += ring(n * size);
        if by_fields(size as usize, w, gpus) {
            calls.2 += 2 * g;
            let bytes = ring(n * if size == 8 { 2 } else { 1 }) + ring(n * 8);
            fields_bytes += bytes;
            let ratio = bytes as f64 / ring(n * size) as f64;
            routes.push(format!("{name}: fields and integers, {ratio:.2}x"));
        } else {
            calls.0 += w as u64 * (g - 1);
            calls.1 += g;
            routes.push(format!("{name}: to the owners"));
        }
    }
    assert_eq!(
        sends.1, calls.0,
        "ncclSend calls (each replica's foreign blocks)"
    );
    assert_eq!(sends.1, recvs.1, "every ncclSend meets an ncclRecv");
    assert_eq!(
        gathers.1, calls.1,
        "one allgather per GPU per float bucket sent raw"
    );
    assert_eq!(
        reduces,
        (fields_bytes + ring(n * 4), calls.2),
        "ncclAllReduce: the I32 bucket, and the fields and integers of the others"
    );
    let moved = sends.0 + gathers.0 + fields_bytes;
    println!(
        "reproducible over NCCL, {w} replicas on {gpus} GPUs: {moved} bytes \
         (send {} + allgather {} + fields and integers {fields_bytes}), the plain ring \
         allreduce {plain} ({:.2}x; {})",
        sends.0,
        gathers.0,
        moved as f64 / plain as f64,
        routes.join("; ")
    );
    assert!(
        4 * moved <= 9 * plain,
        "{moved} bytes moved, the plain allreduce's {plain}: over 2.25x"
    );
}

/// Worlds of ranks (their bodies run under mpirun by name: `world::world_body`).
#[cfg(feature = "mpi")]
#[path = "repro_parts/world.rs"]
mod world;

/// Coalesced sparse sums.
#[path = "repro_parts/sparse_rows.rs"]
mod sparse_rows;
