//! Typed errors. Every failure carries a kind (which becomes the C status) and a message that
//! names the culprit: the argument, the tensor (in quotes) and the replica.

use std::fmt;

use crate::ffi::dpsync_status;

/// Generates [`ErrorKind`] from the one list of failure statuses below, each variant taking its
/// number from the C status it names, and from the same list the conversion to
/// [`dpsync_status`] and the status names ([`dpsync_status::name`]).
macro_rules! error_kinds {
    ($($(#[$doc:meta])* $kind:ident => $status:ident,)*) => {
        /// What went wrong, one variant per C status other than OK (`DPSYNC_STATUS_*`, same
        /// numbers).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[non_exhaustive]
        pub enum ErrorKind {
            $($(#[$doc])* $kind = dpsync_status::$status as isize,)*
        }

        impl From<ErrorKind> for dpsync_status {
            fn from(kind: ErrorKind) -> Self {
                match kind {
                    $(ErrorKind::$kind => dpsync_status::$status,)*
                }
            }
        }

        impl dpsync_status {
            /// Every status, OK first.
            const ALL: &[dpsync_status] =
                &[dpsync_status::DPSYNC_STATUS_OK, $(dpsync_status::$status,)*];

            /// The status whose C number is `code`, or `None`.
            pub(crate) fn from_code(code: u32) -> Option<dpsync_status> {
                Self::ALL.iter().copied().find(|s| *s as u32 == code)
            }

            /// The status's C name, NUL-terminated: "DPSYNC_STATUS_NOT_FOUND\0".
            pub(crate) fn name(self) -> &'static str {
                // Exhaustive: a C status missing from the list does not compile.
                match self {
                    dpsync_status::DPSYNC_STATUS_OK => "DPSYNC_STATUS_OK\0",
                    $(dpsync_status::$status => concat!(stringify!($status), "\0"),)*
                }
            }
        }
    };
}

// The one place to add a failure status, besides its variant in `dpsync_status`
// (src/ffi/status.rs, written out there because cbindgen reads it for the header): a status
// without its line here, or a line without its status, does not compile.
error_kinds! {
    /// Null pointer, zero count, unknown enum value, index out of range.
    InvalidArgument => DPSYNC_STATUS_INVALID_ARGUMENT,
    /// No tensor under that name.
    NotFound => DPSYNC_STATUS_NOT_FOUND,
    /// The name is registered on that replica with another role, count, dtype or pointer.
    Conflict => DPSYNC_STATUS_CONFLICT,
    /// Replicas disagree about a tensor.
    Inconsistent => DPSYNC_STATUS_INCONSISTENT,
    /// The call is not valid in the context's current state.
    InvalidState => DPSYNC_STATUS_INVALID_STATE,
    /// A runtime library (CUDA, NCCL, MPI) or a build feature is missing.
    Unavailable => DPSYNC_STATUS_UNAVAILABLE,
    /// A CUDA / NCCL / MPI call failed.
    Backend => DPSYNC_STATUS_BACKEND_ERROR,
    /// A collective did not complete in time.
    Timeout => DPSYNC_STATUS_TIMEOUT,
    /// An internal defect caught at the boundary.
    Panic => DPSYNC_STATUS_PANIC,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
    /// Set where the error is made ([`Error::out_of_memory`]), never read from the message.
    out_of_memory: bool,
}

impl ErrorKind {
    /// The C status number (what crosses to other ranks).
    pub(crate) fn code(self) -> u32 {
        dpsync_status::from(self) as u32
    }
}

/// The C name of status number `code` ("DPSYNC_STATUS_NOT_FOUND"), if it is one.
pub(crate) fn status_name(code: u32) -> Option<&'static str> {
    dpsync_status::from_code(code).map(|s| s.name().trim_end_matches('\0'))
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            out_of_memory: false,
        }
    }

    /// A BACKEND_ERROR for memory that could not be allocated (the device's, or the host's for
    /// library memory).
    pub(crate) fn out_of_memory(message: impl Into<String>) -> Error {
        Error {
            out_of_memory: true,
            ..Error::new(ErrorKind::Backend, message)
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    pub(crate) fn inconsistent(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Inconsistent, message)
    }

    /// A BACKEND_ERROR that only says memory ran out (made by [`Error::out_of_memory`]): the
    /// device itself is fine, so a context need not be given up for it.
    pub(crate) fn is_out_of_memory(&self) -> bool {
        self.out_of_memory && self.kind == ErrorKind::Backend
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_told_apart_from_other_backend_errors() {
        let device =
            Error::out_of_memory("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory");
        assert!(device.is_out_of_memory());
        assert_eq!(device.kind, ErrorKind::Backend);
        let host = Error::out_of_memory(
            "out of host memory: could not allocate 8 bytes of library memory",
        );
        assert!(host.is_out_of_memory());
        assert_eq!(
            dpsync_status::from(host.kind),
            dpsync_status::DPSYNC_STATUS_BACKEND_ERROR
        );
        // Only the error's maker says so, not its text.
        for text in [
            "cuEventRecord failed: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal address",
            "ncclCommInitAll failed: unhandled system error (last NCCL message: \
             cudaMalloc: CUDA_ERROR_OUT_OF_MEMORY)",
            "out of host memory",
        ] {
            assert!(
                !Error::new(ErrorKind::Backend, text).is_out_of_memory(),
                "{text}"
            );
        }
        let timeout = Error::new(ErrorKind::Timeout, "CUDA_ERROR_OUT_OF_MEMORY");
        assert!(!timeout.is_out_of_memory());
    }
}
