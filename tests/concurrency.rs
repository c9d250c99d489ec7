//! One context used from many threads at once through the C ABI, the way a framework with one
//! backward thread per replica uses it (Horovod, DDP): every replica thread registers its own
//! tensors, then each step writes its gradients one by one in (perturbed) backward order and
//! declares each with `dpsync_grad_ready` while the other replicas' threads do the same, so
//! buckets are reduced early inside whichever thread completes them; after a barrier one thread
//! ends the step with `dpsync_allreduce_grads`. Beside them, an observer thread queries the
//! context (describe, replica_count, loss_scale, failing calls) and runs collectives on other
//! roles; and several contexts run at once. Every value is checked exactly: gradients are small
//! integers stored in their dtype (so every sum is exact in any order), integers are full-range
//! (sums wrap), and the expected bytes follow docs/API.md ("Exact arithmetic", "Overlap").
//!
//! docs/API.md: "calls on one context may come from any thread and are serialised by the
//! context". A watchdog aborts the process with a message if a test hangs.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod sparse;
}

use common::{abi::*, buf::*, context::*, errors::*, float16::*, lcg::*};
use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Barrier, Mutex, RwLock};
use std::time::Duration;

/// Longest a test may take before the watchdog aborts the process (a deadlock must not hang CI).
/// A test takes a few seconds in release builds (scripts/test.sh); debug builds run a third of
/// the steps (`Config::steps`) and are still several times slower. Five minutes either way: a
/// machine busy with other work may stretch a healthy test many times over, and a deadlock is
/// still caught.
const WATCHDOG: Duration = Duration::from_secs(300);
/// A large tensor holds this many bytes (plus a little): enough for the host backend's threads.
const LARGE_BYTES: usize = 1 << 20;
/// Sparse gradient: its name, row length and table size.
const EMB: &str = "emb_grad";
const ROW_LEN: usize = 3;
const NUM_EMB: u64 = 1000;

// ------------------------------------------------------------------ watchdog

/// Aborts the process if not dropped within `WATCHDOG`: a deadlocked test would otherwise hang.
struct Watchdog {
    _disarm_on_drop: mpsc::Sender<()>,
}

fn watchdog(test: &'static str) -> Watchdog {
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(WATCHDOG) {
            // Straight to stderr: the test harness captures eprintln!, and abort loses it.
            let msg = format!(
                "\n{test}: still running after {WATCHDOG:?}: deadlock or livelock in \
                 concurrent calls on one context; aborting\n"
            );
            let _ = std::io::stderr().write_all(msg.as_bytes());
            std::process::abort();
        }
    });
    Watchdog {
        _disarm_on_drop: tx,
    }
}

// ------------------------------------------------------------------ shared handles

/// A context shared by threads. docs/API.md: calls on one context may come from any thread and
/// are serialised by the context; that is the property under test.
struct Shared(Context);
// SAFETY: see above (the library serialises calls on one context).
unsafe impl Sync for Shared {}
// SAFETY: as for Sync; the handle is destroyed by the thread that owns `Shared`.
unsafe impl Send for Shared {}

/// A registered buffer, reached only through its raw pointer once registered: a replica thread
/// writes its own tensor while other threads (inside the library) reduce other tensors.
#[derive(Clone, Copy)]
struct Raw {
    ptr: *mut c_void,
    len: usize,
    dtype: DType,
}
// SAFETY: the buffers outlive every thread of a run, and the test's protocol (fill, then
// grad_ready; barriers around allreduce_grads) keeps writers and readers of one tensor apart.
unsafe impl Send for Raw {}
// SAFETY: as for Send.
unsafe impl Sync for Raw {}

impl Raw {
    fn of(b: &mut Buf) -> Raw {
        Raw {
            ptr: b.ptr(),
            len: b.len(),
            dtype: b.dtype(),
        }
    }

    fn from_const(ptr: *const c_void, len: usize, dtype: DType) -> Raw {
        Raw {
            ptr: ptr.cast_mut(),
            len,
            dtype,
        }
    }

    /// The bits of element `i`.
    fn get(&self, i: usize) -> u64 {
        assert!(i < self.len);
        // SAFETY: in bounds of a live, aligned buffer of this dtype.
        unsafe {
            match self.dtype.size() {
                2 => self.ptr.cast::<u16>().add(i).read() as u64,
                4 => self.ptr.cast::<u32>().add(i).read() as u64,
                _ => self.ptr.cast::<u64>().add(i).read(),
            }
        }
    }

    fn set(&self, i: usize, bits: u64) {
        assert!(i < self.len);
        // SAFETY: as for get; no other thread touches this element now.
        unsafe {
            match self.dtype.size() {
                2 => self.ptr.cast::<u16>().add(i).write(bits as u16),
                4 => self.ptr.cast::<u32>().add(i).write(bits as u32),
                _ => self.ptr.cast::<u64>().add(i).write(bits),
            }
        }
    }
}

// ------------------------------------------------------------------ exact values

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5eed, |h, &p| mix(h ^ p))
}

/// Element `i` of the stream `k`, as an integer: small for float dtypes (every sum of up to 6
/// is exact in the type: f16 below 2048, bf16 below 256, f32 below 2^24), full-range for
/// integers (sums wrap).
fn value(dtype: DType, k: u64, i: usize) -> i64 {
    let h = mix(k.wrapping_add(i as u64));
    let small = |half: i64| (h % (2 * half as u64 + 1)) as i64 - half;
    match dtype {
        DType::F32 => small(1 << 20),
        DType::F64 => small(1 << 40),
        DType::F16 => small(256),
        DType::BF16 => small(32),
        DType::I32 => h as u32 as i32 as i64,
        DType::I64 => h as i64,
    }
}

/// The bits of the integer `v` stored in `dtype` (exact for the values `value` makes).
fn encode(dtype: DType, v: i64) -> u64 {
    match dtype {
        DType::F32 => (v as f32).to_bits() as u64,
        DType::F64 => (v as f64).to_bits(),
        DType::F16 => f32_to_f16(v as f32) as u64,
        DType::BF16 => f32_to_bf16(v as f32) as u64,
        DType::I32 => v as i32 as u32 as u64,
        DType::I64 => v as u64,
    }
}

/// What a tensor should hold.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    /// Each replica's own input (not reduced yet).
    Input,
    Sum,
    Avg,
    /// A bucket summed early, then divided by AVG (docs/API.md "The op"): floats as AVG (the
    /// sums here are exact in the type), integers the *wrapped* sum divided.
    AvgOfWrappedSum,
}

fn want_of(op: u32) -> Want {
    if op == SUM {
        Want::Sum
    } else {
        Want::Avg
    }
}

/// The bits of the reduction of replicas whose exact sum is `s`, over `n` replicas
/// (docs/API.md "Exact arithmetic").
fn reduced(dtype: DType, want: Want, s: i128, n: usize) -> u64 {
    let sum = want == Want::Sum;
    let nf = n as f32;
    match dtype {
        DType::F32 if sum => (s as f32).to_bits() as u64,
        DType::F32 => ((s as f32) / nf).to_bits() as u64,
        DType::F64 if sum => (s as f64).to_bits(),
        DType::F64 => ((s as f64) / n as f64).to_bits(),
        DType::F16 if sum => f32_to_f16(s as f32) as u64,
        DType::F16 => f32_to_f16(s as f32 / nf) as u64,
        DType::BF16 if sum => f32_to_bf16(s as f32) as u64,
        DType::BF16 => f32_to_bf16(s as f32 / nf) as u64,
        DType::I32 => match want {
            Want::Sum => s as i32 as u32 as u64,
            Want::Avg => (s / n as i128) as i32 as u32 as u64,
            _ => ((s as i32) / n as i32) as u32 as u64,
        },
        DType::I64 => match want {
            Want::Sum => s as i64 as u64,
            Want::Avg => (s / n as i128) as i64 as u64,
            _ => ((s as i64) / n as i64) as u64,
        },
    }
}

fn show(dtype: DType, bits: u64) -> String {
    match dtype {
        DType::F32 => format!("{} ({bits:#x})", f32::from_bits(bits as u32)),
        DType::F64 => format!("{} ({bits:#x})", f64::from_bits(bits)),
        DType::F16 => format!("{} ({bits:#x})", f16_to_f32(bits as u16)),
        DType::BF16 => format!("{} ({bits:#x})", bf16_to_f32(bits as u16)),
        DType::I32 => (bits as u32 as i32).to_string(),
        DType::I64 => (bits as i64).to_string(),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

// ------------------------------------------------------------------ the model and the run

struct Tensor {
    name: String,
    dtype: DType,
    len: usize,
}

/// `count` GRAD tensors of mixed dtypes and sizes, `large` of them over a MiB. The names are the
/// same in every context; dtypes and sizes depend on the seed.
fn model(seed: u64, count: usize, large: usize) -> Vec<Tensor> {
    let mut g = Lcg::new(seed);
    let mut large_at = Vec::new();
    while large_at.len() < large {
        let t = g.below(count as u64) as usize;
        if !large_at.contains(&t) {
            large_at.push(t);
        }
    }
    (0..count)
        .map(|t| {
            let dtype = match g.below(100) {
                0..=44 => DType::F32,
                45..=59 => DType::F16,
                60..=69 => DType::BF16,
                70..=79 => DType::F64,
                80..=89 => DType::I32,
                _ => DType::I64,
            };
            let len = if large_at.contains(&t) {
                LARGE_BYTES / dtype.size() + g.below(1000) as usize
            } else if g.below(10) == 0 {
                1000 + g.below(8000) as usize
            } else {
                1 + g.below(300) as usize
            };
            Tensor {
                name: format!("layer{t:03}_grad"),
                dtype,
                len,
            }
        })
        .collect()
}

#[derive(Clone)]
struct Config {
    seed: u64,
    replicas: usize,
    tensors: usize,
    large: usize,
    /// None: the library's default (25 MiB).
    fusion: Option<usize>,
    steps: usize,
    /// The op of the first step (and of every step unless `switch_ops`).
    op: u32,
    /// Now and then the next step uses the other op.
    switch_ops: bool,
    /// Every third step, each replica leaves a few tensors undeclared.
    partial: bool,
    /// A sparse gradient (value dtype, index dtype) set by each replica thread mid-backward.
    sparse: Option<(DType, DType)>,
    /// An observer thread beside the replica threads (describe, queries, failing calls and
    /// collectives on COMPUTED tensors).
    observer: bool,
}

impl Config {
    /// Steps to run: all of them in release builds, a third (at least 12) in debug builds.
    fn steps(&self) -> usize {
        if cfg!(debug_assertions) {
            (self.steps / 3).max(12)
        } else {
            self.steps
        }
    }

    fn data_key(&self, step: usize, r: usize, t: usize) -> u64 {
        key(&[self.seed, 1, step as u64, r as u64, t as u64])
    }

    /// Replica `r`'s backward order in `step`: reverse registration order, perturbed.
    fn order(&self, step: usize, r: usize, count: usize) -> Vec<usize> {
        let mut o: Vec<usize> = (0..count).rev().collect();
        let mut g = Lcg::new(key(&[self.seed, 2, step as u64, r as u64]));
        for i in 0..count.saturating_sub(1) {
            if g.below(3) == 0 {
                o.swap(i, i + 1);
            }
        }
        o
    }

    fn skipped(&self, step: usize, r: usize, t: usize) -> bool {
        self.partial
            && step % 3 == 2
            && key(&[self.seed, 3, step as u64, r as u64, t as u64]) % 16 == 0
    }

    /// grad_ready called twice for this tensor (a no-op the second time).
    fn twice(&self, step: usize, r: usize, t: usize) -> bool {
        key(&[self.seed, 4, step as u64, r as u64, t as u64]) % 32 == 0
    }

    fn ops(&self) -> Vec<u32> {
        let mut g = Lcg::new(key(&[self.seed, 5]));
        let mut op = self.op;
        (0..self.steps())
            .map(|step| {
                if step > 0 && self.switch_ops && g.below(4) == 0 {
                    op = if op == SUM { AVG } else { SUM };
                }
                op
            })
            .collect()
    }

    fn sparse_rows(&self, step: usize, r: usize) -> usize {
        (key(&[self.seed, 6, step as u64, r as u64]) % 7) as usize
    }

    /// Where in replica `r`'s backward its sparse slice is set.
    fn sparse_at(&self, step: usize, r: usize, count: usize) -> usize {
        (key(&[self.seed, 7, step as u64, r as u64]) % count as u64) as usize
    }

    fn sparse_index(&self, step: usize, r: usize, row: usize) -> i64 {
        (mix(key(&[self.seed, 8, step as u64, r as u64]).wrapping_add(row as u64)) % NUM_EMB) as i64
    }

    fn sparse_value_key(&self, step: usize, r: usize) -> u64 {
        key(&[self.seed, 9, step as u64, r as u64])
    }
}

/// The describe JSON, robust against the length changing between calls (other threads change
/// the context meanwhile): sized once with (NULL, 0), then retried with a larger buffer until
/// the text fits.
fn describe_now(ctx: &Context) -> serde_json::Value {
    let mut len = 0usize;
    // SAFETY: the sizing call (NULL, 0) with a valid handle.
    let st = unsafe { dpsync::dpsync_describe(ctx.0, std::ptr::null_mut(), 0, &mut len) };
    check(st, "describe (NULL, 0)");
    assert!(len > 0, "describe sized an empty text");
    let mut cap = len + 256;
    loop {
        let mut buf = vec![0xffu8; cap];
        let mut full = 0usize;
        // SAFETY: a buffer of `cap` bytes.
        let st = unsafe { dpsync::dpsync_describe(ctx.0, buf.as_mut_ptr().cast(), cap, &mut full) };
        check(st, "describe");
        if full < cap {
            assert_eq!(
                buf[full], 0,
                "describe must NUL-terminate at the length it reports"
            );
            buf.truncate(full);
            let s = String::from_utf8(buf).expect("describe is UTF-8");
            return serde_json::from_str(&s)
                .unwrap_or_else(|e| panic!("describe is not JSON ({e}): {s}"));
        }
        cap = full + 1024;
    }
}

fn fill(raw: &Raw, k: u64) {
    for i in 0..raw.len {
        raw.set(i, encode(raw.dtype, value(raw.dtype, k, i)));
    }
}

/// Counts from one run, for the callers' sanity checks.
#[derive(Debug, Default)]
struct Outcome {
    buckets: usize,
    early_buckets: usize,
    refused_sums: usize,
}

/// Everything the threads of one run share.
struct Run<'a> {
    cfg: &'a Config,
    model: &'a [Tensor],
    ctx: &'a Shared,
    raws: &'a [Vec<Raw>],
    stats: &'a [(String, Vec<Raw>)],
    barrier: Barrier,
    step: AtomicUsize,
    stop: AtomicBool,
    done: AtomicBool,
    /// Rounds the observer has completed.
    observed: AtomicUsize,
    failure: Mutex<Option<String>>,
}

impl Run<'_> {
    fn fail(&self, who: &str, p: Box<dyn std::any::Any + Send>) {
        let mut f = self.failure.lock().unwrap();
        if f.is_none() {
            *f = Some(format!("{who}: {}", panic_text(&*p)));
        }
    }

    fn n(&self) -> usize {
        self.cfg.replicas
    }

    /// Replica `r`'s thread: registers its tensors, then runs backward every step.
    fn replica(&self, r: usize) {
        let ctx = &self.ctx.0;
        let setup = catch_unwind(AssertUnwindSafe(|| {
            for (t, raw) in self.raws[r].iter().enumerate() {
                let st = register_raw(
                    ctx.0,
                    &self.model[t].name,
                    GRAD,
                    r,
                    raw.ptr,
                    raw.len,
                    raw.dtype.code(),
                );
                check(
                    st,
                    &format!("register '{}' on replica {r}", self.model[t].name),
                );
            }
            if let Some((v, i)) = self.cfg.sparse {
                let st = ctx.register_sparse(EMB, r, ROW_LEN, v.code(), i.code(), NUM_EMB as usize);
                check(st, &format!("register_sparse on replica {r}"));
            }
        }));
        if let Err(p) = setup {
            self.fail(&format!("replica {r} registering"), p);
        }
        self.barrier.wait();
        // This step's sparse slice: it must stay valid until allreduce_grads has returned.
        let mut held: Option<(Buf, Buf)> = None;
        loop {
            self.barrier.wait();
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let step = self.step.load(Ordering::SeqCst);
            let res = catch_unwind(AssertUnwindSafe(|| self.backward(r, step, &mut held)));
            if let Err(p) = res {
                self.fail(&format!("replica {r} step {step}"), p);
            }
            self.barrier.wait();
        }
    }

    fn backward(&self, r: usize, step: usize, held: &mut Option<(Buf, Buf)>) {
        let (cfg, ctx) = (self.cfg, &self.ctx.0);
        let count = self.model.len();
        let sparse_at = cfg.sparse_at(step, r, count);
        for (pos, t) in cfg.order(step, r, count).into_iter().enumerate() {
            if pos == sparse_at {
                if let Some((vdt, idt)) = cfg.sparse {
                    let rows = cfg.sparse_rows(step, r);
                    let mut ib = Buf::zeros(idt, rows);
                    let mut vb = Buf::zeros(vdt, rows * ROW_LEN);
                    let (iraw, vraw) = (Raw::of(&mut ib), Raw::of(&mut vb));
                    for row in 0..rows {
                        iraw.set(row, encode(idt, cfg.sparse_index(step, r, row)));
                    }
                    fill(&vraw, cfg.sparse_value_key(step, r));
                    let (ip, vp) = if rows == 0 {
                        (std::ptr::null(), std::ptr::null())
                    } else {
                        (iraw.ptr.cast_const(), vraw.ptr.cast_const())
                    };
                    check(
                        ctx.sparse_set_raw(EMB, r, ip, vp, rows),
                        &format!("sparse_set on replica {r}"),
                    );
                    // The previous step's slice is dropped here: that step has ended.
                    *held = Some((ib, vb));
                }
            }
            fill(&self.raws[r][t], cfg.data_key(step, r, t));
            if !cfg.skipped(step, r, t) {
                let name = &self.model[t].name;
                let what = format!("grad_ready '{name}' on replica {r}, step {step}");
                check(ctx.grad_ready(name, r), &what);
                if cfg.twice(step, r, t) {
                    check(ctx.grad_ready(name, r), &format!("{what} (again)"));
                }
            }
        }
    }

    /// Asserts every replica's every gradient holds `want(t)` for `step`'s inputs.
    fn verify_dense(&self, step: usize, what: &str, want: impl Fn(usize) -> Want) {
        let n = self.n();
        for (t, tensor) in self.model.iter().enumerate() {
            let w = want(t);
            let dt = tensor.dtype;
            let keys: Vec<u64> = (0..n).map(|r| self.cfg.data_key(step, r, t)).collect();
            let mut vals = [0i64; 8];
            for i in 0..tensor.len {
                let mut s = 0i128;
                for r in 0..n {
                    vals[r] = value(dt, keys[r], i);
                    s += vals[r] as i128;
                }
                let red = (w != Want::Input).then(|| reduced(dt, w, s, n));
                for (r, raw) in self.raws.iter().enumerate() {
                    let expect = red.unwrap_or_else(|| encode(dt, vals[r]));
                    let got = raw[t].get(i);
                    if got != expect {
                        panic!(
                            "{what}: step {step}, '{}' ({dt:?}, {} elements) on replica {r}, \
                             element {i}: got {}, want {} ({w:?}; inputs {:?})",
                            tensor.name,
                            tensor.len,
                            show(dt, got),
                            show(dt, expect),
                            &vals[..n]
                        );
                    }
                }
            }
        }
    }

    /// Asserts every replica's gathered slice is `step`'s slices in world order, after `op`.
    fn verify_sparse(&self, step: usize, op: u32, what: &str) {
        let Some((vdt, idt)) = self.cfg.sparse else {
            return;
        };
        let n = self.n();
        let rows: Vec<usize> = (0..n).map(|r| self.cfg.sparse_rows(step, r)).collect();
        let total: usize = rows.iter().sum();
        for q in 0..n {
            let out = self.ctx.0.gathered(EMB, q);
            assert_eq!(
                out.rows, total,
                "{what}: step {step}, rows gathered on replica {q}"
            );
            if total == 0 {
                assert!(
                    out.indices.is_null() && out.values.is_null(),
                    "{what}: 0 rows"
                );
                continue;
            }
            let ig = Raw::from_const(out.indices, total, idt);
            let vg = Raw::from_const(out.values, total * ROW_LEN, vdt);
            let mut k = 0;
            for (r, &rr) in rows.iter().enumerate() {
                let vkey = self.cfg.sparse_value_key(step, r);
                for row in 0..rr {
                    let want = encode(idt, self.cfg.sparse_index(step, r, row));
                    assert_eq!(
                        ig.get(k),
                        want,
                        "{what}: step {step}, gathered index {k} on replica {q} \
                         (replica {r}'s row {row})"
                    );
                    for j in 0..ROW_LEN {
                        let v = value(vdt, vkey, row * ROW_LEN + j);
                        let want = reduced(vdt, want_of(op), v as i128, n);
                        let got = vg.get(k * ROW_LEN + j);
                        assert!(
                            got == want,
                            "{what}: step {step}, gathered value ({k}, {j}) on replica {q} \
                             (replica {r}'s row {row}): got {}, want {}",
                            show(vdt, got),
                            show(vdt, want)
                        );
                    }
                    k += 1;
                }
            }
        }
    }

    /// The coordinating thread: checks the plan, then runs the steps.
    fn coordinate(&self) -> Outcome {
        let (cfg, ctx) = (self.cfg, &self.ctx.0);
        let n = self.n();
        let mut out = Outcome::default();
        if let Some(f) = self.failure.lock().unwrap().take() {
            panic!("{f}");
        }
        // The plan: every GRAD in exactly one bucket of its dtype.
        let d = describe_now(ctx);
        assert_eq!(d["replicas"].as_array().unwrap().len(), n);
        assert_eq!(d["overlap"]["op"], serde_json::Value::Null, "no step yet");
        let index: HashMap<&str, usize> = (self.model.iter().enumerate())
            .map(|(t, m)| (m.name.as_str(), t))
            .collect();
        let buckets: Vec<Vec<usize>> = (d["buckets"].as_array().unwrap().iter())
            .map(|b| {
                (b["tensors"].as_array().unwrap().iter())
                    .map(|x| index[x.as_str().unwrap()])
                    .collect()
            })
            .collect();
        let mut bucket_of = vec![usize::MAX; self.model.len()];
        for (b, ts) in buckets.iter().enumerate() {
            for &t in ts {
                assert_eq!(
                    bucket_of[t],
                    usize::MAX,
                    "'{}' in two buckets",
                    self.model[t].name
                );
                bucket_of[t] = b;
                let dt = self.model[t].dtype.name();
                assert_eq!(d["buckets"][b]["dtype"], dt, "bucket {b}'s dtype");
            }
        }
        assert!(
            bucket_of.iter().all(|&b| b != usize::MAX),
            "a GRAD in no bucket"
        );
        if cfg.fusion == Some(0) {
            // No fusion: one bucket per tensor, last registered first. The replica threads
            // registered concurrently, each in forward order: the first registrations keep it.
            let want: Vec<Vec<usize>> = (0..self.model.len()).rev().map(|t| vec![t]).collect();
            assert_eq!(
                buckets, want,
                "buckets without fusion, in reverse registration order"
            );
        }
        out.buckets = buckets.len();
        // The observer runs beside every step: wait for its first round.
        while cfg.observer && self.observed.load(Ordering::SeqCst) == 0 {
            if let Some(f) = self.failure.lock().unwrap().take() {
                panic!("{f}");
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let ops = cfg.ops();
        let mut prev: Option<u32> = None;
        for (step, &op) in ops.iter().enumerate() {
            self.step.store(step, Ordering::SeqCst);
            self.barrier.wait(); // the replica threads run backward
            self.barrier.wait();
            if let Some(f) = self.failure.lock().unwrap().take() {
                panic!("{f}");
            }
            // Which buckets the replica threads' grad_ready calls reduced early.
            let early: Vec<bool> = (buckets.iter())
                .map(|ts| {
                    prev.is_some() && (ts.iter()).all(|&t| (0..n).all(|r| !cfg.skipped(step, r, t)))
                })
                .collect();
            let n_early = early.iter().filter(|&&e| e).count();
            out.early_buckets += n_early;
            let d = describe_now(ctx);
            assert_eq!(
                d["overlap"]["buckets_reduced_early_this_step"], n_early,
                "step {step}: buckets reduced early by the replica threads ({d})"
            );
            let mid = |t: usize| match prev {
                Some(p) if early[bucket_of[t]] => want_of(p),
                _ => Want::Input,
            };
            let refuse = prev == Some(AVG) && op == SUM && n_early > 0;
            // Early buckets hold their reduction already, the others each replica's input.
            self.verify_dense(step, "before allreduce_grads", mid);
            let done_op = if refuse {
                // Buckets averaged early cannot become sums: refused, nothing changes.
                expect_err(
                    ctx.allreduce_grads(SUM),
                    INVALID_STATE,
                    &["op", "DPSYNC_REDUCE_AVG"],
                );
                self.verify_dense(step, "after the refused SUM", mid);
                if step > 0 {
                    self.verify_sparse(step - 1, prev.unwrap(), "kept by the refused SUM");
                }
                out.refused_sums += 1;
                check(
                    ctx.allreduce_grads(AVG),
                    &format!("step {step}: AVG after refusal"),
                );
                AVG
            } else {
                check(
                    ctx.allreduce_grads(op),
                    &format!("step {step}: allreduce_grads"),
                );
                op
            };
            self.verify_dense(step, "after allreduce_grads", |t| {
                if early[bucket_of[t]] && prev == Some(SUM) && done_op == AVG {
                    Want::AvgOfWrappedSum
                } else {
                    want_of(done_op)
                }
            });
            self.verify_sparse(step, done_op, "after allreduce_grads");
            let d = describe_now(ctx);
            let o = &d["overlap"];
            assert_eq!(
                o["buckets_reduced_early_last_step"], n_early,
                "step {step}: {o}"
            );
            assert_eq!(o["marks_this_step"], 0, "step {step}: the step ended: {o}");
            assert_eq!(o["buckets_reduced_early_this_step"], 0, "step {step}: {o}");
            let name = if done_op == SUM { "SUM" } else { "AVG" };
            assert_eq!(
                o["op"], name,
                "step {step}: the op of the next early buckets"
            );
            prev = Some(done_op);
        }
        out
    }

    /// The observer thread: until the run is done, queries the context, makes failing calls
    /// and runs collectives on the COMPUTED tensors (which nothing else touches).
    fn observe(&self) {
        let ctx = &self.ctx.0;
        let n = self.n();
        let grads = self.model.len();
        // Registrations are over (the replica threads passed the setup barrier): the plan stays.
        let buckets = match catch_unwind(AssertUnwindSafe(|| describe_now(ctx)["buckets"].clone()))
        {
            Ok(b) => b,
            Err(p) => {
                self.fail("observer", p);
                return;
            }
        };
        let buckets = &buckets;
        let mut round = 0usize;
        loop {
            round += 1;
            let res = catch_unwind(AssertUnwindSafe(|| {
                assert_eq!(ctx.replica_count(), n);
                assert_eq!(ctx.loss_scale(), 1.0 / n as f64);
                let d = describe_now(ctx);
                assert_eq!(d["replicas"].as_array().unwrap().len(), n);
                assert_eq!(d["loss_scale"], 1.0 / n as f64);
                assert_eq!(
                    &d["buckets"], buckets,
                    "the plan changed under the observer"
                );
                let o = &d["overlap"];
                let early = o["buckets_reduced_early_this_step"].as_u64().unwrap() as usize;
                let marks = o["marks_this_step"].as_u64().unwrap() as usize;
                assert!(early <= buckets.as_array().unwrap().len(), "{o}");
                assert!(marks <= grads * n, "{o}");
                // Failing calls change nothing, and name the culprit on this thread.
                expect_err(
                    ctx.grad_ready("no_such_grad", 0),
                    NOT_FOUND,
                    &["'no_such_grad'"],
                );
                expect_err(
                    ctx.grad_ready(&self.model[0].name, n),
                    INVALID_ARGUMENT,
                    &[&format!("replica {n}")],
                );
                self.stats_round(round);
            }));
            if let Err(p) = res {
                self.fail(&format!("observer round {round}"), p);
                return;
            }
            self.observed.store(round, Ordering::SeqCst);
            if self.done.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_micros(300));
        }
    }

    /// One collective on the COMPUTED tensors, checked exactly.
    fn stats_round(&self, round: usize) {
        let (ctx, n) = (&self.ctx.0, self.n());
        let k = |r: usize, s: usize| key(&[self.cfg.seed, 10, round as u64, r as u64, s as u64]);
        for (s, (_, raws)) in self.stats.iter().enumerate() {
            for (r, raw) in raws.iter().enumerate() {
                fill(raw, k(r, s));
            }
        }
        let kind = round % 3;
        let root = round % n;
        match kind {
            0 => {
                for (name, _) in self.stats {
                    check(ctx.allreduce(name, SUM), &format!("allreduce '{name}'"));
                }
            }
            1 => check(ctx.average(COMPUTED), "average(COMPUTED)"),
            _ => check(ctx.broadcast(COMPUTED, root), "broadcast(COMPUTED)"),
        }
        for (s, (name, raws)) in self.stats.iter().enumerate() {
            let dt = raws[0].dtype;
            for i in 0..raws[0].len {
                let vals: Vec<i64> = (0..n).map(|r| value(dt, k(r, s), i)).collect();
                let sum: i128 = vals.iter().map(|&v| v as i128).sum();
                let want = match kind {
                    0 => reduced(dt, Want::Sum, sum, n),
                    1 => reduced(dt, Want::Avg, sum, n),
                    _ => encode(dt, vals[root]),
                };
                for (r, raw) in raws.iter().enumerate() {
                    let got = raw.get(i);
                    assert!(
                        got == want,
                        "observer round {round} (kind {kind}): '{name}' element {i} on replica \
                         {r}: got {}, want {}",
                        show(dt, got),
                        show(dt, want)
                    );
                }
            }
        }
    }
}

/// Runs `cfg` on its own context: one thread per replica, the calling thread coordinating, and
/// an observer if asked.
fn run(cfg: &Config) -> Outcome {
    let n = cfg.replicas;
    assert!((1..=8).contains(&n));
    let model = model(cfg.seed, cfg.tensors, cfg.large);
    let mut bufs: Vec<Vec<Buf>> = (0..n)
        .map(|_| (model.iter()).map(|t| Buf::zeros(t.dtype, t.len)).collect())
        .collect();
    let raws: Vec<Vec<Raw>> = (bufs.iter_mut())
        .map(|per| per.iter_mut().map(Raw::of).collect())
        .collect();
    let stat_shapes = [("bn_stats", DType::F64, 1500), ("bn_count", DType::I64, 16)];
    let mut stat_bufs: Vec<Vec<Buf>> = (stat_shapes.iter())
        .map(|&(_, dt, len)| (0..n).map(|_| Buf::zeros(dt, len)).collect())
        .collect();
    let ctx = Shared(Context::host(n, cfg.fusion));
    let mut stats = Vec::new();
    if cfg.observer {
        for ((name, _, _), per) in stat_shapes.iter().zip(stat_bufs.iter_mut()) {
            for (r, b) in per.iter_mut().enumerate() {
                ctx.0.reg_buf(name, COMPUTED, r, b);
            }
            stats.push((name.to_string(), per.iter_mut().map(Raw::of).collect()));
        }
    }
    let state = Run {
        cfg,
        model: &model,
        ctx: &ctx,
        raws: &raws,
        stats: &stats,
        barrier: Barrier::new(n + 1),
        step: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        done: AtomicBool::new(false),
        observed: AtomicUsize::new(0),
        failure: Mutex::new(None),
    };
    let result = std::thread::scope(|s| {
        let st = &state;
        for r in 0..n {
            s.spawn(move || st.replica(r));
        }
        st.barrier.wait(); // every replica registered
        let observer = cfg.observer.then(|| s.spawn(move || st.observe()));
        let result = catch_unwind(AssertUnwindSafe(|| st.coordinate()));
        // The replica threads wait at the start of a step: let them go.
        st.stop.store(true, Ordering::SeqCst);
        st.barrier.wait();
        st.done.store(true, Ordering::SeqCst);
        if let Some(h) = observer {
            h.join().expect("the observer catches its own panics");
        }
        result
    });
    let out = result.unwrap_or_else(|p| resume_unwind(p));
    if let Some(f) = state.failure.lock().unwrap().take() {
        panic!("{f}");
    }
    drop(state);
    drop(ctx);
    drop((bufs, stat_bufs));
    out
}

fn base(seed: u64, replicas: usize) -> Config {
    Config {
        seed,
        replicas,
        tensors: 100,
        large: 1,
        fusion: None,
        steps: 30,
        op: SUM,
        switch_ops: false,
        partial: false,
        sparse: None,
        observer: false,
    }
}

// ------------------------------------------------------------------ tests

/// One backward thread per replica, 2 to 6 replicas, fusion off / small / medium / default,
/// every step's buckets reduced early inside the replica threads (some steps leave tensors
/// undeclared), the result exact every step for SUM and AVG.
#[test]
fn backward_threads_per_replica_reduce_buckets_early_and_exactly() {
    let _w = watchdog("backward_threads_per_replica_reduce_buckets_early_and_exactly");
    let configs = [
        Config {
            tensors: 60,
            fusion: Some(0),
            steps: 50,
            partial: true,
            ..base(11, 2)
        },
        Config {
            tensors: 120,
            large: 2,
            fusion: Some(1024),
            op: AVG,
            steps: 50,
            ..base(12, 3)
        },
        Config {
            tensors: 200,
            large: 2,
            steps: 50,
            partial: true,
            ..base(13, 4)
        },
        Config {
            tensors: 80,
            fusion: Some(64 << 10),
            op: AVG,
            steps: 50,
            partial: true,
            ..base(14, 5)
        },
        Config {
            tensors: 150,
            large: 1,
            fusion: Some(256),
            steps: 50,
            ..base(15, 6)
        },
        Config {
            tensors: 100,
            large: 3,
            steps: 50,
            op: AVG,
            partial: true,
            ..base(16, 3)
        },
    ];
    for cfg in &configs {
        let out = run(cfg);
        assert!(
            out.early_buckets > 0,
            "seed {}: nothing reduced early",
            cfg.seed
        );
        if cfg.fusion == Some(0) {
            assert_eq!(out.buckets, cfg.tensors);
        }
    }
}

/// The op changes now and then between SUM and AVG: buckets summed early by the replica
/// threads are divided (integers: the wrapped sum), and a SUM after buckets averaged early is
/// refused without changing anything, then AVG ends the step.
#[test]
fn op_changes_with_buckets_reduced_early_by_replica_threads() {
    let _w = watchdog("op_changes_with_buckets_reduced_early_by_replica_threads");
    let mut refused = 0;
    for (seed, n, fusion) in [(21, 3, Some(512)), (22, 4, Some(0)), (23, 2, None)] {
        let cfg = Config {
            tensors: 70,
            fusion,
            steps: 50,
            switch_ops: true,
            partial: true,
            sparse: Some((DType::F32, DType::I64)),
            ..base(seed, n)
        };
        refused += run(&cfg).refused_sums;
    }
    assert!(refused > 0, "no step exercised the refused SUM");
}

/// While the replica threads run backward and the coordinator ends steps, an observer thread
/// calls describe (always valid JSON with the same plan), replica_count, loss_scale, failing
/// grad_ready calls (their errors stay on its thread and change nothing) and collectives on
/// COMPUTED tensors (exact): nothing deadlocks, panics or disturbs the step.
#[test]
fn queries_and_other_collectives_from_another_thread_during_backward() {
    let _w = watchdog("queries_and_other_collectives_from_another_thread_during_backward");
    for cfg in [
        Config {
            tensors: 90,
            fusion: Some(2048),
            steps: 40,
            partial: true,
            switch_ops: true,
            observer: true,
            ..base(31, 4)
        },
        Config {
            tensors: 50,
            large: 1,
            fusion: Some(0),
            steps: 40,
            op: AVG,
            observer: true,
            sparse: Some((DType::F16, DType::I32)),
            ..base(32, 2)
        },
    ] {
        let out = run(&cfg);
        assert!(out.early_buckets > 0);
    }
}

/// Sparse slices set from the replica threads in the middle of their backward (row counts
/// differ per replica and step, 0 included), gathered by allreduce_grads in world order, next
/// to dense gradients reduced early.
#[test]
fn sparse_slices_set_concurrently_gather_in_world_order() {
    let _w = watchdog("sparse_slices_set_concurrently_gather_in_world_order");
    for (seed, n, sparse, op) in [
        (41, 3, (DType::F32, DType::I64), SUM),
        (42, 5, (DType::BF16, DType::I32), AVG),
        (43, 2, (DType::F64, DType::I64), AVG),
    ] {
        let cfg = Config {
            tensors: 40,
            large: 0,
            fusion: Some(4096),
            steps: 40,
            op,
            partial: true,
            sparse: Some(sparse),
            ..base(seed, n)
        };
        run(&cfg);
    }
}

/// Several contexts, each with its own replica threads, at the same time: the same tensor
/// names with different dtypes and sizes, different replica counts, fusion sizes and ops.
/// Each gives its own exact results: no state is shared between contexts.
#[test]
fn independent_contexts_driven_at_the_same_time() {
    let _w = watchdog("independent_contexts_driven_at_the_same_time");
    let configs = [
        Config {
            tensors: 80,
            fusion: Some(0),
            steps: 40,
            partial: true,
            sparse: Some((DType::F32, DType::I64)),
            ..base(51, 2)
        },
        Config {
            tensors: 100,
            large: 1,
            fusion: Some(1024),
            op: AVG,
            steps: 40,
            switch_ops: true,
            ..base(52, 3)
        },
        Config {
            tensors: 60,
            large: 0,
            steps: 40,
            observer: true,
            sparse: Some((DType::F16, DType::I32)),
            ..base(53, 4)
        },
    ];
    let outcomes: Vec<std::thread::Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (configs.iter()).map(|c| s.spawn(move || run(c))).collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    for (cfg, out) in configs.iter().zip(outcomes) {
        let out = out.unwrap_or_else(|p| {
            panic!("context of seed {}: {}", cfg.seed, panic_text(&*p));
        });
        assert!(out.early_buckets > 0, "seed {}", cfg.seed);
    }
}

// ------------------------------------------------------------------ shards (ZeRO stage 1)
//
// The same replica threads, each step ending with dpsync_reduce_scatter_grads (now and then
// dpsync_allreduce_grads), then each replica thread asking dpsync_shard for its pieces and
// updating only those, and one dpsync_allgather of the parameters. docs/API.md ("Shards",
// "Overlap"): early buckets take the previous step's shape. Reduce-scattered ones (after a
// reduce-scatter step) serve either call: an allreduce step gathers their pieces. A step whose
// buckets dpsync_grad_ready reduced whole (after an allreduce step) refuses a reduce-scatter
// with INVALID_STATE, nothing changed, and ends with dpsync_allreduce_grads.

fn shard_of(ctx: &Context, name: &str, replica: usize) -> (dpsync::dpsync_status, usize, usize) {
    let c = cstr(name);
    let (mut offset, mut count) = (usize::MAX, usize::MAX);
    // SAFETY: valid handle, name and out pointers.
    let st = unsafe { dpsync::dpsync_shard(ctx.0, c.as_ptr(), replica, &mut offset, &mut count) };
    (st, offset, count)
}

fn reduce_scatter(ctx: &Context, op: u32) -> dpsync::dpsync_status {
    // SAFETY: valid handle.
    unsafe { dpsync::dpsync_reduce_scatter_grads(ctx.0, op) }
}

fn allgather(ctx: &Context, roles: u32) -> dpsync::dpsync_status {
    // SAFETY: valid handle.
    unsafe { dpsync::dpsync_allgather(ctx.0, roles) }
}

/// The contract's piece of a tensor of `count` elements owned by replica `w` of `total`.
fn owned(count: usize, w: usize, total: usize) -> (usize, usize) {
    let at = |w: usize| count * w / total;
    (at(w), at(w + 1) - at(w))
}

/// The replica that owns element `i` of a tensor of `count` elements among `total`.
fn owner_of(count: usize, i: usize, total: usize) -> usize {
    (0..total)
        .find(|&w| {
            let (at, k) = owned(count, w, total);
            (at..at + k).contains(&i)
        })
        .expect("every element has an owner")
}

/// Asserts `raw` holds `want(i)` at every element.
#[track_caller]
fn expect_all(raw: &Raw, what: &str, want: impl Fn(usize) -> u64) {
    for i in 0..raw.len {
        let (got, w) = (raw.get(i), want(i));
        assert!(
            got == w,
            "{what}: element {i} of {}: got {}, want {}",
            raw.len,
            show(raw.dtype, got),
            show(raw.dtype, w)
        );
    }
}

#[derive(Clone)]
struct ShardConfig {
    seed: u64,
    replicas: usize,
    tensors: usize,
    large: usize,
    fusion: Option<usize>,
    steps: usize,
    op: u32,
    /// Every `allreduce_every`-th step ends with dpsync_allreduce_grads (0: never).
    allreduce_every: usize,
    /// The replica threads declare every gradient with dpsync_grad_ready.
    marks: bool,
    /// An observer thread beside them: shard queries, failing calls, allgather and average of
    /// its own COMPUTED tensors, describe.
    observer: bool,
}

impl ShardConfig {
    fn steps(&self) -> usize {
        if cfg!(debug_assertions) {
            (self.steps / 3).max(8)
        } else {
            self.steps
        }
    }

    fn data_key(&self, step: usize, r: usize, t: usize) -> u64 {
        key(&[self.seed, 31, step as u64, r as u64, t as u64])
    }

    fn ends_with_allreduce(&self, step: usize) -> bool {
        self.allreduce_every > 0 && step % self.allreduce_every == self.allreduce_every - 1
    }
}

#[derive(Debug, Default)]
struct ShardOutcome {
    reduce_scatter_steps: usize,
    allreduce_steps: usize,
    /// Reduce-scatters refused with INVALID_STATE (buckets reduced whole early).
    refused: usize,
    observed: usize,
}

struct ShardRun<'a> {
    cfg: &'a ShardConfig,
    model: &'a [Tensor],
    ctx: &'a Shared,
    grads: &'a [Vec<Raw>],
    params: &'a [Vec<Raw>],
    stats: &'a [Raw],
    barrier: Barrier,
    step: AtomicUsize,
    /// This step's gradient call reduced every element (allreduce_grads).
    whole: AtomicBool,
    stop: AtomicBool,
    done: AtomicBool,
    observed: AtomicUsize,
    failure: Mutex<Option<String>>,
    /// This step's reduced gradients, as bits: `[tensor][element]`.
    reduced: RwLock<Vec<Vec<u64>>>,
}

impl ShardRun<'_> {
    fn fail(&self, who: &str, p: Box<dyn std::any::Any + Send>) {
        let mut f = self.failure.lock().unwrap();
        if f.is_none() {
            *f = Some(format!("{who}: {}", panic_text(&*p)));
        }
    }

    fn raise(&self) {
        if let Some(f) = self.failure.lock().unwrap().take() {
            panic!("{f}");
        }
    }

    fn n(&self) -> usize {
        self.cfg.replicas
    }

    fn param_name(&self, t: usize) -> String {
        format!("layer{t:03}_param")
    }

    /// Computes `step`'s reduced gradients (every tensor, every element) for the checks.
    fn reduce_expected(&self, step: usize) {
        let n = self.n();
        let reds = (self.model.iter().enumerate())
            .map(|(t, m)| {
                let keys: Vec<u64> = (0..n).map(|r| self.cfg.data_key(step, r, t)).collect();
                (0..m.len)
                    .map(|i| {
                        let s: i128 = keys.iter().map(|&k| value(m.dtype, k, i) as i128).sum();
                        reduced(m.dtype, want_of(self.cfg.op), s, n)
                    })
                    .collect()
            })
            .collect();
        *self.reduced.write().unwrap() = reds;
    }

    /// The reduction of `step`'s gradient element `i` of tensor `t`, and replica `r`'s input.
    fn grad_bits(
        &self,
        reds: &[Vec<u64>],
        step: usize,
        t: usize,
        i: usize,
        r: usize,
    ) -> (u64, u64) {
        let dt = self.model[t].dtype;
        (
            reds[t][i],
            encode(dt, value(dt, self.cfg.data_key(step, r, t), i)),
        )
    }

    fn replica(&self, r: usize) {
        let ctx = &self.ctx.0;
        let setup = catch_unwind(AssertUnwindSafe(|| {
            for (t, m) in self.model.iter().enumerate() {
                let (g, p) = (self.grads[r][t], self.params[r][t]);
                let st = register_raw(ctx.0, &m.name, GRAD, r, g.ptr, g.len, g.dtype.code());
                check(st, &format!("register '{}' on replica {r}", m.name));
                let name = self.param_name(t);
                let st = register_raw(ctx.0, &name, PARAM, r, p.ptr, p.len, p.dtype.code());
                check(st, &format!("register '{name}' on replica {r}"));
            }
        }));
        if let Err(p) = setup {
            self.fail(&format!("replica {r} registering"), p);
        }
        self.barrier.wait();
        loop {
            self.barrier.wait();
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let step = self.step.load(Ordering::SeqCst);
            let res = catch_unwind(AssertUnwindSafe(|| self.backward(r, step)));
            if let Err(p) = res {
                self.fail(&format!("replica {r} step {step} backward"), p);
            }
            self.barrier.wait(); // the coordinator ends the gradient step
            self.barrier.wait();
            let res = catch_unwind(AssertUnwindSafe(|| self.update(r, step)));
            if let Err(p) = res {
                self.fail(&format!("replica {r} step {step} update"), p);
            }
            self.barrier.wait();
        }
    }

    fn backward(&self, r: usize, step: usize) {
        let ctx = &self.ctx.0;
        for t in (0..self.model.len()).rev() {
            fill(&self.grads[r][t], self.cfg.data_key(step, r, t));
            if self.cfg.marks {
                let name = &self.model[t].name;
                check(
                    ctx.grad_ready(name, r),
                    &format!("grad_ready '{name}' on replica {r}, step {step}"),
                );
            }
        }
    }

    /// After the gradient step: this replica's gradients hold the reduction in its own pieces
    /// (everywhere after an allreduce) and its input elsewhere; it asks dpsync_shard for its
    /// pieces (while the other replica threads do the same) and copies the reduced gradient
    /// into its parameter there.
    fn update(&self, r: usize, step: usize) {
        let (ctx, n) = (&self.ctx.0, self.n());
        let whole = self.whole.load(Ordering::SeqCst);
        let reds = self.reduced.read().unwrap();
        for (t, m) in self.model.iter().enumerate() {
            let (g, p) = (&self.grads[r][t], &self.params[r][t]);
            let (st, at, k) = shard_of(ctx, &m.name, r);
            check(st, &format!("shard '{}' on replica {r}", m.name));
            assert_eq!((at, k), owned(m.len, r, n), "'{}' on replica {r}", m.name);
            let (st, pat, pk) = shard_of(ctx, &self.param_name(t), r);
            check(st, "shard of a parameter");
            assert_eq!(
                (pat, pk),
                (at, k),
                "a parameter and its gradient are cut alike"
            );
            let what = format!(
                "step {step} ({}), '{}' on replica {r}",
                if whole { "allreduce" } else { "reduce-scatter" },
                m.name
            );
            expect_all(g, &what, |i| {
                let (red, mine) = self.grad_bits(&reds, step, t, i, r);
                if whole || (at..at + k).contains(&i) {
                    red
                } else {
                    mine
                }
            });
            for i in at..at + k {
                p.set(i, g.get(i));
            }
        }
    }

    /// The coordinating thread: ends each step's gradients, then (after the replica threads'
    /// updates) gathers the parameters. A failure inside a step is raised at its end, where
    /// the replica threads wait for the next one.
    fn coordinate(&self) -> ShardOutcome {
        let cfg = self.cfg;
        let mut out = ShardOutcome::default();
        self.raise();
        while cfg.observer && self.observed.load(Ordering::SeqCst) == 0 {
            self.raise();
            std::thread::sleep(Duration::from_micros(100));
        }
        let mut prev_whole = false;
        for step in 0..cfg.steps() {
            self.step.store(step, Ordering::SeqCst);
            self.barrier.wait(); // backward
            self.barrier.wait();
            let ended = catch_unwind(AssertUnwindSafe(|| {
                self.raise();
                self.reduce_expected(step);
                self.end_gradients(step, prev_whole, &mut out)
            }));
            self.whole
                .store(*ended.as_ref().unwrap_or(&false), Ordering::SeqCst);
            self.barrier.wait(); // updates
            self.barrier.wait();
            let whole = ended.unwrap_or_else(|p| resume_unwind(p));
            self.raise();
            self.gather(step, whole);
            prev_whole = whole;
        }
        out
    }

    /// Ends `step`'s gradients: whether every element was reduced (allreduce_grads).
    fn end_gradients(&self, step: usize, prev_whole: bool, out: &mut ShardOutcome) -> bool {
        let (cfg, ctx) = (self.cfg, &self.ctx.0);
        let early = describe_now(ctx)["overlap"]["buckets_reduced_early_this_step"]
            .as_u64()
            .unwrap();
        // Every gradient is marked before the step ends: from the second step on (the first
        // sets the op) every bucket is reduced early, in the previous step's shape.
        if cfg.marks && step > 0 {
            assert!(early > 0, "step {step}: nothing was reduced early");
        }
        let whole = if cfg.ends_with_allreduce(step) {
            check(
                ctx.allreduce_grads(cfg.op),
                &format!("step {step}: allreduce"),
            );
            true
        } else {
            let st = reduce_scatter(ctx, cfg.op);
            if prev_whole && early > 0 {
                expect_err(st, INVALID_STATE, &["dpsync_allreduce_grads"]);
                out.refused += 1;
                // Nothing changed (the replica threads check every element after the
                // allreduce that ends the step).
                check(
                    ctx.allreduce_grads(cfg.op),
                    &format!("step {step}: after refusal"),
                );
                true
            } else {
                check(st, &format!("step {step}: reduce_scatter_grads"));
                false
            }
        };
        if whole {
            out.allreduce_steps += 1;
        } else {
            out.reduce_scatter_steps += 1;
        }
        whole
    }

    /// dpsync_allgather(PARAM) after the updates: every replica's parameters are the whole
    /// reduced gradient, and the gradients are left alone.
    fn gather(&self, step: usize, whole: bool) {
        let (ctx, n) = (&self.ctx.0, self.n());
        check(
            allgather(ctx, PARAM),
            &format!("step {step}: allgather(PARAM)"),
        );
        let reds = self.reduced.read().unwrap();
        for (t, m) in self.model.iter().enumerate() {
            for r in 0..n {
                let what = format!("step {step}: '{}' on replica {r}", self.param_name(t));
                expect_all(&self.params[r][t], &what, |i| {
                    self.grad_bits(&reds, step, t, i, r).0
                });
                let what = format!("step {step}: '{}' on replica {r} after allgather", m.name);
                let (at, k) = owned(m.len, r, n);
                expect_all(&self.grads[r][t], &what, |i| {
                    let (red, mine) = self.grad_bits(&reds, step, t, i, r);
                    if whole || (at..at + k).contains(&i) {
                        red
                    } else {
                        mine
                    }
                });
            }
        }
    }

    /// Until the run is done: dpsync_shard of any tensor on any replica (the rule), failing
    /// shard, reduce-scatter and allgather calls (their own statuses and messages, nothing
    /// changed), and allgather / average of the COMPUTED tensors only it uses, checked exactly.
    fn observe(&self) {
        let (ctx, n) = (&self.ctx.0, self.n());
        let mut round = 0usize;
        loop {
            round += 1;
            let res = catch_unwind(AssertUnwindSafe(|| {
                let t = round % self.model.len();
                let m = &self.model[t];
                let (st, at, k) = shard_of(ctx, &m.name, round % n);
                check(st, "observer: shard");
                assert_eq!((at, k), owned(m.len, round % n, n));
                let (st, _, _) = shard_of(ctx, &m.name, n + round % 3);
                expect_err(st, INVALID_ARGUMENT, &["replica", &m.name]);
                let (st, _, _) = shard_of(ctx, "no_such_tensor", 0);
                expect_err(st, NOT_FOUND, &["no_such_tensor"]);
                expect_err(reduce_scatter(ctx, 9), INVALID_ARGUMENT, &["op"]);
                expect_err(allgather(ctx, 0), INVALID_ARGUMENT, &["roles"]);
                expect_err(allgather(ctx, 0x40), INVALID_ARGUMENT, &["roles"]);
                let k = |r: usize| key(&[self.cfg.seed, 32, round as u64, r as u64]);
                for (r, raw) in self.stats.iter().enumerate() {
                    fill(raw, k(r));
                }
                let dt = self.stats[0].dtype;
                let len = self.stats[0].len;
                if round % 2 == 0 {
                    check(allgather(ctx, COMPUTED), "observer: allgather(COMPUTED)");
                    for (r, raw) in self.stats.iter().enumerate() {
                        expect_all(raw, &format!("observer round {round} replica {r}"), |i| {
                            encode(dt, value(dt, k(owner_of(len, i, n)), i))
                        });
                    }
                } else {
                    check(ctx.average(COMPUTED), "observer: average(COMPUTED)");
                    for (r, raw) in self.stats.iter().enumerate() {
                        expect_all(raw, &format!("observer round {round} replica {r}"), |i| {
                            let s: i128 = (0..n).map(|q| value(dt, k(q), i) as i128).sum();
                            reduced(dt, Want::Avg, s, n)
                        });
                    }
                }
                let d = describe_now(ctx);
                assert_eq!(d["replicas"].as_array().unwrap().len(), n);
            }));
            if let Err(p) = res {
                self.fail(&format!("observer round {round}"), p);
                return;
            }
            self.observed.store(round, Ordering::SeqCst);
            if self.done.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Runs `cfg` on its own context: one thread per replica registering its gradients and
/// parameters and running backward and its update, the calling thread ending each step, and an
/// observer if asked.
fn shard_run(cfg: &ShardConfig) -> ShardOutcome {
    let n = cfg.replicas;
    assert!((1..=8).contains(&n));
    let model = model(cfg.seed, cfg.tensors, cfg.large);
    let bufs = |_: ()| -> Vec<Vec<Buf>> {
        (0..n)
            .map(|_| (model.iter()).map(|t| Buf::zeros(t.dtype, t.len)).collect())
            .collect()
    };
    let (mut grad_bufs, mut param_bufs) = (bufs(()), bufs(()));
    let raws = |b: &mut Vec<Vec<Buf>>| -> Vec<Vec<Raw>> {
        b.iter_mut()
            .map(|per| per.iter_mut().map(Raw::of).collect())
            .collect()
    };
    let (grads, params) = (raws(&mut grad_bufs), raws(&mut param_bufs));
    let mut stat_bufs: Vec<Buf> = (0..n).map(|_| Buf::zeros(DType::F64, 700)).collect();
    let ctx = Shared(Context::host(n, cfg.fusion));
    let mut stats = Vec::new();
    if cfg.observer {
        for (r, b) in stat_bufs.iter_mut().enumerate() {
            ctx.0.reg_buf("bn_stats", COMPUTED, r, b);
            stats.push(Raw::of(b));
        }
    }
    let state = ShardRun {
        cfg,
        model: &model,
        ctx: &ctx,
        grads: &grads,
        params: &params,
        stats: &stats,
        barrier: Barrier::new(n + 1),
        step: AtomicUsize::new(0),
        whole: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        done: AtomicBool::new(false),
        observed: AtomicUsize::new(0),
        failure: Mutex::new(None),
        reduced: RwLock::new(Vec::new()),
    };
    let result = std::thread::scope(|s| {
        let st = &state;
        for r in 0..n {
            s.spawn(move || st.replica(r));
        }
        st.barrier.wait(); // every replica registered
        let observer = cfg.observer.then(|| s.spawn(move || st.observe()));
        let result = catch_unwind(AssertUnwindSafe(|| st.coordinate()));
        // The replica threads wait at the start of a step: let them go.
        st.stop.store(true, Ordering::SeqCst);
        st.barrier.wait();
        st.done.store(true, Ordering::SeqCst);
        if let Some(h) = observer {
            h.join().expect("the observer catches its own panics");
        }
        result
    });
    let mut out = result.unwrap_or_else(|p| resume_unwind(p));
    if let Some(f) = state.failure.lock().unwrap().take() {
        panic!("{f}");
    }
    out.observed = state.observed.load(Ordering::SeqCst);
    drop(state);
    drop(ctx);
    drop((grad_bufs, param_bufs, stat_bufs));
    out
}

fn shard_base(seed: u64, replicas: usize) -> ShardConfig {
    ShardConfig {
        seed,
        replicas,
        tensors: 40,
        large: 1,
        fusion: None,
        steps: 15,
        op: SUM,
        allreduce_every: 0,
        marks: true,
        observer: false,
    }
}

/// ZeRO-1 steps from one thread per replica: every gradient declared ready from its replica's
/// thread, the step ended by dpsync_reduce_scatter_grads, each replica thread asking
/// dpsync_shard for its pieces at the same time as the others and updating only those, then
/// dpsync_allgather(PARAM): every value exact, every step, 1 to 5 replicas, SUM and AVG, fusion
/// off / small / default.
#[test]
fn reduce_scatter_steps_from_replica_threads_are_exact() {
    let _w = watchdog("reduce_scatter_steps_from_replica_threads_are_exact");
    for cfg in [
        shard_config(61, 1, Some(0), SUM),
        shard_config(62, 2, Some(1024), AVG),
        shard_config(63, 3, None, SUM),
        shard_config(64, 5, Some(256), AVG),
    ] {
        let out = shard_run(&cfg);
        assert_eq!(out.reduce_scatter_steps, cfg.steps(), "seed {}", cfg.seed);
        assert_eq!(out.refused, 0);
    }
}

fn shard_config(seed: u64, n: usize, fusion: Option<usize>, op: u32) -> ShardConfig {
    ShardConfig {
        fusion,
        op,
        ..shard_base(seed, n)
    }
}

/// Steps ending with dpsync_allreduce_grads now and then, gradients declared ready from the
/// replica threads: an allreduce step after reduce-scatter steps completes the buckets they
/// reduce-scattered early; the step after an allreduce step has its buckets reduced whole
/// early, so its reduce-scatter is INVALID_STATE (nothing changed: the check after the
/// allreduce that ends it is exact). An observer thread queries
/// shards, makes failing shard calls and runs allgather / average on other tensors meanwhile.
#[test]
fn reduce_scatter_after_allreduce_steps_with_an_observer() {
    let _w = watchdog("reduce_scatter_after_allreduce_steps_with_an_observer");
    let mut refused = 0;
    for cfg in [
        ShardConfig {
            allreduce_every: 3,
            observer: true,
            fusion: Some(512),
            ..shard_base(71, 3)
        },
        ShardConfig {
            allreduce_every: 4,
            observer: true,
            op: AVG,
            large: 0,
            ..shard_base(72, 4)
        },
        ShardConfig {
            allreduce_every: 2,
            marks: false,
            observer: true,
            fusion: Some(0),
            ..shard_base(73, 2)
        },
    ] {
        let out = shard_run(&cfg);
        assert!(
            out.allreduce_steps > 0 && out.reduce_scatter_steps > 0,
            "{out:?}"
        );
        assert!(out.observed > 0, "{out:?}");
        if !cfg.marks {
            assert_eq!(out.refused, 0, "nothing reduced early without marks");
        }
        refused += out.refused;
    }
    assert!(refused > 0, "no step exercised the refused reduce-scatter");
}

/// Several contexts running ZeRO-1 steps at the same time from their own threads: each gives
/// its own exact results.
#[test]
fn independent_contexts_run_reduce_scatter_steps_at_the_same_time() {
    let _w = watchdog("independent_contexts_run_reduce_scatter_steps_at_the_same_time");
    let configs = [
        ShardConfig {
            fusion: Some(0),
            ..shard_base(81, 2)
        },
        ShardConfig {
            op: AVG,
            allreduce_every: 3,
            observer: true,
            ..shard_base(82, 3)
        },
        ShardConfig {
            fusion: Some(2048),
            large: 0,
            ..shard_base(83, 4)
        },
    ];
    let outcomes: Vec<std::thread::Result<ShardOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (configs.iter())
            .map(|c| s.spawn(move || shard_run(c)))
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    for (cfg, out) in configs.iter().zip(outcomes) {
        let out = out.unwrap_or_else(|p| {
            panic!("context of seed {}: {}", cfg.seed, panic_text(&*p));
        });
        assert!(out.reduce_scatter_steps > 0, "seed {}", cfg.seed);
    }
}
