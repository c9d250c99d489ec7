//! CUDA-replica benchmarks through the C ABI, each beside its baseline in the same run:
//! - `resnet`: the ResNet-50 gradient set (161 tensors) on replicas [0,0]: `allreduce_grads`
//!   fused, the same with fusion off, the same reduction as 161 `dpsync_allreduce` calls, and
//!   as one raw `ncclAllReduce` per tensor on a two-rank communicator over the one GPU (only
//!   where NCCL accepts two ranks per GPU: NCCL >= 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1`;
//!   otherwise that target says NOT MEASURED and why); GPU time per step and the host-side cost
//!   of issuing a step;
//! - `sum`: the sum kernel (PEER_COPY on [0,0]: one table walk reads both replicas and writes
//!   both) against a device-to-device copy of the same bytes;
//! - `bmuf`: the fused BMUF update on the ResNet-50 parameters (one replica, so no averaging
//!   runs) against a device-to-device copy of the bytes it reads and writes.
//!
//! Method (the device tool's METHOD.md): random data, never zeros; every variant warmed up for
//! at least 200 ms (the GPU idles at a low clock); then rounds that alternate the variant and
//! its baseline, each a bracket of calls between two timed events; medians with min–max over
//! the rounds; ratios from medians. AVG rather than SUM, so that repeated steps keep the values
//! finite (the same memory traffic: the division is in the same pass, in NCCL as in dpsync).
//! Each section ends with `TARGET` lines (figure, target, PASS / FAIL / NOT MEASURED), which
//! scripts/gpu-check.sh collects.
//!
//! Sections run in one process by default; name them to run some (`cuda_allreduce sum bmuf`).
//! Without a GPU it prints "skipped: no CUDA device". Run: `cargo bench --bench cuda_allreduce`
//! (`-- --quick` for a short run); scripts/gpu-check.sh runs it on the GPU machine.

use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use dpsync::*;

#[path = "common/mod.rs"]
mod common;
use common::{check, cuda_context, filled, median, raw_nccl, register, Context, F32, GRAD, PARAM};

const AVG: u32 = dpsync_reduce_op::DPSYNC_REDUCE_AVG as u32;
/// One GPU: the reduction is the local walk whatever the transport; PEER_COPY loads no NCCL.
const PEER_COPY: u32 = dpsync_transport::DPSYNC_TRANSPORT_PEER_COPY as u32;

/// CUDA replicas on `ordinals` over `transport`; `None` without a GPU.
fn cuda_ctx(ordinals: &[i32], transport: u32, fusion_bytes: usize) -> Option<Context> {
    cuda_context(|o| {
        o.set_cuda_replicas(ordinals);
        o.set_transport(transport);
        o.set_fusion_bytes(fusion_bytes);
    })
}

/// Registers `n` f32 of device memory as `role`.
fn reg(ctx: &Context, name: &str, role: u32, replica: usize, ptr: u64, n: usize) {
    register(ctx, name, role, replica, ptr as *mut c_void, n, F32);
}

fn set_stream(ctx: &Context, replica: usize, stream: &CudaStream) {
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

/// `n` f32 of device memory holding deterministic non-zero values.
fn random(stream: &Arc<CudaStream>, n: usize, seed: usize) -> CudaSlice<f32> {
    stream.clone_htod(&filled(n, seed, 0.5)).unwrap()
}

/// How long to measure.
#[derive(Clone, Copy)]
struct Plan {
    /// Calls per timed bracket.
    iters: usize,
    /// Brackets per variant, alternating with the others.
    rounds: usize,
    warm_up: Duration,
}

impl Plan {
    fn new(quick: bool, iters: usize) -> Plan {
        if quick {
            Plan {
                iters: 2,
                rounds: 2,
                warm_up: Duration::ZERO,
            }
        } else {
            Plan {
                iters,
                rounds: 7,
                warm_up: Duration::from_millis(200),
            }
        }
    }
}

/// One variant's figures: GPU ms per call for each round, host µs of each call.
struct Timing {
    gpu_ms: Vec<f64>,
    host_us: Vec<f64>,
}

/// Sorted copy.
fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

impl Timing {
    fn gpu(&self) -> f64 {
        median(self.gpu_ms.clone())
    }

    /// "median ms (min–max)".
    fn gpu_text(&self) -> String {
        let s = sorted(&self.gpu_ms);
        format!("{:8.3} ms ({:.3}–{:.3})", self.gpu(), s[0], s[s.len() - 1])
    }

    fn host_median(&self) -> f64 {
        median(self.host_us.clone())
    }

    fn host_p90(&self) -> f64 {
        let s = sorted(&self.host_us);
        s[(s.len() * 9 / 10).min(s.len() - 1)]
    }
}

/// Times `variants` on `stream`: each warmed up, then `plan.rounds` rounds in which every
/// variant in turn runs a bracket of `plan.iters` calls between two timed events.
fn measure(stream: &Arc<CudaStream>, plan: Plan, variants: &mut [&mut dyn FnMut()]) -> Vec<Timing> {
    for f in variants.iter_mut() {
        let start = Instant::now();
        let mut calls = 0;
        while calls < 20.min(plan.iters.max(1)) || start.elapsed() < plan.warm_up {
            f();
            calls += 1;
            if calls % 10 == 0 {
                stream.synchronize().unwrap();
            }
        }
        stream.synchronize().unwrap();
    }
    // Timing needs events created without CU_EVENT_DISABLE_TIMING (cudarc's default).
    let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut out: Vec<Timing> = (0..variants.len())
        .map(|_| Timing {
            gpu_ms: Vec::new(),
            host_us: Vec::new(),
        })
        .collect();
    for _ in 0..plan.rounds {
        for (f, t) in variants.iter_mut().zip(&mut out) {
            let start = stream.record_event(timed).unwrap();
            for _ in 0..plan.iters {
                let h = Instant::now();
                f();
                t.host_us.push(h.elapsed().as_secs_f64() * 1e6);
            }
            let end = stream.record_event(timed).unwrap();
            end.synchronize().unwrap();
            t.gpu_ms
                .push(start.elapsed_ms(&end).unwrap() as f64 / plan.iters as f64);
        }
    }
    out
}

/// A `TARGET` line: what was measured against what, and the verdict.
fn target(what: &str, goal: &str, measured: String, pass: bool) {
    let verdict = if pass { "PASS" } else { "FAIL" };
    println!("TARGET {what} {goal}: {measured} -> {verdict}");
}

/// `what`'s bandwidth as a fraction of a copy of the same bytes (from their times), at least
/// `goal`.
fn bandwidth_target(what: &str, goal: f64, copy_ms: f64, kernel_ms: f64) {
    let ratio = copy_ms / kernel_ms;
    target(
        &format!("{what} bandwidth / D2D copy"),
        &format!(">= {goal}"),
        format!("{ratio:.2}"),
        ratio >= goal,
    );
}

fn not_measured(what: &str, goal: &str, why: &str) {
    println!("TARGET {what} {goal}: NOT MEASURED ({why})");
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
    let bufs: Vec<[CudaSlice<f32>; 2]> = (sizes.iter().enumerate())
        .map(|(t, &n)| [random(&stream, n, 2 * t), random(&stream, n, 2 * t + 1)])
        .collect();
    stream.synchronize().unwrap();
    let total: usize = sizes.iter().sum();
    println!(
        "ResNet-50 gradients: {} tensors, {:.1} M f32, replicas [0,0], AVG",
        sizes.len(),
        total as f64 / 1e6
    );
    let make = |fusion: usize| {
        let ctx = cuda_ctx(&[0, 0], PEER_COPY, fusion)?;
        for (t, pair) in bufs.iter().enumerate() {
            for (r, b) in pair.iter().enumerate() {
                reg(&ctx, &format!("g{t}"), GRAD, r, ptr(&stream, b), sizes[t]);
            }
        }
        set_stream(&ctx, 0, &stream);
        set_stream(&ctx, 1, &stream);
        Some(ctx)
    };
    let (Some(fused), Some(off)) = (make(25 << 20), make(0)) else {
        return;
    };
    let names: Vec<CString> = (0..sizes.len())
        .map(|t| CString::new(format!("g{t}")).unwrap())
        .collect();
    let plan = Plan::new(quick, 50);
    let mut fused_step = || check(unsafe { dpsync_allreduce_grads(fused.0, AVG) });
    let mut off_step = || check(unsafe { dpsync_allreduce_grads(off.0, AVG) });
    let mut each_step = || {
        for name in &names {
            check(unsafe { dpsync_allreduce(fused.0, name.as_ptr(), AVG) });
        }
    };
    // The baseline a framework would write without dpsync: one ncclAllReduce per tensor, two
    // ranks on GPU 0, one stream each, all in one group.
    let nccl = raw_nccl::Comms::two_ranks_on_gpu0();
    let version = raw_nccl::version().unwrap_or_else(|e| e);
    println!("  NCCL for the raw baseline: {version}");
    let second = gpu.new_stream().unwrap();
    let ptrs: Vec<[u64; 2]> = bufs
        .iter()
        .map(|pair| [ptr(&stream, &pair[0]), ptr(&stream, &pair[1])])
        .collect();
    let streams = [stream.cu_stream(), second.cu_stream()];
    let fork = gpu.new_event(None).unwrap();
    let join = gpu.new_event(None).unwrap();
    let raw_step = |comms: &raw_nccl::Comms| {
        fork.record(&stream).unwrap();
        second.wait(&fork).unwrap();
        comms.group(|| {
            for (p, &n) in ptrs.iter().zip(sizes) {
                for rank in 0..2 {
                    comms.allreduce_f32_avg_in_place(rank, p[rank], n, streams[rank] as _);
                }
            }
        });
        join.record(&second).unwrap();
        stream.wait(&join).unwrap();
    };
    let mut labels = vec![
        "fused (25 MiB buckets)",
        "fusion off",
        "161 x dpsync_allreduce",
    ];
    let timings = match (&nccl, issue_only) {
        (Ok(comms), false) => {
            labels.push("raw NCCL, per tensor");
            let mut raw = || raw_step(comms);
            measure(
                &stream,
                plan,
                &mut [&mut fused_step, &mut off_step, &mut each_step, &mut raw],
            )
        }
        _ => measure(
            &stream,
            plan,
            &mut [&mut fused_step, &mut off_step, &mut each_step],
        ),
    };
    for (label, t) in labels.iter().zip(&timings) {
        println!(
            "  {label:<24} GPU {} per step   issue (host) median {:7.1} µs, p90 {:7.1} µs per step",
            t.gpu_text(),
            t.host_median(),
            t.host_p90()
        );
    }
    println!(
        "  (on one GPU, fusion off runs the same single walk as fused: their difference is \
         run-to-run spread)"
    );
    let fused_t = &timings[0];
    println!(
        "  fused / 161 dpsync_allreduce calls, GPU time: {:.2} (informative: what fusion saves)",
        fused_t.gpu() / timings[2].gpu()
    );
    target(
        "issue cost of allreduce_grads (fused, ResNet-50, [0,0])",
        "< 10 µs",
        format!(
            "median {:.1} µs, p90 {:.1} µs",
            fused_t.host_median(),
            fused_t.host_p90()
        ),
        fused_t.host_median() < 10.0,
    );
    let what = "dpsync fused / raw NCCL per tensor, GPU time";
    match (&nccl, timings.get(3)) {
        (Ok(_), Some(raw)) => {
            let ratio = fused_t.gpu() / raw.gpu();
            target(what, "<= 1", format!("{ratio:.2}"), ratio <= 1.0);
        }
        (Err(why), _) => not_measured(what, "<= 1", why),
        _ => not_measured(what, "<= 1", "--issue run"),
    }
}

fn sum_bandwidth(gpu: &Arc<CudaContext>, quick: bool) {
    let n: usize = if quick { 16 << 20 } else { 64 << 20 }; // f32 elements per replica
    let stream = gpu.new_stream().unwrap();
    let a = random(&stream, n, 1);
    let b = random(&stream, n, 2);
    // The copy moves what the sum moves: 2n read, 2n written.
    let src = random(&stream, 2 * n, 3);
    let mut dst: CudaSlice<f32> = stream.alloc_zeros(2 * n).unwrap();
    stream.synchronize().unwrap();
    let Some(ctx) = cuda_ctx(&[0, 0], PEER_COPY, 25 << 20) else {
        return;
    };
    reg(&ctx, "g", GRAD, 0, ptr(&stream, &a), n);
    reg(&ctx, "g", GRAD, 1, ptr(&stream, &b), n);
    set_stream(&ctx, 0, &stream);
    set_stream(&ctx, 1, &stream);
    let name = CString::new("g").unwrap();
    let mut sum = || check(unsafe { dpsync_allreduce(ctx.0, name.as_ptr(), AVG) });
    let mut copy = || {
        let (s, _a) = src.device_ptr(&stream);
        let (d, _b) = dst.device_ptr_mut(&stream);
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(d, s, 2 * n * 4, stream.cu_stream()).unwrap()
        };
    };
    let t = measure(&stream, Plan::new(quick, 20), &mut [&mut sum, &mut copy]);
    // Bytes read plus bytes written, the same for both.
    let moved = (4 * n * 4) as f64;
    let gbps = |ms: f64| moved / (ms * 1e-3) / 1e9;
    let (sum_ms, copy_ms) = (t[0].gpu(), t[1].gpu());
    println!(
        "Sum kernel (AVG), 2 x {} MiB f32 on one GPU: {} = {:.0} GB/s moved; D2D copy of the \
         same bytes {} = {:.0} GB/s",
        (n * 4) >> 20,
        t[0].gpu_text(),
        gbps(sum_ms),
        t[1].gpu_text(),
        gbps(copy_ms)
    );
    // On one GPU this is the local walk that sums replicas sharing a GPU (and packs fusion
    // buffers); the cross-GPU `add` kernel reads a peer's memory and needs two GPUs.
    bandwidth_target(
        "PEER_COPY sum kernel (one GPU: the local sum of two replicas)",
        0.8,
        copy_ms,
        sum_ms,
    );
}

/// The fused BMUF update (bmuf_step on one replica: the averaging is a no-op there) against a
/// device-to-device copy of the bytes the update reads and writes (params, W and D).
fn bmuf_bandwidth(gpu: &Arc<CudaContext>, sizes: &[usize], quick: bool) {
    let stream = gpu.new_stream().unwrap();
    let Some(ctx) = cuda_ctx(&[0], PEER_COPY, 25 << 20) else {
        return;
    };
    let params: Vec<CudaSlice<f32>> = (sizes.iter().enumerate())
        .map(|(t, &n)| random(&stream, n, t))
        .collect();
    let total: usize = sizes.iter().sum();
    // The update reads and writes 3 x total f32 (params, W, D); copy that many.
    let src = random(&stream, 3 * total, 7);
    let mut dst: CudaSlice<f32> = stream.alloc_zeros(3 * total).unwrap();
    stream.synchronize().unwrap();
    for (t, p) in params.iter().enumerate() {
        reg(&ctx, &format!("p{t}"), PARAM, 0, ptr(&stream, p), sizes[t]);
    }
    set_stream(&ctx, 0, &stream);
    check(unsafe { dpsync_bmuf_init(ctx.0, 1.0, 0.9, true) });
    let mut update = || check(unsafe { dpsync_bmuf_step(ctx.0) });
    let mut copy = || {
        let (s, _a) = src.device_ptr(&stream);
        let (d, _b) = dst.device_ptr_mut(&stream);
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(d, s, 3 * total * 4, stream.cu_stream())
                .unwrap()
        };
    };
    let t = measure(&stream, Plan::new(quick, 50), &mut [&mut update, &mut copy]);
    let moved = 2.0 * (3 * total * 4) as f64;
    let gbps = |ms: f64| moved / (ms * 1e-3) / 1e9;
    let (update_ms, copy_ms) = (t[0].gpu(), t[1].gpu());
    println!(
        "BMUF update (Nesterov), ResNet-50 params {:.1} M f32 on [0]: {} = {:.0} GB/s (issue \
         median {:.1} µs); D2D copy of the same bytes {} = {:.0} GB/s",
        total as f64 / 1e6,
        t[0].gpu_text(),
        gbps(update_ms),
        t[0].host_median(),
        t[1].gpu_text(),
        gbps(copy_ms)
    );
    bandwidth_target("fused BMUF update", 0.85, copy_ms, update_ms);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    // --issue: only the dpsync ResNet-50 cases (issue cost), e.g. on the fake driver with
    // FAKE_CUDA_NOEXEC=1 FAKE_CUDA_STATS=1 (docs/PERFORMANCE.md, "issue cost anatomy").
    let issue_only = args.iter().any(|a| a == "--issue");
    let named: Vec<&str> = (args.iter().map(String::as_str))
        .filter(|a| ["resnet", "sum", "bmuf"].contains(a))
        .collect();
    let run = |section: &str| named.is_empty() || named.contains(&section);
    // Probe through dpsync first: it reports a missing driver without panicking.
    if cuda_ctx(&[0], PEER_COPY, 0).is_none() {
        return;
    }
    let gpu = CudaContext::new(0).expect("GPU 0");
    let sizes = resnet_sizes();
    if run("resnet") {
        resnet(&gpu, &sizes, quick, issue_only);
    }
    if issue_only {
        return;
    }
    if run("sum") {
        sum_bandwidth(&gpu, quick);
    }
    if run("bmuf") {
        bmuf_bandwidth(&gpu, &sizes, quick);
    }
}
