//! Failed calls: the expected status and message, and the statuses' names.

use super::context::last_error;
use dpsync::*;
use std::ffi::CStr;

/// Asserts a failure: the exact status, and a last-error message containing every needle.
// tests/sequences checks its failures against its model instead.
#[allow(dead_code)]
#[track_caller]
pub fn expect_err(status: dpsync_status, want: dpsync_status, needles: &[&str]) -> String {
    let msg = last_error();
    assert_eq!(
        status, want,
        "expected {want:?}, got {status:?} (last error: {msg:?})"
    );
    assert!(!msg.is_empty(), "a failed call must leave a message");
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} should name {n:?}");
    }
    msg
}

// Only the tests of the status names themselves (bad_input, sequences) use it.
#[allow(dead_code)]
pub fn status_name(status: u32) -> String {
    // SAFETY: static string.
    unsafe {
        let p = dpsync_status_name(status);
        assert!(!p.is_null());
        CStr::from_ptr(p).to_str().unwrap().to_owned()
    }
}
