//! A world's gradient buckets started ahead of `dpsync_allreduce_grads` (`dpsync_grad_ready`):
//! started on the engine's steps channel (host memory) or queued on the NCCL clique (device
//! memory), finished once the step agrees, or drained when it fails (context/overlap.rs).

use super::shard::{owned_by, pieces_of, Place};
use super::{dense, repro_clique, staged, view, Executor};
use crate::backend::{BucketStage, BucketView, Done, Ranks, Segment, Ticket};
use crate::error::Result;
use crate::plan::{Bucket, Levels, Route};
use crate::registry::TensorView;
use crate::types::{DType, Memory, ReduceOp};

/// A bucket started early with NCCL across the ranks ([`dense::start_in_groups`]): its
/// groups' buffers and the AVG divisor its unpack applies.
struct StartedInGroups {
    buffers: Vec<crate::backend::Allocation>,
    avg: Option<usize>,
}

/// A bucket of CUDA replicas started early on the staged route: this rank's contribution
/// copied into a page-locked stage of its own on the devices' streams, the engine's transfer
/// gated on that copy ([`Ranks::start`](crate::backend::Ranks)), the result copied back into
/// every local replica by [`Executor::finish_early`].
struct StartedStaged {
    ticket: Option<Ticket>,
    stage: Option<BucketStage>,
    copied: Done,
}

impl Drop for StartedStaged {
    fn drop(&mut self) {
        drop(self.ticket.take()); // the engine reads the stage no more
        if !matches!((self.copied)(), Ok(true)) {
            // The copy into it may still run (a failed world, a destroyed context): given
            // back, the memory could be reused while the device writes it. Kept, not waited
            // for: nothing hangs.
            std::mem::forget(self.stage.take());
        }
    }
}

impl Executor {
    /// A world's gradient bucket started ahead of `dpsync_allreduce_grads` (`dpsync_grad_ready`,
    /// host memory): queued on the engine's steps channel in bucket order, every local
    /// replica's data summed piece by piece as the pieces go; nothing is written until
    /// [`Executor::finish_early`], unless `early` (the step is expected to be an allreduce):
    /// then a bucket of one local replica takes its results as they complete, its originals
    /// kept to be put back if the step fails (`Ranks::start`).
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`], until the bucket is finished.
    pub unsafe fn start_early(
        &self,
        (b, bucket): (usize, &Bucket),
        tensors: &[&TensorView],
        op: ReduceOp,
        (divisor, early): (usize, bool),
    ) -> Result<Ticket> {
        let _span = self.bucket_span("allreduce bucket started early", b, bucket, tensors);
        let site = self.site(bucket.memory);
        let ranks = site.ranks.expect("early transfers only in a world");
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        if site.levels.clique().is_some() {
            // NCCL across the ranks: queued on the groups' streams after what the callers
            // queued, which do not wait for it. A reproducible sum divides in its kernel.
            let reproducible = reproducible_contributions(site.levels, bucket.dtype).is_some();
            let buffers = self.bracket_joined(false, || {
                let view = view(bucket, tensors);
                match reproducible {
                    true => {
                        repro_clique::start(site, Some(&view), (view.dtype, view.elements()), avg)
                    }
                    false => dense::start_in_groups(site, &view),
                }
            })?;
            let avg = avg.filter(|_| !reproducible);
            return Ok(Ticket(Box::new(StartedInGroups { buffers, avg })));
        }
        if site.levels.route == Route::RanksStaged {
            let reproducible = reproducible_contributions(site.levels, bucket.dtype);
            return self.start_staged(site, ranks, &view(bucket, tensors), (avg, reproducible));
        }
        let how = (
            avg,
            early,
            reproducible_contributions(site.levels, bucket.dtype),
        );
        super::staged::contributions(&view(bucket, tensors), &site.levels.groups[0], |segments| {
            ranks.start(bucket.dtype, segments, bucket.elements, how, None)
        })
    }

    /// Whether `bucket` can start before its step agrees with `op` ([`Executor::start_early`]):
    /// every bucket but a reproducible context's float buckets, which start only with AVG (a
    /// SUM divided afterwards for an AVG step would round twice where the contract rounds
    /// once) and where they can be summed reproducibly as they go: by the engine (host
    /// memory, or CUDA replicas staged through it, any float: [`Ranks::starts_reproducibly`]),
    /// or over an NCCL clique of the ranks, F32 and F64 by the route to the owners
    /// ([`repro_clique::starts`]); elsewhere (F16/BF16 over the clique) they cross in pieces
    /// of their own (exec/repro.rs) once the step agreed. Alike on every rank.
    pub fn starts_early(&self, bucket: &Bucket, op: ReduceOp) -> bool {
        let site = self.site(bucket.memory);
        if !(site.levels.reproducible && bucket.dtype.is_float()) {
            return true;
        }
        if op != ReduceOp::Avg {
            return false;
        }
        if site.levels.clique().is_some() {
            return repro_clique::starts(site, bucket.dtype);
        }
        let through_host = matches!(site.levels.route, Route::RanksFromHost | Route::RanksStaged);
        let engine = site.ranks.filter(|_| through_host);
        engine.is_some_and(|r| r.starts_reproducibly(bucket.dtype))
    }

    /// Finishes a bucket [`Executor::start_early`] started: its result into every local replica
    /// (the engine writes each from one read of it); with `scatter` (a
    /// reduce-scatter step), into each local replica's owned pieces alone (host replicas: as
    /// [`Executor::release_early`] said; over NCCL: copied out of the bucket's buffers).
    ///
    /// # Safety
    /// As for [`Executor::start_early`], with the same bucket.
    pub unsafe fn finish_early(
        &self,
        (b, bucket): (usize, &Bucket),
        tensors: &[&TensorView],
        ticket: Ticket,
        scatter: Option<Place>,
    ) -> Result<()> {
        let _span = self.bucket_span("allreduce bucket finished", b, bucket, tensors);
        let site = self.site(bucket.memory);
        let ticket = match ticket.0.downcast::<StartedStaged>() {
            Ok(mut started) => {
                let ranks = site.ranks.expect("early transfers only in a world");
                let inner = started.ticket.take().expect("finished once");
                ranks.finish(inner, true)?;
                let stage = started.stage.as_ref().expect("kept until finished").ptr;
                let members: Vec<&TensorView> =
                    bucket.tensors.iter().map(|&t| tensors[t]).collect();
                let local: Vec<usize> =
                    (0..site.levels.groups.iter().map(Vec::len).sum()).collect();
                let owned = scatter.map(|place| pieces_of(&members, &local, place));
                let back = self.bracket(|| {
                    staged::stage_back(site, &view(bucket, tensors), stage, owned.as_deref())
                });
                if back.is_err() {
                    // The copy back may still read it: not reused, not freed.
                    std::mem::forget(started.stage.take());
                }
                return back;
            }
            Err(other) => Ticket(other),
        };
        let ticket = match ticket.0.downcast::<StartedInGroups>() {
            Ok(started) => {
                let view = view(bucket, tensors);
                let members: Vec<&TensorView> =
                    bucket.tensors.iter().map(|&t| tensors[t]).collect();
                let owned = scatter.map(|place| owned_by(&members, place));
                let owned = owned
                    .as_ref()
                    .map(|f| f as &dyn Fn(usize, usize) -> (usize, usize));
                let (buffers, avg) = (&started.buffers, started.avg);
                return self.bracket(|| dense::finish_started(site, &view, buffers, avg, owned));
            }
            Err(other) => Ticket(other),
        };
        let ranks = site.ranks.expect("early transfers only in a world");
        // Writes every local replica: a reduce-scatter's release their own pieces, an
        // allreduce's the whole result into each.
        ranks.finish(ticket, true)
    }

    /// The step agreed: a transfer [`Executor::start_early`] started may write its result as its
    /// pieces complete (`Ranks::release`; NCCL's started buckets are written in
    /// [`Executor::finish_early`]). With `scatter` (a reduce-scatter step of host replicas:
    /// [`Executor::early_serves_either`]) only each local replica's owned pieces are written.
    ///
    /// # Safety
    /// As for [`Executor::finish_early`].
    pub unsafe fn release_early(
        &self,
        ticket: &Ticket,
        (bucket, tensors): (&Bucket, &[&TensorView]),
        scatter: Option<Place>,
    ) {
        let own = ticket.0.is::<StartedInGroups>() || ticket.0.is::<StartedStaged>();
        if let (Some(ranks), false) = (self.ranks(), own) {
            // A piece per contribution: the local replicas, as `start_early` gave them.
            let owned: Option<Vec<(usize, usize)>> = scatter.map(|place| {
                let members: Vec<&TensorView> =
                    bucket.tensors.iter().map(|&t| tensors[t]).collect();
                pieces_of(&members, &self.site(bucket.memory).levels.groups[0], place)
            });
            ranks.release(ticket, owned.as_deref());
        }
    }

    /// Whether a bucket started early serves a reduce-scatter step as well as an allreduce
    /// one: in a world, its result is written only once the step agreed, so either shape
    /// can be written (host memory over the engine: each local replica's owned pieces
    /// alone, every local replica a contribution; over NCCL: the owned pieces copied out of
    /// the bucket's summed buffers, as a reduce-scatter step's combine leaves them). In one
    /// process early buckets write at once, so they follow the previous step's shape.
    pub fn early_serves_either(&self) -> bool {
        let route = &self.levels.route;
        let either = matches!(
            route,
            Route::RanksFromHost | Route::RanksOverClique(_) | Route::RanksStaged
        );
        self.ranks.is_some() && either
    }

    /// One bucket reduce-scattered ahead of `dpsync_reduce_scatter_grads` (`dpsync_grad_ready`
    /// in one process after a reduce-scatter step), as [`Executor::allreduce_early`] does
    /// for allreduce steps.
    ///
    /// # Safety
    /// As for [`Executor::reduce_scatter_buckets`].
    pub unsafe fn reduce_scatter_early(
        &self,
        bucket: &Bucket,
        tensors: &[&TensorView],
        op: ReduceOp,
        (divisor, place): (usize, Place),
    ) -> Result<()> {
        let bucket = std::slice::from_ref(bucket);
        self.bracket_joined(false, || {
            self.reduce_scatter_buckets(bucket, tensors, op, divisor, place)
        })
    }

    /// Results of a world's started transfers written early go back (`Ranks::hold`): a
    /// collective other than their step is being agreed.
    pub fn hold_early(&self) {
        if let Some(ranks) = self.ranks() {
            ranks.hold();
        }
    }

    /// Lets a world's started transfers advance (`Ranks::poke`).
    pub fn poke_early(&self) {
        if let Some(ranks) = self.ranks() {
            ranks.poke();
        }
    }

    /// Drains a failed step: stand-ins of `(dtype, elements, memory)` for the buckets other ranks
    /// started and this one did not, then every started transfer waited for, nothing written.
    /// The steps' channel is then in the same place on every rank.
    pub fn drain_early(
        &self,
        tickets: Vec<Ticket>,
        stand_ins: &[(DType, usize, Memory)],
    ) -> Result<()> {
        let Some(ranks) = self.ranks() else {
            return Ok(());
        };
        if self.levels.clique().is_some() {
            // NCCL across the ranks: the stand-ins queued after this rank's started buckets
            // (the clique then has the same collectives on every rank); the started buckets'
            // buffers go once their queued work has run.
            return self.bracket_joined(false, || {
                let site = self.site(Memory::Device);
                for &(dtype, elements, _) in stand_ins {
                    match reproducible_contributions(site.levels, dtype) {
                        // SAFETY: no memory of the caller is read or written.
                        Some(_) => drop(unsafe {
                            repro_clique::start(site, None, (dtype, elements), None)?
                        }),
                        None => dense::stand_in_groups(site, dtype, elements)?,
                    }
                }
                drop(tickets);
                Ok(())
            });
        }
        let mut tickets = tickets;
        for &(dtype, elements, memory) in stand_ins {
            // SAFETY: no memory of the caller is read or written.
            // Cut as the started bucket was (a reproducible one by its contributions).
            let how = (
                None,
                false,
                reproducible_contributions(self.site(memory).levels, dtype),
            );
            tickets.push(unsafe { ranks.start(dtype, &[], elements, how, None)? });
        }
        for ticket in tickets {
            // A staged bucket's stage is kept until the engine is done with it (below).
            let (ticket, _staged) = match ticket.0.downcast::<StartedStaged>() {
                Ok(mut started) => (started.ticket.take().expect("finished once"), Some(started)),
                Err(other) => (Ticket(other), None),
            };
            // SAFETY: nothing is written; the inputs live until this returns.
            unsafe { ranks.finish(ticket, false)? };
        }
        Ok(())
    }

    /// [`Executor::start_early`] on the staged route: the rank's contribution copied into a
    /// page-locked stage of its own after the work the callers queued (which do not wait for
    /// it), the engine's transfer started on it, gated on the copy. The contribution is the
    /// allreduce's: the one replica's bucket; several replicas' sum over levels 1–2 in the
    /// fusion buffers (the same kernels and order, the replicas unchanged until the step
    /// agrees); f16/bf16 every replica's bucket, summed by the engine in f32; a reproducible
    /// sum (`reproducible`: the replicas on every rank) every replica's raw bucket, summed
    /// reproducibly by the engine.
    fn start_staged(
        &self,
        site: super::Site<'_>,
        ranks: &dyn Ranks,
        bucket: &BucketView<'_>,
        (avg, reproducible): (Option<usize>, Option<&[usize]>),
    ) -> Result<Ticket> {
        let streams = site.backend.streams().expect("the staged route is CUDA's");
        let local: usize = site.levels.groups.iter().map(Vec::len).sum();
        let every = bucket.dtype.is_half() || reproducible.is_some();
        let contributors = if every { local } else { 1 };
        let bytes = bucket.dtype.size() * bucket.elements();
        let stage = streams.bucket_stage(bytes * contributors)?;
        let copied = self.bracket_joined(false, || {
            // SAFETY: the stage holds the contributions; the replicas' memory stays valid
            // (the contract) until the step ends, the fusion buffer until the next collective
            // on the same streams, which follows the copy.
            unsafe {
                if contributors < local {
                    let sum = dense::sum_into_fusion(site.backend, site.levels, bucket)?;
                    let first = site.levels.groups[0][0];
                    streams.stage_copy(first, stage.ptr, sum as usize, bytes)?;
                } else {
                    for k in 0..contributors {
                        staged::copy_out(streams, bucket, k, stage.ptr + k * bytes)?;
                    }
                }
            }
            streams.queued_done()
        })?;
        let gate = copied.clone();
        let staged: Vec<usize> = (0..contributors).map(|k| stage.ptr + k * bytes).collect();
        let segment = Segment {
            ptrs: &staged,
            count: bucket.elements(),
        };
        let data = (
            bucket.dtype,
            std::slice::from_ref(&segment),
            bucket.elements(),
        );
        // SAFETY: the stage lives in the ticket until the transfer finished.
        let ticket = unsafe {
            ranks.start(
                data.0,
                data.1,
                data.2,
                (avg, false, reproducible),
                Some(Box::new(move || gate())),
            )?
        };
        Ok(Ticket(Box::new(StartedStaged {
            ticket: Some(ticket),
            stage: Some(stage),
            copied,
        })))
    }
}

/// A started bucket's contributions on every rank where its sum is reproducible (a
/// reproducible context's float bucket): every rank's replicas (host memory: its one group;
/// staged CUDA replicas: every device's), the levels' counts.
fn reproducible_contributions(levels: &Levels, dtype: DType) -> Option<&[usize]> {
    let reproducible = levels.reproducible && dtype.is_float();
    reproducible.then_some(&levels.ranks[..])
}
