//! What the benchmarks share: a context handle over the C ABI, status checks, side-by-side
//! timing and the parameter-set files. Each benchmark includes this module by path.
#![allow(dead_code)]

pub mod raw_nccl;

use std::ffi::{c_void, CStr, CString};
use std::time::{Duration, Instant};

use dpsync::*;

pub const SUM: u32 = dpsync_reduce_op::DPSYNC_REDUCE_SUM as u32;
pub const GRAD: u32 = dpsync_role::DPSYNC_ROLE_GRAD as u32;
pub const PARAM: u32 = dpsync_role::DPSYNC_ROLE_PARAM as u32;
pub const F32: u32 = dpsync_dtype::DPSYNC_DTYPE_F32 as u32;
pub const I64: u32 = dpsync_dtype::DPSYNC_DTYPE_I64 as u32;

/// Panics with dpsync's message unless `status` is OK.
pub fn check(status: dpsync_status) {
    if status != dpsync_status::DPSYNC_STATUS_OK {
        // SAFETY: dpsync_last_error returns a NUL-terminated thread-local string.
        let msg = unsafe { CStr::from_ptr(dpsync_last_error()) };
        panic!("{status:?}: {}", msg.to_string_lossy());
    }
}

/// A context, destroyed on drop.
pub struct Ctx(pub *mut dpsync_context);

impl Ctx {
    /// A context from options that `configure` sets; `None` (after printing "skipped: ...")
    /// when dpsync answers UNAVAILABLE, as it does for CUDA replicas without a GPU.
    pub fn create(configure: impl FnOnce(*mut dpsync_options)) -> Option<Ctx> {
        // SAFETY: a fresh options object, freed after use; out pointers are valid.
        unsafe {
            let mut o = std::ptr::null_mut();
            check(dpsync_options_new(&mut o));
            configure(o);
            let mut c = std::ptr::null_mut();
            let st = dpsync_context_create(o, &mut c);
            dpsync_options_free(o);
            if st == dpsync_status::DPSYNC_STATUS_UNAVAILABLE {
                let msg = CStr::from_ptr(dpsync_last_error()).to_string_lossy();
                // The GPU machine's run (scripts/gpu-check.sh) must not skip silently.
                if std::env::var("DPSYNC_REQUIRE_GPU").as_deref() == Ok("1") {
                    panic!("DPSYNC_REQUIRE_GPU=1, but the CUDA context was UNAVAILABLE: {msg}");
                }
                println!("skipped: no CUDA device ({msg})");
                return None;
            }
            check(st);
            Some(Ctx(c))
        }
    }

    /// `replicas` host replicas with fusion buckets of `fusion_bytes`.
    pub fn host(replicas: usize, fusion_bytes: usize) -> Ctx {
        Ctx::create(|o| unsafe {
            check(dpsync_options_set_host_replicas(o, replicas));
            check(dpsync_options_set_fusion_bytes(o, fusion_bytes));
        })
        .expect("host contexts are always available")
    }

    /// Registers `n` elements of `dtype` at `ptr` under `name` on `replica`.
    pub fn register(
        &self,
        name: &str,
        role: u32,
        replica: usize,
        ptr: *mut c_void,
        n: usize,
        dtype: u32,
    ) {
        let name = CString::new(name).unwrap();
        // SAFETY: a live context; the caller keeps `ptr` valid while registered.
        unsafe {
            check(dpsync_register(
                self.0,
                name.as_ptr(),
                role,
                replica,
                ptr,
                n,
                dtype,
            ))
        };
    }

    /// `dpsync_describe` parsed.
    pub fn describe(&self) -> serde_json::Value {
        // SAFETY: a live context; the buffer is as long as it says.
        unsafe {
            let mut len = 0usize;
            check(dpsync_describe(self.0, std::ptr::null_mut(), 0, &mut len));
            let mut buf = vec![0u8; len + 1];
            check(dpsync_describe(
                self.0,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut len,
            ));
            buf.truncate(len);
            serde_json::from_slice(&buf).expect("describe is JSON")
        }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once.
        unsafe { dpsync_context_destroy(self.0) };
    }
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

/// A file of benches/data: from the working directory first (the GPU bundle of
/// scripts/gpu-check.sh runs elsewhere than it was built), else from the source tree.
pub fn data_file(name: &str) -> String {
    let local = format!("benches/data/{name}");
    if std::path::Path::new(&local).exists() {
        return local;
    }
    format!("{}/benches/data/{name}", env!("CARGO_MANIFEST_DIR"))
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
