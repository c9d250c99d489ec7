//! The other collectives: `dpsync_allreduce`, broadcast, average, allgather and BMUF.

use super::*;

impl World<'_> {
    pub(super) fn allreduce(&mut self) {
        let op = self.pick(&[SUM, AVG]);
        let t = self.below(self.dense.len() + 1);
        // At a kill, a tensor (kill draws the call only where there is one).
        let t = match self.dying {
            Some(_) => t % self.dense.len(),
            None => t,
        };
        if t == self.dense.len() {
            // A name that is not a dense tensor: NOT_FOUND on every rank.
            let name = match self.sparse.first() {
                Some(s) if self.g.below(2) == 0 => s.name.clone(),
                _ => "nope".to_owned(),
            };
            let e = all(NOT_FOUND, &[&format!("'{name}'")]);
            self.run(&mut Call::Allreduce(Some(name), op), e, None, &mut |_| {});
            return;
        }
        self.fill(t);
        let mut std = Call::Allreduce(Some(self.dense[t].name.clone()), op);
        let dev = self.draw_dev(&std, &["op", "name", "boundary", "benign"], &[]);
        if self.run(&mut std, Expect::Ok, dev, &mut |_| {}) {
            let d = &mut self.dense[t];
            d.vals = vec![reduce(d.dtype, &d.vals, op); self.total];
            self.check_values("after dpsync_allreduce", &[]);
        }
    }

    pub(super) fn broadcast_or_average(&mut self, broadcast: bool) {
        let roles = 1 + self.below(15) as u32;
        let root = self.below(self.total);
        self.refill(roles);
        let mut std = match broadcast {
            true => Call::Broadcast(roles, root),
            false => Call::Average(roles),
        };
        let classes = [
            "root", "roles", "boundary", "call", "register", "local", "benign",
        ];
        let dev = self.draw_dev(&std, &classes[usize::from(!broadcast)..], &[]);
        if !self.run(&mut std, Expect::Ok, dev, &mut |_| {}) {
            return;
        }
        // After a loss the root is renumbered.
        let root = match std {
            Call::Broadcast(_, root) => root,
            _ => root,
        };
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
    pub(super) fn allgather(&mut self) {
        let roles = 1 + self.below(15) as u32;
        self.refill(roles);
        if let Some(t) = (!self.dense.is_empty()).then(|| self.below(self.dense.len())) {
            let (name, count) = (&self.dense[t].name, self.dense[t].vals[0].len());
            // At a leave the model already counts the smaller world; the library, until the
            // call, the one it knows.
            for k in (0..self.local).filter(|_| !self.leaving) {
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
        let mut std = Call::Allgather(roles);
        let classes = ["roles", "boundary", "call", "register", "local", "benign"];
        let dev = self.draw_dev(&std, &classes, &[]);
        if !self.run(&mut std, Expect::Ok, dev, &mut |_| {}) {
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

    pub(super) fn bmuf_init(&mut self) {
        let (lr, mu) = (self.pick(&[1.0, 0.25]), self.pick(&[-1.0, 0.0, 0.5, 0.25]));
        let nesterov = self.below(2) == 0;
        self.refill(PARAM);
        let params: Vec<usize> = (0..self.dense.len())
            .filter(|&t| self.dense[t].role == PARAM)
            .collect();
        let int = params
            .iter()
            .find(|&&t| !FLOATS.contains(&self.dense[t].dtype));
        let mut std = Call::BmufInit(lr, mu, nesterov);
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
        if !self.run(&mut std, e, dev, &mut |_| {}) {
            return;
        }
        let b = Bmuf::start(&mut self.dense, &params, self.total, (lr, mu, nesterov));
        self.bmuf = Some(b);
        self.grave.clear();
        self.check_values("after dpsync_bmuf_init", &[]);
    }

    pub(super) fn bmuf_step(&mut self) {
        self.refill(PARAM);
        // Not started, or the PARAMs changed since: INVALID_STATE everywhere.
        let (e, dev) = match self.bmuf_current() {
            true => {
                let classes = ["call", "register", "local", "benign"];
                (Expect::Ok, self.draw_dev(&Call::BmufStep, &classes, &[]))
            }
            false => (all(INVALID_STATE, &["dpsync_bmuf_init"]), None),
        };
        if !self.run(&mut Call::BmufStep, e, dev, &mut |_| {}) {
            return;
        }
        self.bmuf.as_mut().expect("a filter").step(&mut self.dense);
        self.check_values("after dpsync_bmuf_step", &[]);
    }
}
