//! Long random sequences of C calls on host replicas, every call checked against a model the
//! test keeps: which names are registered (role, dtype, count, memory per replica), the sparse
//! gradients and their slices, the `dpsync_grad_ready` marks of the step, the BMUF filter, and
//! the contents of every registered buffer.
//!
//! After every call:
//! 1. the status is never `DPSYNC_STATUS_PANIC` and is one the model allows (a set, where the
//!    documentation names several errors for one input and leaves their order open);
//! 2. a failing call changed no byte of any registered tensor, left a non-empty message, and
//!    (seen later) no registration: the model, which did not change either, keeps predicting the
//!    library's answers;
//! 3. a successful call left exactly the bytes the model predicts (docs/API.md "Exact
//!    arithmetic", "Overlap", "BMUF", "Sparse gradients"), did not touch memory the library
//!    does not own as a registered tensor (unregistered tensors, sparse slices), and did not
//!    change `dpsync_last_error()`.
//!
//! A failure prints the seed, the context's options and the last calls; `DPSYNC_SEQ_SEED=<n>`
//! runs only that seed (in the test that owns it) and `DPSYNC_SEQ_TRACE=1` prints every call
//! (`cargo test --release --test sequences -- --nocapture`).

mod common;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::ffi::{c_char, c_void, CStr};
use std::ops::{Add, Mul, Sub};
use std::ptr;

use common::*;
use dpsync::*;

/// Sequences per #[test] (four tests: 100 sequences in all, run in parallel by the harness).
const SEQUENCES_PER_TEST: u64 = 25;
/// C calls per sequence (a compound operation may run a few past it).
const CALLS: usize = 1000;
/// Statuses the contract defines: 0..=9; 9 (PANIC) must never be seen.
const PANIC: u32 = dpsync_status::DPSYNC_STATUS_PANIC as u32;
const LAST_STATUS: u32 = dpsync_status::DPSYNC_STATUS_PANIC as u32;
const ROLES: [u32; 4] = [PARAM, GRAD, COMPUTED, STATE];
/// docs/API.md "Options": 25 MiB buckets by default.
const DEFAULT_FUSION: usize = 25 << 20;
/// Names are drawn from this pool for dense tensors and sparse gradients alike, so that names
/// collide across kinds and registrations meet earlier ones.
const NAMES: [&str; 11] = [
    "fc_w", "fc_b", "conv", "bn_mean", "bn_var", "mom", "iter", "emb", "emb2", "h0", "h1",
];
const LOG_LINES: usize = 12;

// ------------------------------------------------------------------ buffers

fn dtype_of(code: u32) -> Option<DType> {
    DType::ALL.into_iter().find(|d| d.code() == code)
}

fn is_float(d: DType) -> bool {
    !matches!(d, DType::I32 | DType::I64)
}

/// The address of a buffer's first element.
fn addr(b: &Buf) -> usize {
    match b {
        Buf::F32(v) => v.as_ptr() as usize,
        Buf::F64(v) => v.as_ptr() as usize,
        Buf::F16(v) | Buf::BF16(v) => v.as_ptr() as usize,
        Buf::I32(v) => v.as_ptr() as usize,
        Buf::I64(v) => v.as_ptr() as usize,
    }
}

/// Small integers in [-8, 8] in every dtype: sums over 5 replicas (and coalesced sparse rows)
/// are exact even in bf16, so only the documented division rounds.
fn fill_small(b: &mut Buf, g: &mut Lcg) {
    let mut next = || g.below(17) as i32 - 8;
    match b {
        Buf::F32(v) => v.iter_mut().for_each(|x| *x = next() as f32),
        Buf::F64(v) => v.iter_mut().for_each(|x| *x = next() as f64),
        Buf::F16(v) => v.iter_mut().for_each(|x| *x = f32_to_f16(next() as f32)),
        Buf::BF16(v) => v.iter_mut().for_each(|x| *x = f32_to_bf16(next() as f32)),
        Buf::I32(v) => v.iter_mut().for_each(|x| *x = next()),
        Buf::I64(v) => v.iter_mut().for_each(|x| *x = next() as i64),
    }
}

/// Fresh contents: mostly small integers, sometimes the common helper's wide values (f16 near
/// its limit, full-range integers that wrap, floats whose sum depends on the order).
fn refill(b: &mut Buf, g: &mut Lcg) {
    if g.below(4) == 0 {
        b.fill_random(g.next_u64());
    } else {
        fill_small(b, g);
    }
}

fn is_nan(b: &Buf, i: usize) -> bool {
    match b {
        Buf::F32(v) => v[i].is_nan(),
        Buf::F64(v) => v[i].is_nan(),
        Buf::F16(v) => f16_to_f32(v[i]).is_nan(),
        Buf::BF16(v) => bf16_to_f32(v[i]).is_nan(),
        Buf::I32(_) | Buf::I64(_) => false,
    }
}

/// The first element where `got` differs from `want` (NaN matches any NaN: the model's NaN
/// payload is not the point), or a length/dtype mismatch as element 0.
fn first_difference(got: &Buf, want: &Buf) -> Option<usize> {
    if got.dtype() != want.dtype() || got.len() != want.len() {
        return Some(0);
    }
    let sz = got.dtype().size();
    let (gb, wb) = (got.bytes(), want.bytes());
    (0..got.len()).find(|&i| {
        gb[i * sz..(i + 1) * sz] != wb[i * sz..(i + 1) * sz] && !(is_nan(got, i) && is_nan(want, i))
    })
}

/// docs/API.md: a stored value divided by N for AVG as a collective divides its sum: f32/f64 in
/// their own type, f16/bf16 widened to f32, divided and rounded once, integers truncated
/// toward zero.
fn divide_each(b: &Buf, n: usize) -> Buf {
    match b {
        Buf::F32(v) => Buf::F32(v.iter().map(|x| x / n as f32).collect()),
        Buf::F64(v) => Buf::F64(v.iter().map(|x| x / n as f64).collect()),
        Buf::F16(v) => Buf::F16(
            v.iter()
                .map(|&x| f32_to_f16(f16_to_f32(x) / n as f32))
                .collect(),
        ),
        Buf::BF16(v) => Buf::BF16(
            v.iter()
                .map(|&x| f32_to_bf16(bf16_to_f32(x) / n as f32))
                .collect(),
        ),
        Buf::I32(v) => Buf::I32(v.iter().map(|x| x / n as i32).collect()),
        Buf::I64(v) => Buf::I64(v.iter().map(|x| x / n as i64).collect()),
    }
}

/// Element `i` as f64 (sparse values are small integers: exact).
fn value_at(b: &Buf, i: usize) -> f64 {
    match b {
        Buf::F32(v) => v[i] as f64,
        Buf::F64(v) => v[i],
        Buf::F16(v) => f16_to_f32(v[i]) as f64,
        Buf::BF16(v) => bf16_to_f32(v[i]) as f64,
        Buf::I32(v) => v[i] as f64,
        Buf::I64(v) => v[i] as f64,
    }
}

/// A float buffer of `dtype` holding `vals` (exactly representable small integers).
fn buf_of(dtype: DType, vals: &[f64]) -> Buf {
    match dtype {
        DType::F32 => Buf::F32(vals.iter().map(|&x| x as f32).collect()),
        DType::F64 => Buf::F64(vals.to_vec()),
        DType::F16 => Buf::F16(vals.iter().map(|&x| f32_to_f16(x as f32)).collect()),
        DType::BF16 => Buf::BF16(vals.iter().map(|&x| f32_to_bf16(x as f32)).collect()),
        DType::I32 => Buf::I32(vals.iter().map(|&x| x as i32).collect()),
        DType::I64 => Buf::I64(vals.iter().map(|&x| x as i64).collect()),
    }
}

fn index_at(b: &Buf, i: usize) -> i64 {
    match b {
        Buf::I32(v) => v[i] as i64,
        Buf::I64(v) => v[i],
        _ => unreachable!("index buffers are I32 or I64"),
    }
}

/// Copies `n` elements of `dtype` from library memory.
///
/// # Safety
/// `p` points to `n` valid elements (`dpsync_sparse_get`'s promise).
unsafe fn read_buf(dtype: DType, p: *const c_void, n: usize) -> Buf {
    match dtype {
        DType::F32 => Buf::F32(std::slice::from_raw_parts(p.cast::<f32>(), n).to_vec()),
        DType::F64 => Buf::F64(std::slice::from_raw_parts(p.cast::<f64>(), n).to_vec()),
        DType::F16 => Buf::F16(std::slice::from_raw_parts(p.cast::<u16>(), n).to_vec()),
        DType::BF16 => Buf::BF16(std::slice::from_raw_parts(p.cast::<u16>(), n).to_vec()),
        DType::I32 => Buf::I32(std::slice::from_raw_parts(p.cast::<i32>(), n).to_vec()),
        DType::I64 => Buf::I64(std::slice::from_raw_parts(p.cast::<i64>(), n).to_vec()),
    }
}

// ------------------------------------------------------------------ BMUF arithmetic

/// docs/API.md "BMUF": every operation in the state type, rounded as written (no FMA).
fn bmuf_filter<T>(a: &[T], w: &mut [T], d: &mut [T], mu: T, eta: T, nesterov: bool) -> Vec<T>
where
    T: Copy + Add<Output = T> + Sub<Output = T> + Mul<Output = T>,
{
    (0..a.len())
        .map(|i| {
            let wg = if nesterov { w[i] + mu * d[i] } else { w[i] };
            let g = a[i] - wg;
            let dn = mu * d[i] + eta * g;
            let wn = w[i] + dn;
            d[i] = dn;
            w[i] = wn;
            if nesterov {
                wn + mu * dn
            } else {
                wn
            }
        })
        .collect()
}

/// `W` and `D` of one PARAM: f64 for f64 params, f32 for f32/f16/bf16.
#[derive(Clone)]
enum State {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

fn widen32(b: &Buf) -> Vec<f32> {
    match b {
        Buf::F32(v) => v.clone(),
        Buf::F16(v) => v.iter().map(|&x| f16_to_f32(x)).collect(),
        Buf::BF16(v) => v.iter().map(|&x| bf16_to_f32(x)).collect(),
        _ => unreachable!("f32 state for f32/f16/bf16 params"),
    }
}

fn narrow32(dtype: DType, v: &[f32]) -> Buf {
    match dtype {
        DType::F32 => Buf::F32(v.to_vec()),
        DType::F16 => Buf::F16(v.iter().map(|&x| f32_to_f16(x)).collect()),
        DType::BF16 => Buf::BF16(v.iter().map(|&x| f32_to_bf16(x)).collect()),
        _ => unreachable!(),
    }
}

struct BmufParam {
    name: String,
    ptrs: Vec<usize>,
    count: usize,
    dtype: DType,
    state: State,
}

struct Bmuf {
    lr: f64,
    mu: f64,
    nesterov: bool,
    params: Vec<BmufParam>,
}

// ------------------------------------------------------------------ the model

struct Slot {
    role: u32,
    dtype: DType,
    buf: Buf,
}

/// One dense name: per replica, what was registered (None: nothing on that replica).
struct Tensor {
    name: String,
    slots: Vec<Option<Slot>>,
}

impl Tensor {
    /// (role, dtype, count) when every replica registered the same.
    fn spec(&self) -> Option<(u32, DType, usize)> {
        let mut spec = None;
        for s in &self.slots {
            let s = s.as_ref()?;
            let this = (s.role, s.dtype, s.buf.len());
            if *spec.get_or_insert(this) != this {
                return None;
            }
        }
        spec
    }

    /// The first registration (what a consistent completion copies).
    fn reference(&self) -> Option<(u32, DType, usize)> {
        (self.slots.iter().flatten())
            .next()
            .map(|s| (s.role, s.dtype, s.buf.len()))
    }

    fn role_bits(&self) -> u32 {
        self.slots.iter().flatten().fold(0, |acc, s| acc | s.role)
    }

    fn buf(&self, r: usize) -> &Buf {
        &self.slots[r].as_ref().expect("registered").buf
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spec {
    row_len: usize,
    values: DType,
    indices: DType,
    num_embeddings: usize,
}

/// One replica's slice for the coming step; the buffers live here until it is consumed.
struct SliceM {
    /// The indices as set (a copy when the memory is another slice's: shared indices).
    indices: Buf,
    values: Buf,
    rows: usize,
    /// The indices pointer given to the library (slices sharing it share one index gather).
    indices_ptr: usize,
}

struct Gathered {
    indices: Vec<i64>,
    values: Buf,
    rows: usize,
    /// Per replica, the (indices pointer, rows) set: gradients with equal keys share one index
    /// gather and get the same indices pointer back.
    share_key: Vec<(usize, usize)>,
}

struct SparseM {
    name: String,
    specs: Vec<Option<Spec>>,
    slices: Vec<Option<SliceM>>,
    gathered: Option<Gathered>,
}

impl SparseM {
    fn spec(&self) -> Option<Spec> {
        let first = self.specs[0]?;
        self.specs
            .iter()
            .all(|s| *s == Some(first))
            .then_some(first)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct BucketM {
    dtype: DType,
    names: Vec<String>,
    elements: usize,
}

/// This step's `dpsync_grad_ready` marks (forgotten when a registration changes the buckets).
#[derive(Clone)]
struct Marks {
    buckets: Vec<BucketM>,
    ready: HashSet<(String, usize)>,
    reduced: Vec<bool>,
}

/// One kind of random operation.
type Op = fn(&mut Sim);

/// Predicted contents of every registered buffer, per tensor (model order) per replica.
type Pred = Vec<Vec<Option<Buf>>>;

enum Want {
    Ok(Pred),
    Err(Vec<dpsync_status>),
}

/// Where the data pointer of a registration comes from.
enum Data {
    /// A fresh buffer of `count` elements.
    New,
    Null,
    /// A buffer of count + 1 elements, one byte in.
    Misaligned,
    /// The pointer of the slot's current buffer (re-registration).
    Reuse,
    /// A buffer kept by the test (an unregistered tensor registered again).
    Given(Buf),
}

struct Sim {
    // Declared first: dropped (destroyed) before any buffer it may still point to.
    ctx: Context,
    seed: u64,
    g: Lcg,
    n: usize,
    fusion: usize,
    fusion_set: Option<usize>,
    coalesce: bool,
    tensors: Vec<Tensor>,
    /// Unregistered tensors whose memory the test keeps (to register them again identically);
    /// the library must not write it.
    detached: Vec<Tensor>,
    sparse: Vec<SparseM>,
    /// Memory the library may have seen but no longer owns; kept alive until the end.
    graveyard: Vec<Buf>,
    marks: Option<Marks>,
    last_op: Option<u32>,
    last_step_early: usize,
    bmuf: Option<Bmuf>,
    log: VecDeque<String>,
    calls: usize,
    last_fail: Option<(dpsync_status, String)>,
    trace: bool,
}

fn op_name(op: u32) -> String {
    match op {
        SUM => "SUM".into(),
        AVG => "AVG".into(),
        _ => format!("op {op}"),
    }
}

fn status_str(st: dpsync_status) -> String {
    status_name(st as u32)
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut g = Lcg::new(0x5EC0_0000 + seed);
        let n = 1 + g.below(5) as usize;
        let fusion_set = match g.below(3) {
            0 => Some(0),
            1 => Some([8, 16, 24, 48, 64, 100][g.below(6) as usize]),
            _ => None,
        };
        let coalesce = g.below(3) == 0;
        let o = Options::host(n);
        if let Some(f) = fusion_set {
            o.set_fusion_bytes(f);
        }
        if coalesce {
            o.set_sparse_coalesce(true);
        }
        let ctx = Context::new(&o);
        Sim {
            ctx,
            seed,
            g,
            n,
            fusion: fusion_set.unwrap_or(DEFAULT_FUSION),
            fusion_set,
            coalesce,
            tensors: Vec::new(),
            detached: Vec::new(),
            sparse: Vec::new(),
            graveyard: Vec::new(),
            marks: None,
            last_op: None,
            last_step_early: 0,
            bmuf: None,
            log: VecDeque::new(),
            calls: 0,
            last_fail: None,
            trace: std::env::var("DPSYNC_SEQ_TRACE").as_deref() == Ok("1"),
        }
    }

    // -------------------------------------------------------------- bookkeeping

    fn chance(&mut self, p: f64) -> bool {
        self.g.unit() < p
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.g.below(items.len() as u64) as usize]
    }

    fn note(&mut self, line: String) {
        if self.trace {
            eprintln!("seed {}: {line}", self.seed);
        }
        if self.log.len() == LOG_LINES {
            self.log.pop_front();
        }
        self.log.push_back(line);
    }

    fn fail(&self, what: impl std::fmt::Display) -> ! {
        let mut s = format!(
            "seed {} ({} host replicas, fusion_bytes {:?}, sparse coalesce {}), after call #{}: \
             {what}\nlast calls (all of them: DPSYNC_SEQ_SEED={} DPSYNC_SEQ_TRACE=1 cargo test --release \
             --test sequences -- --nocapture):\n",
            self.seed, self.n, self.fusion_set, self.coalesce, self.calls, self.seed
        );
        for l in &self.log {
            s.push_str("  ");
            s.push_str(l);
            s.push('\n');
        }
        panic!("{s}");
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    fn find_sparse(&self, name: &str) -> Option<usize> {
        self.sparse.iter().position(|s| s.name == name)
    }

    fn contents(&self) -> Pred {
        (self.tensors.iter())
            .map(|t| {
                (t.slots.iter())
                    .map(|s| s.as_ref().map(|s| s.buf.clone()))
                    .collect()
            })
            .collect()
    }

    fn unchanged(&self) -> Want {
        Want::Ok(self.contents())
    }

    /// Success with no byte changed, or one of `errs`.
    fn unchanged_unless(&self, errs: Vec<dpsync_status>) -> Want {
        if errs.is_empty() {
            self.unchanged()
        } else {
            Want::Err(errs)
        }
    }

    /// Bytes of memory the library must never write: unregistered tensors and sparse slices.
    fn frozen(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for t in &self.detached {
            out.extend(t.slots.iter().flatten().map(|s| s.buf.bytes()));
        }
        for s in &self.sparse {
            for sl in s.slices.iter().flatten() {
                out.push(sl.indices.bytes());
                out.push(sl.values.bytes());
            }
        }
        out
    }

    /// Whether `dpsync_grad_ready` reduced a bucket of this step.
    fn mid_step(&self) -> bool {
        (self.marks.as_ref()).is_some_and(|m| m.reduced.iter().any(|&r| r))
    }

    /// Some name with a role in `mask` on some replica is inconsistent.
    fn inconsistent(&self, mask: u32) -> bool {
        (self.tensors.iter()).any(|t| t.role_bits() & mask != 0 && t.spec().is_none())
    }

    /// Consistent tensors whose role is in `mask`, by model index.
    fn selected(&self, mask: u32) -> Vec<usize> {
        (0..self.tensors.len())
            .filter(|&i| (self.tensors[i].spec()).is_some_and(|(role, _, _)| role & mask != 0))
            .collect()
    }

    fn reduce(&self, t: usize, op: u32) -> Buf {
        let bufs: Vec<&Buf> = (0..self.n).map(|r| self.tensors[t].buf(r)).collect();
        reference_allreduce(&bufs, op)
    }

    fn set_all(pred: &mut Pred, t: usize, b: &Buf) {
        for slot in &mut pred[t] {
            *slot = Some(b.clone());
        }
    }

    /// The plan's fusion buckets as docs/API.md describes them: consistent GRADs last registered
    /// first, packed per dtype into buckets of at most fusion_bytes (an oversized tensor alone,
    /// 0 = one tensor per bucket), in the order of their first tensor.
    fn buckets(&self) -> Vec<BucketM> {
        let mut done: Vec<(usize, BucketM)> = Vec::new();
        let mut open: Vec<(usize, BucketM)> = Vec::new();
        let grads = (self.tensors.iter().rev()).filter_map(|t| match t.spec() {
            Some((GRAD, dtype, count)) => Some((t.name.clone(), dtype, count)),
            _ => None,
        });
        for (pos, (name, dtype, count)) in grads.enumerate() {
            if let Some(i) = open.iter().position(|(_, b)| b.dtype == dtype) {
                if (open[i].1.elements + count) * dtype.size() <= self.fusion {
                    open[i].1.names.push(name);
                    open[i].1.elements += count;
                    continue;
                }
                done.push(open.swap_remove(i));
            }
            let bucket = BucketM {
                dtype,
                names: vec![name],
                elements: count,
            };
            open.push((pos, bucket));
        }
        done.extend(open);
        done.sort_by_key(|(pos, _)| *pos);
        done.into_iter().map(|(_, b)| b).collect()
    }

    // -------------------------------------------------------------- one checked call

    /// Runs one C call and checks it against `want` (see the file's doc comment).
    fn call(
        &mut self,
        what: String,
        want: Want,
        f: impl FnOnce(*mut dpsync_context) -> dpsync_status,
    ) -> dpsync_status {
        self.calls += 1;
        let before = self.contents();
        let frozen = self.frozen();
        let message_before = last_error();
        let st = f(self.ctx.0);
        let code = st as u32;
        let msg = last_error();
        self.note(format!("#{} {what} -> {}", self.calls, status_name(code)));
        if code == PANIC {
            self.fail(format!("DPSYNC_STATUS_PANIC: {msg}"));
        }
        if code > LAST_STATUS {
            self.fail(format!("status {code} is not one the contract defines"));
        }
        if self.frozen() != frozen {
            self.fail("the call wrote memory of an unregistered tensor or of a sparse slice");
        }
        match want {
            Want::Ok(pred) => {
                if st != OK {
                    self.fail(format!("expected OK, got {} ({msg})", status_str(st)));
                }
                if msg != message_before {
                    self.fail(format!(
                        "a successful call changed dpsync_last_error from {message_before:?} to \
                         {msg:?} (docs: it stays until the next failing call)"
                    ));
                }
                self.check_contents(&pred, "after a successful call");
            }
            Want::Err(allowed) => {
                let names: Vec<String> = allowed.iter().map(|&s| status_str(s)).collect();
                if st == OK {
                    self.fail(format!("expected one of {names:?}, got OK"));
                }
                if !allowed.contains(&st) {
                    self.fail(format!(
                        "expected one of {names:?}, got {} ({msg})",
                        status_str(st)
                    ));
                }
                if msg.is_empty() {
                    self.fail("a failed call left dpsync_last_error empty");
                }
                if let Some((prev, prev_msg)) = &self.last_fail {
                    if *prev != st && *prev_msg == msg {
                        self.fail(format!(
                            "a {} failure kept the message of the previous {} failure: {msg:?}",
                            status_str(st),
                            status_str(*prev)
                        ));
                    }
                }
                self.last_fail = Some((st, msg));
                self.check_unchanged(&before);
            }
        }
        st
    }

    /// A failed call changed no byte.
    fn check_unchanged(&self, before: &Pred) {
        for (t, tensor) in self.tensors.iter().enumerate() {
            for (r, slot) in tensor.slots.iter().enumerate() {
                let (Some(slot), Some(old)) = (slot, &before[t][r]) else {
                    continue;
                };
                if slot.buf.bytes() != old.bytes() {
                    let i = (0..old.len())
                        .find(|&i| elem_str(&slot.buf, i) != elem_str(old, i))
                        .unwrap_or(0);
                    self.fail(format!(
                        "a failed call changed tensor '{}' on replica {r}: element {i} was {}, \
                         is {}",
                        tensor.name,
                        elem_str(old, i),
                        elem_str(&slot.buf, i)
                    ));
                }
            }
        }
    }

    /// Every buffer holds the predicted bytes; replicas predicted identical are byte-identical.
    fn check_contents(&self, pred: &Pred, when: &str) {
        for (t, tensor) in self.tensors.iter().enumerate() {
            for (r, slot) in tensor.slots.iter().enumerate() {
                let (Some(slot), Some(want)) = (slot, &pred[t][r]) else {
                    continue;
                };
                if let Some(i) = first_difference(&slot.buf, want) {
                    self.fail(format!(
                        "{when}: tensor '{}' ({:?}, {} elements) on replica {r}: element {i} is \
                         {}, the model predicts {}",
                        tensor.name,
                        want.dtype(),
                        want.len(),
                        elem_str(&slot.buf, i),
                        elem_str(want, i)
                    ));
                }
            }
            let predicted: Vec<Vec<u8>> = pred[t].iter().flatten().map(Buf::bytes).collect();
            if tensor.spec().is_some() && predicted.windows(2).all(|w| w[0] == w[1]) {
                let actual: Vec<Vec<u8>> = (tensor.slots.iter().flatten())
                    .map(|s| s.buf.bytes())
                    .collect();
                if actual.windows(2).any(|w| w[0] != w[1]) {
                    self.fail(format!(
                        "{when}: tensor '{}': replicas do not hold identical bytes",
                        tensor.name
                    ));
                }
            }
        }
    }

    // -------------------------------------------------------------- operations

    fn random_op(&mut self) {
        let weights: [(u32, Op); 21] = [
            (8, Sim::op_register),
            (4, Sim::op_repair),
            (9, Sim::op_register_all),
            (3, Sim::op_complete),
            (4, Sim::op_unregister),
            (2, Sim::op_reattach),
            (10, Sim::op_refill),
            (8, Sim::op_allreduce_grads),
            (5, Sim::op_allreduce),
            (5, Sim::op_broadcast),
            (5, Sim::op_average),
            (5, Sim::op_grad_ready),
            (4, Sim::op_backward),
            (3, Sim::op_bmuf_init),
            (4, Sim::op_bmuf_step),
            (2, Sim::op_sparse_register),
            (2, Sim::op_sparse_register_all),
            (5, Sim::op_sparse_set_all),
            (3, Sim::op_sparse_get),
            (3, Sim::op_describe),
            (3, Sim::op_misc),
        ];
        let total: u32 = weights.iter().map(|w| w.0).sum();
        let mut x = self.g.below(total as u64) as u32;
        for (w, f) in weights {
            if x < w {
                f(self);
                return;
            }
            x -= w;
        }
    }

    /// A name: mostly one the library knows, sometimes a free one, sometimes "".
    fn pick_name(&mut self) -> String {
        let x = self.g.below(100);
        if x < 45 && !self.tensors.is_empty() {
            let i = self.g.below(self.tensors.len() as u64) as usize;
            return self.tensors[i].name.clone();
        }
        if x < 60 && !self.sparse.is_empty() {
            let i = self.g.below(self.sparse.len() as u64) as usize;
            return self.sparse[i].name.clone();
        }
        if x < 63 {
            return String::new();
        }
        self.pick(&NAMES).to_owned()
    }

    /// A name neither a dense tensor nor a sparse gradient has.
    fn free_name(&mut self) -> Option<String> {
        let free: Vec<&str> = (NAMES.iter().copied())
            .filter(|n| self.find(n).is_none() && self.find_sparse(n).is_none())
            .collect();
        if free.is_empty() {
            return None;
        }
        Some(self.pick(&free).to_owned())
    }

    fn pick_replica(&mut self) -> usize {
        if self.chance(0.05) {
            self.n + self.g.below(3) as usize
        } else {
            self.g.below(self.n as u64) as usize
        }
    }

    fn pick_role(&mut self) -> u32 {
        if self.chance(0.04) {
            self.pick(&[0, 3, 16, 0x8000_0000])
        } else {
            self.pick(&ROLES)
        }
    }

    fn pick_dtype(&mut self) -> u32 {
        if self.chance(0.04) {
            self.pick(&[6, 7, 255])
        } else {
            self.pick(&DType::ALL).code()
        }
    }

    fn pick_count(&mut self) -> usize {
        match self.g.below(100) {
            0..=2 => 0,
            3 => usize::MAX / 2 + 1, // byte size overflows
            4..=24 => 13 + self.g.below(50) as usize,
            _ => 1 + self.g.below(12) as usize,
        }
    }

    fn pick_op(&mut self) -> u32 {
        if self.chance(0.05) {
            self.pick(&[2, 3, u32::MAX])
        } else {
            self.pick(&[SUM, AVG])
        }
    }

    fn pick_roles(&mut self) -> u32 {
        if self.chance(0.06) {
            self.pick(&[0, 16, 0x11, 0xFFFF_FFFF])
        } else {
            1 + self.g.below(15) as u32
        }
    }

    // ---- registration

    /// One `dpsync_register` call, checked; the model follows on success.
    fn register_call(
        &mut self,
        name: &str,
        role: u32,
        replica: usize,
        count: usize,
        dtype: u32,
        data: Data,
    ) -> dpsync_status {
        let dt = dtype_of(dtype);
        let alloc_dt = dt.unwrap_or(DType::F32);
        let alloc = count.min(64);
        let existing = self.find(name);
        let slot = existing
            .filter(|_| replica < self.n)
            .and_then(|t| self.tensors[t].slots[replica].as_ref());
        let (mut owned, ptr, kind) = match data {
            Data::New => {
                let mut b = Buf::zeros(alloc_dt, alloc);
                refill(&mut b, &mut self.g);
                let p = b.ptr();
                (Some(b), p, "new")
            }
            Data::Null => (None, ptr::null_mut(), "NULL"),
            Data::Misaligned => {
                let mut b = Buf::zeros(alloc_dt, alloc + 1);
                // SAFETY: one byte into a buffer of alloc + 1 elements of at least 2 bytes.
                let p = unsafe { b.ptr().cast::<u8>().add(1) }.cast::<c_void>();
                (Some(b), p, "misaligned")
            }
            Data::Reuse => {
                let p = slot.map_or(ptr::null_mut(), |s| addr(&s.buf) as *mut c_void);
                (None, p, "its own")
            }
            Data::Given(mut b) => {
                let p = b.ptr();
                (Some(b), p, "kept")
            }
        };
        let misaligned = kind == "misaligned";
        let identical = slot.is_some_and(|s| {
            Some(s.dtype) == dt
                && s.role == role
                && s.buf.len() == count
                && addr(&s.buf) == ptr as usize
        });
        let mut errs = Vec::new();
        if name.is_empty()
            || !ROLES.contains(&role)
            || ptr.is_null()
            || count == 0
            || dt.is_none()
            || replica >= self.n
            || misaligned
            || count
                .checked_mul(alloc_dt.size())
                .is_none_or(|b| b > isize::MAX as usize)
        {
            errs.push(INVALID_ARGUMENT);
        }
        if self.find_sparse(name).is_some() || (slot.is_some() && !identical) {
            errs.push(CONFLICT);
        }
        if self.mid_step() && !identical {
            errs.push(INVALID_STATE);
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let what = format!(
            "register('{name}', role {role}, replica {replica}, {kind} data, count {count}, dtype {dtype})"
        );
        // SAFETY: the data outlives its registration (owned by the model or the graveyard).
        let st = self.call(what, want, |ctx| unsafe {
            dpsync_register(ctx, c.as_ptr(), role, replica, ptr, count, dtype)
        });
        if st == OK && !identical {
            let b = owned
                .take()
                .expect("a successful new registration has its buffer");
            let slot = Slot {
                role,
                dtype: dt.expect("valid"),
                buf: b,
            };
            match existing {
                Some(t) => self.tensors[t].slots[replica] = Some(slot),
                None => {
                    let mut slots: Vec<Option<Slot>> = (0..self.n).map(|_| None).collect();
                    slots[replica] = Some(slot);
                    self.tensors.push(Tensor {
                        name: name.to_owned(),
                        slots,
                    });
                }
            }
            self.marks = None; // the buckets may have changed: the step's marks are forgotten
        }
        if let Some(b) = owned {
            self.graveyard.push(b);
        }
        st
    }

    /// A framework usually ends the step (allreduce_grads) before it changes registrations;
    /// while `grad_ready` has reduced a bucket, registrations are refused.
    fn maybe_end_step(&mut self) {
        if self.mid_step() && self.chance(0.5) {
            self.op_allreduce_grads();
        }
    }

    /// One random registration, valid or not.
    fn op_register(&mut self) {
        self.maybe_end_step();
        let name = self.pick_name();
        let existing = self.find(&name);
        let mut replica = self.pick_replica();
        if let Some(t) = existing {
            let missing: Vec<usize> = (0..self.n)
                .filter(|&r| self.tensors[t].slots[r].is_none())
                .collect();
            if !missing.is_empty() && self.chance(0.5) {
                replica = self.pick(&missing);
            }
        }
        let reference = existing.and_then(|t| self.tensors[t].reference());
        let (mut role, mut dtype, mut count) =
            (self.pick_role(), self.pick_dtype(), self.pick_count());
        if let Some((r, d, c)) = reference {
            if self.chance(0.7) {
                (role, dtype, count) = (r, d.code(), c);
            }
        }
        let has_slot =
            existing.is_some_and(|t| replica < self.n && self.tensors[t].slots[replica].is_some());
        let data = match self.g.below(100) {
            0..=3 => Data::Null,
            4..=7 => Data::Misaligned,
            8..=40 if has_slot => Data::Reuse,
            _ => Data::New,
        };
        self.register_call(&name, role, replica, count, dtype, data);
    }

    /// A new name on every replica (what a framework does), sometimes with one replica that
    /// disagrees or is left out.
    fn op_register_all(&mut self) {
        if self.tensors.len() >= 9 {
            return self.op_unregister();
        }
        let Some(name) = self.free_name() else {
            return;
        };
        self.maybe_end_step();
        let role = self.pick(&ROLES);
        let mut dtype = self.pick(&DType::ALL);
        if role == PARAM && !is_float(dtype) && self.chance(0.8) {
            dtype = DType::F32; // BMUF refuses integer PARAMs: keep most models filterable
        }
        let count = if self.chance(0.2) {
            13 + self.g.below(40) as usize
        } else {
            1 + self.g.below(12) as usize
        };
        let odd = if self.chance(0.15) {
            Some(self.g.below(self.n as u64) as usize)
        } else {
            None
        };
        self.note(format!("-- register '{name}' on every replica"));
        for r in 0..self.n {
            let (mut role, mut dtype, mut count) = (role, dtype, count);
            if odd == Some(r) {
                match self.g.below(4) {
                    0 => continue, // left out
                    1 => count += 1,
                    2 => dtype = self.pick(&DType::ALL),
                    _ => role = self.pick(&ROLES),
                }
            }
            self.register_call(&name, role, r, count, dtype.code(), Data::New);
            if self.chance(0.05) {
                // a duplicate initialiser: the identical registration again
                self.register_call(&name, role, r, count, dtype.code(), Data::Reuse);
            }
        }
    }

    /// Registers an inconsistent name where it is missing, like its first registration.
    fn op_complete(&mut self) {
        let partial: Vec<usize> = (0..self.tensors.len())
            .filter(|&t| self.tensors[t].slots.iter().any(Option::is_none))
            .collect();
        if partial.is_empty() {
            return self.op_register();
        }
        let t = self.pick(&partial);
        let name = self.tensors[t].name.clone();
        let (role, dtype, count) = self.tensors[t].reference().expect("registered somewhere");
        for r in 0..self.n {
            let t = self.find(&name);
            if t.is_some_and(|t| self.tensors[t].slots[r].is_none()) {
                self.register_call(&name, role, r, count, dtype.code(), Data::New);
            }
        }
    }

    /// What a framework does after a mistake: every inconsistent dense name completed where it
    /// is only missing, otherwise unregistered; every inconsistent sparse gradient unregistered.
    fn op_repair(&mut self) {
        self.note("-- repair inconsistent names".into());
        let bad: Vec<String> = (self.tensors.iter())
            .filter(|t| t.spec().is_none())
            .map(|t| t.name.clone())
            .collect();
        for name in bad {
            let t = self.find(&name).expect("registered");
            let reference = self.tensors[t].reference().expect("registered somewhere");
            let only_missing = (self.tensors[t].slots.iter().flatten())
                .all(|s| (s.role, s.dtype, s.buf.len()) == reference);
            if only_missing && self.chance(0.7) {
                let (role, dtype, count) = reference;
                for r in 0..self.n {
                    if self.tensors[t].slots[r].is_none() {
                        self.register_call(&name, role, r, count, dtype.code(), Data::New);
                    }
                }
            } else {
                self.unregister_call(&name);
            }
        }
        let bad: Vec<String> = (self.sparse.iter())
            .filter(|s| s.spec().is_none())
            .map(|s| s.name.clone())
            .collect();
        for name in bad {
            self.unregister_call(&name);
        }
    }

    fn unregister_call(&mut self, name: &str) {
        let dense = self.find(name);
        let sparse = self.find_sparse(name);
        let want = if sparse.is_some() {
            self.unchanged()
        } else if dense.is_some() {
            if self.mid_step() {
                Want::Err(vec![INVALID_STATE])
            } else {
                self.unchanged()
            }
        } else if name.is_empty() {
            Want::Err(vec![INVALID_ARGUMENT])
        } else {
            Want::Err(vec![NOT_FOUND])
        };
        let c = cstr(name);
        // SAFETY: valid handle and name.
        let st = self.call(format!("unregister('{name}')"), want, |ctx| unsafe {
            dpsync_unregister(ctx, c.as_ptr())
        });
        if st != OK {
            return;
        }
        if let Some(s) = sparse {
            let s = self.sparse.remove(s);
            for sl in s.slices.into_iter().flatten() {
                self.graveyard.push(sl.indices);
                self.graveyard.push(sl.values);
            }
        } else if let Some(t) = dense {
            let t = self.tensors.remove(t);
            self.marks = None;
            self.detached.push(t);
            if self.detached.len() > 4 {
                let old = self.detached.remove(0);
                self.graveyard
                    .extend(old.slots.into_iter().flatten().map(|s| s.buf));
            }
        }
    }

    fn op_unregister(&mut self) {
        self.maybe_end_step();
        let inconsistent: Vec<String> = (self.tensors.iter())
            .filter(|t| t.spec().is_none())
            .map(|t| t.name.clone())
            .collect();
        let name = if !inconsistent.is_empty() && self.chance(0.4) {
            self.pick_from(&inconsistent)
        } else {
            self.pick_name()
        };
        self.unregister_call(&name);
    }

    fn pick_from(&mut self, names: &[String]) -> String {
        names[self.g.below(names.len() as u64) as usize].clone()
    }

    /// An unregistered tensor registered again with its old memory (what BMUF accepts as
    /// "undoing the change").
    fn op_reattach(&mut self) {
        let free: Vec<usize> = (0..self.detached.len())
            .filter(|&i| {
                let name = &self.detached[i].name;
                self.find(name).is_none() && self.find_sparse(name).is_none()
            })
            .collect();
        if free.is_empty() {
            return self.op_register_all();
        }
        let i = self.pick(&free);
        let t = self.detached.remove(i);
        self.note(format!(
            "-- register '{}' again with its old memory",
            t.name
        ));
        for (r, slot) in t.slots.into_iter().enumerate() {
            if let Some(s) = slot {
                let (role, dtype, count) = (s.role, s.dtype.code(), s.buf.len());
                self.register_call(&t.name, role, r, count, dtype, Data::Given(s.buf));
            }
        }
    }

    /// The framework computes: new values in some registered buffers (not in GRADs a bucket
    /// of this step was already reduced from, and not in slices: those are set fresh).
    fn op_refill(&mut self) {
        let mid = self.mid_step();
        let mut touched = Vec::new();
        for t in 0..self.tensors.len() {
            if self.g.below(2) == 0 || (mid && self.tensors[t].role_bits() & GRAD != 0) {
                continue;
            }
            for r in 0..self.n {
                if self.g.below(4) == 0 {
                    continue;
                }
                if let Some(s) = self.tensors[t].slots[r].as_mut() {
                    refill(&mut s.buf, &mut self.g);
                    touched.push(format!("{}@{r}", self.tensors[t].name));
                }
            }
        }
        self.note(format!("-- refill {}", touched.join(" ")));
    }

    // ---- collectives

    fn allreduce_grads_call(&mut self, op: u32) {
        let mut errs = Vec::new();
        if op != SUM && op != AVG {
            errs.push(INVALID_ARGUMENT);
        }
        if self.inconsistent(GRAD) {
            errs.push(INCONSISTENT);
        }
        if self.mid_step() && self.last_op == Some(AVG) && op == SUM {
            errs.push(INVALID_STATE);
        }
        if self.sparse_step_fails() {
            errs.push(INCONSISTENT);
        }
        let want = if errs.is_empty() {
            let mut pred = self.contents();
            let early: HashSet<String> = match &self.marks {
                Some(m) => (m.buckets.iter().zip(&m.reduced))
                    .filter(|(_, &r)| r)
                    .flat_map(|(b, _)| b.names.iter().cloned())
                    .collect(),
                None => HashSet::new(),
            };
            for t in self.selected(GRAD) {
                if !early.contains(&self.tensors[t].name) {
                    let b = self.reduce(t, op);
                    Self::set_all(&mut pred, t, &b);
                } else if self.last_op == Some(SUM) && op == AVG {
                    // summed early, divided now (docs/API.md "Overlap")
                    for (r, slot) in pred[t].iter_mut().enumerate() {
                        *slot = Some(divide_each(self.tensors[t].buf(r), self.n));
                    }
                }
            }
            Want::Ok(pred)
        } else {
            Want::Err(errs)
        };
        let gathered: Vec<Gathered> = if matches!(want, Want::Ok(_)) {
            (0..self.sparse.len()).map(|s| self.gather(s, op)).collect()
        } else {
            Vec::new()
        };
        // SAFETY: valid handle; slices stay valid (owned by the model).
        let st = self.call(
            format!("allreduce_grads({})", op_name(op)),
            want,
            |ctx| unsafe { dpsync_allreduce_grads(ctx, op) },
        );
        if st != OK {
            if self.chance(0.5) {
                self.op_sparse_get(); // the previous gathered slices are kept
            }
            return;
        }
        self.last_step_early = self
            .marks
            .as_ref()
            .map_or(0, |m| m.reduced.iter().filter(|&&r| r).count());
        self.marks = None;
        self.last_op = Some(op);
        for (s, g) in gathered.into_iter().enumerate() {
            let entry = &mut self.sparse[s];
            entry.gathered = Some(g);
            for sl in entry.slices.iter_mut().filter_map(Option::take) {
                self.graveyard.push(sl.indices);
                self.graveyard.push(sl.values);
            }
        }
        if self.chance(0.6) {
            let mut got: Vec<Vec<Option<usize>>> = Vec::new();
            for s in 0..self.sparse.len() {
                let name = self.sparse[s].name.clone();
                got.push(
                    (0..self.n)
                        .map(|r| self.sparse_get_call(&name, r, false))
                        .collect(),
                );
            }
            // docs/API.md: slices set with the same indices buffer and row count on every
            // replica share one index gather and return the same indices pointer.
            for a in 0..self.sparse.len() {
                for b in a + 1..self.sparse.len() {
                    let key = |s: usize| {
                        &self.sparse[s]
                            .gathered
                            .as_ref()
                            .expect("gathered")
                            .share_key
                    };
                    if key(a) == key(b) && key(a).iter().all(|&(p, _)| p != 0) && got[a] != got[b] {
                        self.fail(format!(
                            "sparse gradients '{}' and '{}' were set with the same indices \
                             buffers and rows on every replica, but sparse_get returned indices \
                             {:x?} and {:x?}",
                            self.sparse[a].name, self.sparse[b].name, got[a], got[b]
                        ));
                    }
                }
            }
        }
    }

    fn op_allreduce_grads(&mut self) {
        let last = self.last_op;
        let op = match last {
            Some(op) if self.chance(0.7) => op,
            _ => self.pick_op(),
        };
        if !self.sparse.is_empty() && self.chance(0.7) {
            self.op_sparse_set_all();
        }
        self.allreduce_grads_call(op);
    }

    fn op_allreduce(&mut self) {
        let name = self.pick_name();
        let op = self.pick_op();
        let mut errs = Vec::new();
        if op != SUM && op != AVG {
            errs.push(INVALID_ARGUMENT);
        }
        let t = self.find(&name);
        match t {
            _ if name.is_empty() => errs.push(INVALID_ARGUMENT),
            None => errs.push(NOT_FOUND), // unknown, or a sparse gradient
            Some(t) if self.tensors[t].spec().is_none() => errs.push(INCONSISTENT),
            Some(_) => {}
        }
        let want = match t {
            Some(t) if errs.is_empty() => {
                let mut pred = self.contents();
                let b = self.reduce(t, op);
                Self::set_all(&mut pred, t, &b);
                Want::Ok(pred)
            }
            _ => Want::Err(errs),
        };
        let c = cstr(&name);
        // SAFETY: valid handle and name.
        self.call(
            format!("allreduce('{name}', {})", op_name(op)),
            want,
            |ctx| unsafe { dpsync_allreduce(ctx, c.as_ptr(), op) },
        );
    }

    fn op_broadcast(&mut self) {
        let roles = self.pick_roles();
        let root = self.pick_replica();
        let want = self.roles_want(roles, root >= self.n, |sim, t| {
            sim.tensors[t].buf(root).clone()
        });
        // SAFETY: valid handle.
        self.call(
            format!("broadcast(roles {roles:#x}, root {root})"),
            want,
            |ctx| unsafe { dpsync_broadcast(ctx, roles, root) },
        );
    }

    fn op_average(&mut self) {
        let roles = self.pick_roles();
        let want = self.roles_want(roles, false, |sim, t| sim.reduce(t, AVG));
        // SAFETY: valid handle.
        self.call(format!("average(roles {roles:#x})"), want, |ctx| unsafe {
            dpsync_average(ctx, roles)
        });
    }

    /// What a collective over the tensors of `roles` must do: fail with INVALID_ARGUMENT (bad
    /// `roles`, or `bad_arg` for another argument) or INCONSISTENT (a selected tensor), or
    /// leave every selected tensor as `result` on every replica.
    fn roles_want(&self, roles: u32, bad_arg: bool, result: impl Fn(&Sim, usize) -> Buf) -> Want {
        let mut errs = Vec::new();
        if roles == 0 || roles & !0xF != 0 || bad_arg {
            errs.push(INVALID_ARGUMENT);
        }
        if self.inconsistent(roles) {
            errs.push(INCONSISTENT);
        }
        if !errs.is_empty() {
            return Want::Err(errs);
        }
        let mut pred = self.contents();
        for t in self.selected(roles) {
            Self::set_all(&mut pred, t, &result(self, t));
        }
        Want::Ok(pred)
    }

    // ---- overlap

    fn grad_ready_call(&mut self, name: &str, replica: usize) {
        let mut errs = Vec::new();
        if replica >= self.n {
            errs.push(INVALID_ARGUMENT);
        }
        let t = self.find(name);
        // An empty name, or a sparse gradient's (not a dense GRAD).
        if name.is_empty() || self.find_sparse(name).is_some() {
            errs.push(INVALID_ARGUMENT);
        } else {
            match t {
                None => errs.push(NOT_FOUND),
                Some(t) => match self.tensors[t].spec() {
                    // Not a GRAD and inconsistent: the docs name both errors.
                    None if self.tensors[t].role_bits() != GRAD => {
                        errs.extend([INCONSISTENT, INVALID_ARGUMENT])
                    }
                    None => errs.push(INCONSISTENT),
                    Some((role, _, _)) if role != GRAD => errs.push(INVALID_ARGUMENT),
                    Some(_) => {}
                },
            }
        }
        if self.inconsistent(GRAD) {
            errs.push(INCONSISTENT);
        }
        let mut marks = None;
        let mut early = String::new();
        let want = match t {
            Some(_) if errs.is_empty() => {
                let mut m = self.marks.clone().unwrap_or_else(|| {
                    let buckets = self.buckets();
                    Marks {
                        reduced: vec![false; buckets.len()],
                        buckets,
                        ready: HashSet::new(),
                    }
                });
                let mut pred = self.contents();
                if m.ready.insert((name.to_owned(), replica)) {
                    let b = (m.buckets.iter())
                        .position(|b| b.names.iter().any(|n| n == name))
                        .expect("every consistent GRAD is in a bucket");
                    let complete = (m.buckets[b].names.iter())
                        .all(|n| (0..self.n).all(|r| m.ready.contains(&(n.clone(), r))));
                    if let (true, Some(op)) = (complete, self.last_op) {
                        for n in &m.buckets[b].names {
                            let t = self.find(n).expect("registered");
                            let reduced = self.reduce(t, op);
                            Self::set_all(&mut pred, t, &reduced);
                        }
                        m.reduced[b] = true;
                        early =
                            format!(" [completes bucket {b}: reduced now with {}]", op_name(op));
                    }
                }
                marks = Some(m);
                Want::Ok(pred)
            }
            _ => Want::Err(errs),
        };
        let c = cstr(name);
        // SAFETY: valid handle and name.
        let st = self.call(
            format!("grad_ready('{name}', {replica}){early}"),
            want,
            |ctx| unsafe { dpsync_grad_ready(ctx, c.as_ptr(), replica) },
        );
        if st == OK {
            self.marks = marks;
        }
    }

    fn op_grad_ready(&mut self) {
        let grads: Vec<String> = (self.tensors.iter())
            .filter(|t| t.role_bits() & GRAD != 0)
            .map(|t| t.name.clone())
            .collect();
        let name = if !grads.is_empty() && self.chance(0.8) {
            self.pick_from(&grads)
        } else {
            self.pick_name()
        };
        let replica = self.pick_replica();
        self.grad_ready_call(&name, replica);
    }

    /// A backward pass: every GRAD declared ready, last registered first, replicas interleaved
    /// (some marks skipped, some repeated), then usually the step's allreduce_grads.
    fn op_backward(&mut self) {
        if !self.mid_step() {
            for t in self.selected(GRAD) {
                for r in 0..self.n {
                    let s = self.tensors[t].slots[r].as_mut().expect("consistent");
                    refill(&mut s.buf, &mut self.g);
                }
            }
            self.note("-- refill every GRAD, then a backward pass".into());
        }
        let grads: Vec<String> = (self.selected(GRAD).into_iter().rev())
            .map(|t| self.tensors[t].name.clone())
            .collect();
        let skip = self.chance(0.3);
        for name in grads {
            let mut order: Vec<usize> = (0..self.n).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, self.g.below(i as u64 + 1) as usize);
            }
            for r in order {
                if skip && self.chance(0.2) {
                    continue;
                }
                self.grad_ready_call(&name, r);
                if self.chance(0.05) {
                    self.grad_ready_call(&name, r); // declared twice: a no-op
                }
            }
        }
        if self.chance(0.75) {
            self.op_allreduce_grads();
        }
    }

    // ---- BMUF

    fn op_bmuf_init(&mut self) {
        let lr = if self.chance(0.08) {
            self.pick(&[0.0, -1.0, f64::NAN, f64::INFINITY])
        } else {
            self.pick(&[1.0, 0.5, 2.0, 0.75])
        };
        let mu = if self.chance(0.08) {
            self.pick(&[1.0, 1.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY])
        } else {
            self.pick(&[-1.0, 0.0, 0.5, 0.25, 0.875, 0.9])
        };
        let nesterov = self.chance(0.5);
        let params = self.selected(PARAM);
        let mut errs = Vec::new();
        let lr_ok = lr.is_finite() && lr > 0.0;
        let mu_ok = mu < 1.0; // negative, -inf too: the default 1 - 1/N; NaN fails
        if !lr_ok || !mu_ok {
            errs.push(INVALID_ARGUMENT);
        }
        if self.inconsistent(PARAM) {
            errs.push(INCONSISTENT);
        }
        if params.is_empty() {
            errs.push(INVALID_STATE); // no (consistent) PARAM
        }
        if (params.iter()).any(|&t| !is_float(self.tensors[t].spec().expect("consistent").1)) {
            errs.push(INVALID_ARGUMENT);
        }
        let want = if errs.is_empty() {
            let mut pred = self.contents();
            for &t in &params {
                let b = self.tensors[t].buf(0).clone();
                Self::set_all(&mut pred, t, &b);
            }
            Want::Ok(pred)
        } else {
            Want::Err(errs)
        };
        // SAFETY: valid handle.
        let st = self.call(
            format!("bmuf_init(lr {lr}, mu {mu}, nesterov {nesterov})"),
            want,
            |ctx| unsafe { dpsync_bmuf_init(ctx, lr, mu, nesterov) },
        );
        if st != OK {
            return;
        }
        let mu = if mu < 0.0 {
            1.0 - 1.0 / self.n as f64
        } else {
            mu
        };
        let params = (params.into_iter())
            .map(|t| {
                let tensor = &self.tensors[t];
                let b = tensor.buf(0);
                let state = match b {
                    Buf::F64(v) => State::F64(v.clone(), vec![0.0; v.len()]),
                    _ => State::F32(widen32(b), vec![0.0; b.len()]),
                };
                BmufParam {
                    name: tensor.name.clone(),
                    ptrs: (0..self.n).map(|r| addr(tensor.buf(r))).collect(),
                    count: b.len(),
                    dtype: b.dtype(),
                    state,
                }
            })
            .collect();
        self.bmuf = Some(Bmuf {
            lr,
            mu,
            nesterov,
            params,
        });
    }

    /// Whether the PARAMs registered now are those the filter was started over.
    fn bmuf_params_match(&self, bmuf: &Bmuf) -> bool {
        let now = self.selected(PARAM);
        now.len() == bmuf.params.len()
            && now.iter().all(|&t| {
                let tensor = &self.tensors[t];
                let (_, dtype, count) = tensor.spec().expect("consistent");
                bmuf.params.iter().any(|p| {
                    p.name == tensor.name
                        && p.dtype == dtype
                        && p.count == count
                        && (0..self.n).all(|r| addr(tensor.buf(r)) == p.ptrs[r])
                })
            })
    }

    fn op_bmuf_step(&mut self) {
        let started = (self.bmuf.as_ref()).is_some_and(|b| self.bmuf_params_match(b));
        if !started && self.chance(0.6) {
            self.op_bmuf_init();
        }
        let mut errs = Vec::new();
        match &self.bmuf {
            None => errs.push(INVALID_STATE),
            Some(b) if !self.inconsistent(PARAM) && !self.bmuf_params_match(b) => {
                errs.push(INVALID_STATE)
            }
            Some(_) => {}
        }
        if self.inconsistent(PARAM) {
            errs.extend([INCONSISTENT, INVALID_STATE]);
        }
        let mut new_state = Vec::new();
        let want = if errs.is_empty() {
            let bmuf = self.bmuf.as_ref().expect("started");
            let mut pred = self.contents();
            for p in &bmuf.params {
                let t = self.find(&p.name).expect("checked");
                let a = self.reduce(t, AVG);
                let mut state = p.state.clone();
                let out = match &mut state {
                    State::F64(w, d) => {
                        let Buf::F64(a) = &a else { unreachable!() };
                        let out = bmuf_filter(a, w, d, bmuf.mu, bmuf.lr, bmuf.nesterov);
                        Buf::F64(out)
                    }
                    State::F32(w, d) => {
                        let a = widen32(&a);
                        let (mu, lr) = (bmuf.mu as f32, bmuf.lr as f32);
                        narrow32(p.dtype, &bmuf_filter(&a, w, d, mu, lr, bmuf.nesterov))
                    }
                };
                Self::set_all(&mut pred, t, &out);
                new_state.push(state);
            }
            Want::Ok(pred)
        } else {
            Want::Err(errs)
        };
        // SAFETY: valid handle.
        let st = self.call("bmuf_step()".into(), want, |ctx| unsafe {
            dpsync_bmuf_step(ctx)
        });
        if st == OK {
            let bmuf = self.bmuf.as_mut().expect("started");
            for (p, s) in bmuf.params.iter_mut().zip(new_state) {
                p.state = s;
            }
        }
    }

    // ---- sparse gradients

    fn sparse_register_call(
        &mut self,
        name: &str,
        replica: usize,
        row_len: usize,
        values: u32,
        indices: u32,
        num_embeddings: usize,
    ) {
        let vdt = dtype_of(values).filter(|&d| is_float(d));
        let idt = dtype_of(indices).filter(|&d| !is_float(d));
        let s = self.find_sparse(name);
        let mut errs = Vec::new();
        if name.is_empty()
            || vdt.is_none()
            || idt.is_none()
            || replica >= self.n
            || row_len == 0
            || row_len.checked_mul(vdt.map_or(1, DType::size)).is_none()
        {
            errs.push(INVALID_ARGUMENT);
        }
        if self.find(name).is_some() {
            errs.push(CONFLICT);
        }
        let spec = vdt.zip(idt).map(|(v, i)| Spec {
            row_len,
            values: v,
            indices: i,
            num_embeddings,
        });
        if let Some(old) = s
            .filter(|_| replica < self.n)
            .and_then(|s| self.sparse[s].specs[replica])
        {
            if Some(old) != spec {
                errs.push(CONFLICT);
            }
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let what = format!(
            "register_sparse('{name}', replica {replica}, row_len {row_len}, values {values}, \
             indices {indices}, num_embeddings {num_embeddings})"
        );
        // SAFETY: valid handle and name.
        let st = self.call(what, want, |ctx| unsafe {
            dpsync_register_sparse(
                ctx,
                c.as_ptr(),
                replica,
                row_len,
                values,
                indices,
                num_embeddings,
            )
        });
        if st != OK {
            return;
        }
        let s = s.unwrap_or_else(|| {
            self.sparse.push(SparseM {
                name: name.to_owned(),
                specs: vec![None; self.n],
                slices: (0..self.n).map(|_| None).collect(),
                gathered: None,
            });
            self.sparse.len() - 1
        });
        self.sparse[s].specs[replica] = spec;
    }

    fn random_spec(&mut self) -> Spec {
        Spec {
            row_len: 1 + self.g.below(4) as usize,
            values: self.pick(&[DType::F32, DType::F64, DType::F16, DType::BF16]),
            indices: self.pick(&[DType::I32, DType::I64]),
            num_embeddings: self.pick(&[0, 5, 16, 1000]),
        }
    }

    fn op_sparse_register(&mut self) {
        let name = self.pick_name();
        let replica = self.pick_replica();
        let reference = self
            .find_sparse(&name)
            .and_then(|s| self.sparse[s].specs.iter().flatten().next().copied());
        let mut spec = self.random_spec();
        if let Some(r) = reference.filter(|_| self.g.below(10) < 7) {
            spec = r;
        }
        let (mut values, mut indices, mut row_len) =
            (spec.values.code(), spec.indices.code(), spec.row_len);
        match self.g.below(30) {
            0 => values = self.pick(&[I32, I64, 6]),
            1 => indices = self.pick(&[F32, F16, 9]),
            2 => row_len = self.pick(&[0, usize::MAX]),
            _ => {}
        }
        self.sparse_register_call(
            &name,
            replica,
            row_len,
            values,
            indices,
            spec.num_embeddings,
        );
    }

    fn op_sparse_register_all(&mut self) {
        if self.sparse.len() >= 3 {
            return self.op_sparse_set_all();
        }
        let Some(name) = self.free_name() else {
            return;
        };
        let spec = self.random_spec();
        let odd = if self.chance(0.1) {
            Some(self.g.below(self.n as u64) as usize)
        } else {
            None
        };
        self.note(format!("-- register sparse '{name}' on every replica"));
        for r in 0..self.n {
            let mut s = spec;
            if odd == Some(r) {
                if self.chance(0.5) {
                    continue;
                }
                s.row_len += 1;
            }
            let (v, i) = (s.values.code(), s.indices.code());
            self.sparse_register_call(&name, r, s.row_len, v, i, s.num_embeddings);
        }
    }

    /// One `dpsync_sparse_set` with fresh data: `rows` rows; a NULL pointer where asked; the
    /// indices memory of another slice (pointer and a copy of its contents) when `shared`.
    fn sparse_set_call(
        &mut self,
        name: &str,
        replica: usize,
        rows: usize,
        null: (bool, bool),
        shared: Option<(usize, Buf)>,
    ) -> bool {
        let s = self.find_sparse(name);
        let spec = s
            .filter(|_| replica < self.n)
            .and_then(|s| self.sparse[s].specs[replica]);
        let buf_spec = match spec {
            Some(spec) => spec,
            None => self.random_spec(),
        };
        let mut indices = Buf::zeros(buf_spec.indices, rows);
        let bad_row = if shared.is_none() && self.chance(0.05) && rows > 0 {
            Some(self.g.below(rows as u64) as usize)
        } else {
            None
        };
        for k in 0..rows {
            let i: i64 = if bad_row == Some(k) {
                if buf_spec.num_embeddings > 0 {
                    self.pick(&[-1, buf_spec.num_embeddings as i64, 1 << 40])
                } else {
                    -(1 + self.g.below(3) as i64)
                }
            } else if buf_spec.num_embeddings > 0 {
                // few distinct indices, so coalescing has duplicates to sum
                self.g.below(buf_spec.num_embeddings.min(6) as u64) as i64
            } else {
                self.g.below(9) as i64 - 2
            };
            match &mut indices {
                Buf::I32(v) => v[k] = i as i32,
                Buf::I64(v) => v[k] = i,
                _ => unreachable!(),
            }
        }
        let mut values = Buf::zeros(buf_spec.values, rows * buf_spec.row_len);
        fill_small(&mut values, &mut self.g);
        let null_both = rows == 0 && shared.is_none() && self.chance(0.7);
        let mut ip = if null.0 || null_both {
            ptr::null()
        } else {
            addr(&indices) as *const c_void
        };
        if let Some((p, copy)) = shared {
            assert!(rows <= copy.len(), "a shared indices buffer holds the rows");
            self.graveyard.push(std::mem::replace(&mut indices, copy));
            ip = p as *const c_void;
        }
        let vp = if null.1 || null_both {
            ptr::null()
        } else {
            addr(&values) as *const c_void
        };
        let mut errs = Vec::new();
        if name.is_empty() || (rows > 0 && (ip.is_null() || vp.is_null())) || replica >= self.n {
            errs.push(INVALID_ARGUMENT);
        }
        match s {
            None => errs.push(NOT_FOUND),
            Some(_) if replica < self.n && spec.is_none() => errs.push(INCONSISTENT),
            Some(_) => {}
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let what = format!(
            "sparse_set('{name}', replica {replica}, indices {}{:?}, {rows} rows{}{})",
            if ip.is_null() || addr(&indices) == ip as usize {
                ""
            } else {
                "shared "
            },
            &indices_list(&indices)[..rows.min(indices.len())],
            if ip.is_null() { ", NULL indices" } else { "" },
            if vp.is_null() { ", NULL values" } else { "" },
        );
        // SAFETY: the buffers stay alive (model or graveyard) until the step consumes them.
        let st = self.call(what, want, |ctx| unsafe {
            dpsync_sparse_set(ctx, c.as_ptr(), replica, ip, vp, rows)
        });
        if st == OK {
            let slot = &mut self.sparse[s.expect("found")].slices[replica];
            if let Some(old) = slot.replace(SliceM {
                indices,
                values,
                rows,
                indices_ptr: ip as usize,
            }) {
                self.graveyard.push(old.indices);
                self.graveyard.push(old.values);
            }
        } else {
            self.graveyard.push(indices);
            self.graveyard.push(values);
        }
        st == OK
    }

    /// Every sparse gradient's slice on every replica (sometimes one left out), or one random set.
    #[allow(clippy::needless_range_loop)] // `first[r]` is read and written per replica
    fn op_sparse_set_all(&mut self) {
        if self.sparse.is_empty() || self.chance(0.2) {
            let name = self.pick_name();
            let replica = self.pick_replica();
            let rows = self.g.below(5) as usize;
            let null = (self.chance(0.1), self.chance(0.1));
            self.sparse_set_call(&name, replica, rows, null, None);
            return;
        }
        // The first gradient's indices per replica: (pointer, copy), for later ones to share
        // (several value tensors of one embedding lookup).
        let mut first: Vec<Option<(usize, Buf)>> = vec![None; self.n];
        let names: Vec<String> = self.sparse.iter().map(|s| s.name.clone()).collect();
        for (k, name) in names.iter().enumerate() {
            let share = k > 0 && self.chance(0.4);
            for r in 0..self.n {
                if self.chance(0.04) {
                    continue;
                }
                let spec = self.sparse[self.find_sparse(name).expect("registered")].specs[r];
                let shared = match (first[r].as_ref(), spec) {
                    (Some((p, copy)), Some(spec)) if share && copy.dtype() == spec.indices => {
                        Some((*p, copy.clone()))
                    }
                    _ => None,
                };
                let rows = match &shared {
                    // the same rows, sometimes fewer (then gathered separately)
                    Some((_, copy)) if self.chance(0.85) => copy.len(),
                    Some((_, copy)) => self.g.below(copy.len() as u64 + 1) as usize,
                    None => self.g.below(6) as usize,
                };
                if self.sparse_set_call(name, r, rows, (false, false), shared) && k == 0 {
                    let s = &self.sparse[self.find_sparse(name).expect("registered")];
                    let sl = s.slices[r].as_ref().expect("just set");
                    if sl.indices_ptr != 0 {
                        first[r] = Some((sl.indices_ptr, sl.indices.clone()));
                    }
                }
            }
        }
    }

    /// What `dpsync_allreduce_grads` will find wrong with the sparse gradients (INCONSISTENT).
    fn sparse_step_fails(&self) -> bool {
        self.sparse.iter().any(|s| {
            let Some(spec) = s.spec() else {
                return true;
            };
            s.slices.iter().any(|sl| match sl {
                None => true,
                Some(sl) => {
                    spec.num_embeddings > 0
                        && (0..sl.rows).any(|k| {
                            let i = index_at(&sl.indices, k);
                            i < 0 || i >= spec.num_embeddings as i64
                        })
                }
            })
        })
    }

    /// The gathered slice of sparse gradient `s` after a successful step with `op`.
    fn gather(&self, s: usize, op: u32) -> Gathered {
        let entry = &self.sparse[s];
        let spec = entry.spec().expect("checked");
        let slices: Vec<&SliceM> = entry.slices.iter().map(|s| s.as_ref().unwrap()).collect();
        let (indices, values): (Vec<i64>, Vec<f64>) = if self.coalesce {
            let mut sums: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
            for sl in &slices {
                for k in 0..sl.rows {
                    let row = sums
                        .entry(index_at(&sl.indices, k))
                        .or_insert_with(|| vec![0.0; spec.row_len]);
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += value_at(&sl.values, k * spec.row_len + j);
                    }
                }
            }
            (
                sums.keys().copied().collect(),
                sums.into_values().flatten().collect(),
            )
        } else {
            let mut indices = Vec::new();
            let mut values = Vec::new();
            for sl in &slices {
                indices.extend((0..sl.rows).map(|k| index_at(&sl.indices, k)));
                values.extend((0..sl.values.len()).map(|i| value_at(&sl.values, i)));
            }
            (indices, values)
        };
        let mut values = buf_of(spec.values, &values);
        if op == AVG {
            values = divide_each(&values, self.n);
        }
        Gathered {
            rows: indices.len(),
            indices,
            values,
            share_key: slices.iter().map(|s| (s.indices_ptr, s.rows)).collect(),
        }
    }

    /// `dpsync_sparse_get`, checked; the indices pointer on success.
    fn sparse_get_call(&mut self, name: &str, replica: usize, null_out: bool) -> Option<usize> {
        let s = self.find_sparse(name);
        let mut errs = Vec::new();
        if name.is_empty() {
            errs.extend([INVALID_ARGUMENT, NOT_FOUND]);
        }
        if replica >= self.n || null_out {
            errs.push(INVALID_ARGUMENT);
        }
        match s {
            None => errs.push(NOT_FOUND),
            Some(s) if self.sparse[s].gathered.is_none() => errs.push(INVALID_STATE),
            Some(_) => {}
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let (mut ip, mut vp, mut rows) = (ptr::null::<c_void>(), ptr::null::<c_void>(), 0usize);
        let outs = if null_out {
            (ptr::null_mut(), ptr::null_mut(), ptr::null_mut())
        } else {
            (&mut ip as *mut _, &mut vp as *mut _, &mut rows as *mut _)
        };
        // SAFETY: valid handle, name and out pointers (or NULL, refused).
        let st = self.call(
            format!("sparse_get('{name}', {replica})"),
            want,
            |ctx| unsafe { dpsync_sparse_get(ctx, c.as_ptr(), replica, outs.0, outs.1, outs.2) },
        );
        if st != OK {
            return None;
        }
        let entry = &self.sparse[s.expect("found")];
        let spec = entry.spec().expect("gathered");
        let want = entry.gathered.as_ref().expect("gathered");
        if rows != want.rows {
            self.fail(format!(
                "sparse_get('{name}', {replica}): {rows} rows, the model predicts {} (indices {:?})",
                want.rows, want.indices
            ));
        }
        if rows == 0 {
            if !ip.is_null() || !vp.is_null() {
                self.fail(format!(
                    "sparse_get('{name}', {replica}): 0 rows but non-NULL outputs"
                ));
            }
            return Some(0);
        }
        // SAFETY: the library keeps `rows` indices and rows x row_len values there.
        let (got_i, got_v) = unsafe {
            (
                read_buf(spec.indices, ip, rows),
                read_buf(spec.values, vp, rows * spec.row_len),
            )
        };
        let got_i: Vec<i64> = (0..rows).map(|k| index_at(&got_i, k)).collect();
        if got_i != want.indices {
            self.fail(format!(
                "sparse_get('{name}', {replica}): indices {got_i:?}, the model predicts {:?}",
                want.indices
            ));
        }
        if let Some(i) = first_difference(&got_v, &want.values) {
            self.fail(format!(
                "sparse_get('{name}', {replica}): value {i} (row {}) is {}, the model predicts {}",
                i / spec.row_len,
                elem_str(&got_v, i),
                elem_str(&want.values, i)
            ));
        }
        Some(ip as usize)
    }

    fn op_sparse_get(&mut self) {
        let name = if !self.sparse.is_empty() && self.chance(0.8) {
            let i = self.g.below(self.sparse.len() as u64) as usize;
            self.sparse[i].name.clone()
        } else {
            self.pick_name()
        };
        let replica = self.pick_replica();
        let null_out = self.chance(0.03);
        self.sparse_get_call(&name, replica, null_out);
    }

    // ---- describe and the rest

    fn op_describe(&mut self) {
        let mut len = 0usize;
        let want = self.unchanged();
        // SAFETY: sizing call (NULL, 0).
        self.call("describe(NULL, 0)".into(), want, |ctx| unsafe {
            dpsync_describe(ctx, ptr::null_mut(), 0, &mut len)
        });
        let mut buf = vec![0xAAu8; len + 1];
        let mut len2 = 0usize;
        let want = self.unchanged();
        let p = buf.as_mut_ptr().cast::<c_char>();
        let cap = buf.len();
        // SAFETY: a buffer of len + 1 bytes.
        self.call("describe(buf, len + 1)".into(), want, |ctx| unsafe {
            dpsync_describe(ctx, p, cap, &mut len2)
        });
        if len2 != len || buf[len] != 0 {
            self.fail(format!(
                "describe: length {len2} (sizing said {len}), byte at len is {}",
                buf[len]
            ));
        }
        let text = String::from_utf8(buf[..len].to_vec())
            .unwrap_or_else(|_| self.fail("describe output is not UTF-8"));
        let json: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| self.fail(format!("describe is not JSON ({e}): {text}")));
        self.check_describe(&json, &text);
        if len > 0 && self.chance(0.3) {
            let cap = 1 + self.g.below(len as u64) as usize;
            let mut small = vec![0xAAu8; cap];
            let mut len3 = 0usize;
            let want = self.unchanged();
            let p = small.as_mut_ptr().cast::<c_char>();
            // SAFETY: a buffer of `cap` bytes.
            self.call(format!("describe(buf, {cap})"), want, |ctx| unsafe {
                dpsync_describe(ctx, p, cap, &mut len3)
            });
            if len3 != len || small[..cap - 1] != text.as_bytes()[..cap - 1] || small[cap - 1] != 0
            {
                self.fail(format!(
                    "describe into {cap} bytes: length {len3} (want {len}), not the truncated, \
                     NUL-terminated text"
                ));
            }
        }
        if self.chance(0.15) {
            // SAFETY: length NULL is refused.
            self.call(
                "describe(NULL, 0, length NULL)".into(),
                Want::Err(vec![INVALID_ARGUMENT]),
                |ctx| unsafe { dpsync_describe(ctx, ptr::null_mut(), 0, ptr::null_mut()) },
            );
        }
        if self.chance(0.15) {
            let mut l = 0usize;
            // SAFETY: buffer NULL with capacity > 0 is refused.
            self.call(
                "describe(NULL, 16)".into(),
                Want::Err(vec![INVALID_ARGUMENT]),
                |ctx| unsafe { dpsync_describe(ctx, ptr::null_mut(), 16, &mut l) },
            );
        }
    }

    /// The description agrees with the model (docs/API.md "Describing the plan", "Overlap",
    /// "BMUF", "Sparse gradients").
    fn check_describe(&self, j: &serde_json::Value, text: &str) {
        let fail = |what: String| -> ! { self.fail(format!("describe: {what}\n{text}")) };
        let replicas = j["replicas"]
            .as_array()
            .unwrap_or_else(|| fail("no replicas".into()));
        if replicas.len() != self.n || replicas.iter().any(|r| r["device"] != "host") {
            fail(format!("replicas should be {} host replicas", self.n));
        }
        if j["transport"] != "host" {
            fail("transport should be host".into());
        }
        if j["fusion_bytes"].as_u64() != Some(self.fusion as u64) {
            fail(format!("fusion_bytes should be {}", self.fusion));
        }
        let scale = j["loss_scale"].as_f64().unwrap_or(f64::NAN);
        if (scale - 1.0 / self.n as f64).abs() > 1e-12 {
            fail(format!("loss_scale {scale}, want 1/{}", self.n));
        }
        let consistent = self.tensors.iter().filter(|t| t.spec().is_some()).count();
        if j["tensors"].as_u64() != Some(consistent as u64) {
            fail(format!(
                "tensors should be {consistent} (the consistent ones)"
            ));
        }
        // buckets
        let mut want: Vec<(String, Vec<String>, u64, u64)> = (self.buckets().into_iter())
            .map(|b| {
                let bytes = (b.elements * b.dtype.size()) as u64;
                (b.dtype.name().to_owned(), b.names, b.elements as u64, bytes)
            })
            .collect();
        let mut got: Vec<(String, Vec<String>, u64, u64)> = (j["buckets"].as_array())
            .unwrap_or_else(|| fail("no buckets".into()))
            .iter()
            .map(|b| {
                let names = (b["tensors"].as_array().into_iter().flatten())
                    .map(|n| n.as_str().unwrap_or("?").to_owned())
                    .collect();
                let dtype = b["dtype"].as_str().unwrap_or("?").to_owned();
                let elements = b["elements"].as_u64().unwrap_or(u64::MAX);
                (
                    dtype,
                    names,
                    elements,
                    b["bytes"].as_u64().unwrap_or(u64::MAX),
                )
            })
            .collect();
        want.sort();
        got.sort();
        if got != want {
            fail(format!("buckets {got:?}, the model predicts {want:?}"));
        }
        // problems: one per inconsistent dense name or sparse gradient, naming it
        let mut bad: Vec<&str> = (self.tensors.iter())
            .filter(|t| t.spec().is_none())
            .map(|t| t.name.as_str())
            .collect();
        bad.extend(
            (self.sparse.iter())
                .filter(|s| s.spec().is_none())
                .map(|s| s.name.as_str()),
        );
        let problems: Vec<&str> = (j["problems"].as_array())
            .unwrap_or_else(|| fail("no problems list".into()))
            .iter()
            .map(|p| p.as_str().unwrap_or(""))
            .collect();
        if problems.len() != bad.len()
            || !bad
                .iter()
                .all(|n| problems.iter().any(|p| p.contains(&format!("'{n}'"))))
        {
            fail(format!(
                "problems {problems:?}, the model's inconsistent names {bad:?}"
            ));
        }
        // sparse gradients
        let mut sparse_got: Vec<&str> = (j["sparse"].as_array().into_iter().flatten())
            .map(|s| s["name"].as_str().unwrap_or("?"))
            .collect();
        let mut sparse_want: Vec<&str> = (self.sparse.iter())
            .filter(|s| s.spec().is_some())
            .map(|s| s.name.as_str())
            .collect();
        sparse_got.sort_unstable();
        sparse_want.sort_unstable();
        if sparse_got != sparse_want {
            fail(format!(
                "sparse {sparse_got:?}, the model has {sparse_want:?}"
            ));
        }
        // overlap
        let o = &j["overlap"];
        let (marks, early) = match &self.marks {
            Some(m) => (m.ready.len(), m.reduced.iter().filter(|&&r| r).count()),
            None => (0, 0),
        };
        let op = match self.last_op {
            Some(SUM) => serde_json::json!("SUM"),
            Some(_) => serde_json::json!("AVG"),
            None => serde_json::Value::Null,
        };
        if o["marks_this_step"].as_u64() != Some(marks as u64)
            || o["buckets_reduced_early_this_step"].as_u64() != Some(early as u64)
            || o["buckets_reduced_early_last_step"].as_u64() != Some(self.last_step_early as u64)
            || o["op"] != op
        {
            fail(format!(
                "overlap {o}, the model has {marks} marks, {early} early buckets, {} last step, \
                 op {op}",
                self.last_step_early
            ));
        }
        // BMUF
        match &self.bmuf {
            None if !j["bmuf"].is_null() => fail("bmuf shown before a successful bmuf_init".into()),
            None => {}
            Some(b) => {
                let mu = j["bmuf"]["block_momentum"].as_f64().unwrap_or(f64::NAN);
                let lr = j["bmuf"]["block_lr"].as_f64().unwrap_or(f64::NAN);
                if (mu - b.mu).abs() > 1e-12
                    || (lr - b.lr).abs() > 1e-12
                    || j["bmuf"]["nesterov"] != b.nesterov
                    || j["bmuf"]["tensors"].as_u64() != Some(b.params.len() as u64)
                {
                    fail(format!(
                        "bmuf {}, the model has mu {}, lr {}, nesterov {}, {} tensors",
                        j["bmuf"],
                        b.mu,
                        b.lr,
                        b.nesterov,
                        b.params.len()
                    ));
                }
            }
        }
    }

    fn op_misc(&mut self) {
        let n = self.n;
        match self.g.below(9) {
            0 => {
                let mut out = 0usize;
                let want = self.unchanged();
                // SAFETY: valid handle and out pointer.
                self.call("replica_count".into(), want, |ctx| unsafe {
                    dpsync_replica_count(ctx, &mut out)
                });
                if out != n {
                    self.fail(format!("replica_count {out}, want {n}"));
                }
            }
            1 => {
                let mut out = 0f64;
                let want = self.unchanged();
                // SAFETY: valid handle and out pointer.
                self.call("loss_scale".into(), want, |ctx| unsafe {
                    dpsync_loss_scale(ctx, &mut out)
                });
                if out != 1.0 / n as f64 {
                    self.fail(format!("loss_scale {out}, want 1/{n}"));
                }
            }
            2 => {
                // SAFETY: NULL out pointers are refused.
                self.call(
                    "replica_count(NULL)".into(),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |ctx| unsafe { dpsync_replica_count(ctx, ptr::null_mut()) },
                );
                // SAFETY: as above.
                self.call(
                    "loss_scale(NULL)".into(),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |ctx| unsafe { dpsync_loss_scale(ctx, ptr::null_mut()) },
                );
            }
            3 => {
                let want = self.unchanged();
                // SAFETY: valid handle.
                self.call("synchronize".into(), want, |ctx| unsafe {
                    dpsync_synchronize(ctx)
                });
            }
            4 => {
                let r = self.pick_replica();
                // SAFETY: host replicas refuse streams.
                self.call(
                    format!("set_stream({r}, NULL)"),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |ctx| unsafe { dpsync_set_stream(ctx, r, ptr::null_mut()) },
                );
            }
            5 => {
                let op = self.pick_op();
                // SAFETY: a NULL context is refused.
                self.call(
                    "allreduce_grads(NULL context)".into(),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |_| unsafe { dpsync_allreduce_grads(ptr::null_mut(), op) },
                );
            }
            6 => {
                // An invalid UTF-8 name is refused before anything else is looked at.
                let bad = c"w\xff\xfe";
                let r = self.pick_replica();
                let mut data = Buf::zeros(DType::F32, 1);
                let p = data.ptr();
                self.graveyard.push(data);
                let which = self.g.below(4);
                let what = ["unregister", "allreduce", "grad_ready", "register"][which as usize];
                // SAFETY: valid handle, NUL-terminated name, live data.
                self.call(
                    format!("{what}(invalid UTF-8 name)"),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |c| unsafe {
                        match which {
                            0 => dpsync_unregister(c, bad.as_ptr()),
                            1 => dpsync_allreduce(c, bad.as_ptr(), SUM),
                            2 => dpsync_grad_ready(c, bad.as_ptr(), r),
                            _ => dpsync_register(c, bad.as_ptr(), GRAD, r, p, 1, F32),
                        }
                    },
                );
            }
            7 => {
                let r = self.pick_replica();
                let which = self.g.below(3);
                let what = ["unregister", "grad_ready", "sparse_set"][which as usize];
                // SAFETY: a NULL name is refused before anything is read.
                self.call(
                    format!("{what}(NULL name)"),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |c| unsafe {
                        match which {
                            0 => dpsync_unregister(c, ptr::null()),
                            1 => dpsync_grad_ready(c, ptr::null(), r),
                            _ => dpsync_sparse_set(c, ptr::null(), r, ptr::null(), ptr::null(), 0),
                        }
                    },
                );
            }
            _ => {
                // The version and status names are static strings.
                // SAFETY: static NUL-terminated strings.
                let v = unsafe { CStr::from_ptr(dpsync_version()) };
                if v.to_str() != Ok(env!("CARGO_PKG_VERSION")) {
                    self.fail(format!("version {v:?}"));
                }
                for code in 0..=LAST_STATUS {
                    if !status_name(code).starts_with("DPSYNC_STATUS_") {
                        self.fail(format!("status name of {code}"));
                    }
                }
            }
        }
    }
}

fn indices_list(b: &Buf) -> Vec<i64> {
    (0..b.len()).map(|k| index_at(b, k)).collect()
}

/// One sequence: a context with random options, CALLS checked calls, a final describe check.
fn run_sequence(seed: u64) {
    let mut sim = Sim::new(seed);
    sim.note(format!(
        "-- context: {} host replicas, fusion_bytes {:?}, coalesce {}",
        sim.n, sim.fusion_set, sim.coalesce
    ));
    while sim.calls < CALLS {
        sim.random_op();
    }
    sim.op_describe();
    // Nothing registered is freed before the context: `sim.ctx` is dropped first.
    drop(sim);
}

fn run_seeds(first: u64) {
    let only: Option<u64> = std::env::var("DPSYNC_SEQ_SEED")
        .ok()
        .map(|s| s.parse().expect("DPSYNC_SEQ_SEED is a number"));
    for seed in first..first + SEQUENCES_PER_TEST {
        if only.is_none_or(|o| o == seed) {
            run_sequence(seed);
        }
    }
}

#[test]
fn random_call_sequences_seeds_0_to_24() {
    run_seeds(0);
}

#[test]
fn random_call_sequences_seeds_25_to_49() {
    run_seeds(25);
}

#[test]
fn random_call_sequences_seeds_50_to_74() {
    run_seeds(50);
}

#[test]
fn random_call_sequences_seeds_75_to_99() {
    run_seeds(75);
}
