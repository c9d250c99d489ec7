//! dpsync keeps data-parallel model replicas in sync behind a small C ABI.
//!
//! The data flows one way: C call → `ffi` (the boundary) → `registry` (tensors by name and
//! replica, consistency) → `plan` (pure data: buckets and reduction steps) → `exec`
//! (algorithms written once) → `backend` (primitives over one kind of memory).
//!
//! Everything a C caller sees lives in `ffi` and is re-exported here, so Rust tests can drive
//! the library exactly as a C program does (`use dpsync::*;`). The other modules are internal;
//! benchmarks that measure a primitive below the C ABI go through `dpsync::bench`.

mod backend;
mod context;
mod error;
mod exec;
mod ffi;
mod log;
mod options;
mod plan;
mod registry;
mod timeline;
mod types;

#[doc(hidden)]
pub mod bench;

pub use ffi::*;
