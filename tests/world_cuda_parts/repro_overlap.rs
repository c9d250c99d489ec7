//! `dpsync_grad_ready` in a reproducible world of CUDA replicas: float buckets start early
//! under AVG. On the staged route (PEER_COPY), every replica's raw bucket is staged and summed
//! by the engine's reproducible sum (F32 whole through shared memory with one replica per
//! rank, else, and BF16 always, the owners' exchange); over an NCCL clique of the ranks, the
//! clique's route to the owners is queued on its streams for F32 (exec/repro_clique.rs), and
//! the BF16 bucket, the last, only marks. Every
//! step gives the bytes of one process holding every replica, marked or not; a failed or
//! refused step writes nothing.

use super::*;

/// Two replicas on each of 2 ranks (GPUs 0 and 1), then one on each (`DPSYNC_TEST_REPRO_ROUTE`:
/// staged, staged-one, nccl, nccl-one). Staged: the owners' exchange, then whole through
/// shared memory.
#[test]
fn cuda_reproducible_overlap_across_ranks() {
    if under_mpirun() {
        return;
    }
    for route in ["staged", "staged-one", "nccl", "nccl-one"] {
        let env = Some(("DPSYNC_TEST_REPRO_ROUTE", std::path::Path::new(route)));
        launch("repro_overlap::repro_overlap_body", 2, 300, env);
    }
}

const N: usize = 1000;
/// Registered in this order: the bf16 tensor's bucket comes last in backward order.
const NAMES: [&str; 4] = ["h", "r0", "r1", "r2"];
const DTYPES: [u32; 4] = [BF16, F32, F32, F32];

/// Tensor `t`'s bytes per element.
fn size_of(t: usize) -> usize {
    if DTYPES[t] == BF16 {
        2
    } else {
        4
    }
}

/// World replica `w`'s tensor `t`: magnitudes 2^-12..2^12 of both signs, so that another
/// summation order shows in the bytes.
fn values(t: usize, w: usize) -> Vec<u8> {
    let v: Vec<f64> = (0..N)
        .map(|i| {
            let h = ((t * 7919 + w * 104_729 + i) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            let (m, scale) = ((h % 20_001) as f64 - 10_000.0, (h >> 15) % 25);
            m / 3.0 * 2f64.powi(scale as i32 - 12)
        })
        .collect();
    match DTYPES[t] {
        BF16 => (v.iter())
            .flat_map(|x| half::bf16::from_f64(*x).to_ne_bytes())
            .collect(),
        _ => bytes_of(&v.iter().map(|x| *x as f32).collect::<Vec<f32>>()),
    }
}

/// Registers tensor bytes `data[t][k]` on replica `k` (`ptrs`: each one's address).
fn register_all(ctx: &Context, ptrs: &[Vec<usize>]) {
    for (t, per_replica) in ptrs.iter().enumerate() {
        for (k, &p) in per_replica.iter().enumerate() {
            let st = register_raw(ctx.0, NAMES[t], GRAD, k, p as *mut _, N, DTYPES[t]);
            check(st, &format!("register {}", NAMES[t]));
        }
    }
}

#[test]
fn repro_overlap_body() {
    let Some((rank, ranks)) = as_rank("repro_overlap_body") else {
        return;
    };
    let Some(place) = Place::gpus("repro_overlap_body", 1) else {
        return;
    };
    let route = std::env::var("DPSYNC_TEST_REPRO_ROUTE").unwrap_or_default();
    let (transport, cross) = match route.starts_with("nccl") {
        true => (T_NCCL, "nccl"),
        false => (T_PEER_COPY, "mpi_staged"),
    };
    let gpus = common::place::device_count().clamp(1, 2) as i32;
    let ordinals: Vec<i32> = match route.ends_with("-one") {
        true => vec![rank as i32 % gpus],
        false => (0..2).map(|d| d % gpus).collect(),
    };
    let (local, replicas) = (ordinals.len(), ordinals.len() * ranks);
    let tag = |what: &str| format!("rank {rank}/{ranks} ({route}, {local} replicas): {what}");

    // The bytes every replica must end with: one process holding every world replica.
    let mut all: Vec<Vec<Vec<u8>>> = (0..NAMES.len())
        .map(|t| (0..replicas).map(|w| values(t, w)).collect())
        .collect();
    let reference = Context::new(&{
        let o = Options::host(replicas);
        // SAFETY: valid options.
        check(
            unsafe { dpsync_options_set_reproducible(o.0, true) },
            "reproducible",
        );
        o
    });
    let ptrs: Vec<Vec<usize>> = (all.iter_mut())
        .map(|per| per.iter_mut().map(|b| b.as_mut_ptr() as usize).collect())
        .collect();
    register_all(&reference, &ptrs);
    check(reference.allreduce_grads(AVG), &tag("one process"));
    let want: Vec<Vec<u8>> = all.iter().map(|per| per[0].clone()).collect();

    let Some(ctx) = cuda_context("repro_overlap_body", &ordinals, |o| {
        world(o, transport);
        o.set_fusion_bytes(4 * N);
        // SAFETY: valid options.
        check(
            unsafe { dpsync_options_set_reproducible(o.0, true) },
            "reproducible",
        );
    }) else {
        return;
    };
    assert_eq!(ctx.describe_json()["world"]["cross_rank"], cross);
    let first = rank * local;
    let mut g: Vec<Vec<Mem>> = (0..NAMES.len())
        .map(|t| {
            (0..local)
                .map(|k| place.mem_on(ordinals[k], &values(t, first + k)))
                .collect()
        })
        .collect();
    let ptrs: Vec<Vec<usize>> = (g.iter())
        .map(|per| per.iter().map(|m| m.ptr()).collect())
        .collect();
    register_all(&ctx, &ptrs);
    let refill = |g: &mut Vec<Vec<Mem>>| {
        for (t, per) in g.iter_mut().enumerate() {
            for (k, m) in per.iter_mut().enumerate() {
                m.write(&values(t, first + k));
            }
        }
    };
    let mark = || {
        for t in (0..NAMES.len()).rev() {
            for k in 0..local {
                check(ctx.grad_ready(NAMES[t], k), &tag("grad_ready"));
            }
        }
    };
    // Every replica's tensor `t` as `want(t, w)` says (w: its world index).
    let holds = |g: &Vec<Vec<Mem>>, want: &dyn Fn(usize, usize) -> Vec<u8>, what: &str| {
        check(common::place::synchronize(&ctx), &tag("synchronize"));
        for (t, per) in g.iter().enumerate() {
            for (k, m) in per.iter().enumerate() {
                let got = m.read();
                let at = got
                    .iter()
                    .zip(want(t, first + k))
                    .position(|(a, b)| *a != b);
                let name = NAMES[t];
                assert!(
                    at.is_none(),
                    "{}",
                    tag(&format!("{what}: replica {k}'s {name} byte {at:?}"))
                );
            }
        }
    };
    let summed = |t: usize, _: usize| want[t].clone();
    let untouched = |t: usize, w: usize| values(t, w);
    let early = || ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"].clone();

    // Step 1 sets the op (nothing starts before); step 2, marked: every bucket starts, but
    // for the bf16 one over NCCL.
    check(ctx.allreduce_grads(AVG), &tag("step 1"));
    holds(&g, &summed, "step 1");
    refill(&mut g);
    mark();
    let starting = if transport == T_NCCL { 3 } else { 4 };
    assert_eq!(
        early(),
        starting,
        "{}",
        tag("step 2: buckets started early")
    );
    holds(
        &g,
        &untouched,
        "step 2: nothing written before allreduce_grads",
    );
    check(ctx.allreduce_grads(AVG), &tag("step 2"));
    holds(&g, &summed, "step 2 (marked)");

    // Step 3, marked, a reduce-scatter: each replica's own piece as one process's.
    refill(&mut g);
    mark();
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(ctx.0, AVG) },
        &tag("step 3"),
    );
    let owned = |t: usize, w: usize| {
        let size = size_of(t);
        let (lo, hi) = (size * (N * w / replicas), size * (N * (w + 1) / replicas));
        let mut v = values(t, w);
        v[lo..hi].copy_from_slice(&want[t][lo..hi]);
        v
    };
    holds(&g, &owned, "step 3 (marked reduce-scatter)");

    // Step 4: the agreement fails (the last rank marked nothing and registered another
    // gradient: the others' started buckets meet stand-ins); nothing written, then again.
    // Over NCCL, ranks that start different buckets need streams that run apart from the
    // host: the fake NCCL's synchronous mode runs a collective inside the call that queues
    // it, until every process queued it.
    let apart = transport != T_NCCL || std::env::var("FAKE_CUDA_ASYNC").as_deref() == Ok("1");
    refill(&mut g);
    if !apart {
        println!("repro_overlap_body ({route}): step 4 skipped: it needs FAKE_CUDA_ASYNC=1");
    }
    let last = rank == ranks - 1;
    if apart {
        let extra: Vec<Mem> = (0..local)
            .map(|k| place.mem_on(ordinals[k], &bytes_of(&[1.0f32; 4])))
            .collect();
        match last {
            true => {
                for (k, m) in extra.iter().enumerate() {
                    let st = register_raw(ctx.0, "extra", GRAD, k, m.ptr() as *mut _, 4, F32);
                    check(st, &tag("register extra"));
                }
            }
            false => mark(),
        }
        assert_eq!(ctx.allreduce_grads(AVG), INCONSISTENT, "{}", tag("step 4"));
        holds(
            &g,
            &untouched,
            "step 4: nothing written after a failed agreement",
        );
        if last {
            check(ctx.unregister("extra"), &tag("unregister extra"));
        }
        check(ctx.allreduce_grads(AVG), &tag("step 4 again"));
        holds(&g, &summed, "step 4 again");
    }

    // Step 5, marked: the last rank's op is invalid, refused everywhere; nothing written.
    refill(&mut g);
    mark();
    let st = ctx.allreduce_grads(if last { 7 } else { AVG });
    let refused = if last { INVALID_ARGUMENT } else { INCONSISTENT };
    assert_eq!(st, refused, "{}: {}", tag("step 5"), last_error());
    holds(&g, &untouched, "step 5: nothing written by a refused step");
    check(ctx.allreduce_grads(AVG), &tag("step 5 again"));
    holds(&g, &summed, "step 5 again");
}
