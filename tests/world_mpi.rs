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

#[test]
fn worlds_of_two_three_and_four_ranks() {
    if under_mpirun() {
        return; // a rank runs rank_body only
    }
    for n in [2, 3, 4] {
        launch("rank_body", n, 300, None);
    }
}

#[test]
fn large_buckets_cross_the_engines_pieces() {
    if under_mpirun() {
        return;
    }
    for n in [2, 3] {
        // Through shared memory (every rank on this host), over MPI's ring as across hosts,
        // and with only the last rank refusing shared memory (all then agree on MPI).
        for shm in ["1", "0", "last"] {
            let env = Some(("DPSYNC_MPI_SHM", std::path::Path::new(shm)));
            launch("pieces_body", n, 300, env);
        }
    }
}

/// Fused buckets and a broadcast of several MB whose tensor boundaries fall inside the engine's
/// pieces (it stages them piece by piece): every element of every tensor, in f32, f64, f16 and
/// bf16 (summed in f32: the f32 pieces' element counts), rank r with r + 1 replicas.
#[test]
fn pieces_body() {
    let Some((rank, ranks)) = as_rank("pieces_body") else {
        return;
    };
    let local = rank + 1;
    let total: usize = (1..=ranks).sum();
    let offset: usize = (1..=rank).sum();
    let shm = std::env::var("DPSYNC_MPI_SHM").unwrap_or_default();
    if shm == "last" && rank + 1 == ranks {
        std::env::set_var("DPSYNC_MPI_SHM", "0");
    }
    let ctx = Context::new(&world_options(local));
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    // The path the large pieces take: shared memory unless a rank turned it off.
    let shared = ctx.describe_json()["world"]["shared_memory"].clone();
    let expected = match shm == "0" || shm == "last" {
        true => "off: DPSYNC_MPI_SHM=0 on a rank".to_owned(),
        false => format!("on: all {ranks} ranks on this host"),
    };
    assert_eq!(shared, expected.as_str(), "{}", tag("shared memory"));
    // Small integers (sums exact in every dtype): world replica w's element i of tensor t.
    let v = |w: usize, t: usize, i: usize, m: usize| ((w + 1) * ((i + t) % m + 1)) as f32;
    // Σ over the world's replicas.
    let sum = |t: usize, i: usize, m: usize| (total * (total + 1) / 2 * ((i + t) % m + 1)) as f32;
    let sizes32 = [100_003usize, 3, 250_001, 70_000];
    let sizes64 = [40_000usize, 90_001];
    let sizes16 = [200_001usize, 77_777];
    let mut g32: Vec<Vec<Vec<f32>>> = (sizes32.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| v(offset + k, t, i, 1000)).collect())
                .collect()
        })
        .collect();
    let mut g64: Vec<Vec<Vec<f64>>> = (sizes64.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| v(offset + k, t, i, 1000) as f64).collect())
                .collect()
        })
        .collect();
    // f16: integers up to 2048 are exact; bf16: up to 256.
    let mut h16: Vec<Vec<Vec<u16>>> = (sizes16.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| f32_to_f16(v(offset + k, t, i, 7))).collect())
                .collect()
        })
        .collect();
    let mut b16: Vec<Vec<Vec<u16>>> = (sizes16.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| {
                    (0..n)
                        .map(|i| f32_to_bf16(v(offset + k, t, i, 3)))
                        .collect()
                })
                .collect()
        })
        .collect();
    for k in 0..local {
        for t in 0..sizes32.len() {
            ctx.reg(&format!("f32_{t}"), GRAD, k, &mut g32[t][k], F32);
        }
        for t in 0..sizes64.len() {
            ctx.reg(&format!("f64_{t}"), GRAD, k, &mut g64[t][k], F64);
        }
        for t in 0..sizes16.len() {
            ctx.reg(&format!("f16_{t}"), GRAD, k, &mut h16[t][k], F16);
            ctx.reg(&format!("bf16_{t}"), GRAD, k, &mut b16[t][k], BF16);
        }
    }
    check(ctx.allreduce_grads(SUM), &tag("allreduce_grads"));
    for k in 0..local {
        for t in 0..sizes32.len() {
            for i in 0..sizes32[t] {
                assert_eq!(
                    g32[t][k][i],
                    sum(t, i, 1000),
                    "{}",
                    tag(&format!("f32_{t}[{i}]"))
                );
            }
        }
        for t in 0..sizes64.len() {
            for i in 0..sizes64[t] {
                let want = sum(t, i, 1000) as f64;
                assert_eq!(g64[t][k][i], want, "{}", tag(&format!("f64_{t}[{i}]")));
            }
        }
        for t in 0..sizes16.len() {
            for i in 0..sizes16[t] {
                let (h, b) = (f16_to_f32(h16[t][k][i]), bf16_to_f32(b16[t][k][i]));
                assert_eq!(h, sum(t, i, 7), "{}", tag(&format!("f16_{t}[{i}]")));
                assert_eq!(b, sum(t, i, 3), "{}", tag(&format!("bf16_{t}[{i}]")));
            }
        }
    }

    // A broadcast of several MB from the last world replica, spans crossing the pieces.
    let sizes = [300_001usize, 5, 200_000];
    let mut p: Vec<Vec<Vec<f32>>> = (sizes.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| v(offset + k, t, i, 1000)).collect())
                .collect()
        })
        .collect();
    for k in 0..local {
        for t in 0..sizes.len() {
            ctx.reg(&format!("p_{t}"), PARAM, k, &mut p[t][k], F32);
        }
    }
    let root = total - 1;
    check(ctx.broadcast(PARAM, root), &tag("broadcast"));
    for k in 0..local {
        for t in 0..sizes.len() {
            for i in 0..sizes[t] {
                let want = v(root, t, i, 1000);
                assert_eq!(p[t][k][i], want, "{}", tag(&format!("p_{t}[{i}]")));
            }
        }
    }
}

#[test]
fn buckets_start_early_across_ranks() {
    if under_mpirun() {
        return;
    }
    launch("overlap_body", 2, 300, None);
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
    launch("overlap_pieces_body", 2, 300, None);
    launch("overlap_pieces_body", 3, 300, None);
    let no_shm = Some(("DPSYNC_MPI_SHM", std::path::Path::new("0")));
    launch("overlap_pieces_body", 2, 300, no_shm);
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

#[test]
fn every_rank_writes_its_own_timeline() {
    if under_mpirun() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("dpsync-world-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pattern = dir.join("trace-%r.json");
    launch("timeline_body", 2, 120, Some(("DPSYNC_TIMELINE", &pattern)));
    for rank in 0..2 {
        let path = dir.join(format!("trace-{rank}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        let has = |ph: &str, name: &str| events.iter().any(|e| e["ph"] == ph && e["name"] == name);
        assert!(
            has("X", "agree") && has("X", "across ranks") && has("X", "local sum"),
            "{text}"
        );
        let process = events.iter().find(|e| e["name"] == "process_name").unwrap();
        assert_eq!(process["args"]["name"], format!("dpsync rank {rank} of 2"));
        assert!(events.iter().all(|e| e["pid"] == rank));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A step on two local replicas under DPSYNC_TIMELINE (set by the launcher above).
#[test]
fn timeline_body() {
    let Some(_) = as_rank("timeline_body") else {
        return;
    };
    let ctx = Context::new(&world_options(2));
    let mut g: Vec<Vec<f32>> = vec![vec![1.0; 1000]; 2];
    for (k, buf) in g.iter_mut().enumerate() {
        ctx.reg("g", GRAD, k, buf, F32);
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    assert_eq!(g[1][7], 4.0);
}

#[test]
fn a_stuck_rank_times_out_the_others() {
    if under_mpirun() {
        return;
    }
    launch("stuck_body", 2, 120, None);
}

#[test]
fn a_rank_stopped_mid_transfer_times_out_the_others() {
    if under_mpirun() {
        return;
    }
    launch("stopped_body", 2, 120, None);
}

/// `kill -SIGNAL pid` (SIGSTOP / SIGCONT).
fn signal(signal: &str, pid: i64) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill {signal} {pid}: {status}");
}

/// A rank stopped (SIGSTOP, by the other) a few ms into a 256 MB allreduce, so in its data
/// phase with pieces in flight on both sides: the running rank gets TIMEOUT within about the
/// timeout, its world fails and destroy returns at once. The stopped rank, resumed, fails too
/// (or completes against pieces the other had issued, then fails on its next call), and both
/// processes exit, MPI_Finalize meeting the transfers left pending.
#[test]
fn stopped_body() {
    let Some((rank, _)) = as_rank("stopped_body") else {
        return;
    };
    let n = 64 << 20;
    let mut x = vec![1.0f32; n];
    // Each rank's pid, through a world that lines the ranks up as well.
    let mut pids = [0i64; 2];
    pids[rank] = i64::from(std::process::id());
    let ctx = lined_up_world(&mut pids, 2000);
    ctx.reg("x", STATE, 0, &mut x, F32);
    if rank == 1 {
        finds_the_world_failed(ctx, "stopped rank");
        return;
    }
    let peer = pids[1];
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(5));
        signal("-STOP", peer);
    });
    let start = std::time::Instant::now();
    let st = ctx.allreduce("x", SUM);
    let waited = start.elapsed();
    stopper.join().expect("the stopper thread");
    signal("-CONT", peer);
    let msg = last_error();
    assert_eq!(st, TIMEOUT, "{msg}");
    assert!(
        msg.contains("dpsync_allreduce(name='x'") && msg.contains("2000 ms"),
        "the message names the collective and the wait: {msg}"
    );
    // The data phase is where a stop 5 ms in lands, unless this machine lagged that long.
    if !msg.contains("MPI_Iallreduce") {
        eprintln!("stopped_body: the stop landed outside the data phase: {msg}");
    }
    assert!(waited.as_secs_f64() < 10.0, "returned after {waited:?}");
    assert_eq!(ctx.allreduce("x", SUM), INVALID_STATE, "{}", last_error());
    let start = std::time::Instant::now();
    drop(ctx);
    assert!(
        start.elapsed().as_secs_f64() < 2.0,
        "destroy waited on the lost rank"
    );
}

/// A world of one host replica per rank with a short timeout (`timeout_ms`, for a test whose
/// fault is a rank that does not come), created once `values` are summed across the ranks in a
/// world with world_options' generous timeout: creating a world is a collective under its own
/// timeout, and right after the ranks met it does not wait on a rank still starting up on a
/// busy machine.
fn lined_up_world(values: &mut [i64], timeout_ms: u64) -> Context {
    let lineup = Context::new(&world_options(1));
    lineup.reg("values", STATE, 0, values, I64);
    check(lineup.allreduce("values", SUM), "the ranks line up");
    drop(lineup);
    let o = world_options(1);
    o.set_timeout_ms(timeout_ms);
    Context::new(&o)
}

/// Options for `replicas` host replicas in the MPI_COMM_WORLD world; a timeout, so that a rank
/// that fails an assertion makes the others fail too instead of hanging.
/// The rank that was stopped or late while the other timed out: its `dpsync_allreduce` of the
/// STATE "x" fails with TIMEOUT or INVALID_STATE, at the latest the second time (the first may
/// complete against the exchange the other rank abandoned: a small allreduce's data rides in
/// the agreement the other had sent); then the context goes.
fn finds_the_world_failed(ctx: Context, who: &str) {
    let mut st = ctx.allreduce("x", SUM);
    if st == OK {
        st = ctx.allreduce("x", SUM);
    }
    assert!(
        st == TIMEOUT || st == INVALID_STATE,
        "{who}: {st:?} {}",
        last_error()
    );
    drop(ctx);
}

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

#[test]
fn rank_body() {
    let Some((rank, ranks)) = as_rank("rank_body") else {
        return;
    };
    let local = rank + 1;
    let total: usize = (1..=ranks).sum();
    let offset: usize = (1..=rank).sum();
    let ctx = Context::new(&world_options(local));
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");

    // Who is where.
    let (mut r, mut n, mut t, mut o) = (9, 9, 9, 9);
    unsafe {
        check(dpsync_rank(ctx.0, &mut r, &mut n), "dpsync_rank");
        check(
            dpsync_world_replicas(ctx.0, &mut t, &mut o),
            "world_replicas",
        );
    }
    assert_eq!((r, n, t, o), (rank, ranks, total, offset), "{}", tag("ids"));
    assert_eq!(ctx.replica_count(), local);
    assert_eq!(ctx.loss_scale(), 1.0 / total as f64);
    let d = ctx.describe_json();
    let world = &d["world"];
    assert_eq!(world["engine"], "mpi");
    assert_eq!(world["rank"], rank);
    assert_eq!(world["ranks"], ranks);
    let per_rank: Vec<usize> = (1..=ranks).collect();
    assert_eq!(world["replicas_per_rank"], serde_json::json!(per_rank));
    assert_eq!(world["cross_rank"], "mpi");
    assert!(world["mpi_library"].as_str().is_some_and(|s| !s.is_empty()));
    let levels = d["levels"].as_array().unwrap();
    assert_eq!(levels.last().unwrap()["level"], "ranks", "{d}");

    // Gradients: two f32 tensors (one bucket of two segments), i64, f16.
    let len = [1000usize, 3, 5, 4];
    let mut w32: Vec<Vec<f32>> = vec![vec![0.0; len[0]]; local];
    let mut b32: Vec<Vec<f32>> = vec![vec![0.0; len[1]]; local];
    let mut s64: Vec<Vec<i64>> = vec![vec![0; len[2]]; local];
    let mut h16: Vec<Vec<u16>> = vec![vec![0; len[3]]; local];
    let mut g16: Vec<Vec<u16>> = vec![vec![0; len[3]]; local];
    let fill = |w32: &mut Vec<Vec<f32>>,
                b32: &mut Vec<Vec<f32>>,
                s64: &mut Vec<Vec<i64>>,
                h16: &mut Vec<Vec<u16>>,
                g16: &mut Vec<Vec<u16>>| {
        for k in 0..local {
            let w = offset + k;
            w32[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(w, i) as f32);
            b32[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = -value(w, i) as f32);
            s64[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(w, i) << 40);
            h16[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = f32_to_f16(value(w, i) as f32));
            g16[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = f32_to_bf16(value(w, i) as f32));
        }
    };
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    for k in 0..local {
        ctx.reg("w_grad", GRAD, k, &mut w32[k], F32);
        ctx.reg("b_grad", GRAD, k, &mut b32[k], F32);
        ctx.reg("s_grad", GRAD, k, &mut s64[k], I64);
        ctx.reg("h_grad", GRAD, k, &mut h16[k], F16);
        ctx.reg("g_grad", GRAD, k, &mut g16[k], BF16);
    }
    // Σ over world replicas of value(w, i) = (i + 1) * total * (total + 1) / 2.
    let sum = |i: usize| ((i + 1) * total * (total + 1) / 2) as i64;
    check(ctx.allreduce_grads(SUM), &tag("allreduce_grads SUM"));
    for k in 0..local {
        for i in 0..len[0] {
            assert_eq!(w32[k][i], sum(i) as f32, "{}", tag(&format!("w[{k}][{i}]")));
        }
        for i in 0..len[1] {
            assert_eq!(b32[k][i], -sum(i) as f32, "{}", tag("b"));
        }
        for i in 0..len[2] {
            assert_eq!(s64[k][i], sum(i) << 40, "{}", tag("s"));
        }
        for i in 0..len[3] {
            assert_eq!(f16_to_f32(h16[k][i]), sum(i) as f32, "{}", tag("h"));
            assert_eq!(bf16_to_f32(g16[k][i]), sum(i) as f32, "{}", tag("g"));
        }
    }
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    check(ctx.allreduce_grads(AVG), &tag("allreduce_grads AVG"));
    for k in 0..local {
        for i in 0..len[0] {
            let want = sum(i) as f64 / total as f64;
            assert_eq!(w32[k][i], want as f32, "{}", tag("w avg"));
        }
        for i in 0..len[2] {
            // Integers: the sum divided, truncated toward zero.
            assert_eq!(s64[k][i], (sum(i) << 40) / total as i64, "{}", tag("s avg"));
        }
    }

    // dpsync_allreduce of one tensor, SUM.
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    check(ctx.allreduce("s_grad", SUM), &tag("allreduce s_grad"));
    for k in 0..local {
        assert_eq!(s64[k][2], sum(2) << 40, "{}", tag("allreduce one tensor"));
        assert_eq!(w32[k][0], value(offset + k, 0) as f32, "others untouched");
    }

    // A bucket larger than the engine's pieces (512 KiB): several transfers in flight.
    let big_n = 700_000;
    let mut big: Vec<Vec<f32>> = (0..local)
        .map(|k| {
            (0..big_n)
                .map(|i| ((offset + k) * 3 + i % 1000) as f32)
                .collect()
        })
        .collect();
    for (k, buf) in big.iter_mut().enumerate() {
        ctx.reg("big", STATE, k, buf, F32);
    }
    check(ctx.allreduce("big", SUM), &tag("allreduce big"));
    for buf in &big {
        for i in [0, 131_071, 131_072, 262_144, 524_288, big_n - 1] {
            let want: usize = (0..total).map(|w| w * 3 + i % 1000).sum();
            assert_eq!(buf[i], want as f32, "{}", tag(&format!("big[{i}]")));
        }
    }
    check(ctx.unregister("big"), "unregister big");

    // Broadcast from the last world replica: the last rank's last local replica (not its 0).
    let mut p: Vec<Vec<f64>> = (0..local)
        .map(|k| (0..7).map(|i| ((offset + k) * 100 + i) as f64).collect())
        .collect();
    for (k, buf) in p.iter_mut().enumerate() {
        ctx.reg("p", PARAM, k, buf, F64);
    }
    let root = total - 1;
    check(ctx.broadcast(PARAM, root), &tag("broadcast"));
    for buf in &p {
        for (i, &x) in buf.iter().enumerate() {
            assert_eq!(x, (root * 100 + i) as f64, "{}", tag("broadcast value"));
        }
    }
    assert_eq!(
        ctx.broadcast(PARAM, total),
        INVALID_ARGUMENT,
        "root out of the world"
    );
    assert!(last_error().contains("root_replica"), "{}", last_error());

    // Registrations that differ between ranks: INCONSISTENT everywhere, nothing changed.
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    let mut odd: Vec<Vec<f32>> = vec![vec![1.0; if rank == 1 { 11 } else { 10 }]; local];
    for (k, buf) in odd.iter_mut().enumerate() {
        ctx.reg("odd_grad", GRAD, k, buf, F32);
    }
    assert_eq!(ctx.allreduce_grads(SUM), INCONSISTENT, "{}", tag("odd"));
    let msg = last_error();
    assert!(
        msg.contains("'odd_grad'") && msg.contains("rank 1"),
        "{}",
        tag(&msg)
    );
    assert_eq!(
        w32[0][1],
        value(offset, 1) as f32,
        "{}",
        tag("nothing changed")
    );
    check(ctx.unregister("odd_grad"), "unregister");

    // A call that fails on rank 0 only: its own status there, INCONSISTENT naming it elsewhere.
    let name = if rank == 0 {
        "no_such_tensor"
    } else {
        "s_grad"
    };
    let st = ctx.allreduce(name, SUM);
    let msg = last_error();
    if rank == 0 {
        assert_eq!(st, NOT_FOUND, "{msg}");
    } else {
        assert_eq!(st, INCONSISTENT, "{msg}");
        assert!(msg.contains("rank 0") && msg.contains("NOT_FOUND"), "{msg}");
    }
    assert_eq!(
        s64[0][1],
        value(offset, 1) << 40,
        "{}",
        tag("nothing changed")
    );
    // Ranks making different calls: INCONSISTENT on every rank naming both calls, nothing
    // changed. Another reduce op, then another operation.
    let op = if rank == 0 { SUM } else { AVG };
    assert_eq!(ctx.allreduce("s_grad", op), INCONSISTENT, "{}", tag("op"));
    let msg = last_error();
    assert!(
        msg.contains("rank 0 called dpsync_allreduce(name='s_grad', op=Sum)")
            && msg.contains("dpsync_allreduce(name='s_grad', op=Avg)"),
        "{}",
        tag(&msg)
    );
    let st = if rank == 0 {
        ctx.allreduce_grads(SUM)
    } else {
        ctx.allreduce("s_grad", SUM)
    };
    assert_eq!(st, INCONSISTENT, "{}", tag("operation"));
    let msg = last_error();
    assert!(
        msg.contains("rank 0 called dpsync_allreduce_grads")
            && msg.contains("dpsync_allreduce(name="),
        "{}",
        tag(&msg)
    );
    assert_eq!(
        s64[0][1],
        value(offset, 1) << 40,
        "{}",
        tag("nothing changed")
    );
    // And the context still works.
    check(ctx.allreduce("s_grad", SUM), &tag("after the failures"));
    assert_eq!(s64[0][1], sum(1) << 40);

    half_sums_round_once(&ctx, rank, local, offset, total);
    for coalesce in [false, true] {
        sparse_over_the_world(rank, local, offset, total, coalesce);
    }
    bmuf_over_the_world(&ctx, rank, local, offset, total);

    // Options that must agree: fusion_bytes differs on rank 1.
    let o = world_options(1);
    if rank == 1 {
        o.set_fusion_bytes(1 << 20);
    }
    let mut bad = ptr::null_mut();
    let st = unsafe { dpsync_context_create(o.0, &mut bad) };
    let msg = last_error();
    assert_eq!(st, INCONSISTENT, "{}", tag(&msg));
    assert!(
        msg.contains("fusion_bytes") && msg.contains("rank 1") && msg.contains("rank"),
        "{msg}"
    );
    assert!(bad.is_null());
    // A rank whose own options fail (NCCL for host replicas): its own status there, INCONSISTENT
    // naming it elsewhere, at once (not after the others' timeout).
    let o = world_options(1);
    if rank == 1 {
        o.set_transport(T_NCCL);
    }
    let start = std::time::Instant::now();
    let st = unsafe { dpsync_context_create(o.0, &mut bad) };
    let msg = last_error();
    if rank == 1 {
        assert_eq!(st, INVALID_ARGUMENT, "{}", tag(&msg));
    } else {
        assert_eq!(st, INCONSISTENT, "{}", tag(&msg));
        assert!(
            msg.contains("rank 1") && msg.contains("INVALID_ARGUMENT"),
            "{msg}"
        );
    }
    assert!(start.elapsed().as_secs() < 60, "{}", tag("failed at once"));
    assert!(bad.is_null());
    drop(ctx);
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

/// A rank that does not come: rank 1 sleeps past the timeout while rank 0 calls
/// dpsync_allreduce. Rank 0 gets TIMEOUT within about the timeout, naming the collective and the
/// wait, then INVALID_STATE for further collectives while queries still answer, and destroy
/// returns at once. Rank 1, arriving late, fails too at the latest on its next call (never a
/// hang), and the processes exit.
#[test]
fn stuck_body() {
    let Some((rank, _)) = as_rank("stuck_body") else {
        return;
    };
    let ctx = lined_up_world(&mut [0], 2000);
    let mut x = vec![1.0f32; 8];
    ctx.reg("x", STATE, 0, &mut x, F32);
    if rank == 1 {
        std::thread::sleep(std::time::Duration::from_secs(6));
        finds_the_world_failed(ctx, "late rank");
        return;
    }
    let start = std::time::Instant::now();
    let st = ctx.allreduce("x", SUM);
    let waited = start.elapsed();
    let msg = last_error();
    assert_eq!(st, TIMEOUT, "{msg}");
    assert!(
        msg.contains("dpsync_allreduce") && msg.contains("2000 ms"),
        "the message names the collective and the wait: {msg}"
    );
    assert!(waited.as_secs_f64() < 10.0, "returned after {waited:?}");
    assert_eq!(x[0], 1.0, "nothing changed");
    assert_eq!(ctx.allreduce("x", SUM), INVALID_STATE, "{}", last_error());
    assert!(last_error().contains("failed"), "{}", last_error());
    assert_eq!(ctx.replica_count(), 1, "queries still answer");
    assert!(ctx.describe_json()["world"]["failed"].is_string());
    let start = std::time::Instant::now();
    drop(ctx);
    assert!(
        start.elapsed().as_secs_f64() < 2.0,
        "destroy waited on the lost rank"
    );
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
