//! The C boundary and nothing else: NULL and enum checks, `catch_unwind` on every entry, the
//! thread-local last error, and handle ownership. Every exported function's `///` comment is
//! copied by cbindgen into `include/dpsync.h`.
//!
//! Every function here is `unsafe extern "C"`: the general safety contract is the header's
//! (valid pointers or NULL, NUL-terminated strings, registered memory valid while registered).
#![allow(clippy::missing_safety_doc, non_camel_case_types)]

mod bmuf;
mod boundary;
mod collectives;
mod context;
mod describe;
mod log;
mod options;
mod register;
mod shard;
mod sparse;
mod status;
mod world;

pub use bmuf::*;
pub use boundary::dpsync_context;
pub use collectives::*;
pub use context::*;
pub use describe::*;
pub use log::*;
pub use options::*;
pub use register::*;
pub use shard::*;
pub use sparse::*;
pub use status::*;
pub use world::*;
