//! The fake NCCL's sends and receives between processes (tests/fakecuda/fake_nccl_across.hpp,
//! `p2p_across`), strict as dpsync's all-to-all needs them: two child processes of this test
//! binary each initialise one rank of a clique whose unique id this process made, and queue one
//! group of `ncclSend`/`ncclRecv`. Matched pairs move their bytes; a recv whose count differs
//! from its send's, or sends that meet no recv, fail the group on both processes with
//! ncclInvalidUsage and a text naming the link. Only on the fake (`DPSYNC_FAKE_CUDA=1`): real
//! NCCL hangs on such a group.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::process::{Command, Stdio};

use cudarc::driver::{CudaContext, DevicePtr};

const CHILD: &str = "DPSYNC_P2P_CHILD";
const INVALID_USAGE: c_int = 5;
const FLOAT32: c_int = 7;

type Init = unsafe extern "C" fn(*mut *mut c_void, c_int, [u8; 128], c_int) -> c_int;
type P2p =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;

/// Runs `case` on two child processes at once; each child's stdout.
fn both(case: &str) -> Vec<String> {
    // SAFETY: the fake's ncclGetUniqueId(ncclUniqueId*).
    let id = unsafe {
        let lib = libloading::Library::new("libnccl.so.2").expect("the fake NCCL");
        let get =
            (lib.get::<unsafe extern "C" fn(*mut [u8; 128]) -> c_int>(b"ncclGetUniqueId")).unwrap();
        let mut id = [0u8; 128];
        assert_eq!(get(&mut id), 0);
        id
    };
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    // Both spawned before either is waited for: each waits for its peer's round.
    let children: Vec<_> = (0..2)
        .map(|rank| {
            (Command::new(&exe))
                .args(["--exact", "fake_nccl_p2p::child", "--nocapture"])
                .env(CHILD, format!("{rank} {case} {hex}"))
                .stdout(Stdio::piped())
                .spawn()
                .expect("a child process")
        })
        .collect();
    (children.into_iter())
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "a child failed: {out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .collect()
}

/// The child's part: rank `rank` of 2 queues `case`'s group and prints the group's outcome
/// (`rc <code> <text>`) and, for a matched case, what it received.
#[test]
fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return; // run by `sends_and_receives_between_processes` only
    };
    let mut words = spec.split(' ');
    let (rank, case, hex) = (
        words.next().unwrap().parse::<usize>().unwrap(),
        words.next().unwrap().to_owned(),
        words.next().unwrap(),
    );
    let mut id = [0u8; 128];
    for (k, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * k..2 * k + 2], 16).unwrap();
    }
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let stream = ctx.default_stream();
    let mine: Vec<f32> = (0..16).map(|i| (rank * 100 + i) as f32).collect();
    let send = stream.clone_htod(&mine).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(16).unwrap();
    let (sp, _s) = send.device_ptr(&stream);
    let rp = {
        let (p, _s) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut recv, &stream);
        p
    };
    let peer = 1 - rank as c_int;
    // SAFETY: the fake NCCL's entry points, on buffers of 16 f32 in fake device memory.
    let (rc, state, text) = unsafe {
        let lib = libloading::Library::new("libnccl.so.2").unwrap();
        let init = lib.get::<Init>(b"ncclCommInitRank").unwrap();
        let send_f = lib.get::<P2p>(b"ncclSend").unwrap();
        let recv_f = lib.get::<P2p>(b"ncclRecv").unwrap();
        let start = lib
            .get::<unsafe extern "C" fn() -> c_int>(b"ncclGroupStart")
            .unwrap();
        let end = lib
            .get::<unsafe extern "C" fn() -> c_int>(b"ncclGroupEnd")
            .unwrap();
        let state_f = (lib.get::<unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int>(
            b"ncclCommGetAsyncError",
        ))
        .unwrap();
        let last = (lib
            .get::<unsafe extern "C" fn(*mut c_void) -> *const c_char>(b"ncclGetLastError"))
        .unwrap();
        let mut comm = std::ptr::null_mut();
        assert_eq!(init(&mut comm, 2, id, rank as c_int), 0, "init");
        // In progress until the other process's rank joined (real NCCL's init blocks).
        let mut joined = 7;
        while joined == 7 {
            assert_eq!(state_f(comm, &mut joined), 0);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(joined, 0, "init");
        let s = stream.cu_stream() as *mut c_void;
        start();
        let count = if case == "count" && rank == 1 { 8 } else { 16 };
        send_f(sp as *mut c_void, 16, FLOAT32, peer, comm, s);
        if case != "unpaired" {
            recv_f(rp as *mut c_void, count, FLOAT32, peer, comm, s);
        }
        let rc = end();
        stream.synchronize().unwrap();
        let mut state = 0;
        state_f(comm, &mut state);
        let text = CStr::from_ptr(last(comm)).to_string_lossy().into_owned();
        // Unlinks the clique's files in /dev/shm.
        let destroy = lib.get::<unsafe extern "C" fn(*mut c_void) -> c_int>(b"ncclCommDestroy");
        destroy.unwrap()(comm);
        (rc, state, text)
    };
    let got = stream.clone_dtoh(&recv).unwrap();
    let first = if rc != 0 { rc } else { state };
    println!("rc {first} {text}");
    println!(
        "data {}",
        got.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
}

#[test]
fn sends_and_receives_between_processes_pair_strictly() {
    if std::env::var("DPSYNC_FAKE_CUDA").as_deref() != Ok("1") || std::env::var_os(CHILD).is_some()
    {
        println!(
            "sends_and_receives_between_processes_pair_strictly: skipped (the fake NCCL only)"
        );
        return;
    }
    let outs = both("match");
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.contains("rc 0 "), "rank {rank}: {out}");
        let want: Vec<String> = (0..16)
            .map(|i| ((1 - rank) * 100 + i).to_string())
            .collect();
        assert!(
            out.contains(&format!("data {}", want.join(","))),
            "rank {rank}: {out}"
        );
    }
    for (case, text) in [
        (
            "count",
            "send #0 from rank 0 to rank 1 is 16 float32, the recv it pairs with 8",
        ),
        (
            "unpaired",
            "rank 0 queued 1 send(s) to rank 1, but rank 1 queued 0 recv(s)",
        ),
    ] {
        for (rank, out) in both(case).iter().enumerate() {
            assert!(
                out.contains(&format!("rc {INVALID_USAGE} ")),
                "{case}, rank {rank}: {out}"
            );
            assert!(out.contains(text), "{case}, rank {rank}: {out}");
            // Nothing received: the group did not run.
            assert!(
                out.contains(&format!("data {}", ["0"; 16].join(","))),
                "{case}: {out}"
            );
        }
    }
}
