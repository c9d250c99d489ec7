//! Buckets started early across the ranks, whole and piece by piece (`overlap_body`,
//! `overlap_pieces_body`).

use super::*;

#[test]
fn buckets_start_early_across_ranks() {
    if under_mpirun() {
        return;
    }
    launch("overlap::overlap_body", 2, 300, None);
}

/// `dpsync_grad_ready` in a world: buckets start early in bucket order while the registrations
/// are those agreed by the last step, ranks that marked different tensors still match, an op
/// change divides the early sums, a failed step drains what was started with nothing written,
/// and a rank that re-registered starts nothing early while the other does.
#[test]
fn overlap_body() {
    if let Some((rank, ranks)) = as_rank("overlap_body") {
        overlap_steps(rank, ranks, 1000);
    }
}

/// The early buckets' pieces: each gradient 300 000 f32 (1.2 MB: three of MPI's 512 KiB
/// pieces, ten of shared memory's 128 KiB), so started buckets cross the ranks a few pieces at
/// a time, stand-ins too;
/// through shared memory, and over MPI's ring (as across hosts) with 2 ranks.
#[test]
fn buckets_cross_the_ranks_piece_by_piece() {
    if under_mpirun() {
        return;
    }
    launch("overlap::overlap_pieces_body", 2, 300, None);
    launch("overlap::overlap_pieces_body", 3, 300, None);
    let no_shm = Some(("DPSYNC_MPI_SHM", std::path::Path::new("0")));
    launch("overlap::overlap_pieces_body", 2, 300, no_shm);
}

#[test]
fn overlap_pieces_body() {
    if let Some((rank, ranks)) = as_rank("overlap_pieces_body") {
        overlap_steps(rank, ranks, 300_000);
    }
}

/// The steps of [`overlap_body`] with gradients of `n` f32, every element checked (values
/// repeat every 1000 elements, so that sums stay exact in f32).
fn overlap_steps(rank: usize, ranks: usize, n: usize) {
    let local = rank + 1;
    let total: usize = (1..=ranks).sum();
    let offset: usize = (1..=rank).sum();
    let o = world_options(local);
    o.set_fusion_bytes(4 * n); // a bucket per gradient
    let ctx = Context::new(&o);
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let names = ["g0", "g1", "g2", "g3"];
    let fill = |g: &mut Vec<Vec<Vec<f32>>>| {
        for (t, per_replica) in g.iter_mut().enumerate() {
            for (k, buf) in per_replica.iter_mut().enumerate() {
                for (i, x) in buf.iter_mut().enumerate() {
                    *x = (value(offset + k, i % 1000) as usize * (t + 1)) as f32;
                }
            }
        }
    };
    let mut g: Vec<Vec<Vec<f32>>> = vec![vec![vec![0.0; n]; local]; names.len()];
    fill(&mut g);
    for (t, per_replica) in g.iter_mut().enumerate() {
        for (k, buf) in per_replica.iter_mut().enumerate() {
            ctx.reg(names[t], GRAD, k, buf, F32);
        }
    }
    // Σ over the world of value(w, i) * (t + 1).
    let sum = |t: usize, i: usize| ((i % 1000 + 1) * total * (total + 1) / 2 * (t + 1)) as f32;
    let expect = |g: &Vec<Vec<Vec<f32>>>, div: f32, what: &str| {
        for (t, per_replica) in g.iter().enumerate() {
            for buf in per_replica {
                for i in 0..n {
                    assert_eq!(
                        buf[i],
                        sum(t, i) / div,
                        "{}",
                        tag(&format!("{what}: g{t}[{i}]"))
                    );
                }
            }
        }
    };
    let mark = |tensors: &[usize]| {
        for &t in tensors {
            for k in 0..local {
                check(ctx.grad_ready(names[t], k), &tag("grad_ready"));
            }
        }
    };
    let early = || ctx.describe_json()["overlap"]["buckets_reduced_early_last_step"].clone();

    // Step 1: nothing starts early before the first step.
    mark(&[0, 1, 2, 3]);
    check(ctx.allreduce_grads(SUM), &tag("step 1"));
    expect(&g, 1.0, "step 1");
    assert_eq!(early(), 0, "{}", tag("step 1 early"));

    // Step 2: rank 0 marks everything (backward order), rank 1 two tensors only.
    fill(&mut g);
    mark(if rank == 0 { &[3, 2, 1, 0] } else { &[1, 2] });
    check(ctx.allreduce_grads(SUM), &tag("step 2"));
    expect(&g, 1.0, "step 2");
    if rank == 0 {
        assert_eq!(early(), 4, "{}", tag("step 2: every bucket started early"));
    }

    // Step 3: the op changes to AVG: the early buckets were summed, then divided.
    fill(&mut g);
    mark(&[0, 1, 2, 3]);
    check(ctx.allreduce_grads(AVG), &tag("step 3"));
    expect(&g, total as f32, "step 3");
    assert_eq!(early(), 4, "{}", tag("step 3 early"));

    // Step 4: rank 0's early buckets were averaged, so SUM is refused there: every rank fails,
    // the started transfers are drained, nothing is written; then AVG works.
    fill(&mut g);
    if rank == 0 {
        mark(&[0, 1, 2, 3]);
    }
    let st = ctx.allreduce_grads(SUM);
    let msg = last_error();
    assert_eq!(
        st,
        if rank == 0 {
            INVALID_STATE
        } else {
            INCONSISTENT
        },
        "{}",
        tag(&msg)
    );
    for (t, per_replica) in g.iter().enumerate() {
        for (k, buf) in per_replica.iter().enumerate() {
            for i in [5, n - 1] {
                let want = (value(offset + k, i % 1000) as usize * (t + 1)) as f32;
                assert_eq!(buf[i], want, "{}", tag("step 4: nothing written"));
            }
        }
    }
    check(ctx.allreduce_grads(AVG), &tag("step 4, again with AVG"));
    expect(&g, total as f32, "step 4");

    // Step 5: rank 1 registers another tensor (a STATE, outside the step): its registrations
    // are not the agreed ones any more, so it starts nothing early; rank 0 does. They match.
    let mut extra: Vec<Vec<f32>> = vec![vec![0.0; 3]; local];
    if rank == 1 {
        for (k, buf) in extra.iter_mut().enumerate() {
            ctx.reg("extra", STATE, k, buf, F32);
        }
    }
    fill(&mut g);
    mark(&[0, 1, 2, 3]);
    check(ctx.allreduce_grads(AVG), &tag("step 5"));
    expect(&g, total as f32, "step 5");
    assert_eq!(
        early(),
        if rank == 1 { 0 } else { 4 },
        "{}",
        tag("step 5 early")
    );

    // Step 6: both agreed again: both start early.
    fill(&mut g);
    mark(&[3, 1, 0, 2]);
    check(ctx.allreduce_grads(AVG), &tag("step 6"));
    expect(&g, total as f32, "step 6");
    assert_eq!(early(), 4, "{}", tag("step 6 early"));

    // Step 7: rank 0 starts every bucket early and calls dpsync_allreduce_grads while rank 1
    // calls another collective: both fail, and rank 0 keeps its started buckets for the step
    // both then finish.
    fill(&mut g);
    if rank == 0 {
        mark(&[0, 1, 2, 3]);
    }
    let st = if rank == 0 {
        ctx.allreduce_grads(AVG)
    } else {
        ctx.allreduce("g0", AVG)
    };
    assert_eq!(st, INCONSISTENT, "{}", tag(&last_error()));
    check(ctx.allreduce_grads(AVG), &tag("step 7"));
    expect(&g, total as f32, "step 7");
    if rank == 0 {
        assert_eq!(
            early(),
            4,
            "{}",
            tag("step 7: the started buckets were kept")
        );
    }

    // Step 8: every rank marks everything, then stays away from dpsync (its backward pass):
    // where the engine's progress thread runs, the buckets cross the ranks meanwhile.
    fill(&mut g);
    mark(&[3, 2, 1, 0]);
    let world = |d: serde_json::Value| d["world"].clone();
    let thread = world(ctx.describe_json())["progress_thread"].clone();
    // Every process gets the thread, one bound to a single CPU too (mpirun -n 2's binding):
    // a caller away from dpsync leaves that CPU free.
    assert_eq!(thread, "running", "{}", tag("step 8"));
    {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let queue = world(ctx.describe_json())["early_buckets"].clone();
            assert_eq!(queue["queued"], 4, "{}", tag("step 8"));
            if queue["pieces_done"] == queue["pieces"] {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{}",
                tag(&format!("step 8: the early buckets stalled: {queue}"))
            );
        }
    }
    check(ctx.allreduce_grads(AVG), &tag("step 8"));
    expect(&g, total as f32, "step 8");
}
