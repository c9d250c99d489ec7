//! The reproducible sum where the ring's shared-memory route cannot carry it (no shared memory,
//! or several contributions per rank): every element's contributions travel raw to the rank
//! that owns its block (an all-to-all), the owner sums them with the host's reproducible
//! arithmetic (backend/host/repro.rs: the same bytes for any number and order of
//! contributions), divides, and the sums travel back (an allgather). The plain allreduce's
//! bytes per contribution, where the exponents' maximum then the integers' sum move 2.25x.
//!
//! One [`Exchange`] moves a bucket chunk by chunk without ever waiting: the waited sum
//! ([`Engine::alltoall_reproducible`]) drives it to its end, and the steps queue moves a
//! bucket started early with it while the caller computes (`steps.rs`).

use std::collections::VecDeque;
use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mpi::ffi;

use super::calls::{check, count_of, tested};
use super::pieces::{stage, DEPTH, PIECE};
use super::poll::Idle;
use super::staging::mpi_type;
use super::Engine;
use crate::backend::host::repro;
use crate::backend::{Channel, Segment};
use crate::error::Result;
use crate::types::DType;

/// Element `i` of the flattened segments lies in block `r` for `first(r) <= i < first(r + 1)`.
pub(super) fn first(count: usize, n: usize, r: usize) -> usize {
    // u128: count * r may pass usize on 32-bit hosts; exact either way.
    (count as u128 * r as u128 / n as u128) as usize
}

/// Copies elements `[from, to)` of the segments' flattened contribution `k` to `dst` (`k`
/// None: the other way, from `dst` into every contribution).
///
/// # Safety
/// Every pointer holds its segment's elements; `dst` the range's.
unsafe fn copy_range(
    segments: &[(Vec<usize>, usize)],
    size: usize,
    (from, to): (usize, usize),
    k: Option<usize>,
    dst: *mut u8,
) {
    let mut at = 0;
    for (ptrs, count) in segments {
        let (a, b) = (from.max(at), to.min(at + count));
        if a < b {
            let bytes = (b - a) * size;
            let buf = dst.add((a - from) * size);
            match k {
                Some(k) => std::ptr::copy_nonoverlapping(
                    (ptrs[k] as *const u8).add((a - at) * size),
                    buf,
                    bytes,
                ),
                None => {
                    for &p in ptrs {
                        std::ptr::copy_nonoverlapping(
                            buf,
                            (p as *mut u8).add((a - at) * size),
                            bytes,
                        );
                    }
                }
            }
        }
        at += count;
    }
}

/// MPI's type for `dtype`'s own bytes: nothing is summed by MPI here, so f16 and bf16 travel
/// as they are (the ring widens them, for MPI's sums).
fn raw_type(dtype: DType) -> ffi::MPI_Datatype {
    match dtype.is_half() {
        // SAFETY: a link-time constant of the MPI library.
        true => unsafe { ffi::RSMPI_UINT16_T },
        false => mpi_type(dtype).0,
    }
}

/// Per segment: every local contribution's pointer, and the count.
pub(super) type Inputs = Vec<(Vec<usize>, usize)>;

/// Where an [`Exchange`]'s sums go: a bucket's held result (the steps queue), or back into
/// every contribution (a waited sum).
#[derive(Clone, Copy)]
pub(super) enum Out {
    /// Into `held`; with `keep` (the results written early: the originals'
    /// [`Aside::base`](super::aside::Aside)), each chunk staged there to be sent, its own
    /// block too, and left there: the staging is the saving (no copy more), in the exchange's
    /// layout ([`Aside::exchanged`](super::aside::Aside)).
    Held {
        held: *mut u8,
        keep: Option<*mut u8>,
    },
    Back,
}

/// One bucket's reproducible sum on its way: chunk `c`'s all-to-all, then (once it completed)
/// the owner's sums and chunk `c`'s allgather, the all-to-alls running [`DEPTH`] chunks ahead.
/// Every rank issues the calls in this same order whatever completes when (MPI's rule for
/// collectives on one communicator); each chunk's stages stay in cache (about a [`PIECE`] of
/// every local contribution together) and are reused [`DEPTH`] chunks on (but for a kept
/// chunk's send stage: its place in the aside, `Out::Held`).
pub(super) struct Exchange {
    comm: ffi::MPI_Comm,
    datatype: ffi::MPI_Datatype,
    dtype: DType,
    n: usize,
    me: usize,
    /// This rank's contributions.
    k: usize,
    /// Per rank r, every rank's contributions before r's (`n + 1` entries: the last, every
    /// contribution): where rank r's land in a receive stage, and in the owner's sum.
    before: Vec<usize>,
    /// Per segment: every local contribution's pointer, and the count (none: zeros, a
    /// stand-in).
    inputs: Inputs,
    /// Its ticket was dropped: zeros go for what is left, the caller's memory untouched.
    abandoned: Option<Arc<AtomicBool>>,
    count: usize,
    avg: Option<usize>,
    out: Out,
    /// Elements per chunk, and chunks.
    ch: usize,
    chunks: usize,
    /// [`DEPTH`] slots each of send stages, receive stages, sums and gather stages, from
    /// `base`; each slot's bytes.
    base: *mut u8,
    slot: [usize; 4],
    /// Per slot, the counts and displacements of its calls in flight: MPI may read them until
    /// each call completes (MPI 3.1 §5.12).
    counts: [[Vec<c_int>; 4]; DEPTH],
    gather_counts: [[Vec<c_int>; 2]; DEPTH],
    exchanges: [Option<ffi::MPI_Request>; DEPTH],
    /// Per slot, where its chunk's own block was staged (contribution `j` at `j * mine`
    /// elements on): in the receive stage, or kept.
    own: [usize; DEPTH],
    gathers: VecDeque<ffi::MPI_Request>,
    /// The ranges of originals saved at `keep` so far ([`Exchange::take_saved`]).
    saved: Vec<(usize, usize)>,
    /// Chunks whose all-to-all, allgather were issued; whose allgather completed; of those,
    /// the ones [`Exchange::landed`] told of.
    exchanged: usize,
    summed: usize,
    gathered: usize,
    told: usize,
}

// SAFETY: pointers into the caller's registered memory and the stages, used by one thread at
// a time (the queue's lock, or the waited call's); MPI_THREAD_MULTIPLE lets any thread test.
unsafe impl Send for Exchange {}

impl Exchange {
    /// The exchange of a bucket of `count` elements of a float `dtype` with
    /// `contributions[r]` on rank r of `comm` (`n` ranks, this one `me`), its sums divided by
    /// `avg` into `out`; its stages from `stages(bytes)`, which must stay valid (and are
    /// never freed while a call may use them) until it finished.
    pub(super) fn new(
        (comm, n, me): (ffi::MPI_Comm, usize, usize),
        (dtype, inputs, contributions, count): (DType, Inputs, &[usize], usize),
        (avg, out, abandoned): (Option<usize>, Out, Option<Arc<AtomicBool>>),
        stages: impl FnOnce(usize) -> *mut u8,
    ) -> Exchange {
        let (datatype, size) = (raw_type(dtype), dtype.size());
        let before: Vec<usize> = (0..=n).map(|r| contributions[..r].iter().sum()).collect();
        let (k, most_k) = (contributions[me], contributions.iter().copied().max());
        // About a PIECE of every local contribution together (of the most on a rank: the
        // chunks are alike on every rank): the stages of the chunks in flight then fit in
        // this VM's L2. At least one element per rank.
        let ch = (PIECE / size / most_k.unwrap_or(1).max(1)).max(n);
        let most = ch.div_ceil(n);
        let slot = |bytes: usize| bytes.next_multiple_of(64);
        let gather = match out {
            Out::Held { .. } => 0,
            Out::Back => slot(ch * size),
        };
        let slots = [
            slot(k * ch * size),
            slot(before[n] * most * size),
            slot(most * size),
            gather,
        ];
        let base = stages(DEPTH * slots.iter().sum::<usize>());
        Exchange {
            comm,
            datatype,
            dtype,
            n,
            me,
            k,
            before,
            inputs,
            abandoned,
            count,
            avg,
            out,
            ch,
            chunks: count.div_ceil(ch),
            base,
            slot: slots,
            counts: Default::default(),
            gather_counts: Default::default(),
            exchanges: [None; DEPTH],
            own: [0; DEPTH],
            gathers: VecDeque::with_capacity(DEPTH),
            exchanged: 0,
            summed: 0,
            gathered: 0,
            told: 0,
            saved: Vec::new(),
        }
    }

    pub(super) fn finished(&self) -> bool {
        self.gathered == self.chunks
    }

    /// The ranges of originals saved so far, for the caller's
    /// [`Aside::saved`](super::aside::Aside).
    pub(super) fn take_saved(&mut self) -> Vec<(usize, usize)> {
        std::mem::take(&mut self.saved)
    }

    /// The early writes stop: nothing more is saved; the ranges saved so far.
    pub(super) fn stop_saving(&mut self) -> Vec<(usize, usize)> {
        if let Out::Held { keep, .. } = &mut self.out {
            *keep = None;
        }
        self.take_saved()
    }

    /// The elements `[start, end)` whose sums landed in the held result since the last call.
    pub(super) fn landed(&mut self) -> (usize, usize) {
        let at = |c: usize| (c * self.ch).min(self.count);
        let range = (at(self.told), at(self.gathered));
        self.told = self.gathered;
        range
    }

    /// Slot `c % DEPTH` of stage `which` (0 send, 1 receive, 2 sums, 3 gather).
    fn at(&self, which: usize, c: usize) -> *mut u8 {
        let before: usize = self.slot[..which].iter().sum();
        // SAFETY: within the stages `new` took.
        unsafe {
            self.base
                .add(DEPTH * before + (c % DEPTH) * self.slot[which])
        }
    }

    /// Chunk `c`'s width.
    fn width(&self, c: usize) -> usize {
        self.ch.min(self.count - c * self.ch)
    }

    /// Rank `r`'s first element and length of chunk `c`.
    fn block(&self, c: usize, r: usize) -> (usize, usize) {
        let w = self.width(c);
        let a = first(w, self.n, r);
        (a, first(w, self.n, r + 1) - a)
    }

    /// Whether the caller's memory is not to be read (a stand-in, or a dropped ticket).
    fn zeros(&self) -> bool {
        let dropped = (self.abandoned.as_ref()).is_some_and(|a| a.load(Ordering::Relaxed));
        self.inputs.is_empty() || dropped
    }

    /// Issues and completes the calls that can go now, without waiting, summing one chunk at
    /// most (the steps queue's lock goes back between chunks: the caller's marks wait for
    /// it); whether anything moved.
    ///
    /// # Safety
    /// The inputs are valid (unless zeros) and the stages and `out` hold what `new` said.
    pub(super) unsafe fn advance(&mut self) -> Result<bool> {
        let (mut moved, mut summed_one) = (self.complete_gathers()?, false);
        loop {
            if self.exchanged < self.chunks.min(self.summed + DEPTH) {
                // Its stages are free: the chunk DEPTH before was summed.
                self.exchange(self.exchanged)?;
                self.exchanged += 1;
            } else if self.summed < self.chunks && !summed_one {
                let c = self.summed;
                // Its sums' slot is free once the allgather DEPTH before completed.
                if self.gathered + DEPTH <= c && !self.complete_gathers()? {
                    break;
                }
                if !tested(self.exchanges[c % DEPTH].as_mut().expect("issued"))? {
                    break;
                }
                self.exchanges[c % DEPTH] = None;
                self.sum(c);
                self.gather(c)?;
                // The next all-to-all still goes (the same order on every rank), then the
                // lock goes back.
                (self.summed, summed_one) = (c + 1, true);
            } else {
                break;
            }
            moved = true;
        }
        Ok(self.complete_gathers()? || moved)
    }

    /// Chunk `c`'s all-to-all: block `r` of the send stage holds every local contribution's
    /// elements of rank `r`'s block, one contribution after another; this rank's own block
    /// stays out of it (counts 0): in the receive stage, or, kept, at its place in the send
    /// layout (chunk `c`'s of the kept originals: `k * c * ch` elements on).
    unsafe fn exchange(&mut self, c: usize) -> Result<()> {
        let (n, me, k, size) = (self.n, self.me, self.k, self.dtype.size());
        let (at, w, zeros) = (c * self.ch, self.width(c), self.zeros());
        let keep = match self.out {
            Out::Held { keep, .. } => keep.filter(|_| !zeros),
            Out::Back => None,
        };
        let recv = self.at(1, c);
        let send = keep.map_or(self.at(0, c), |kept| kept.add(k * at * size));
        let (a_me, mine) = self.block(c, me);
        let own = match keep {
            Some(_) => send.add(k * a_me * size),
            None => recv.add(self.before[me] * mine * size),
        };
        self.own[c % DEPTH] = own as usize;
        for r in 0..n {
            let (a, l) = self.block(c, r);
            for j in 0..k {
                let to = match r == me {
                    true => own.add(j * mine * size),
                    false => send.add((k * a + j * l) * size),
                };
                match zeros {
                    true => std::ptr::write_bytes(to, 0, l * size),
                    false => copy_range(&self.inputs, size, (at + a, at + a + l), Some(j), to),
                }
            }
        }
        if keep.is_some() {
            self.saved.push((at, w));
        }
        let of = |f: &dyn Fn(usize) -> usize| (0..n).map(|r| count_of(f(r))).collect();
        let others = |v: usize, r: usize| if r == me { 0 } else { v };
        self.counts[c % DEPTH] = [
            of(&|r| others(k * (first(w, n, r + 1) - first(w, n, r)), r)),
            of(&|r| k * first(w, n, r)),
            of(&|r| others((self.before[r + 1] - self.before[r]) * mine, r)),
            of(&|r| self.before[r] * mine),
        ];
        let [sc, sd, rc, rd] = &self.counts[c % DEPTH];
        let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
        let rc = ffi::MPI_Ialltoallv(
            send.cast(),
            sc.as_ptr(),
            sd.as_ptr(),
            self.datatype,
            recv.cast(),
            rc.as_ptr(),
            rd.as_ptr(),
            self.datatype,
            self.comm,
            request.as_mut_ptr(),
        );
        check("MPI_Ialltoallv", rc)?;
        // SAFETY: the call succeeded, so it wrote the request.
        self.exchanges[c % DEPTH] = Some(request.assume_init());
        Ok(())
    }

    /// This rank's block of chunk `c`: every rank's contributions (the others' in the receive
    /// stage, its own where [`Exchange::exchange`] staged them) summed and divided into the
    /// sums' slot, which takes its first contribution first (the own block stays as staged:
    /// kept, it is the saved originals).
    unsafe fn sum(&mut self, c: usize) {
        let (me, size, before) = (self.me, self.dtype.size(), &self.before);
        let (_, mine) = self.block(c, me);
        let (recv, sums, own) = (self.at(1, c) as usize, self.at(2, c), self.own[c % DEPTH]);
        std::ptr::copy_nonoverlapping(own as *const u8, sums, mine * size);
        let ptrs: Vec<usize> = (0..before[self.n])
            .map(|i| {
                let own_j = (before[me]..before[me + 1])
                    .contains(&i)
                    .then(|| i - before[me]);
                match own_j {
                    Some(0) => sums as usize,
                    Some(j) => own + j * mine * size,
                    None => recv + i * mine * size,
                }
            })
            .collect();
        repro::reduce_ptrs(self.dtype, &ptrs, before[me], mine, self.avg);
    }

    /// Chunk `c`'s allgather of the owners' sums, into the held result or a gather stage.
    unsafe fn gather(&mut self, c: usize) -> Result<()> {
        let (n, w) = (self.n, self.width(c));
        let to = match self.out {
            Out::Held { held, .. } => held.add(c * self.ch * self.dtype.size()),
            Out::Back => self.at(3, c),
        };
        self.gather_counts[c % DEPTH] = [
            (0..n).map(|r| count_of(self.block(c, r).1)).collect(),
            (0..n).map(|r| count_of(first(w, n, r))).collect(),
        ];
        let [gc, gd] = &self.gather_counts[c % DEPTH];
        let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
        let rc = ffi::MPI_Iallgatherv(
            self.at(2, c).cast(),
            count_of(self.block(c, self.me).1),
            self.datatype,
            to.cast(),
            gc.as_ptr(),
            gd.as_ptr(),
            self.datatype,
            self.comm,
            request.as_mut_ptr(),
        );
        check("MPI_Iallgatherv", rc)?;
        // SAFETY: the call succeeded, so it wrote the request.
        self.gathers.push_back(request.assume_init());
        Ok(())
    }

    /// Completes the allgathers that are done, oldest first (a waited sum copies each chunk
    /// into every contribution); whether one completed.
    unsafe fn complete_gathers(&mut self) -> Result<bool> {
        let mut moved = false;
        while let Some(request) = self.gathers.front_mut() {
            if !tested(request)? {
                break;
            }
            self.gathers.pop_front();
            let c = self.gathered;
            if let (Out::Back, false) = (self.out, self.zeros()) {
                let size = self.dtype.size();
                let range = (c * self.ch, c * self.ch + self.width(c));
                copy_range(&self.inputs, size, range, None, self.at(3, c));
            }
            (self.gathered, moved) = (c + 1, true);
        }
        Ok(moved)
    }
}

impl Engine {
    /// Whether [`Engine::alltoall_reproducible`] takes this bucket: a float dtype,
    /// [`Engine::counted`]. Alike on every rank, as exec's `contributions` are.
    pub(super) fn alltoall_takes(
        &self,
        dtype: DType,
        segments: &[Segment<'_>],
        contributions: &[usize],
    ) -> bool {
        dtype.is_float() && self.counted(segments, contributions)
    }

    /// Whether `contributions` (every rank's) say what `segments` hold here: some on every
    /// rank, every segment with this rank's.
    pub(super) fn counted(&self, segments: &[Segment<'_>], contributions: &[usize]) -> bool {
        let every_rank = contributions.len() == self.size && contributions.iter().all(|&k| k > 0);
        every_rank
            && segments
                .iter()
                .all(|s| s.ptrs.len() == contributions[self.rank])
    }

    /// Every contribution of every segment := the reproducible sum over every rank's
    /// contributions, divided by `avg`: one [`Exchange`] driven to its end within the
    /// timeout. Staged in the engine's scratch (a timed-out request may still use it: then it
    /// is leaked, never the caller's memory).
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`](crate::backend::Ranks::allreduce); every pointer writable.
    pub(super) unsafe fn alltoall_reproducible(
        &self,
        channel: Channel,
        (dtype, segments, contributions): (DType, &[Segment<'_>], &[usize]),
        avg: Option<usize>,
    ) -> Result<()> {
        let count: usize = segments.iter().map(|s| s.count).sum();
        if count == 0 {
            return Ok(());
        }
        let inputs = segments
            .iter()
            .map(|s| (s.ptrs.to_vec(), s.count))
            .collect();
        let mut scratch = self.scratch.lock();
        let comm = (self.comm_of(channel), self.size, self.rank);
        let mut exchange = Exchange::new(
            comm,
            (dtype, inputs, contributions, count),
            (avg, Out::Back, None),
            |bytes| stage(&mut scratch, bytes),
        );
        let (mut since, mut idle) = (None, Idle::default());
        let mut drive = || -> Result<()> {
            loop {
                if exchange.advance()? {
                    idle.reset();
                }
                if exchange.finished() {
                    return Ok(());
                }
                idle.wait(&mut since, self.timeout, "the reproducible sum's exchange")?;
            }
        };
        drive().map_err(|e| {
            // Calls still pending may use the stages and counts.
            std::mem::forget(std::mem::take(&mut *scratch));
            std::mem::forget(exchange);
            self.failing(e)
        })
    }
}
