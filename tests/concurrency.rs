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

/// Dense steps: backward threads per replica, an observer, several contexts.
#[path = "concurrency_parts/dense.rs"]
mod dense;

/// Shards (ZeRO stage 1) from replica threads.
#[path = "concurrency_parts/shards.rs"]
mod shards;
