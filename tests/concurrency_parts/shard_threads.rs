//! The threads of a shard run: replica threads (backward, update of the owned pieces), the
//! coordinator that ends each step and gathers, the observer.

use super::*;

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

    pub(super) fn replica(&self, r: usize) {
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
    pub(super) fn coordinate(&self) -> ShardOutcome {
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
    pub(super) fn observe(&self) {
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
