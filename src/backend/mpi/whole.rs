//! A bucket started early that crosses the ranks through shared memory as one reduce-scatter
//! then one allgather ([`Whole`]), into the bucket's held result: the steps queue's way for
//! a bucket the ring carries where the ranks share memory (`steps.rs`).
//!
//! Why not the ring's pieces: a ring piece through shared memory stages every element into a
//! slot, sums a block there and copies every block out again, handshaking three times per
//! 128 KiB; this stages only the elements other ranks own and each rank sums its own straight
//! into the held result, then the sums are gathered. Each rank reads and writes about half
//! the memory, which is what sets the pace on one host: with one replica per rank, the
//! ring's pieces took longer than a backward's worth of compute and so hid nothing (marked
//! steps no faster than unmarked ones, docs/PERFORMANCE.md).
//!
//! The bytes are the ring's, as [`Engine::shared_reduce_scatter`](super::Engine) keeps them:
//! each element is the sum of every rank's local sum (staged as a ring piece stages it), in
//! the ring's order (its block's rank first, then the others ascending), divided and rounded
//! once. Owners here are even cuts of the bucket as one run (the result is the held buffer,
//! not the caller's tensors), which changes who adds, not how.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::pieces::{Walk, DEPTH};
use super::ring::block;
use super::scatter::{blocks, range_of, section, section_of, sum_in_order};
use super::shm::{Slots, OUT, REDUCED, STAGED};
use super::staging::{copy_spans, stage_in, stage_out, Way};
use super::steps::segments;
use crate::backend::host::{copy_streaming, repro};
use crate::types::DType;

/// Output lists, each `(ptr, count)` per segment ([`Item`](super::steps::Item)'s).
pub(super) type Outputs = Vec<Vec<(usize, usize)>>;

/// One started bucket in flight through the steps channel's slots, moved on without waiting
/// ([`Whole::advance`]) by whichever thread drives the queue.
pub(super) struct Whole {
    slots: Slots,
    dtype: DType,
    count: usize,
    /// Per segment: every local contribution's pointer, and the count (none: a stand-in of
    /// zeros).
    inputs: Vec<(Vec<usize>, usize)>,
    abandoned: Arc<AtomicBool>,
    held: *mut u8,
    /// The step agreed before the bucket went, or is expected to (`aside`): the sums are
    /// written straight into these outputs ([`Item`](super::steps::Item)'s), `held` keeping
    /// only this rank's own (`aside.rs`: what stops early writes copies the rest there).
    direct: Option<Outputs>,
    /// Written early: where the originals go ([`Aside::base`](super::aside::Aside)), each
    /// piece's as it is staged (hot in cache, rather than the bucket's at once before it
    /// goes), and the ranges saved so far.
    aside: Option<*mut u8>,
    saved: Vec<(usize, usize)>,
    /// Several local contributions, written early: per contribution its byte spans, and per
    /// rank (whose owned elements are saved in order) per contribution where saving got to.
    kept: Vec<Vec<(usize, usize)>>,
    walks_kept: Vec<Vec<Walk>>,
    /// Written early, this rank's sums of a piece are made here (hot in cache) and go to the
    /// outputs only; the allgather stages them from there ([`PIECE`] bytes).
    scratch: Vec<u64>,
    /// Per rank, per output: where writing that rank's sums has got to.
    walks_out: Vec<Vec<Walk>>,
    avg: Option<usize>,
    /// Summed as the waited reproducible sum through shared memory (one contribution per
    /// rank, F32 or F64: the ranks' raw values meet here, so the sums are exact).
    reproducible: bool,
    /// The ring allreduce's piece of this bucket, whose blocks say each element's sum order.
    ring_piece: usize,
    /// 0: the reduce-scatter; 1: the allgather; 2: done.
    phase: usize,
    /// Per phase: the first piece's number on the channel, pieces, each rank's elements per
    /// piece.
    first: [usize; 2],
    pieces: [usize; 2],
    c: [usize; 2],
    staged: usize,
    done: usize,
    /// Per rank: where staging its owned elements (this rank's: summing them) has got to.
    walks: Vec<Walk>,
}

// SAFETY: pointers into the caller's registered memory and the queue's held buffer, used by
// one thread at a time under the queue's lock.
unsafe impl Send for Whole {}

impl Whole {
    /// A bucket of `count` elements (`inputs` as [`Item`](super::steps::Item) keeps them)
    /// summed into `held` (divided by `avg`), its pieces numbered from `*numbers` on (which it
    /// moves past them); `ring_piece` as the ring would cut it.
    pub(super) fn new(
        slots: Slots,
        (dtype, count, inputs, reproducible): (DType, usize, Vec<(Vec<usize>, usize)>, bool),
        (held, avg, abandoned): (*mut u8, Option<usize>, Arc<AtomicBool>),
        direct: Option<(Outputs, Option<*mut u8>)>,
        (ring_piece, numbers): (usize, &mut usize),
    ) -> Whole {
        let (direct, aside) = match direct {
            Some((outs, aside)) => (Some(outs), aside),
            None => (None, None),
        };
        let n = slots.ranks();
        let size = dtype.size();
        let contributions = inputs.first().map_or(0, |i| i.0.len());
        let kept: Vec<Vec<(usize, usize)>> = match aside.is_some() && contributions > 1 {
            true => (0..contributions)
                .map(|k| inputs.iter().map(|(p, c)| (p[k], c * size)).collect())
                .collect(),
            false => Vec::new(),
        };
        let c = [section_of(size, n), super::shm::PIECE / size];
        let most = block(count, n, 0).1;
        let pieces = [most.div_ceil(c[0]), most.div_ceil(c[1])];
        let first = [*numbers, *numbers + pieces[0]];
        *numbers += pieces[0] + pieces[1];
        Whole {
            slots,
            dtype,
            count,
            inputs,
            abandoned,
            held,
            walks_out: (0..n)
                .map(|_| {
                    (0..direct.as_ref().map_or(0, Vec::len))
                        .map(|_| Walk::default())
                        .collect()
                })
                .collect(),
            direct,
            aside,
            saved: Vec::new(),
            walks_kept: (0..n)
                .map(|_| kept.iter().map(|_| Walk::default()).collect())
                .collect(),
            kept,
            scratch: match aside {
                Some(_) => vec![0; super::shm::PIECE / 8],
                None => Vec::new(),
            },
            avg,
            reproducible,
            ring_piece: ring_piece.min(count),
            phase: 0,
            first,
            pieces,
            c,
            staged: 0,
            done: 0,
            walks: (0..n).map(|_| Walk::default()).collect(),
        }
    }

    pub(super) fn finished(&self) -> bool {
        self.phase == 2
    }

    /// Written early ([`Whole::new`]'s `aside`): from now on only into `held` (the caller
    /// copies what the outputs got so far there). The ranges saved, for the caller to put
    /// back.
    pub(super) fn stop_early(&mut self) -> Vec<(usize, usize)> {
        if self.aside.take().is_some() {
            self.direct = None;
        }
        self.take_saved()
    }

    /// The ranges of originals saved so far ([`Aside::saved`](super::aside::Aside)).
    pub(super) fn take_saved(&mut self) -> Vec<(usize, usize)> {
        std::mem::take(&mut self.saved)
    }

    /// Where the originals go while they are saved: written early, and the caller's memory
    /// still ours (a dropped ticket's is not read).
    fn saving(&self) -> Option<*mut u8> {
        self.aside
            .filter(|_| !self.abandoned.load(Ordering::Relaxed))
    }

    /// Written early: the originals of rank `q`'s elements `[e, e + l)`, just staged at
    /// `from` (this rank's local sum), saved before any sum is written over them: the stage
    /// itself with one local contribution, each contribution's (hot in cache: just read)
    /// with several. Non-temporal stores: read again only if the step fails.
    unsafe fn keep(&mut self, q: usize, (e, l): (usize, usize), from: *const u8) {
        let Some(base) = self.saving() else {
            return;
        };
        let size = self.dtype.size();
        if self.kept.is_empty() {
            copy_streaming(from, base.add(e * size), l * size);
        } else {
            for (k, spans) in self.kept.iter().enumerate() {
                let to = base.add((k * self.count + e) * size);
                let walk = &mut self.walks_kept[q][k];
                copy_spans((spans, walk), (e * size, l * size), to, Way::Keep);
            }
        }
        self.saved.push((e, l));
    }

    /// Stages and reads every piece that can go now, without waiting; whether it moved.
    ///
    /// # Safety
    /// The inputs are valid (unless abandoned) and `held` holds the bucket.
    pub(super) unsafe fn advance(&mut self) -> bool {
        let mut moved = false;
        while self.phase < 2 {
            let (first, pieces) = (self.first[self.phase], self.pieces[self.phase]);
            while self.staged < pieces && self.staged < self.done + DEPTH {
                let Some(slot) = self.slots.mine_when_free(first + self.staged) else {
                    break;
                };
                self.stage(self.staged, slot);
                self.slots.publish(STAGED, first + self.staged);
                (self.staged, moved) = (self.staged + 1, true);
            }
            while self.done < self.staged && self.slots.all_past(STAGED, first + self.done) {
                let k = first + self.done;
                self.read(self.done, k);
                self.slots.publish(REDUCED, k);
                self.slots.publish(OUT, k);
                (self.done, moved) = (self.done + 1, true);
            }
            if self.done < pieces {
                break;
            }
            (self.phase, self.staged, self.done) = (self.phase + 1, 0, 0);
            self.walks.iter_mut().for_each(|w| *w = Walk::default());
        }
        moved
    }

    /// Rank `r`'s owned elements of the bucket: `(first, count)`.
    fn owned(&self, r: usize) -> (usize, usize) {
        block(self.count, self.slots.ranks(), r)
    }

    /// Rank `r`'s sums of bucket elements `[e, e + l)`, at `from`, into every output
    /// (direct only).
    unsafe fn write_out(&mut self, r: usize, (e, l): (usize, usize), from: *const u8) {
        if self.abandoned.load(Ordering::Relaxed) {
            return; // the caller's memory is not touched any more
        }
        if let Some(outs) = &self.direct {
            for (out, walk) in outs.iter().zip(self.walks_out[r].iter_mut()) {
                stage_out(self.dtype, from, (out, walk), (e, l), None);
            }
        }
    }

    /// This rank's local sum of bucket elements `[e, e + l)` into `to` (zeros for a stand-in
    /// or a bucket whose ticket was dropped: the caller's memory is not read then).
    unsafe fn local_sum(&mut self, walk: usize, (e, l): (usize, usize), to: *mut u8) {
        if self.inputs.is_empty() || self.abandoned.load(Ordering::Relaxed) {
            std::ptr::write_bytes(to, 0, l * self.dtype.size());
            return;
        }
        let segments = segments(&self.inputs, false);
        stage_in(self.dtype, &segments, &mut self.walks[walk], (e, l), to);
    }

    /// Piece `i` into this rank's slot: the reduce-scatter's, one section per other rank of
    /// that rank's owned elements; the allgather's, this rank's sums.
    unsafe fn stage(&mut self, i: usize, slot: *mut u8) {
        let (n, me, size) = (self.slots.ranks(), self.slots.me(), self.dtype.size());
        let c = self.c[self.phase];
        if self.phase == 1 {
            let (o, l) = self.owned(me);
            if let Some((s, len)) = range_of(i, c, l) {
                match self.saving() {
                    // Written early: this rank's sums are in the outputs only.
                    Some(_) => {
                        let first = segments(&self.inputs, true);
                        let walk = &mut self.walks[me];
                        stage_in(self.dtype, &first, walk, (o + s, len), slot);
                    }
                    None => {
                        let from = self.held.add((o + s) * size);
                        std::ptr::copy_nonoverlapping(from, slot, len * size);
                    }
                }
            }
            return;
        }
        for q in (0..n).filter(|&q| q != me) {
            let (o, l) = self.owned(q);
            if let Some((s, len)) = range_of(i, c, l) {
                let into = slot.add(section(q, me) * c * size);
                self.local_sum(q, (o + s, len), into);
                self.keep(q, (o + s, len), into);
            }
        }
    }

    /// Piece `i` (number `k`) from the others' slots: the reduce-scatter's, this rank's
    /// elements summed into `held`; the allgather's, the others' sums copied there.
    unsafe fn read(&mut self, i: usize, k: usize) {
        let (n, me, size) = (self.slots.ranks(), self.slots.me(), self.dtype.size());
        let c = self.c[self.phase];
        if self.phase == 1 {
            for r in (0..n).filter(|&r| r != me) {
                let (o, l) = self.owned(r);
                if let Some((s, len)) = range_of(i, c, l) {
                    let from = self.slots.slot(r, k);
                    match self.direct {
                        Some(_) => self.write_out(r, (o + s, len), from),
                        None => {
                            let to = self.held.add((o + s) * size);
                            std::ptr::copy_nonoverlapping(from, to, len * size);
                        }
                    }
                }
            }
            return;
        }
        let (o, l) = self.owned(me);
        let Some((s, len)) = range_of(i, c, l) else {
            return;
        };
        let e = o + s;
        // Written early, the sums go to the outputs only, through the scratch (a held copy
        // would be one more write and read of every element; what stops the early writes
        // copies the outputs into `held`).
        let mine = match self.saving() {
            Some(_) => self.scratch.as_mut_ptr().cast::<u8>(),
            None => self.held.add(e * size),
        };
        self.local_sum(me, (e, len), mine);
        self.keep(me, (e, len), mine);
        let theirs = |r: usize, at: usize| match r == me {
            true => mine.add(at * size) as *const u8,
            false => (self.slots.slot(r, k)).add((section(me, r) * c + at) * size) as *const u8,
        };
        if self.reproducible {
            let ptrs: Vec<usize> = (0..n).map(|r| theirs(r, 0) as usize).collect();
            repro::reduce_ptrs(self.dtype, &ptrs, me, len, self.avg);
            self.write_out(me, (e, len), mine);
            return;
        }
        let mut from: Vec<*const u8> = Vec::with_capacity(n);
        let mut at = 0;
        for (b, l) in blocks((e, len), (self.ring_piece, self.count), n) {
            from.clear();
            from.extend(
                (std::iter::once(b).chain((0..n).filter(|&r| r != b))).map(|r| theirs(r, at)),
            );
            sum_in_order(self.dtype, mine.add(at * size), &from, l, self.avg);
            at += l;
        }
        self.write_out(me, (e, len), mine);
    }
}
