//! CUDA replicas through the C ABI. Every test needs a GPU: without one it prints
//! "skipped: no CUDA device" and returns. `scripts/gpu-check.sh` runs them on the GPU machine.
//!
//! Device memory, streams and the spin kernels come from cudarc's safe layer, as a framework's
//! would come from its own runtime; dpsync only ever sees the raw pointers and streams.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod errors;
    pub mod float16;
    pub mod gpu;
    pub mod lcg;
    pub mod place;
    pub mod skip;
    pub mod sparse;
}

use common::gpu::*;
use common::place::*;
use common::{abi::*, buf::*, context::*, cuda_context::*, errors::*, skip::*};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use dpsync::*;
use half::{bf16, f16};

/// Values replica r holds at element i: small integers, exact in every dtype.
fn value(r: usize, i: usize) -> f64 {
    ((i * 7 + r * 3) % 17) as f64 - 8.0
}

trait Elem: Copy + PartialEq + std::fmt::Debug + cudarc::driver::DeviceRepr + Default + Unpin {
    const CODE: u32;
    fn of(v: f64) -> Self;
}
macro_rules! elem {
    ($t:ty, $code:expr, $conv:expr) => {
        impl Elem for $t {
            const CODE: u32 = $code;
            fn of(v: f64) -> Self {
                $conv(v)
            }
        }
    };
}
elem!(f32, F32, |v| v as f32);
elem!(f64, F64, |v| v);
/// Local newtypes: cudarc's DeviceRepr cannot be implemented for half's types here.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Debug, Default)]
struct H16(f16);
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Debug, Default)]
struct B16(bf16);
// SAFETY: plain 2-byte values.
unsafe impl cudarc::driver::DeviceRepr for H16 {}
// SAFETY: plain 2-byte values.
unsafe impl cudarc::driver::DeviceRepr for B16 {}
elem!(H16, F16, |v| H16(f16::from_f64(v)));
elem!(B16, BF16, |v| B16(bf16::from_f64(v)));
elem!(i32, I32, |v: f64| v as i32);
elem!(i64, I64, |v: f64| v as i64);

/// Allreduce of one tensor of `n` elements over `ordinals` with `transport`, SUM and AVG,
/// checked exactly: the values are small integers, so every dtype and order is exact.
fn allreduce_case<T: Elem>(ordinals: &[i32], transport: u32, n: usize) -> bool {
    let Some(ctx) = cuda_context("allreduce_case", ordinals, |o| o.set_transport(transport)) else {
        return false;
    };
    let reps = ordinals.len();
    let mut bufs = Vec::new();
    for (r, &ordinal) in ordinals.iter().enumerate() {
        let stream = default_stream(ordinal);
        let host: Vec<T> = (0..n).map(|i| T::of(value(r, i))).collect();
        let d = stream.clone_htod(&host).unwrap();
        register_device(&ctx, "g", GRAD, r, dptr(&stream, &d), n, T::CODE);
        stream.synchronize().unwrap();
        bufs.push((d, stream));
    }
    check(ctx.allreduce("g", SUM), "allreduce SUM");
    check(synchronize(&ctx), "synchronize");
    let sum: Vec<f64> = (0..n)
        .map(|i| (0..reps).map(|r| value(r, i)).sum())
        .collect();
    for (r, (d, stream)) in bufs.iter().enumerate() {
        let got = stream.clone_dtoh(d).unwrap();
        for i in 0..n {
            assert_eq!(
                got[i],
                T::of(sum[i]),
                "SUM replica {r} element {i} of {n}, {ordinals:?}"
            );
        }
    }
    // AVG of the sums: every element is sum * reps / reps = sum when re-run on equal replicas.
    check(ctx.allreduce("g", AVG), "allreduce AVG");
    check(synchronize(&ctx), "synchronize");
    for (r, (d, stream)) in bufs.iter().enumerate() {
        let got = stream.clone_dtoh(d).unwrap();
        for i in (0..n).step_by((n / 1000).max(1)) {
            assert_eq!(got[i], T::of(sum[i]), "AVG replica {r} element {i}");
        }
    }
    true
}

/// [`allreduce_case`] for every dtype, `n` elements each; false when the transport is missing
/// here.
fn allreduce_every_dtype(ordinals: &[i32], transport: u32, n: usize) -> bool {
    allreduce_every_dtype_sized(ordinals, transport, |_| n)
}

/// [`allreduce_case`] for every dtype, `n_of(element size)` elements each.
fn allreduce_every_dtype_sized(
    ordinals: &[i32],
    transport: u32,
    n_of: impl Fn(usize) -> usize,
) -> bool {
    if !allreduce_case::<f32>(ordinals, transport, n_of(4)) {
        return false;
    }
    allreduce_case::<f64>(ordinals, transport, n_of(8));
    allreduce_case::<H16>(ordinals, transport, n_of(2));
    allreduce_case::<B16>(ordinals, transport, n_of(2));
    allreduce_case::<i32>(ordinals, transport, n_of(4));
    allreduce_case::<i64>(ordinals, transport, n_of(8))
}

/// Three replicas on `ordinals`: fused AVG of mixed-size grads, broadcast of params from replica
/// 2, then average.
fn fused_gradients_broadcast_and_average_on(ordinals: &[i32], transport: u32) {
    let Some(ctx) = cuda_context("fused_gradients", ordinals, |o| {
        o.set_fusion_bytes(4096);
        o.set_transport(transport);
    }) else {
        return;
    };
    let sizes = [3usize, 1000, 17, 5000, 1];
    let mut grads = Vec::new();
    let mut params = Vec::new();
    for (t, &n) in sizes.iter().enumerate() {
        for (r, &ordinal) in ordinals.iter().enumerate() {
            let stream = default_stream(ordinal);
            let g: Vec<f32> = (0..n).map(|i| value(r, i + t) as f32).collect();
            let p: Vec<f32> = (0..n).map(|i| (r * 100 + i) as f32).collect();
            let dg = stream.clone_htod(&g).unwrap();
            let dp = stream.clone_htod(&p).unwrap();
            register_device(&ctx, &format!("g{t}"), GRAD, r, dptr(&stream, &dg), n, F32);
            register_device(&ctx, &format!("p{t}"), PARAM, r, dptr(&stream, &dp), n, F32);
            stream.synchronize().unwrap();
            grads.push((t, r, dg, stream.clone()));
            params.push((t, r, dp, stream));
        }
    }
    let json = ctx.describe_json();
    assert!(
        json["buckets"].as_array().unwrap().len() >= 2,
        "fusion made buckets: {json}"
    );
    let (reps, root) = (ordinals.len(), ordinals.len() - 1);
    check(ctx.allreduce_grads(AVG), "allreduce_grads");
    check(
        ctx.broadcast(PARAM, root),
        "broadcast from the last replica",
    );
    check(synchronize(&ctx), "synchronize");
    for (t, r, d, stream) in &grads {
        let got = stream.clone_dtoh(d).unwrap();
        for (i, g) in got.iter().enumerate() {
            let want = (0..reps).map(|q| value(q, i + t) as f32).sum::<f32>() / reps as f32;
            assert_eq!(*g, want, "grad g{t} replica {r} element {i}");
        }
    }
    for (_, r, d, stream) in &params {
        let got = stream.clone_dtoh(d).unwrap();
        for (i, p) in got.iter().enumerate() {
            assert_eq!(
                *p,
                (root * 100 + i) as f32,
                "param on replica {r} element {i}"
            );
        }
    }
    check(ctx.average(PARAM), "average");
    check(synchronize(&ctx), "synchronize");
}

/// Dense collectives: dtypes, sizes, transports, fused gradients, the table cache.
#[path = "cuda_parts/collectives.rs"]
mod collectives;

/// Ordering by the callers' streams.
#[path = "cuda_parts/stream_order.rs"]
mod stream_order;

/// Timeouts and device faults.
#[path = "cuda_parts/faults.rs"]
mod faults;

/// Current contexts, peer access, describe, streams and memory placement.
#[path = "cuda_parts/devices.rs"]
mod devices;

/// NCCL's setup, failures and ranks.
#[path = "cuda_parts/nccl.rs"]
mod nccl;

/// Early buckets (dpsync_grad_ready).
#[path = "cuda_parts/overlap.rs"]
mod overlap;

/// The fake NCCL's sends and receives between processes.
#[path = "cuda_parts/fake_nccl_p2p.rs"]
mod fake_nccl_p2p;

/// The fake NCCL's shrink.
#[path = "cuda_parts/fake_nccl_shrink.rs"]
mod fake_nccl_shrink;
