//! A rank killed at a random call (`Config::kill`: an elastic world under an MPI with ULFM,
//! host replicas): the rank drawn SIGKILLs itself instead of making the call; every survivor
//! gets RANK_LOST from it naming that rank (by its number before the loss), finds every tensor
//! but the GRADs with its bytes from before the call, drops the rank from the model
//! ([`World::drop_rank`], as after a leave), computes the GRADs again and makes the call
//! again, which must work over the survivors' replicas. Below min_ranks the context is failed
//! instead, and the survivors stop.

use super::*;

const RANK_LOST: dpsync_status = dpsync_status::DPSYNC_STATUS_RANK_LOST;

/// Ends this process at once, as a crash would (no MPI_Finalize, no destructor).
fn die() -> ! {
    // SAFETY: sends a signal to this process.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL returned");
}

impl World<'_> {
    /// One rank (drawn alike on every rank) dies at a collective that would succeed: a
    /// broadcast, average, allgather, allreduce, BMUF step or gradient step (no deviation;
    /// before a step, marks as drawn: the dying rank's own, then it dies).
    pub(super) fn kill(&mut self) {
        let r = self.kg.below(self.per_rank.len() as u64) as usize;
        self.note(format!("rank {r} dies at the next collective"));
        self.tally.count("kill");
        let shards = self.cfg.on("shards");
        let bmuf = self.cfg.on("bmuf") && self.bmuf_current();
        self.dying = Some(r);
        match self.kg.below(7) {
            0 => self.broadcast_or_average(true),
            1 => self.broadcast_or_average(false),
            2 if shards => self.allgather(),
            3 if !self.dense.is_empty() => self.allreduce(),
            4 if bmuf => self.bmuf_step(),
            5 if shards => self.grads(true),
            _ => self.grads(false),
        }
        self.dying = None;
    }

    /// [`World::run`] at the call rank `r` dies at: it dies; the others check RANK_LOST and
    /// what it left, and unless the context failed, call `retry` and make `std` again over
    /// the survivors (a broadcast's root renumbered, or drawn anew where it was the lost
    /// rank's). Whether `std` was made again (the caller then updates the model).
    pub(super) fn lost_at(
        &mut self,
        std: &mut Call,
        r: usize,
        retry: &mut dyn FnMut(&mut Self),
    ) -> bool {
        self.note(format!("{std:?}; rank {r} dies instead"));
        self.tally.calls += 1;
        if r == self.rank {
            die();
        }
        let fails = self.per_rank.len() - 1 < self.min_ranks;
        let named = format!("rank {r} (numbers before the loss) lost");
        let mut needles = vec![named.as_str()];
        if fails {
            needles.push("min_ranks");
        }
        match self.lost_mark.take() {
            None => {
                let st = std.invoke(&self.ctx);
                self.expect(st, &all(RANK_LOST, &needles), &format!("{std:?}"));
                self.tally.count("rank_lost");
            }
            // A mark before the step learnt of the loss: the step is where the others learn
            // of it, and the one this rank now makes again.
            Some(msg) if needles.iter().all(|n| msg.contains(n)) => {
                self.tally.count("rank_lost_at_grad_ready")
            }
            Some(msg) => self.fail(format!(
                "dpsync_grad_ready: RANK_LOST {msg:?}, not naming {needles:?}"
            )),
        }
        self.check_kept(&format!("after {std:?} answered RANK_LOST"));
        let (first, n) = (self.per_rank[..r].iter().sum(), self.per_rank[r]);
        self.lost.push(self.creation[r]);
        self.lost.sort_unstable();
        self.drop_rank(r);
        self.check_lost();
        if fails {
            // The context is failed: collectives are refused, and this rank stops.
            let st = self.ctx.broadcast(PARAM, 0);
            let e = all(INVALID_STATE, &["min_ranks", "refuses collectives"]);
            self.expect(st, &e, "a collective after a loss below min_ranks");
            self.tally.count("below_min_ranks");
            self.check_epoch();
            self.left = true;
            return false;
        }
        self.check_place();
        // The step's gradients computed again.
        self.refill(GRAD);
        if let Call::Broadcast(_, root) = std {
            *root = match *root {
                w if w < first => w,
                w if w >= first + n => w - n,
                _ => self.below(self.total),
            };
        }
        self.redo = Some((first, n));
        retry(self);
        self.redo = None;
        self.note(format!("{std:?} again over the survivors"));
        self.tally.calls += 1;
        let st = std.invoke(&self.ctx);
        self.ok(st, "the call again after the loss");
        self.tally.count(std.function());
        if matches!(std, Call::Grads(_) | Call::Scatter(_)) {
            self.agreed.fill(true);
        }
        true
    }

    /// BMUF started over the PARAMs registered now (a step would succeed).
    pub(super) fn bmuf_current(&self) -> bool {
        let now: BTreeSet<(String, u64)> = (self.dense.iter().filter(|t| t.role == PARAM))
            .map(|t| (t.name.clone(), t.id))
            .collect();
        (self.bmuf.iter()).any(|b| b.params.iter().cloned().collect::<BTreeSet<_>>() == now)
    }

    /// After RANK_LOST: every tensor but the GRADs holds its bytes from before the call (GRADs
    /// are unspecified until the call is made again; the sparse outputs, as before the call,
    /// are checked by tests/world_lost_parts/sparse.rs, not here).
    fn check_kept(&self, what: &str) {
        for t in self.dense.iter().filter(|t| t.role != GRAD) {
            for k in 0..self.local {
                let (got, want) = (t.bufs[k].vals(), &t.vals[self.offset + k]);
                if !same(&got, want) {
                    let (name, dt) = (&t.name, t.dtype);
                    self.fail(format!(
                        "{what}: '{name}' {dt:?} on replica {k}: {got:?}, not its bytes from \
                         before the call {want:?}"
                    ));
                }
            }
        }
    }

    /// describe's "lost": the lost ranks by their numbers at creation.
    fn check_lost(&self) {
        let got = &self.ctx.describe_json()["world"]["lost"];
        if *got != serde_json::json!(self.lost) {
            self.fail(format!("describe: lost {got}, not {:?}", self.lost));
        }
    }
}
