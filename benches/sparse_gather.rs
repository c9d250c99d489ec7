//! Sparse gradient gather on host replicas through the C ABI, plain vs coalesced, side by side
//! in one run: an embedding table of 1 M rows x 64 f32, 4 replicas x 4096 rows per step, indices
//! drawn from Zipf(1.1) (a skewed stream: a few rows are hit very often). For each mode: the time
//! of one `dpsync_allreduce_grads` (the gather, coalescing included), the bytes it copied (from
//! `dpsync_describe`), the gathered rows, and the time to scatter-add the gathered slice into
//! one replica's table (what the optimizer does next), so the end-to-end cost is visible too.
//! Run: `cargo bench --bench sparse_gather` (`-- --quick` for a short smoke run). Figures go to
//! docs/PERFORMANCE.md.

use std::ffi::{c_void, CString};
use std::hint::black_box;
use std::time::{Duration, Instant};

use dpsync::*;

#[path = "common/mod.rs"]
mod common;
use common::*;

const TABLE_ROWS: usize = 1 << 20;
const ROW_LEN: usize = 64;
const REPLICAS: usize = 4;
const ROWS_PER_REPLICA: usize = 4096;
const ZIPF_S: f64 = 1.1;

/// SplitMix64: small, fast, good enough for a benchmark's index stream.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s) over ranks 1..=n by inverse transform: P(rank k) ∝ k^-s, sampled by a binary search
/// in the cumulative weights. Rank k is returned as row k - 1, so row 0 is the most frequent.
struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|k| {
                total += (k as f64).powf(-s);
                total
            })
            .collect();
        Zipf { cumulative }
    }

    fn sample(&self, rng: &mut Rng) -> i64 {
        let total = *self.cumulative.last().expect("n >= 1");
        let u = rng.unit() * total;
        let row = self.cumulative.partition_point(|&c| c <= u);
        row.min(self.cumulative.len() - 1) as i64
    }
}

/// The benchmark's context: host replicas with the embedding gradient registered.
fn sparse_context(coalesce: bool) -> Context {
    let o = Options::host(REPLICAS);
    o.set_sparse_coalesce(coalesce);
    let ctx = Context::new(&o);
    let name = CString::new("emb_grad").unwrap();
    for r in 0..REPLICAS {
        // SAFETY: a live context and name.
        unsafe {
            check(dpsync_register_sparse(
                ctx.0,
                name.as_ptr(),
                r,
                ROW_LEN,
                F32,
                I64,
                TABLE_ROWS,
            ))
        };
    }
    ctx
}

impl Context {
    /// Sets every replica's slice and runs the step.
    fn step(&self, step: &Step) {
        let name = CString::new("emb_grad").unwrap();
        for r in 0..REPLICAS {
            unsafe {
                check(dpsync_sparse_set(
                    self.0,
                    name.as_ptr(),
                    r,
                    step.indices[r].as_ptr() as *const c_void,
                    step.values[r].as_ptr() as *const c_void,
                    ROWS_PER_REPLICA,
                ));
            }
        }
        unsafe { check(dpsync_allreduce_grads(self.0, SUM)) };
    }

    /// Replica 0's gathered slice.
    fn gathered(&self) -> (&[i64], &[f32]) {
        let name = CString::new("emb_grad").unwrap();
        let (mut i, mut v, mut rows) = (std::ptr::null(), std::ptr::null(), 0usize);
        unsafe {
            check(dpsync_sparse_get(
                self.0,
                name.as_ptr(),
                0,
                &mut i,
                &mut v,
                &mut rows,
            ));
            if rows == 0 {
                return (&[], &[]);
            }
            (
                std::slice::from_raw_parts(i as *const i64, rows),
                std::slice::from_raw_parts(v as *const f32, rows * ROW_LEN),
            )
        }
    }

    /// Bytes the last step copied, from dpsync_describe.
    fn bytes_copied(&self) -> usize {
        self.describe_json()["sparse_last_step"]["bytes_copied"]
            .as_u64()
            .expect("bytes_copied") as usize
    }
}

/// One step's slices: 4096 Zipf indices and their rows on every replica.
struct Step {
    indices: Vec<Vec<i64>>,
    values: Vec<Vec<f32>>,
}

fn make_step(zipf: &Zipf, rng: &mut Rng) -> Step {
    let indices = (0..REPLICAS)
        .map(|_| (0..ROWS_PER_REPLICA).map(|_| zipf.sample(rng)).collect())
        .collect();
    let values = (0..REPLICAS)
        .map(|_| {
            (0..ROWS_PER_REPLICA * ROW_LEN)
                .map(|_| (rng.unit() - 0.5) as f32 * 1e-2)
                .collect()
        })
        .collect();
    Step { indices, values }
}

/// table[index] -= lr * row, for every gathered row: the optimizer's scatter-add.
fn apply(table: &mut [f32], indices: &[i64], values: &[f32]) {
    for (k, &i) in indices.iter().enumerate() {
        let row = &mut table[i as usize * ROW_LEN..(i as usize + 1) * ROW_LEN];
        for (t, v) in row.iter_mut().zip(&values[k * ROW_LEN..(k + 1) * ROW_LEN]) {
            *t -= 0.1 * v;
        }
    }
}

#[derive(Default)]
struct Figures {
    gather: Vec<Duration>,
    apply: Vec<Duration>,
    bytes: Vec<usize>,
    rows: Vec<usize>,
}

impl Figures {
    fn run(&mut self, ctx: &Context, step: &Step, table: &mut [f32]) {
        let t = Instant::now();
        ctx.step(step);
        self.gather.push(t.elapsed());
        let (indices, values) = ctx.gathered();
        let t = Instant::now();
        apply(table, indices, values);
        black_box(&table[0]);
        self.apply.push(t.elapsed());
        self.bytes.push(ctx.bytes_copied());
        self.rows.push(indices.len());
    }

    fn mean<T: Copy + Into<f64>>(v: &[T]) -> f64 {
        v.iter().map(|&x| x.into()).sum::<f64>() / v.len() as f64
    }

    fn bytes(&self) -> f64 {
        Self::mean(&self.bytes.iter().map(|&b| b as f64).collect::<Vec<_>>())
    }

    fn rows(&self) -> f64 {
        Self::mean(&self.rows.iter().map(|&r| r as f64).collect::<Vec<_>>())
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let steps = if quick { 3 } else { 21 };
    println!(
        "dpsync {} sparse gather, {} hardware threads{}: {REPLICAS} host replicas x \
         {ROWS_PER_REPLICA} rows/step, table {TABLE_ROWS} x {ROW_LEN} f32, Zipf({ZIPF_S}) indices, \
         {steps} steps (medians of times, means of bytes/rows)",
        env!("CARGO_PKG_VERSION"),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        if quick { " (quick)" } else { "" }
    );
    let zipf = Zipf::new(TABLE_ROWS, ZIPF_S);
    let mut rng = Rng(2024);
    let plain_ctx = sparse_context(false);
    let coalesced_ctx = sparse_context(true);
    // Written once here so that page faults on first touch do not land in the timed scatter-adds.
    let mut table = vec![0.5f32; TABLE_ROWS * ROW_LEN];
    let (mut plain, mut coalesced) = (Figures::default(), Figures::default());
    let mut unique_per_replica = Vec::new();
    // A warm-up step for both, then alternate so that both see the same machine state.
    let warm = make_step(&zipf, &mut rng);
    plain_ctx.step(&warm);
    coalesced_ctx.step(&warm);
    for s in 0..steps {
        let step = make_step(&zipf, &mut rng);
        for ix in &step.indices {
            let mut v = ix.clone();
            v.sort_unstable();
            v.dedup();
            unique_per_replica.push(v.len() as f64);
        }
        // Alternate which goes first, so neither always sees the caches the other warmed.
        if s % 2 == 0 {
            plain.run(&plain_ctx, &step, &mut table);
            coalesced.run(&coalesced_ctx, &step, &mut table);
        } else {
            coalesced.run(&coalesced_ctx, &step, &mut table);
            plain.run(&plain_ctx, &step, &mut table);
        }
    }
    let unique = Figures::mean(&unique_per_replica);
    println!(
        "stream: {unique:.0} unique of {ROWS_PER_REPLICA} rows per replica on average ({:.0} %)",
        100.0 * unique / ROWS_PER_REPLICA as f64
    );
    let mib = |b: f64| b / (1 << 20) as f64;
    for (label, f) in [("plain    ", &plain), ("coalesced", &coalesced)] {
        let (g, a) = (median(f.gather.clone()), median(f.apply.clone()));
        println!(
            "{label}: gather {:.2} ms, {:.1} MiB copied, {:.0} rows gathered | scatter-add into \
             one table {:.2} ms | end to end {:.2} ms",
            ms(g),
            mib(f.bytes()),
            f.rows(),
            ms(a),
            ms(g + a)
        );
    }
    // Baseline: one memcpy of the plain gather's bytes into memory that is reused (no page
    // faults): the floor for a gather that copies every row.
    let bytes = plain.bytes() as usize;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let copies: Vec<Duration> = (0..steps)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
            t.elapsed()
        })
        .collect();
    println!(
        "baseline : one memcpy of {:.1} MiB into reused memory {:.2} ms",
        mib(bytes as f64),
        ms(median(copies))
    );
    let (pg, cg) = (
        median(plain.gather.clone()),
        median(coalesced.gather.clone()),
    );
    let (pa, ca) = (median(plain.apply.clone()), median(coalesced.apply.clone()));
    println!(
        "coalesced vs plain: bytes copied {:.2}x fewer (target >= 2) | gather time ratio {:.2} | \
         end-to-end ratio {:.2} (target <= 1)",
        plain.bytes() / coalesced.bytes(),
        cg.as_secs_f64() / pg.as_secs_f64(),
        (cg + ca).as_secs_f64() / (pg + pa).as_secs_f64()
    );
}
