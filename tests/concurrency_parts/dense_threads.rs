//! The threads of a dense run: replica threads (backward, grad_ready), the coordinator that ends
//! each step and checks it, the observer.

use super::*;

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
    pub(super) fn replica(&self, r: usize) {
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
    pub(super) fn coordinate(&self) -> Outcome {
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
    pub(super) fn observe(&self) {
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
