//! Dense steps from replica threads: the run's configuration, the run itself and its tests.

use super::*;

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

/// The threads of a run.
#[path = "dense_threads.rs"]
mod dense_threads;
