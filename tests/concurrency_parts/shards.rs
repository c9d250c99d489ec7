//! Shards (ZeRO stage 1) from replica threads: reduce-scatter steps, each replica's update of its
//! pieces, allgather.

use super::*;

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

/// The threads of a shard run.
#[path = "shard_threads.rs"]
mod shard_threads;
