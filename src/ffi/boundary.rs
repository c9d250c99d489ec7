//! The one way into the library from C, in the manner of rustls-ffi's `ffi_panic_boundary!`:
//! every exported body runs under `catch_unwind`; an `Err` becomes its status plus the
//! thread's last-error message; a panic becomes `DPSYNC_STATUS_PANIC` (and poisons the context
//! it happened in). Pointer and enum arguments are decoded by the helpers below, which name the
//! C parameter in their message.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use parking_lot::Mutex;

use super::status::dpsync_status;
use crate::context::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::log;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // Interior NULs would truncate the message in C; show them instead.
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

pub(super) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".to_owned())
}

fn report(result: Result<()>) -> dpsync_status {
    match result {
        Ok(()) => dpsync_status::DPSYNC_STATUS_OK,
        Err(err) => {
            set_last_error(&err.message);
            let status: dpsync_status = err.kind.into();
            // Timeouts and panics are what a framework must see even when it does not check
            // every status; the rest is the caller's to report.
            let level = match err.kind {
                ErrorKind::Timeout | ErrorKind::Panic => log::Level::Error,
                _ => log::Level::Debug,
            };
            log::log(level, || format!("{status:?}: {}", err.message));
            status
        }
    }
}

/// Runs `body` at the boundary: no panic crosses into C.
pub(super) fn entry(body: impl FnOnce() -> Result<()>) -> dpsync_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => report(result),
        Err(payload) => {
            let text = panic_text(&*payload);
            report(Err(Error::new(
                ErrorKind::Panic,
                format!("internal error (please report): {text}"),
            )))
        }
    }
}

/// The object behind a `dpsync_context *`.
pub struct dpsync_context {
    inner: Mutex<Context>,
    /// Set when a call on this context panicked: its state may be half-updated.
    poisoned: Mutex<Option<String>>,
}

impl dpsync_context {
    pub(super) fn new(context: Context) -> dpsync_context {
        dpsync_context {
            inner: Mutex::new(context),
            poisoned: Mutex::new(None),
        }
    }
}

/// Runs `body` on the context behind `context`, under the boundary. A context that panicked
/// before refuses further work with INVALID_STATE.
pub(super) fn with_context(
    context: *const dpsync_context,
    body: impl FnOnce(&mut Context) -> Result<()>,
) -> dpsync_status {
    entry(|| {
        // SAFETY: a non-NULL context comes from dpsync_context_create (the C contract).
        let ctx = unsafe { context.as_ref() }.ok_or_else(|| Error::invalid("context is NULL"))?;
        if let Some(why) = ctx.poisoned.lock().as_ref() {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("the context is unusable after an earlier internal error: {why}"),
            ));
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| body(&mut ctx.inner.lock())));
        match outcome {
            Ok(result) => result,
            Err(payload) => {
                let text = panic_text(&*payload);
                *ctx.poisoned.lock() = Some(text.clone());
                Err(Error::new(
                    ErrorKind::Panic,
                    format!(
                        "internal error (please report); the context refuses further work: {text}"
                    ),
                ))
            }
        }
    })
}

/// A collective on the context behind `context`: `args` translates its C arguments, `body`
/// runs it. Arguments refused here still go through the context ([`Context::refuse`]): in a
/// world every rank must take part in a collective's agreement, so the others fail at once
/// with INCONSISTENT naming this rank instead of waiting for it until their timeout. Where
/// ranks leave at its agreement it is made again over the others ([`Context::world_call`]).
pub(super) fn with_collective<A: Clone>(
    context: *const dpsync_context,
    call: &str,
    args: impl FnOnce() -> Result<A>,
    mut body: impl FnMut(&mut Context, A) -> Result<()>,
) -> dpsync_status {
    with_context(context, |ctx| match args() {
        Ok(args) => ctx.world_call(|ctx| body(ctx, args.clone())),
        Err(e) => ctx.world_call(|ctx| ctx.refuse(call, e.clone())),
    })
}

/// `ptr` as a reference, or INVALID_ARGUMENT naming `argument`.
pub(super) unsafe fn try_ref<'a, T>(ptr: *const T, argument: &str) -> Result<&'a T> {
    ptr.as_ref()
        .ok_or_else(|| Error::invalid(format!("{argument} is NULL")))
}

/// `ptr` as a mutable reference, or INVALID_ARGUMENT naming `argument`.
pub(super) unsafe fn try_mut<'a, T>(ptr: *mut T, argument: &str) -> Result<&'a mut T> {
    ptr.as_mut()
        .ok_or_else(|| Error::invalid(format!("{argument} is NULL")))
}

/// A tensor or sparse gradient name: a non-NULL, non-empty, NUL-terminated UTF-8 string
/// (INVALID_ARGUMENT naming `argument` otherwise). Empty names are refused by every call, not
/// only by registration, so that a lookup never answers NOT_FOUND for a name that could not be
/// registered.
///
/// # Safety
/// A non-NULL `ptr` points to a NUL-terminated string that outlives the returned borrow.
pub(super) unsafe fn try_name<'a>(ptr: *const c_char, argument: &str) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(Error::invalid(format!("{argument} is NULL")));
    }
    let name = CStr::from_ptr(ptr)
        .to_str()
        .map_err(|_| Error::invalid(format!("{argument} is not valid UTF-8")))?;
    if name.is_empty() {
        return Err(Error::invalid(format!("{argument} is empty")));
    }
    Ok(name)
}

/// A C enum value passed as `uint32_t`, decoded by `decode`.
pub(super) fn try_enum<T>(
    code: u32,
    decode: fn(u32) -> Option<T>,
    argument: &str,
    expected: &str,
) -> Result<T> {
    decode(code)
        .ok_or_else(|| Error::invalid(format!("{argument} is {code}, not one of {expected}")))
}

/// A floating-point argument that must be finite: NaN and infinities are INVALID_ARGUMENT
/// naming `argument`.
pub(super) fn try_finite(value: f64, argument: &str) -> Result<f64> {
    if value.is_finite() {
        Ok(value)
    } else {
        Err(Error::invalid(format!(
            "{argument} is {value}: it must be a finite number"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;

    fn last_error() -> String {
        // SAFETY: the pointer is this thread's live CString.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_poisons_only_its_context() {
        let mut options = Options::default();
        options.set_host_replicas(2).unwrap();
        let ctx = dpsync_context::new(Context::new(&options).unwrap());
        let other = dpsync_context::new(Context::new(&options).unwrap());
        let status = with_context(&ctx, |_| panic!("defect under test"));
        assert_eq!(status, dpsync_status::DPSYNC_STATUS_PANIC);
        assert!(
            last_error().contains("defect under test"),
            "{}",
            last_error()
        );
        let status = with_context(&ctx, |c| {
            assert_eq!(c.replica_count(), 2);
            Ok(())
        });
        assert_eq!(status, dpsync_status::DPSYNC_STATUS_INVALID_STATE);
        assert!(last_error().contains("unusable"), "{}", last_error());
        let status = with_context(&other, |c| {
            assert_eq!(c.replica_count(), 2);
            Ok(())
        });
        assert_eq!(status, dpsync_status::DPSYNC_STATUS_OK);
        assert!(
            last_error().contains("unusable"),
            "success keeps the last error"
        );
    }

    #[test]
    fn a_panic_outside_a_context_is_caught_too() {
        assert_eq!(
            entry(|| panic!("free-standing defect")),
            dpsync_status::DPSYNC_STATUS_PANIC
        );
        assert!(last_error().contains("free-standing defect"));
        assert_eq!(
            with_context(std::ptr::null(), |_| Ok(())),
            dpsync_status::DPSYNC_STATUS_INVALID_ARGUMENT
        );
        assert_eq!(last_error(), "context is NULL");
    }
}
