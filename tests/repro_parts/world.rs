//! Worlds (`--features mpi`): 8 replicas over 1, 2, 3, 4 and 8 ranks give the bytes of one
//! process of 8, over the host and over NCCL across the ranks; ranks that disagree on the
//! option create no context. `world_body` runs under mpirun, launched by name.

use super::*;
use common::mpi::{as_rank, launch, under_mpirun};

/// Replicas per rank for `ranks` ranks: 8 in all.
fn layout(ranks: usize) -> Vec<usize> {
    match ranks {
        1 => vec![8],
        2 => vec![5, 3],
        3 => vec![3, 3, 2],
        4 => vec![2; 4],
        8 => vec![1; 8],
        _ => unreachable!(),
    }
}

#[test]
fn arrangements_over_ranks_give_the_bytes_of_one_process() {
    if under_mpirun() {
        return;
    }
    for ranks in [1, 2, 3, 4, 8] {
        launch("world::world_body", ranks, 300, None);
    }
}

fn world_context(
    local: usize,
    reproducible: bool,
    fusion: usize,
) -> Result<Context, (dpsync_status, String)> {
    let o = Options::host(local);
    o.set_timeout_ms(60_000);
    o.set_fusion_bytes(fusion);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    unsafe {
        check(
            dpsync_options_set_world_mpi(o.0, std::ptr::null()),
            "set_world_mpi",
        );
        check(
            dpsync_options_set_reproducible(o.0, reproducible),
            "set_reproducible",
        );
    }
    let mut p = std::ptr::null_mut();
    // SAFETY: valid options and out pointer.
    match unsafe { dpsync_context_create(o.0, &mut p) } {
        OK => Ok(Context(p)),
        st => Err((st, last_error())),
    }
}

/// This process's fake NCCL counts of one reproducible `allreduce_grads` over a clique
/// across `ranks` ranks, this one's replicas on `gpus` GPUs (8 replicas in the world): each
/// float bucket went by `ncclSend`/`ncclRecv` and `ncclAllGather`, or as exponent fields and
/// i64 sums by `ncclAllReduce` where that moves fewer bytes (`by_fields`), and, where this
/// process holds at most 3 replicas per GPU, moved at most 2.25 times what its GPUs' share of
/// the plain ring allreduce of them moves (2 (n-1)/n of a bucket per GPU, n the clique's GPUs).
fn nccl_across_ranks_moves_the_plain_bytes(
    sent: &[(u64, u64); 6],
    gpus: usize,
    ranks: usize,
    mine: &[usize],
) {
    use fake_nccl::{ALLGATHER, ALLREDUCE, RECV, SEND};
    let (sends, recvs, gathers, reduces) =
        (sent[SEND], sent[RECV], sent[ALLGATHER], sent[ALLREDUCE]);
    // Every rank's replicas spread over its GPUs alike (tests: two fake GPUs a rank).
    let (g, n) = (gpus as u64, (ranks * gpus) as u64);
    // The fake's count of this process's share of one allreduce of `bytes`.
    let ring = |bytes: u64| g * (2 * (n - 1) * bytes / n);
    let (mut plain, mut gathered, mut fields_bytes, mut calls) = (0, 0, 0, g);
    for size in [4u64, 8] {
        plain += ring(N as u64 * size);
        if by_fields(size as usize, 8, n as usize) {
            calls += 2 * g;
            let field = if size == 8 { 2 } else { 1 };
            fields_bytes += ring(N as u64 * field) + ring(N as u64 * 8);
        } else {
            gathered += g;
        }
    }
    assert_eq!(
        sends.1 > 0,
        gathered > 0,
        "ncclSend where a bucket went raw"
    );
    assert_eq!(
        recvs.1 > 0,
        gathered > 0,
        "ncclRecv where a bucket went raw"
    );
    assert_eq!(
        gathers.1, gathered,
        "one allgather per GPU per float bucket sent raw"
    );
    assert_eq!(
        reduces,
        (fields_bytes + ring(N as u64 * 4), calls),
        "ncclAllReduce: the I32 bucket, and the fields and integers of the others"
    );
    let moved = sends.0 + gathers.0 + fields_bytes;
    println!(
        "reproducible over NCCL, {} replicas on {gpus} of {n} GPUs: {moved} bytes sent \
         here (send {} + allgather {} + fields and integers {fields_bytes}), the plain ring \
         allreduce {plain} ({:.2}x)",
        mine.len(),
        sends.0,
        gathers.0,
        moved as f64 / plain as f64
    );
    if mine.len() <= 3 * gpus {
        assert!(
            4 * moved <= 9 * plain,
            "{moved} bytes, the plain {plain}: over 2.25x"
        );
    }
}

#[test]
fn world_body() {
    let Some((rank, ranks)) = as_rank("world_body") else {
        return;
    };
    let per_rank = layout(ranks);
    let offset: usize = per_rank[..rank].iter().sum();
    // World replica k holds contribution p[k] of one permutation of the 8.
    let p = permutation(8, 11);
    let mine: Vec<usize> = p[offset..offset + per_rank[rank]].to_vec();
    for op in [SUM, AVG] {
        let want = grads(
            &Place::Host,
            &(0..8).collect::<Vec<_>>(),
            op,
            true,
            DEFAULT_FUSION,
        );
        let ctx = world_context(mine.len(), true, 4096).expect("a world context");
        let run = Run::new(ctx, &Place::Host, &mine, 8);
        check(run.ctx.allreduce_grads(op), "allreduce_grads (world)");
        assert_eq!(
            run.result(0),
            want,
            "rank {rank}/{ranks} op {op}: allreduce_grads"
        );
        for dtype in TENSORS {
            check(
                run.ctx.allreduce(&name("w", dtype), op),
                "allreduce (world)",
            );
        }
        assert_eq!(
            run.result(1),
            want,
            "rank {rank}/{ranks} op {op}: allreduce"
        );
    }
    // Buckets the engine's ring carries (64 KiB and more): with one replica per rank and
    // every rank on this host, F32 and F64 are summed from the ranks' raw values in shared
    // memory (Ranks::allreduce_reproducible); the bytes are still one process's.
    let big = 24_000;
    let ctx = context(&Place::Host, "large buckets", 8, true, DEFAULT_FUSION);
    let one = Run::sized(ctx, &Place::Host, &(0..8).collect::<Vec<_>>(), 8, big);
    check(
        one.ctx.allreduce_grads(AVG),
        "allreduce_grads (one process)",
    );
    let want = one.result(0);
    drop(one);
    let ctx = world_context(mine.len(), true, DEFAULT_FUSION).expect("a world context");
    let run = Run::sized(ctx, &Place::Host, &mine, 8, big);
    check(
        run.ctx.allreduce_grads(AVG),
        "allreduce_grads (world, large)",
    );
    assert_eq!(run.result(0), want, "rank {rank}/{ranks}: large buckets");
    drop(run);
    // CUDA replicas (scripts/test.sh runs this on the fake driver and NCCL): NCCL across
    // the ranks where it runs, and the staged path, give the host's bytes too.
    if ranks <= 3 {
        if let Some(gpu) = Place::gpu("world_body on CUDA replicas") {
            let want = grads(
                &Place::Host,
                &(0..8).collect::<Vec<_>>(),
                AVG,
                true,
                DEFAULT_FUSION,
            );
            for transport in [T_AUTO, T_PEER_COPY] {
                let ordinals: Vec<i32> = (0..mine.len()).map(|r| ordinal(&gpu, r)).collect();
                let ctx = cuda_context("world_body on CUDA replicas", &ordinals, |o| {
                    o.set_transport(transport);
                    o.set_timeout_ms(60_000);
                    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
                    unsafe {
                        check(dpsync_options_set_world_mpi(o.0, std::ptr::null()), "world");
                        check(dpsync_options_set_reproducible(o.0, true), "reproducible");
                    }
                })
                .expect("a CUDA world context");
                let run = Run::new(ctx, &gpu, &mine, 8);
                let sent = fake_nccl::sent_by(&run.ctx, "allreduce_grads (CUDA world)", || {
                    run.ctx.allreduce_grads(AVG)
                });
                assert_eq!(
                    run.result(0),
                    want,
                    "rank {rank}/{ranks} CUDA transport {transport}"
                );
                if let Some(sent) = sent.filter(|s| s[fake_nccl::ALLREDUCE].1 > 0) {
                    let gpus = ordinals.iter().collect::<std::collections::BTreeSet<_>>();
                    nccl_across_ranks_moves_the_plain_bytes(&sent, gpus.len(), ranks, &mine);
                }
            }
        }
    }
    if ranks > 1 {
        // Rank 0 alone asks for reproducible sums: no context anywhere.
        match world_context(mine.len(), rank == 0, 4096) {
            Ok(_) => panic!("rank {rank}: a world whose ranks disagree on reproducible"),
            Err((st, msg)) => {
                assert_eq!(st, INCONSISTENT, "rank {rank}: {msg}");
                assert!(msg.contains("reproducible"), "rank {rank}: {msg}");
            }
        }
    }
}
