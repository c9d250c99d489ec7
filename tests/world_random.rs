//! Random calls across the ranks of an MPI world, checked against a model (built with
//! `--features mpi` only; docs/ARCHITECTURE.md, "Randomized cross-rank test"). The calls are
//! common/world_calls.rs's, shared with the CUDA form (tests/world_random_cuda.rs).
//!
//! `random_calls_across_ranks` runs `random_body` under `mpirun -n 2` (1 and 2 host replicas),
//! `-n 3` (3, 1 and 2) and `-n 2` again with 2 and 2 (`DPSYNC_RANDOM_EVEN=2`: as many on
//! every rank, where a reproducible context's float buckets cross even, as they do uneven); every third seed puts one replica on every rank (the engine's own
//! reduce-scatter and allgather, early buckets serving either gradient step). Every rank draws the same calls from each seed: registrations of
//! every dtype and role, sparse gradients and their slices, `dpsync_grad_ready` marks, the
//! collectives, reduce-scatter steps and allgathers, and per seed the reproducible-sum option. Now and then one rank deviates (another op, name, root, roles or call, an
//! invalid argument, registrations of its own, a bad sparse index). In one seed in three, ranks
//! leave at random calls (`dpsync_leave`, one rank at a time, one always stays;
//! common/world_calls/leave.rs):
//! the others' collective completes over their replicas and the model drops the leaver's. The model
//! (common/world_model.rs) holds every tensor's values on every world replica, so every rank
//! knows what each rank must see: after each call it checks its status and message
//! ("Agreement before mutation" in dpsync_world.h), its replicas' bytes and sparse outputs, and
//! after a failure that the call without the deviation works.
//!
//! `random_kills_across_ranks` (under an MPI with ULFM named by `DPSYNC_ULFM`, else skipped)
//! runs `kill_body`: the same calls in an elastic world where one rank SIGKILLs itself at a
//! call drawn from the seed (common/world_calls/kill.rs). The survivors check RANK_LOST naming
//! it, every tensor but the GRADs kept, then drop it from the model, compute the GRADs again,
//! make the call again and go on; now and then min_ranks is every rank and the context is
//! failed instead. One mpirun per seed (the lost rank's process is gone), 3 ranks by default
//! (`DPSYNC_RANDOM_RANKS`), seeds `DPSYNC_RANDOM_KILL_SEEDS` (`N` or `A..B`, default 3).
//!
//! Environment: `DPSYNC_RANDOM_SEEDS` (`N`: seeds 0..N-1, or `A..B`), `DPSYNC_RANDOM_CALLS`
//! (collectives and registrations per seed), `DPSYNC_RANDOM_NO` (classes switched off, comma
//! separated: `CLASSES`), `DPSYNC_RANDOM_RANKS` (`2,3`), `DPSYNC_RANDOM_LIMIT_S` (per mpirun),
//! `DPSYNC_RANDOM_TIMEOUT_MS` (the contexts' timeout), `DPSYNC_RANDOM_TRACE=1` (rank 0 prints
//! every call). scripts/world-random.sh sets them from its arguments. The launcher sets
//! `DPSYNC_RANDOM_EVEN=2` (each rank's replica count) for its last run, which it always
//! makes, so scripts/world-random.sh replays that run's seeds too. `DPSYNC_MPI_SHM=0`
//! turns the shared memory between the ranks off (scripts/test.sh runs the test both ways):
//! every piece then crosses in MPI messages, and the reduce-scatter and allgather of one
//! replica per rank take their halves of the ring (`backend/mpi/owners.rs`).
#![cfg(feature = "mpi")]

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod float16;
    pub mod lcg;
    pub mod mpi;
    pub mod place;
    pub mod skip;
    pub mod sparse;
    pub mod world_calls;
    pub mod world_model;
}

use common::abi::T_AUTO;
use common::mpi::{as_rank, launch, launch_ulfm, ulfm_venv, under_mpirun};
use common::world_calls::{layout, run, Setup};
use common::world_model::{env, env_num, seeds_from, Config, Where};

/// The launchers take turns: ranks of two worlds at once would spin against each other on a
/// small machine.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn random_calls_across_ranks() {
    if under_mpirun() {
        return; // a rank runs random_body only
    }
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let limit = env_num("DPSYNC_RANDOM_LIMIT_S", 300);
    for n in env("DPSYNC_RANDOM_RANKS")
        .unwrap_or("2,3".into())
        .split(',')
    {
        let n = n.trim().parse().expect("DPSYNC_RANDOM_RANKS: e.g. 2,3");
        launch("random_body", n, limit, None);
    }
    // Two replicas on each of 2 ranks: as many on every rank (the layouts above are uneven).
    let even = Some(("DPSYNC_RANDOM_EVEN", std::path::Path::new("2")));
    launch("random_body", 2, limit, even);
}

#[test]
fn random_kills_across_ranks() {
    if under_mpirun() {
        return; // a rank runs kill_body only
    }
    let Some(venv) = ulfm_venv("random_kills_across_ranks (the kill variant)") else {
        return;
    };
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let limit = env_num("DPSYNC_RANDOM_LIMIT_S", 300);
    for n in env("DPSYNC_RANDOM_RANKS").unwrap_or("3".into()).split(',') {
        let n: usize = n.trim().parse().expect("DPSYNC_RANDOM_RANKS: e.g. 3,4");
        for seed in seeds_from("DPSYNC_RANDOM_KILL_SEEDS", 3) {
            let seeds = format!("{seed}..{seed}");
            // DPSYNC_RANDOM_KILL: the replay line names the kill variant.
            let env = [
                ("DPSYNC_RANDOM_SEEDS", seeds.as_str()),
                ("DPSYNC_RANDOM_KILL", "1"),
            ];
            launch_ulfm("kill_body", n, limit, &venv, &env, n - 1);
        }
    }
}

#[test]
fn random_body() {
    let Some((rank, ranks)) = as_rank("random_body") else {
        return;
    };
    run(rank, &layout(ranks), &Config::from_env(50, 800), &setup());
}

#[test]
fn kill_body() {
    let Some((rank, ranks)) = as_rank("kill_body") else {
        return;
    };
    let cfg = Config {
        kill: true,
        ..Config::from_env(1, 800)
    };
    run(rank, &layout(ranks), &cfg, &setup());
    // On a line of its own (the harness's "test kill_body ... " has none): launch_ulfm counts them.
    println!("\nSURVIVED kill_body");
}

fn setup() -> Setup {
    Setup {
        test: "world_random",
        at: Where::Host,
        transport: T_AUTO, // host replicas: unused
        lockstep: false,
        groups: 0,
        replay: |_, seed, calls, ranks| {
            let no = env("DPSYNC_RANDOM_NO").map_or(String::new(), |v| format!(" --no {v}"));
            // Without shared memory between the ranks, the replay needs it off too.
            let shm = match env("DPSYNC_MPI_SHM").as_deref() {
                Some("0") => "DPSYNC_MPI_SHM=0 ",
                _ => "",
            };
            let seeds = match env("DPSYNC_RANDOM_KILL") {
                Some(_) => "kills",
                None => "seeds",
            };
            format!(
                "{shm}scripts/world-random.sh --{seeds} {seed}..{seed} --calls {calls} --ranks {ranks}{no}"
            )
        },
    }
}
