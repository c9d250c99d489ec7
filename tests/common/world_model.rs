//! The model of the randomized cross-rank tests (tests/world_random.rs on host replicas,
//! tests/world_random_cuda.rs on CUDA replicas; the calls themselves: common/world_calls.rs):
//! their settings, the calls drawn and the outcomes expected, every tensor's values as exact
//! f64 (small integers, so that every sum is exact in every dtype), the library's rounding of
//! AVG and BMUF, the sparse slices of a step, and where the memory lives ([`Where`]: host
//! buffers, or device memory of CUDA replicas).

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ops::{Add, Mul, Sub};
use std::ptr;

use super::abi::*;
use super::buf::{Buf, DType};
use super::context::Context;
use super::float16::*;
use super::lcg::Lcg;
use super::place::{download, Mem, Place};
use super::sparse::SparseOut;
use dpsync::*;

mod calls;
mod draws;
mod memory;
pub use calls::*;
pub use draws::*;
pub use memory::*;

/// Deviations (one rank differs) and cases that `DPSYNC_RANDOM_NO` switches off: `boundary`
/// (an argument the C boundary refuses), `sparse_uneven` (marks that start buckets on some
/// ranks only, in steps with sparse gradients), `sparse_share` (index buffers shared on some
/// replicas only, NULL for empty slices), whole kinds of calls (`marks`, `sparse`, `bmuf`,
/// `shards`: reduce-scatter steps and allgathers), the reproducible-sum option (`repro`,
/// drawn per seed) and ranks leaving (`leave`: `dpsync_leave` at random calls of some seeds).
pub const CLASSES: [&str; 20] = [
    "op",
    "name",
    "root",
    "roles",
    "bmuf_args",
    "call",
    "register",
    "local",
    "benign",
    "boundary",
    "sparse_index",
    "sparse_extra",
    "sparse_uneven",
    "sparse_share",
    "marks",
    "sparse",
    "bmuf",
    "shards",
    "repro",
    "leave",
];

pub fn env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

pub fn env_num(key: &str, default: u64) -> u64 {
    env(key).map_or(default, |v| v.trim().parse().expect(key))
}

/// The seeds variable `key` names (`N`: seeds 0..N-1, or `A..B`), else `0..default`.
pub fn seeds_from(key: &str, default: u64) -> Vec<u64> {
    let num = |s: &str| -> u64 { s.trim().parse().expect("seeds: N or A..B") };
    match env(key) {
        None => (0..default).collect(),
        Some(s) => match s.split_once("..") {
            Some((a, b)) => (num(a)..=num(b)).collect(),
            None => (0..num(&s)).collect(),
        },
    }
}

pub struct Config {
    pub seeds: Vec<u64>,
    /// Elastic worlds in which one rank kills itself at a random call (tests/world_random.rs
    /// `kill_body`, under an MPI with ULFM): one seed per mpirun, since the lost rank's
    /// process is gone.
    pub kill: bool,
    pub calls: usize,
    pub off: Vec<String>,
    pub timeout_ms: u64,
    pub trace: bool,
}

impl Config {
    /// The settings from the environment; without it, seeds `0..seeds` of `calls` calls each.
    pub fn from_env(seeds: u64, calls: u64) -> Config {
        let seeds = seeds_from("DPSYNC_RANDOM_SEEDS", seeds);
        let off: Vec<String> = env("DPSYNC_RANDOM_NO")
            .map(|v| v.split(',').map(|c| c.trim().to_owned()).collect())
            .unwrap_or_default();
        for c in &off {
            assert!(
                CLASSES.contains(&c.as_str()),
                "DPSYNC_RANDOM_NO: no class '{c}'"
            );
        }
        Config {
            seeds,
            kill: false,
            calls: env_num("DPSYNC_RANDOM_CALLS", calls) as usize,
            off,
            timeout_ms: env_num("DPSYNC_RANDOM_TIMEOUT_MS", 20_000),
            trace: env("DPSYNC_RANDOM_TRACE").is_some_and(|v| v != "0"),
        }
    }

    pub fn on(&self, class: &str) -> bool {
        !self.off.iter().any(|c| c == class)
    }
}

/// What a run did: calls, failures (each expected), and per class the deviations whose
/// outcome was as expected, the cases exercised and the calls that succeeded.
#[derive(Default)]
pub struct Tally {
    pub calls: usize,
    pub failed: usize,
    pub seen: BTreeMap<&'static str, usize>,
}

impl Tally {
    pub fn count(&mut self, class: &'static str) {
        *self.seen.entry(class).or_default() += 1;
    }

    pub fn add(&mut self, o: &Tally) {
        self.calls += o.calls;
        self.failed += o.failed;
        (o.seen.iter()).for_each(|(k, v)| *self.seen.entry(k).or_default() += v);
    }

    pub fn line(&self) -> String {
        let seen: Vec<String> = self.seen.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let (calls, failed) = (self.calls, self.failed);
        format!(
            "{calls} calls, {failed} failed as expected; seen: {}",
            seen.join(", ")
        )
    }
}

// ------------------------------------------------------------------ values and arithmetic

/// A buffer's elements as f64 (exact for every dtype at these magnitudes).
pub fn vals_of(b: &Buf) -> Vec<f64> {
    match b {
        Buf::F32(v) => v.iter().map(|&x| x as f64).collect(),
        Buf::F64(v) => v.clone(),
        Buf::F16(v) => v.iter().map(|&x| f16_to_f32(x) as f64).collect(),
        Buf::BF16(v) => v.iter().map(|&x| bf16_to_f32(x) as f64).collect(),
        Buf::I32(v) => v.iter().map(|&x| x as f64).collect(),
        Buf::I64(v) => v.iter().map(|&x| x as f64).collect(),
    }
}

/// Writes `vals` into the first elements of `b`, rounded to its dtype.
pub fn store(b: &mut Buf, vals: &[f64]) {
    let z = vals.iter();
    match b {
        Buf::F32(v) => v.iter_mut().zip(z).for_each(|(o, &x)| *o = x as f32),
        Buf::F64(v) => v.iter_mut().zip(z).for_each(|(o, &x)| *o = x),
        Buf::F16(v) => v
            .iter_mut()
            .zip(z)
            .for_each(|(o, &x)| *o = f32_to_f16(x as f32)),
        Buf::BF16(v) => v
            .iter_mut()
            .zip(z)
            .for_each(|(o, &x)| *o = f32_to_bf16(x as f32)),
        Buf::I32(v) => v.iter_mut().zip(z).for_each(|(o, &x)| *o = x as i32),
        Buf::I64(v) => v.iter_mut().zip(z).for_each(|(o, &x)| *o = x as i64),
    }
}

/// A buffer of at least `min` elements holding `vals` (min 1: an address of its own even
/// when empty; 0: an empty buffer's dangling address).
pub fn make_buf(dt: DType, vals: &[f64], min: usize) -> Buf {
    let mut b = Buf::zeros(dt, vals.len().max(min));
    store(&mut b, vals);
    b
}

pub fn round(dt: DType, x: f64) -> f64 {
    vals_of(&make_buf(dt, &[x], 1))[0]
}

/// `sum / n` as the library computes AVG (docs/API.md "Exact arithmetic"): f16/bf16 divided
/// in f32 and rounded once, integers truncated.
pub fn avg(dt: DType, sum: f64, n: usize) -> f64 {
    match dt {
        DType::F64 => sum / n as f64,
        DType::I32 | DType::I64 => (sum as i64 / n as i64) as f64,
        _ => round(dt, (sum as f32 / n as f32) as f64),
    }
}

/// The allreduce of the world replicas' values (sums of small integers: exact in any order).
pub fn reduce(dt: DType, world: &[Vec<f64>], op: u32) -> Vec<f64> {
    let n = world.len();
    let sum = |i: usize| world.iter().map(|v| v[i]).sum::<f64>();
    (0..world[0].len())
        .map(|i| match op {
            SUM => round(dt, sum(i)),
            _ => avg(dt, sum(i), n),
        })
        .collect()
}

/// One element of the BMUF filter in its state type `T`, operations rounded as written:
/// `x` = [A, W, D, mu, eta]; returns [param (before rounding to its dtype), W, D].
pub fn filter<T>(x: [f64; 5], nesterov: bool, to: fn(f64) -> T, from: fn(T) -> f64) -> [f64; 3]
where
    T: Copy + Add<Output = T> + Sub<Output = T> + Mul<Output = T>,
{
    let [a, w, d, mu, eta] = x.map(to);
    let wg = if nesterov { w + mu * d } else { w };
    let d2 = mu * d + eta * (a - wg);
    let w2 = w + d2;
    let p = if nesterov { w2 + mu * d2 } else { w2 };
    [from(p), from(w2), from(d2)]
}

/// The library's default `dpsync_options_set_fusion_bytes`.
pub const DEFAULT_FUSION_BYTES: usize = 25 << 20;

/// The buckets of the GRADs among `dense` (registration order), as tensor indices: the last
/// registered first, packed per dtype into buckets of at most `fusion` bytes (a larger tensor
/// alone), in the order of their first tensor: the order they start in (src/plan/buckets.rs).
pub fn buckets(dense: &[Dense], fusion: usize) -> Vec<Vec<usize>> {
    // (position of the first tensor, dtype, bytes, tensors); one open bucket per dtype.
    let mut done: Vec<(usize, DType, usize, Vec<usize>)> = Vec::new();
    let mut open: Vec<(usize, DType, usize, Vec<usize>)> = Vec::new();
    let grads = (0..dense.len()).rev().filter(|&t| dense[t].role == GRAD);
    for (pos, t) in grads.enumerate() {
        let (dt, count) = (dense[t].dtype, dense[t].vals[0].len());
        let bytes = count * dt.size();
        if let Some(slot) = open.iter().position(|b| b.1 == dt) {
            if open[slot].2 + bytes <= fusion {
                open[slot].2 += bytes;
                open[slot].3.push(t);
                continue;
            }
            done.push(open.swap_remove(slot));
        }
        open.push((pos, dt, bytes, vec![t]));
    }
    done.extend(open);
    done.sort_by_key(|b| b.0);
    done.into_iter().map(|b| b.3).collect()
}

/// Bit for bit (the library's bytes, not just equal values).
pub fn same(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

// ------------------------------------------------------------------ the model's state

pub struct Dense {
    pub name: String,
    pub role: u32,
    pub dtype: DType,
    /// Tells registrations apart (BMUF's PARAM set).
    pub id: u64,
    /// Expected values on every world replica.
    pub vals: Vec<Vec<f64>>,
    /// This rank's registered memory, one per local replica.
    pub bufs: Vec<Store>,
}

pub struct Sparse {
    pub name: String,
    pub row_len: usize,
    pub vdt: DType,
    pub idt: DType,
    pub num_emb: usize,
    /// The last successful step's gathered slice (indices, values), the same on every replica.
    pub out: Option<(Vec<i64>, Vec<f64>)>,
}

impl Sparse {
    /// A gathered slice as (indices, values), read where `at` keeps this rank's replicas; None
    /// when a 0-row slice has non-NULL pointers.
    pub fn read(&self, o: SparseOut, at: &Where) -> Option<(Vec<i64>, Vec<f64>)> {
        if o.rows == 0 && !(o.indices.is_null() && o.values.is_null()) {
            return None;
        }
        let (rows, (idt, vdt)) = (o.rows, (self.idt, self.vdt));
        let idx = vals_of(&buf_of(idt, &at.fetch(o.indices, rows * idt.size())));
        let n = rows * self.row_len * vdt.size();
        let vals = vals_of(&buf_of(vdt, &at.fetch(o.values, n)));
        Some((idx.into_iter().map(|i| i as i64).collect(), vals))
    }

    /// The gathered slice of `idx` / `val` (per world replica): every replica's rows in world
    /// order, or with coalescing the sorted unique indices with their rows summed; AVG divides
    /// the values by the world's replicas.
    pub fn gathered(
        &self,
        idx: &[Vec<i64>],
        val: &[Vec<f64>],
        coalesce: bool,
        op: u32,
    ) -> (Vec<i64>, Vec<f64>) {
        let fin = |x: f64| {
            if op == AVG {
                avg(self.vdt, x, idx.len())
            } else {
                x
            }
        };
        if !coalesce {
            return (idx.concat(), val.concat().into_iter().map(fin).collect());
        }
        let mut rows: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
        for (idx, val) in idx.iter().zip(val) {
            for (j, &i) in idx.iter().enumerate() {
                let row = rows.entry(i).or_insert(vec![0.0; self.row_len]);
                let add = &val[j * self.row_len..];
                row.iter_mut().zip(add).for_each(|(x, a)| *x += a);
            }
        }
        let values = rows.values().flatten().map(|&x| fin(x)).collect();
        (rows.into_keys().collect(), values)
    }
}

pub struct Bmuf {
    pub lr: f64,
    /// Resolved (the default 1 - 1/N).
    pub mu: f64,
    /// `mu` is the default: recounted when the world loses replicas.
    pub default_mu: bool,
    pub nesterov: bool,
    /// The PARAMs `bmuf_init` took (name, id), their W and D.
    pub params: Vec<(String, u64)>,
    pub w: Vec<Vec<f64>>,
    pub d: Vec<Vec<f64>>,
}

/// One `dpsync_sparse_set`: the index buffer (into [`Slices::bufs`]), the pointers, rows.
pub type SliceSet = (Option<usize>, *const c_void, *const c_void, usize);

/// One step's sparse slices: every world replica's rows, and this rank's buffers.
#[derive(Default)]
pub struct Slices {
    /// `[s][w]`.
    pub idx: Vec<Vec<Vec<i64>>>,
    pub val: Vec<Vec<Vec<f64>>>,
    /// Kept alive until the step ends (a failed step consumes no slice).
    pub bufs: Vec<Store>,
    /// `[s][k]`: what `dpsync_sparse_set` gets.
    pub set: Vec<Vec<SliceSet>>,
    /// Gradients whose indices are the previous gradient's buffer on every world replica.
    pub shared: Vec<usize>,
    /// `[s][w]`: gradient `s` has the previous one's index buffer on world replica `w`.
    pub with_prev: Vec<Vec<bool>>,
}

impl Slices {
    pub fn push(&mut self, mut b: Store) -> (Option<usize>, *const c_void) {
        let p = b.ptr() as *const c_void;
        self.bufs.push(b);
        (Some(self.bufs.len() - 1), p)
    }

    /// Without world replicas `first..first + n` (a rank lost): their rows are no longer
    /// gathered.
    pub fn drop_replicas(&mut self, first: usize, n: usize) {
        self.idx
            .iter_mut()
            .for_each(|v| drop(v.drain(first..first + n)));
        self.val
            .iter_mut()
            .for_each(|v| drop(v.drain(first..first + n)));
        (self.with_prev.iter_mut()).for_each(|v| drop(v.drain(first..first + n)));
    }

    /// Sets index 0 of gradient `s`'s slice on local replica `k` to `v`; the old value.
    pub fn poke(&mut self, s: usize, k: usize, v: i64) -> i64 {
        match &mut self.bufs[self.set[s][k].0.expect("rows")] {
            Store::Host(Buf::I32(x)) => std::mem::replace(&mut x[0], v as i32) as i64,
            Store::Host(Buf::I64(x)) => std::mem::replace(&mut x[0], v),
            Store::Host(_) => unreachable!("indices are i32 or i64"),
            b => {
                // Small indices: exact as f64.
                let mut x = b.vals();
                let old = std::mem::replace(&mut x[0], v as f64);
                b.set(&x);
                old as i64
            }
        }
    }
}
