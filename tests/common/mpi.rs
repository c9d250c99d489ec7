//! Tests that run as the ranks of an MPI world: a launcher test starts its own binary under
//! `timeout LIMIT mpirun -n N` (Open MPI's flags for this root, 2-core machine), where a body
//! test runs as every rank.

use std::path::Path;
use std::process::Command;

/// Whether this process is a rank started by mpirun (Open MPI, MPICH/Hydra).
pub fn under_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// Runs `body` (a test of this binary) as every rank of `mpirun -n ranks`, killed after
/// `limit_s` seconds: a hang fails the test instead of stalling the suite. `env`: one more
/// variable for the ranks.
#[allow(dead_code)]
pub fn launch(body: &str, ranks: usize, limit_s: u64, env: Option<(&str, &Path)>) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = Command::new("timeout");
    if let Some((key, value)) = env {
        command.env(key, value);
    }
    let status = command
        .args([
            &limit_s.to_string(),
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
        ])
        .args(["-n", &ranks.to_string()])
        .arg(&exe)
        .args([body, "--exact", "--nocapture", "--test-threads=1"])
        .env("DPSYNC_TEST_RANKS", ranks.to_string())
        .status()
        .expect("mpirun (Open MPI) must be installed: scripts/common.sh ensure_mpi");
    assert!(status.success(), "{body} on {ranks} ranks: {status}");
}

/// This rank and the number of ranks, when run by [`launch`]; None (and a printed skip)
/// otherwise.
#[allow(dead_code)]
pub fn as_rank(body: &str) -> Option<(usize, usize)> {
    if !under_mpirun() {
        super::skip::skip(format_args!(
            "{body}: skipped: runs only as an MPI rank (a launcher test of this file starts it)"
        ));
        return None;
    }
    let ranks: usize = std::env::var("DPSYNC_TEST_RANKS").unwrap().parse().unwrap();
    let rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .or_else(|_| std::env::var("PMI_RANK"))
        .unwrap()
        .parse()
        .unwrap();
    Some((rank, ranks))
}
