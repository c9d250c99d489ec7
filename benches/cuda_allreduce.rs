//! CUDA-replica benchmarks through the C ABI, each beside its baseline in the same run:
//! - the ResNet-50 gradient set (161 tensors) on replicas [0,0]: fused vs one bucket per
//!   tensor, GPU time per allreduce_grads and the host-side cost of issuing it, and the same
//!   reduction written with one raw `ncclAllReduce` per tensor on a two-rank communicator over
//!   the one GPU (only where NCCL accepts two ranks per GPU: `NCCL_MULTI_RANK_GPU_ENABLE=1`,
//!   NCCL >= 2.30; otherwise the baseline prints why it was skipped);
//! - the sum kernel (PEER_COPY on [0,0]: one table walk reads both replicas and writes both)
//!   as bytes moved per second against a device-to-device copy of the same bytes;
//! - the fused BMUF update on the ResNet-50 parameters (one replica, so no averaging runs)
//!   against a device-to-device copy of the bytes it reads and writes.
//!
//! Without a GPU it prints "skipped: no CUDA device". Run: `cargo bench --bench cuda_allreduce`
//! (`-- --quick` for a short run); scripts/gpu-check.sh runs it on the GPU machine.

use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use dpsync::*;

#[path = "common/mod.rs"]
mod common;
use common::{check, raw_nccl, Ctx, F32, GRAD, PARAM, SUM};

/// CUDA replicas on `ordinals` over `transport` (0 = AUTO); `None` without a GPU.
fn cuda_ctx(ordinals: &[i32], transport: u32, fusion_bytes: usize) -> Option<Ctx> {
    Ctx::create(|o| unsafe {
        check(dpsync_options_set_cuda_replicas(
            o,
            ordinals.as_ptr(),
            ordinals.len(),
        ));
        check(dpsync_options_set_transport(o, transport));
        check(dpsync_options_set_fusion_bytes(o, fusion_bytes));
    })
}

/// Registers `n` f32 of device memory as `role`.
fn reg(ctx: &Ctx, name: &str, role: u32, replica: usize, ptr: u64, n: usize) {
    ctx.register(name, role, replica, ptr as *mut c_void, n, F32);
}

fn set_stream(ctx: &Ctx, replica: usize, stream: &CudaStream) {
    // SAFETY: a live context and stream.
    unsafe {
        check(dpsync_set_stream(
            ctx.0,
            replica,
            stream.cu_stream() as *mut _,
        ))
    };
}

fn ptr(stream: &Arc<CudaStream>, s: &CudaSlice<f32>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// GPU milliseconds per call of `f` (timed with events on `stream`) and host µs per call.
fn time(stream: &Arc<CudaStream>, iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    stream.synchronize().unwrap();
    // Timing needs events created without CU_EVENT_DISABLE_TIMING (cudarc's default).
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(timed).unwrap();
    let mut host = 0.0;
    for _ in 0..iters {
        let h = Instant::now();
        f();
        host += h.elapsed().as_secs_f64();
    }
    let end = stream.record_event(timed).unwrap();
    end.synchronize().unwrap();
    let gpu_ms = start.elapsed_ms(&end).unwrap() as f64 / iters as f64;
    (gpu_ms, host * 1e6 / iters as f64)
}

/// The ResNet-50 tensor sizes.
fn resnet_sizes() -> Vec<usize> {
    common::load_param_set("resnet50_params.tsv")
        .into_iter()
        .map(|(_, n)| n)
        .collect()
}

fn resnet(gpu: &Arc<CudaContext>, sizes: &[usize], quick: bool, issue_only: bool) {
    let stream = gpu.new_stream().unwrap();
    let bufs: Vec<[CudaSlice<f32>; 2]> = sizes
        .iter()
        .map(|&n| {
            [
                stream.alloc_zeros(n).unwrap(),
                stream.alloc_zeros(n).unwrap(),
            ]
        })
        .collect();
    let iters = if quick { 5 } else { 50 };
    let total: usize = sizes.iter().sum();
    println!(
        "ResNet-50 gradients: {} tensors, {:.1} M f32, replicas [0,0]",
        sizes.len(),
        total as f64 / 1e6
    );
    let mut results = Vec::new();
    for (label, fusion) in [
        ("fused (25 MiB buckets)", 25usize << 20),
        ("one bucket per tensor", 0),
    ] {
        let Some(ctx) = cuda_ctx(&[0, 0], 0, fusion) else {
            return;
        };
        for (t, pair) in bufs.iter().enumerate() {
            for (r, b) in pair.iter().enumerate() {
                reg(&ctx, &format!("g{t}"), GRAD, r, ptr(&stream, b), sizes[t]);
            }
        }
        set_stream(&ctx, 0, &stream);
        set_stream(&ctx, 1, &stream);
        let (gpu_ms, host_us) = time(&stream, iters, || {
            check(unsafe { dpsync_allreduce_grads(ctx.0, SUM) })
        });
        println!("  {label:<24} GPU {gpu_ms:8.3} ms/step   issue (host) {host_us:8.1} µs/call");
        results.push(gpu_ms);
    }
    println!(
        "  fused / per-tensor GPU time: {:.2}",
        results[0] / results[1]
    );
    if issue_only {
        return;
    }
    // The baseline: one ncclAllReduce per tensor, two ranks on GPU 0, one stream each.
    let second = gpu.new_stream().unwrap();
    match raw_nccl::Comms::two_ranks_on_gpu0() {
        Err(why) => println!("  raw NCCL per tensor: skipped: {why}"),
        Ok(comms) => {
            // Pointers and events made once, as a framework would keep them.
            let ptrs: Vec<[u64; 2]> = bufs
                .iter()
                .map(|pair| [ptr(&stream, &pair[0]), ptr(&stream, &pair[1])])
                .collect();
            let streams = [stream.cu_stream(), second.cu_stream()];
            let fork = gpu.new_event(None).unwrap();
            let join = gpu.new_event(None).unwrap();
            let (gpu_ms, host_us) = time(&stream, iters, || {
                fork.record(&stream).unwrap();
                second.wait(&fork).unwrap();
                comms.group(|| {
                    for (p, &n) in ptrs.iter().zip(sizes) {
                        for rank in 0..2 {
                            comms.allreduce_f32_in_place(rank, p[rank], n, streams[rank] as _);
                        }
                    }
                });
                join.record(&second).unwrap();
                stream.wait(&join).unwrap();
            });
            println!(
                "  {:<24} GPU {gpu_ms:8.3} ms/step   issue (host) {host_us:8.1} µs/call",
                "raw NCCL, per tensor"
            );
            println!(
                "  dpsync fused / raw NCCL GPU time: {:.2} (target <= 1)",
                results[0] / gpu_ms
            );
        }
    }
}

fn sum_bandwidth(gpu: &Arc<CudaContext>, quick: bool) {
    let n: usize = if quick { 16 << 20 } else { 64 << 20 }; // f32 elements per replica
    let stream = gpu.new_stream().unwrap();
    let a: CudaSlice<f32> = stream.alloc_zeros(n).unwrap();
    let b: CudaSlice<f32> = stream.alloc_zeros(n).unwrap();
    let mut c: CudaSlice<f32> = stream.alloc_zeros(n).unwrap();
    let Some(ctx) = cuda_ctx(&[0, 0], 2, 25 << 20) else {
        return;
    };
    reg(&ctx, "g", GRAD, 0, ptr(&stream, &a), n);
    reg(&ctx, "g", GRAD, 1, ptr(&stream, &b), n);
    set_stream(&ctx, 0, &stream);
    set_stream(&ctx, 1, &stream);
    let iters = if quick { 5 } else { 20 };
    let bytes = (n * 4) as f64;
    let name = CString::new("g").unwrap();
    let (sum_ms, _) = time(&stream, iters, || {
        check(unsafe { dpsync_allreduce(ctx.0, name.as_ptr(), SUM) })
    });
    let (copy_ms, _) = time(&stream, iters, || {
        let (src, _s) = a.device_ptr(&stream);
        let (dst, _d) = c.device_ptr_mut(&stream);
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, n * 4, stream.cu_stream()).unwrap()
        };
    });
    // The sum reads 2 replicas and writes 2; the copy reads 1 and writes 1.
    let sum_bw = 4.0 * bytes / (sum_ms * 1e-3) / 1e9;
    let copy_bw = 2.0 * bytes / (copy_ms * 1e-3) / 1e9;
    println!(
        "Sum kernel, 2 x {} MiB f32 on one GPU: {sum_ms:.3} ms = {sum_bw:.0} GB/s moved; \
         D2D copy {copy_ms:.3} ms = {copy_bw:.0} GB/s; ratio {:.2}",
        (n * 4) >> 20,
        sum_bw / copy_bw
    );
}

/// The fused BMUF update (bmuf_step on one replica: the averaging is a no-op there) against a
/// device-to-device copy of the bytes the update reads and writes (params, W and D).
fn bmuf_bandwidth(gpu: &Arc<CudaContext>, sizes: &[usize], quick: bool) {
    let stream = gpu.new_stream().unwrap();
    let Some(ctx) = cuda_ctx(&[0], 0, 25 << 20) else {
        return;
    };
    let params: Vec<CudaSlice<f32>> = sizes
        .iter()
        .map(|&n| stream.alloc_zeros(n).unwrap())
        .collect();
    for (t, p) in params.iter().enumerate() {
        reg(&ctx, &format!("p{t}"), PARAM, 0, ptr(&stream, p), sizes[t]);
    }
    set_stream(&ctx, 0, &stream);
    check(unsafe { dpsync_bmuf_init(ctx.0, 1.0, 0.9, true) });
    let total: usize = sizes.iter().sum();
    let iters = if quick { 5 } else { 50 };
    let (update_ms, host_us) = time(&stream, iters, || check(unsafe { dpsync_bmuf_step(ctx.0) }));
    // The update reads and writes 3 x total f32 (params, W, D); copy that many.
    let src: CudaSlice<f32> = stream.alloc_zeros(3 * total).unwrap();
    let mut dst: CudaSlice<f32> = stream.alloc_zeros(3 * total).unwrap();
    let (copy_ms, _) = time(&stream, iters, || {
        let (s, _a) = src.device_ptr(&stream);
        let (d, _b) = dst.device_ptr_mut(&stream);
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(d, s, 3 * total * 4, stream.cu_stream())
                .unwrap()
        };
    });
    let moved = 2.0 * (3 * total * 4) as f64;
    println!(
        "BMUF update (Nesterov), ResNet-50 params {:.1} M f32 on [0]: {update_ms:.3} ms = {:.0} \
         GB/s (issue {host_us:.1} µs); D2D copy of the same bytes {copy_ms:.3} ms = {:.0} GB/s; \
         ratio {:.2} (target >= 0.85)",
        total as f64 / 1e6,
        moved / (update_ms * 1e-3) / 1e9,
        moved / (copy_ms * 1e-3) / 1e9,
        copy_ms / update_ms
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // --issue: only the dpsync ResNet-50 cases (issue cost), e.g. on the fake driver with
    // FAKE_CUDA_NOEXEC=1 FAKE_CUDA_STATS=1 (docs/PERFORMANCE.md, "issue cost anatomy").
    let issue_only = std::env::args().any(|a| a == "--issue");
    // Probe through dpsync first: it reports a missing driver without panicking.
    if cuda_ctx(&[0], 0, 0).is_none() {
        return;
    }
    let gpu = CudaContext::new(0).expect("GPU 0");
    let sizes = resnet_sizes();
    resnet(&gpu, &sizes, quick, issue_only);
    if issue_only {
        return;
    }
    sum_bandwidth(&gpu, quick);
    bmuf_bandwidth(&gpu, &sizes, quick);
}
