//! Gradient steps: `dpsync_allreduce_grads` and `dpsync_reduce_scatter_grads`, with their
//! marks, early buckets and sparse slices.

use super::*;

impl World<'_> {
    /// A gradient step: `dpsync_allreduce_grads`, or with `scatter`
    /// `dpsync_reduce_scatter_grads` (each replica's own pieces of the dense gradients written,
    /// the rest as it was; sparse gradients gathered whole alike).
    pub(super) fn grads(&mut self, scatter: bool) {
        // Buckets started early in a world serve either step: host replicas (the engine
        // writes their results once the step agreed, for a reduce-scatter each local
        // replica's owned pieces alone), NCCL across the ranks (the owned pieces copied out of
        // the started bucket's buffers) and the staged path (copied back from the bucket's
        // stage).
        let marks = self.cfg.on("marks") && self.below(3) != 0;
        // CUDA replicas: no marks at a leave (buckets started early on the NCCL clique would
        // wait for the leaver's part in them).
        let marks = marks && !(self.leaving && self.setup.at.cuda());
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
        let mut std = match scatter {
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
            if self.dying.is_some() {
                self.tally.count("marks_where_a_rank_dies");
            }
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
                // Where a rank dies, a mark that starts a bucket after an earlier one failed
                // learns of the loss: RANK_LOST there, and the step is not made (lost_at).
                if st == dpsync_status::DPSYNC_STATUS_RANK_LOST && self.dying.is_some() {
                    self.lost_mark = Some(last_error());
                    break;
                }
                self.expect(st, &e, "dpsync_grad_ready");
            }
            self.early_buckets(&every, dev.as_mut(), scatter);
        }
        if !self.sparse.is_empty() && self.cfg.on("sparse_share") {
            self.tally.count("sparse_share");
        }
        self.set_slices(&sl);
        let ok = self.run(&mut std, Expect::Ok, dev, &mut |w| {
            if let Some((s, k, v)) = bad_here {
                sl.poke(s, k, v);
            }
            // After a loss the model's slices are the survivors' replicas' and, the step's
            // gradients computed again, set again.
            if let Some((first, n)) = w.redo {
                sl.drop_replicas(first, n);
                return w.set_slices(&sl);
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
        self.last_op = Some(op);
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

    /// After the marks (`every`: each rank's): the buckets each rank started early, on this
    /// rank as describe counts them. In bucket order (NCCL across the ranks
    /// and the staged path alike), on a rank whose registrations are those the last successful step agreed
    /// on. With buckets in flight on the NCCL clique, a
    /// rank that calls a collective other than a gradient step (`call`) is refused at once:
    /// its own INVALID_STATE.
    /// `scatter`: they finish a reduce-scatter step (counted apart).
    pub(super) fn early_buckets(
        &mut self,
        every: &[Vec<(usize, usize)>],
        dev: Option<&mut Dev>,
        scatter: bool,
    ) {
        let buckets = model::buckets(&self.dense, self.fusion);
        let can_start = |r: usize| self.agreed[r] && self.last_op.is_some();
        // Reproducible sums: float buckets start only after an AVG step, where they can be
        // summed as they go: by the engine (host memory, or CUDA replicas staged through it:
        // any float), or over an NCCL clique by its route to the owners (F32 or F64, and not
        // where exponent fields then integers move fewer bytes: `k + n` element sizes against
        // `2 n (field + 8)`, k replicas over n GPUs); elsewhere they only mark, and the
        // buckets after one wait with it (integers start).
        let floats = |b: &Vec<usize>| b.iter().any(|&t| FLOATS.contains(&self.dense[t].dtype));
        let wide = |b: &Vec<usize>| {
            (b.iter()).all(|&t| matches!(self.dense[t].dtype, DType::F32 | DType::F64))
        };
        let avg = self.last_op == Some(AVG);
        let engine = !self.setup.nccl() && avg;
        let (k, n) = (self.per_rank.iter().sum::<usize>(), self.setup.groups);
        let to_owners = |b: &Vec<usize>| {
            let (size, field) = match self.dense[b[0]].dtype {
                DType::F64 => (8, 2),
                _ => (4, 1),
            };
            (k + n) * size <= 2 * n * (field + 8)
        };
        let clique = |b: &Vec<usize>| self.setup.nccl() && avg && to_owners(b);
        let startable =
            |b: &Vec<usize>| !(self.repro && floats(b)) || engine || (clique(b) && wide(b));
        let started: Vec<usize> = (0..self.per_rank.len())
            .map(|r| {
                let marked = |t: &usize| (0..self.per_rank[r]).all(|k| every[r].contains(&(*t, k)));
                let complete = (buckets.iter())
                    .take_while(|b| b.iter().all(marked) && startable(b))
                    .count();
                if can_start(r) {
                    complete
                } else {
                    0
                }
            })
            .collect();
        let here = &self.ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"];
        if self.leaving {
            // Host replicas mark at a leave too: this rank started what its last agreed step
            // let it (the leave is learnt in the step), which the model, its world already
            // without the leaver, no longer knows. The values are checked as always.
            self.tally.count("marks_at_a_leave");
            return;
        }
        if here.as_u64() != Some(started[self.rank] as u64) {
            let want = started[self.rank];
            self.fail(format!(
                "describe: {here} buckets started early, not {want}"
            ));
        }
        if started.iter().any(|&n| n > 0) {
            self.tally.count("early_buckets");
            let mine = &buckets[..started[self.rank]];
            if self.repro && mine.iter().any(floats) {
                self.tally.count("early_reproducible_floats");
            }
            if scatter {
                self.tally.count("early_buckets_scatter");
            }
        }
        // A gradient step of either shape finishes them.
        let step = |c: &Option<Call>| matches!(c, Some(Call::Grads(_) | Call::Scatter(_)));
        let other = |d: &&mut Dev| d.class == "call" && !step(&d.call);
        let clique = self.setup.nccl();
        if let Some(dev) = dev.filter(|d| clique && other(d) && started[d.rank] > 0) {
            self.note(format!("rank {} has buckets in flight", dev.rank));
            self.tally.count("call_in_flight");
            dev.expect = own(dev.rank, INVALID_STATE, &["dpsync_allreduce_grads"]);
        }
    }

    pub(super) fn set_slices(&self, sl: &Slices) {
        for (s, per_replica) in sl.set.iter().enumerate() {
            for (k, &(_, i, v, rows)) in per_replica.iter().enumerate() {
                let st = self.ctx.sparse_set_raw(&self.sparse[s].name, k, i, v, rows);
                self.ok(st, "dpsync_sparse_set");
            }
        }
    }
}
