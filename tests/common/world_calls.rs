//! The calls of the randomized cross-rank tests (docs/ARCHITECTURE.md, "Randomized cross-rank
//! test"): one rank's side of a seed's run, drawn alike on every rank and checked against the
//! model (common/world_model.rs). tests/world_random.rs runs it on host replicas,
//! tests/world_random_cuda.rs on CUDA replicas ([`Setup`]: where the memory lives, how the
//! ranks are crossed).

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr;

use super::buf::{Buf, DType};
use super::cuda_context::cuda_context;
use super::place::synchronize;
use super::world_model::{self as model, *};
use super::{abi::*, context::*, lcg::Lcg};
use dpsync::*;

mod collectives;
mod deviations;
mod kill;
mod leave;
mod steps;

const NAMES: [&str; 7] = ["w_a", "w_b", "w_c", "w_d", "w_e", "w_f", "w_g"];
const SPARSE: [&str; 3] = ["emb_a", "emb_b", "emb_c"];
const ROLES: [u32; 4] = [PARAM, GRAD, COMPUTED, STATE];
/// Element counts: the small ones ride in the agreement record, 40 and 100 of most dtypes not;
/// 20000 makes a bucket the engine's ring carries (64 KiB on: the shared-memory ring, and the
/// in-place reduce-scatter of one replica per rank).
const COUNTS: [usize; 8] = [1, 2, 3, 5, 8, 40, 100, 20_000];
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Replicas per rank: uneven, so that world indices and AVG's divisor are not the rank's.
pub fn layout(ranks: usize) -> Vec<usize> {
    // As many on every rank (`DPSYNC_RANDOM_EVEN=N`: N each): the even layout beside the
    // uneven ones below.
    if let Some(n) = std::env::var("DPSYNC_RANDOM_EVEN")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return vec![n; ranks];
    }
    match ranks {
        3 => vec![3, 1, 2],
        n => (0..n).map(|r| 1 + r % 2).collect(),
    }
}

/// What a run's replicas are and how they cross the ranks.
pub struct Setup {
    /// The test, as failures and the summary name it.
    pub test: &'static str,
    /// Host replicas, or CUDA replicas (this rank's GPUs).
    pub at: Where,
    /// CUDA replicas: the transport (NCCL across the ranks, or PEER_COPY: staged through MPI).
    pub transport: u32,
    /// CUDA replicas with NCCL across the ranks on streams that run inside the calls that queue
    /// their work (the fake driver without FAKE_CUDA_ASYNC=1): its NCCL collectives complete
    /// only once every rank queued them, so every rank must start the same buckets early.
    pub lockstep: bool,
    /// CUDA replicas: the GPUs of every rank together (each rank's counted apart: NCCL's
    /// clique ranks); host replicas: 0.
    pub groups: usize,
    /// The command line that replays seed `.1` with `.2` calls on `.3` ranks.
    pub replay: fn(&Setup, u64, usize, usize) -> String,
}

impl Setup {
    /// CUDA replicas with NCCL across the ranks: buckets marked final start early on the
    /// clique every collective uses.
    fn nccl(&self) -> bool {
        self.at.cuda() && self.transport == T_NCCL
    }
}

thread_local! {
    /// The last calls of this rank, printed with a failure.
    static TRACE: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Rank `rank` of `per_rank.len()` runs every seed of `cfg` (each a context of its own); rank 0
/// prints the summary. A failure prints the seed, the rank's last calls and the command line
/// that replays it.
pub fn run(rank: usize, per_rank: &[usize], cfg: &Config, setup: &Setup) {
    let ranks = per_rank.len();
    let test = setup.test;
    let start = std::time::Instant::now();
    let mut sum = Tally::default();
    // Who prints the summary: rank 0; in a world that lost a rank, its rank 0 now.
    let mut lead = rank == 0;
    for &seed in &cfg.seeds {
        TRACE.with(|t| t.borrow_mut().clear());
        // One seed in three on host replicas puts one replica on every rank: the engine's own
        // reduce-scatter and allgather, and early buckets that serve either gradient step.
        let ones = vec![1; ranks];
        let per_rank = match (seed % 3, &setup.at) {
            (2, Where::Host) => &ones[..],
            _ => per_rank,
        };
        let run = catch_unwind(AssertUnwindSafe(|| {
            let mut w = World::new(seed, rank, per_rank, cfg, setup);
            // A kill drawn near the end still comes: an action may make several calls and
            // pass it (seed 192 of the kill variant ended with every rank alive).
            while !w.left && (w.tally.calls < cfg.calls || w.kill_at.is_some()) {
                w.action();
            }
            (std::mem::take(&mut w.tally), w.rank)
        }));
        let (tally, now) = run.unwrap_or_else(|e| {
            let replay = (setup.replay)(setup, seed, cfg.calls, ranks);
            eprintln!(
                "{test}: rank {rank} of {ranks} {per_rank:?} FAILED at seed {seed}; replay: \
                 {replay}\n\
                 its last calls:"
            );
            TRACE.with(|t| t.borrow().iter().for_each(|l| eprintln!("  {l}")));
            resume_unwind(e)
        });
        if cfg.kill {
            lead = now == 0;
        }
        if lead && cfg.trace {
            println!("{test}: seed {seed}: {}", tally.line());
        }
        sum.add(&tally);
    }
    if lead {
        let seeds = match (cfg.seeds.first(), cfg.seeds.last()) {
            (Some(a), Some(b)) => format!("{a}..={b}"),
            _ => "none".into(),
        };
        let (time, off) = (start.elapsed().as_secs_f64(), &cfg.off);
        let ones = match (&setup.at, cfg.kill) {
            (Where::Cuda(..), _) => "",
            (_, false) => " (every third seed 1 each)",
            (_, true) => " (every third seed 1 each), elastic, one rank killed",
        };
        println!(
            "{test}: {ranks} ranks {per_rank:?}{ones}, seeds {seeds}, {} calls per seed, \
             off {off:?}: {} ({time:.1} s)",
            cfg.calls,
            sum.line()
        );
    }
}

/// One rank's side of a seed's run: the context, the generator every rank shares, the model.
/// Every draw happens on every rank alike (never inside a branch on this rank), so that the
/// generators stay in step and every rank knows what every other does.
struct World<'a> {
    /// First: destroyed before the memory registered in it.
    ctx: Context,
    cfg: &'a Config,
    setup: &'a Setup,
    g: Lcg,
    /// Where ranks leave (a generator of its own: seeds without leaves draw as before).
    lg: Lcg,
    /// The calls (tally counts) at which a rank leaves, ascending.
    leaves: Vec<usize>,
    /// This rank has left: it stops.
    left: bool,
    /// The collective a rank leaves at: no deviation.
    leaving: bool,
    /// Kills (`Config::kill`): a generator of their own, the call (tally count) at which one
    /// rank dies, the world's min_ranks, the rank dying at this call (no deviation, no marks)
    /// and, while a call is redone after the loss, the world replicas (first, count) dropped.
    kg: Lcg,
    kill_at: Option<usize>,
    min_ranks: usize,
    dying: Option<usize>,
    redo: Option<(usize, usize)>,
    /// At a kill: a mark answered RANK_LOST (its message); the step is then not made.
    lost_mark: Option<String>,
    /// The present ranks' numbers at creation, and the lost ones' (describe's "lost").
    creation: Vec<usize>,
    lost: Vec<usize>,
    /// World changes so far (`dpsync_world_epoch`).
    epoch: u64,
    rank: usize,
    per_rank: Vec<usize>,
    local: usize,
    offset: usize,
    total: usize,
    coalesce: bool,
    /// Reproducible sums (dpsync_options_set_reproducible): nothing starts early.
    repro: bool,
    /// The fusion bytes the buckets are packed to.
    fusion: usize,
    dense: Vec<Dense>,
    sparse: Vec<Sparse>,
    bmuf: Option<Bmuf>,
    /// Memory of PARAMs the filter took and that were unregistered since: kept, so that a
    /// new registration never gets its address (the library would take it for the old one).
    grave: Vec<Store>,
    /// The op of the last successful dpsync_allreduce_grads (early buckets use it).
    last_op: Option<u32>,
    /// Per rank: registrations unchanged since the last successful dpsync_allreduce_grads
    /// (only then does dpsync_grad_ready start buckets).
    agreed: Vec<bool>,
    next_id: u64,
    tally: Tally,
}

impl<'a> World<'a> {
    fn new(
        seed: u64,
        rank: usize,
        per_rank: &[usize],
        cfg: &'a Config,
        setup: &'a Setup,
    ) -> World<'a> {
        let mut g = Lcg::new(seed);
        let fusion = [None, Some(0), Some(64), Some(1024)][g.below(4) as usize];
        let coalesce = g.below(3) == 0;
        let repro = g.below(3) == 0 && cfg.on("repro");
        let mut kg = Lcg::new(seed ^ 0x6b69_6c6c);
        let ranks = per_rank.len();
        let kill_at = cfg.kill.then(|| kg.below(cfg.calls as u64) as usize);
        // Now and then min_ranks is every rank: the loss fails the context.
        let min_ranks = ranks - usize::from(kg.below(4) != 0);
        let configure = |o: &Options| {
            o.set_timeout_ms(cfg.timeout_ms);
            o.set_sparse_coalesce(coalesce);
            // SAFETY: valid options.
            check(
                unsafe { dpsync_options_set_reproducible(o.0, repro) },
                "reproducible",
            );
            if let Some(f) = fusion {
                o.set_fusion_bytes(f);
            }
            // SAFETY: valid options; NULL is MPI_COMM_WORLD.
            check(
                unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
                "world",
            );
            if cfg.kill {
                // SAFETY: valid options.
                check(
                    unsafe { dpsync_options_set_elastic(o.0, min_ranks) },
                    "elastic",
                );
            }
        };
        let ctx = match &setup.at {
            Where::Host => {
                let o = Options::host(per_rank[rank]);
                configure(&o);
                Context::new(&o)
            }
            Where::Cuda(_, ordinals) => cuda_context(setup.test, ordinals, |o| {
                configure(o);
                o.set_transport(setup.transport);
            })
            .expect("a CUDA context (the run checked for a GPU)"),
        };
        let mut lg = Lcg::new(seed ^ 0x6c65_6176_6573);
        // Kills and leaves mix: a leave is not bound by min_ranks, a later kill counts the
        // ranks that remain (`World::lost_at`).
        let on = cfg.on("leave");
        let leaves = World::draw_leaves(&mut lg, per_rank.len(), cfg.calls, on);
        let mut w = World {
            ctx,
            cfg,
            setup,
            g,
            lg,
            leaves,
            left: false,
            leaving: false,
            kg,
            kill_at,
            min_ranks,
            dying: None,
            redo: None,
            lost_mark: None,
            creation: (0..ranks).collect(),
            lost: Vec::new(),
            epoch: 0,
            rank,
            local: per_rank[rank],
            offset: per_rank[..rank].iter().sum(),
            total: per_rank.iter().sum(),
            per_rank: per_rank.to_vec(),
            coalesce,
            repro,
            fusion: fusion.unwrap_or(model::DEFAULT_FUSION_BYTES),
            dense: Vec::new(),
            sparse: Vec::new(),
            bmuf: None,
            grave: Vec::new(),
            last_op: None,
            agreed: vec![false; per_rank.len()],
            next_id: 0,
            tally: Tally::default(),
        };
        let (leaves, kill) = (&w.leaves, (kill_at, min_ranks));
        w.note(format!(
            "seed {seed}: fusion_bytes {fusion:?}, coalesce {coalesce}, reproducible {repro}, \
             leaves at {leaves:?}, (kill at, min_ranks) {kill:?}"
        ));
        if repro {
            w.tally.count("reproducible seeds");
        }
        w
    }

    fn below(&mut self, n: usize) -> usize {
        self.g.below(n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }

    fn note(&self, line: String) {
        if self.cfg.trace && self.rank == 0 {
            println!("  {line}");
        }
        TRACE.with(|t| {
            let mut t = t.borrow_mut();
            if t.len() == 40 {
                t.remove(0);
            }
            t.push(line);
        });
    }

    #[track_caller]
    fn fail(&self, what: String) -> ! {
        let (rank, calls) = (self.rank, self.tally.calls);
        // Why the engine failed, where it did (a world's failure may hide behind another).
        let failed = &self.ctx.describe_json()["world"]["failed"];
        panic!(
            "rank {rank} of {:?}, call {calls}: {what} (describe: the world's engine failed: \
             {failed})",
            self.per_rank
        )
    }

    /// This rank's status and message are what `e` says.
    #[track_caller]
    fn expect(&self, st: dpsync_status, e: &Expect, what: &str) {
        let (want, needles) = e.on(self.rank);
        let msg = if st == OK {
            String::new()
        } else {
            last_error()
        };
        if st != want || needles.iter().any(|n| !msg.contains(n.as_str())) {
            self.fail(format!(
                "{what}: expected {want:?} naming {needles:?}, got {st:?}: {msg:?}"
            ));
        }
    }

    #[track_caller]
    fn ok(&self, st: dpsync_status, what: &str) {
        self.expect(st, &Expect::Ok, what);
    }

    /// Fresh small values in tensor `t` on every world replica (so that sums stay exact).
    fn fill(&mut self, t: usize) {
        let count = self.dense[t].vals[0].len();
        for w in 0..self.total {
            self.dense[t].vals[w] = (0..count).map(|_| self.g.below(4) as f64).collect();
        }
        let d = &mut self.dense[t];
        for k in 0..self.local {
            d.bufs[k].set(&d.vals[self.offset + k]);
        }
    }

    fn refill(&mut self, roles: u32) {
        for t in 0..self.dense.len() {
            if self.dense[t].role & roles != 0 {
                self.fill(t);
            }
        }
    }

    /// After a call that succeeded: every registered tensor, temporary and sparse output on
    /// this rank is as the model says (on CUDA replicas read after `dpsync_synchronize`, which
    /// must succeed).
    fn check_values(&self, what: &str, temps: &[Temp]) {
        if self.setup.at.cuda() {
            let st = synchronize(&self.ctx);
            self.ok(st, &format!("dpsync_synchronize {what}"));
        }
        self.check_unchanged(what, temps);
    }

    /// Every registered tensor, temporary and sparse output on this rank is as the model says,
    /// read as the replicas' streams see them. After a failed call this is all there is to wait
    /// for (it queued nothing), and `dpsync_synchronize` must not be called: a failed step
    /// that not every rank was in leaves the buckets started early in flight on the NCCL
    /// clique until the next one, and synchronizing would wait for the other ranks' part.
    fn check_unchanged(&self, what: &str, temps: &[Temp]) {
        for t in &self.dense {
            for k in 0..self.local {
                let (got, want) = (t.bufs[k].vals(), &t.vals[self.offset + k]);
                if !same(&got, want) {
                    let (name, dt) = (&t.name, t.dtype);
                    self.fail(format!(
                        "{what}: '{name}' {dt:?} on replica {k}: {got:?}, not {want:?}"
                    ));
                }
            }
        }
        self.check_temps(temps);
        for s in &self.sparse {
            for k in 0..self.local {
                let got = (self.ctx.sparse_get(&s.name, k)).map(|o| s.read(o, &self.setup.at));
                let fine = match (&s.out, &got) {
                    (None, Err(st)) => *st == INVALID_STATE,
                    (Some((i, v)), Ok(Some((gi, gv)))) => i == gi && same(v, gv),
                    _ => false,
                };
                if !fine {
                    let (name, want) = (&s.name, &s.out);
                    self.fail(format!(
                        "{what}: sparse '{name}' on {k}: {got:?}, not {want:?}"
                    ));
                }
            }
        }
    }

    fn check_temps(&self, temps: &[Temp]) {
        for t in temps {
            for b in &t.bufs {
                let want: Vec<f64> = (0..b.len()).map(|i| (i % 3) as f64).collect();
                if !same(&b.vals(), &want) {
                    self.fail(format!("temporary '{}' changed: {:?}", t.name, b.vals()));
                }
            }
        }
    }

    // -------------------------------------------------------------- actions

    fn action(&mut self) {
        if self.leaves.first().is_some_and(|&c| self.tally.calls >= c) {
            self.leaves.remove(0);
            return self.leave();
        }
        if self.kill_at.is_some_and(|c| self.tally.calls >= c) {
            self.kill_at = None;
            return self.kill();
        }
        let (sparse, bmuf) = (self.cfg.on("sparse"), self.cfg.on("bmuf"));
        let shards = self.cfg.on("shards");
        match self.below(100) {
            0..=13 => self.register(),
            14..=20 => self.unregister(),
            21..=24 if sparse => self.register_sparse(),
            25..=26 if sparse => self.unregister_sparse(),
            27..=38 => self.allreduce(),
            39..=48 => self.broadcast_or_average(true),
            49..=56 => self.broadcast_or_average(false),
            57..=62 if bmuf => self.bmuf_init(),
            63..=71 if bmuf => self.bmuf_step(),
            72..=79 if shards => self.grads(true),
            80..=85 if shards => self.allgather(),
            _ => self.grads(false),
        }
    }

    /// A new dense tensor on every replica of every rank (the same on all).
    fn register(&mut self) {
        let free: Vec<&str> = (NAMES.iter().copied())
            .filter(|n| !self.dense.iter().any(|t| t.name == *n))
            .collect();
        if free.is_empty() {
            return self.unregister();
        }
        let (name, role) = (self.pick(&free), self.pick(&ROLES));
        // PARAMs mostly floating-point: an integer one refuses dpsync_bmuf_init.
        let floats = role == PARAM && self.below(4) != 0;
        let dtype = self.pick(if floats { &FLOATS } else { &DType::ALL });
        let (count, again) = (self.pick(&COUNTS), self.below(4) == 0);
        self.note(format!("register '{name}' role {role} {dtype:?} x {count}"));
        self.next_id += 1;
        self.dense.push(Dense {
            name: name.to_owned(),
            role,
            dtype,
            id: self.next_id,
            vals: vec![vec![0.0; count]; self.total],
            bufs: (0..self.local)
                .map(|k| self.setup.at.put(k, Buf::zeros(dtype, count)))
                .collect(),
        });
        let t = self.dense.len() - 1;
        self.fill(t);
        // The identical registration again (on replica 0) is a no-op.
        for k in (0..self.local).chain(again.then_some(0)) {
            let b = &mut self.dense[t].bufs[k];
            let st = register_raw(self.ctx.0, name, role, k, b.ptr(), count, dtype.code());
            self.ok(st, "dpsync_register");
        }
        self.agreed.fill(false);
        self.tally.calls += 1;
    }

    fn unregister(&mut self) {
        if self.dense.is_empty() {
            return;
        }
        let t = self.below(self.dense.len());
        let gone = self.dense.remove(t);
        self.note(format!("unregister '{}'", gone.name));
        self.ok(self.ctx.unregister(&gone.name), "dpsync_unregister");
        if (self.bmuf.iter()).any(|b| b.params.iter().any(|p| p.1 == gone.id)) {
            self.grave.extend(gone.bufs);
        }
        self.agreed.fill(false);
        self.tally.calls += 1;
    }

    fn register_sparse(&mut self) {
        let free: Vec<&str> = (SPARSE.iter().copied())
            .filter(|n| !self.sparse.iter().any(|s| s.name == *n))
            .collect();
        if free.is_empty() {
            return self.unregister_sparse();
        }
        let s = Sparse {
            name: self.pick(&free).to_owned(),
            row_len: 1 + self.below(3),
            vdt: self.pick(&FLOATS),
            idt: self.pick(&[DType::I32, DType::I64]),
            num_emb: self.pick(&[0, 8]),
            out: None,
        };
        let (vdt, idt, n) = (s.vdt.code(), s.idt.code(), s.num_emb);
        self.note(format!(
            "register_sparse '{}' {} {vdt} {idt} {n}",
            s.name, s.row_len
        ));
        for k in 0..self.local {
            let st = self.ctx.register_sparse(&s.name, k, s.row_len, vdt, idt, n);
            self.ok(st, "dpsync_register_sparse");
        }
        self.sparse.push(s);
        self.tally.calls += 1;
    }

    fn unregister_sparse(&mut self) {
        if !self.sparse.is_empty() {
            let s = self.below(self.sparse.len());
            let name = self.sparse.remove(s).name;
            self.note(format!("unregister sparse '{name}'"));
            self.ok(self.ctx.unregister(&name), "dpsync_unregister (sparse)");
            self.tally.calls += 1;
        }
    }
}
