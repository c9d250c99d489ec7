//! dpsync keeps data-parallel model replicas in sync behind a small C ABI.
//!
//! The data flows one way: C call → [`ffi`] (the boundary) → [`registry`] (tensors by name and
//! replica, consistency) → [`plan`] (pure data: buckets and reduction steps) → [`exec`]
//! (algorithms written once) → [`backend`] (primitives over one kind of memory).
//!
//! Everything a C caller sees lives in [`ffi`] and is re-exported here, so Rust tests can drive
//! the library exactly as a C program does (`use dpsync::*;`).

pub mod backend;
pub mod context;
pub mod error;
pub mod exec;
pub mod ffi;
pub mod options;
pub mod plan;
pub mod registry;
pub mod types;

pub use ffi::*;
