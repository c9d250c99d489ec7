//! Large allreduces as a ring over point-to-point calls: each piece split into one block per
//! rank, reduce-scatter then allgather around the ring (2 (n − 1) steps, each rank sending one
//! block to the next rank and receiving one from the previous), a few pieces in flight. Every
//! rank sends and sums 1/n of a piece per step. Open MPI's non-blocking allreduce of 2 ranks
//! reduces at one rank and sends the result back, and its time jumped between runs on the
//! development VM (docs/PERFORMANCE.md). Each block is summed once, at one rank, then copied:
//! the same bytes on every rank. Waited transfers ([`Engine::ring_allreduce`]) and the steps
//! queue's pieces (`steps.rs`) both go this way from [`RING_BYTES`] on, so a bucket meets the
//! same protocol on every rank whichever way each rank sends it. Where every rank runs on one
//! host, a piece crosses through shared memory instead ([`Slots`], `shm.rs`): the same flights,
//! staged straight into this rank's slot.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::time::Instant;

use half::{bf16, f16};
use mpi::ffi;

use super::calls::{check, count_of};
use super::pieces::{piece_of, stage, Walk, DEPTH};
use super::poll::Idle;
use super::shm::{Slots, OUT, REDUCED, STAGED};
use super::staging::{copy_spans, mpi_type, stage_in, stage_out, Summed, Way};
use super::Engine;
use crate::backend::host::{repro, STREAM_BYTES};
use crate::backend::Segment;
use crate::error::Result;
use crate::types::DType;

/// From this many bytes on, a bucket's allreduce goes round the ring; smaller ones, which
/// latency rules, are one non-blocking allreduce per piece.
pub(super) const RING_BYTES: usize = 64 << 10;

/// Tags of the ring's messages, `TAG_RING + k % DEPTH` for the `k`-th ring piece on a
/// communicator: pieces in flight never match each other's messages (messages of one tag
/// between two ranks arrive in order), and every rank numbers them alike.
const TAG_RING: c_int = 0x6480;

/// Where a rank sits in the ring of a communicator.
#[derive(Clone, Copy)]
pub(super) struct Ring {
    comm: ffi::MPI_Comm,
    n: usize,
    me: usize,
    /// The communicator's slots of shared memory, where every rank shares this host.
    pub(super) shm: Option<Slots>,
}

impl Ring {
    pub(super) fn new(comm: ffi::MPI_Comm, me: usize, n: usize, shm: Option<Slots>) -> Ring {
        Ring { comm, n, me, shm }
    }

    pub(super) fn comm(&self) -> ffi::MPI_Comm {
        self.comm
    }

    /// Ranks round it, and this rank's place.
    pub(super) fn ranks(&self) -> usize {
        self.n
    }

    pub(super) fn me(&self) -> usize {
        self.me
    }

    /// Whether a bucket of `bytes` goes round the ring.
    pub(super) fn takes(&self, bytes: usize) -> bool {
        self.n > 1 && bytes >= RING_BYTES
    }

    /// Where ring piece `k` is staged: `own` (an engine stage), or this rank's slot of shared
    /// memory once no rank reads it any more (None: not yet; poll again).
    pub(super) fn stage_for(&self, k: usize, own: *mut u8) -> Option<*mut u8> {
        match &self.shm {
            None => Some(own),
            Some(slots) => slots.mine_when_free(k),
        }
    }

    /// Elements of `size` bytes per piece: through shared memory, [`shm::PIECE`](super::shm)
    /// bytes, else the engine's [`PIECE`](super::pieces::PIECE).
    pub(super) fn piece_of(&self, size: usize) -> usize {
        match self.shm {
            Some(_) => (super::shm::PIECE / size).max(1),
            None => piece_of(size),
        }
    }

    /// Through shared memory: whether each piece crosses there.
    pub(super) fn shared(&self) -> bool {
        self.shm.is_some()
    }

    /// The communicator's slots of shared memory, where every rank shares this host.
    pub(super) fn slots(&self) -> Option<Slots> {
        self.shm
    }

    /// A flight's steps: sends and receives round the ring, or through shared memory its
    /// reduction then its copy out.
    fn steps(&self) -> usize {
        match self.shm {
            Some(_) => 2,
            None => 2 * (self.n - 1),
        }
    }

    /// Step `s`'s (block sent, block received).
    fn blocks(&self, s: usize) -> (usize, usize) {
        let (n, me) = (self.n, self.me);
        match s < n - 1 {
            true => ((me + n - s) % n, (me + 2 * n - s - 1) % n),
            false => ((me + 2 * n - s) % n, (me + 2 * n - 1 - s) % n),
        }
    }
}

/// Block `b` of `m` elements split into `n`: its first element and length.
pub(super) fn block(m: usize, n: usize, b: usize) -> (usize, usize) {
    let (q, rem) = (m / n, m % n);
    (b * q + b.min(rem), q + usize::from(b < rem))
}

/// `dst[..count] += src[..count]` in MPI's type for `dtype`.
///
/// # Safety
/// Both hold `count` aligned elements of that type.
pub(super) unsafe fn add_into(dtype: DType, dst: *mut u8, src: *const u8, count: usize) {
    unsafe fn add<T: Summed>(dst: *mut u8, src: *const u8, count: usize) {
        let d = std::slice::from_raw_parts_mut(dst.cast::<T::Acc>(), count);
        let s = std::slice::from_raw_parts(src.cast::<T::Acc>(), count);
        d.iter_mut().zip(s).for_each(|(d, &s)| *d = T::add(*d, s));
    }
    match dtype {
        DType::F32 => add::<f32>(dst, src, count),
        DType::F64 => add::<f64>(dst, src, count),
        DType::F16 => add::<f16>(dst, src, count),
        DType::Bf16 => add::<bf16>(dst, src, count),
        DType::I32 => add::<i32>(dst, src, count),
        DType::I64 => add::<i64>(dst, src, count),
    }
}

/// How a ring block is summed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sum {
    /// Added rank after rank, in MPI's type for the dtype.
    Plain,
    /// Through shared memory only, one contribution per rank in the dtype itself: the
    /// reproducible sum of the ranks' blocks (backend/host/repro.rs), divided by the given
    /// divisor, written once. The ranks' raw values meet in one place, so no exponent needs
    /// crossing first and nothing wider than the dtype travels.
    Reproducible(Option<usize>),
}

/// One piece on its way round the ring: `m` elements in MPI's type at `work`, reduced in
/// place, and room for one block at `block_in`.
pub(super) struct Flight {
    /// What it sums, in MPI's type for it; None: raw bytes, gathered only.
    dtype: Option<DType>,
    sum: Sum,
    m: usize,
    /// Where each of its `n` blocks starts, then `m`: the owners' layout (`owners.rs`); None:
    /// the even split ([`block`]).
    cut: Option<Vec<usize>>,
    work: *mut u8,
    block_in: *mut u8,
    tag: c_int,
    /// Its number among the communicator's ring pieces.
    k: usize,
    /// Steps done (a gather starts halfway).
    step: usize,
    /// The step it finishes at: [`Ring::steps`], or halfway for a reduce-scatter.
    end: usize,
    requests: [ffi::MPI_Request; 2],
}

/// Which half of the ring's steps a flight of the owners' layout takes (without shared
/// memory): the reduce-scatter leaves rank `r` the sum of block `(r + 1) % n`; the allgather
/// starts from each rank holding that block.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    Scatter,
    Gather,
}

impl Flight {
    /// Sends the `k`-th ring piece of the communicator off (its first step); through shared
    /// memory, says it is staged (`work` is then [`Ring::stage_for`]'s slot).
    ///
    /// # Safety
    /// `work` holds `m` elements and `block_in` a block of them until the flight finishes.
    pub(super) unsafe fn start(
        ring: &Ring,
        (dtype, m, k, sum): (DType, usize, usize, Sum),
        work: *mut u8,
        block_in: *mut u8,
    ) -> Result<Flight> {
        debug_assert!(
            sum == Sum::Plain || ring.shared(),
            "reproducible: shared memory only"
        );
        let flight = Flight {
            dtype: Some(dtype),
            sum,
            m,
            cut: None,
            work,
            block_in,
            tag: TAG_RING + (k % DEPTH) as c_int,
            k,
            step: 0,
            end: ring.steps(),
            // SAFETY: link-time constants.
            requests: [ffi::RSMPI_REQUEST_NULL; 2],
        };
        flight.launch(ring)
    }

    /// Sends the `k`-th ring piece of the communicator off in the owners' layout, over MPI
    /// messages: block `b` spans `cut[b]..cut[b + 1]` of `work`, and the flight takes `half`
    /// of the steps (`dtype` None: bytes, gathered only).
    ///
    /// # Safety
    /// As for [`Flight::start`], `block_in` holding the largest block.
    pub(super) unsafe fn start_owned(
        ring: &Ring,
        (dtype, k, half): (Option<DType>, usize, Half),
        cut: Vec<usize>,
        work: *mut u8,
        block_in: *mut u8,
    ) -> Result<Flight> {
        debug_assert!(!ring.shared() && cut.len() == ring.n + 1);
        debug_assert!(
            dtype.is_some() || half == Half::Gather,
            "bytes are not summed"
        );
        let n = ring.n;
        let (step, end) = match half {
            Half::Scatter => (0, n - 1),
            Half::Gather => (n - 1, 2 * (n - 1)),
        };
        let flight = Flight {
            dtype,
            sum: Sum::Plain,
            m: cut[n],
            cut: Some(cut),
            work,
            block_in,
            tag: TAG_RING + (k % DEPTH) as c_int,
            k,
            step,
            end,
            // SAFETY: link-time constants.
            requests: [ffi::RSMPI_REQUEST_NULL; 2],
        };
        flight.launch(ring)
    }

    /// Its first step: issued, or through shared memory said to be staged.
    unsafe fn launch(mut self, ring: &Ring) -> Result<Flight> {
        match &ring.shm {
            Some(slots) => slots.publish(STAGED, self.k),
            None => self.issue(ring)?,
        }
        Ok(self)
    }

    /// The MPI type of its elements, and their size.
    fn mpi(&self) -> (ffi::MPI_Datatype, usize) {
        match self.dtype {
            Some(dtype) => mpi_type(dtype),
            // SAFETY: a link-time constant.
            None => (unsafe { ffi::RSMPI_UINT8_T }, 1),
        }
    }

    /// The dtype it sums.
    fn summed(&self) -> DType {
        self.dtype.expect("a flight that sums has a dtype")
    }

    /// Block `b` of `n`: its first element and length.
    fn block(&self, n: usize, b: usize) -> (usize, usize) {
        match &self.cut {
            Some(cut) => (cut[b], cut[b + 1] - cut[b]),
            None => block(self.m, n, b),
        }
    }

    /// The finished piece's result, handed to `f(part, first element, elements)` part after
    /// part in order: the whole piece, or through shared memory each rank's summed block read
    /// from its slot; then, through shared memory, this rank says it is done with the others'
    /// slots.
    ///
    /// # Safety
    /// The flight finished.
    pub(super) unsafe fn finish(self, ring: &Ring, mut f: impl FnMut(*const u8, usize, usize)) {
        let Some(slots) = &ring.shm else {
            return f(self.work, 0, self.m);
        };
        let (n, me, size) = (slots.ranks(), slots.me(), self.mpi().1);
        for r in 0..n {
            let (o, l) = block(self.m, n, r);
            let slot = match r == me {
                true => self.work,
                false => slots.slot(r, self.k),
            };
            f(slot.add(o * size), o, l);
        }
        slots.publish(OUT, self.k);
    }

    pub(super) fn finished(&self) -> bool {
        self.step == self.end
    }

    unsafe fn issue(&mut self, ring: &Ring) -> Result<()> {
        let (datatype, size) = self.mpi();
        let (sent, received) = ring.blocks(self.step);
        let (so, sl) = self.block(ring.n, sent);
        let (ro, rl) = self.block(ring.n, received);
        let into = match self.step < ring.n - 1 {
            true => self.block_in,
            false => self.work.add(ro * size),
        };
        let (left, right) = ((ring.me + ring.n - 1) % ring.n, (ring.me + 1) % ring.n);
        let [recv, send] = &mut self.requests;
        let (count, tag, comm) = (count_of(rl), self.tag, ring.comm);
        let rc = ffi::MPI_Irecv(into.cast(), count, datatype, left as c_int, tag, comm, recv);
        check("MPI_Irecv", rc)?;
        let from = self.work.add(so * size);
        let rc = ffi::MPI_Isend(
            from.cast(),
            count_of(sl),
            datatype,
            right as c_int,
            tag,
            comm,
            send,
        );
        check("MPI_Isend", rc)
    }

    /// Tests the step under way; once it is done, sums what it received (while reducing) and
    /// issues the next. Whether it moved.
    ///
    /// # Safety
    /// As for [`Flight::start`].
    pub(super) unsafe fn advance(&mut self, ring: &Ring) -> Result<bool> {
        if self.finished() {
            return Ok(false);
        }
        if let Some(slots) = &ring.shm {
            return Ok(self.advance_shared(slots));
        }
        let mut flag: c_int = 0;
        let requests = self.requests.as_mut_ptr();
        let rc = ffi::MPI_Testall(2, requests, &mut flag, ffi::RSMPI_STATUSES_IGNORE);
        check("MPI_Testall", rc)?;
        if flag == 0 {
            return Ok(false);
        }
        if self.step < ring.n - 1 {
            let (ro, rl) = self.block(ring.n, ring.blocks(self.step).1);
            let size = self.mpi().1;
            add_into(self.summed(), self.work.add(ro * size), self.block_in, rl);
        }
        self.step += 1;
        if !self.finished() {
            self.issue(ring)?;
        }
        Ok(true)
    }

    /// Through shared memory: once every rank staged the piece, sums this rank's block from the
    /// others' slots into its own (ascending rank order); then waits until every rank did
    /// ([`Flight::finish`] reads their blocks from their slots). A rank sums piece `k` only
    /// after its piece `k - 1`: a counter says every piece before it passed too. Whether it
    /// moved.
    unsafe fn advance_shared(&mut self, slots: &Slots) -> bool {
        let (n, me, size) = (slots.ranks(), slots.me(), self.mpi().1);
        let at = |b: usize| block(self.m, n, b);
        let k = self.k;
        match self.step {
            0 if slots.next(REDUCED) == k && slots.all_past(STAGED, k) => {
                let (o, l) = at(me);
                let mine = self.work.add(o * size);
                let theirs = |r: usize| slots.slot(r, self.k).add(o * size);
                match self.sum {
                    Sum::Plain => {
                        for r in (0..n).filter(|&r| r != me) {
                            add_into(self.summed(), mine, theirs(r), l);
                        }
                    }
                    Sum::Reproducible(avg) => {
                        let ptrs: Vec<usize> = (0..n)
                            .map(|r| match r == me {
                                true => mine as usize,
                                false => theirs(r) as usize,
                            })
                            .collect();
                        repro::reduce_ptrs(self.summed(), &ptrs, me, l, avg);
                    }
                }
                slots.publish(REDUCED, self.k);
            }
            1 if slots.all_past(REDUCED, k) => {}
            _ => return false,
        }
        self.step += 1;
        true
    }
}

// SAFETY: stages of the engine and requests of this process; one thread at a time (the
// engine's locks).
unsafe impl Send for Flight {}

impl Engine {
    /// [`Ranks::allreduce`](crate::backend::Ranks) of `segments` (`count` elements) round
    /// `ring`, its pieces numbered from `first` (the ring pieces the communicator carried
    /// before); [`DEPTH`] pieces in flight, each staged in and out through the engine's stages
    /// (or this rank's slots of shared memory) as a waited `MPI_Iallreduce` piece is. `sum`:
    /// how each block is summed; `avg` divides a plain sum as it is staged out (a reproducible
    /// sum divides in its reduction); `outs` ([`outputs`](super::staging::outputs)): where the
    /// result goes, null parts not written (and, through shared memory, not read).
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`](crate::backend::Ranks).
    pub(super) unsafe fn ring_allreduce(
        &self,
        (ring, first): (Ring, usize),
        (dtype, segments, count): (DType, &[Segment<'_>], usize),
        outs: &[(usize, usize)],
        sum: Sum,
        avg: Option<usize>,
    ) -> Result<()> {
        let size = mpi_type(dtype).1;
        let piece = ring.piece_of(size).min(count);
        let pieces = count.div_ceil(piece);
        // Each slot: the piece, then room for one received block.
        let work = (piece * size).next_multiple_of(64);
        let slot = work + (piece.div_ceil(ring.n) * size).next_multiple_of(64);
        let range = |i: usize| (i * piece, piece.min(count - i * piece));
        let (mut walk_in, mut walk_out) = (Walk::default(), Walk::default());
        let what = match ring.shared() {
            true => "the ring allreduce through shared memory",
            false => "MPI_Isend/MPI_Irecv (ring allreduce)",
        };
        self.fly(
            (ring, pieces, slot),
            what,
            |i, own| {
                let Some(stage) = ring.stage_for(first + i, own) else {
                    return Ok(None);
                };
                stage_in(dtype, segments, &mut walk_in, range(i), stage);
                let key = (dtype, range(i).1, first + i, sum);
                Flight::start(&ring, key, stage, own.add(work)).map(Some)
            },
            |i, flight| {
                let start = range(i).0;
                flight.finish(&ring, |part, at, len| {
                    stage_out(dtype, part, (outs, &mut walk_out), (start + at, len), avg)
                });
            },
        )
    }

    /// `pieces` ring pieces round `ring`, [`DEPTH`] in flight, each in a slot of `slot` bytes
    /// of the engine's stages: `launch(i, slot)` stages piece `i` and starts its flight (None:
    /// its slot of shared memory is not free yet; asked again), `land(i, flight)` finishes
    /// each in piece order. `what`: the transfer, named in a timeout.
    ///
    /// # Safety
    /// `launch` and `land` stay within the slot and the caller's memory.
    pub(super) unsafe fn fly(
        &self,
        (ring, pieces, slot): (Ring, usize, usize),
        what: &str,
        mut launch: impl FnMut(usize, *mut u8) -> Result<Option<Flight>>,
        mut land: impl FnMut(usize, Flight),
    ) -> Result<()> {
        let mut scratch = self.scratch.lock();
        let base = stage(&mut scratch, slot * DEPTH.min(pieces));
        let at = |i: usize| base.add((i % DEPTH) * slot);
        let mut flights: VecDeque<(usize, Flight)> = VecDeque::with_capacity(DEPTH);
        let (mut next, mut since) = (0, None::<Instant>);
        let mut idle = Idle::watching(ring.shm);
        let mut run = || -> Result<()> {
            loop {
                while flights.len() < DEPTH && next < pieces {
                    let Some(flight) = launch(next, at(next))? else {
                        break;
                    };
                    flights.push_back((next, flight));
                    next += 1;
                }
                let mut moved = false;
                for (_, flight) in flights.iter_mut() {
                    moved |= flight.advance(&ring)?;
                }
                // Out in piece order: a later piece that finished first keeps its slot.
                while flights.front().is_some_and(|(_, f)| f.finished()) {
                    let (i, flight) = flights.pop_front().expect("a front");
                    land(i, flight);
                }
                if flights.is_empty() && next == pieces {
                    return Ok(());
                }
                match moved {
                    true => idle.reset(),
                    false => idle.wait(&mut since, self.timeout, what)?,
                }
            }
        };
        let done = run().map_err(|e| self.failing(e));
        if done.is_err() {
            // Pieces still pending may read and write their stages.
            std::mem::forget(std::mem::take(&mut *scratch));
        }
        done
    }
}

impl Engine {
    /// [`Ranks::allgather_owned`](crate::backend::Ranks) through shared memory: `bytes` of
    /// spans laid end to end, in pieces numbered from `first` on the collectives' channel.
    /// `parts[r]`: the spans with only rank `r`'s owned bytes (the rest null, [`copy_spans`]).
    /// Each rank copies its own bytes of a piece into its slot at their place there, then every
    /// other rank's bytes from that rank's slot: each byte is copied once in, and once out per
    /// other rank, and nothing is staged that no rank reads. The counters go as a ring piece's
    /// do ([`Flight`]), so ring pieces and these share the channel's numbering.
    ///
    /// # Safety
    /// As for [`Ranks::allgather_owned`](crate::backend::Ranks); `ring` is shared.
    pub(super) unsafe fn shared_allgather(
        &self,
        (ring, first): (Ring, usize),
        bytes: usize,
        parts: &[Vec<(usize, usize)>],
    ) -> Result<()> {
        let Some(slots) = ring.shm else {
            unreachable!("an allgather through shared memory without it");
        };
        let (n, me) = (slots.ranks(), slots.me());
        let piece = ring.piece_of(1).min(bytes);
        let pieces = bytes.div_ceil(piece);
        let range = |i: usize| (i * piece, piece.min(bytes - i * piece));
        // The others' bytes land where this rank has not read: a large gather streams them
        // past the caches, as the host's own allgather does.
        let streaming = bytes >= STREAM_BYTES;
        // The channel's slots are used under its lock, as the waited transfers' stages are.
        let _held = self.scratch.lock();
        let mut walk_in = Walk::default();
        let mut walks_out: Vec<Walk> = (0..n).map(|_| Walk::default()).collect();
        self.through_slots(
            (slots, first, pieces),
            "the allgather through shared memory",
            |i, slot| copy_spans((&parts[me], &mut walk_in), range(i), slot, Way::In),
            |i, k| {
                for r in (0..n).filter(|&r| r != me) {
                    let out = (&parts[r][..], &mut walks_out[r]);
                    copy_spans(out, range(i), slots.slot(r, k), Way::Out { streaming });
                }
            },
        )
    }

    /// `pieces` pieces through a channel's `slots`, numbered from `first` as ring pieces (the
    /// same counters): piece `i` staged into this rank's slot by `stage(i, slot)` once every
    /// rank is done with that slot's last piece, at most [`DEPTH`] ahead; then, once every
    /// rank staged it, read from the others' slots by `read(i, k)` (`k`: its number). Nothing
    /// is reduced between, so both later counters pass at once, and the next ring piece finds
    /// them at its number. The caller holds the channel's lock.
    ///
    /// # Safety
    /// `stage` and `read` stay within the slots' pieces and the caller's memory.
    pub(super) unsafe fn through_slots(
        &self,
        (slots, first, pieces): (Slots, usize, usize),
        what: &str,
        mut stage: impl FnMut(usize, *mut u8),
        mut read: impl FnMut(usize, usize),
    ) -> Result<()> {
        let (mut staged, mut done) = (0, 0);
        let (mut since, mut idle) = (None::<Instant>, Idle::watching(Some(slots)));
        let mut run = || -> Result<()> {
            while done < pieces {
                let mut moved = false;
                while staged < pieces && staged < done + DEPTH {
                    let Some(slot) = slots.mine_when_free(first + staged) else {
                        break;
                    };
                    stage(staged, slot);
                    slots.publish(STAGED, first + staged);
                    (staged, moved) = (staged + 1, true);
                }
                while done < staged && slots.all_past(STAGED, first + done) {
                    let k = first + done;
                    read(done, k);
                    slots.publish(REDUCED, k);
                    slots.publish(OUT, k);
                    (done, moved) = (done + 1, true);
                }
                match moved {
                    true => idle.reset(),
                    false => idle.wait(&mut since, self.timeout, what)?,
                }
            }
            Ok(())
        };
        run().map_err(|e| self.failing(e))
    }
}
