//! Ranks leaving at random calls (`dpsync_leave`, host replicas): the leaver stands for its
//! part in the others' next collective, which completes over the remaining replicas; the model
//! then drops the leaver's replicas ([`World::drop_rank`], the step a lost rank would take too); every change
//! grows the world's epoch.

use super::*;

impl World<'_> {
    /// Now and then (per seed, drawn alike on every rank from the leave generator) one rank
    /// leaves at a collective, never the last one: the calls at which one leaves.
    pub(super) fn draw_leaves(g: &mut Lcg, ranks: usize, calls: usize, on: bool) -> Vec<usize> {
        if !on || ranks < 2 || g.below(3) != 0 {
            return Vec::new();
        }
        let n = 1 + g.below(ranks as u64 - 1) as usize;
        let mut at: Vec<usize> = (0..n).map(|_| g.below(calls as u64) as usize).collect();
        at.sort_unstable();
        at
    }

    /// One rank leaves: it calls `dpsync_leave` (which must work), sees a collective refused
    /// with INVALID_STATE, and stops. The others drop its replicas from the model and make a
    /// collective that succeeds without deviations (a deviation and a leave at once would each
    /// be another case); it completes over their replicas, and they are renumbered.
    pub(super) fn leave(&mut self) {
        let r = self.lg.below(self.per_rank.len() as u64) as usize;
        self.note(format!("rank {r} leaves at the others' next collective"));
        self.tally.count("leave");
        self.tally.calls += 1;
        if r == self.rank {
            // SAFETY: a live context.
            let st = unsafe { dpsync_leave(self.ctx.0) };
            self.ok(st, "dpsync_leave");
            let st = self.ctx.broadcast(PARAM, 0);
            let e = all(INVALID_STATE, &["left its world"]);
            self.expect(st, &e, "a collective after dpsync_leave");
            // Its epoch grew with the others' (queries still answer).
            self.epoch += 1;
            self.check_epoch();
            self.left = true;
            return;
        }
        self.drop_rank(r);
        self.leaving = true;
        let shards = self.cfg.on("shards");
        match self.below(4) {
            0 => self.broadcast_or_average(true),
            1 => self.broadcast_or_average(false),
            2 if shards => self.allgather(),
            _ => {
                let scatter = shards && self.below(2) == 0;
                self.grads(scatter)
            }
        }
        self.leaving = false;
        self.check_place();
    }

    /// The model's world without rank `r`'s replicas: the world replicas after them move down
    /// (tensor values, offsets, totals, so broadcast roots and AVG's divisor count the
    /// remaining ones), the ranks after it are renumbered, BMUF's default momentum is
    /// recounted, and no rank's registrations are those of a step any more (the plan is made
    /// again: nothing starts early until the next successful `dpsync_allreduce_grads`).
    pub(super) fn drop_rank(&mut self, r: usize) {
        assert_ne!(r, self.rank, "this rank's own replicas are not dropped");
        let first: usize = self.per_rank[..r].iter().sum();
        let n = self.per_rank.remove(r);
        self.creation.remove(r);
        for t in &mut self.dense {
            t.vals.drain(first..first + n);
        }
        self.agreed.remove(r);
        self.agreed.fill(false);
        self.total -= n;
        if r < self.rank {
            self.rank -= 1;
            self.offset -= n;
        }
        if let Some(b) = &mut self.bmuf {
            b.recount(self.total);
        }
        self.epoch += 1;
    }

    /// `dpsync_world_epoch` counts the model's world changes.
    pub(super) fn check_epoch(&self) {
        let (mut epoch, mut first) = (u64::MAX, usize::MAX);
        // SAFETY: a live context and valid out pointers.
        let st = unsafe { dpsync_world_epoch(self.ctx.0, &mut epoch, &mut first) };
        self.ok(st, "dpsync_world_epoch");
        if epoch != self.epoch {
            self.fail(format!("dpsync_world_epoch: {epoch}, not {}", self.epoch));
        }
    }

    /// `dpsync_rank`, `dpsync_world_replicas` and `dpsync_world_epoch` are the model's
    /// (renumbered after a leave).
    pub(super) fn check_place(&self) {
        self.check_epoch();
        // BMUF's block momentum as describe shows it (the default recounted).
        if let Some(b) = &self.bmuf {
            let got = &self.ctx.describe_json()["bmuf"]["block_momentum"];
            if got.as_f64() != Some(b.mu) {
                self.fail(format!("describe: block_momentum {got}, not {}", b.mu));
            }
        }
        let (mut rank, mut ranks, mut total, mut offset) = (0, 0, 0, 0);
        // SAFETY: a live context and valid out pointers.
        let st = unsafe { dpsync_rank(self.ctx.0, &mut rank, &mut ranks) };
        self.ok(st, "dpsync_rank");
        // SAFETY: as above.
        let st = unsafe { dpsync_world_replicas(self.ctx.0, &mut total, &mut offset) };
        self.ok(st, "dpsync_world_replicas");
        let want = (self.rank, self.per_rank.len(), self.total, self.offset);
        if (rank, ranks, total, offset) != want {
            let got = (rank, ranks, total, offset);
            self.fail(format!(
                "after a leave: (rank, ranks, world replicas, offset) {got:?}, not {want:?}"
            ));
        }
    }
}
