//! The fake NCCL's counts (tests/fakecuda/fake_nccl.cpp: `fake_nccl_sent_bytes`,
//! `fake_nccl_calls`): what this process's NCCL ranks sent and called, by kind.

// Each test binary reads the kinds it checks.
#![allow(dead_code)]

use std::ffi::{c_char, CString};

use dpsync::dpsync_status;

use super::context::{check, Context};
use super::place::synchronize;

/// The kinds counted, by the fake's names.
pub const KINDS: [&str; 6] = [
    "allreduce",
    "broadcast",
    "reducescatter",
    "allgather",
    "send",
    "recv",
];
pub const ALLREDUCE: usize = 0;
pub const BROADCAST: usize = 1;
pub const REDUCE_SCATTER: usize = 2;
pub const ALLGATHER: usize = 3;
pub const SEND: usize = 4;
pub const RECV: usize = 5;

/// `(bytes sent, calls)` of each of [`KINDS`]; `None` on a real NCCL.
pub type Sent = Option<[(u64, u64); 6]>;

/// The fake NCCL's count `symbol(kind)`; `None` on a real NCCL, which has no such symbol.
fn count(symbol: &str, kind: &str) -> Option<u64> {
    let kind = CString::new(kind).unwrap();
    // SAFETY: opens the NCCL this process already loaded (dpsync did); the fake's
    // `uint64_t symbol(const char*)`.
    unsafe {
        let lib = libloading::Library::new("libnccl.so.2").ok()?;
        let f = (lib.get::<unsafe extern "C" fn(*const c_char) -> u64>(symbol.as_bytes())).ok()?;
        Some(f(kind.as_ptr()))
    }
}

/// Every kind's counts so far.
fn counts() -> Sent {
    let mut out = [(0, 0); 6];
    for (k, kind) in KINDS.iter().enumerate() {
        out[k] = (
            count("fake_nccl_sent_bytes", kind)?,
            count("fake_nccl_calls", kind)?,
        );
    }
    Some(out)
}

/// What `call` (checked OK, `what` names it) sent and called by kind, once its work completed
/// (`dpsync_synchronize`).
pub fn sent_by(ctx: &Context, what: &str, call: impl FnOnce() -> dpsync_status) -> Sent {
    let before = counts();
    check(call(), what);
    check(synchronize(ctx), "dpsync_synchronize");
    let (before, after) = (before?, counts()?);
    Some(std::array::from_fn(|k| {
        (after[k].0 - before[k].0, after[k].1 - before[k].1)
    }))
}
