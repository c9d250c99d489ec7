//! Buckets started early write their results into the gradients as they cross, before the
//! step agreed, keeping the originals of every local replica aside (`backend/mpi/aside.rs`):
//! every way the step can fail afterwards must leave the gradients as they were, and a
//! reduce-scatter step must leave the elements a replica does not own.

use super::*;

/// Through shared memory (whole buckets) with 2 and 3 ranks, and over MPI's ring pieces; one
/// and two replicas per rank.
#[test]
fn early_results_go_back_when_the_step_fails() {
    if under_mpirun() {
        return;
    }
    let no_shm = Some(("DPSYNC_MPI_SHM", std::path::Path::new("0")));
    launch("early_writes::early_writes_body", 2, 300, None);
    launch("early_writes::early_writes_body", 3, 300, None);
    launch("early_writes::early_writes_body", 2, 300, no_shm);
    launch("early_writes::early_writes_two_body", 2, 300, None);
    launch("early_writes::early_writes_two_body", 2, 300, no_shm);
}

#[test]
fn early_writes_body() {
    if let Some((rank, ranks)) = as_rank("early_writes_body") {
        early_writes(rank, ranks, 1);
    }
}

#[test]
fn early_writes_two_body() {
    if let Some((rank, ranks)) = as_rank("early_writes_two_body") {
        early_writes(rank, ranks, 2);
    }
}

fn early_writes(rank: usize, ranks: usize, replicas: usize) {
    // Two gradients of 300 000 f32 (a bucket each: several pieces), one of 1000 (one piece off
    // the ring).
    let sizes = [300_000, 1000, 300_000];
    let names = ["a", "b", "c"];
    let o = world_options(replicas);
    o.set_fusion_bytes(4 * 300_000);
    let ctx = Context::new(&o);
    let tag = |what: &str| format!("rank {rank}/{ranks} x {replicas}: {what}");
    // World replica w holds (i % 1000) + 2w: the mean over the world is (i % 1000) + W - 1,
    // exact.
    let world = ranks * replicas;
    let value = |w: usize, i: usize| (i % 1000 + 2 * w) as f32;
    let mean = |i: usize| (i % 1000 + world - 1) as f32;
    let mut g: Vec<Vec<Vec<f32>>> = (0..replicas)
        .map(|_| sizes.iter().map(|&n| vec![0.0; n]).collect())
        .collect();
    let fill = |g: &mut Vec<Vec<Vec<f32>>>| {
        for (r, set) in g.iter_mut().enumerate() {
            for buf in set.iter_mut() {
                for (i, x) in buf.iter_mut().enumerate() {
                    *x = value(rank * replicas + r, i);
                }
            }
        }
    };
    fill(&mut g);
    for (r, set) in g.iter_mut().enumerate() {
        for (t, buf) in set.iter_mut().enumerate() {
            ctx.reg(names[t], GRAD, r, buf, F32);
        }
    }
    let before = g.clone();
    let expect_mean = |g: &Vec<Vec<Vec<f32>>>, what: &str| {
        for (r, set) in g.iter().enumerate() {
            for (t, buf) in set.iter().enumerate() {
                for (i, &x) in buf.iter().enumerate() {
                    let at = format!("{what}: replica {r} {}[{i}]", names[t]);
                    assert_eq!(x, mean(i), "{}", tag(&at));
                }
            }
        }
    };
    // Marks every gradient, then (`cross`) waits until every started bucket crossed the
    // ranks: their results are in the gradients already, before the step's agreement.
    let mark = |what: &str, cross: bool| {
        for name in names {
            for r in 0..replicas {
                check(ctx.grad_ready(name, r), &tag("grad_ready"));
            }
        }
        if !cross {
            return;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let queue = ctx.describe_json()["world"]["early_buckets"].clone();
            if queue["queued"] == names.len() && queue["pieces_done"] == queue["pieces"] {
                break;
            }
            // Not a speed check: a hang guard well above any machine's time.
            assert!(
                std::time::Instant::now() < deadline,
                "{}",
                tag(&format!("{what}: the early buckets stalled: {queue}"))
            );
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    };
    let last = rank == ranks - 1;

    // The first step sets the op (AVG) and the shape (allreduce) early buckets expect.
    check(ctx.allreduce_grads(AVG), &tag("step 1"));
    expect_mean(&g, "step 1");

    // The step refused (the last rank's op is invalid): every rank drains, nothing changes.
    fill(&mut g);
    mark("a refused step", true);
    let st = ctx.allreduce_grads(if last { 7 } else { AVG });
    let want = if last { INVALID_ARGUMENT } else { INCONSISTENT };
    assert_eq!(st, want, "{}: {}", tag("a refused step"), last_error());
    assert!(
        g == before,
        "{}",
        tag("a refused step changed the gradients")
    );
    check(ctx.allreduce_grads(AVG), &tag("the step again"));
    expect_mean(&g, "the step again");

    // Another call on the last rank: the buckets stay started for the next step, and the
    // refused call changes nothing. Once after the buckets crossed, once while they may still
    // be crossing (the early writes stop wherever the pieces are, the rest of each bucket is
    // held).
    for (what, cross) in [("another call", true), ("another call, crossing", false)] {
        fill(&mut g);
        mark(what, cross);
        let st = match last {
            true => ctx.average(STATE),
            false => ctx.allreduce_grads(AVG),
        };
        assert_eq!(st, INCONSISTENT, "{}: {}", tag(what), last_error());
        assert!(
            g == before,
            "{}",
            tag(&format!("{what} changed the gradients"))
        );
        let after = format!("the step after {what}");
        check(ctx.allreduce_grads(AVG), &tag(&after));
        expect_mean(&g, &after);
    }

    // A reduce-scatter step although the last step was an allreduce: each rank's piece of
    // every gradient reduced, the rest as it was.
    fill(&mut g);
    mark("a reduce-scatter step", true);
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(ctx.0, AVG) },
        &tag("a reduce-scatter step"),
    );
    for (r, set) in g.iter().enumerate() {
        let w = rank * replicas + r;
        for (t, buf) in set.iter().enumerate() {
            let n = sizes[t];
            let (lo, hi) = (n * w / world, n * (w + 1) / world);
            for (i, &x) in buf.iter().enumerate() {
                let want = match (lo..hi).contains(&i) {
                    true => mean(i),
                    false => value(w, i),
                };
                let at = format!("reduce-scatter: replica {r} {}[{i}]", names[t]);
                assert_eq!(x, want, "{}", tag(&at));
            }
        }
    }
}
