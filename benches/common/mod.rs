//! What the benchmarks share: the tests' context handle over the C ABI (tests/common/context.rs),
//! status checks, side-by-side timing and the parameter-set files. Each benchmark includes this
//! module by path.
#![allow(dead_code)]

#[path = "../../tests/common/context.rs"]
pub mod context;
pub mod raw_nccl;

pub use context::{Context, Options};

use std::ffi::{c_void, CStr};
use std::time::{Duration, Instant};

use dpsync::*;

pub const SUM: u32 = dpsync_reduce_op::DPSYNC_REDUCE_SUM as u32;
pub const GRAD: u32 = dpsync_role::DPSYNC_ROLE_GRAD as u32;
pub const PARAM: u32 = dpsync_role::DPSYNC_ROLE_PARAM as u32;
pub const F32: u32 = dpsync_dtype::DPSYNC_DTYPE_F32 as u32;
pub const BF16: u32 = dpsync_dtype::DPSYNC_DTYPE_BF16 as u32;
pub const I64: u32 = dpsync_dtype::DPSYNC_DTYPE_I64 as u32;

/// Panics with dpsync's message unless `status` is OK.
pub fn check(status: dpsync_status) {
    if status != dpsync_status::DPSYNC_STATUS_OK {
        // SAFETY: dpsync_last_error returns a NUL-terminated thread-local string.
        let msg = unsafe { CStr::from_ptr(dpsync_last_error()) };
        panic!("{status:?}: {}", msg.to_string_lossy());
    }
}

/// A context over CUDA replicas from options that `configure` sets; `None` (after printing
/// "skipped: ...") when dpsync answers UNAVAILABLE, as it does without a GPU.
pub fn cuda_context(configure: impl FnOnce(&Options)) -> Option<Context> {
    let o = Options::new();
    configure(&o);
    let ctx = Context::new_if_available(&o);
    if ctx.is_none() {
        let msg = context::last_error();
        // The GPU machine's run (scripts/gpu-check.sh) must not skip silently.
        if std::env::var("DPSYNC_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("DPSYNC_REQUIRE_GPU=1, but the CUDA context was UNAVAILABLE: {msg}");
        }
        println!("skipped: no CUDA device ({msg})");
    }
    ctx
}

/// Registers `n` elements of `dtype` at `ptr` under `name` on `replica`.
pub fn register(
    ctx: &Context,
    name: &str,
    role: u32,
    replica: usize,
    ptr: *mut c_void,
    n: usize,
    dtype: u32,
) {
    check(context::register_raw(
        ctx.0, name, role, replica, ptr, n, dtype,
    ));
}

/// The middle value (the upper one of an even count).
pub fn median<T: PartialOrd + Copy>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN among timings"));
    v[v.len() / 2]
}

/// Runs `a` and `b` alternately `reps` times; returns their median times.
pub fn side_by_side(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (Duration, Duration) {
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

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Deterministic f32 contents in [offset, offset + 1).
pub fn filled(n: usize, seed: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + seed * 13) % 1000) as f32 * 1e-3 + offset)
        .collect()
}

/// A file of the benchmarks' own tree, `rel` as under benches/ ("data/resnet50_params.tsv",
/// "gloo_allreduce.py"), found where a benchmark may run: under `DPSYNC_BENCH_DIR` when set (a
/// directory laid out as benches/ is); under benches/ or the bundle layout of
/// scripts/gpu-check.sh (data/, gloo_allreduce.py at its root) in the working directory; the
/// same beside the executable and up to four directories above it (a bundle's benches/ and
/// mpi/, cargo's target/release/deps/); last in the source tree it was built from, which a
/// bundle moved to another machine does not have. Panics naming every place tried.
pub fn bench_file(rel: &str) -> String {
    use std::path::PathBuf;
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(dir) = std::env::var_os("DPSYNC_BENCH_DIR") {
        roots.push(dir.into());
    }
    roots.extend([PathBuf::from("benches"), PathBuf::from(".")]);
    let exe = std::env::current_exe().unwrap_or_default();
    for dir in exe.ancestors().skip(1).take(5) {
        roots.push(dir.join("benches"));
        roots.push(dir.to_path_buf());
    }
    roots.push(PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches"
    )));
    let mut tried: Vec<PathBuf> = roots.iter().map(|r| r.join(rel)).collect();
    tried.dedup();
    if let Some(found) = tried.iter().find(|p| p.is_file()) {
        return found.to_string_lossy().into_owned();
    }
    let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    panic!(
        "benches/{rel} not found; set DPSYNC_BENCH_DIR to a directory holding {rel} (the \
         source tree's benches/, or a bundle of scripts/gpu-check.sh). Tried: {}",
        tried.join(", ")
    );
}

/// A file of benches/data ([`bench_file`]).
pub fn data_file(name: &str) -> String {
    bench_file(&format!("data/{name}"))
}

/// A parameter set (benches/data/*.tsv: name, shape, element count): (name, elements) per tensor.
pub fn load_param_set(file: &str) -> Vec<(String, usize)> {
    let path = data_file(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
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
