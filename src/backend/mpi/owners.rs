//! A reduce-scatter and an allgather of owned elements round the ring over MPI messages (no
//! shared memory), each half of the ring allreduce alone. Ring piece `k` is laid out by owner:
//! its block `(r + 1) % n` holds rank `r`'s owned elements `[k c, (k + 1) c)` ([`Owned`]), the
//! block a ring's reduce-scatter half leaves summed at rank `r` and its allgather half starts
//! from there. So the reduce-scatter sends and sums `(n - 1) / n` of the bucket per rank and
//! writes only the rank's own elements, and the allgather sends as much; together they move
//! what one ring allreduce moves, where the allreduce with its copy-out cut (what a
//! reduce-scatter was before) moved it all and the allgather came on top.
//!
//! Each element is summed once, at its owner, starting at the next rank round the ring: the
//! same on every rank, but not the order the allreduce's even blocks give it, so across ranks
//! the bytes are the allreduce's up to the order of the sums (the contract's promise; 2 ranks
//! add one pair, which is the same either way).

use super::pieces::Walk;
use super::ring::{Flight, Half, Ring};
use super::scatter::{range_of, Owned};
use super::staging::{copy_spans, mpi_type, stage_in, stage_out, Way};
use super::Engine;
use crate::backend::host::STREAM_BYTES;
use crate::backend::Segment;
use crate::error::Result;
use crate::types::DType;

/// The rank whose elements block `b` of `n` holds.
fn owner_of(b: usize, n: usize) -> usize {
    (b + n - 1) % n
}

/// The block of `n` that holds rank `r`'s elements.
fn block_of(r: usize, n: usize) -> usize {
    (r + 1) % n
}

/// Ring piece `k`'s cut: where each block starts, then the piece's length.
fn cut(owned: &Owned, k: usize) -> Vec<usize> {
    let n = owned.totals.len();
    let mut cut = Vec::with_capacity(n + 1);
    let mut at = 0;
    for b in 0..n {
        cut.push(at);
        at += range_of(k, owned.c, owned.totals[owner_of(b, n)]).map_or(0, |r| r.1);
    }
    cut.push(at);
    cut
}

/// Bytes of a ring piece's slot: `c` elements of `size` per rank, then room for one block.
fn slot_of(owned: &Owned, size: usize) -> (usize, usize) {
    let block = (owned.c * size).next_multiple_of(64);
    (owned.totals.len() * block, (owned.totals.len() + 1) * block)
}

impl Engine {
    /// [`Ranks::reduce_scatter`](crate::backend::Ranks) round `ring` (over MPI messages):
    /// every rank's elements `owned` (`c`: a ring piece's worth over the ranks), in pieces
    /// numbered from `first`; this rank's contributions summed as they are staged in (in
    /// their order, as the allreduce's), and each contribution's own elements `pieces` (as
    /// `Ranks::reduce_scatter` gives them) get the sum, divided by `avg`. Nothing else is
    /// written.
    ///
    /// # Safety
    /// As for [`Ranks::reduce_scatter`](crate::backend::Ranks).
    pub(super) unsafe fn ring_reduce_scatter(
        &self,
        (ring, first): (Ring, usize),
        (dtype, segments, pieces): (DType, &[Segment<'_>], &[(usize, usize)]),
        owned: &Owned,
        avg: Option<usize>,
    ) -> Result<()> {
        let size = mpi_type(dtype).1;
        let n = owned.totals.len();
        let me = ring.me();
        debug_assert_eq!(n, ring.ranks(), "laid out for this ring");
        // Each rank's runs as segments of their own, so that staging walks them end to end.
        let starts: Vec<Vec<Vec<usize>>> = (owned.runs.iter())
            .map(|runs| {
                (runs.iter())
                    .map(|run| {
                        let ptrs = segments[run.segment].ptrs;
                        ptrs.iter().map(|p| p + run.first * dtype.size()).collect()
                    })
                    .collect()
            })
            .collect();
        let runs: Vec<Vec<Segment<'_>>> = (starts.iter().zip(&owned.runs))
            .map(|(starts, runs)| {
                (starts.iter().zip(runs))
                    .map(|(ptrs, run)| Segment {
                        ptrs,
                        count: run.len,
                    })
                    .collect()
            })
            .collect();
        // This rank's runs, each its contributions' pieces end to end.
        let outs: Vec<(usize, usize)> = (owned.runs[me].iter())
            .flat_map(|run| {
                let ptrs = segments[run.segment].ptrs;
                let mine = &pieces[run.segment * ptrs.len()..][..ptrs.len()];
                debug_assert_eq!(mine.iter().map(|p| p.1).sum::<usize>(), run.len);
                (ptrs.iter().zip(mine)).map(|(p, &(f, c))| (p + f * dtype.size(), c))
            })
            .collect();
        let (work, slot) = slot_of(owned, size);
        let mut walks_in: Vec<Walk> = (0..n).map(|_| Walk::default()).collect();
        let mut walk_out = Walk::default();
        self.fly(
            (ring, owned.pieces, slot),
            "MPI_Isend/MPI_Irecv (ring reduce-scatter)",
            |i, stage| {
                let cut = cut(owned, i);
                for (b, &at) in cut[..n].iter().enumerate() {
                    let q = owner_of(b, n);
                    if let Some(range) = range_of(i, owned.c, owned.totals[q]) {
                        let into = stage.add(at * size);
                        stage_in(dtype, &runs[q], &mut walks_in[q], range, into);
                    }
                }
                let key = (Some(dtype), first + i, Half::Scatter);
                Flight::start_owned(&ring, key, cut, stage, stage.add(work)).map(Some)
            },
            |i, flight| {
                let Some(range) = range_of(i, owned.c, owned.totals[me]) else {
                    return;
                };
                let at = cut(owned, i)[block_of(me, n)];
                flight.finish(&ring, |piece, _, _| {
                    stage_out(
                        dtype,
                        piece.add(at * size),
                        (&outs, &mut walk_out),
                        range,
                        avg,
                    )
                });
            },
        )
    }

    /// [`Ranks::allgather_owned`](crate::backend::Ranks) round `ring` (over MPI messages):
    /// `spans` `(ptr, bytes)`, every rank's bytes `owned` (`c`: a ring piece's worth over the
    /// ranks), in pieces numbered from `first`: this rank's bytes staged into its block, every
    /// other rank's copied out of theirs.
    ///
    /// # Safety
    /// As for [`Ranks::allgather_owned`](crate::backend::Ranks).
    pub(super) unsafe fn ring_allgather(
        &self,
        (ring, first): (Ring, usize),
        spans: &[(usize, usize)],
        owned: &Owned,
    ) -> Result<()> {
        let n = owned.totals.len();
        let me = ring.me();
        debug_assert_eq!(n, ring.ranks(), "laid out for this ring");
        let parts: Vec<Vec<(usize, usize)>> = (owned.runs.iter())
            .map(|runs| {
                (runs.iter())
                    .map(|run| (spans[run.segment].0 + run.first, run.len))
                    .collect()
            })
            .collect();
        // The others' bytes land where this rank has not read: a large gather streams them
        // past the caches, as the host's own allgather does.
        let total: usize = owned.totals.iter().sum();
        let streaming = total >= STREAM_BYTES;
        let (work, slot) = slot_of(owned, 1);
        let mut walks: Vec<Walk> = (0..n).map(|_| Walk::default()).collect();
        let mut walk_in = Walk::default();
        self.fly(
            (ring, owned.pieces, slot),
            "MPI_Isend/MPI_Irecv (ring allgather)",
            |i, stage| {
                let cut = cut(owned, i);
                if let Some(range) = range_of(i, owned.c, owned.totals[me]) {
                    let into = stage.add(cut[block_of(me, n)]);
                    copy_spans((&parts[me], &mut walk_in), range, into, Way::In);
                }
                let key = (None, first + i, Half::Gather);
                Flight::start_owned(&ring, key, cut, stage, stage.add(work)).map(Some)
            },
            |i, flight| {
                let cut = cut(owned, i);
                flight.finish(&ring, |piece, _, _| {
                    for q in (0..n).filter(|&q| q != me) {
                        if let Some(range) = range_of(i, owned.c, owned.totals[q]) {
                            let from = piece.add(cut[block_of(q, n)]).cast_mut();
                            let out = (&parts[q][..], &mut walks[q]);
                            copy_spans(out, range, from, Way::Out { streaming });
                        }
                    }
                });
            },
        )
    }
}
