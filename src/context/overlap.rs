//! Overlap (`dpsync_grad_ready`): gradients declared final during backward; a bucket whose
//! tensors are all final on every replica is reduced at once, and `dpsync_allreduce_grads`
//! finishes the rest.
//!
//! The op only comes with `allreduce_grads`, so early buckets use the op of the previous one
//! (frameworks keep it from step to step): the step then gives exactly the bytes it gives
//! without the calls. Before the first `allreduce_grads` nothing starts early. If the op
//! changes, SUM buckets are divided for AVG (docs/API.md, "Overlap": rounding), and AVG buckets
//! cannot be turned back into sums: that call is refused.
//!
//! Worlds: a bucket crosses the ranks in bucket order on the engine's steps channel, so the
//! buckets start (every local replica's data summed into the engine's stage, the transfer
//! issued, nothing written) as the next ones in order become final, and only while the
//! registrations are those the last `allreduce_grads` agreed on with every rank (so every rank
//! that starts one has the same buckets). `allreduce_grads` agrees first, then writes the
//! started buckets' results and reduces the rest in order; if its agreement fails, the ranks
//! exchange what they started, issue stand-ins for what others started, drop everything and
//! forget the marks: nothing was written. Host contexts, and CUDA replicas with NCCL across the
//! ranks: there a bucket is packed into buffers of its own and its collective queued on the
//! clique (unpacked by `allreduce_grads`), and since the clique carries every collective,
//! others are refused while a step's buckets are in flight (`check_nothing_in_flight`).
//!
//! Shapes: early buckets take the previous gradient step's shape as they take its op. In one
//! process, after a reduce-scatter step they reduce-scatter (an allreduce step then gathers
//! their pieces: the same bytes); after an allreduce step they reduce whole, and a
//! reduce-scatter step is refused. In a world a started bucket writes nothing until the step
//! agreed, so it serves either shape: of host replicas, a reduce-scatter's release writes each
//! local replica's own pieces; over NCCL, they are copied out of the bucket's summed buffers.
//!
//! Marks belong to one plan: registrations that would change the buckets are refused while a
//! bucket of the step has been reduced early (they would reduce it twice or not at all), and
//! merely make the next mark forget the old ones otherwise (those buckets are then reduced by
//! `allreduce_grads`, as without the calls).

use std::sync::Arc;

use serde_json::{json, Value};

use super::shard::Shape;
use super::sparse::SparseStep;
use super::Context;
use crate::backend::Ticket;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::world::{Records, INLINE};
use crate::plan::{Bucket, Plan};
use crate::registry::TensorView;
use crate::types::{DType, Memory, ReduceOp, Role};

/// Sparse gradients whose index groups ride in a world's agreement record (after the count of
/// early buckets); more take an exchange of their own.
const INLINE_LABELS: usize = INLINE - 8;

/// This step's `dpsync_grad_ready` marks.
#[derive(Default)]
pub(super) struct Overlap {
    /// The plan the marks refer to; `None` before the first mark of a step.
    plan: Option<Arc<Plan>>,
    /// Per snapshot tensor, its bucket (GRADs only).
    bucket_of: Vec<Option<usize>>,
    /// Per (tensor, replica), `tensor * replicas + replica`: declared final this step.
    ready: Vec<bool>,
    /// Per bucket: marks still missing.
    missing: Vec<usize>,
    /// Per bucket: reduced by `grad_ready` this step, with `op`.
    reduced: Vec<bool>,
    /// The op of the last successful gradient step: what early buckets use (None: nothing
    /// starts early).
    op: Option<ReduceOp>,
    /// The last successful gradient step was a reduce-scatter: in one process, early buckets
    /// reduce-scatter too (they write at once).
    scatter: bool,
    /// In a world, the last successful gradient step was an allreduce: early buckets expect
    /// this one to be too, and write their results at once where they can (`Ranks::start`).
    expect_allreduce: bool,
    /// Buckets reduced early in the last completed step, for `describe`.
    last_step_early: usize,
    /// In a world: the transfers of buckets `0..started.len()` of this step, started early in
    /// bucket order and finished by `allreduce_grads` (context/overlap.rs, "Worlds").
    started: Vec<Ticket>,
    /// In a world: the registry generation the last successful `allreduce_grads` agreed on
    /// with every rank. Buckets start early only while it is current: every rank that starts
    /// one then has the same buckets.
    pub(super) agreed: Option<u64>,
    /// In a world: buckets of this step started by `allreduce_grads` because other ranks
    /// started them early ([`Context::settle_world_step`]); not counted as early here.
    caught_up: usize,
}

impl Overlap {
    fn any_reduced(&self) -> bool {
        self.reduced.iter().any(|&r| r)
    }

    /// Marks for `plan`, kept if they already refer to it.
    fn start(&mut self, plan: &Arc<Plan>, tensors: usize, replicas: usize) -> Result<()> {
        if self.plan.as_ref().is_some_and(|p| Arc::ptr_eq(p, plan)) {
            return Ok(());
        }
        if self.any_reduced() {
            // Registrations are refused while a bucket is reduced early (check_not_mid_step);
            // forgetting the early buckets now would reduce them twice.
            return Err(Error::new(
                ErrorKind::InvalidState,
                "the buckets changed while some were reduced early; call \
                 dpsync_allreduce_grads to end the step",
            ));
        }
        let mut bucket_of = vec![None; tensors];
        for (b, bucket) in plan.buckets.iter().enumerate() {
            for &t in &bucket.tensors {
                bucket_of[t] = Some(b);
            }
        }
        self.missing = (plan.buckets.iter())
            .map(|b| b.tensors.len() * replicas)
            .collect();
        self.reduced = vec![false; plan.buckets.len()];
        self.ready = vec![false; tensors * replicas];
        self.bucket_of = bucket_of;
        self.plan = Some(plan.clone());
        Ok(())
    }

    /// Every mark forgotten (a new step, or registrations changed the buckets).
    pub(super) fn forget(&mut self) {
        debug_assert!(
            self.started.is_empty(),
            "started transfers are finished first"
        );
        *self = Overlap {
            op: self.op,
            scatter: self.scatter,
            expect_allreduce: self.expect_allreduce,
            last_step_early: self.last_step_early,
            agreed: self.agreed,
            ..Overlap::default()
        };
    }
}

impl Context {
    /// Refuses a registration change that would alter the buckets of a step some of whose
    /// buckets `grad_ready` already reduced.
    pub(super) fn check_not_mid_step(&self, name: &str, what: &str) -> Result<()> {
        let reduced = self.overlap.reduced.iter().filter(|&&r| r).count();
        if reduced == 0 {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::InvalidState,
            format!(
                "cannot {what} tensor '{name}' now: dpsync_grad_ready already reduced {reduced} \
                 bucket(s) of this step; call dpsync_allreduce_grads first"
            ),
        ))
    }

    pub fn grad_ready(&mut self, name: &str, replica: usize) -> Result<()> {
        self.check_replica_of("tensor", name, replica)?;
        self.check_member("dpsync_grad_ready")?;
        if let Some(t) = &self.trace {
            t.instant("grad_ready", json!({"tensor": name, "replica": replica}));
        }
        if self.sparse.contains(name) {
            return Err(Error::invalid(format!(
                "tensor '{name}' is a sparse gradient: dpsync_allreduce_grads gathers it; \
                 dpsync_grad_ready takes dense GRAD tensors"
            )));
        }
        let (snapshot, plan) = self.prepare();
        let t = snapshot.position(name)?;
        let tensor = &snapshot.tensors[t];
        if tensor.role != Role::Grad {
            return Err(Error::invalid(format!(
                "tensor '{name}' is a {} tensor: dpsync_grad_ready takes GRAD tensors",
                tensor.role.name()
            )));
        }
        // A bucket reduced now must be one allreduce_grads would reduce: refuse what it would.
        snapshot.grads_to_reduce()?;
        let replicas = self.replica_count();
        self.overlap
            .start(&plan, snapshot.tensors.len(), replicas)?;
        let b = self.overlap.bucket_of[t].expect("every GRAD is in a bucket");
        let mark = t * replicas + replica;
        if self.overlap.ready[mark] {
            return Ok(()); // declared twice: nothing new
        }
        let planned = &plan.buckets[b];
        // Host tensors on CUDA replicas are reduced by the host after the callers' streams ran
        // what they queued: started here, that wait would block this backward thread (and,
        // through the context's lock, every other replica's) until all the GPUs caught up.
        // allreduce_grads reduces them instead, once.
        // In a world, buckets must cross the ranks in the same order on every rank, which the
        // order of readiness does not give: they start in bucket order (below).
        // Reproducible sums are not started early either: an early SUM later divided for AVG would
        // round twice where the step's AVG rounds once.
        let early = !self.executor.touching_waits(planned.memory)
            && !self.in_world()
            && !self.options.reproducible;
        if let (1, Some(op), true) = (self.overlap.missing[b], self.overlap.op, early) {
            // The bucket over its own tensors only, renumbered: a step costs O(tensors), not
            // O(tensors x buckets) (backends key their caches by pointers, not indices).
            let tensors: Vec<&TensorView> = (planned.tensors.iter())
                .map(|&t| &snapshot.tensors[t])
                .collect();
            let bucket = Bucket {
                tensors: (0..tensors.len()).collect(),
                ..planned.clone()
            };
            let divisor = self.divisor();
            // SAFETY: registered memory stays valid while registered (the C contract).
            unsafe {
                match self.overlap.scatter {
                    false => (self.executor).allreduce_early(&bucket, &tensors, op, divisor)?,
                    true => (self.executor).reduce_scatter_early(
                        &bucket,
                        &tensors,
                        op,
                        (divisor, self.place()),
                    )?,
                }
            };
            self.overlap.reduced[b] = true;
        }
        self.overlap.ready[mark] = true;
        self.overlap.missing[b] -= 1;
        if self.in_world() && self.overlap.agreed == Some(snapshot.generation) {
            if let Some(op) = self.overlap.op {
                if let Err(e) = self.start_world_buckets(&snapshot.tensors, &plan, op, None) {
                    return self.lost_while_marking(e);
                }
            }
            if !self.overlap.started.is_empty() {
                self.executor.poke_early();
            }
        }
        Ok(())
    }

    /// A bucket could not start because this rank's world failed (a transfer of a bucket
    /// started earlier failed, e.g. with a dead peer). In an elastic world this mark is where
    /// this rank learns of a loss (dpsync_elastic.h: "dpsync_grad_ready included"): it votes
    /// with the other survivors, which vote at their own mark or at the step whose agreement
    /// then fails alike, and on a loss the world is made again over them and this answers
    /// RANK_LOST (the step's gradients to be computed again, the step made again).
    fn lost_while_marking(&mut self, e: Error) -> Result<()> {
        let Some(ranks) = self.executor.ranks().filter(|_| self.options.elastic > 0) else {
            return Err(e);
        };
        ranks.begin("dpsync_grad_ready");
        self.vote(Err(e))
    }

    /// Worlds: starts the transfers of the step's next buckets whose gradients are all final,
    /// in bucket order (every rank issues them in that order on the engine's steps channel, the
    /// rest in `allreduce_grads`); with `upto`, buckets `..upto` whatever their marks (another
    /// rank started them). A reproducible context's float buckets start only with AVG, where
    /// the engine sums them reproducibly as they go (`Executor::starts_early`), and the
    /// buckets after one that cannot wait with it.
    fn start_world_buckets(
        &mut self,
        all: &[TensorView],
        plan: &Plan,
        op: ReduceOp,
        upto: Option<usize>,
    ) -> Result<()> {
        // Buckets another rank started are started once the step agreed: nothing early then.
        let early = self.overlap.expect_allreduce && upto.is_none();
        let divisor = self.divisor();
        let next = &mut self.overlap.started;
        while let Some(planned) = plan.buckets.get(next.len()) {
            let b = next.len();
            // Host tensors on CUDA replicas wait for allreduce_grads (as in grad_ready), and
            // the buckets after them with them: buckets start in order.
            let stop = match upto {
                Some(upto) => b >= upto,
                None => {
                    self.overlap.missing[b] > 0
                        || self.executor.touching_waits(planned.memory)
                        || !self.executor.starts_early(planned, op)
                }
            };
            if stop {
                break;
            }
            let (bucket, tensors) = own_bucket(planned, all);
            // SAFETY: registered memory stays valid while registered (the C contract);
            // registrations are refused until the step ends (check_not_mid_step).
            let ticket = unsafe {
                (self.executor).start_early((b, &bucket), &tensors, op, (divisor, early))?
            };
            next.push(ticket);
            self.overlap.reduced[b] = true;
        }
        Ok(())
    }

    /// Worlds: what the other ranks must know of this rank's step before `allreduce_grads`
    /// moves data, riding in its agreement record: how many buckets it started early (u64),
    /// then its sparse gradients' index groups (a byte each) where they fit.
    pub(super) fn step_record(&self, step: &SparseStep) -> Vec<u8> {
        let mut record = (self.overlap.started.len() as u64).to_le_bytes().to_vec();
        if step.len() <= INLINE_LABELS {
            // A label is at most its input's position, so below 256.
            record.extend(step.labels().iter().map(|&l| l as u8));
        }
        record
    }

    /// Worlds, `allreduce_grads` agreed (`records`: every rank's [`Context::step_record`]):
    /// buckets another rank started early are started here too, so that every rank has the
    /// same transfers in flight before the sparse gather (which crosses the ranks too); and the
    /// sparse gather takes the index groups every rank can use. Returns what is then left to
    /// reduce, as [`Context::split_buckets`].
    pub(super) fn settle_world_step<'s>(
        &mut self,
        records: &Records,
        step: &mut SparseStep,
        plan: &Arc<Plan>,
        tensors: &[&'s TensorView],
        op: ReduceOp,
    ) -> Result<(Vec<usize>, Vec<&'s TensorView>)> {
        let ranks = self.topology.world_size;
        let word = |r: usize| {
            u64::from_le_bytes(records.inline(r)[..8].try_into().expect("8 bytes")) as usize
        };
        if step.len() > 1 {
            let labels: Vec<Vec<usize>> = if step.len() <= INLINE_LABELS {
                (0..ranks)
                    .map(|r| {
                        let bytes = &records.inline(r)[8..8 + step.len()];
                        bytes.iter().map(|&l| usize::from(l)).collect()
                    })
                    .collect()
            } else {
                let mine: Vec<u8> = (step.labels().iter())
                    .flat_map(|&l| (l as u32).to_le_bytes())
                    .collect();
                let ranks = self.executor.ranks().expect("records come from a world");
                (ranks.allgather(&mine)?.iter())
                    .map(|m| {
                        (m.chunks_exact(4))
                            .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")) as usize)
                            .collect()
                    })
                    .collect()
            };
            step.regroup(&labels);
        }
        let most = (0..ranks).map(word).max().unwrap_or(0);
        if most > self.overlap.started.len() {
            // Started with the previous step's op, as every rank does (the same on every rank:
            // it is the op of the last allreduce_grads they all completed).
            let early_op = self.overlap.op.ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidState,
                    "another rank started gradient buckets early before any \
                     dpsync_allreduce_grads completed here",
                )
            })?;
            let replicas = self.replica_count();
            let (snapshot, _) = self.prepare();
            self.overlap.start(plan, snapshot.tensors.len(), replicas)?;
            self.overlap.caught_up = most - self.overlap.started.len();
            self.start_world_buckets(&snapshot.tensors, plan, early_op, Some(most))?;
        }
        self.split_buckets(plan, tensors, op)
    }

    /// Worlds, the gradient step (`shape`) agreed: the early transfers' results written (in
    /// bucket order; a reduce-scatter's into the owned pieces alone), `started` being the
    /// step's ([`Context::take_started`]).
    pub(super) fn finish_world_buckets(
        &self,
        started: Vec<Ticket>,
        all: &[TensorView],
        (plan, shape): (&Plan, Shape),
    ) -> Result<()> {
        let scatter = (shape == Shape::ReduceScatter).then(|| self.place());
        for (b, ticket) in started.iter().enumerate() {
            let (bucket, tensors) = own_bucket(&plan.buckets[b], all);
            // SAFETY: as in start_world_buckets; every one is finished below.
            unsafe { (self.executor).release_early(ticket, (&bucket, &tensors), scatter) };
        }
        for (b, ticket) in started.into_iter().enumerate() {
            let (bucket, tensors) = own_bucket(&plan.buckets[b], all);
            // SAFETY: as in start_world_buckets.
            unsafe { (self.executor).finish_early((b, &bucket), &tensors, ticket, scatter)? };
        }
        Ok(())
    }

    /// Whether this step's early buckets reduce-scatter (one process, after a reduce-scatter
    /// step).
    pub(super) fn overlap_scatters(&self) -> bool {
        self.overlap.scatter
    }

    /// One process, an allreduce step: the tensors of the buckets `dpsync_grad_ready`
    /// reduce-scattered this step, which the step completes with an allgather (a
    /// reduce-scatter sums as allreduce does, so the bytes are the allreduce's).
    pub(super) fn early_scattered<'s>(
        &self,
        plan: &Arc<Plan>,
        tensors: &[&'s TensorView],
    ) -> Vec<&'s TensorView> {
        let current = (self.overlap.plan.as_ref()).is_some_and(|p| Arc::ptr_eq(p, plan));
        if !(current && self.overlap.scatter) {
            return Vec::new();
        }
        (plan.buckets.iter().zip(&self.overlap.reduced))
            .filter(|(_, &reduced)| reduced)
            .flat_map(|(b, _)| b.tensors.iter().map(|&t| tensors[t]))
            .collect()
    }

    /// Buckets of this step reduced or started early.
    pub(super) fn early_buckets(&self) -> usize {
        let reduced = self.overlap.reduced.iter().filter(|&&r| r).count();
        reduced.max(self.overlap.started.len())
    }

    /// The step's early transfers, handed to [`Context::finish_world_buckets`].
    pub(super) fn take_started(&mut self) -> Vec<Ticket> {
        std::mem::take(&mut self.overlap.started)
    }

    /// With NCCL across the ranks the step's early buckets are queued on the clique every
    /// collective uses: another collective queued now would meet them in another order on a
    /// rank that started fewer (their streams would wait on each other), so it is refused here,
    /// before its agreement, which then fails it on every rank. The gradient step of either
    /// shape finishes them.
    pub(super) fn check_nothing_in_flight(&self, call: &str) -> Result<()> {
        let started = self.overlap.started.len();
        let step = ["dpsync_allreduce_grads", "dpsync_reduce_scatter_grads"];
        if started == 0
            || self.topology.world_nccl.is_none()
            || step.iter().any(|s| call.starts_with(s))
        {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::InvalidState,
            format!(
                "dpsync_grad_ready started {started} gradient bucket(s) of this step on the NCCL \
                 clique across the ranks: call dpsync_allreduce_grads or \
                 dpsync_reduce_scatter_grads before other collectives"
            ),
        ))
    }

    /// Worlds, `allreduce_grads` failed its agreement (every rank did): the ranks' early
    /// transfers are matched and dropped, so the steps channel is in the same place on every
    /// rank, and the step's marks are forgotten (nothing was written: the next
    /// `allreduce_grads` reduces every bucket).
    pub(super) fn drain_world_buckets(&mut self, plan: &Plan) -> Result<()> {
        let Some(ranks) = self.executor.ranks() else {
            return Ok(());
        };
        let started = std::mem::take(&mut self.overlap.started);
        // Every rank's started buckets, as (dtype code, elements); the longest list is what
        // every rank must have issued (the others' are prefixes of it: same buckets).
        let mine: Vec<u8> = (plan.buckets[..started.len()].iter())
            .flat_map(|b| [b.dtype.code() as u64, b.elements as u64])
            .flat_map(u64::to_le_bytes)
            .collect();
        let all = ranks.allgather(&mine)?;
        let longest = all
            .iter()
            .max_by_key(|m| m.len())
            .cloned()
            .unwrap_or_default();
        let words: Vec<u64> = (longest.chunks_exact(8))
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect();
        let stand_ins: Vec<(DType, usize, Memory)> = (words.chunks_exact(2))
            .zip(&plan.buckets)
            .skip(started.len())
            .filter_map(|(p, b)| Some((DType::from_code(p[0] as u32)?, p[1] as usize, b.memory)))
            .collect();
        let drained = self.executor.drain_early(started, &stand_ins);
        self.overlap.forget();
        drained
    }

    /// The buckets of `plan` that `allreduce_grads(op)` must still reduce, and the tensors of
    /// those `grad_ready` reduced that it must divide (summed early, `op` AVG). INVALID_STATE
    /// if they were averaged and `op` is SUM.
    pub(super) fn split_buckets<'s>(
        &self,
        plan: &Arc<Plan>,
        tensors: &[&'s TensorView],
        op: ReduceOp,
    ) -> Result<(Vec<usize>, Vec<&'s TensorView>)> {
        let current = self
            .overlap
            .plan
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(p, plan));
        let (left, early): (Vec<usize>, Vec<usize>) =
            (0..plan.buckets.len()).partition(|&b| !(current && self.overlap.reduced[b]));
        let mut divide = Vec::new();
        match (self.overlap.op, op) {
            _ if early.is_empty() => {}
            (Some(ReduceOp::Avg), ReduceOp::Sum) => {
                // SUM is a valid op; this step's state refuses it.
                return Err(Error::new(
                    ErrorKind::InvalidState,
                    format!(
                        "op is DPSYNC_REDUCE_SUM, but dpsync_grad_ready already averaged {} \
                     bucket(s) of this step with the previous step's op, DPSYNC_REDUCE_AVG; finish \
                     the step with AVG (the next step's early buckets follow the new op)",
                        early.len()
                    ),
                ));
            }
            (Some(ReduceOp::Sum), ReduceOp::Avg) => {
                for &b in &early {
                    divide.extend(plan.buckets[b].tensors.iter().map(|&t| tensors[t]));
                }
            }
            _ => {}
        }
        Ok((left, divide))
    }

    /// Called when a gradient step (`op`, `shape`) succeeded: the step is over, and `op` is
    /// the one the next step's early buckets use.
    pub(super) fn end_overlap_step(&mut self, op: ReduceOp, shape: Shape, generation: u64) {
        if self.in_world() {
            self.overlap.agreed = Some(generation);
        }
        let reduced = self.overlap.reduced.iter().filter(|&&r| r).count();
        self.overlap.last_step_early = reduced - self.overlap.caught_up;
        // Early buckets follow the step's shape in one process, and serve either shape in a
        // world.
        let scatter = shape == Shape::ReduceScatter;
        let follows = !self.in_world() || self.executor.early_serves_either();
        self.overlap.op = (!scatter || follows).then_some(op);
        self.overlap.scatter = scatter && !self.in_world();
        self.overlap.expect_allreduce = !scatter;
        self.overlap.forget();
    }

    pub(super) fn describe_overlap(&self) -> Value {
        // Marks of an older plan are forgotten by the next grad_ready.
        let o = &self.overlap;
        let current = (o.plan.as_ref()).is_some_and(|p| p.generation == self.registry.generation());
        let count = |v: &[bool]| {
            if current {
                v.iter().filter(|&&r| r).count()
            } else {
                0
            }
        };
        json!({
            "buckets_reduced_early_this_step": count(&o.reduced),
            "marks_this_step": count(&o.ready),
            "buckets_reduced_early_last_step": o.last_step_early,
            "op": o.op.map(|op| match op {
                ReduceOp::Sum => "SUM",
                ReduceOp::Avg => "AVG",
            }),
        })
    }
}

/// `planned` over its own tensors only, renumbered: a step costs O(tensors), not
/// O(tensors × buckets) (backends key their caches by pointers, not indices).
fn own_bucket<'a>(planned: &Bucket, all: &'a [TensorView]) -> (Bucket, Vec<&'a TensorView>) {
    let tensors: Vec<&TensorView> = planned.tensors.iter().map(|&t| &all[t]).collect();
    let bucket = Bucket {
        tensors: (0..tensors.len()).collect(),
        ..planned.clone()
    };
    (bucket, tensors)
}
