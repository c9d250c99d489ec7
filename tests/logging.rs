//! Logging through the C ABI: silent by default, DPSYNC_LOG to stderr, a callback instead.

mod common {
    pub mod abi;
    pub mod context;
    pub mod skip;
}

use std::ffi::{c_char, c_void, CStr};
use std::process::Command;
use std::ptr;
use std::sync::Mutex;

use common::{abi::*, context::*};
use dpsync::*;

static LINES: Mutex<Vec<(u32, String, usize)>> = Mutex::new(Vec::new());

unsafe extern "C" fn collect(level: u32, message: *const c_char, user_data: *mut c_void) {
    let text = CStr::from_ptr(message).to_string_lossy().into_owned();
    LINES
        .lock()
        .unwrap()
        .push((level, text, user_data as usize));
}

fn taken() -> Vec<(u32, String, usize)> {
    std::mem::take(&mut *LINES.lock().unwrap())
}

const INFO: u32 = dpsync_log_level::DPSYNC_LOG_INFO as u32;
const DEBUG: u32 = dpsync_log_level::DPSYNC_LOG_DEBUG as u32;
const WARN: u32 = dpsync_log_level::DPSYNC_LOG_WARN as u32;

/// One test: the callback is process-wide.
#[test]
fn a_callback_gets_the_lines_at_its_level() {
    let mut token = 7u8;
    let user = &mut token as *mut u8 as *mut c_void;
    // SAFETY: a callable function and any pointer.
    unsafe {
        assert_eq!(
            dpsync_set_log_callback(Some(collect), user, 9),
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("level"), "{}", last_error());
        check(
            dpsync_set_log_callback(Some(collect), user, INFO),
            "set callback",
        );
    }
    let ctx = Context::host(2, None);
    let lines = taken();
    let created = lines
        .iter()
        .find(|(_, t, _)| t.starts_with("context created: 2 replicas [host, host], transport host"))
        .unwrap_or_else(|| panic!("no creation line in {lines:?}"));
    assert_eq!((created.0, created.2), (INFO, user as usize));
    // Below the threshold: nothing (a failed call logs at DEBUG).
    assert_eq!(ctx.allreduce("missing", SUM), NOT_FOUND);
    assert!(taken().is_empty());
    // SAFETY: as above.
    unsafe { check(dpsync_set_log_callback(Some(collect), user, DEBUG), "debug") };
    assert_eq!(ctx.allreduce("missing", SUM), NOT_FOUND);
    let mut a = vec![1.0f32; 4];
    let mut b = vec![2.0f32; 4];
    ctx.reg("g", GRAD, 0, &mut a, F32);
    ctx.reg("g", GRAD, 1, &mut b, F32);
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let lines = taken();
    assert!(
        lines.iter().any(|(l, t, _)| *l == DEBUG
            && t.starts_with("DPSYNC_STATUS_NOT_FOUND")
            && t.contains("'missing'")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|(_, t, _)| t.contains("plan rebuilt") && t.contains("1 gradient buckets")),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|(_, t, _)| t.contains("no GRAD tensor")),
        "{lines:?}"
    );
    // A gradient step with nothing registered as GRAD succeeds, with a warning.
    let params_only = Context::host(2, None);
    let mut p = [vec![0f32; 4], vec![0f32; 4]];
    for (r, p) in p.iter_mut().enumerate() {
        params_only.reg("w", PARAM, r, p, F32);
    }
    check(params_only.allreduce_grads(SUM), "allreduce_grads, no GRAD");
    let lines = taken();
    assert!(
        lines.iter().any(|(l, t, _)| *l == WARN
            && t.starts_with("dpsync_allreduce_grads: no GRAD tensor is registered")),
        "{lines:?}"
    );
    // NULL: back to the default (no DPSYNC_LOG in this test's environment: silence).
    // SAFETY: NULL is allowed.
    unsafe {
        check(
            dpsync_set_log_callback(None, ptr::null_mut(), DEBUG),
            "reset",
        )
    };
    assert_eq!(ctx.allreduce("missing", SUM), NOT_FOUND);
    assert!(taken().is_empty());
}

/// Run as a child by `dpsync_log_goes_to_stderr_only_when_asked`.
#[test]
fn stderr_child() {
    if std::env::var_os("DPSYNC_LOG_CHILD").is_none() {
        common::skip::skip(format_args!(
            "stderr_child: skipped: runs only as the child of dpsync_log_goes_to_stderr_only_when_asked"
        ));
        return;
    }
    let ctx = Context::host(3, None);
    assert_eq!(ctx.allreduce("missing", SUM), NOT_FOUND);
}

#[test]
fn dpsync_log_goes_to_stderr_only_when_asked() {
    let exe = std::env::current_exe().unwrap();
    let run = |level: Option<&str>| -> String {
        let mut cmd = Command::new(&exe);
        cmd.args(["stderr_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("DPSYNC_LOG_CHILD", "1")
            .env_remove("DPSYNC_LOG");
        if let Some(level) = level {
            cmd.env("DPSYNC_LOG", level);
        }
        let out = cmd.output().expect("the test binary runs");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let silent = run(None);
    assert!(
        !silent.contains("dpsync "),
        "printed without DPSYNC_LOG: {silent}"
    );
    let info = run(Some("info"));
    assert!(
        info.contains("dpsync info: context created: 3 replicas"),
        "{info}"
    );
    assert!(!info.contains("dpsync debug:"), "{info}");
    let debug = run(Some("debug"));
    assert!(
        debug.contains("dpsync debug: DPSYNC_STATUS_NOT_FOUND"),
        "{debug}"
    );
}
