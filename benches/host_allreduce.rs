//! Host-replica benchmarks through the C ABI, each measured side by side with its baseline in
//! the same run (ratios, not absolute times, are the claim). Run: `cargo bench --bench host_allreduce`
//! (`-- --quick` for a short smoke run). Figures go to docs/PERFORMANCE.md.

use std::ffi::{c_void, CString};
use std::hint::black_box;
use std::time::Instant;

use dpsync::*;

#[path = "common/mod.rs"]
mod common;
use common::*;

/// Registers a host f32 gradient.
fn reg(ctx: &Context, name: &str, replica: usize, data: &mut [f32]) {
    register(
        ctx,
        name,
        GRAD,
        replica,
        data.as_mut_ptr() as *mut c_void,
        data.len(),
        F32,
    );
}

/// 4 replicas x 64 MiB f32 allreduce vs one memcpy of the same 256 MiB, with `threads` host
/// threads (None: all); every replica's gradient `offset` floats into its allocation (a
/// tensor inside a flat buffer: on AMD Zen 3/4, memcpy's `rep movsb` into a destination 4
/// bytes off its source's alignment ran at a fraction of its speed, PERFORMANCE.md).
fn allreduce_vs_memcpy(quick: bool, threads: Option<usize>, offset: usize) {
    // Read by the host backend when the context is created; nothing else runs concurrently here.
    match threads {
        Some(n) => std::env::set_var("DPSYNC_HOST_THREADS", n.to_string()),
        None => std::env::remove_var("DPSYNC_HOST_THREADS"),
    }
    let replicas = 4;
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let ctx = Context::host(replicas, Some(25 << 20));
    std::env::remove_var("DPSYNC_HOST_THREADS");
    let mut bufs: Vec<Vec<f32>> = (0..replicas).map(|r| filled(n + offset, r, 0.0)).collect();
    for (r, b) in bufs.iter_mut().enumerate() {
        reg(&ctx, "g", r, &mut b[offset..]);
    }
    let total = n * replicas;
    let src = filled(total, 9, 0.0);
    let mut dst = vec![0f32; total];
    let name = CString::new("g").unwrap();
    let (t_all, t_copy) = side_by_side(
        reps,
        || unsafe { check(dpsync_allreduce(ctx.0, name.as_ptr(), SUM)) },
        || {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        },
    );
    let mib = (total * 4) as f64 / (1 << 20) as f64;
    let threads = threads.map_or("all threads".to_owned(), |n| format!("{n} thread(s)"));
    let at = match offset {
        0 => String::new(),
        k => format!(", {} bytes into their buffers", k * 4),
    };
    println!(
        "allreduce {replicas} x {:.0} MiB f32 ({threads}{at}): {:.2} ms | memcpy {mib:.0} MiB: {:.2} ms | ratio {:.2} (target <= 1.3)",
        mib / replicas as f64,
        ms(t_all),
        ms(t_copy),
        t_all.as_secs_f64() / t_copy.as_secs_f64()
    );
}

/// A real gradient set on 4 replicas: fused and unfused allreduce_grads vs one tensor of the
/// same total size.
fn gradient_set(label: &str, file: &str, quick: bool) {
    let replicas = 4;
    let reps = if quick { 3 } else { 9 };
    let params = load_param_set(file);
    let total: usize = params.iter().map(|(_, n)| n).sum();
    let mut bufs: Vec<Vec<Vec<f32>>> = (0..replicas)
        .map(|r| params.iter().map(|(_, n)| filled(*n, r, 0.0)).collect())
        .collect();
    let mut flat: Vec<Vec<f32>> = (0..replicas).map(|r| filled(total, r, 0.0)).collect();
    let fused = Context::host(replicas, Some(25 << 20));
    let unfused = Context::host(replicas, Some(0));
    let single = Context::host(replicas, Some(25 << 20));
    for (r, tensors) in bufs.iter_mut().enumerate() {
        for ((name, _), data) in params.iter().zip(tensors.iter_mut()) {
            reg(&fused, name, r, data);
            reg(&unfused, name, r, data);
        }
    }
    for (r, b) in flat.iter_mut().enumerate() {
        reg(&single, "all", r, b);
    }
    let name = CString::new("all").unwrap();
    let (t_fused, t_single) = side_by_side(
        reps,
        || unsafe { check(dpsync_allreduce_grads(fused.0, SUM)) },
        || unsafe { check(dpsync_allreduce(single.0, name.as_ptr(), SUM)) },
    );
    let (t_unfused, _) = side_by_side(
        reps,
        || unsafe { check(dpsync_allreduce_grads(unfused.0, SUM)) },
        || {},
    );
    println!(
        "{label} ({} tensors, {:.1} M f32) x {replicas} replicas: fused {:.2} ms | unfused {:.2} ms | \
         one tensor of the same size {:.2} ms | fused/single {:.2} (target <= 1.2), unfused/single {:.2}",
        params.len(),
        total as f64 / 1e6,
        ms(t_fused),
        ms(t_unfused),
        ms(t_single),
        t_fused.as_secs_f64() / t_single.as_secs_f64(),
        t_unfused.as_secs_f64() / t_single.as_secs_f64()
    );
}

/// Host-side cost of one call: allreduce of one f32 on 2 replicas.
fn call_overhead(quick: bool) {
    let calls = if quick { 10_000 } else { 200_000 };
    let ctx = Context::host(2, Some(25 << 20));
    let mut a = [1.0f32];
    let mut b = [2.0f32];
    reg(&ctx, "x", 0, &mut a);
    reg(&ctx, "x", 1, &mut b);
    let name = CString::new("x").unwrap();
    let mut times = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t = Instant::now();
        unsafe { check(dpsync_allreduce(ctx.0, name.as_ptr(), SUM)) };
        times.push(t.elapsed());
    }
    times.sort();
    let at = |q: f64| times[((calls as f64 * q) as usize).min(calls - 1)].as_secs_f64() * 1e6;
    println!(
        "call overhead, allreduce of 1 f32 on 2 replicas ({calls} calls): median {:.3} us, p90 {:.3} us, p99 {:.3} us (target median < 2 us)",
        at(0.5),
        at(0.9),
        at(0.99)
    );
}

/// Overlap bookkeeping: a step that declares each of `tensors` small gradients on 2 replicas
/// with `dpsync_grad_ready` (with `fusion_bytes = 0` a bucket completes at every tensor) against
/// the same step without the calls. The cost per call should not grow with the tensor count.
fn grad_ready_step(quick: bool) {
    let counts: &[usize] = if quick { &[1000] } else { &[1000, 16_000] };
    for &tensors in counts {
        for fusion in [25 << 20, 0] {
            let ctx = Context::host(2, Some(fusion));
            let mut bufs: Vec<Vec<f32>> = (0..2).map(|r| filled(4 * tensors, r, 0.0)).collect();
            let names: Vec<CString> = (0..tensors)
                .map(|t| CString::new(format!("g{t}")).unwrap())
                .collect();
            for (r, buf) in bufs.iter_mut().enumerate() {
                for (t, chunk) in buf.chunks_mut(4).enumerate() {
                    reg(&ctx, &format!("g{t}"), r, chunk);
                }
            }
            // The first allreduce_grads fixes the op that early buckets use.
            unsafe { check(dpsync_allreduce_grads(ctx.0, SUM)) };
            let (with, without) = side_by_side(
                if quick { 3 } else { 9 },
                || unsafe {
                    for name in &names {
                        for r in 0..2 {
                            check(dpsync_grad_ready(ctx.0, name.as_ptr(), r));
                        }
                    }
                    check(dpsync_allreduce_grads(ctx.0, SUM));
                },
                || unsafe { check(dpsync_allreduce_grads(ctx.0, SUM)) },
            );
            println!(
                "grad_ready step, {tensors} GRADs x 2 replicas, fusion_bytes {fusion}: with the calls \
                 {:.2} ms | without {:.2} ms | {:.3} us per grad_ready call",
                ms(with),
                ms(without),
                (with.as_secs_f64() - without.as_secs_f64()) * 1e6 / (2 * tensors) as f64
            );
        }
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    println!(
        "dpsync {} host benchmarks, {} hardware threads{}",
        env!("CARGO_PKG_VERSION"),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if quick { " (quick)" } else { "" }
    );
    allreduce_vs_memcpy(quick, None, 0);
    allreduce_vs_memcpy(quick, Some(1), 0);
    allreduce_vs_memcpy(quick, Some(1), 1);
    gradient_set("ResNet-50", "resnet50_params.tsv", quick);
    if !quick {
        gradient_set("BERT-base", "bert_base_params.tsv", quick);
    }
    call_overhead(quick);
    grad_ready_step(quick);
}
