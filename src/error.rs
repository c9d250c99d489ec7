//! Typed errors. Every failure carries a kind (which becomes the C status) and a message that
//! names the culprit: the argument, the tensor (in quotes) and the replica.

use std::fmt;

/// Generates [`ErrorKind`] from the one list of failure kinds below, each with the number and
/// name of the C status it becomes (src/ffi/status.rs maps it, and checks the two agree).
macro_rules! error_kinds {
    ($($(#[$doc:meta])* $kind:ident = $code:literal $name:literal,)*) => {
        /// What went wrong, one variant per C status other than OK (`DPSYNC_STATUS_*`, same
        /// numbers).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[non_exhaustive]
        pub enum ErrorKind {
            $($(#[$doc])* $kind = $code,)*
        }

        impl ErrorKind {
            /// Every kind, in the order of their numbers.
            pub(crate) const ALL: &[ErrorKind] = &[$(ErrorKind::$kind,)*];

            /// The C status's name ("DPSYNC_STATUS_NOT_FOUND").
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $(ErrorKind::$kind => $name,)*
                }
            }
        }
    };
}

// The one place to add a failure kind, besides its status in `dpsync_status` (src/ffi/status.rs,
// written out there because cbindgen reads it for the header): the mapping there does not
// compile without it, and its test checks the numbers and names.
error_kinds! {
    /// Null pointer, zero count, unknown enum value, index out of range.
    InvalidArgument = 1 "DPSYNC_STATUS_INVALID_ARGUMENT",
    /// No tensor under that name.
    NotFound = 2 "DPSYNC_STATUS_NOT_FOUND",
    /// The name is registered on that replica with another role, count, dtype or pointer.
    Conflict = 3 "DPSYNC_STATUS_CONFLICT",
    /// Replicas disagree about a tensor.
    Inconsistent = 4 "DPSYNC_STATUS_INCONSISTENT",
    /// The call is not valid in the context's current state.
    InvalidState = 5 "DPSYNC_STATUS_INVALID_STATE",
    /// A runtime library (CUDA, NCCL, MPI) or a build feature is missing.
    Unavailable = 6 "DPSYNC_STATUS_UNAVAILABLE",
    /// A CUDA / NCCL / MPI call failed.
    Backend = 7 "DPSYNC_STATUS_BACKEND_ERROR",
    /// A collective did not complete in time.
    Timeout = 8 "DPSYNC_STATUS_TIMEOUT",
    /// An internal defect caught at the boundary.
    Panic = 9 "DPSYNC_STATUS_PANIC",
    /// Ranks of an elastic world were lost; this rank's world goes on without them.
    RankLost = 10 "DPSYNC_STATUS_RANK_LOST",
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
    /// Set where the error is made ([`Error::out_of_memory`]), never read from the message.
    out_of_memory: bool,
    /// Made by [`Error::world_changed`]: never reaches the caller.
    world_changed: bool,
}

impl ErrorKind {
    /// The C status number (what crosses to other ranks).
    pub(crate) fn code(self) -> u32 {
        self as u32
    }

    /// The kind whose C status number is `code`, or `None`.
    pub(crate) fn from_code(code: u32) -> Option<ErrorKind> {
        Self::ALL.iter().copied().find(|k| k.code() == code)
    }
}

/// The C name of status number `code` ("DPSYNC_STATUS_NOT_FOUND"), if it is a failure's.
pub(crate) fn status_name(code: u32) -> Option<&'static str> {
    ErrorKind::from_code(code).map(ErrorKind::name)
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            out_of_memory: false,
            world_changed: false,
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

    /// Ranks left the world at a collective's agreement, which every remaining rank passed:
    /// the call is made again over the remaining ranks, so this never reaches the caller.
    pub(crate) fn world_changed(message: impl Into<String>) -> Error {
        Error {
            world_changed: true,
            ..Error::new(ErrorKind::InvalidState, message)
        }
    }

    /// Made by [`Error::world_changed`].
    pub(crate) fn is_world_changed(&self) -> bool {
        self.world_changed
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
        assert_eq!(host.kind, ErrorKind::Backend);
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
