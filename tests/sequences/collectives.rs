//! Modelled collectives: `dpsync_allreduce_grads`, `dpsync_allreduce`, `dpsync_broadcast`,
//! `dpsync_average` and `dpsync_grad_ready` (overlap with backward).

use std::collections::HashSet;

use crate::buffers::{divide_each, refill};
use crate::common::{abi::*, buf::*, context::*};
use crate::model::{op_name, Gathered, Marks, Sim, Want};
use dpsync::*;

impl Sim {
    pub(crate) fn allreduce_grads_call(&mut self, op: u32) {
        let mut errs = Vec::new();
        if op != SUM && op != AVG {
            errs.push(INVALID_ARGUMENT);
        }
        if self.inconsistent(GRAD) {
            errs.push(INCONSISTENT);
        }
        if self.mid_step() && self.last_op == Some(AVG) && op == SUM {
            errs.push(INVALID_STATE);
        }
        if self.sparse_step_fails() {
            errs.push(INCONSISTENT);
        }
        let want = if errs.is_empty() {
            let mut pred = self.contents();
            let early: HashSet<String> = match &self.marks {
                Some(m) => (m.buckets.iter().zip(&m.reduced))
                    .filter(|(_, &r)| r)
                    .flat_map(|(b, _)| b.names.iter().cloned())
                    .collect(),
                None => HashSet::new(),
            };
            for t in self.selected(GRAD) {
                if !early.contains(&self.tensors[t].name) {
                    let b = self.reduce(t, op);
                    Self::set_all(&mut pred, t, &b);
                } else if self.last_op == Some(SUM) && op == AVG {
                    // summed early, divided now (docs/API.md "Overlap")
                    for (r, slot) in pred[t].iter_mut().enumerate() {
                        *slot = Some(divide_each(self.tensors[t].buf(r), self.n));
                    }
                }
            }
            Want::Ok(pred)
        } else {
            Want::Err(errs)
        };
        let gathered: Vec<Gathered> = if matches!(want, Want::Ok(_)) {
            (0..self.sparse.len()).map(|s| self.gather(s, op)).collect()
        } else {
            Vec::new()
        };
        // SAFETY: valid handle; slices stay valid (owned by the model).
        let st = self.call(
            format!("allreduce_grads({})", op_name(op)),
            want,
            |ctx| unsafe { dpsync_allreduce_grads(ctx, op) },
        );
        if st != OK {
            if self.chance(0.5) {
                self.op_sparse_get(); // the previous gathered slices are kept
            }
            return;
        }
        self.last_step_early = self
            .marks
            .as_ref()
            .map_or(0, |m| m.reduced.iter().filter(|&&r| r).count());
        self.marks = None;
        self.last_op = Some(op);
        for (s, g) in gathered.into_iter().enumerate() {
            let entry = &mut self.sparse[s];
            entry.gathered = Some(g);
            for sl in entry.slices.iter_mut().filter_map(Option::take) {
                self.graveyard.push(sl.indices);
                self.graveyard.push(sl.values);
            }
        }
        if self.chance(0.6) {
            let mut got: Vec<Vec<Option<usize>>> = Vec::new();
            for s in 0..self.sparse.len() {
                let name = self.sparse[s].name.clone();
                got.push(
                    (0..self.n)
                        .map(|r| self.sparse_get_call(&name, r, false))
                        .collect(),
                );
            }
            // docs/API.md: slices set with the same indices buffer and row count on every
            // replica share one index gather and return the same indices pointer.
            for a in 0..self.sparse.len() {
                for b in a + 1..self.sparse.len() {
                    let key = |s: usize| {
                        &self.sparse[s]
                            .gathered
                            .as_ref()
                            .expect("gathered")
                            .share_key
                    };
                    if key(a) == key(b) && key(a).iter().all(|&(p, _)| p != 0) && got[a] != got[b] {
                        self.fail(format!(
                            "sparse gradients '{}' and '{}' were set with the same indices \
                             buffers and rows on every replica, but sparse_get returned indices \
                             {:x?} and {:x?}",
                            self.sparse[a].name, self.sparse[b].name, got[a], got[b]
                        ));
                    }
                }
            }
        }
    }

    pub(crate) fn op_allreduce_grads(&mut self) {
        let last = self.last_op;
        let op = match last {
            Some(op) if self.chance(0.7) => op,
            _ => self.pick_op(),
        };
        if !self.sparse.is_empty() && self.chance(0.7) {
            self.op_sparse_set_all();
        }
        self.allreduce_grads_call(op);
    }

    pub(crate) fn op_allreduce(&mut self) {
        let name = self.pick_name();
        let op = self.pick_op();
        let mut errs = Vec::new();
        if op != SUM && op != AVG {
            errs.push(INVALID_ARGUMENT);
        }
        let t = self.find(&name);
        match t {
            _ if name.is_empty() => errs.push(INVALID_ARGUMENT),
            None => errs.push(NOT_FOUND), // unknown, or a sparse gradient
            Some(t) if self.tensors[t].spec().is_none() => errs.push(INCONSISTENT),
            Some(_) => {}
        }
        let want = match t {
            Some(t) if errs.is_empty() => {
                let mut pred = self.contents();
                let b = self.reduce(t, op);
                Self::set_all(&mut pred, t, &b);
                Want::Ok(pred)
            }
            _ => Want::Err(errs),
        };
        let c = cstr(&name);
        // SAFETY: valid handle and name.
        self.call(
            format!("allreduce('{name}', {})", op_name(op)),
            want,
            |ctx| unsafe { dpsync_allreduce(ctx, c.as_ptr(), op) },
        );
    }

    pub(crate) fn op_broadcast(&mut self) {
        let roles = self.pick_roles();
        let root = self.pick_replica();
        let want = self.roles_want(roles, root >= self.n, |sim, t| {
            sim.tensors[t].buf(root).clone()
        });
        // SAFETY: valid handle.
        self.call(
            format!("broadcast(roles {roles:#x}, root {root})"),
            want,
            |ctx| unsafe { dpsync_broadcast(ctx, roles, root) },
        );
    }

    pub(crate) fn op_average(&mut self) {
        let roles = self.pick_roles();
        let want = self.roles_want(roles, false, |sim, t| sim.reduce(t, AVG));
        // SAFETY: valid handle.
        self.call(format!("average(roles {roles:#x})"), want, |ctx| unsafe {
            dpsync_average(ctx, roles)
        });
    }

    /// What a collective over the tensors of `roles` must do: fail with INVALID_ARGUMENT (bad
    /// `roles`, or `bad_arg` for another argument) or INCONSISTENT (a selected tensor), or
    /// leave every selected tensor as `result` on every replica.
    pub(crate) fn roles_want(
        &self,
        roles: u32,
        bad_arg: bool,
        result: impl Fn(&Sim, usize) -> Buf,
    ) -> Want {
        let mut errs = Vec::new();
        if roles == 0 || roles & !0xF != 0 || bad_arg {
            errs.push(INVALID_ARGUMENT);
        }
        if self.inconsistent(roles) {
            errs.push(INCONSISTENT);
        }
        if !errs.is_empty() {
            return Want::Err(errs);
        }
        let mut pred = self.contents();
        for t in self.selected(roles) {
            Self::set_all(&mut pred, t, &result(self, t));
        }
        Want::Ok(pred)
    }

    pub(crate) fn grad_ready_call(&mut self, name: &str, replica: usize) {
        let mut errs = Vec::new();
        if replica >= self.n {
            errs.push(INVALID_ARGUMENT);
        }
        let t = self.find(name);
        // An empty name, or a sparse gradient's (not a dense GRAD).
        if name.is_empty() || self.find_sparse(name).is_some() {
            errs.push(INVALID_ARGUMENT);
        } else {
            match t {
                None => errs.push(NOT_FOUND),
                Some(t) => match self.tensors[t].spec() {
                    // Not a GRAD and inconsistent: the docs name both errors.
                    None if self.tensors[t].role_bits() != GRAD => {
                        errs.extend([INCONSISTENT, INVALID_ARGUMENT])
                    }
                    None => errs.push(INCONSISTENT),
                    Some((role, _, _)) if role != GRAD => errs.push(INVALID_ARGUMENT),
                    Some(_) => {}
                },
            }
        }
        if self.inconsistent(GRAD) {
            errs.push(INCONSISTENT);
        }
        let mut marks = None;
        let mut early = String::new();
        let want = match t {
            Some(_) if errs.is_empty() => {
                let mut m = self.marks.clone().unwrap_or_else(|| {
                    let buckets = self.buckets();
                    Marks {
                        reduced: vec![false; buckets.len()],
                        buckets,
                        ready: HashSet::new(),
                    }
                });
                let mut pred = self.contents();
                if m.ready.insert((name.to_owned(), replica)) {
                    let b = (m.buckets.iter())
                        .position(|b| b.names.iter().any(|n| n == name))
                        .expect("every consistent GRAD is in a bucket");
                    let complete = (m.buckets[b].names.iter())
                        .all(|n| (0..self.n).all(|r| m.ready.contains(&(n.clone(), r))));
                    if let (true, Some(op)) = (complete, self.last_op) {
                        for n in &m.buckets[b].names {
                            let t = self.find(n).expect("registered");
                            let reduced = self.reduce(t, op);
                            Self::set_all(&mut pred, t, &reduced);
                        }
                        m.reduced[b] = true;
                        early =
                            format!(" [completes bucket {b}: reduced now with {}]", op_name(op));
                    }
                }
                marks = Some(m);
                Want::Ok(pred)
            }
            _ => Want::Err(errs),
        };
        let c = cstr(name);
        // SAFETY: valid handle and name.
        let st = self.call(
            format!("grad_ready('{name}', {replica}){early}"),
            want,
            |ctx| unsafe { dpsync_grad_ready(ctx, c.as_ptr(), replica) },
        );
        if st == OK {
            self.marks = marks;
        }
    }

    pub(crate) fn op_grad_ready(&mut self) {
        let grads: Vec<String> = (self.tensors.iter())
            .filter(|t| t.role_bits() & GRAD != 0)
            .map(|t| t.name.clone())
            .collect();
        let name = if !grads.is_empty() && self.chance(0.8) {
            self.pick_from(&grads)
        } else {
            self.pick_name()
        };
        let replica = self.pick_replica();
        self.grad_ready_call(&name, replica);
    }

    /// A backward pass: every GRAD declared ready, last registered first, replicas interleaved
    /// (some marks skipped, some repeated), then usually the step's allreduce_grads.
    pub(crate) fn op_backward(&mut self) {
        if !self.mid_step() {
            for t in self.selected(GRAD) {
                for r in 0..self.n {
                    let s = self.tensors[t].slots[r].as_mut().expect("consistent");
                    refill(&mut s.buf, &mut self.g);
                }
            }
            self.note("-- refill every GRAD, then a backward pass".into());
        }
        let grads: Vec<String> = (self.selected(GRAD).into_iter().rev())
            .map(|t| self.tensors[t].name.clone())
            .collect();
        let skip = self.chance(0.3);
        for name in grads {
            let mut order: Vec<usize> = (0..self.n).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, self.g.below(i as u64 + 1) as usize);
            }
            for r in order {
                if skip && self.chance(0.2) {
                    continue;
                }
                self.grad_ready_call(&name, r);
                if self.chance(0.05) {
                    self.grad_ready_call(&name, r); // declared twice: a no-op
                }
            }
        }
        if self.chance(0.75) {
            self.op_allreduce_grads();
        }
    }
}
