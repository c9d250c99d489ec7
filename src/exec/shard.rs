//! Shards (ZeRO stage 1): the gradients reduced onto the pieces their replicas own, and the
//! owners' pieces copied back to every replica.
//!
//! Six routes, the first that applies:
//!
//! - Host memory in one process, and the replicas of one GPU in one process (a kernel), have a
//!   primitive of their own ([`Backend::reduce_owned`]: each replica's pieces summed as the
//!   backend's allreduce sums them, written once; [`Backend::spread_owned`]: each owner's
//!   pieces copied to the other replicas, one pass over each bucket).
//! - A world of host replicas: the engine's own ([`Ranks::reduce_scatter`]: its allreduce of
//!   every local replica's contribution, each local replica getting its own pieces, straight
//!   from and into the tensors; [`Ranks::allgather_owned`]: each rank's pieces, gathered into
//!   local replica 0 first, to every other rank, then spread to the other local replicas).
//! - CUDA replicas in a world staged through the host: every local replica's bucket a
//!   contribution in the page-locked stage, the engine's reduce-scatter there, each
//!   replica's own pieces copied back ([`dense::reduce_scatter_staged`]).
//! - An NCCL clique (several GPUs in one process, or NCCL across the ranks) where another
//!   summation order keeps the bytes below: `ncclReduceScatter` and `ncclAllGather` over
//!   owner-packed blocks ([`clique`] says where).
//! - Other NCCL cliques and several GPUs over peer or staged copies: the allreduce's combine
//!   of the groups' fusion buffers, each replica's pieces copied out of its group's buffer
//!   ([`dense::reduce_scatter_levels`]; with three GPUs or more in one process NCCL promises
//!   no common summation order between `ncclReduceScatter` and `ncclAllReduce`).
//! - Everywhere else (reproducible sums
//!   the engine cannot do in one exchange) a reduce-scatter is the allreduce of a
//!   library-owned copy of each bucket, on every route the allreduce takes, followed by each
//!   replica's owned pieces copied out (the copy moves the bucket twice more than the
//!   allreduce does, docs/PERFORMANCE.md).
//!
//! An allgather outside the first two routes and NCCL cliques is one broadcast per world
//! replica of the pieces it owns.
//!
//! In one process every element gets the bytes `dpsync_allreduce_grads` gives it (same buckets,
//! same levels, the same sums or sums that commute), so a ZeRO-1 step gives the bytes of an
//! allreduce step; across the
//! ranks too, except where the engine sums each rank's elements at that rank without shared
//! memory (3 ranks or more), sums a staged rank's several replicas itself, or reduce-scatters
//! over an NCCL clique of 3 GPUs or more: there up to the order of the sums, as the contract
//! allows. Nothing outside a replica's pieces is written.
//!
//! [`Backend::reduce_owned`]: crate::backend::Backend::reduce_owned
//! [`Backend::spread_owned`]: crate::backend::Backend::spread_owned
//! [`Ranks::reduce_scatter`]: crate::backend::Ranks::reduce_scatter
//! [`Ranks::allgather_owned`]: crate::backend::Ranks::allgather_owned

use super::clique;
use super::dense;
use super::staged::{self, contributions};
use super::{buckets_for, view, Executor, Site};
use crate::backend::{Allocation, Backend, Channel, EveryRank, Ranks};
use crate::error::Result;
use crate::plan::{Bucket, Levels, Route};
use crate::registry::TensorView;
use crate::types::{Memory, ReduceOp};

pub use crate::types::piece;

/// Where a process's replicas stand among the world's: `(world index of local replica 0,
/// world replicas)`.
#[derive(Clone, Copy)]
pub struct Place {
    pub offset: usize,
    pub total: usize,
}

impl TensorView {
    /// The elements `[at, at + count)` of this tensor on every replica, as a tensor of its own.
    pub fn piece(&self, at: usize, count: usize) -> TensorView {
        let size = self.dtype.size();
        TensorView {
            count,
            ptrs: self.ptrs.iter().map(|p| p + at * size).collect(),
            ..self.clone()
        }
    }
}

/// Whether the backend shards a bucket in one pass of its own ([`Backend::reduce_owned`],
/// [`Backend::spread_owned`]): host memory in one process, or the replicas of one GPU in one
/// process (a kernel over the group's table).
///
/// [`Backend::reduce_owned`]: crate::backend::Backend::reduce_owned
/// [`Backend::spread_owned`]: crate::backend::Backend::spread_owned
fn one_pass(levels: &Levels, memory: Memory, backend: &dyn Backend) -> bool {
    let device = backend.streams().is_some() && levels.groups.len() == 1;
    levels.in_place() && (memory == Memory::Host || device)
}

/// A world of host replicas (alike on every rank: the levels say): the engine reduces onto
/// each local replica's pieces itself ([`Ranks::reduce_scatter`], every local replica a
/// contribution) and gathers the ranks' pieces ([`Ranks::allgather_owned`]), straight from and
/// into the tensors.
fn host_world<'a>(site: &Site<'a>, memory: Memory) -> Option<&'a dyn Ranks> {
    let from_host = site.levels.route == Route::RanksFromHost;
    site.ranks.filter(|_| memory == Memory::Host && from_host)
}

/// The pieces `(first, count)` of every tensor of `members` on every local replica of
/// `replicas`, tensor after tensor ([`Ranks::reduce_scatter`]'s order).
pub(super) fn pieces_of(
    members: &[&TensorView],
    replicas: &[usize],
    place: Place,
) -> Vec<(usize, usize)> {
    let owned = owned_by(members, place);
    (0..members.len())
        .flat_map(|s| replicas.iter().map(move |&r| (s, r)))
        .map(|(s, r)| owned(s, r))
        .collect()
}

/// A rank's elements `(first, count)` of a tensor of `count` elements: the pieces of its world
/// replicas `(w, n)` (`w..w + n`) end to end, contiguous by the rule.
fn rank_piece(count: usize, (w, n): (usize, usize), total: usize) -> (usize, usize) {
    let first = piece(count, w, total).0;
    let end = match n {
        0 => first,
        _ => {
            let (f, c) = piece(count, w + n - 1, total);
            f + c
        }
    };
    (first, end - first)
}

/// Local replica `r`'s owned piece `(first, count)` of segment `s` of a bucket of `members`:
/// the piece of world replica `place.offset + r`.
pub(super) fn owned_by<'a>(
    members: &'a [&TensorView],
    place: Place,
) -> impl Fn(usize, usize) -> (usize, usize) + 'a {
    move |segment, r| piece(members[segment].count, place.offset + r, place.total)
}

impl Executor {
    /// Every local replica's owned pieces of every bucket's tensors := their sum over all
    /// replicas (divided by `divisor` for AVG); nothing else of the tensors is written.
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`].
    pub unsafe fn reduce_scatter_buckets(
        &self,
        buckets: &[Bucket],
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
        place: Place,
    ) -> Result<()> {
        self.bracket(|| {
            for bucket in buckets {
                self.reduce_scatter_bucket(bucket, tensors, op, divisor, place)?;
            }
            Ok(())
        })
    }

    /// One bucket of [`Executor::reduce_scatter_buckets`], by the first route of this module's
    /// list that applies.
    unsafe fn reduce_scatter_bucket(
        &self,
        bucket: &Bucket,
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
        place: Place,
    ) -> Result<()> {
        let members: Vec<&TensorView> = bucket.tensors.iter().map(|&t| tensors[t]).collect();
        let Some(replicas) = members.first().map(|t| t.ptrs.len()) else {
            return Ok(());
        };
        let site = self.site_to_touch(bucket.memory)?;
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        if one_pass(site.levels, bucket.memory, site.backend) && !site.levels.reproducible {
            // Host memory in one process, or replicas of one GPU: the backend's own
            // reduce-scatter, which sums as its allreduce does and writes each piece once.
            let _span = self.bucket_span("reduce-scatter bucket", 0, bucket, tensors);
            return site.backend.reduce_owned(
                &site.levels.groups[0],
                &view(bucket, tensors),
                avg,
                &owned_by(&members, place),
            );
        }
        // Integers' sums are exact already: the reproducible option leaves them plain.
        let reproducible = site.levels.reproducible && bucket.dtype.is_float();
        // The plan's layout, alike on every rank: the engine's reproducible sum and its
        // in-place reduce-scatter serve one replica per rank, and every rank must choose alike.
        let one_each = site.levels.ranks.iter().all(|&r| r == 1);
        // Every rank's elements: the pieces of its world replicas.
        let ranks_at: Vec<(usize, usize)> = (site.levels.ranks.iter())
            .scan(0, |w, &n| Some((std::mem::replace(w, *w + n), n)))
            .collect();
        let of_rank = |segment: usize, rank: usize| {
            rank_piece(members[segment].count, ranks_at[rank], place.total)
        };
        let every_rank = Some(EveryRank {
            owned: &of_rank,
            one_each,
        });
        let world = host_world(&site, bucket.memory).filter(|_| one_each || !reproducible);
        if let Some(ranks) = world {
            let _span = self.bucket_span("reduce-scatter bucket", 0, bucket, tensors);
            let local = &site.levels.groups[0];
            let owned = pieces_of(&members, local, place);
            // Every local replica a contribution, summed in the engine's stage in their order
            // (as the local sum of an allreduce), each getting its own pieces.
            let done = contributions(&view(bucket, tensors), local, |segments| {
                let data = (bucket.dtype, segments, &owned[..]);
                ranks.reduce_scatter(Channel::Steps, data, avg, reproducible, every_rank)
            })?;
            if done {
                return Ok(());
            }
        }
        if site.levels.route == Route::RanksStaged && (one_each || !reproducible) {
            // CUDA replicas across the ranks through the host: every local replica's bucket
            // a contribution to the engine's reduce-scatter in the stage, each replica's own
            // pieces copied back.
            let _span = self.bucket_span("reduce-scatter bucket", 0, bucket, tensors);
            let owned = pieces_of(&members, &(0..replicas).collect::<Vec<_>>(), place);
            let site = Site {
                channel: Channel::Steps,
                ..site
            };
            let (view, mine) = (view(bucket, tensors), (&owned[..], every_rank));
            if staged::reduce_scatter_staged(site, &view, mine, avg, reproducible)? {
                return Ok(());
            }
        }
        if !reproducible {
            // An NCCL clique where another summation order keeps the contract: each GPU's
            // owners' pieces packed into its block, `ncclReduceScatter`, each owner's sums
            // unpacked into it alone.
            let span = self.bucket_span("reduce-scatter bucket", 0, bucket, tensors);
            let site = Site {
                channel: Channel::Steps,
                ..site
            };
            if clique::reduce_scatter(site, &view(bucket, tensors), avg, place)? {
                return Ok(());
            }
            drop(span);
        }
        if !site.levels.reproducible {
            // Several GPUs, or NCCL across the ranks: the allreduce's combine of the groups'
            // fusion buffers, the owned pieces copied out of them.
            let _span = self.bucket_span("reduce-scatter bucket", 0, bucket, tensors);
            let owned = owned_by(&members, place);
            let site = Site {
                channel: Channel::Steps,
                ..site
            };
            if dense::reduce_scatter_levels(site, &view(bucket, tensors), avg, &owned)? {
                return Ok(());
            }
        }
        let backend = site.backend;
        let size = bucket.dtype.size();
        let copies: Vec<Allocation> = (0..replicas)
            .map(|r| backend.alloc(r, bucket.bytes()))
            .collect::<Result<_>>()?;
        // The copies, tensor after tensor as in the bucket.
        let mut shadows: Vec<TensorView> = Vec::with_capacity(members.len());
        let mut at = 0;
        for t in &members {
            let ptrs: Vec<usize> = copies.iter().map(|c| c.ptr() + at).collect();
            for (r, (&src, &dst)) in t.ptrs.iter().zip(&ptrs).enumerate() {
                if t.count > 0 {
                    backend.copy(r, src, r, dst, t.count * size)?;
                }
            }
            shadows.push(TensorView {
                ptrs,
                ..(*t).clone()
            });
            at += t.count * size;
        }
        let shadow_refs: Vec<&TensorView> = shadows.iter().collect();
        let shadow = Bucket {
            tensors: (0..shadows.len()).collect(),
            ..bucket.clone()
        };
        self.allreduce_buckets(&[shadow], &shadow_refs, op, divisor, Channel::Steps)?;
        for (t, s) in members.iter().zip(&shadows) {
            for r in 0..replicas {
                let (first, count) = piece(t.count, place.offset + r, place.total);
                let offset = first * size;
                if count > 0 {
                    backend.copy(r, s.ptrs[r] + offset, r, t.ptrs[r] + offset, count * size)?;
                }
            }
        }
        Ok(())
    }

    /// Every replica's copy of `tensors` := the owners' pieces (`locate`: a world replica's
    /// rank and local index), by the routes of this module's first lines.
    ///
    /// # Safety
    /// As for [`Executor::broadcast`].
    pub unsafe fn allgather(
        &self,
        tensors: &[&TensorView],
        place: Place,
        locate: impl Fn(usize) -> (usize, usize),
        fusion_bytes: usize,
    ) -> Result<()> {
        // Every rank's world replicas, `(first, count)`, for the engine's allgather.
        let mut spans_of: Vec<(usize, usize)> = Vec::new();
        for w in 0..place.total {
            let (rank, _) = locate(w);
            if spans_of.len() <= rank {
                spans_of.resize(rank + 1, (w, 0));
            }
            spans_of[rank].1 += 1;
        }
        self.bracket(|| {
            let mut rest: Vec<&TensorView> = Vec::new();
            for (b, bucket) in buckets_for(tensors, fusion_bytes).iter().enumerate() {
                let site = self.site_to_touch(bucket.memory)?;
                if let Some(ranks) = host_world(&site, bucket.memory) {
                    let _span = self.bucket_span("allgather bucket", b, bucket, tensors);
                    self.allgather_ranks(site, ranks, (bucket, tensors), (place, &spans_of))?;
                    continue;
                }
                if !one_pass(site.levels, bucket.memory, site.backend) {
                    let _span = self.bucket_span("allgather bucket", b, bucket, tensors);
                    // An NCCL clique: every owner's pieces in its GPU's block, `ncclAllGather`.
                    if clique::allgather(site, &view(bucket, tensors), place)? {
                        continue;
                    }
                    rest.extend(bucket.tensors.iter().map(|&t| tensors[t]));
                    continue;
                }
                let _span = self.bucket_span("allgather bucket", b, bucket, tensors);
                let owned = |segment: usize, r: usize| {
                    let t = tensors[bucket.tensors[segment]];
                    piece(t.count, place.offset + r, place.total)
                };
                site.backend.spread_owned(&view(bucket, tensors), &owned)?;
            }
            for w in 0..place.total {
                let pieces: Vec<TensorView> = (rest.iter())
                    .filter_map(|t| {
                        let (first, count) = piece(t.count, w, place.total);
                        (count > 0).then(|| t.piece(first, count))
                    })
                    .collect();
                if pieces.is_empty() {
                    continue;
                }
                let refs: Vec<&TensorView> = pieces.iter().collect();
                let (rank, local) = locate(w);
                self.broadcast(&refs, rank, local, fusion_bytes)?;
            }
            Ok(())
        })
    }
}

impl Executor {
    /// A world of host replicas: each local replica's pieces of `bucket` copied into local
    /// replica 0's tensors, every rank's pieces gathered there over the engine (rank `r` owns
    /// the pieces of its world replicas `ranks_at[r]` = `(first, count)`, one range per tensor),
    /// then local replica 0's tensors spread to the other local replicas.
    ///
    /// # Safety
    /// As for [`Executor::allgather`].
    unsafe fn allgather_ranks(
        &self,
        site: Site<'_>,
        ranks: &dyn Ranks,
        (bucket, tensors): (&Bucket, &[&TensorView]),
        (place, ranks_at): (Place, &[(usize, usize)]),
    ) -> Result<()> {
        let members: Vec<&TensorView> = bucket.tensors.iter().map(|&t| tensors[t]).collect();
        let local = &site.levels.groups[0];
        let size = members.first().map_or(1, |t| t.dtype.size());
        let leader = local[0];
        for t in &members {
            for &r in &local[1..] {
                let (first, count) = piece(t.count, place.offset + r, place.total);
                if count > 0 {
                    let at = first * size;
                    (site.backend).copy(
                        r,
                        t.ptrs[r] + at,
                        leader,
                        t.ptrs[leader] + at,
                        count * size,
                    )?;
                }
            }
        }
        let spans: Vec<(usize, usize)> = members
            .iter()
            .map(|t| (t.ptrs[leader], t.count * size))
            .collect();
        let owned = |s: usize, rank: usize| {
            let (first, count) = rank_piece(members[s].count, ranks_at[rank], place.total);
            (first * size, count * size)
        };
        ranks.allgather_owned(&spans, &owned)?;
        if local.len() > 1 {
            site.backend.spread(0, &view(bucket, tensors), leader)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::piece;

    #[test]
    fn pieces_cover_every_element_once_in_order() {
        for (count, total) in [(10, 4), (3, 8), (0, 3), (1000, 7), (5, 1)] {
            let mut next = 0;
            for w in 0..total {
                let (first, n) = piece(count, w, total);
                assert_eq!(first, next, "{count} / {total}, replica {w}");
                next += n;
            }
            assert_eq!(next, count, "{count} / {total}");
        }
        assert_eq!(piece(10, 1, 4), (2, 3));
        assert_eq!(piece(3, 0, 8), (0, 0));
        assert_eq!(piece(3, 7, 8), (2, 1));
    }
}
