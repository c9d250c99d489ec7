//! Logging. Nothing is printed by default. `DPSYNC_LOG=error|warn|info|debug` (read once)
//! sends lines to stderr; a callback set through `dpsync_set_log_callback` routes them to the
//! framework's own logger instead, at the level it asks for. When nothing listens, a log
//! point costs one relaxed atomic load and a compare: messages are made only when they go out.

use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::RwLock;

/// Severity, most severe first (0 is "off" as a threshold).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// A C logger: called with the level, the line (NUL-terminated, valid during the call) and the
/// caller's pointer, from whichever thread logs.
pub type Callback = unsafe extern "C" fn(u32, *const c_char, *mut c_void);

struct Sink {
    callback: Option<(Callback, usize)>,
}

static SINK: RwLock<Sink> = RwLock::new(Sink { callback: None });

/// The most verbose level anyone listens to; `UNREAD` until `DPSYNC_LOG` has been read.
static THRESHOLD: AtomicU32 = AtomicU32::new(UNREAD);
const UNREAD: u32 = u32::MAX;

/// `DPSYNC_LOG`'s level (0: unset or not understood: nothing on stderr).
fn env_level() -> u32 {
    match std::env::var("DPSYNC_LOG").as_deref().map(str::trim) {
        Ok("error") => 1,
        Ok("warn") => 2,
        Ok("info") => 3,
        Ok("debug") => 4,
        _ => 0,
    }
}

fn threshold() -> u32 {
    match THRESHOLD.load(Ordering::Relaxed) {
        UNREAD => {
            let level = env_level();
            // A callback set meanwhile stored its own threshold: keep that one.
            let _ = THRESHOLD.compare_exchange(UNREAD, level, Ordering::Relaxed, Ordering::Relaxed);
            THRESHOLD.load(Ordering::Relaxed)
        }
        t => t,
    }
}

/// Routes lines to `callback` (with `user_data`) at `level` and more severe; `None` goes back
/// to stderr at `DPSYNC_LOG`'s level.
pub fn set_callback(callback: Option<Callback>, user_data: usize, level: u32) {
    let mut sink = SINK.write();
    sink.callback = callback.map(|c| (c, user_data));
    let t = if sink.callback.is_some() {
        level
    } else {
        env_level()
    };
    THRESHOLD.store(t, Ordering::Relaxed);
}

/// Whether a line at `level` would go anywhere.
pub fn enabled(level: Level) -> bool {
    level as u32 <= threshold()
}

/// Logs the line `message` makes, if anyone listens at `level`.
pub fn log(level: Level, message: impl FnOnce() -> String) {
    if !enabled(level) {
        return;
    }
    let text = message();
    let sink = SINK.read();
    match sink.callback {
        Some((callback, user_data)) => {
            let line = CString::new(text.replace('\0', "\\0")).unwrap_or_default();
            // SAFETY: the caller of dpsync_set_log_callback promised a callable function.
            unsafe { callback(level as u32, line.as_ptr(), user_data as *mut c_void) };
        }
        None => eprintln!("dpsync {}: {text}", level.name()),
    }
}

pub fn warn(message: impl FnOnce() -> String) {
    log(Level::Warn, message)
}

pub fn info(message: impl FnOnce() -> String) {
    log(Level::Info, message)
}

pub fn debug(message: impl FnOnce() -> String) {
    log(Level::Debug, message)
}
