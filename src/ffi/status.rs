//! Status codes, enums as C sees them, and the error-reporting calls.

use std::ffi::{c_char, CString};

use std::sync::LazyLock;

use super::boundary;
use crate::error::ErrorKind;

/// Result of every fallible call. `DPSYNC_STATUS_OK` (0) is success; on failure
/// `dpsync_last_error()` says what was wrong. Numbers are never reused.
#[repr(C)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dpsync_status {
    DPSYNC_STATUS_OK = 0,
    /// Null pointer, zero count, unknown enum value, replica index out of range.
    DPSYNC_STATUS_INVALID_ARGUMENT = 1,
    /// No tensor registered under that name.
    DPSYNC_STATUS_NOT_FOUND = 2,
    /// Name re-registered on a replica with another role/count/dtype/pointer.
    DPSYNC_STATUS_CONFLICT = 3,
    /// Replicas (or ranks) disagree: a name missing on some replica, counts or dtypes differ,
    /// sparse indices/values lengths differ, index out of range.
    DPSYNC_STATUS_INCONSISTENT = 4,
    /// Call not valid now (e.g. bmuf_step before bmuf_init, or a context that failed earlier).
    DPSYNC_STATUS_INVALID_STATE = 5,
    /// CUDA driver, NCCL or MPI not present at run time or not built in.
    DPSYNC_STATUS_UNAVAILABLE = 6,
    /// A CUDA / NCCL / MPI call failed; the message carries that library's text. When a
    /// collective or dpsync_synchronize on CUDA replicas fails so (other than by running out of
    /// memory), the context then refuses further collectives (destroy it).
    DPSYNC_STATUS_BACKEND_ERROR = 7,
    /// A collective did not complete within the configured timeout; on CUDA replicas the
    /// context then refuses further collectives (destroy it).
    DPSYNC_STATUS_TIMEOUT = 8,
    /// Internal defect caught at the boundary; the context refuses further work.
    DPSYNC_STATUS_PANIC = 9,
    /// Ranks of an elastic world were lost (dpsync_options_set_elastic): the message names
    /// them. This rank's world goes on without them, renumbered; compute the step's gradients
    /// again and repeat the call. Below the world's min_ranks the context refuses further
    /// collectives instead.
    DPSYNC_STATUS_RANK_LOST = 10,
    // A new failure status also needs its line in `error_kinds!` (src/error.rs), which gives
    // it its `ErrorKind`, and its arm in `From<ErrorKind>` below.
}

/// Every failure status's name as C reads it, in the order of [`ErrorKind::ALL`].
static NAMES: LazyLock<Vec<CString>> = LazyLock::new(|| {
    (ErrorKind::ALL.iter())
        .map(|k| CString::new(k.name()).expect("names have no NUL"))
        .collect()
});

impl From<ErrorKind> for dpsync_status {
    fn from(kind: ErrorKind) -> Self {
        use dpsync_status::*;
        match kind {
            ErrorKind::InvalidArgument => DPSYNC_STATUS_INVALID_ARGUMENT,
            ErrorKind::NotFound => DPSYNC_STATUS_NOT_FOUND,
            ErrorKind::Conflict => DPSYNC_STATUS_CONFLICT,
            ErrorKind::Inconsistent => DPSYNC_STATUS_INCONSISTENT,
            ErrorKind::InvalidState => DPSYNC_STATUS_INVALID_STATE,
            ErrorKind::Unavailable => DPSYNC_STATUS_UNAVAILABLE,
            ErrorKind::Backend => DPSYNC_STATUS_BACKEND_ERROR,
            ErrorKind::Timeout => DPSYNC_STATUS_TIMEOUT,
            ErrorKind::Panic => DPSYNC_STATUS_PANIC,
            ErrorKind::RankLost => DPSYNC_STATUS_RANK_LOST,
        }
    }
}

/// Element types of tensors.
#[repr(C)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dpsync_dtype {
    DPSYNC_DTYPE_F32 = 0,
    DPSYNC_DTYPE_F64 = 1,
    DPSYNC_DTYPE_F16 = 2,
    DPSYNC_DTYPE_BF16 = 3,
    DPSYNC_DTYPE_I32 = 4,
    DPSYNC_DTYPE_I64 = 5,
}

/// Roles are bit flags so that several can be named at once as a mask.
#[repr(C)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dpsync_role {
    /// Model parameters: broadcast at start / after checkpoint load; BMUF operates on these.
    DPSYNC_ROLE_PARAM = 1,
    /// Dense gradients: reduced by dpsync_allreduce_grads.
    DPSYNC_ROLE_GRAD = 2,
    /// Computed params, e.g. batch-norm running statistics: broadcast or averaged.
    DPSYNC_ROLE_COMPUTED = 4,
    /// Optimizer state and counters (momentum, ITER): broadcast only when the roles mask
    /// includes it; `DPSYNC_ROLE_PARAM` alone leaves STATE tensors as they are, so restore a
    /// checkpoint with `dpsync_broadcast(ctx, DPSYNC_ROLE_PARAM | DPSYNC_ROLE_STATE, root)`.
    DPSYNC_ROLE_STATE = 8,
}

/// Reduction operators.
#[repr(C)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dpsync_reduce_op {
    DPSYNC_REDUCE_SUM = 0,
    /// Sum divided by the total number of replicas in the world.
    DPSYNC_REDUCE_AVG = 1,
}

/// How replicas are reduced.
#[repr(C)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum dpsync_transport {
    /// NCCL when it loads and initialises, else PEER_COPY; host replicas use HOST.
    DPSYNC_TRANSPORT_AUTO = 0,
    /// Require NCCL; UNAVAILABLE if it cannot be used.
    DPSYNC_TRANSPORT_NCCL = 1,
    /// Copy + sum kernels, direct peer reads only where peer access exists.
    DPSYNC_TRANSPORT_PEER_COPY = 2,
    /// Host replicas: multi-threaded reduction in host memory.
    DPSYNC_TRANSPORT_HOST = 3,
}

/// Major version of the library this header came with (Cargo.toml's). A program can compare
/// the three DPSYNC_VERSION_* macros with dpsync_version() to catch a header and a library that
/// do not belong together.
pub const DPSYNC_VERSION_MAJOR: u32 = 0;
/// Minor version of the library this header came with. While the major version is 0, a new
/// minor version may break the ABI (the shared library's soname carries it).
pub const DPSYNC_VERSION_MINOR: u32 = 1;
/// Patch version of the library this header came with.
pub const DPSYNC_VERSION_PATCH: u32 = 0;
// tests/header.rs checks these against Cargo.toml's version: cbindgen copies literals only.

/// Library version, e.g. "0.1.0": DPSYNC_VERSION_MAJOR.MINOR.PATCH of the library loaded, which
/// may differ from the header's macros when they do not belong together. Static string.
#[no_mangle]
pub extern "C" fn dpsync_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Name of a status code, e.g. "DPSYNC_STATUS_NOT_FOUND"; "UNKNOWN" for other values. Static string.
#[no_mangle]
pub extern "C" fn dpsync_status_name(status: u32) -> *const c_char {
    match ErrorKind::ALL.iter().position(|k| k.code() == status) {
        Some(at) => NAMES[at].as_ptr(),
        None if status == 0 => c"DPSYNC_STATUS_OK".as_ptr(),
        None => c"UNKNOWN".as_ptr(),
    }
}

/// Message of the last failed call on this thread, "" if none. Valid until the next dpsync call
/// on this thread. Successful calls leave it as it is.
#[no_mangle]
pub extern "C" fn dpsync_last_error() -> *const c_char {
    boundary::last_error_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_is_the_status_of_its_number_and_name() {
        for &kind in ErrorKind::ALL {
            let status = dpsync_status::from(kind);
            assert_eq!(status as u32, kind.code(), "{kind:?}");
            assert_eq!(format!("{status:?}"), kind.name(), "{kind:?}");
            // SAFETY: a static NUL-terminated string.
            let name = unsafe { std::ffi::CStr::from_ptr(dpsync_status_name(kind.code())) };
            assert_eq!(name.to_str(), Ok(kind.name()));
        }
        assert_eq!(
            ErrorKind::ALL.len(),
            dpsync_status::DPSYNC_STATUS_RANK_LOST as usize
        );
    }
}
