//! The randomized cross-rank test on CUDA replicas (built with `--features mpi` only;
//! docs/ARCHITECTURE.md, "Randomized cross-rank test"): the calls, deviations and model of
//! tests/world_random.rs (common/world_calls.rs, common/world_model.rs), with every tensor and
//! sparse slice in device memory of CUDA replicas, read back after `dpsync_synchronize`.
//!
//! `random_calls_across_ranks_on_cuda` runs `random_cuda_body` under `mpirun -n 2` (1 and 2
//! replicas: GPU 0; GPUs 0 and 1), `-n 3` (3, 1 and 2: GPUs 0, 0 and 1; GPU 1; GPUs 0 and 0)
//! and `-n 2` again with GPUs 0 and 1 on each rank (`DPSYNC_RANDOM_EVEN=2`);
//! every rank runs the seeds with transport NCCL (one clique over every rank's GPUs), then with
//! PEER_COPY (each rank's sum staged through page-locked host memory and MPI), in one mpirun so
//! that each rank compiles dpsync's kernels once. scripts/test.sh runs it on the fake CUDA
//! driver and NCCL (two fake GPUs per rank), with synchronous and asynchronous streams; on a
//! machine without a CUDA driver every rank prints that it was skipped. Smaller than the host
//! run by default: 10 seeds of 150 calls per layout and transport. Values are read after
//! `dpsync_synchronize` when a call succeeded, and as the replicas' streams see them after a
//! failure (`World::check_unchanged` says why).
//!
//! What the CUDA form does differently, by the library's rules for CUDA replicas:
//! - a bad sparse index (`sparse_index`) is found by a kernel on the device: the step succeeds
//!   on every rank with the index gathered as given, and only that rank's next
//!   `dpsync_synchronize` reports it (docs/API.md, worlds);
//! - `dpsync_grad_ready` starts buckets early with NCCL across the ranks and on the staged
//!   path (a rank of one replica copies its bucket to page-locked memory, a rank of several
//!   its levels 1–2 sum): every rank checks the buckets it started against describe, and a rank that calls another collective (`call`) while it has buckets in
//!   flight on the clique is refused at once, with its own INVALID_STATE;
//! - excluded: with synchronous streams (the fake driver without FAKE_CUDA_ASYNC=1) a fake
//!   NCCL collective completes inside the call that queues it only once every rank queued it,
//!   so ranks that start different buckets early would wait for each other for ever: there the
//!   marks are alike on every rank, and made only where every rank starts the same buckets
//!   (`Setup::lockstep`; uneven marks run with FAKE_CUDA_ASYNC=1 and on a GPU).
//! - ranks leave (`leave`) as on host replicas, but with no marks at the call a rank leaves at
//!   (buckets started early on the NCCL clique there would be a case of its own; tests/world_leave.rs
//!   has a leave while host replicas' buckets were started early).
//!
//! `random_kills_across_ranks_on_cuda` (under an MPI with ULFM named by `DPSYNC_ULFM`, else
//! skipped) runs `kill_cuda_body`: tests/world_random.rs's kill variant on CUDA replicas, one
//! mpirun per seed and transport (`DPSYNC_RANDOM_KILL_SEEDS`, default 2; 3 ranks), one rank
//! SIGKILLing itself at a call drawn from the seed, the survivors checking RANK_LOST, the
//! bytes kept and the redo, the NCCL clique made again over them. Not with synchronous fake
//! streams: there a fake NCCL collective completes inside the call only once every rank
//! queued it, and a dead rank's never comes.
//!
//! Environment: as tests/world_random.rs (`DPSYNC_RANDOM_SEEDS`, `DPSYNC_RANDOM_CALLS`,
//! `DPSYNC_RANDOM_NO`, `DPSYNC_RANDOM_RANKS`, `DPSYNC_RANDOM_LIMIT_S`, `DPSYNC_RANDOM_TIMEOUT_MS`,
//! `DPSYNC_RANDOM_TRACE`), and `DPSYNC_RANDOM_TRANSPORTS` (`nccl,peer_copy`).
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

use common::abi::{T_NCCL, T_PEER_COPY};
use common::mpi::{as_rank, launch, launch_ulfm, ulfm_venv, under_mpirun};
use common::place::{device_count, Place};
use common::world_calls::{layout, run, Setup};
use common::world_model::{env, env_num, seeds_from, Config, Where};

fn flag(key: &str) -> bool {
    std::env::var(key).as_deref() == Ok("1")
}

#[test]
fn random_calls_across_ranks_on_cuda() {
    if under_mpirun() {
        return; // a rank runs random_cuda_body only
    }
    let limit = env_num("DPSYNC_RANDOM_LIMIT_S", 300);
    for n in env("DPSYNC_RANDOM_RANKS")
        .unwrap_or("2,3".into())
        .split(',')
    {
        let n = n.trim().parse().expect("DPSYNC_RANDOM_RANKS: e.g. 2,3");
        // Every transport in one mpirun: each rank compiles dpsync's kernels once.
        launch("random_cuda_body", n, limit, None);
    }
    // Two replicas on each of 2 ranks: as many on every rank (the layouts above are uneven).
    let even = Some(("DPSYNC_RANDOM_EVEN", std::path::Path::new("2")));
    launch("random_cuda_body", 2, limit, even);
}

/// Each rank's CUDA ordinals, `layout`'s replica counts: two GPUs where there are (the fakes
/// give each rank two), replicas sharing a GPU and replicas on several; on one GPU all on it.
fn ordinals(rank: usize, ranks: usize) -> Vec<i32> {
    let gpus = device_count().clamp(1, 2) as i32;
    let on: Vec<i32> = match (ranks, layout(ranks)[rank]) {
        (3, _) => [&[0, 0, 1][..], &[1], &[0, 0]][rank].to_vec(),
        (_, 1) => vec![0],
        (_, n) => (0..n as i32).collect(),
    };
    on.into_iter().map(|d| d % gpus).collect()
}

#[test]
fn random_kills_across_ranks_on_cuda() {
    const TEST: &str = "random_kills_across_ranks_on_cuda (the kill variant on CUDA replicas)";
    if under_mpirun() {
        return; // a rank runs kill_cuda_body only
    }
    let Some(venv) = ulfm_venv(TEST) else {
        return;
    };
    if flag("DPSYNC_FAKE_CUDA") && !flag("FAKE_CUDA_ASYNC") {
        common::skip::skip(format_args!(
            "{TEST}: skipped with synchronous fake streams (FAKE_CUDA_ASYNC=1 runs it)"
        ));
        return;
    }
    if Place::gpus(TEST, 1).is_none() {
        return; // it said it was skipped
    }
    let limit = env_num("DPSYNC_RANDOM_LIMIT_S", 300);
    let transports = env("DPSYNC_RANDOM_TRANSPORTS").unwrap_or("nccl,peer_copy".into());
    for n in env("DPSYNC_RANDOM_RANKS").unwrap_or("3".into()).split(',') {
        let n: usize = n.trim().parse().expect("DPSYNC_RANDOM_RANKS: e.g. 3");
        for seed in seeds_from("DPSYNC_RANDOM_KILL_SEEDS", 2) {
            for transport in transports.split(',').map(str::trim) {
                let seeds = format!("{seed}..{seed}");
                // The lost rank's process is gone, and MPI_COMM_WORLD with it: one seed and
                // transport per mpirun.
                let env = [
                    ("DPSYNC_RANDOM_SEEDS", seeds.as_str()),
                    ("DPSYNC_RANDOM_TRANSPORTS", transport),
                    ("DPSYNC_RANDOM_KILL", "1"),
                ];
                launch_ulfm("kill_cuda_body", n, limit, &venv, &env, n - 1);
            }
        }
    }
}

#[test]
fn random_cuda_body() {
    let Some((rank, ranks)) = as_rank("random_cuda_body") else {
        return;
    };
    cuda_body(rank, ranks, &Config::from_env(10, 150));
}

#[test]
fn kill_cuda_body() {
    let Some((rank, ranks)) = as_rank("kill_cuda_body") else {
        return;
    };
    let cfg = Config {
        kill: true,
        ..Config::from_env(1, 150)
    };
    cuda_body(rank, ranks, &cfg);
    // On a line of its own: launch_ulfm counts them.
    println!("\nSURVIVED kill_cuda_body");
}

/// Every transport of `DPSYNC_RANDOM_TRANSPORTS` in turn, on this rank's GPUs.
fn cuda_body(rank: usize, ranks: usize, cfg: &Config) {
    let transports = env("DPSYNC_RANDOM_TRANSPORTS").unwrap_or("nccl,peer_copy".into());
    for transport in transports.split(',').map(str::trim) {
        let (transport, test) = match transport {
            "nccl" => (T_NCCL, "world_random_cuda, NCCL across the ranks"),
            "peer_copy" => (T_PEER_COPY, "world_random_cuda, staged (PEER_COPY)"),
            t => panic!("DPSYNC_RANDOM_TRANSPORTS: nccl, peer_copy (not '{t}')"),
        };
        // Without a CUDA driver every rank says it is skipped, once.
        let Some(place) = Place::gpus("random_cuda_body", 1) else {
            return;
        };
        // On one GPU every replica is on it: a real NCCL refuses ranks sharing it
        // ("Duplicate GPU detected") unless NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30).
        let shared_gpu = ranks > 1
            && device_count() == 1
            && std::env::var_os("NCCL_MULTI_RANK_GPU_ENABLE").is_none();
        if transport == T_NCCL && shared_gpu {
            if rank == 0 {
                println!(
                    "{test}: skipped on {ranks} ranks: they share the one GPU (set \
                     NCCL_MULTI_RANK_GPU_ENABLE=1 on NCCL >= 2.30)"
                );
            }
            continue;
        }
        let nccl = transport == T_NCCL;
        let (per_rank, on) = (layout(ranks), ordinals(rank, ranks));
        let setup = Setup {
            test,
            at: Where::Cuda(place, on),
            transport,
            lockstep: nccl && flag("DPSYNC_FAKE_CUDA") && !flag("FAKE_CUDA_ASYNC"),
            groups: (0..ranks)
                .map(|r| {
                    let mut on = ordinals(r, ranks);
                    on.sort_unstable();
                    on.dedup();
                    on.len()
                })
                .sum(),
            replay,
        };
        run(rank, &per_rank, cfg, &setup);
    }
}

/// The command line that replays `seed` of `setup`'s run on the fake CUDA driver (or on the
/// GPUs of this machine).
fn replay(setup: &Setup, seed: u64, calls: usize, ranks: usize) -> String {
    let no = env("DPSYNC_RANDOM_NO").unwrap_or_default();
    let transport = if setup.transport == T_NCCL {
        "nccl"
    } else {
        "peer_copy"
    };
    let fake = match flag("DPSYNC_FAKE_CUDA") {
        true => {
            let streams = if flag("FAKE_CUDA_ASYNC") { "1" } else { "" };
            format!(
                "DPSYNC_FAKE_CUDA=1 DPSYNC_REQUIRE_GPU=1 FAKE_CUDA_DEVICES=2 \
                 FAKE_CUDA_ASYNC={streams} LD_LIBRARY_PATH=$PWD/target/fakecuda "
            )
        }
        false => String::new(),
    };
    // The kill variant: its launcher, under Open MPI 5 with ULFM.
    let (seeds, test) = match env("DPSYNC_RANDOM_KILL") {
        Some(_) => (
            "DPSYNC_ULFM=<venv> DPSYNC_RANDOM_KILL_SEEDS",
            " random_kills_across_ranks_on_cuda",
        ),
        None => ("DPSYNC_RANDOM_SEEDS", ""),
    };
    format!(
        "{fake}{seeds}={seed}..{seed} DPSYNC_RANDOM_CALLS={calls} \
         DPSYNC_RANDOM_RANKS={ranks} DPSYNC_RANDOM_TRANSPORTS={transport} DPSYNC_RANDOM_NO={no} \
         cargo test --release --features mpi --target-dir target/mpi --test world_random_cuda{test}"
    )
}
