//! The fake NCCL's `ncclCommShrink` (tests/fakecuda/fake_nccl_shrink.hpp), strict as dpsync's
//! elastic worlds need it: a clique of two ranks in this process; rank 1 shrunk without rank 0
//! becomes rank 0 of a clique of one; an excluded rank out of range or listed twice, a rank
//! excluding itself, unknown flags, and a failed parent without `NCCL_SHRINK_ABORT` are refused;
//! after a shrink with it the parent takes no more ops. Only on the fake (`DPSYNC_FAKE_CUDA=1`).

use std::ffi::{c_char, c_int, c_void, CStr};

const INVALID_ARGUMENT: c_int = 4;
const INVALID_USAGE: c_int = 5;
const SHRINK_ABORT: c_int = 1;

type Shrink = unsafe extern "C" fn(
    *mut c_void,
    *const c_int,
    c_int,
    *mut *mut c_void,
    *mut c_void,
    c_int,
) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;
type Info = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;

#[test]
fn shrink_makes_the_survivors_clique_strictly() {
    if std::env::var("DPSYNC_FAKE_CUDA").as_deref() != Ok("1") {
        println!("shrink_makes_the_survivors_clique_strictly: skipped (the fake NCCL only)");
        return;
    }
    // SAFETY: the fake NCCL's entry points with their prototypes; handles it made.
    unsafe {
        // The fake NCCL finds the fake driver's helpers in the driver already loaded.
        let _driver = libloading::Library::new("libcuda.so.1").expect("the fake CUDA driver");
        let lib = libloading::Library::new("libnccl.so.2").expect("the fake NCCL");
        let init_all = (lib
            .get::<unsafe extern "C" fn(*mut *mut c_void, c_int, *const c_int) -> c_int>(
                b"ncclCommInitAll",
            ))
        .unwrap();
        let shrink = lib.get::<Shrink>(b"ncclCommShrink").unwrap();
        let count = lib.get::<Info>(b"ncclCommCount").unwrap();
        let user_rank = lib.get::<Info>(b"ncclCommUserRank").unwrap();
        let all_reduce = lib.get::<AllReduce>(b"ncclAllReduce").unwrap();
        let last = (lib
            .get::<unsafe extern "C" fn(*mut c_void) -> *const c_char>(b"ncclGetLastError"))
        .unwrap();
        let abort = lib
            .get::<unsafe extern "C" fn(*mut c_void) -> c_int>(b"ncclCommAbort")
            .unwrap();
        let text = |c: *mut c_void| CStr::from_ptr(last(c)).to_string_lossy().into_owned();
        let mut comms = [std::ptr::null_mut(); 2];
        assert_eq!(init_all(comms.as_mut_ptr(), 2, [0, 1].as_ptr()), 0, "init");
        let mut child = std::ptr::null_mut();
        let null = std::ptr::null_mut();
        for (list, flags, why) in [
            (vec![2], SHRINK_ABORT, "out of range"),
            (vec![0, 0], SHRINK_ABORT, "listed twice"),
            (vec![1], SHRINK_ABORT, "excludes itself"),
            (vec![0], 2, "flags 2"),
        ] {
            let rc = shrink(
                comms[1],
                list.as_ptr(),
                list.len() as c_int,
                &mut child,
                null,
                flags,
            );
            assert_eq!(rc, INVALID_ARGUMENT, "{why}");
            assert!(text(comms[1]).contains(why), "{why}: {}", text(comms[1]));
        }
        // Rank 1 fails (an op with no CUDA context current on this thread): only
        // NCCL_SHRINK_ABORT shrinks it.
        let f = [0f32; 1].as_ptr() as *mut c_void;
        let rc = all_reduce(f, f, 1, 7, 0, comms[1], null);
        assert_eq!(rc, INVALID_USAGE, "a failing op: {}", text(comms[1]));
        let rc = shrink(comms[1], [0].as_ptr(), 1, &mut child, null, 0);
        assert_eq!(
            rc, INVALID_USAGE,
            "a failed parent without NCCL_SHRINK_ABORT"
        );
        assert!(
            text(comms[1]).contains("without NCCL_SHRINK_ABORT"),
            "{}",
            text(comms[1])
        );
        assert_eq!(
            shrink(comms[1], [0].as_ptr(), 1, &mut child, null, SHRINK_ABORT),
            0
        );
        let (mut n, mut r) = (0, -1);
        assert_eq!(count(child, &mut n), 0);
        assert_eq!(user_rank(child, &mut r), 0);
        assert_eq!((n, r), (1, 0), "rank 1 of 2 without rank 0: rank 0 of 1");
        // The parent, its ops ended, takes no more.
        let rc = all_reduce(f, f, 1, 7, 0, comms[1], null);
        assert_eq!(rc, INVALID_USAGE, "an op on the shrunk parent");
        assert!(
            text(comms[1]).contains("after ncclCommShrink"),
            "{}",
            text(comms[1])
        );
        for c in [child, comms[0], comms[1]] {
            abort(c);
        }
    }
}
