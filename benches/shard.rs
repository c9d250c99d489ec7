//! Shards (ZeRO-1) on host replicas, side by side with `dpsync_allreduce_grads` in the same run
//! (ratios, not absolute times, are the claim). Run: `cargo bench --bench shard` (`-- --quick`
//! for a short smoke run). Figures go to docs/PERFORMANCE.md ("Shards").
//!
//! 4 replicas × 64 MiB of f32 gradients (one tensor, and its parameter): `reduce_scatter_grads`
//! against `allreduce_grads`, then `reduce_scatter_grads` + `allgather(PARAM)` against
//! `allreduce_grads`; then on CUDA replicas (4 on GPU 0) where a GPU is found.

use std::ffi::c_void;

use dpsync::*;

#[path = "common/mod.rs"]
mod common;
use common::*;

const REPLICAS: usize = 4;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (n, reps) = if quick { (1 << 20, 3) } else { (16 << 20, 9) };
    println!(
        "dpsync {} shard benchmark: {REPLICAS} host replicas x {} MiB f32, {} hardware threads{}",
        env!("CARGO_PKG_VERSION"),
        (n * 4) >> 20,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if quick { " (quick)" } else { "" }
    );
    let ctx = Context::host(REPLICAS, None);
    let mut grads: Vec<Vec<f32>> = (0..REPLICAS).map(|r| filled(n, r, -0.5)).collect();
    let mut params: Vec<Vec<f32>> = (0..REPLICAS).map(|r| filled(n, r, 0.0)).collect();
    for r in 0..REPLICAS {
        let g = grads[r].as_mut_ptr() as *mut c_void;
        let p = params[r].as_mut_ptr() as *mut c_void;
        register(&ctx, "w_grad", GRAD, r, g, n, F32);
        register(&ctx, "w", PARAM, r, p, n, F32);
    }
    // SAFETY (all three): a live context over registered memory.
    let allreduce = || check(unsafe { dpsync_allreduce_grads(ctx.0, SUM) });
    let scatter = || check(unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) });
    let gather = || check(unsafe { dpsync_allgather(ctx.0, PARAM) });
    let (t_rs, t_ar) = side_by_side(reps, scatter, allreduce);
    println!(
        "reduce_scatter_grads {:8.2} ms   allreduce_grads {:8.2} ms   ratio {:.2} (target <= 0.65)",
        ms(t_rs),
        ms(t_ar),
        ms(t_rs) / ms(t_ar)
    );
    let (t_both, t_ar) = side_by_side(
        reps,
        || {
            scatter();
            gather();
        },
        allreduce,
    );
    println!(
        "reduce_scatter + allgather {:8.2} ms   allreduce_grads {:8.2} ms   ratio {:.2} (target <= 1.1)",
        ms(t_both),
        ms(t_ar),
        ms(t_both) / ms(t_ar)
    );
    drop(ctx);
    drop((grads.pop(), params.pop()));
    cuda(n, reps);
}

/// The same on CUDA replicas, 4 on GPU 0 (target: reduce-scatter + allgather within 10 % of
/// the allreduce), each step waited for with `dpsync_synchronize`.
fn cuda(n: usize, reps: usize) {
    use cudarc::driver::{CudaContext, DevicePtr};
    let Some(ctx) = cuda_context(|o| o.set_cuda_replicas(&[0; REPLICAS])) else {
        println!("cuda: skipped: no CUDA device");
        return;
    };
    let stream = CudaContext::new(0).expect("GPU 0").default_stream();
    let bufs: Vec<_> = (0..2 * REPLICAS)
        .map(|k| stream.clone_htod(&filled(n, k, -0.5)).unwrap())
        .collect();
    for (k, buf) in bufs.iter().enumerate() {
        let (ptr, _sync) = buf.device_ptr(&stream);
        let (name, role) = if k < REPLICAS {
            ("w_grad", GRAD)
        } else {
            ("w", PARAM)
        };
        register(&ctx, name, role, k % REPLICAS, ptr as *mut c_void, n, F32);
    }
    // SAFETY (all): a live context over registered memory. Each step is waited for.
    let waited = |calls: &dyn Fn()| {
        calls();
        check(unsafe { dpsync_synchronize(ctx.0) });
    };
    let (allreduce_grads, reduce_scatter_grads, allgather_param) = (
        || check(unsafe { dpsync_allreduce_grads(ctx.0, SUM) }),
        || check(unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) }),
        || check(unsafe { dpsync_allgather(ctx.0, PARAM) }),
    );
    let allreduce = || waited(&allreduce_grads);
    let both = || {
        waited(&|| {
            reduce_scatter_grads();
            allgather_param();
        })
    };
    let (t_both, t_ar) = side_by_side(reps, both, allreduce);
    println!(
        "cuda, {REPLICAS} replicas on GPU 0: reduce_scatter + allgather {:8.2} ms   allreduce_grads {:8.2} ms   ratio {:.2} (target <= 1.1)",
        ms(t_both),
        ms(t_ar),
        ms(t_both) / ms(t_ar)
    );
    // Each half alone, to tell which one the pair's cost comes from.
    let scatter = || waited(&reduce_scatter_grads);
    let gather = || waited(&allgather_param);
    let (t_rs, t_ag) = side_by_side(reps, scatter, gather);
    println!(
        "cuda, {REPLICAS} replicas on GPU 0: reduce_scatter_grads alone {:8.2} ms   allgather(PARAM) alone {:8.2} ms",
        ms(t_rs),
        ms(t_ag)
    );
}
