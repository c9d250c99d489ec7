//! JSON descriptions of a live context and of a dry-run plan.

use std::ffi::c_char;

use super::boundary::{dpsync_context, entry, try_mut, try_ref, with_context};
use super::options::dpsync_options;
use super::status::dpsync_status;
use crate::context::plan_describe;
use crate::error::{Error, Result};

/// snprintf-style: writes at most `capacity` bytes including the NUL, stores the full length.
unsafe fn write_text(
    text: &str,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> Result<()> {
    let length = try_mut(length, "length")?;
    if buffer.is_null() && capacity > 0 {
        return Err(Error::invalid("buffer is NULL but capacity is not 0"));
    }
    *length = text.len();
    if capacity > 0 {
        let n = text.len().min(capacity - 1);
        // SAFETY: the caller provides `capacity` writable bytes at buffer.
        std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), n);
        *buffer.add(n) = 0;
    }
    Ok(())
}

/// JSON description of the context: replicas and their devices, transport in use, peer-access
/// matrix, fusion buckets, reduction steps, and any registration problems. Writes at most
/// `capacity` bytes including the NUL and stores the full length (without NUL) in *length
/// (which must not be NULL); call with buffer NULL and capacity 0 to size the buffer.
#[no_mangle]
pub unsafe extern "C" fn dpsync_describe(
    context: *const dpsync_context,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let text = ctx.describe();
        write_text(&text, buffer, capacity, length)
    })
}

/// The same description computed from options alone, touching no device: a dry run of the plan
/// for a topology (with dpsync_options_set_peer_access) on any machine.
#[no_mangle]
pub unsafe extern "C" fn dpsync_plan_describe(
    options: *const dpsync_options,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> dpsync_status {
    entry(|| {
        let options = try_ref(options, "options")?;
        let text = plan_describe(&options.inner)?;
        write_text(&text, buffer, capacity, length)
    })
}
