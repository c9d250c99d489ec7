//! BMUF on host replicas, each figure measured side by side with its baseline in the same run
//! (ratios, not absolute times, are the claim). Run: `cargo bench --bench bmuf` (`-- --quick`
//! for a short smoke run). Figures go to docs/PERFORMANCE.md.
//!
//! 1. The update alone — what `dpsync_bmuf_step` does after the averaging collective — on the
//!    ResNet-50 parameter set (25.6 M f32) on 4 replicas: the host backend's `bmuf_update`
//!    primitive over the buckets the library makes (through `dpsync::bench`, the benches' door), against one memcpy of the bytes the update
//!    touches (params, W and D of every replica: 12 bytes per element per replica).
//! 2. The whole `dpsync_bmuf_step` through the C ABI against `dpsync_average(PARAM)`, the
//!    averaging collective it starts with.

use std::ffi::c_void;
use std::hint::black_box;

use dpsync::bench::HostBmufUpdate;
use dpsync::*;

#[path = "common/mod.rs"]
mod common;
use common::*;

const REPLICAS: usize = 4;
const FUSION_BYTES: usize = 25 << 20;

/// One replica's params, tensor by tensor, as a framework allocates them.
fn replica_params(params: &[(String, usize)], replica: usize) -> Vec<Vec<f32>> {
    params
        .iter()
        .map(|(_, n)| filled(*n, replica, -0.5))
        .collect()
}

/// Part 1: the update primitive over the library's buckets vs a memcpy of the touched bytes.
fn update_vs_memcpy(params: &[(String, usize)], reps: usize, threads: Option<usize>) {
    // Read by HostBackend::new; nothing else runs concurrently here.
    match threads {
        Some(n) => std::env::set_var("DPSYNC_HOST_THREADS", n.to_string()),
        None => std::env::remove_var("DPSYNC_HOST_THREADS"),
    }
    let mut replicas: Vec<Vec<Vec<f32>>> =
        (0..REPLICAS).map(|r| replica_params(params, r)).collect();
    // The buckets dpsync_bmuf_init makes (PARAMs in registration order, 25 MiB, per dtype),
    // their state loaded from these params.
    // SAFETY: `replicas` outlives `update` and is not resized.
    let update = unsafe { HostBmufUpdate::new(&mut replicas, FUSION_BYTES) };
    std::env::remove_var("DPSYNC_HOST_THREADS");
    // Local training moved the params: D becomes non-zero (and decays by mu each rep, far from
    // subnormal over the few reps run here).
    for rep in replicas.iter_mut() {
        for t in rep.iter_mut() {
            t.iter_mut().for_each(|x| *x += 0.01);
        }
    }
    let state_size = HostBmufUpdate::state_size();
    let elements: usize = params.iter().map(|(_, n)| n).sum();
    let touched = elements * REPLICAS * (4 + 2 * state_size);
    let src = vec![1u8; touched];
    let mut dst = vec![0u8; touched];
    let (t_update, t_copy) = side_by_side(
        reps,
        || update.update(1.0, 0.75, true),
        || {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        },
    );
    let mib = touched as f64 / (1 << 20) as f64;
    let threads = threads.map_or("all threads".to_owned(), |n| format!("{n} thread(s)"));
    println!(
        "bmuf update only, ResNet-50 ({} tensors, {:.1} M f32, {} buckets) x {REPLICAS} replicas, Nesterov ({threads}): \
         {:.2} ms | memcpy of the {mib:.0} MiB it touches: {:.2} ms | ratio {:.2} (target <= 1.5)",
        params.len(),
        elements as f64 / 1e6,
        update.buckets(),
        ms(t_update),
        ms(t_copy),
        t_update.as_secs_f64() / t_copy.as_secs_f64()
    );
}

/// Part 2: the whole step through the C ABI vs the averaging collective alone.
fn step_vs_collective(params: &[(String, usize)], reps: usize) {
    let mut replicas: Vec<Vec<Vec<f32>>> =
        (0..REPLICAS).map(|r| replica_params(params, r)).collect();
    let ctx = Context::host(REPLICAS, Some(FUSION_BYTES));
    for (r, tensors) in replicas.iter_mut().enumerate() {
        for ((name, _), data) in params.iter().zip(tensors.iter_mut()) {
            let ptr = data.as_mut_ptr() as *mut c_void;
            register(&ctx, name, PARAM, r, ptr, data.len(), F32);
        }
    }
    unsafe { check(dpsync_bmuf_init(ctx.0, 1.0, -1.0, true)) };
    let (t_step, t_avg) = side_by_side(
        reps,
        || unsafe { check(dpsync_bmuf_step(ctx.0)) },
        || unsafe { check(dpsync_average(ctx.0, PARAM)) },
    );
    println!(
        "dpsync_bmuf_step, ResNet-50 x {REPLICAS} replicas: {:.2} ms | its averaging collective \
         (dpsync_average PARAM): {:.2} ms | difference (the update) {:.2} ms",
        ms(t_step),
        ms(t_avg),
        ms(t_step) - ms(t_avg)
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 3 } else { 9 };
    println!(
        "dpsync {} host BMUF benchmarks, {} hardware threads{}",
        env!("CARGO_PKG_VERSION"),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if quick { " (quick)" } else { "" }
    );
    let params = load_param_set("resnet50_params.tsv");
    update_vs_memcpy(&params, reps, None);
    update_vs_memcpy(&params, reps, Some(1));
    step_vs_collective(&params, reps);
}
