//! Typed errors. Every failure carries a kind (which becomes the C status) and a message that
//! names the culprit: the argument, the tensor (in quotes) and the replica.

use std::fmt;

/// What went wrong, one variant per C status (`DPSYNC_STATUS_*`, same numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Null pointer, zero count, unknown enum value, index out of range.
    InvalidArgument = 1,
    /// No tensor under that name.
    NotFound = 2,
    /// The name is registered on that replica with another role, count, dtype or pointer.
    Conflict = 3,
    /// Replicas disagree about a tensor.
    Inconsistent = 4,
    /// The call is not valid in the context's current state.
    InvalidState = 5,
    /// A runtime library (CUDA, NCCL, MPI) or a build feature is missing.
    Unavailable = 6,
    /// A CUDA / NCCL / MPI call failed.
    Backend = 7,
    /// A collective did not complete in time.
    Timeout = 8,
    /// An internal defect caught at the boundary.
    Panic = 9,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    pub(crate) fn inconsistent(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Inconsistent, message)
    }

    /// A BACKEND_ERROR that only says memory ran out (the device's, or the host's for library
    /// memory): the device itself is fine, so a context need not be given up for it.
    pub(crate) fn is_out_of_memory(&self) -> bool {
        self.kind == ErrorKind::Backend
            && (self.message.contains("CUDA_ERROR_OUT_OF_MEMORY")
                || self.message.starts_with("out of host memory"))
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
        let oom = |m: &str| Error::new(ErrorKind::Backend, m).is_out_of_memory();
        assert!(oom(
            "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        ));
        assert!(oom(
            "out of host memory: could not allocate 8 bytes of library memory"
        ));
        assert!(!oom(
            "cuEventRecord failed: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal address"
        ));
        let timeout = Error::new(ErrorKind::Timeout, "CUDA_ERROR_OUT_OF_MEMORY");
        assert!(!timeout.is_out_of_memory(), "only BACKEND_ERRORs");
    }
}
