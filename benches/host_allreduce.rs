//! Host-replica benchmarks through the C ABI, each measured side by side with its baseline in
//! the same run (ratios, not absolute times, are the claim). Run: `cargo bench --bench host_allreduce`
//! (`-- --quick` for a short smoke run). Figures go to docs/PERFORMANCE.md.

use std::ffi::{c_void, CString};
use std::hint::black_box;
use std::time::{Duration, Instant};

use dpsync::*;

const SUM: u32 = dpsync_reduce_op::DPSYNC_REDUCE_SUM as u32;
const GRAD: u32 = dpsync_role::DPSYNC_ROLE_GRAD as u32;
const F32: u32 = dpsync_dtype::DPSYNC_DTYPE_F32 as u32;

fn check(status: dpsync_status) {
    if status != dpsync_status::DPSYNC_STATUS_OK {
        let msg = unsafe { std::ffi::CStr::from_ptr(dpsync_last_error()) };
        panic!("{status:?}: {}", msg.to_string_lossy());
    }
}

struct Ctx(*mut dpsync_context);

impl Ctx {
    fn new(replicas: usize, fusion_bytes: usize) -> Ctx {
        unsafe {
            let mut o = std::ptr::null_mut();
            check(dpsync_options_new(&mut o));
            check(dpsync_options_set_host_replicas(o, replicas));
            check(dpsync_options_set_fusion_bytes(o, fusion_bytes));
            let mut c = std::ptr::null_mut();
            check(dpsync_context_create(o, &mut c));
            dpsync_options_free(o);
            Ctx(c)
        }
    }

    fn register(&self, name: &str, replica: usize, data: &mut [f32]) {
        let name = CString::new(name).unwrap();
        let ptr = data.as_mut_ptr() as *mut c_void;
        unsafe {
            check(dpsync_register(
                self.0,
                name.as_ptr(),
                GRAD,
                replica,
                ptr,
                data.len(),
                F32,
            ))
        };
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        unsafe { dpsync_context_destroy(self.0) };
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Runs `a` and `b` alternately `reps` times; returns their median times.
fn side_by_side(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (Duration, Duration) {
    a();
    b();
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        a();
        ta.push(t.elapsed());
        let t = Instant::now();
        b();
        tb.push(t.elapsed());
    }
    (median(ta), median(tb))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn filled(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + seed * 13) % 1000) as f32 * 1e-3)
        .collect()
}

/// 4 replicas x 64 MiB f32 allreduce vs one memcpy of the same 256 MiB, with `threads` host
/// threads (None: all).
fn allreduce_vs_memcpy(quick: bool, threads: Option<usize>) {
    // Read by the host backend when the context is created; nothing else runs concurrently here.
    match threads {
        Some(n) => std::env::set_var("DPSYNC_HOST_THREADS", n.to_string()),
        None => std::env::remove_var("DPSYNC_HOST_THREADS"),
    }
    let replicas = 4;
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let ctx = Ctx::new(replicas, 25 << 20);
    std::env::remove_var("DPSYNC_HOST_THREADS");
    let mut bufs: Vec<Vec<f32>> = (0..replicas).map(|r| filled(n, r)).collect();
    for (r, b) in bufs.iter_mut().enumerate() {
        ctx.register("g", r, b);
    }
    let total = n * replicas;
    let src = filled(total, 9);
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
    println!(
        "allreduce {replicas} x {:.0} MiB f32 ({threads}): {:.2} ms | memcpy {mib:.0} MiB: {:.2} ms | ratio {:.2} (target <= 1.3)",
        mib / replicas as f64,
        ms(t_all),
        ms(t_copy),
        t_all.as_secs_f64() / t_copy.as_secs_f64()
    );
}

fn load_param_set(path: &str) -> Vec<(String, usize)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let cols: Vec<&str> = l.split('\t').collect();
            (
                cols[0].to_owned(),
                cols[2].trim().parse().expect("element count"),
            )
        })
        .collect()
}

/// A real gradient set on 4 replicas: fused and unfused allreduce_grads vs one tensor of the
/// same total size.
fn gradient_set(label: &str, path: &str, quick: bool) {
    let replicas = 4;
    let reps = if quick { 3 } else { 9 };
    let params = load_param_set(path);
    let total: usize = params.iter().map(|(_, n)| n).sum();
    let mut bufs: Vec<Vec<Vec<f32>>> = (0..replicas)
        .map(|r| params.iter().map(|(_, n)| filled(*n, r)).collect())
        .collect();
    let mut flat: Vec<Vec<f32>> = (0..replicas).map(|r| filled(total, r)).collect();
    let fused = Ctx::new(replicas, 25 << 20);
    let unfused = Ctx::new(replicas, 0);
    let single = Ctx::new(replicas, 25 << 20);
    for (r, tensors) in bufs.iter_mut().enumerate() {
        for ((name, _), data) in params.iter().zip(tensors.iter_mut()) {
            fused.register(name, r, data);
            unfused.register(name, r, data);
        }
    }
    for (r, b) in flat.iter_mut().enumerate() {
        single.register("all", r, b);
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
    let ctx = Ctx::new(2, 25 << 20);
    let mut a = [1.0f32];
    let mut b = [2.0f32];
    ctx.register("x", 0, &mut a);
    ctx.register("x", 1, &mut b);
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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/data");
    println!(
        "dpsync {} host benchmarks, {} hardware threads{}",
        env!("CARGO_PKG_VERSION"),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if quick { " (quick)" } else { "" }
    );
    allreduce_vs_memcpy(quick, None);
    allreduce_vs_memcpy(quick, Some(1));
    gradient_set("ResNet-50", &format!("{data}/resnet50_params.tsv"), quick);
    if !quick {
        gradient_set("BERT-base", &format!("{data}/bert_base_params.tsv"), quick);
    }
    call_overhead(quick);
}
