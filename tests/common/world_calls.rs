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
            while w.tally.calls < cfg.calls {
                w.action();
            }
            std::mem::take(&mut w.tally)
        }));
        let tally = run.unwrap_or_else(|e| {
            let replay = (setup.replay)(setup, seed, cfg.calls, ranks);
            eprintln!(
                "{test}: rank {rank} of {ranks} {per_rank:?} FAILED at seed {seed}; replay: \
                 {replay}\n\
                 its last calls:"
            );
            TRACE.with(|t| t.borrow().iter().for_each(|l| eprintln!("  {l}")));
            resume_unwind(e)
        });
        if rank == 0 && cfg.trace {
            println!("{test}: seed {seed}: {}", tally.line());
        }
        sum.add(&tally);
    }
    if rank == 0 {
        let seeds = match (cfg.seeds.first(), cfg.seeds.last()) {
            (Some(a), Some(b)) => format!("{a}..={b}"),
            _ => "none".into(),
        };
        let (time, off) = (start.elapsed().as_secs_f64(), &cfg.off);
        let ones = match setup.at {
            Where::Host => " (every third seed 1 each)",
            Where::Cuda(..) => "",
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
        let mut w = World {
            ctx,
            cfg,
            setup,
            g,
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
        w.note(format!(
            "seed {seed}: fusion_bytes {fusion:?}, coalesce {coalesce}, reproducible {repro}"
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
        panic!("rank {rank} of {:?}, call {calls}: {what}", self.per_rank)
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

    /// Runs `std` on every rank (the deviating rank its own call), checks every rank's outcome
    /// and that a failure changed nothing; after a deviation undoes it, and after a failure
    /// calls `retry` and `std` again, which must work. Whether `std` succeeded (the caller
    /// then updates the model and checks the values).
    fn run(
        &mut self,
        std: &Call,
        e: Expect,
        dev: Option<Dev>,
        retry: &mut dyn FnMut(&mut Self),
    ) -> bool {
        let mine = match &dev {
            Some(d) if d.rank == self.rank => d.call.clone().unwrap_or(std.clone()),
            _ => std.clone(),
        };
        let e = dev.as_ref().map_or(e, |d| d.expect.clone());
        let how = dev.as_ref().map_or(String::new(), |d| {
            format!("; rank {} deviates ({}): {:?}", d.rank, d.class, d.call)
        });
        self.note(format!("{std:?}{how}, expecting {e:?}"));
        self.tally.calls += 1;
        let st = mine.invoke(&self.ctx);
        self.expect(st, &e, &format!("{mine:?}"));
        let temps = dev.as_ref().map_or(&[][..], |d| &d.temps);
        if st == OK {
            self.check_temps(temps);
            self.tally.count(std.function());
        } else {
            self.check_unchanged(&format!("after {mine:?} failed"), temps);
            self.tally.failed += 1;
        }
        let step = matches!(std, Call::Grads(_) | Call::Scatter(_));
        if st == OK && step {
            self.agreed.fill(true);
        }
        let Some(dev) = dev else {
            return st == OK;
        };
        self.tally.count(dev.class);
        for t in &dev.temps {
            self.ok(self.ctx.unregister(t.name), "unregistering a temporary");
        }
        if dev.sparse_extra && dev.rank == self.rank {
            self.ok(self.ctx.unregister("emb_x"), "unregistering emb_x");
        }
        dev.registered.iter().for_each(|&r| self.agreed[r] = false);
        if st == OK {
            return true;
        }
        retry(self);
        self.note(format!("{std:?} again, without the deviation"));
        self.tally.calls += 1;
        let st = std.invoke(&self.ctx);
        self.ok(st, "the same call again, without the deviation");
        self.tally.count(std.function());
        if step {
            self.agreed.fill(true);
        }
        true
    }

    /// Now and then a deviation of one rank from `std` (which would succeed), of one of
    /// `classes`; registrations it needs are made here. `bad`: (gradient, world replica) pairs
    /// that can take a bad index.
    fn draw_dev(
        &mut self,
        std: &Call,
        classes: &[&'static str],
        bad: &[(usize, usize)],
    ) -> Option<Dev> {
        let sparse = self.cfg.on("sparse");
        let classes: Vec<&'static str> = (classes.iter().copied())
            .filter(|c| self.cfg.on(c) && (sparse || !c.starts_with("sparse")))
            .filter(|&c| {
                (c != "benign" || std.involved() != 0xf) && (c != "sparse_index" || !bad.is_empty())
            })
            // `local` needs a rank of several replicas.
            .filter(|&c| c != "local" || self.per_rank.iter().any(|&r| r > 1))
            .collect();
        if self.below(100) >= 35 || classes.is_empty() {
            return None;
        }
        let (class, d, pick) = (
            self.pick(&classes),
            self.below(self.per_rank.len()),
            self.below(4),
        );
        let mut dev = Dev {
            class,
            rank: d,
            ..Dev::default()
        };
        // Where calls differ, the message names rank 0's and the first other rank's.
        let first = format!("rank {}", d.max(1));
        let differ = |n: &[&str]| all(INCONSISTENT, &[n, &[first.as_str()]].concat());
        let (call, expect) = match (class, std) {
            ("op", Call::Grads(op) | Call::Allreduce(_, op) | Call::Scatter(op)) => {
                (std.with(1 - op), differ(&["op=Sum", "op=Avg"]))
            }
            ("name", Call::Allreduce(Some(name), op)) => {
                let others: Vec<String> = (self.dense.iter().map(|t| t.name.clone()))
                    .filter(|n| n != name)
                    .collect();
                match others.get(pick) {
                    Some(o) => {
                        let e = differ(&[&format!("name='{name}'"), &format!("name='{o}'")]);
                        (Call::Allreduce(Some(o.clone()), *op), e)
                    }
                    None => (
                        Call::Allreduce(Some("nope".into()), *op),
                        own(d, NOT_FOUND, &["'nope'"]),
                    ),
                }
            }
            ("root", Call::Broadcast(roles, root)) if pick < 3 => {
                let other = (root + 1 + pick % (self.total - 1)) % self.total;
                let e = differ(&[&format!("root={root})"), &format!("root={other})")]);
                (Call::Broadcast(*roles, other), e)
            }
            ("root", Call::Broadcast(roles, _)) => {
                let e = own(d, INVALID_ARGUMENT, &["root_replica"]);
                (Call::Broadcast(*roles, self.total + pick), e)
            }
            (
                "roles",
                Call::Broadcast(roles, _) | Call::Average(roles) | Call::Allgather(roles),
            ) => {
                let other = 1 + (roles + pick as u32) % 15;
                let e = differ(&[&format!("roles={roles:#x}"), &format!("roles={other:#x}")]);
                (std.with(other), e)
            }
            ("bmuf_args", &Call::BmufInit(lr, mu, nesterov)) => match pick {
                0 => (Call::BmufInit(0.5, mu, nesterov), differ(&["block_lr=0.5"])),
                1 => {
                    let e = differ(&[&format!("nesterov={}", !nesterov)]);
                    (Call::BmufInit(lr, mu, !nesterov), e)
                }
                p => {
                    let bad = if p == 2 { 1.5 } else { f64::NAN };
                    let e = own(d, INVALID_ARGUMENT, &["block_momentum"]);
                    (Call::BmufInit(lr, bad, nesterov), e)
                }
            },
            ("boundary", _) => {
                let roles = [0, 0x10, 0x8000_0001][pick % 3];
                let (call, arg) = match std {
                    Call::Grads(_) => (Call::Grads(7), "op"),
                    Call::Scatter(_) => (Call::Scatter(7), "op"),
                    Call::Allgather(_) => (Call::Allgather(roles), "roles"),
                    Call::Allreduce(n, _) if pick < 2 => (Call::Allreduce(n.clone(), 7), "op"),
                    Call::Allreduce(_, op) => (Call::Allreduce(None, *op), "name"),
                    Call::Broadcast(_, root) => (Call::Broadcast(roles, *root), "roles"),
                    Call::Average(_) => (Call::Average(roles), "roles"),
                    &Call::BmufInit(_, mu, n) => (Call::BmufInit(f64::NAN, mu, n), "block_lr"),
                    Call::BmufStep => unreachable!("dpsync_bmuf_step takes no argument"),
                };
                (call, own(d, INVALID_ARGUMENT, &[arg]))
            }
            ("call", _) => {
                let other = match std {
                    Call::Broadcast(..) => Call::Average(COMPUTED),
                    // The step's other shape: it may finish buckets started early too.
                    Call::Scatter(op) => Call::Grads(*op),
                    _ => Call::Broadcast(PARAM | STATE, 0),
                };
                let e = differ(&[std.function(), other.function()]);
                (other, e)
            }
            ("register" | "local" | "benign", _) => {
                self.dev_register(&mut dev, std);
                return Some(dev);
            }
            ("sparse_extra", _) => {
                dev.sparse_extra = true;
                let e = all(INCONSISTENT, &["'emb_x'", &format!("rank {d}")]);
                (std.clone(), e)
            }
            ("sparse_index", _) => {
                let (s, w) = bad[pick % bad.len()];
                let offset = |r: usize| self.per_rank[..r].iter().sum::<usize>();
                dev.rank = (0..self.per_rank.len())
                    .rfind(|&r| offset(r) <= w)
                    .expect("a rank");
                let k = w - offset(dev.rank);
                let v = [self.sparse[s].num_emb as i64, -1][pick % 2];
                dev.bad = Some((s, k, v));
                // CUDA replicas check indices on the device: the step succeeds everywhere, and
                // the rank's next dpsync_synchronize reports it (checked in `grads`).
                let e = match self.setup.at.cuda() {
                    true => Expect::Ok,
                    false => own(dev.rank, INCONSISTENT, &[&format!("index {v}")]),
                };
                (std.clone(), e)
            }
            _ => unreachable!("class {class} for {std:?}"),
        };
        (dev.call, dev.expect) = (Some(call), expect);
        Some(dev)
    }

    /// Registrations that differ between ranks (`register`), between the replicas of one rank
    /// (`local`), or that the call does not involve (`benign`), of a role `std` involves (does
    /// not, for `benign`).
    fn dev_register(&mut self, dev: &mut Dev, std: &Call) {
        let (involved, benign) = (std.involved(), dev.class == "benign");
        let roles: Vec<u32> = (ROLES.iter().copied())
            .filter(|r| (r & involved != 0) != benign)
            .collect();
        let role = self.pick(&roles);
        // PARAMs floating-point: an integer one would refuse dpsync_bmuf_init on its own.
        let dtypes: &[DType] = if role == PARAM { &FLOATS } else { &DType::ALL };
        let i = self.below(dtypes.len());
        let (dtype, other) = (dtypes[i], dtypes[(i + 1) % dtypes.len()]);
        let (count, variant) = (self.pick(&COUNTS[..5]), self.below(4));
        // `local`: a rank with several replicas, registering on some of them.
        let several: Vec<usize> = (0..self.per_rank.len())
            .filter(|&r| self.per_rank[r] > 1)
            .collect();
        // Drawn alike on every rank (the layout is every rank's).
        let local_rank = match several.is_empty() {
            true => dev.rank,
            false => self.pick(&several),
        };
        if dev.class == "local" {
            dev.rank = local_rank;
        }
        let d = dev.rank;
        let part = 1 + self.below(self.per_rank[d].max(2) - 1);
        let first = format!("rank {}", d.max(1));
        let (l, me) = (self.local, self.rank == d);
        let every: Vec<usize> = (0..self.per_rank.len()).collect();
        let bmuf_step = matches!(std, Call::BmufStep);
        // (name, dtype, count, replicas) for this rank, the ranks registering, the outcome.
        let (regs, who, e) = match (dev.class, variant) {
            ("benign", _) => (vec![("dev_x", dtype, count, l)], vec![d], Expect::Ok),
            ("local", _) => {
                dev.local_grad = role == GRAD;
                let e = own(d, INCONSISTENT, &["'dev_x'"]);
                (vec![("dev_x", dtype, count, part)], vec![d], e)
            }
            (_, 0) => {
                let e = match bmuf_step {
                    true => own(d, INVALID_STATE, &["'dev_x'"]),
                    false => all(INCONSISTENT, &["'dev_x'", &format!("rank {d}")]),
                };
                (vec![("dev_x", dtype, count, l)], vec![d], e)
            }
            (_, 1 | 2) => {
                let (dt, n) = match (me, variant) {
                    (true, 1) => (dtype, count + 1),
                    (true, _) => (other, count),
                    _ => (dtype, count),
                };
                let e = match bmuf_step {
                    true => all(INVALID_STATE, &["'dev_"]),
                    false => all(INCONSISTENT, &["'dev_x'", &first]),
                };
                (vec![("dev_x", dt, n, l)], every, e)
            }
            _ => {
                let mut regs = vec![("dev_x", dtype, count, l), ("dev_y", dtype, count, l)];
                if me {
                    regs.reverse();
                }
                let e = match bmuf_step {
                    true => all(INVALID_STATE, &["'dev_"]),
                    false => all(INCONSISTENT, &["order", &first]),
                };
                (regs, every, e)
            }
        };
        dev.expect = e;
        let here = who.contains(&self.rank);
        for (name, dtype, count, replicas) in regs.into_iter().filter(|_| here) {
            let vals: Vec<f64> = (0..count).map(|i| (i % 3) as f64).collect();
            let mut bufs: Vec<Store> = (0..replicas)
                .map(|k| self.setup.at.put(k, make_buf(dtype, &vals, 1)))
                .collect();
            for (k, b) in bufs.iter_mut().enumerate() {
                let st = register_raw(self.ctx.0, name, role, k, b.ptr(), count, dtype.code());
                self.ok(st, "registering a temporary");
            }
            dev.temps.push(Temp { name, bufs });
        }
        who.iter().for_each(|&r| self.agreed[r] = false);
        dev.registered = who;
    }

    // -------------------------------------------------------------- collectives

    /// Whether buckets started early serve a reduce-scatter step as well as an allreduce one:
    /// host replicas (the engine writes their results once the step agreed, for a
    /// reduce-scatter each local replica's owned pieces alone) and NCCL across the ranks (the
    /// owned pieces copied out of the started bucket's buffers). On the staged path nothing
    /// starts early, and after a reduce-scatter step nothing would.
    fn serves_either(&self) -> bool {
        !self.setup.at.cuda() || self.setup.nccl()
    }

    /// A gradient step: `dpsync_allreduce_grads`, or with `scatter`
    /// `dpsync_reduce_scatter_grads` (each replica's own pieces of the dense gradients written,
    /// the rest as it was; sparse gradients gathered whole alike).
    fn grads(&mut self, scatter: bool) {
        // A reduce-scatter step is refused after buckets started early whole: marks there only
        // where nothing starts (the previous step was a reduce-scatter, or none succeeded
        // yet), or where started buckets serve either step.
        let marks = self.cfg.on("marks") && self.below(3) != 0;
        let marks = marks && (!scatter || self.last_op.is_none() || self.serves_either());
        let mut op = self.pick(&[SUM, AVG]);
        // Buckets averaged early cannot be summed: with marks, AVG stays AVG.
        let avg_early = marks && self.last_op == Some(AVG);
        if avg_early {
            op = AVG;
        }
        self.refill(GRAD);
        let (place, alike) = ((self.offset, self.local), !self.cfg.on("sparse_share"));
        let at = &self.setup.at;
        let mut sl = Slices::draw(&mut self.g, &self.sparse, self.total, place, alike, at);
        let bad: Vec<(usize, usize)> = (0..self.sparse.len())
            .filter(|&s| self.sparse[s].num_emb > 0)
            .flat_map(|s| (0..self.total).map(move |w| (s, w)))
            .filter(|&(s, w)| !sl.idx[s][w].is_empty())
            .collect();
        let std = match scatter {
            true => Call::Scatter(op),
            false => Call::Grads(op),
        };
        let mut classes = vec!["call", "register", "local", "benign", "boundary"];
        classes.extend(["sparse_extra", "sparse_index"]);
        if !avg_early {
            classes.push("op");
        }
        let mut dev = self.draw_dev(&std, &classes, &bad);
        let d = dev.as_ref().map_or(usize::MAX, |d| d.rank);
        let bad_index = dev.as_ref().and_then(|d| d.bad);
        let bad_here = match bad_index {
            Some((s, k, v)) if d == self.rank => Some((s, k, sl.poke(s, k, v))),
            _ => None,
        };
        let extra = dev.as_ref().is_some_and(|d| d.sparse_extra);
        for k in (0..self.local).filter(|_| extra && d == self.rank) {
            let st = self.ctx.register_sparse("emb_x", k, 1, F32, I64, 0);
            self.ok(st, "register_sparse emb_x");
            let null = ptr::null();
            let st = self.ctx.sparse_set_raw("emb_x", k, null, null, 0);
            self.ok(st, "sparse_set emb_x");
        }
        // Marks: per rank all, some or none of its (tensor, replica) pairs; with sparse_uneven
        // off, alike on every rank and only where every rank would start the same buckets.
        // In lockstep (Setup::lockstep) always so: a bucket one rank started and another did
        // not would wait inside the call that queued it for a rank that never queues it.
        let local_grad = dev.as_ref().is_some_and(|d| d.local_grad);
        let sparse_here = !self.sparse.is_empty() || extra;
        let lockstep = self.setup.lockstep;
        let uniform = lockstep || (sparse_here && !self.cfg.on("sparse_uneven"));
        let alike = self.agreed.iter().all(|&a| a == self.agreed[0]) && !local_grad;
        if marks && (alike || !uniform) {
            self.tally.count("marks");
            if sparse_here && !uniform {
                self.tally.count("sparse_uneven");
            }
            let grads: Vec<usize> = (0..self.dense.len())
                .rev()
                .filter(|&t| self.dense[t].role == GRAD)
                .collect();
            let every = model::marks(&mut self.g, &self.per_rank, &grads, uniform);
            let mine = &every[self.rank];
            let how = if uniform { "alike" } else { "per rank" };
            self.note(format!("marks ({how}): {mine:?}"));
            let e = match local_grad && d == self.rank {
                true => all(INCONSISTENT, &["'dev_x'"]),
                false => Expect::Ok,
            };
            // The first mark twice: a no-op.
            for &(t, k) in mine.iter().chain(mine.first()) {
                let st = self.ctx.grad_ready(&self.dense[t].name, k);
                self.expect(st, &e, "dpsync_grad_ready");
            }
            if self.setup.at.cuda() {
                self.early_buckets(&every, dev.as_mut(), scatter);
            }
        }
        if !self.sparse.is_empty() && self.cfg.on("sparse_share") {
            self.tally.count("sparse_share");
        }
        self.set_slices(&sl);
        let ok = self.run(&std, Expect::Ok, dev, &mut |w| {
            if let Some((s, k, v)) = bad_here {
                sl.poke(s, k, v);
            }
            // A failed step consumed no slice: setting them again is optional.
            if w.below(2) == 0 {
                w.set_slices(&sl);
            }
        });
        if !ok {
            return;
        }
        // A bad index on a CUDA replica: the step gathered it as given; that rank's
        // dpsync_synchronize reports it, the others' succeed.
        if let (Some((s, k, v)), true) = (bad_index, self.setup.at.cuda()) {
            let w = self.per_rank[..d].iter().sum::<usize>() + k;
            sl.idx[s][w][0] = v;
            // The gradient before or after it may share that index buffer.
            if sl.with_prev.get(s + 1).is_some_and(|next| next[w]) {
                sl.idx[s + 1][w][0] = v;
            }
            if sl.with_prev[s][w] {
                sl.idx[s - 1][w][0] = v;
            }
            let e = match d == self.rank {
                true => all(
                    INCONSISTENT,
                    &[&format!("index {v}"), "found on the device"],
                ),
                false => Expect::Ok,
            };
            let st = synchronize(&self.ctx);
            self.expect(st, &e, "dpsync_synchronize after a bad index");
        }
        for t in self.dense.iter_mut().filter(|t| t.role == GRAD) {
            let sum = reduce(t.dtype, &t.vals, op);
            if !scatter {
                t.vals = vec![sum; self.total];
                continue;
            }
            for (w, v) in t.vals.iter_mut().enumerate() {
                let (first, count) = piece(sum.len(), w, self.total);
                v[first..first + count].copy_from_slice(&sum[first..first + count]);
            }
        }
        for (s, sp) in self.sparse.iter_mut().enumerate() {
            sp.out = Some(sp.gathered(&sl.idx[s], &sl.val[s], self.coalesce, op));
        }
        // After a reduce-scatter step nothing starts early, unless started buckets serve
        // either step.
        self.last_op = (!scatter || self.serves_either()).then_some(op);
        self.check_values(&format!("after {}", std.function()), &[]);
        // Indices shared on every replica share one gather: one pointer.
        for (&s, k) in sl
            .shared
            .iter()
            .flat_map(|s| (0..self.local).map(move |k| (s, k)))
        {
            let get = |s: usize| self.ctx.gathered(&self.sparse[s].name, k);
            let (a, b) = (get(s - 1), get(s));
            if a.rows > 0 && !self.coalesce && a.indices != b.indices {
                self.fail(format!("shared indices gathered apart: {a:?} {b:?}"));
            }
        }
    }

    /// CUDA replicas, after the marks (`every`: each rank's): the buckets each rank started
    /// early, on this rank as describe counts them. Only with NCCL across the ranks (on the
    /// staged path CUDA replicas only mark), in bucket order, on a rank whose registrations are
    /// those the last successful step agreed on. With buckets in flight on the NCCL clique, a
    /// rank that calls a collective other than a gradient step (`call`) is refused at once:
    /// its own INVALID_STATE.
    /// `scatter`: they finish a reduce-scatter step (counted apart).
    fn early_buckets(
        &mut self,
        every: &[Vec<(usize, usize)>],
        dev: Option<&mut Dev>,
        scatter: bool,
    ) {
        let buckets = model::buckets(&self.dense, self.fusion);
        let can_start =
            |r: usize| self.setup.nccl() && self.agreed[r] && self.last_op.is_some() && !self.repro;
        let started: Vec<usize> = (0..self.per_rank.len())
            .map(|r| {
                let marked = |t: &usize| (0..self.per_rank[r]).all(|k| every[r].contains(&(*t, k)));
                let complete = buckets.iter().take_while(|b| b.iter().all(marked)).count();
                if can_start(r) {
                    complete
                } else {
                    0
                }
            })
            .collect();
        let here = &self.ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"];
        if here.as_u64() != Some(started[self.rank] as u64) {
            let want = started[self.rank];
            self.fail(format!(
                "describe: {here} buckets started early, not {want}"
            ));
        }
        if started.iter().any(|&n| n > 0) {
            self.tally.count("early_buckets");
            if scatter {
                self.tally.count("early_buckets_scatter");
            }
        }
        // A gradient step of either shape finishes them.
        let step = |c: &Option<Call>| matches!(c, Some(Call::Grads(_) | Call::Scatter(_)));
        let other = |d: &&mut Dev| d.class == "call" && !step(&d.call);
        if let Some(dev) = dev.filter(|d| other(d) && started[d.rank] > 0) {
            self.note(format!("rank {} has buckets in flight", dev.rank));
            self.tally.count("call_in_flight");
            dev.expect = own(dev.rank, INVALID_STATE, &["dpsync_allreduce_grads"]);
        }
    }

    fn set_slices(&self, sl: &Slices) {
        for (s, per_replica) in sl.set.iter().enumerate() {
            for (k, &(_, i, v, rows)) in per_replica.iter().enumerate() {
                let st = self.ctx.sparse_set_raw(&self.sparse[s].name, k, i, v, rows);
                self.ok(st, "dpsync_sparse_set");
            }
        }
    }

    fn allreduce(&mut self) {
        let op = self.pick(&[SUM, AVG]);
        let t = self.below(self.dense.len() + 1);
        if t == self.dense.len() {
            // A name that is not a dense tensor: NOT_FOUND on every rank.
            let name = match self.sparse.first() {
                Some(s) if self.g.below(2) == 0 => s.name.clone(),
                _ => "nope".to_owned(),
            };
            let e = all(NOT_FOUND, &[&format!("'{name}'")]);
            self.run(&Call::Allreduce(Some(name), op), e, None, &mut |_| {});
            return;
        }
        self.fill(t);
        let std = Call::Allreduce(Some(self.dense[t].name.clone()), op);
        let dev = self.draw_dev(&std, &["op", "name", "boundary", "benign"], &[]);
        if self.run(&std, Expect::Ok, dev, &mut |_| {}) {
            let d = &mut self.dense[t];
            d.vals = vec![reduce(d.dtype, &d.vals, op); self.total];
            self.check_values("after dpsync_allreduce", &[]);
        }
    }

    fn broadcast_or_average(&mut self, broadcast: bool) {
        let roles = 1 + self.below(15) as u32;
        let root = self.below(self.total);
        self.refill(roles);
        let std = match broadcast {
            true => Call::Broadcast(roles, root),
            false => Call::Average(roles),
        };
        let classes = [
            "root", "roles", "boundary", "call", "register", "local", "benign",
        ];
        let dev = self.draw_dev(&std, &classes[usize::from(!broadcast)..], &[]);
        if !self.run(&std, Expect::Ok, dev, &mut |_| {}) {
            return;
        }
        for t in self.dense.iter_mut().filter(|t| t.role & roles != 0) {
            let v = match broadcast {
                true => t.vals[root].clone(),
                false => reduce(t.dtype, &t.vals, AVG),
            };
            t.vals = vec![v; self.total];
        }
        self.check_values(&format!("after {std:?}"), &[]);
    }

    /// `dpsync_allgather(roles)`: every replica's copy of each selected tensor := the owners'
    /// pieces; `dpsync_shard` names them first.
    fn allgather(&mut self) {
        let roles = 1 + self.below(15) as u32;
        self.refill(roles);
        if let Some(t) = (!self.dense.is_empty()).then(|| self.below(self.dense.len())) {
            let (name, count) = (&self.dense[t].name, self.dense[t].vals[0].len());
            for k in 0..self.local {
                let (mut first, mut n) = (usize::MAX, usize::MAX);
                let c = cstr(name);
                // SAFETY: a valid context, name and out pointers.
                let st = unsafe { dpsync_shard(self.ctx.0, c.as_ptr(), k, &mut first, &mut n) };
                self.ok(st, "dpsync_shard");
                let want = piece(count, self.offset + k, self.total);
                if (first, n) != want {
                    self.fail(format!(
                        "dpsync_shard('{name}', {k}): {:?}, not {want:?}",
                        (first, n)
                    ));
                }
            }
        }
        let std = Call::Allgather(roles);
        let classes = ["roles", "boundary", "call", "register", "local", "benign"];
        let dev = self.draw_dev(&std, &classes, &[]);
        if !self.run(&std, Expect::Ok, dev, &mut |_| {}) {
            return;
        }
        let total = self.total;
        for t in self.dense.iter_mut().filter(|t| t.role & roles != 0) {
            let count = t.vals[0].len();
            let whole: Vec<f64> = (0..total)
                .flat_map(|w| {
                    let (first, n) = piece(count, w, total);
                    t.vals[w][first..first + n].to_vec()
                })
                .collect();
            t.vals = vec![whole; total];
        }
        self.check_values("after dpsync_allgather", &[]);
    }

    fn bmuf_init(&mut self) {
        let (lr, mu) = (self.pick(&[1.0, 0.25]), self.pick(&[-1.0, 0.0, 0.5, 0.25]));
        let nesterov = self.below(2) == 0;
        self.refill(PARAM);
        let params: Vec<usize> = (0..self.dense.len())
            .filter(|&t| self.dense[t].role == PARAM)
            .collect();
        let int = params
            .iter()
            .find(|&&t| !FLOATS.contains(&self.dense[t].dtype));
        let std = Call::BmufInit(lr, mu, nesterov);
        let (e, dev) = match int {
            _ if params.is_empty() => (all(INVALID_STATE, &["PARAM"]), None),
            Some(&t) => (
                all(INVALID_ARGUMENT, &[&format!("'{}'", self.dense[t].name)]),
                None,
            ),
            None => {
                let classes = [
                    "bmuf_args",
                    "boundary",
                    "call",
                    "register",
                    "local",
                    "benign",
                ];
                (Expect::Ok, self.draw_dev(&std, &classes, &[]))
            }
        };
        if !self.run(&std, e, dev, &mut |_| {}) {
            return;
        }
        let b = Bmuf::start(&mut self.dense, &params, self.total, (lr, mu, nesterov));
        self.bmuf = Some(b);
        self.grave.clear();
        self.check_values("after dpsync_bmuf_init", &[]);
    }

    fn bmuf_step(&mut self) {
        self.refill(PARAM);
        let now: BTreeSet<(String, u64)> = (self.dense.iter().filter(|t| t.role == PARAM))
            .map(|t| (t.name.clone(), t.id))
            .collect();
        // Not started, or the PARAMs changed since: INVALID_STATE everywhere.
        let (e, dev) = match &self.bmuf {
            Some(b) if b.params.iter().cloned().collect::<BTreeSet<_>>() == now => {
                let classes = ["call", "register", "local", "benign"];
                (Expect::Ok, self.draw_dev(&Call::BmufStep, &classes, &[]))
            }
            _ => (all(INVALID_STATE, &["dpsync_bmuf_init"]), None),
        };
        if !self.run(&Call::BmufStep, e, dev, &mut |_| {}) {
            return;
        }
        self.bmuf.as_mut().expect("a filter").step(&mut self.dense);
        self.check_values("after dpsync_bmuf_step", &[]);
    }
}
