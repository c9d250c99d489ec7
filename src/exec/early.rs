//! A world's gradient buckets started ahead of `dpsync_allreduce_grads` (`dpsync_grad_ready`):
//! started on the engine's steps channel (host memory) or queued on the NCCL clique (device
//! memory), finished once the step agrees, or drained when it fails (context/overlap.rs).

use super::{dense, view, Executor};
use crate::backend::Ticket;
use crate::error::Result;
use crate::plan::Bucket;
use crate::registry::TensorView;
use crate::types::{DType, Memory, ReduceOp};

/// A bucket started early with NCCL across the ranks ([`dense::start_in_groups`]): its
/// groups' buffers and the AVG divisor its unpack applies.
struct StartedInGroups {
    buffers: Vec<crate::backend::Allocation>,
    avg: Option<usize>,
}

impl Executor {
    /// A world's gradient bucket started ahead of `dpsync_allreduce_grads` (`dpsync_grad_ready`,
    /// host memory): queued on the engine's steps channel in bucket order, every local
    /// replica's data summed piece by piece as the pieces go; nothing is written until
    /// [`Executor::finish_early`].
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`], until the bucket is finished.
    pub unsafe fn start_early(
        &self,
        (b, bucket): (usize, &Bucket),
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
    ) -> Result<Ticket> {
        let _span = self.bucket_span("allreduce bucket started early", b, bucket, tensors);
        let site = self.site(bucket.memory);
        let ranks = site.ranks.expect("early transfers only in a world");
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        if site.levels.clique().is_some() {
            // NCCL across the ranks: queued on the groups' streams after what the callers
            // queued, which do not wait for it.
            let buffers = self.bracket_joined(false, || {
                dense::start_in_groups(site, &view(bucket, tensors))
            })?;
            return Ok(Ticket(Box::new(StartedInGroups { buffers, avg })));
        }
        dense::contributions(&view(bucket, tensors), &site.levels.groups[0], |segments| {
            ranks.start(bucket.dtype, segments, bucket.elements, avg)
        })
    }

    /// Finishes a bucket [`Executor::start_early`] started: its result into local replica 0
    /// (the engine writes it), then copied to the other local replicas.
    ///
    /// # Safety
    /// As for [`Executor::start_early`], with the same bucket.
    pub unsafe fn finish_early(
        &self,
        (b, bucket): (usize, &Bucket),
        tensors: &[&TensorView],
        ticket: Ticket,
    ) -> Result<()> {
        let _span = self.bucket_span("allreduce bucket finished", b, bucket, tensors);
        let site = self.site(bucket.memory);
        let ticket = match ticket.0.downcast::<StartedInGroups>() {
            Ok(started) => {
                let view = view(bucket, tensors);
                return self
                    .bracket(|| dense::finish_started(site, &view, &started.buffers, started.avg));
            }
            Err(other) => Ticket(other),
        };
        let ranks = site.ranks.expect("early transfers only in a world");
        ranks.finish(ticket, true)?;
        let members = &site.levels.groups[0];
        if members.len() > 1 {
            site.backend.spread(0, &view(bucket, tensors), members[0])?;
        }
        Ok(())
    }

    /// The step agreed: a transfer [`Executor::start_early`] started may write its result as its
    /// pieces complete (`Ranks::release`; NCCL's started buckets are written in
    /// [`Executor::finish_early`]).
    ///
    /// # Safety
    /// As for [`Executor::finish_early`].
    pub unsafe fn release_early(&self, ticket: &Ticket) {
        if let (Some(ranks), false) = (self.ranks(), ticket.0.is::<StartedInGroups>()) {
            ranks.release(ticket);
        }
    }

    /// Lets a world's started transfers advance (`Ranks::poke`).
    pub fn poke_early(&self) {
        if let Some(ranks) = self.ranks() {
            ranks.poke();
        }
    }

    /// Drains a failed step: stand-ins of `(dtype, elements)` for the buckets other ranks
    /// started and this one did not, then every started transfer waited for, nothing written.
    /// The steps' channel is then in the same place on every rank.
    pub fn drain_early(&self, tickets: Vec<Ticket>, stand_ins: &[(DType, usize)]) -> Result<()> {
        let Some(ranks) = self.ranks() else {
            return Ok(());
        };
        if self.levels.clique().is_some() {
            // NCCL across the ranks: the stand-ins queued after this rank's started buckets
            // (the clique then has the same collectives on every rank); the started buckets'
            // buffers go once their queued work has run.
            return self.bracket_joined(false, || {
                for &(dtype, elements) in stand_ins {
                    dense::stand_in_groups(self.site(Memory::Device), dtype, elements)?;
                }
                drop(tickets);
                Ok(())
            });
        }
        let mut tickets = tickets;
        for &(dtype, elements) in stand_ins {
            // SAFETY: no memory of the caller is read or written.
            tickets.push(unsafe { ranks.start(dtype, &[], elements, None)? });
        }
        for ticket in tickets {
            // SAFETY: nothing is written.
            unsafe { ranks.finish(ticket, false)? };
        }
        Ok(())
    }
}
