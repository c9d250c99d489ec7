//! What every MPI call of the engine goes through: its return code turned into dpsync's error
//! (with MPI's own words for it), and its count checked into MPI's C int. Kept apart so that
//! the engine, the ring and the steps queue report a failed call alike.

use std::ffi::c_int;

use mpi::ffi;

use crate::error::{Error, ErrorKind, Result};

/// MPI's words for an error code.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

pub(super) fn backend_error(call: &str, code: c_int) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("{call} failed: {} (code {code})", error_string(code)),
    )
}

/// One MPI call's return code as a result.
pub(super) fn check(call: &str, rc: c_int) -> Result<()> {
    match rc {
        0 => Ok(()),
        rc => Err(backend_error(call, rc)),
    }
}

/// Whether `request` completed (MPI_REQUEST_NULL then), without waiting.
///
/// # Safety
/// A request of this process.
pub(super) unsafe fn tested(request: &mut ffi::MPI_Request) -> Result<bool> {
    let mut flag: c_int = 0;
    check(
        "MPI_Test",
        ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE),
    )?;
    Ok(flag != 0)
}

pub(super) fn count_of(n: usize) -> c_int {
    c_int::try_from(n).expect("chunked below C int range")
}
