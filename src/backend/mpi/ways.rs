//! Which way the engine's collectives go, and the waited sums they share: the choices
//! [`Ranks`](crate::backend::Ranks)'s methods (`ranks.rs`) make alike on every rank, from
//! what every rank knows (the bucket, the dtype, the shared memory agreed at join).

use std::sync::atomic::Ordering;

use mpi::ffi;

use super::calls::count_of;
use super::pieces::{piece_of, stage, Walk, DEPTH};
use super::ring::Sum;
use super::staging::{mpi_type, stage_in, stage_out};
use super::steps::{Queue, Until};
use super::MpiRanks;
use crate::backend::{Channel, EveryRank, Segment};
use crate::error::Result;
use crate::types::DType;

impl MpiRanks {
    /// The number of the first of a transfer's ring pieces of `piece` elements on its
    /// communicator: the steps' are numbered across the queue's and the waited ones.
    pub(super) fn number_ring_pieces(
        &self,
        queue: Option<&mut Queue>,
        count: usize,
        piece: usize,
    ) -> usize {
        let pieces = count.div_ceil(piece);
        match queue {
            Some(q) => q.ring_pieces(pieces),
            None => self.calls_pieces.fetch_add(pieces, Ordering::Relaxed),
        }
    }

    /// Whether [`Ranks::allreduce_reproducible`] can sum these segments in one exchange: one
    /// contribution each, F32 or F64, a bucket the ring carries through shared memory. Alike
    /// on every rank: the shared memory was agreed at join, and the ranks agreed on the bucket
    /// and on one contribution each.
    pub(super) fn sums_reproducibly(
        &self,
        channel: Channel,
        dtype: DType,
        segments: &[Segment<'_>],
    ) -> bool {
        let wide_enough = matches!(dtype, DType::F32 | DType::F64);
        wide_enough && self.shared_one_each(channel, segments, dtype.size())
    }

    /// Whether the ring carries `segments` (`size` bytes an element) through shared memory,
    /// one contribution per rank.
    fn shared_one_each(&self, channel: Channel, segments: &[Segment<'_>], size: usize) -> bool {
        let count: usize = segments.iter().map(|s| s.count).sum();
        let ring = self.ring(channel);
        let one_each = segments.iter().all(|s| s.ptrs.len() == 1);
        ring.shared() && ring.takes(count * size) && one_each
    }

    /// Whether [`Ranks::allreduce`] goes as the in-place reduce-scatter then the allgather
    /// through shared memory ([`Engine::shared_allreduce`](super::Engine)): a bucket the ring
    /// carries there, one contribution per rank. Alike on every rank: the shared memory was
    /// agreed at join, and exec hands the engine a non-half bucket's local sum alone (half
    /// types come with every local replica, so their count may differ between ranks).
    pub(super) fn scatters_then_gathers(
        &self,
        channel: Channel,
        dtype: DType,
        segments: &[Segment<'_>],
    ) -> bool {
        debug_assert!(
            dtype.is_half() || segments.iter().all(|s| s.ptrs.len() == 1),
            "one contribution of a non-half bucket"
        );
        !dtype.is_half() && self.shared_one_each(channel, segments, mpi_type(dtype).1)
    }

    /// `f` with the channel to itself: on the steps' channel under the queue's lock (handed
    /// to `f`, which numbers its ring pieces there), after every bucket started ahead has
    /// finished on every rank.
    pub(super) fn alone<R>(
        &self,
        channel: Channel,
        f: impl FnOnce(Option<&mut Queue>) -> Result<R>,
    ) -> Result<R> {
        let mut queue = (channel == Channel::Steps).then(|| self.queue.lock());
        if let Some(queue) = &mut queue {
            self.drive(queue, Until::Empty)?;
        }
        f(queue.as_deref_mut())
    }

    /// Whether a reduce-scatter of `count` elements sums each rank's elements at that rank: a
    /// bucket the ring allreduce carries, through shared memory where every rank has one
    /// contribution ([`Engine::shared_reduce_scatter`](super::Engine), whose sums follow the
    /// allreduce's order), else without it ([`Engine::ring_reduce_scatter`](super::Engine)).
    /// Alike on every rank, as [`MpiRanks::sums_reproducibly`].
    pub(super) fn scatters_owned(
        &self,
        channel: Channel,
        every: EveryRank<'_>,
        count: usize,
        dtype: DType,
    ) -> bool {
        let ring = self.ring(channel);
        ring.takes(count * mpi_type(dtype).1) && (every.one_each || !ring.shared())
    }

    /// The sum over the ranks of `segments` (`sum`: how; reproducible only where
    /// [`MpiRanks::sums_reproducibly`]), divided by `avg`, written into `outs` ([`outputs`]):
    /// round the ring from [`RING_BYTES`](super::ring) on, else one non-blocking allreduce
    /// per piece.
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`]; `outs` lie within the segments' contributions.
    pub(super) unsafe fn reduce_into(
        &self,
        channel: Channel,
        (dtype, segments, outs): (DType, &[Segment<'_>], &[(usize, usize)]),
        (sum, avg): (Sum, Option<usize>),
    ) -> Result<()> {
        self.refuse_if_failed()?;
        let size = mpi_type(dtype).1;
        let count: usize = segments.iter().map(|s| s.count).sum();
        let ring = self.ring(channel);
        // Held to the end: the steps' communicator carries this transfer alone meanwhile.
        self.alone(channel, |queue| {
            if count == 0 {
                return Ok(());
            }
            if ring.takes(count * size) {
                let first = self.number_ring_pieces(queue, count, ring.piece_of(size));
                let data = (dtype, segments, count);
                return self.ring_allreduce((ring, first), data, outs, sum, avg);
            }
            debug_assert!(sum == Sum::Plain, "reproducible sums go round the ring");
            self.reduce_pieces(self.comm_of(channel), (dtype, segments, count), outs, avg)
        })
    }

    /// [`MpiRanks::reduce_into`] below the ring's size: an allreduce per piece, staged.
    ///
    /// # Safety
    /// As for [`MpiRanks::reduce_into`].
    pub(super) unsafe fn reduce_pieces(
        &self,
        comm: ffi::MPI_Comm,
        (dtype, segments, count): (DType, &[Segment<'_>], usize),
        outs: &[(usize, usize)],
        avg: Option<usize>,
    ) -> Result<()> {
        let (datatype, size) = mpi_type(dtype);
        let piece = piece_of(size).min(count);
        let pieces = count.div_ceil(piece);
        // Slot `i % DEPTH` of piece `i`: a send area, then a receive area.
        let area = (piece * size).next_multiple_of(64);
        let mut scratch = self.scratch.lock();
        let stages = stage(&mut scratch, 2 * area * DEPTH.min(pieces));
        let at = |i: usize, k: usize| stages.add((2 * (i % DEPTH) + k) * area);
        let range = |i: usize| (i * piece, piece.min(count - i * piece));
        let (mut walk_in, mut walk_out) = (Walk::default(), Walk::default());
        let done = self.run_pieces(
            "MPI_Iallreduce",
            pieces,
            |i, request| {
                stage_in(dtype, segments, &mut walk_in, range(i), at(i, 0));
                ffi::MPI_Iallreduce(
                    at(i, 0).cast(),
                    at(i, 1).cast(),
                    count_of(range(i).1),
                    datatype,
                    ffi::RSMPI_SUM,
                    comm,
                    request,
                )
            },
            |i| stage_out(dtype, at(i, 1), (outs, &mut walk_out), range(i), avg),
        );
        if done.is_err() {
            // Pieces still pending may read and write their stages.
            std::mem::forget(std::mem::take(&mut *scratch));
        }
        done
    }
}
