//! Every bad input of every exported entry point: the exact status, a last-error message that
//! names the culprit (argument name, or the tensor name and "replica N"), and nothing changed:
//! tensor bytes of every replica as before, the registry as before (describe), and a valid
//! collective afterwards still works. Also dpsync_status_name, dpsync_version and the per-thread
//! last error.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
    pub mod skip;
}

use common::{abi::*, buf::*, context::*, errors::*, reference::*, skip::*};
use dpsync::*;
use std::ffi::{c_char, c_void};
use std::ptr;

// ------------------------------------------------------------------ fixture

/// A 3-replica context with one tensor of every role (and three GRAD dtypes).
struct Fx {
    ctx: Context,
    n: usize,
    /// (name, role, per-replica buffers)
    tensors: Vec<(String, u32, Vec<Buf>)>,
}

impl Fx {
    fn new() -> Fx {
        let n = 3;
        let ctx = Context::host(n, Some(64));
        let mut fx = Fx {
            ctx,
            n,
            tensors: Vec::new(),
        };
        fx.add("w", PARAM, DType::F32, 5);
        fx.add("g", GRAD, DType::F32, 4);
        fx.add("gi", GRAD, DType::I32, 3);
        fx.add("gh", GRAD, DType::F16, 6);
        fx.add("bn", COMPUTED, DType::F64, 2);
        fx.add("it", STATE, DType::I64, 1);
        fx
    }

    fn add(&mut self, name: &str, role: u32, d: DType, count: usize) {
        let mut bufs: Vec<Buf> = (0..self.n)
            .map(|r| Buf::random(d, count, (self.tensors.len() * 10 + r) as u64))
            .collect();
        for (r, b) in bufs.iter_mut().enumerate() {
            self.ctx.reg_buf(name, role, r, b);
        }
        self.tensors.push((name.to_owned(), role, bufs));
    }

    fn snapshot(&self) -> Vec<Vec<Buf>> {
        self.tensors.iter().map(|t| t.2.clone()).collect()
    }

    #[track_caller]
    fn assert_unchanged(&self, before: &[Vec<Buf>], what: &str) {
        for ((name, _, bufs), pre) in self.tensors.iter().zip(before) {
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                assert_same_bytes(b, p, &format!("{what}: '{name}' on replica {r} changed"));
            }
        }
    }

    /// Valid collectives still work on the fixture, with exact results.
    #[track_caller]
    fn assert_usable(&mut self, what: &str) {
        let before = self.snapshot();
        check(
            self.ctx.allreduce_grads(SUM),
            &format!("{what}: allreduce_grads afterwards"),
        );
        check(
            self.ctx.broadcast(PARAM | STATE, 1),
            &format!("{what}: broadcast afterwards"),
        );
        check(
            self.ctx.average(COMPUTED),
            &format!("{what}: average afterwards"),
        );
        for ((name, role, bufs), pre) in self.tensors.iter().zip(&before) {
            let want: Vec<Buf> = match *role {
                GRAD => vec![reference_allreduce(&pre.iter().collect::<Vec<_>>(), SUM); self.n],
                COMPUTED => vec![reference_allreduce(&pre.iter().collect::<Vec<_>>(), AVG); self.n],
                _ => vec![pre[1].clone(); self.n],
            };
            for (r, (b, w)) in bufs.iter().zip(&want).enumerate() {
                assert_same_bytes(b, w, &format!("{what}: '{name}' on replica {r} afterwards"));
            }
        }
        check(
            unsafe { dpsync_synchronize(self.ctx.0) },
            &format!("{what}: synchronize"),
        );
    }
}

/// One way of registering a tensor 'bad' so that the replicas disagree.
#[derive(Clone, Copy, Debug)]
enum Bad {
    /// f32 x4 on replicas 0 and 1, f32 x5 on replica 2
    Count,
    /// f32 x4 on replicas 0 and 1, i32 x4 on replica 2
    Dtype,
    /// GRAD on replicas 0 and 1, COMPUTED on replica 2
    Role,
    /// on replicas 0 and 1 only
    MissingOnLast,
    /// on replicas 1 and 2 only
    MissingOnFirst,
    /// replica 1's memory overlaps replica 0's
    Overlap,
}

impl Bad {
    const ALL: [Bad; 6] = [
        Bad::Count,
        Bad::Dtype,
        Bad::Role,
        Bad::MissingOnLast,
        Bad::MissingOnFirst,
        Bad::Overlap,
    ];

    /// Registers 'bad' this way on a 3-replica context from `ptrs` (three buffers of 6 f32):
    /// the replica the collectives' messages name.
    fn register(self, ctx: *mut dpsync_context, ptrs: &[*mut c_void], what: &str) -> &'static str {
        let reg = |r: usize, p: *mut c_void, role: u32, count: usize, dtype: u32| {
            check(register_raw(ctx, "bad", role, r, p, count, dtype), what);
        };
        match self {
            Bad::Count => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 5, F32);
                "replica 2"
            }
            Bad::Dtype => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 4, I32);
                "replica 2"
            }
            Bad::Role => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], COMPUTED, 4, F32);
                "replica 2"
            }
            Bad::MissingOnLast => {
                reg(0, ptrs[0], GRAD, 4, F32);
                reg(1, ptrs[1], GRAD, 4, F32);
                "replica 2"
            }
            Bad::MissingOnFirst => {
                reg(1, ptrs[1], GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 4, F32);
                "replica 0"
            }
            Bad::Overlap => {
                reg(0, ptrs[0], GRAD, 4, F32);
                // replica 1 registers elements 2..6 of replica 0's buffer
                let p = unsafe { (ptrs[0] as *mut f32).add(2) } as *mut c_void;
                reg(1, p, GRAD, 4, F32);
                reg(2, ptrs[2], GRAD, 4, F32);
                "replica"
            }
        }
    }
}

// ------------------------------------------------------------------ shards (ZeRO stage 1)

/// dpsync_reduce_scatter_grads(ctx, op).
fn reduce_scatter(ctx: *mut dpsync_context, op: u32) -> dpsync_status {
    // SAFETY: the handle is valid or NULL (refused).
    unsafe { dpsync_reduce_scatter_grads(ctx, op) }
}

/// dpsync_allgather(ctx, roles).
fn allgather(ctx: *mut dpsync_context, roles: u32) -> dpsync_status {
    // SAFETY: the handle is valid or NULL (refused).
    unsafe { dpsync_allgather(ctx, roles) }
}

/// dpsync_shard of `name` on `replica`: the status and the outputs (sentinels where unwritten).
fn shard(ctx: *const dpsync_context, name: &str, replica: usize) -> (dpsync_status, usize, usize) {
    let c = cstr(name);
    let (mut offset, mut count) = (0xDEAD_usize, 0xBEEF_usize);
    // SAFETY: valid handle, name and out pointers.
    let st = unsafe { dpsync_shard(ctx, c.as_ptr(), replica, &mut offset, &mut count) };
    (st, offset, count)
}

/// The contract's rule: world replica `w` of `total` owns `[count * w / total, count * (w + 1)
/// / total)`, as (first element, elements).
fn owned(count: usize, w: usize, total: usize) -> (usize, usize) {
    let at = |w: usize| count * w / total;
    (at(w), at(w + 1) - at(w))
}

/// `b` with elements `[at, at + k)` taken from `src`.
fn spliced(b: &Buf, src: &Buf, at: usize, k: usize) -> Buf {
    let size = b.dtype().size();
    let mut bytes = b.bytes();
    bytes[at * size..(at + k) * size].copy_from_slice(&src.bytes()[at * size..(at + k) * size]);
    let mut out = Buf::zeros(b.dtype(), b.len());
    // SAFETY: `out` holds exactly `bytes.len()` bytes.
    unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), out.ptr().cast::<u8>(), bytes.len()) };
    out
}

/// Statuses, version, last error, options.
#[path = "bad_input_parts/basics.rs"]
mod basics;

/// Contexts and registration.
#[path = "bad_input_parts/registry.rs"]
mod registry;

/// Collectives.
#[path = "bad_input_parts/collectives.rs"]
mod collectives;

/// Shards (ZeRO stage 1).
#[path = "bad_input_parts/shards.rs"]
mod shards;

/// Shards: the owned pieces only.
#[path = "bad_input_parts/shard_pieces.rs"]
mod shard_pieces;
