//! `dpsync_grad_ready` on the staged route (CUDA replicas, no clique: PEER_COPY): buckets start
//! early, each rank's contribution (its one replica's bucket, or its replicas' levels 1–2 sum)
//! copied into page-locked memory of the bucket's own, the engine's transfer gated on the copy.
//! Nothing is written before the step agrees. Reproducible contexts: `staged_repro.rs`.

use super::*;

/// Each rank's CUDA ordinals: one replica per rank; with `DPSYNC_TEST_STAGED_MIXED` (3 ranks)
/// one, two (on two GPUs) and one.
fn staged_layout(rank: usize) -> Vec<i32> {
    let gpus = common::place::device_count().clamp(1, 2) as i32;
    let layouts: &[&[i32]] = match std::env::var_os("DPSYNC_TEST_STAGED_MIXED") {
        Some(_) => &[&[0], &[0, 1], &[1]],
        None => &[&[0], &[1], &[0]],
    };
    layouts[rank].iter().map(|&d| d % gpus).collect()
}

#[test]
fn cuda_overlap_across_ranks_staged() {
    if under_mpirun() {
        return;
    }
    for n in [2, 3] {
        launch("staged_overlap::staged_overlap_body", n, 300, None);
    }
    let mixed = Some(("DPSYNC_TEST_STAGED_MIXED", std::path::Path::new("1")));
    launch("staged_overlap::staged_overlap_body", 3, 300, mixed);
}

/// As every rank: three gradients of 1000 f32 (a bucket each), marked in backward order:
/// SUM steps, a reduce-scatter step after early buckets (each replica's own pieces written,
/// nothing else), a failed agreement (the started buckets drained, nothing written) and a
/// refused op (likewise), each followed by a step that succeeds; then warm steps that make no
/// page-locked allocation.
#[test]
fn staged_overlap_body() {
    let Some((rank, ranks)) = as_rank("staged_overlap_body") else {
        return;
    };
    let Some(place) = Place::gpus("staged_overlap_body", 1) else {
        return;
    };
    let sizes: Vec<usize> = (0..ranks).map(|r| staged_layout(r).len()).collect();
    let (local, total) = (sizes[rank], sizes.iter().sum::<usize>());
    let offset: usize = sizes[..rank].iter().sum();
    let ordinals = &staged_layout(rank);
    let Some(ctx) = cuda_context("staged_overlap_body", ordinals, |o| {
        world(o, T_PEER_COPY);
        o.set_fusion_bytes(4000);
    }) else {
        return;
    };
    let tag = format!("rank {rank}/{ranks} ({local} replicas)");
    assert_eq!(ctx.describe_json()["world"]["cross_rank"], "mpi_staged");
    let mut g = Grads::new(&ctx, &place, ordinals, (local, total, offset), tag);
    let all = [2, 1, 0];
    let (now, last) = (
        "buckets_reduced_early_this_step",
        "buckets_reduced_early_last_step",
    );
    let starts = 3;

    // Step 1 (no op yet: nothing starts early).
    check(ctx.allreduce_grads(SUM), &g.tag("step 1"));
    g.expect("step 1");

    // Step 2: every bucket marked and started, nothing written before allreduce_grads.
    g.refill();
    g.mark(&all);
    assert_eq!(g.early(now), starts, "{}", g.tag("step 2 started"));
    g.untouched("step 2: nothing written before allreduce_grads");
    check(ctx.allreduce_grads(SUM), &g.tag("step 2"));
    g.expect("step 2");
    assert_eq!(g.early(last), starts, "{}", g.tag("step 2 early"));

    // Step 3: started buckets serve a reduce-scatter step: each replica's own pieces written,
    // nothing else.
    g.refill();
    g.mark(&all);
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) },
        &g.tag("step 3"),
    );
    g.expect_owned("step 3");

    // Step 4: after a reduce-scatter step they start again and serve an allreduce step.
    g.refill();
    g.mark(&all);
    assert_eq!(g.early(now), starts, "{}", g.tag("step 4 started"));
    check(ctx.allreduce_grads(SUM), &g.tag("step 4"));
    g.expect("step 4");

    // Step 5: the agreement fails on every rank (the last rank, which marked nothing,
    // registered another gradient): the started buckets are drained (stand-ins where none
    // started), nothing is written; then the step succeeds.
    g.refill();
    if rank != ranks - 1 {
        g.mark(&all);
    }
    g.failed_agreement((&place, ordinals), (rank, ranks), "step 5");

    // Step 6: the last rank's op is invalid: refused there, INCONSISTENT elsewhere; the
    // started buckets drained, nothing written; then the step succeeds.
    g.refill();
    g.mark(&all);
    let st = ctx.allreduce_grads(if rank == ranks - 1 { 7 } else { SUM });
    let want = if rank == ranks - 1 {
        INVALID_ARGUMENT
    } else {
        INCONSISTENT
    };
    assert_eq!(st, want, "{}: {}", g.tag("step 6"), last_error());
    g.untouched("step 6: nothing written by a refused step");
    check(ctx.allreduce_grads(SUM), &g.tag("step 6, again"));
    g.expect("step 6");

    // Steps 7-9: warm, the early buckets reuse the page-locked stages of earlier steps.
    let Some(before) = host_allocations() else {
        println!("staged_overlap_body: page-locked reuse skipped: needs the fake CUDA driver");
        return;
    };
    for step in 7..10 {
        g.refill();
        g.mark(&all);
        check(ctx.allreduce_grads(SUM), &g.tag(&format!("step {step}")));
        g.expect(&format!("step {step}"));
    }
    assert_eq!(
        host_allocations(),
        Some(before),
        "{}",
        g.tag("steps 7-9 allocated page-locked memory")
    );
}

/// The fake driver's count of page-locked allocations made by this thread (dpsync stages a
/// bucket on the thread that marks it); `None` on a real driver, which has no such symbol.
fn host_allocations() -> Option<i64> {
    // SAFETY: opens the driver this process already loaded (dpsync did); the fake's
    // `long fake_cuda_host_allocations(void)`.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").ok()?;
        let f = lib.get::<unsafe extern "C" fn() -> i64>(b"fake_cuda_host_allocations");
        Some(f.ok()?())
    }
}
