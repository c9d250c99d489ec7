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

#[test]
fn allreduce_every_dtype_size_and_transport_on_shared_gpus() {
    // A transport that is not available here (NCCL missing) is skipped, not the others.
    'transports: for transport in [T_NCCL, T_PEER_COPY, T_AUTO] {
        for ordinals in [&[0][..], &[0, 0], &[0, 0, 0, 0]] {
            for n in [1usize, 7, 1000, 65_537] {
                if !allreduce_every_dtype(ordinals, transport, n) {
                    continue 'transports;
                }
            }
        }
    }
    // 4 MiB + 1 element and 64 MiB per replica, every dtype (minutes on the fake driver's CPU
    // threads: real GPUs only).
    if std::env::var("DPSYNC_FAKE_CUDA").as_deref() == Ok("1") {
        skip(format_args!(
            "allreduce of 4 and 64 MiB: skipped on the fake CUDA driver (minutes of emulation)"
        ));
        return;
    }
    for transport in [T_NCCL, T_PEER_COPY] {
        for ordinals in [&[0][..], &[0, 0], &[0, 0, 0, 0]] {
            let ok = allreduce_every_dtype_sized(ordinals, transport, |size| (4 << 20) / size + 1)
                && allreduce_every_dtype_sized(ordinals, transport, |size| (64 << 20) / size);
            if !ok {
                skip(format_args!(
                    "allreduce of 4 and 64 MiB over transport {transport}: skipped: not available here"
                ));
                break;
            }
        }
    }
}

/// Several GPUs (scripts/fake-cuda.sh: four fake ones, under each peer-access pattern; a
/// machine with one GPU skips): Caffe2's device sets and more, every dtype, NCCL and PEER_COPY.
#[test]
fn allreduce_across_gpus_every_dtype_and_transport() {
    if Place::gpus("allreduce_across_gpus_every_dtype_and_transport", 4).is_none() {
        return;
    }
    let sets: [&[i32]; 7] = [
        &[0, 1],
        &[0, 2],
        &[1, 2],
        &[0, 1, 2],
        &[0, 1, 2, 3],
        &[3, 3, 1, 0],
        &[2, 0, 2],
    ];
    'transports: for transport in [T_NCCL, T_PEER_COPY] {
        for ordinals in sets {
            for n in [1usize, 1000, 65_537] {
                if !allreduce_every_dtype(ordinals, transport, n) {
                    skip(format_args!(
                        "transport {transport} skipped: not available here"
                    ));
                    continue 'transports;
                }
            }
        }
        fused_gradients_broadcast_and_average_on(&[2, 0, 1], transport);
    }
}

#[test]
fn fused_gradients_broadcast_and_average() {
    fused_gradients_broadcast_and_average_on(&[0, 0, 0], T_AUTO);
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

/// Grad writer spins on the caller's stream; allreduce and the reader follow with no host
/// synchronisation. `tell_dpsync == false` is the negative control: dpsync is given another
/// stream, so it does not wait for the writer and the reader sees unreduced values.
fn stream_ordering(tell_dpsync: bool) -> Option<bool> {
    let ctx = cuda_context("stream_ordering", &[0, 0], |_| {})?;
    let gpu = gpu();
    let k = spin_kernels(&gpu);
    let n = 1 << 20;
    let caller = gpu.new_stream().unwrap();
    let other = gpu.new_stream().unwrap();
    let g0 = caller.alloc_zeros::<f32>(n).unwrap();
    let g1 = caller.alloc_zeros::<f32>(n).unwrap();
    let out = caller.alloc_zeros::<f32>(n).unwrap();
    caller.synchronize().unwrap();
    register_device(&ctx, "g", GRAD, 0, dptr(&caller, &g0), n, F32);
    register_device(&ctx, "g", GRAD, 1, dptr(&caller, &g1), n, F32);
    let told = if tell_dpsync { &caller } else { &other };
    set_stream(&ctx, 0, told);
    set_stream(&ctx, 1, told);
    let cfg = LaunchConfig::for_num_elems(n as u32);
    let cycles: i64 = 200_000_000; // ~0.1 s at ~2 GHz
    for (buf, v) in [(&g0, 1.0f32), (&g1, 2.0f32)] {
        let mut b = caller.launch_builder(&k.fill);
        let (nn, vv, cc) = (n as u64, v, cycles);
        b.arg(buf).arg(&nn).arg(&vv).arg(&cc);
        // SAFETY: arguments match the kernel.
        unsafe { b.launch(cfg) }.unwrap();
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    {
        let mut b = caller.launch_builder(&k.copy);
        let nn = n as u64;
        b.arg(&g1).arg(&out).arg(&nn);
        // SAFETY: arguments match the kernel.
        unsafe { b.launch(cfg) }.unwrap();
    }
    let got = caller.clone_dtoh(&out).unwrap();
    check(synchronize(&ctx), "synchronize");
    Some(got.iter().all(|&v| v == 3.0))
}

#[test]
fn collectives_are_ordered_by_the_callers_stream_without_host_sync() {
    let Some(ordered) = stream_ordering(true) else {
        return;
    };
    assert!(
        ordered,
        "the reader after allreduce saw unreduced gradients"
    );
    if needs_async_streams("stream-ordering negative control") {
        return;
    }
    let control = stream_ordering(false).unwrap();
    assert!(
        !control,
        "negative control: without the caller's stream dpsync should not have waited"
    );
}

#[test]
fn host_tensors_on_cuda_replicas_are_reduced_on_the_host() {
    let Some(ctx) = cuda_context("host_tensors", &[0, 0], |_| {}) else {
        return;
    };
    let mut a = vec![1.0f32; 10];
    let mut b = vec![2.0f32; 10];
    ctx.reg("cpu_stat", COMPUTED, 0, &mut a, F32);
    ctx.reg("cpu_stat", COMPUTED, 1, &mut b, F32);
    let json = ctx.describe_json();
    check(ctx.average(COMPUTED), "average");
    check(synchronize(&ctx), "synchronize");
    assert_eq!(a, vec![1.5f32; 10]);
    assert_eq!(b, vec![1.5f32; 10]);
    let backend = &json["backend"];
    assert_eq!(backend["name"], "cuda", "{json}");
    assert!(backend["host_memory"].is_object(), "{json}");
}

/// Host memory on a CUDA replica is reduced by the host, but still after the work already
/// queued on the caller's stream: there, a slow kernel fills a device buffer and a copy brings
/// it into the pinned host memory registered as the GRAD; `allreduce_grads` follows with no
/// host sync, and when it returns the host tensors must hold the sum of the copied values.
#[test]
fn host_tensors_on_cuda_replicas_wait_for_the_callers_streams() {
    use cudarc::driver::sys;
    let Some(ctx) = cuda_context("host_tensors_in_stream_order", &[0, 0], |_| {}) else {
        return;
    };
    let dev = gpu();
    let k = spin_kernels(&dev);
    let n = 1usize << 10;
    let mut replicas = Vec::new();
    for r in 0..2 {
        let stream = dev.new_stream().unwrap();
        let device = stream.alloc_zeros::<f32>(n).unwrap();
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        dev.bind_to_thread().unwrap();
        // SAFETY: plain driver call; freed below.
        let rc = unsafe { sys::cuMemAllocHost_v2(&mut host, n * 4) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemAllocHost");
        // SAFETY: n f32 of pinned memory, ours.
        let slice = unsafe { std::slice::from_raw_parts_mut(host as *mut f32, n) };
        slice.fill(0.0);
        ctx.reg("cpu_grad", GRAD, r, slice, F32);
        set_stream(&ctx, r, &stream);
        replicas.push((stream, device, host as *mut f32));
    }
    for slow in 0..2 {
        let base = 10.0 * slow as f32;
        for (r, (stream, device, host)) in replicas.iter().enumerate() {
            let cycles: i64 = if r == slow { 400_000_000 } else { 0 }; // ~0.2 s at 2 GHz
            let (nn, v) = (n as u64, base + (r + 1) as f32);
            let mut b = stream.launch_builder(&k.fill);
            b.arg(device).arg(&nn).arg(&v).arg(&cycles);
            // SAFETY: arguments match the kernel.
            unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
            // SAFETY: n f32 each side; the copy is queued after the fill on the same stream.
            let rc = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.cast(),
                    dptr(stream, device) as u64,
                    n * 4,
                    stream.cu_stream(),
                )
            };
            assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemcpyDtoHAsync");
        }
        // Declared ready on both replicas (from the second step on, early buckets have an op):
        // a host bucket is still left to allreduce_grads, since reducing it here would block
        // this thread until the GPUs caught up.
        for r in 0..2 {
            check(ctx.grad_ready("cpu_grad", r), "grad_ready");
        }
        let overlap = &ctx.describe_json()["overlap"];
        assert_eq!(
            overlap["buckets_reduced_early_this_step"], 0,
            "step {slow}: {overlap}"
        );
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        let want = 2.0 * base + 3.0;
        for (r, (_, _, host)) in replicas.iter().enumerate() {
            // SAFETY: n f32 of pinned memory; dpsync reduced it before returning.
            let got = unsafe { std::slice::from_raw_parts(*host, n) };
            assert!(
                got.iter().all(|&x| x == want),
                "replica {slow} slow: replica {r}'s host tensor holds {}, want {want}",
                got[0]
            );
        }
    }
    check(synchronize(&ctx), "synchronize");
    drop(ctx);
    for (stream, _, host) in replicas {
        stream.synchronize().unwrap();
        // SAFETY: ours, no longer registered or in use.
        unsafe { sys::cuMemFreeHost(host.cast()) };
    }
}

#[test]
fn a_stuck_collective_times_out_and_poisons_only_its_context() {
    let Some(stuck) = StuckCaller::new("a_stuck_collective_times_out", |o| o.set_timeout_ms(50))
    else {
        return;
    };
    let (ctx, caller) = (&stuck.ctx, &stuck.caller);
    let n = 1024;
    let g0 = caller.alloc_zeros::<f32>(n).unwrap();
    let g1 = caller.alloc_zeros::<f32>(n).unwrap();
    caller.synchronize().unwrap();
    register_device(ctx, "g", GRAD, 0, dptr(caller, &g0), n, F32);
    register_device(ctx, "g", GRAD, 1, dptr(caller, &g1), n, F32);
    set_stream(ctx, 0, caller);
    set_stream(ctx, 1, caller);
    stuck.spin_until_released_then_fill(&g0, 1.0);
    check(ctx.allreduce_grads(SUM), "allreduce_grads (queued)");
    expect_err(synchronize(ctx), TIMEOUT, &["timeout"]);
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    assert!(
        stuck.still_busy(),
        "the caller stream is stuck until released"
    );
    stuck.release();
    caller.synchronize().unwrap();
    // Another context is unaffected.
    let other = cuda_context("timeout", &[0], |_| {}).unwrap();
    check(synchronize(&other), "synchronize on a fresh context");
}

/// A device fault (on a GPU: a kernel's illegal address, after which every call on that context
/// fails) is reported as BACKEND_ERROR naming the driver's error; the context then refuses
/// collectives with INVALID_STATE, and destroying it neither hangs nor aborts the process. The
/// fake driver's `fake_cuda_fault` provokes it; on a real driver this prints that it was skipped.
#[test]
fn a_device_fault_fails_the_context_and_destroy_still_returns() {
    // Across two GPUs too (AUTO: NCCL communicators, aborted by the failure), where there are
    // two. (device_count needs a driver: asked only once the first run found one.)
    if device_fault_on(&[0, 0]) && device_count() >= 2 {
        device_fault_on(&[0, 1]);
    }
}

/// The fault on `ordinals`; false when it could not run here (no GPU, or a real driver).
fn device_fault_on(ordinals: &[i32]) -> bool {
    let test = "a_device_fault_fails_the_context";
    // The timeout only bounds a wait that would otherwise hang: the fault shows as an error.
    let Some(ctx) = cuda_context(test, ordinals, |o| o.set_timeout_ms(60_000)) else {
        return false;
    };
    // SAFETY: the fake's `void fake_cuda_fault(int)`.
    let Some(fault) = (unsafe { fake_driver_fn::<extern "C" fn(i32)>(test, "fake_cuda_fault") })
    else {
        return false;
    };
    let n = 4096;
    let bufs: Vec<_> = (ordinals.iter().enumerate())
        .map(|(r, &ordinal)| {
            let stream = default_stream(ordinal);
            let d = stream.clone_htod(&vec![1.0f32; n]).unwrap();
            register_device(&ctx, "g", GRAD, r, dptr(&stream, &d), n, F32);
            stream.synchronize().unwrap();
            d
        })
        .collect();
    check(ctx.allreduce_grads(SUM), "allreduce_grads before the fault");
    check(synchronize(&ctx), "synchronize before the fault");
    // Cleared however the test ends: the fault is process-wide.
    struct Cleared(extern "C" fn(i32));
    impl Drop for Cleared {
        fn drop(&mut self) {
            (self.0)(0);
        }
    }
    let cleared = Cleared(fault);
    fault(700); // CUDA_ERROR_ILLEGAL_ADDRESS
                // The fault shows in the next call that issues or waits, whichever comes first.
    let st = match ctx.allreduce_grads(SUM) {
        OK => synchronize(&ctx),
        st => st,
    };
    let msg = last_error();
    let later = [ctx.allreduce_grads(SUM), synchronize(&ctx)];
    let later_msg = last_error();
    // Destroyed while the device still fails every call, as a faulted GPU context does.
    drop(ctx);
    drop(cleared);
    drop(bufs);
    assert_eq!(st, dpsync_status::DPSYNC_STATUS_BACKEND_ERROR, "{msg}");
    assert!(msg.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{msg}");
    assert_eq!(later, [INVALID_STATE; 2], "{later_msg}");
    assert!(later_msg.contains("destroy"), "{later_msg}");
    // The process goes on: a new context works.
    let again = cuda_context(test, ordinals, |_| {}).expect("a fresh context after the fault");
    check(synchronize(&again), "synchronize on a fresh context");
    true
}

/// Host tensors on CUDA replicas wait on the host for the callers' streams; a stream that does
/// not get there in time fails the context like any collective that timed out (its queued
/// waits may never end), and the host tensors stay as they were.
#[test]
fn a_stuck_caller_stream_times_out_the_host_tensors_wait_and_fails_the_context() {
    let Some(stuck) = StuckCaller::new("a_stuck_caller_stream_times_out", |o| {
        o.set_timeout_ms(50);
    }) else {
        return;
    };
    let (ctx, caller) = (&stuck.ctx, &stuck.caller);
    let n = 256;
    let scratch = caller.alloc_zeros::<f32>(n).unwrap();
    caller.synchronize().unwrap();
    let mut host = [vec![1.0f32; n], vec![2.0f32; n]];
    for (r, h) in host.iter_mut().enumerate() {
        ctx.reg("cpu_grad", GRAD, r, h, F32);
        set_stream(ctx, r, caller);
    }
    stuck.spin_until_released_then_fill(&scratch, 1.0);
    expect_err(
        ctx.allreduce_grads(SUM),
        TIMEOUT,
        &["replica 0", "callers' streams", "50 ms"],
    );
    assert!(
        stuck.still_busy(),
        "returned while the caller stream was stuck"
    );
    assert!(
        host[0].iter().all(|&x| x == 1.0) && host[1].iter().all(|&x| x == 2.0),
        "the host tensors were touched"
    );
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    stuck.release();
    caller.synchronize().unwrap();
    drop(stuck);
}

/// The segment-table cache (one device table per tensor layout, 4096 at most per GPU) is
/// emptied when full, while the collective being issued may already use one of its tables: a
/// broadcast looks up the replicas' table, then uploads the root's, and that upload can be the
/// one that empties the cache. Here every step has a new layout (the tensor re-registered one
/// element further on), and one allreduce first makes the count odd, so that some broadcast's
/// second upload finds the cache full. Every step must still copy the root's values (on the
/// fake driver a freed table is poisoned, so a walk through it crashes or writes garbage).
#[test]
fn broadcasts_stay_right_when_the_table_cache_empties() {
    let test = "broadcasts_stay_right_when_the_table_cache_empties";
    let Some(ctx) = cuda_context(test, &[0, 0], |o| o.set_transport(T_PEER_COPY)) else {
        return;
    };
    let stream = default_stream(0);
    let (n, steps) = (16usize, 4200usize);
    let root: Vec<f32> = (0..n + steps).map(|i| i as f32 + 0.5).collect();
    let src = stream.clone_htod(&root).unwrap();
    let dst = stream.clone_htod(&vec![0.0f32; n + steps]).unwrap();
    let g = stream.clone_htod(&[1.0f32, 2.0]).unwrap();
    let g1 = stream.clone_htod(&[3.0f32, 4.0]).unwrap();
    stream.synchronize().unwrap();
    let (src_p, dst_p) = (dptr(&stream, &src), dptr(&stream, &dst));
    register_device(&ctx, "g", GRAD, 0, dptr(&stream, &g), 2, F32);
    register_device(&ctx, "g", GRAD, 1, dptr(&stream, &g1), 2, F32);
    check(
        ctx.allreduce_grads(SUM),
        "allreduce_grads (one table first)",
    );
    for step in 0..steps {
        let at = 4 * step;
        register_device(&ctx, "p", PARAM, 0, src_p + at, n, F32);
        register_device(&ctx, "p", PARAM, 1, dst_p + at, n, F32);
        check(ctx.broadcast(PARAM, 0), "broadcast");
        check(ctx.unregister("p"), "unregister");
    }
    check(synchronize(&ctx), "synchronize");
    // Step s wrote dst[s..s + n]; each later step overwrote all but its first element with the
    // same values, so every element ends as the root's.
    let got = stream.clone_dtoh(&dst).unwrap();
    assert_eq!(&got[..n + steps - 1], &root[..n + steps - 1]);
}

/// dpsync leaves the calling thread's current CUDA context as it found it, also through NCCL,
/// whose group launches, aborts and destroys may switch it (the fake NCCL does what the CUDA
/// runtime would). On a thread with no context current, every call must leave none current.
#[test]
fn the_callers_current_context_is_left_as_it_was() {
    let test = "the_callers_current_context_is_left_as_it_was";
    if Place::gpu(test).is_none() {
        return;
    }
    let layout: Vec<i32> = if device_count() >= 2 {
        vec![0, 1]
    } else {
        vec![0, 0]
    };
    let n = 1000;
    let mems: Vec<_> = layout
        .iter()
        .map(|&ordinal| {
            let stream = default_stream(ordinal);
            let d = stream.clone_htod(&vec![1.0f32; n]).unwrap();
            stream.synchronize().unwrap();
            (dptr(&stream, &d), d)
        })
        .collect();
    let ptrs: Vec<usize> = mems.iter().map(|m| m.0).collect();
    std::thread::spawn(move || {
        let current = || {
            let mut c = std::ptr::null_mut();
            // SAFETY: plain query.
            unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
            c
        };
        assert!(current().is_null(), "a new thread has no current context");
        for_each_transport(&[&layout], |ordinals, transport| {
            let Some(ctx) = cuda_context(test, ordinals, |o| o.set_transport(transport)) else {
                return false;
            };
            let after = |what: &str| {
                assert!(
                    current().is_null(),
                    "transport {transport}: {what} left a context current"
                )
            };
            after("dpsync_context_create");
            for (r, &p) in ptrs.iter().enumerate() {
                register_device(&ctx, "g", GRAD, r, p, n, F32);
            }
            after("dpsync_register");
            check(ctx.allreduce_grads(SUM), "allreduce_grads");
            after("dpsync_allreduce_grads");
            check(ctx.broadcast(GRAD, 1), "broadcast");
            after("dpsync_broadcast");
            check(synchronize(&ctx), "synchronize");
            after("dpsync_synchronize");
            drop(ctx);
            after("dpsync_context_destroy");
            true
        });
    })
    .join()
    .expect("the checks on a thread without a current context pass");
    drop(mems);
}

/// A GRAD "g" of `n` ones on replica 0 (GPU 0) and replica 1 (GPU 1), with its streams.
fn ones_on_gpus_0_and_1(
    ctx: &Context,
    n: usize,
) -> Vec<(
    cudarc::driver::CudaSlice<f32>,
    std::sync::Arc<cudarc::driver::CudaStream>,
)> {
    (0..2)
        .map(|r| {
            let stream = default_stream(r as i32);
            let d = stream.clone_htod(&vec![1.0f32; n]).unwrap();
            register_device(ctx, "g", GRAD, r, dptr(&stream, &d), n, F32);
            stream.synchronize().unwrap();
            (d, stream)
        })
        .collect()
}

/// Creating NCCL communicators and a set's first group (where NCCL connects the ranks) take
/// seconds on a multi-GPU machine; a collective timeout set for steady-state steps must not cut
/// them short. The fake NCCL stretches both with FAKE_NCCL_SETUP_MS (scripts/fake-cuda.sh);
/// elsewhere this prints that it was skipped. With a timeout a quarter of that, AUTO still
/// chooses NCCL, and the first collectives of both transports succeed with the right sums.
#[test]
fn slow_nccl_setup_is_not_a_collective_timeout() {
    let Some(setup_ms) = std::env::var("FAKE_NCCL_SETUP_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| ms >= 8)
    else {
        skip(format_args!(
            "slow_nccl_setup_is_not_a_collective_timeout: skipped: needs the fake NCCL's slow \
             setup (FAKE_NCCL_SETUP_MS; scripts/fake-cuda.sh)"
        ));
        return;
    };
    assert!(
        Place::gpus("slow_nccl_setup", 2).is_some(),
        "the fake has 2+ GPUs"
    );
    for transport in [T_AUTO, T_NCCL] {
        let ctx = cuda_context("slow nccl setup", &[0, 1], |o| {
            o.set_transport(transport);
            o.set_timeout_ms(setup_ms / 4);
        })
        .expect("the fake CUDA driver and NCCL are loaded");
        let json = ctx.describe_json();
        assert_eq!(json["transport"], "nccl", "transport {transport}: {json}");
        two_sums_of_ones(&ctx, &format!("transport {transport}"));
    }
}

/// Registers 1000 ones on GPUs 0 and 1 and checks that two SUM steps give 2, then 4. Each step
/// has run on the GPUs (waited for without a timeout) before dpsync looks for its completion, so
/// a short collective timeout (slow_nccl_setup_is_not_a_collective_timeout's) cannot expire on
/// steady-state work that a busy machine merely delays.
fn two_sums_of_ones(ctx: &Context, what: &str) {
    let n = 1000;
    let keep = ones_on_gpus_0_and_1(ctx, n);
    for step in 1..=2 {
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        for ordinal in 0..2 {
            let gpu = cudarc::driver::CudaContext::new(ordinal).unwrap();
            gpu.synchronize().expect("cuCtxSynchronize");
        }
        check(synchronize(ctx), "synchronize");
        for (r, (d, stream)) in keep.iter().enumerate() {
            let got = stream.clone_dtoh(d).unwrap();
            let want = (1u32 << step) as f32;
            assert_eq!(got, vec![want; n], "{what}, step {step}, replica {r}");
        }
    }
}

/// NCCL that cannot be used: a DPSYNC_NCCL_LIBRARY that does not load (that library alone is
/// tried, never another NCCL the loader finds), or an NCCL whose communicators fail to
/// initialise (the fake NCCL's FAKE_NCCL_INIT_FAULT=1). AUTO uses peer copies and says why;
/// NCCL asked for explicitly is UNAVAILABLE (a bad path, at creation) or fails its collective
/// naming NCCL's error. scripts/fake-cuda.sh runs both cases; elsewhere this prints that it was
/// skipped.
/// Log lines kept by `keep_line` (dpsync_set_log_callback).
static LOGGED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn keep_line(
    _level: u32,
    line: *const std::ffi::c_char,
    _: *mut std::ffi::c_void,
) {
    let text = std::ffi::CStr::from_ptr(line)
        .to_string_lossy()
        .into_owned();
    LOGGED.lock().unwrap().push(text);
}

#[test]
fn unusable_nccl_sends_auto_to_peer_copy_and_fails_an_explicit_request() {
    let missing = std::env::var("DPSYNC_NCCL_LIBRARY")
        .ok()
        .filter(|p| !p.is_empty() && !std::path::Path::new(p).exists());
    let init_fault = std::env::var("FAKE_NCCL_INIT_FAULT").as_deref() == Ok("1");
    let want_reason = match (&missing, init_fault) {
        (Some(path), _) => path.clone(),
        (None, true) => "injected init failure".to_owned(),
        (None, false) => {
            skip(format_args!(
                "unusable_nccl_sends_auto_to_peer_copy: skipped: needs DPSYNC_NCCL_LIBRARY naming \
                 a missing file, or the fake NCCL's FAKE_NCCL_INIT_FAULT=1 (scripts/fake-cuda.sh)"
            ));
            return;
        }
    };
    if Place::gpus("unusable_nccl", 2).is_none() {
        return; // scripts/fake-cuda.sh gives it two fake GPUs
    }
    // The fallback is logged (a framework's logger gets it through the callback).
    // SAFETY: a callable function; its lines go to a static.
    unsafe {
        check(
            dpsync_set_log_callback(Some(keep_line), std::ptr::null_mut(), 2),
            "log",
        )
    };
    let auto = cuda_context("unusable nccl", &[0, 1], |_| {}).expect("AUTO falls back");
    // SAFETY: NULL restores the default.
    unsafe {
        check(
            dpsync_set_log_callback(None, std::ptr::null_mut(), 0),
            "log off",
        )
    };
    let warned = LOGGED.lock().unwrap().clone();
    assert!(
        warned
            .iter()
            .any(|l| l.starts_with("NCCL is not used") && l.contains(&want_reason)),
        "{warned:?}"
    );
    let json = auto.describe_json();
    assert_eq!(json["transport"], "peer_copy", "{json}");
    let reason = json["transport_reason"].as_str().unwrap_or_default();
    assert!(reason.contains(&want_reason), "{reason}");
    two_sums_of_ones(&auto, "AUTO without a usable NCCL");
    drop(auto);
    let o = Options::new();
    o.set_cuda_replicas(&[0, 1]);
    o.set_transport(T_NCCL);
    let mut p = std::ptr::null_mut();
    // SAFETY: valid options and out pointer.
    let st = unsafe { dpsync_context_create(o.0, &mut p) };
    if missing.is_some() {
        expect_err(st, UNAVAILABLE, &["DPSYNC_NCCL_LIBRARY", &want_reason]);
        return;
    }
    check(
        st,
        "an explicit NCCL context (communicators are made at first use)",
    );
    let ctx = Context(p);
    let _keep = ones_on_gpus_0_and_1(&ctx, 16);
    let st = ctx.allreduce_grads(SUM);
    assert_ne!(st, OK, "a collective without communicators");
    assert!(
        last_error().contains(&want_reason),
        "{st:?}: {}",
        last_error()
    );
}

/// A failing NCCL, provoked by the fake NCCL of scripts/fake-cuda.sh (FAKE_NCCL_FAULT=hang: the
/// communicators stay in progress forever; =error: they report an asynchronous error): the
/// collective returns TIMEOUT or BACKEND_ERROR, the communicators are aborted, the context
/// refuses further collectives and is destroyed cleanly. A real NCCL cannot be made to fail on
/// demand, so elsewhere this prints that it was skipped.
#[test]
fn a_failing_nccl_collective_poisons_the_context() {
    let fault = std::env::var("FAKE_NCCL_FAULT").unwrap_or_default();
    let want = match fault.as_str() {
        "hang" => (TIMEOUT, "did not get ready in time"),
        "error" => (
            dpsync_status::DPSYNC_STATUS_BACKEND_ERROR,
            "injected failure",
        ),
        _ => {
            skip(format_args!(
                "a_failing_nccl_collective_poisons_the_context: skipped: needs the fake NCCL's \
                 fault injection (FAKE_NCCL_FAULT=hang or error; scripts/fake-cuda.sh)"
            ));
            return;
        }
    };
    assert!(
        Place::gpus("a_failing_nccl_collective", 2).is_some(),
        "the fake has 2+ GPUs"
    );
    // The healthy part (creating the communicators, a first collective without the fault: the
    // fake reads it per group) runs in a context with a generous timeout, so that a busy machine
    // cannot time it out. The fault hits a second context over the same GPUs, which shares those
    // communicators (made, so nothing of its own waits on setup) and has a short timeout: a hang
    // is reported after the longer of it and nccl::setup_time(), which scripts/fake-cuda.sh
    // shortens for this test (DPSYNC_NCCL_SETUP_TIMEOUT_MS; its default is a minute).
    std::env::remove_var("FAKE_NCCL_FAULT");
    let healthy = cuda_context("nccl before the fault", &[0, 1], |o| {
        o.set_transport(T_NCCL);
        o.set_timeout_ms(60_000);
    })
    .expect("the fake CUDA driver and NCCL are loaded");
    let n = 1000;
    let mut keep: Vec<_> = (ones_on_gpus_0_and_1(&healthy, n).into_iter())
        .map(|(d, _)| d)
        .collect();
    check(
        healthy.allreduce_grads(SUM),
        "allreduce_grads before the fault",
    );
    check(synchronize(&healthy), "synchronize before the fault");
    let ctx = cuda_context("nccl fault", &[0, 1], |o| {
        o.set_transport(T_NCCL);
        o.set_timeout_ms(100);
    })
    .unwrap();
    for (r, d) in keep.iter().enumerate() {
        register_device(
            &ctx,
            "g",
            GRAD,
            r,
            dptr(&default_stream(r as i32), d),
            n,
            F32,
        );
    }
    std::env::set_var("FAKE_NCCL_FAULT", &fault);
    expect_err(ctx.allreduce_grads(SUM), want.0, &[want.1]);
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    expect_err(synchronize(&ctx), INVALID_STATE, &["destroy"]);
    drop(ctx);
    // The communicators it aborted were the healthy context's too, which now refuses to use
    // them (this also shows the faulty context made none of its own).
    std::env::remove_var("FAKE_NCCL_FAULT");
    expect_err(
        healthy.allreduce_grads(SUM),
        dpsync_status::DPSYNC_STATUS_BACKEND_ERROR,
        &["aborted"],
    );
    drop(healthy);
    // The aborted communicators are not reused: a new context builds its own (and the fake
    // aborts the process on any use of an aborted one).
    let again = cuda_context("after an NCCL fault", &[0, 1], |o| o.set_transport(T_NCCL)).unwrap();
    for (r, d) in keep.iter_mut().enumerate() {
        let stream = default_stream(r as i32);
        stream.memcpy_htod(&vec![1.0f32; n], d).unwrap();
        stream.synchronize().unwrap();
        register_device(&again, "g", GRAD, r, dptr(&stream, d), n, F32);
    }
    check(
        again.allreduce_grads(SUM),
        "allreduce_grads after the fault",
    );
    check(synchronize(&again), "synchronize");
    let got = default_stream(1).clone_dtoh(&keep[1]).unwrap();
    assert_eq!(got, vec![2.0f32; n], "the new communicators reduce");
}

#[test]
fn describe_of_a_live_context_matches_the_dry_run() {
    for transport in [T_NCCL, T_PEER_COPY] {
        let Some(ctx) = cuda_context("describe", &[0, 0, 0, 0], |o| o.set_transport(transport))
        else {
            continue;
        };
        let live = ctx.describe_json();
        let o = Options::new();
        o.set_cuda_replicas(&[0, 0, 0, 0]);
        o.set_transport(transport);
        let dry = o.plan_json();
        assert_eq!(live["steps"], dry["steps"], "live {live}\ndry {dry}");
        assert_eq!(live["peer_access"], dry["peer_access"]);
        assert_eq!(live["peer_access_source"], "detected");
        assert_eq!(live["backend"]["name"], "cuda");
    }
}

/// A device out of peer connections (CUDA_ERROR_TOO_MANY_PEERS when enabling one more) is not
/// a failure: those pairs count as without access and use staged copies. The fake driver's
/// FAKE_CUDA_PEER_LIMIT provokes it (scripts/fake-cuda.sh); elsewhere this prints that it was
/// skipped.
#[test]
fn a_peer_limit_falls_back_to_staged_copies() {
    let test = "a_peer_limit_falls_back_to_staged_copies";
    let Some(limit) = std::env::var("FAKE_CUDA_PEER_LIMIT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    else {
        skip(format_args!(
            "{test}: skipped: needs the fake driver's FAKE_CUDA_PEER_LIMIT (scripts/fake-cuda.sh)"
        ));
        return;
    };
    if Place::gpus(test, 4).is_none() {
        return;
    }
    let ordinals = [0, 1, 2, 3];
    let ctx = cuda_context(test, &ordinals, |o| o.set_transport(T_PEER_COPY)).unwrap();
    let live = ctx.describe_json();
    let rows = live["peer_access"].as_array().expect("peer_access");
    for (i, row) in rows.iter().enumerate() {
        let peers = (row.as_array().unwrap().iter().enumerate())
            .filter(|&(j, v)| j != i && v == 1)
            .count();
        assert!(
            peers <= limit,
            "replica {i} has {peers} peers over the limit {limit}: {live}"
        );
    }
    assert!(
        rows.iter()
            .flat_map(|r| r.as_array().unwrap())
            .any(|v| v == 0),
        "some pairs went without access: {live}"
    );
    drop(ctx);
    assert!(allreduce_every_dtype(&ordinals, T_PEER_COPY, 1000));
}

/// Several GPUs: the live context detects the peer matrix (under scripts/fake-cuda.sh, the one
/// FAKE_CUDA_PEER describes, so the other multi-GPU tests really ran on that pattern) and
/// executes the plan a dry run gives for that matrix. With an override, it shows the override and, beside it, what it detected.
#[test]
fn describe_across_gpus_shows_the_detected_peer_matrix_and_its_plan() {
    if Place::gpus("describe_across_gpus", 4).is_none() {
        return;
    }
    for ordinals in [&[0, 1, 2][..], &[0, 1, 2, 3], &[1, 1, 2]] {
        let Some(ctx) = cuda_context("describe", ordinals, |o| o.set_transport(T_PEER_COPY)) else {
            return;
        };
        let live = ctx.describe_json();
        // GPUs of one kind share one compiled kernel image (the fake's are all sm_90): NVRTC ran
        // once in this process (twice where the CUBIN fails and PTX follows), not once per GPU.
        let devices = live["backend"]["devices"].as_array().expect("devices");
        assert!(devices.len() > 1, "{live}");
        assert!(
            devices
                .iter()
                .all(|d| d["kernels"] == devices[0]["kernels"]),
            "{live}"
        );
        let compiles = live["backend"]["nvrtc_compiles"]
            .as_u64()
            .expect("nvrtc_compiles");
        assert!((1..=2).contains(&compiles), "{live}");
        let n = ordinals.len();
        let matrix: Vec<u8> = live["peer_access"]
            .as_array()
            .expect("peer_access")
            .iter()
            .flat_map(|row| {
                row.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u8)
            })
            .collect();
        assert_eq!(matrix.len(), n * n, "{live}");
        if let Ok(pairs) = std::env::var("FAKE_CUDA_PEER") {
            let access = |a: i32, b: i32| match pairs.as_str() {
                "0" => false,
                "" => a != b,
                _ => pairs
                    .split(',')
                    .any(|p| p == format!("{a}-{b}") || p == format!("{b}-{a}")),
            };
            for i in 0..n {
                for j in 0..n {
                    let (a, b) = (ordinals[i], ordinals[j]);
                    // Replicas on one GPU always reach each other's memory.
                    let want = a == b || access(a, b);
                    assert_eq!(
                        matrix[i * n + j] == 1,
                        want,
                        "{ordinals:?} [{i}][{j}]: {live}"
                    );
                }
            }
        }
        let o = Options::new();
        o.set_cuda_replicas(ordinals);
        o.set_transport(T_PEER_COPY);
        o.set_peer_access(&matrix, n);
        let dry = o.plan_json();
        assert_eq!(live["steps"], dry["steps"], "live {live}\ndry {dry}");
        assert!(live["peer_access_detected"].is_null(), "{live}");
        // An override (no access between different GPUs, always allowed) replaces the matrix;
        // the detected one is still shown.
        let only_own: Vec<u8> = (0..n * n)
            .map(|k| u8::from(ordinals[k / n] == ordinals[k % n]))
            .collect();
        let Some(restricted) = cuda_context("describe override", ordinals, |o| {
            o.set_transport(T_PEER_COPY);
            o.set_peer_access(&only_own, n);
        }) else {
            return;
        };
        let json = restricted.describe_json();
        assert_eq!(json["peer_access_source"], "override", "{json}");
        assert_eq!(json["peer_access_detected"], live["peer_access"], "{json}");
        for step in json["steps"].as_array().expect("steps") {
            let (src, dst) = (step["src"].as_u64().unwrap(), step["dst"].as_u64().unwrap());
            if ordinals[src as usize] != ordinals[dst as usize] {
                assert_eq!(step["via"], "staged", "no access, staged copies: {json}");
            }
        }
    }
}

#[test]
fn set_stream_checks_its_arguments() {
    let Some(ctx) = cuda_context("set_stream", &[0], |_| {}) else {
        return;
    };
    // SAFETY: a live context; the stream values are never dereferenced on failure.
    unsafe {
        expect_err(
            dpsync_set_stream(ctx.0, 1, std::ptr::null_mut()),
            INVALID_ARGUMENT,
            &["replica"],
        );
        check(
            dpsync_set_stream(ctx.0, 0, std::ptr::null_mut()),
            "legacy stream",
        );
    }
}

/// The special stream handles: cudaStreamLegacy (0x1) is the replica's legacy default stream
/// whatever context the calling thread has current (none here, or GPU 0's for a replica on GPU
/// 1); cudaStreamPerThread (0x2) is refused, naming it, since it is another stream on every
/// thread.
#[test]
fn set_stream_takes_the_legacy_handle_and_refuses_the_per_thread_one() {
    let test = "set_stream_takes_the_legacy_handle_and_refuses_the_per_thread_one";
    if Place::gpu(test).is_none() {
        return;
    }
    let two = device_count() >= 2;
    std::thread::spawn(move || {
        let ordinals: &[i32] = if two { &[0, 1] } else { &[0] };
        let ctx = cuda_context(test, ordinals, |_| {}).unwrap();
        let last = ordinals.len() - 1;
        // No context current on this new thread; then, with two GPUs, GPU 0's.
        let mut bound_gpu0 = None;
        for round in 0..if two { 2 } else { 1 } {
            if round == 1 {
                let gpu0 = gpu();
                gpu0.bind_to_thread().unwrap();
                bound_gpu0 = Some(gpu0);
            }
            // SAFETY: a live context; the special handles are never dereferenced.
            unsafe {
                check(
                    dpsync_set_stream(ctx.0, last, std::ptr::without_provenance_mut(0x1)),
                    "cudaStreamLegacy",
                );
                expect_err(
                    dpsync_set_stream(ctx.0, 0, std::ptr::without_provenance_mut(0x2)),
                    INVALID_ARGUMENT,
                    &["cudaStreamPerThread", "replica 0"],
                );
            }
            let json = ctx.describe_json();
            assert!(
                json["backend"]["caller_streams"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|s| s == "legacy default"),
                "round {round}: {json}"
            );
        }
        drop(bound_gpu0);
    })
    .join()
    .expect("the special handles behave");
}

/// Two NCCL ranks on the one GPU ([`rank_per_replica`]): a 2-rank communicator on one GPU.
#[test]
fn two_nccl_ranks_on_one_gpu_when_enabled() {
    if !rank_per_replica("two_nccl_ranks_on_one_gpu_when_enabled") {
        return;
    }
    let Some(ctx) = cuda_context("two NCCL ranks", &[0, 0], |o| o.set_transport(T_NCCL)) else {
        return;
    };
    let plan = ctx.describe_json();
    let ranks = plan["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["op"] == "nccl_allreduce")
        .count();
    assert_eq!(ranks, 2, "one NCCL rank per replica: {plan}");
    // Its contexts get the same two-rank plan (the variable is read per options): every dtype,
    // fused gradients, broadcast and average over real NCCL calls on one GPU.
    for n in [1usize, 12_345, 1 << 20] {
        assert!(allreduce_every_dtype(&[0, 0], T_NCCL, n));
    }
    fused_gradients_broadcast_and_average_on(&[0, 0], T_NCCL);
}

/// Tensors of the overlap runs: name, dtype, elements (several buckets at 64-byte fusion).
const OVERLAP_MODEL: [(&str, DType, usize); 5] = [
    ("a", DType::F32, 5),
    ("b", DType::F16, 9),
    ("c", DType::F32, 13),
    ("d", DType::I32, 4),
    ("e", DType::F64, 6),
];

/// Steps with every gradient declared final by dpsync_grad_ready (in backward order), SUM then
/// AVG: every replica's bytes after each step. Values are small integers, exact in every dtype
/// and order, so host and device runs must agree byte for byte. `None` without a GPU.
fn overlap_steps(place: &Place, ordinals: &[i32], transport: u32) -> Option<Vec<Vec<Vec<u8>>>> {
    let ctx = match place {
        Place::Host => Context::host(ordinals.len(), Some(64)),
        Place::Gpu(_) => cuda_context("overlap", ordinals, |o| {
            o.set_transport(transport);
            o.set_fusion_bytes(64);
        })?,
    };
    let encoded = |dtype: DType, v: &[f64]| match dtype {
        DType::I32 | DType::I64 => {
            encode_indices(dtype, &v.iter().map(|&x| x as i64).collect::<Vec<_>>())
        }
        _ => encode(dtype, v),
    };
    let mut mems: Vec<Vec<Mem>> = Vec::new();
    for (r, &ordinal) in ordinals.iter().enumerate() {
        let mut per = Vec::new();
        for &(name, dtype, n) in &OVERLAP_MODEL {
            let mem = place.mem_on(ordinal, &vec![0u8; n * dtype.size()]);
            let st = register_raw(ctx.0, name, GRAD, r, mem.ptr() as _, n, dtype.code());
            check(st, "register");
            per.push(mem);
        }
        mems.push(per);
    }
    let mut out = Vec::new();
    for (step, op) in [(0usize, SUM), (1, SUM), (2, AVG), (3, AVG)] {
        for (r, per) in mems.iter_mut().enumerate() {
            for (i, (mem, &(_, dtype, n))) in per.iter_mut().zip(&OVERLAP_MODEL).enumerate() {
                let v: Vec<f64> = (0..n).map(|e| value(r + step, e + i)).collect();
                mem.write(&encoded(dtype, &v));
            }
        }
        for &(name, _, _) in OVERLAP_MODEL.iter().rev() {
            for r in 0..ordinals.len() {
                check(ctx.grad_ready(name, r), "grad_ready");
            }
        }
        let early = &ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"];
        assert_eq!(
            early.as_u64().unwrap() > 0,
            step > 0,
            "step {step}: {early}"
        );
        check(ctx.allreduce_grads(op), "allreduce_grads");
        if let Place::Gpu(_) = place {
            check(synchronize(&ctx), "synchronize");
        }
        out.push(mems.iter().flatten().map(Mem::read).collect());
    }
    Some(out)
}

/// dpsync_grad_ready on CUDA replicas: early buckets queued on dpsync's streams (and divided on
/// the device when the op changes from SUM to AVG) give the host's bytes.
#[test]
fn grad_ready_on_cuda_replicas_gives_the_hosts_bytes() {
    let Some(gpu) = Place::gpu("grad_ready_on_cuda_replicas_gives_the_hosts_bytes") else {
        return;
    };
    let host = overlap_steps(&Place::Host, &[0, 0, 0], T_HOST).unwrap();
    let got = overlap_steps(&gpu, &[0, 0, 0], T_AUTO).unwrap();
    assert_eq!(got, host, "[0, 0, 0]");
}

#[test]
fn grad_ready_across_gpus_gives_the_hosts_bytes() {
    let Some(gpus) = Place::gpus("grad_ready_across_gpus_gives_the_hosts_bytes", 4) else {
        return;
    };
    for ordinals in [&[0, 1, 2, 3][..], &[2, 0, 2]] {
        let host = overlap_steps(&Place::Host, ordinals, T_HOST).unwrap();
        for transport in [T_NCCL, T_PEER_COPY] {
            let Some(got) = overlap_steps(&gpus, ordinals, transport) else {
                skip(format_args!(
                    "transport {transport} skipped: not available here"
                ));
                continue;
            };
            assert_eq!(got, host, "{ordinals:?} transport {transport}");
        }
    }
}

/// How often the fake driver made `stream` wait on an event; `None` on a real driver.
fn fake_waits_on(test: &str, stream: &cudarc::driver::CudaStream) -> Option<i64> {
    type WaitsOn = extern "C" fn(*mut std::ffi::c_void) -> i64;
    // SAFETY: the fake's `long fake_cuda_waits_on(void*)`.
    let f = unsafe { fake_driver_fn::<WaitsOn>(test, "fake_cuda_waits_on") };
    f.map(|f| f(stream.cu_stream() as *mut _))
}

/// A bucket reduced early by dpsync_grad_ready waits for the work already on the callers'
/// streams but does not make them wait for it (backward goes on, which is the point); the
/// allreduce_grads that ends the step does.
#[test]
fn early_buckets_do_not_make_the_callers_wait() {
    let test = "early_buckets_do_not_make_the_callers_wait";
    let Some(ctx) = cuda_context(test, &[0, 0], |o| o.set_fusion_bytes(64)) else {
        return;
    };
    let gpu = gpu();
    let caller = gpu.new_stream().unwrap();
    let bufs: Vec<_> = (0..4)
        .map(|_| caller.alloc_zeros::<f32>(16).unwrap())
        .collect();
    caller.synchronize().unwrap();
    for (t, pair) in bufs.chunks(2).enumerate() {
        for (r, b) in pair.iter().enumerate() {
            register_device(&ctx, &format!("g{t}"), GRAD, r, dptr(&caller, b), 16, F32);
        }
    }
    set_stream(&ctx, 0, &caller);
    set_stream(&ctx, 1, &caller);
    check(
        ctx.allreduce_grads(SUM),
        "the first step (the op is not known before)",
    );
    let Some(before) = fake_waits_on(test, &caller) else {
        return;
    };
    for name in ["g1", "g0"] {
        for r in 0..2 {
            check(ctx.grad_ready(name, r), "grad_ready");
        }
    }
    let early = &ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"];
    assert_eq!(early, 2, "both 64-byte buckets reduced early");
    assert_eq!(
        fake_waits_on(test, &caller).unwrap(),
        before,
        "early buckets made the caller's stream wait"
    );
    check(ctx.allreduce_grads(SUM), "allreduce_grads ends the step");
    assert!(
        fake_waits_on(test, &caller).unwrap() > before,
        "allreduce_grads must make the caller's stream wait"
    );
    check(synchronize(&ctx), "synchronize");
}

/// The collectives of one ordering run, with the value every replica must end with when replica
/// r's tensor held r + 1 (exact in f32).
#[derive(Clone, Copy, Debug)]
enum Collective {
    Grads,
    One,
    Broadcast,
    Average,
}

impl Collective {
    fn role(self) -> u32 {
        match self {
            Collective::Grads | Collective::One => GRAD,
            Collective::Broadcast => PARAM,
            Collective::Average => COMPUTED,
        }
    }

    fn run(self, ctx: &Context, replicas: usize) -> dpsync_status {
        match self {
            Collective::Grads => ctx.allreduce_grads(SUM),
            Collective::One => ctx.allreduce("t", AVG),
            Collective::Broadcast => ctx.broadcast(PARAM, replicas - 1),
            Collective::Average => ctx.average(COMPUTED),
        }
    }

    fn expected(self, replicas: usize) -> f32 {
        let n = replicas as f32;
        match self {
            Collective::Grads => n * (n + 1.0) / 2.0,
            Collective::One | Collective::Average => (n + 1.0) / 2.0,
            Collective::Broadcast => n,
        }
    }
}

/// Every dense collective in stream order, each replica with its own caller stream
/// ([`in_stream_order`]). False when `transport` is not available here.
fn every_collective_in_stream_order(test: &str, ordinals: &[i32], transport: u32) -> bool {
    let reps = ordinals.len();
    [
        Collective::Grads,
        Collective::One,
        Collective::Broadcast,
        Collective::Average,
    ]
    .into_iter()
    .all(|c| {
        let what = format!("{c:?}");
        let issue = |ctx: &Context| c.run(ctx, reps);
        in_stream_order(
            test,
            &what,
            ordinals,
            transport,
            c.role(),
            |_| {},
            issue,
            c.expected(reps),
        )
    })
}

#[test]
fn every_collective_is_ordered_by_each_replicas_stream() {
    for_each_transport(&[&[0, 0, 0]], |ordinals, transport| {
        every_collective_in_stream_order("every_collective_in_order", ordinals, transport)
    });
}

#[test]
fn every_collective_across_gpus_is_ordered_by_each_replicas_stream() {
    let test = "every_collective_across_gpus_in_order";
    if Place::gpus(test, 4).is_none() {
        return;
    }
    for_each_transport(&ACROSS_GPUS, |ordinals, transport| {
        every_collective_in_stream_order(test, ordinals, transport)
    });
}

/// Memory of another GPU than the replica's is refused at once, naming the tensor, the
/// argument and both devices: a dense tensor's `data`, a sparse slice's `indices` or `values`.
#[test]
fn memory_of_another_gpu_is_refused_across_gpus() {
    let test = "memory_of_another_gpu_is_refused_across_gpus";
    let Some(place) = Place::gpus(test, 2) else {
        return;
    };
    let Some(ctx) = cuda_context(test, &[0, 1], |_| {}) else {
        return;
    };
    let on0 = place.mem_on(0, &[0u8; 64]);
    let on1 = place.mem_on(1, &[0u8; 64]);
    let st = register_raw(ctx.0, "w", GRAD, 0, on1.ptr() as _, 4, F32);
    expect_err(
        st,
        INVALID_ARGUMENT,
        &["'w'", "data", "cuda:1", "replica 0", "cuda:0"],
    );
    ctx.reg_sparse_all("e", 1, F32, I64, 0);
    let (good, bad) = (on0.ptr() as *const _, on1.ptr() as *const _);
    for (what, indices, values) in [("indices", bad, good), ("values", good, bad)] {
        let st = ctx.sparse_set_raw("e", 0, indices, values, 2);
        expect_err(st, INVALID_ARGUMENT, &["'e'", what, "cuda:1", "replica 0"]);
    }
}

/// The fake NCCL's sends and receives between processes (tests/cuda_parts/fake_nccl_p2p.rs).
#[path = "cuda_parts/fake_nccl_p2p.rs"]
mod fake_nccl_p2p;
