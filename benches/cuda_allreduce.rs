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

#[path = "common/raw_nccl.rs"]
mod raw_nccl;

const SUM: u32 = dpsync_reduce_op::DPSYNC_REDUCE_SUM as u32;
const GRAD: u32 = dpsync_role::DPSYNC_ROLE_GRAD as u32;
const PARAM: u32 = dpsync_role::DPSYNC_ROLE_PARAM as u32;
const F32: u32 = dpsync_dtype::DPSYNC_DTYPE_F32 as u32;

fn check(status: dpsync_status) {
    if status != dpsync_status::DPSYNC_STATUS_OK {
        let msg = unsafe { std::ffi::CStr::from_ptr(dpsync_last_error()) };
        panic!("{status:?}: {}", msg.to_string_lossy());
    }
}

struct Ctx(*mut dpsync_context);

impl Ctx {
    fn new(ordinals: &[i32], transport: u32, fusion_bytes: usize) -> Option<Ctx> {
        unsafe {
            let mut o = std::ptr::null_mut();
            check(dpsync_options_new(&mut o));
            check(dpsync_options_set_cuda_replicas(
                o,
                ordinals.as_ptr(),
                ordinals.len(),
            ));
            check(dpsync_options_set_transport(o, transport));
            check(dpsync_options_set_fusion_bytes(o, fusion_bytes));
            let mut c = std::ptr::null_mut();
            let st = dpsync_context_create(o, &mut c);
            dpsync_options_free(o);
            if st == dpsync_status::DPSYNC_STATUS_UNAVAILABLE {
                let msg = std::ffi::CStr::from_ptr(dpsync_last_error());
                println!("skipped: no CUDA device ({})", msg.to_string_lossy());
                return None;
            }
            check(st);
            Some(Ctx(c))
        }
    }

    fn register(&self, name: &str, replica: usize, ptr: u64, n: usize) {
        self.register_as(name, GRAD, replica, ptr, n)
    }

    fn register_as(&self, name: &str, role: u32, replica: usize, ptr: u64, n: usize) {
        let name = CString::new(name).unwrap();
        unsafe {
            check(dpsync_register(
                self.0,
                name.as_ptr(),
                role,
                replica,
                ptr as *mut c_void,
                n,
                F32,
            ))
        };
    }

    fn set_stream(&self, replica: usize, stream: &CudaStream) {
        unsafe {
            check(dpsync_set_stream(
                self.0,
                replica,
                stream.cu_stream() as *mut _,
            ))
        };
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        unsafe { dpsync_context_destroy(self.0) };
    }
}

fn ptr(stream: &Arc<CudaStream>, s: &CudaSlice<f32>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

fn load_param_set(path: &str) -> Vec<usize> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split('\t').nth(2).unwrap().trim().parse().unwrap())
        .collect()
}

/// GPU milliseconds per call of `f` (timed with events on `stream`) and host µs per call.
fn time(stream: &Arc<CudaStream>, iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    stream.synchronize().unwrap();
    let start = stream.record_event(None).unwrap();
    let mut host = 0.0;
    for _ in 0..iters {
        let h = Instant::now();
        f();
        host += h.elapsed().as_secs_f64();
    }
    let end = stream.record_event(None).unwrap();
    end.synchronize().unwrap();
    let gpu_ms = start.elapsed_ms(&end).unwrap() as f64 / iters as f64;
    (gpu_ms, host * 1e6 / iters as f64)
}

/// The ResNet-50 tensor sizes. The bundle of scripts/gpu-check.sh runs elsewhere than it was
/// built: try the working directory first.
fn resnet_sizes() -> Vec<usize> {
    let local = "benches/data/resnet50_params.tsv";
    let built = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/data/resnet50_params.tsv"
    );
    load_param_set(if std::path::Path::new(local).exists() {
        local
    } else {
        built
    })
}

fn resnet(gpu: &Arc<CudaContext>, sizes: &[usize], quick: bool) {
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
        let Some(ctx) = Ctx::new(&[0, 0], 0, fusion) else {
            return;
        };
        for (t, pair) in bufs.iter().enumerate() {
            for (r, b) in pair.iter().enumerate() {
                ctx.register(&format!("g{t}"), r, ptr(&stream, b), sizes[t]);
            }
        }
        ctx.set_stream(0, &stream);
        ctx.set_stream(1, &stream);
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
    // The baseline: one ncclAllReduce per tensor, two ranks on GPU 0, one stream each.
    let second = gpu.new_stream().unwrap();
    match raw_nccl::Comms::two_ranks_on_gpu0() {
        Err(why) => println!("  raw NCCL per tensor: skipped: {why}"),
        Ok(comms) => {
            let (gpu_ms, host_us) = time(&stream, iters, || {
                let fork = stream.record_event(None).unwrap();
                second.wait(&fork).unwrap();
                comms.group(|| {
                    for (pair, &n) in bufs.iter().zip(sizes) {
                        for (rank, s) in [&stream, &second].into_iter().enumerate() {
                            let p = ptr(s, &pair[rank]);
                            comms.allreduce_f32_in_place(rank, p, n, s.cu_stream() as _);
                        }
                    }
                });
                let join = second.record_event(None).unwrap();
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
    let Some(ctx) = Ctx::new(&[0, 0], 2, 25 << 20) else {
        return;
    };
    ctx.register("g", 0, ptr(&stream, &a), n);
    ctx.register("g", 1, ptr(&stream, &b), n);
    ctx.set_stream(0, &stream);
    ctx.set_stream(1, &stream);
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
    let Some(ctx) = Ctx::new(&[0], 0, 25 << 20) else {
        return;
    };
    let params: Vec<CudaSlice<f32>> = sizes
        .iter()
        .map(|&n| stream.alloc_zeros(n).unwrap())
        .collect();
    for (t, p) in params.iter().enumerate() {
        ctx.register_as(&format!("p{t}"), PARAM, 0, ptr(&stream, p), sizes[t]);
    }
    ctx.set_stream(0, &stream);
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
    // Probe through dpsync first: it reports a missing driver without panicking.
    if Ctx::new(&[0], 0, 0).is_none() {
        return;
    }
    let gpu = CudaContext::new(0).expect("GPU 0");
    let sizes = resnet_sizes();
    resnet(&gpu, &sizes, quick);
    sum_bandwidth(&gpu, quick);
    bmuf_bandwidth(&gpu, &sizes, quick);
}
