//! The gradient steps' queue ([`Channel::Steps`](crate::backend::Channel)): buckets started
//! ahead of `dpsync_allreduce_grads` by `dpsync_grad_ready` go across the ranks piece by piece,
//! strictly in (bucket, piece) order on every rank, at most [`DEPTH`] pieces in flight. Each
//! piece is summed from the local replicas into a small send stage just before its call (so it
//! is in cache when MPI reads it) and its result lands in the bucket's own result buffer, held
//! there until the step agrees ([`MpiRanks::finish`](super::MpiRanks)). Every mark, and the
//! step itself, moves the queue on ([`Queue::drive`]): an MPI moves a transfer only inside its
//! calls.

use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::alltoall::{Exchange, Out};
use super::aside::Aside;
use super::calls::{check, count_of, tested};
use super::pieces::{stage, Walk, DEPTH, PIECE};
use super::poll::Idle;
use super::ring::{Flight, Ring, Sum};
use super::staging::{mpi_type, stage_in, stage_out};
use super::whole::Whole;
use crate::backend::host::copy_streaming;
use crate::backend::{Gate, Segment};
use crate::error::Result;
use crate::types::DType;

mod release;

/// A started bucket, until [`MpiRanks::finish`](super::MpiRanks) takes its result.
pub(super) struct Item {
    seq: u64,
    pub(super) dtype: DType,
    /// Per segment: every local contribution's pointer, and the count. Read as the pieces
    /// are issued (the caller declared them final); none: a stand-in of zeros.
    inputs: Vec<(Vec<usize>, usize)>,
    /// Output lists, each `(ptr, count)` per segment laid end to end and written whole: an
    /// allreduce step's, every local replica's segments (written from one read of the result,
    /// no copy from replica 0 afterwards); a reduce-scatter's, one list of every local
    /// replica's owned elements ([`Queue::release`]).
    pub(super) outs: Vec<Vec<(usize, usize)>>,
    pub(super) count: usize,
    pub(super) avg: Option<usize>,
    /// The results, in MPI's type, pieces landing in place until the step agrees.
    pub(super) held: Vec<u64>,
    crossing: Crossing,
    piece: usize,
    pieces: usize,
    issued: usize,
    done: usize,
    walk: Walk,
    /// The step agreed (`finish` with its result wanted): the pieces issued from then on go
    /// through a small receive stage straight into the outputs, as a waited transfer's do.
    /// The first piece issued so.
    direct_from: Option<usize>,
    walk_out: Vec<Walk>,
    /// Its ticket was dropped unfinished: the pieces not yet issued go as zeros (the ranks'
    /// order stays the same, and the caller's memory is not read any more).
    abandoned: Arc<AtomicBool>,
    /// Results written into the one output as the pieces complete, before the step agreed,
    /// its originals kept here (`aside.rs`); `held` is filled as well.
    pub(super) aside: Option<Aside>,
    /// Asked before the first piece goes ([`Ranks::start`](crate::backend::Ranks)): the
    /// inputs are not read before it opens.
    gate: Option<Gate>,
}

impl Item {
    fn finished(&self) -> bool {
        self.done == self.pieces
    }

    /// Piece `i`'s first element and length.
    fn range(&self, i: usize) -> (usize, usize) {
        (i * self.piece, self.piece.min(self.count - i * self.piece))
    }

    /// The elements whose results are in `held` (the rest are written already).
    pub(super) fn held_count(&self) -> usize {
        if self.aside.as_ref().is_some_and(|a| a.live) {
            return 0; // written into the output already
        }
        match self.direct_from {
            None => self.count,
            Some(d) => (d * self.piece).min(self.count),
        }
    }
}

/// How a started bucket crosses the ranks.
#[derive(Clone, PartialEq, Eq)]
pub(super) enum Crossing {
    /// In pieces: an MPI_Iallreduce each, or round the ring.
    Pieces,
    /// As one [`Whole`] through shared memory (summed as
    /// [`Ranks::allreduce_reproducible`](crate::backend::Ranks) sums with `reproducible`).
    Whole { reproducible: bool },
    /// As one reproducible [`Exchange`] over MPI, `contributions[r]` on rank r; its result
    /// into `held`, and written early into the outputs chunk by chunk as it lands while the
    /// `aside` is live ([`Item::write_early`]; the exchange saves the originals).
    Exchange { contributions: Vec<usize> },
}

impl Crossing {
    /// Crosses as one transfer, which divides as it sums: one piece, and `avg` none once
    /// issued; a whole bucket released before it went (`direct_from` 0) writes the outputs
    /// itself.
    fn at_once(&self) -> bool {
        *self != Crossing::Pieces
    }
}

/// An item's contributions per segment, as [`Segment`]s; with `first`, only the first
/// contribution's (the first output's, once results are written into it).
pub(super) fn segments(inputs: &[(Vec<usize>, usize)], first: bool) -> Vec<Segment<'_>> {
    (inputs.iter())
        .map(|(ptrs, count)| Segment {
            ptrs: if first { &ptrs[..1] } else { ptrs },
            count: *count,
        })
        .collect()
}

/// What a [`Ticket`](crate::backend::Ticket) of the queue holds.
pub(super) struct Handle {
    seq: u64,
    abandoned: Arc<AtomicBool>,
}

impl Handle {
    pub(super) fn seq(&self) -> u64 {
        self.seq
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // Harmless once finished: the item is gone then.
        self.abandoned.store(true, Ordering::Relaxed);
    }
}

/// How far [`Queue::drive`] goes.
#[derive(Clone, Copy)]
pub(super) enum Until {
    /// Completes what is complete, moves what is in flight one pass and issues what may be,
    /// never waiting.
    Idle,
    /// Waits until this item's pieces are all done.
    Done(u64),
    /// Waits until nothing is queued or in flight.
    Empty,
}

#[derive(Default)]
pub(super) struct Queue {
    items: VecDeque<Item>,
    next_seq: u64,
    /// Pieces issued and completed so far, all items together: piece `k` uses slot
    /// `k % DEPTH`.
    issued: usize,
    done: usize,
    /// Ring steps taken so far ([`Queue::moves`]).
    steps: usize,
    /// `(item seq, piece, transfer)` of the pieces in flight, oldest first.
    inflight: VecDeque<(u64, usize, Transfer)>,
    /// Ring pieces the steps' communicator carried so far, the queue's and waited transfers'
    /// ([`Queue::ring_pieces`]): their tags follow this count on every rank.
    ring_pieces: usize,
    /// [`DEPTH`] slots of [`PIECE`] bytes each way: send stages, then receive stages.
    stages: Vec<u64>,
}

/// A piece in flight: one non-blocking allreduce, a flight round the ring (a bucket of
/// [`RING_BYTES`](super::ring::RING_BYTES) or more, as waited transfers send it), or a whole
/// bucket through shared memory (alone in flight).
enum Transfer {
    Collective(ffi::MPI_Request),
    Ring(Flight),
    Whole(Box<Whole>),
    Exchange(Box<Exchange>),
}

// SAFETY: requests, pointers and stages are plain data; MPI_THREAD_MULTIPLE lets any thread
// test a request, and the engine's lock keeps one thread at a time here.
unsafe impl Send for Queue {}

impl Queue {
    /// Queues a bucket of `count` elements (its contributions per segment, or none for a
    /// stand-in) whose results go to `held`, crossing as `crossing` says (in pieces of
    /// `piece`); its handle.
    /// With `aside` (a stage for the originals of every output), the results are also
    /// written into the outputs early (`aside.rs`).
    pub(super) fn push(
        &mut self,
        (dtype, segments, count): (DType, &[Segment<'_>], usize),
        (avg, piece, crossing): (Option<usize>, usize, Crossing),
        (held, aside, gate): (Vec<u64>, Option<Vec<u64>>, Option<Gate>),
    ) -> Handle {
        let abandoned = Arc::new(AtomicBool::new(false));
        let seq = self.next_seq;
        self.next_seq += 1;
        let outs: Vec<Vec<(usize, usize)>> = (0..segments.first().map_or(0, |s| s.ptrs.len()))
            .map(|k| segments.iter().map(|s| (s.ptrs[k], s.count)).collect())
            .collect();
        let aside = aside
            .filter(|_| !outs.is_empty())
            .map(|bytes| Aside::new(dtype, &outs, count, bytes));
        self.items.push_back(Item {
            seq,
            dtype,
            inputs: segments
                .iter()
                .map(|s| (s.ptrs.to_vec(), s.count))
                .collect(),
            outs,
            count,
            avg,
            held,
            pieces: match crossing.at_once() {
                true => 1,
                false => count.div_ceil(piece),
            },
            crossing,
            piece,
            issued: 0,
            done: 0,
            walk: Walk::default(),
            direct_from: None,
            walk_out: Vec::new(),
            abandoned: abandoned.clone(),
            aside,
            gate,
        });
        Handle { seq, abandoned }
    }

    /// Numbers `pieces` ring pieces of a waited transfer on the steps' communicator: the first
    /// one's number.
    pub(super) fn ring_pieces(&mut self, pieces: usize) -> usize {
        self.ring_pieces += pieces;
        self.ring_pieces - pieces
    }

    /// Issues the next pieces in order while fewer than [`DEPTH`] are in flight. Whether the
    /// next one waits for its slot of shared memory (another rank still reads it).
    ///
    /// # Safety
    /// Every queued item's inputs are valid (unless abandoned); `ring` is the steps'
    /// communicator's.
    unsafe fn issue(&mut self, ring: &Ring) -> Result<bool> {
        while self.inflight.len() < DEPTH {
            if let Some((_, _, Transfer::Whole(_) | Transfer::Exchange(_))) = self.inflight.back() {
                return Ok(false);
            }
            let Some(item) = self.items.iter_mut().find(|i| i.issued < i.pieces) else {
                return Ok(false);
            };
            if let Some(gate) = item.gate.as_mut() {
                // Waits like a piece waiting for its slot (the thread driving keeps asking,
                // a waited drive within the timeout); a dropped ticket reads nothing.
                if !item.abandoned.load(Ordering::Relaxed) && !gate()? {
                    return Ok(true);
                }
                item.gate = None;
            }
            if item.crossing.at_once() && !self.inflight.is_empty() {
                // Alone on the channel (its slots, its collectives' order): after the pieces
                // before it.
                return Ok(false);
            }
            if let Crossing::Exchange { contributions } = &item.crossing {
                let comm = (ring.comm(), ring.ranks(), ring.me());
                let data = (
                    item.dtype,
                    item.inputs.clone(),
                    &contributions[..],
                    item.count,
                );
                // Written early: the originals kept as the exchange stages them.
                let mut live = item.aside.as_mut().filter(|a| a.live);
                let held = Out::Held {
                    held: item.held.as_mut_ptr().cast(),
                    keep: live.as_mut().map(|a| a.base()),
                };
                let sums = (item.avg.take(), held, Some(item.abandoned.clone()));
                // The queue's stages are idle while it crosses alone.
                let exchange = Exchange::new(comm, data, sums, |b| stage(&mut self.stages, b));
                if let Some(aside) = live {
                    aside.exchanged(ring.ranks());
                }
                self.inflight
                    .push_back((item.seq, 0, Transfer::Exchange(Box::new(exchange))));
                item.issued += 1;
                self.issued += 1;
                continue;
            }
            if let &Crossing::Whole { reproducible } = &item.crossing {
                let slots = ring.slots().expect("a whole bucket through shared memory");
                let data = (item.dtype, item.count, item.inputs.clone(), reproducible);
                let held = item.held.as_mut_ptr().cast::<u8>();
                let into = (held, item.avg.take(), item.abandoned.clone());
                // Released already: straight into the outputs; early: into both, the pieces
                // saving the originals as they stage them.
                let early =
                    item.direct_from.is_none() && item.aside.as_ref().is_some_and(|a| a.live);
                let aside = item.aside.as_mut().filter(|_| early).map(|a| a.base());
                let direct =
                    (item.direct_from.is_some() || early).then(|| (item.outs.clone(), aside));
                let numbers = (item.piece, &mut self.ring_pieces);
                let whole = Whole::new(slots, data, into, direct, numbers);
                self.inflight
                    .push_back((item.seq, 0, Transfer::Whole(Box::new(whole))));
                item.issued += 1;
                self.issued += 1;
                continue;
            }
            let (datatype, size) = mpi_type(item.dtype);
            let slot = self.issued % DEPTH;
            let own = stage(&mut self.stages, 2 * PIECE * DEPTH).add(slot * PIECE);
            let on_ring = ring.takes(item.count * size);
            let send = match on_ring {
                true => match ring.stage_for(self.ring_pieces, own) {
                    Some(send) => send,
                    None => return Ok(true),
                },
                false => own,
            };
            let (start, n) = item.range(item.issued);
            let zeros = item.inputs.is_empty() || item.abandoned.load(Ordering::Relaxed);
            let mut send = send;
            let early = item.direct_from.is_none();
            if let Some(aside) = item.aside.as_mut().filter(|a| a.live && early) {
                match !on_ring && !zeros && size == item.dtype.size() && aside.outputs() == 1 {
                    // Staged in the aside itself, which MPI only reads: saved at no cost.
                    true => send = aside.stage((start, n)),
                    false => aside.save((start, n)),
                }
            }
            if zeros {
                std::ptr::write_bytes(send, 0, n * size);
            } else {
                let segments = segments(&item.inputs, false);
                stage_in(item.dtype, &segments, &mut item.walk, (start, n), send);
            }
            let transfer = if on_ring {
                // In place in the send stage, the receive stage holding a block.
                let key = (item.dtype, n, self.ring_pieces, Sum::Plain);
                self.ring_pieces += 1;
                Transfer::Ring(Flight::start(ring, key, send, own.add(DEPTH * PIECE))?)
            } else {
                let recv = match item.direct_from {
                    Some(_) => own.add(DEPTH * PIECE),
                    None => item.held.as_mut_ptr().cast::<u8>().add(start * size),
                };
                let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
                let rc = ffi::MPI_Iallreduce(
                    send.cast_const().cast(),
                    recv.cast(),
                    count_of(n),
                    datatype,
                    ffi::RSMPI_SUM,
                    ring.comm(),
                    request.as_mut_ptr(),
                );
                check("MPI_Iallreduce", rc)?;
                // SAFETY: the call succeeded, so it wrote the request.
                Transfer::Collective(request.assume_init())
            };
            self.inflight.push_back((item.seq, item.issued, transfer));
            item.issued += 1;
            self.issued += 1;
        }
        Ok(false)
    }

    /// Moves the queue on: moves every piece in flight as far as it goes without waiting,
    /// completes the oldest as they finish and issues the next, waiting (polled within
    /// `timeout`) as `until` says. Finished items whose tickets were dropped go, their result
    /// buffers to `spare`.
    ///
    /// # Safety
    /// As for [`Queue::issue`].
    pub(super) unsafe fn drive(
        &mut self,
        ring: &Ring,
        until: Until,
        timeout: Option<Duration>,
        spare: impl FnMut(Vec<u64>),
    ) -> Result<()> {
        let (mut since, mut idle) = (None::<Instant>, Idle::watching(ring.shm));
        loop {
            let blocked = self.issue(ring)?;
            // Nothing in flight nor waiting for a slot: every queued piece is done.
            let empty = self.inflight.is_empty() && !blocked;
            let reached = match until {
                Until::Idle => false,
                Until::Done(seq) => self.item(seq).is_none_or(|i| i.finished()),
                Until::Empty => empty,
            };
            if reached || empty {
                break;
            }
            let mut moved = false;
            for (seq, _, transfer) in self.inflight.iter_mut() {
                match transfer {
                    Transfer::Ring(flight) => moved |= flight.advance(ring)?,
                    Transfer::Whole(whole) => moved |= whole.advance(),
                    Transfer::Exchange(exchange) => {
                        moved |= exchange.advance()?;
                        let (landed, saved) = (exchange.landed(), exchange.take_saved());
                        if let Some(item) = self.items.iter_mut().find(|i| i.seq == *seq) {
                            item.write_early(landed, saved);
                        }
                    }
                    Transfer::Collective(_) => {}
                }
            }
            self.steps += usize::from(moved);
            let Some((seq, piece, front)) = self.inflight.front_mut() else {
                // The next piece waits for its slot of shared memory.
                match until {
                    Until::Idle => break,
                    _ => idle.wait(&mut since, timeout, "the early buckets' pieces")?,
                }
                continue;
            };
            let finished = match front {
                Transfer::Ring(flight) => flight.finished(),
                Transfer::Whole(whole) => whole.finished(),
                Transfer::Exchange(exchange) => exchange.finished(),
                Transfer::Collective(request) => tested(request)?,
            };
            if !finished {
                match (moved, until) {
                    // One pass, then the lock goes back: the caller's marks wait for it, and
                    // the progress thread comes straight back while things move.
                    (_, Until::Idle) => break,
                    (true, _) => idle.reset(),
                    (false, _) => idle.wait(&mut since, timeout, "the early buckets' pieces")?,
                }
                continue;
            }
            idle.reset();
            let (seq, piece) = (*seq, *piece);
            // Its slot, free again once this returns: pieces complete in the order issued. A
            // ring piece's result is in its flight's parts, a collective's in the receive
            // stage (or already in `held`).
            let recv = (self.stages.as_ptr().cast::<u8>()).add((DEPTH + self.done % DEPTH) * PIECE);
            let (_, _, mut transfer) = self.inflight.pop_front().expect("the front");
            self.done += 1;
            let item = self.items.iter_mut().find(|i| i.seq == seq);
            let Some(item) = item else {
                if let Transfer::Ring(flight) = transfer {
                    flight.finish(ring, |_, _, _| {});
                }
                continue;
            };
            if let (Transfer::Whole(whole), Some(aside)) = (&mut transfer, item.aside.as_mut()) {
                aside.saved(whole.take_saved());
            }
            item.done += 1;
            let (start, n) = item.range(piece);
            let direct = item.direct_from.is_some_and(|d| piece >= d);
            // Held, and written early too (a whole bucket writes its outputs itself).
            let early = !direct
                && !matches!(transfer, Transfer::Whole(_) | Transfer::Exchange(_))
                && item.aside.as_ref().is_some_and(|a| a.live)
                && !item.abandoned.load(Ordering::Relaxed);
            let (dtype, avg, size) = (item.dtype, item.avg, mpi_type(item.dtype).1);
            let held = item.held.as_mut_ptr().cast::<u8>();
            item.walk_out.resize_with(item.outs.len(), Walk::default);
            let (outs, walks) = (&item.outs, &mut item.walk_out);
            let mut write = |part: *const u8, range: (usize, usize)| {
                for (out, walk) in outs.iter().zip(walks.iter_mut()) {
                    stage_out(dtype, part, (out, walk), range, avg);
                }
            };
            let collective = matches!(transfer, Transfer::Collective(_));
            match transfer {
                Transfer::Collective(_) if direct => write(recv, (start, n)),
                Transfer::Collective(_) | Transfer::Whole(_) | Transfer::Exchange(_) => {}
                Transfer::Ring(flight) => flight.finish(ring, |part, at, len| {
                    if direct || early {
                        write(part, (start + at, len));
                    }
                    if !direct {
                        // Written early, `held` is read only if the early writes stop: kept
                        // with non-temporal stores.
                        let into = held.add((start + at) * size);
                        match early {
                            true => copy_streaming(part, into, len * size),
                            false => std::ptr::copy_nonoverlapping(part, into, len * size),
                        }
                    }
                }),
            }
            if early && collective {
                write(held.add(start * size), (start, n));
            }
        }
        self.prune(spare);
        Ok(())
    }

    fn item(&mut self, seq: u64) -> Option<&mut Item> {
        self.items.iter_mut().find(|i| i.seq == seq)
    }

    /// Finished items whose tickets were dropped: gone, their buffers to `spare`.
    fn prune(&mut self, mut spare: impl FnMut(Vec<u64>)) {
        while let Some(at) =
            (self.items.iter()).position(|i| i.finished() && i.abandoned.load(Ordering::Relaxed))
        {
            let item = self.items.remove(at).expect("found");
            spare(item.held);
        }
    }

    /// The finished item of `handle`, out of the queue.
    pub(super) fn take(&mut self, handle: &Handle) -> Option<Item> {
        let at = self.items.iter().position(|i| i.seq == handle.seq)?;
        self.items.remove(at)
    }

    /// After a failure: pieces in flight may still read the stages (and an exchange's
    /// counts) and write the result buffers, so all are leaked, and nothing more is issued.
    pub(super) fn leak(&mut self) {
        std::mem::forget(std::mem::take(&mut self.items));
        std::mem::forget(std::mem::take(&mut self.stages));
        std::mem::forget(std::mem::take(&mut self.inflight));
    }

    /// The buckets queued, their pieces, and how many of those have crossed the ranks.
    pub(super) fn state(&self) -> (usize, usize, usize) {
        let sum = |f: fn(&Item) -> usize| self.items.iter().map(f).sum();
        (self.items.len(), sum(|i| i.pieces), sum(|i| i.done))
    }

    /// Grows whenever the queue moves (a piece issued or completed, a ring step taken): the
    /// progress thread backs off while it stays the same.
    pub(super) fn moves(&self) -> usize {
        self.issued + self.done + self.steps
    }

    pub(super) fn busy(&self) -> bool {
        !self.items.is_empty() || !self.inflight.is_empty()
    }

    /// Whether a piece is in flight or waits to be issued: what the progress thread moves
    /// (finished items only wait for the step to take them).
    pub(super) fn moving(&self) -> bool {
        !self.inflight.is_empty() || self.items.iter().any(|i| i.issued < i.pieces)
    }
}
