//! [`Ranks`] for the MPI engine: the collectives the rest of dpsync calls, each refused once the
//! world failed, then carried by the engine's waited pieces, its ring or its steps queue; the
//! engine's other files are its parts, which nothing outside this module sees.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use mpi::ffi;
use serde_json::json;

use super::calls::{check, count_of};
use super::pieces::{piece_of, stage, Walk, DEPTH, PIECE};
use super::poll::poll;
use super::ring::Sum;
use super::scatter;
use super::staging::{copy_spans, mpi_type, outputs, Way};
use super::steps::{Crossing, Handle, Until};
use super::MpiRanks;
use crate::backend::{allgather_packed, Channel, EveryRank, Gate, Ranks, Segment, Ticket};
use crate::error::{Error, ErrorKind, Result};
use crate::types::DType;

/// The tag of [`Ranks::allgather_fixed`]'s point-to-point exchanges (on the collectives'
/// communicator, where nothing else sends point to point).
const TAG_GATHER: c_int = 0x6470;

impl Ranks for MpiRanks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.size
    }

    fn describe(&self) -> serde_json::Value {
        let (queued, pieces, done) = self.queue.lock().state();
        json!({"engine": "mpi", "mpi_library": self.library,
               "failed": *self.failed.lock(), "progress_thread": self.progress.lock().describe(),
               "shared_memory": self.shared_note,
               "early_buckets": {"queued": queued, "pieces": pieces, "pieces_done": done}})
    }

    fn neighbours(&self) -> Vec<(usize, u32)> {
        self.neighbours.clone()
    }

    fn begin(&self, call: &str) {
        call.clone_into(&mut self.call.lock());
        self.begun.store(true, Ordering::Relaxed);
        self.agreed.store(false, Ordering::Relaxed);
    }

    fn agreed(&self) {
        self.agreed.store(true, Ordering::Relaxed);
    }

    fn vote_lost(&self, failed_here: Option<&str>) -> Result<Option<bool>> {
        let agreed = self.agreed.swap(false, Ordering::Relaxed);
        if !self.elastic || !self.begun.swap(false, Ordering::Relaxed) {
            return Ok(None);
        }
        // A refused agreement's error is alike on every rank: no loss of this rank's.
        let failed_here = failed_here.filter(|_| agreed);
        // The progress thread stays out of MPI meanwhile (it moves the queue under its lock):
        // else Open MPI 5.0 answered false losses (docs/ARCHITECTURE.md, "Pitfalls seen").
        let _queue = self.queue.lock();
        MpiRanks::vote_lost(self, failed_here).map(Some)
    }

    fn shrunk(&self) -> Result<(Box<dyn Ranks>, Vec<usize>)> {
        let (engine, lost) = MpiRanks::shrunk(self)?;
        Ok((Box::new(engine), lost))
    }

    unsafe fn allreduce(
        &self,
        channel: Channel,
        dtype: DType,
        segments: &[Segment<'_>],
        avg: Option<usize>,
    ) -> Result<()> {
        if self.scatters_then_gathers(channel, dtype, segments) {
            self.refuse_if_failed()?;
            return self.alone(channel, |queue| {
                self.shared_allreduce(channel, queue, dtype, segments, (Sum::Plain, avg))
            });
        }
        let outs = outputs(dtype, segments, None);
        self.reduce_into(channel, (dtype, segments, &outs), (Sum::Plain, avg))
    }

    unsafe fn allreduce_reproducible(
        &self,
        channel: Channel,
        (dtype, segments, contributions): (DType, &[Segment<'_>], &[usize]),
        avg: Option<usize>,
    ) -> Result<bool> {
        self.refuse_if_failed()?;
        let one_each = contributions.iter().all(|&k| k == 1);
        if !(one_each && self.sums_reproducibly(channel, dtype, segments)) {
            if !self.alltoall_takes(dtype, segments, contributions) {
                return Ok(false);
            }
            self.alone(channel, |_| {
                self.alltoall_reproducible(channel, (dtype, segments, contributions), avg)
            })?;
            return Ok(true);
        }
        // As the plain allreduce through shared memory goes: the owners' sums are exact.
        let sum = (Sum::Reproducible(avg), None);
        self.alone(channel, |queue| {
            self.shared_allreduce(channel, queue, dtype, segments, sum)
        })?;
        Ok(true)
    }

    unsafe fn reduce_scatter(
        &self,
        channel: Channel,
        (dtype, segments, owned): (DType, &[Segment<'_>], &[(usize, usize)]),
        avg: Option<usize>,
        reproducible: bool,
        every_rank: Option<EveryRank<'_>>,
    ) -> Result<bool> {
        self.refuse_if_failed()?;
        let count: usize = segments.iter().map(|s| s.count).sum();
        // Reproducible sums take the owners' way through shared memory only (exact there), with
        // one contribution on every rank: the levels' word (alike on every rank), not this
        // rank's count alone.
        let one_each = every_rank.as_ref().is_some_and(|e| e.one_each);
        let exact = reproducible && one_each && self.sums_reproducibly(channel, dtype, segments);
        let every_rank = every_rank.filter(|_| !reproducible || exact);
        if let Some(every) = every_rank.filter(|e| self.scatters_owned(channel, *e, count, dtype)) {
            let ring = self.ring(channel);
            let size = mpi_type(dtype).1;
            let c = match ring.shared() {
                true => scatter::section_of(dtype.size(), self.size),
                false => ring.piece_of(size).div_ceil(self.size),
            };
            let owners = scatter::Owned::new(segments.len(), every.owned, self.size, c);
            self.alone(channel, |queue| {
                let first = self.number_ring_pieces(queue, owners.pieces, 1);
                match ring.shared() {
                    true => {
                        let data = (dtype, segments, count);
                        let ring_piece = ring.piece_of(size).min(count);
                        let owned = (&owners, ring_piece);
                        let sum = match exact {
                            true => (Sum::Reproducible(avg), None),
                            false => (Sum::Plain, avg),
                        };
                        self.shared_reduce_scatter((ring, first), data, owned, sum)
                    }
                    false => {
                        let data = (dtype, segments, owned);
                        self.ring_reduce_scatter((ring, first), data, &owners, avg)
                    }
                }
            })?;
            return Ok(true);
        }
        let outs = outputs(dtype, segments, Some(owned));
        let data = (dtype, segments, &outs[..]);
        let sum = match reproducible {
            false => (Sum::Plain, avg),
            true if exact => (Sum::Reproducible(avg), None),
            true => return Ok(false),
        };
        self.reduce_into(channel, data, sum)?;
        Ok(true)
    }

    unsafe fn allgather_owned(
        &self,
        spans: &[(usize, usize)],
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        self.refuse_if_failed()?;
        let ring = self.ring(Channel::Calls);
        let bytes: usize = spans.iter().map(|s| s.1).sum();
        if bytes == 0 {
            return Ok(());
        }
        if !ring.shared() {
            if !ring.takes(bytes) {
                // Latency rules: one exchange.
                return allgather_packed(self, spans, owned);
            }
            let c = ring.piece_of(1).div_ceil(self.size);
            let owned = scatter::Owned::new(spans.len(), owned, self.size, c);
            let first = self.number_ring_pieces(None, owned.pieces, 1);
            return self.ring_allgather((ring, first), spans, &owned);
        }
        let parts = scatter::parts_of(spans, owned, self.size);
        let first = self.number_ring_pieces(None, bytes, ring.piece_of(1));
        self.shared_allgather((ring, first), bytes, &parts)
    }

    fn allreduce_max(&self, channel: Channel, data: &mut [u8], wide: bool) -> Result<()> {
        self.refuse_if_failed()?;
        // SAFETY: MPI's predefined handles, constant once MPI is initialised.
        let (datatype, size) = match wide {
            true => (unsafe { ffi::RSMPI_UINT16_T }, 2),
            false => (unsafe { ffi::RSMPI_UINT8_T }, 1),
        };
        let count = data.len() / size;
        let comm = self.comm_of(channel);
        // Held to the end: the steps' communicator carries this transfer alone meanwhile.
        self.alone(channel, |_| {
            if count == 0 {
                return Ok(());
            }
            // rsmpi has no MPI_IN_PLACE: the pieces are sent from a copy.
            let send = data.to_vec();
            let recv = data.as_mut_ptr();
            let piece = piece_of(size).min(count);
            let done = self.run_pieces(
                "MPI_Iallreduce (MPI_MAX)",
                count.div_ceil(piece),
                |i, request| {
                    let (at, n) = (i * piece * size, piece.min(count - i * piece));
                    // SAFETY: both ranges hold the piece; `send` outlives the requests (below).
                    unsafe {
                        ffi::MPI_Iallreduce(
                            send.as_ptr().add(at).cast(),
                            recv.add(at).cast(),
                            count_of(n),
                            datatype,
                            ffi::RSMPI_MAX,
                            comm,
                            request,
                        )
                    }
                },
                |_| {},
            );
            if done.is_err() {
                // Pieces still pending may read it (the world has failed: nothing is sent again).
                std::mem::forget(send);
            }
            done
        })
    }

    unsafe fn start(
        &self,
        dtype: DType,
        segments: &[Segment<'_>],
        count: usize,
        (avg, early, reproducible): (Option<usize>, bool, Option<&[usize]>),
        gate: Option<Gate>,
    ) -> Result<Ticket> {
        self.refuse_if_failed()?;
        let as_said = reproducible.is_some_and(|every| self.counted(segments, every));
        if let Some(every) = reproducible.filter(|_| !self.starts_reproducibly(dtype) || !as_said) {
            let message = format!(
                "a reproducible sum of {count} x {dtype:?} ({every:?} contributions per rank) \
                 cannot start early"
            );
            return Err(Error::new(ErrorKind::Panic, message));
        }
        let size = mpi_type(dtype).1;
        // Cut as a waited transfer of the bucket would be (a bucket off the ring is below
        // either piece size: one piece). Through shared memory, a bucket the ring carries
        // crosses whole (`whole.rs`), and so does a reproducible one of one contribution per
        // rank, of any size (its sum needs the ranks' raw values in one place); other
        // reproducible ones go to each element's owner and back (`alltoall.rs`). Alike on
        // every rank, as the bucket, dtype, options and contributions are.
        let ring = self.ring(Channel::Steps);
        let crossing = match reproducible {
            Some(every) if ring.shared() && every.iter().all(|&k| k == 1) && !dtype.is_half() => {
                Crossing::Whole { reproducible: true }
            }
            Some(every) => Crossing::Exchange {
                contributions: every.to_vec(),
            },
            None if ring.shared() && ring.takes(count * size) && !dtype.is_half() => {
                Crossing::Whole {
                    reproducible: false,
                }
            }
            None => Crossing::Pieces,
        };
        let held = self.spare_stage(count * size);
        let outputs = segments.first().map_or(0, |s| s.ptrs.len()) * count;
        let aside = early.then(|| self.spare_stage(outputs * dtype.size()));
        let mut queue = self.queue.lock();
        let handle = queue.push(
            (dtype, segments, count),
            (avg, ring.piece_of(size), crossing),
            (held, aside, gate),
        );
        if !self.thread_moves() {
            self.drive(&mut queue, Until::Idle)?;
        }
        drop(queue);
        self.wake_progress();
        Ok(Ticket(Box::new(handle)))
    }

    fn starts_reproducibly(&self, dtype: DType) -> bool {
        // The ranks' raw values meet in shared memory (`whole.rs`, F32 and F64) or at each
        // element's owner (`alltoall.rs`, any float).
        dtype.is_float()
    }

    unsafe fn release(&self, ticket: &Ticket, owned: Option<&[(usize, usize)]>) {
        if let Some(handle) = ticket.0.downcast_ref::<Handle>() {
            self.queue.lock().release(handle, owned);
        }
    }

    fn hold(&self) {
        self.queue.lock().stop_early(None);
    }

    fn poke(&self) {
        if !self.thread_moves() && self.refuse_if_failed().is_ok() {
            // Busy: the progress thread is moving the queue. A failure is kept in `failed`:
            // the step's allreduce_grads reports it.
            if let Some(mut queue) = self.queue.try_lock() {
                let _ = self.drive(&mut queue, Until::Idle);
            }
        }
    }

    unsafe fn finish(&self, ticket: Ticket, write: bool) -> Result<()> {
        let Ok(handle) = ticket.0.downcast::<Handle>() else {
            unreachable!("a ticket of another engine");
        };
        self.refuse_if_failed()?;
        let mut queue = self.queue.lock();
        if write {
            // Released already (Executor::release_early) when its step agreed: with the
            // outputs it then chose.
            queue.release(&handle, None);
        }
        self.drive(&mut queue, Until::Done(handle.seq()))?;
        let item = queue.take(&handle).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidState,
                "a bucket started early is no longer queued in this context's world",
            )
        })?;
        // The item is ours now: the next buckets move on (progress thread) while it is copied.
        drop(queue);
        let mut item = item;
        if write {
            // The pieces that completed before the step agreed (the others are written).
            for out in &item.outs {
                item.write_held((out, &mut Walk::default()), (0, item.held_count()));
            }
        } else if let Some(aside) = item.aside.as_mut() {
            // Drained: what was written early goes back.
            aside.restore();
        }
        let mut spare = self.spare.lock();
        spare.extend(item.aside.map(|a| a.bytes));
        spare.push(item.held);
        Ok(())
    }

    unsafe fn broadcast(&self, spans: &[(usize, usize)], root: usize) -> Result<()> {
        self.refuse_if_failed()?;
        let bytes: usize = spans.iter().map(|&(_, n)| n).sum();
        if bytes == 0 {
            return Ok(());
        }
        // Pieces through cache-sized stages, as in `allreduce`: slot `i % DEPTH` of piece `i`.
        let piece = PIECE.min(bytes);
        let pieces = bytes.div_ceil(piece);
        let mut scratch = self.scratch.lock();
        let stages = stage(&mut scratch, piece * DEPTH.min(pieces));
        let at = |i: usize| stages.add((i % DEPTH) * piece);
        let range = |i: usize| (i * piece, piece.min(bytes - i * piece));
        let mine = root == self.rank;
        let (mut walk_in, mut walk_out) = (Walk::default(), Walk::default());
        let sent = self.run_pieces(
            "MPI_Ibcast",
            pieces,
            |i, request| {
                if mine {
                    copy_spans((spans, &mut walk_in), range(i), at(i), Way::In);
                }
                ffi::MPI_Ibcast(
                    at(i).cast(),
                    count_of(range(i).1),
                    ffi::RSMPI_UINT8_T,
                    root as c_int,
                    self.comm.0,
                    request,
                )
            },
            |i| {
                if !mine {
                    copy_spans(
                        (spans, &mut walk_out),
                        range(i),
                        at(i),
                        Way::Out { streaming: false },
                    );
                }
            },
        );
        if sent.is_err() {
            std::mem::forget(std::mem::take(&mut *scratch));
        }
        sent
    }

    fn allgather_fixed(&self, words: &[u64]) -> Result<Vec<u64>> {
        self.refuse_if_failed()?;
        let (n, len) = (self.size, words.len() * 8);
        // Bruck's allgather, point to point: after each round this rank holds the records of
        // ranks rank, rank + 1, ... (mod n), twice as many as before; ceil(log2 n) rounds, one
        // exchange with 2 ranks. Open MPI's non-blocking allgather (libnbc) spends about as long
        // building its schedule as the exchange of a small record takes (docs/PERFORMANCE.md).
        // `held` is leaked on failure: a pending receive may still write it.
        let mut held = vec![0u64; words.len() * n];
        held[..words.len()].copy_from_slice(words);
        let base = held.as_mut_ptr().cast::<u8>();
        let mut since = None;
        let mut rounds = || -> Result<()> {
            let (mut have, mut dist) = (1, 1);
            while have < n {
                let blocks = dist.min(n - have);
                let (to, from) = ((self.rank + n - dist) % n, (self.rank + dist) % n);
                // SAFETY: link-time constants.
                let mut requests = unsafe { [ffi::RSMPI_REQUEST_NULL; 2] };
                // SAFETY: the receive fills records `have..have + blocks` of `held` (within it:
                // `have + blocks <= n`), the send reads the first `blocks <= have`: disjoint.
                unsafe {
                    let count = count_of(blocks * len);
                    check(
                        "MPI_Irecv",
                        ffi::MPI_Irecv(
                            base.add(have * len).cast(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            from as c_int,
                            TAG_GATHER,
                            self.comm.0,
                            &mut requests[0],
                        ),
                    )?;
                    check(
                        "MPI_Isend",
                        ffi::MPI_Isend(
                            base.cast_const().cast(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            to as c_int,
                            TAG_GATHER,
                            self.comm.0,
                            &mut requests[1],
                        ),
                    )?;
                }
                poll(
                    &mut requests,
                    &mut since,
                    self.timeout,
                    "MPI_Isend/MPI_Irecv",
                )?;
                have += blocks;
                dist *= 2;
            }
            Ok(())
        };
        if let Err(e) = rounds() {
            std::mem::forget(held);
            return Err(self.failing(e));
        }
        // `held` starts at this rank's record: rotated into rank order.
        held.rotate_right(self.rank * words.len());
        Ok(held)
    }

    fn without(&self, left: &[usize]) -> Result<Box<dyn Ranks>> {
        self.refuse_if_failed()?;
        Ok(Box::new(self.remaining(left)?))
    }

    fn allgather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.refuse_if_failed()?;
        // The lengths first (a fixed-size exchange), then the bytes at their offsets.
        let lengths: Vec<u64> = (self.allgather_fixed(&[(bytes.len() as u64).to_le()])?)
            .into_iter()
            .map(u64::from_le)
            .collect();
        let total: u64 = lengths.iter().sum();
        if total == 0 {
            // Nothing to move (and some MPIs refuse a gather of empty buffers).
            return Ok(vec![Vec::new(); self.size]);
        }
        if total > c_int::MAX as u64 {
            return Err(Error::invalid(format!(
                "an exchange between ranks of {total} bytes is beyond MPI's int counts"
            )));
        }
        let counts: Vec<c_int> = lengths.iter().map(|&l| l as c_int).collect();
        let offsets: Vec<c_int> = (counts.iter())
            .scan(0, |at, &n| {
                let o = *at;
                *at += n;
                Some(o)
            })
            .collect();
        let mut all = vec![0u8; total as usize];
        let send = bytes.to_vec();
        // SAFETY: counts and offsets describe `all`; every rank sends what it announced.
        let sent = self.run("MPI_Iallgatherv", |request| unsafe {
            ffi::MPI_Iallgatherv(
                send.as_ptr().cast(),
                count_of(bytes.len()),
                ffi::RSMPI_UINT8_T,
                all.as_mut_ptr().cast(),
                counts.as_ptr(),
                offsets.as_ptr(),
                ffi::RSMPI_UINT8_T,
                self.comm.0,
                request,
            )
        });
        if let Err(e) = sent {
            std::mem::forget((send, all, counts, offsets));
            return Err(e);
        }
        Ok((offsets.iter().zip(&counts))
            .map(|(&o, &n)| all[o as usize..(o + n) as usize].to_vec())
            .collect())
    }
}
