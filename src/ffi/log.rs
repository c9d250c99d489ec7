//! Logging seen from C: the level enum and the callback that routes dpsync's lines.

use std::ffi::{c_char, c_void};

use super::boundary::entry;
use super::status::dpsync_status;
use crate::error::Error;
use crate::log;

/// Severity of a log line, and the threshold of dpsync_set_log_callback (OFF: none).
#[repr(C)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dpsync_log_level {
    DPSYNC_LOG_OFF = 0,
    DPSYNC_LOG_ERROR = 1,
    DPSYNC_LOG_WARN = 2,
    DPSYNC_LOG_INFO = 3,
    DPSYNC_LOG_DEBUG = 4,
}

/// Receives one log line: its level (a dpsync_log_level), the text (NUL-terminated, valid only
/// during the call, no trailing newline) and the user_data given to dpsync_set_log_callback.
/// Called from whichever thread logs, possibly several at once; it must not call back into
/// dpsync.
pub type dpsync_log_callback =
    Option<unsafe extern "C" fn(level: u32, message: *const c_char, user_data: *mut c_void)>;

/// Routes dpsync's log lines at `level` and more severe (DPSYNC_LOG_OFF: none) to `callback`
/// instead of stderr. What is logged: context creation (replicas, devices, the transport and
/// why, the world), plan rebuilds (buckets), fallbacks (NCCL not used, pairs without peer
/// access staged through the host), timeouts, agreement failures between ranks, and (at DEBUG)
/// every failed call with its status. A NULL `callback` goes back to the default: nothing, or
/// stderr at the level the environment variable DPSYNC_LOG names (error, warn, info, debug).
/// INVALID_ARGUMENT for an unknown `level`. Process-wide; callable at any time.
#[no_mangle]
pub unsafe extern "C" fn dpsync_set_log_callback(
    callback: dpsync_log_callback,
    user_data: *mut c_void,
    level: u32,
) -> dpsync_status {
    entry(|| {
        if level > dpsync_log_level::DPSYNC_LOG_DEBUG as u32 {
            return Err(Error::invalid(format!(
                "level: {level} is not a dpsync_log_level (DPSYNC_LOG_OFF..DPSYNC_LOG_DEBUG)"
            )));
        }
        log::set_callback(callback, user_data as usize, level);
        Ok(())
    })
}
