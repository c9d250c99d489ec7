//! A stuck rank and a rank stopped mid-transfer time out the others (`stuck_body`, `stopped_body`).

use super::*;

#[test]
fn a_stuck_rank_times_out_the_others() {
    if under_mpirun() {
        return;
    }
    launch("timeouts::stuck_body", 2, 120, None);
}

#[test]
fn a_rank_stopped_mid_transfer_times_out_the_others() {
    if under_mpirun() {
        return;
    }
    launch("timeouts::stopped_body", 2, 120, None);
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
