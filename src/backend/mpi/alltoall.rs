//! The reproducible sum where the ring's shared-memory route cannot carry it (no shared memory,
//! or several contributions per rank): every element's contributions travel raw to the rank
//! that owns its block (one all-to-all), the owner sums them with the host's reproducible
//! arithmetic (backend/host/repro.rs: the same bytes for any number and order of
//! contributions), divides, and the sums travel back (one allgather). The plain allreduce's
//! bytes per contribution, where the exponents' maximum then the integers' sum move 2.25x.

use std::ffi::c_int;

use mpi::ffi;

use super::calls::count_of;
use super::pieces::{stage, DEPTH, PIECE};
use super::staging::mpi_type;
use super::Engine;
use crate::backend::host::repro;
use crate::backend::{Channel, Segment};
use crate::error::Result;
use crate::types::DType;

/// Element `i` of the flattened segments lies in block `r` for `first(r) <= i < first(r + 1)`.
fn first(count: usize, n: usize, r: usize) -> usize {
    // u128: count * r may pass usize on 32-bit hosts; exact either way.
    (count as u128 * r as u128 / n as u128) as usize
}

/// Copies elements `[from, to)` of the segments' flattened contribution `k` to `dst` (`k`
/// None: the other way, from `dst` into every contribution).
///
/// # Safety
/// Every pointer holds its segment's elements; `dst` the range's.
unsafe fn copy_range(
    segments: &[Segment<'_>],
    size: usize,
    (from, to): (usize, usize),
    k: Option<usize>,
    dst: *mut u8,
) {
    let mut at = 0;
    for s in segments {
        let (a, b) = (from.max(at), to.min(at + s.count));
        if a < b {
            let bytes = (b - a) * size;
            let buf = dst.add((a - from) * size);
            match k {
                Some(k) => std::ptr::copy_nonoverlapping(
                    (s.ptrs[k] as *const u8).add((a - at) * size),
                    buf,
                    bytes,
                ),
                None => {
                    for &p in s.ptrs {
                        std::ptr::copy_nonoverlapping(
                            buf,
                            (p as *mut u8).add((a - at) * size),
                            bytes,
                        );
                    }
                }
            }
        }
        at += s.count;
    }
}

impl Engine {
    /// Whether [`Engine::alltoall_reproducible`] takes this bucket: F32 or F64, every segment
    /// with the same contributions, and the exchange's counts within MPI's C int. Alike on
    /// every rank where exec hands every rank the same number of contributions.
    pub(super) fn alltoall_takes(&self, dtype: DType, segments: &[Segment<'_>]) -> bool {
        let k = segments.first().map_or(0, |s| s.ptrs.len());
        let count: usize = segments.iter().map(|s| s.count).sum();
        matches!(dtype, DType::F32 | DType::F64)
            && k > 0
            && segments.iter().all(|s| s.ptrs.len() == k)
            && (k * count).saturating_mul(self.size) < c_int::MAX as usize
    }

    /// Every contribution of every segment := the reproducible sum over every rank's
    /// contributions, divided by `avg`: the all-to-all to the blocks' owners, their sums, the
    /// allgather back, chunk by chunk ([`chunk_of`]: each chunk's stages stay in cache, and
    /// the next chunk's exchange is in flight while one is summed or copied out). Staged in
    /// the engine's scratch (a timed-out request may still use it: then it is leaked, never
    /// the caller's memory).
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`](crate::backend::Ranks::allreduce); every pointer writable.
    pub(super) unsafe fn alltoall_reproducible(
        &self,
        channel: Channel,
        dtype: DType,
        segments: &[Segment<'_>],
        avg: Option<usize>,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let k = segments[0].ptrs.len();
        let count: usize = segments.iter().map(|s| s.count).sum();
        if count == 0 {
            return Ok(());
        }
        let (datatype, size) = mpi_type(dtype);
        let ch = chunk_of(size, k, n);
        let chunks = count.div_ceil(ch);
        // Chunk c: elements [c ch, c ch + width(c)); rank r owns [first(w, n, r), first(w, n, r + 1)) of it.
        let width = |c: usize| ch.min(count - c * ch);
        let len = |w: usize, r: usize| first(w, n, r + 1) - first(w, n, r);
        let most = ch.div_ceil(n);
        let slot = |bytes: usize| bytes.next_multiple_of(64);
        let (send_slot, recv_slot) = (slot(k * ch * size), slot(n * k * most * size));
        let gather_slot = slot(ch * size);
        let sums_bytes = slot(chunks * most * size);
        let mut scratch = self.scratch.lock();
        let total = DEPTH * (send_slot + recv_slot + gather_slot) + sums_bytes;
        let base = stage(&mut scratch, total);
        let send = |c: usize| base.add((c % DEPTH) * send_slot);
        let recv = |c: usize| base.add(DEPTH * send_slot + (c % DEPTH) * recv_slot);
        let gather =
            |c: usize| base.add(DEPTH * (send_slot + recv_slot) + (c % DEPTH) * gather_slot);
        let sums =
            |c: usize| base.add(DEPTH * (send_slot + recv_slot + gather_slot) + c * most * size);
        let comm = self.comm_of(channel);
        // Per chunk, the counts and displacements of its exchange and of its gather: MPI may
        // read them until each call completes (MPI 3.1 §5.12), so they live as long as the
        // scratch. This rank's own block stays out of the exchange (counts 0): the owner reads
        // its own contributions straight from the tensors.
        let counts: Vec<[Vec<c_int>; 6]> = (0..chunks)
            .map(|c| {
                let w = width(c);
                let of = |f: &dyn Fn(usize) -> usize| (0..n).map(|r| count_of(f(r))).collect();
                let mine = len(w, me);
                let others = |v: usize| move |r: usize| if r == me { 0 } else { v };
                [
                    of(&|r| others(k * len(w, r))(r)),
                    of(&|r| k * first(w, n, r)),
                    of(&|r| others(k * mine)(r)),
                    of(&|r| r * k * mine),
                    of(&|r| len(w, r)),
                    of(&|r| first(w, n, r)),
                ]
            })
            .collect();
        let exchanged = self.run_pieces(
            "MPI_Ialltoallv",
            chunks,
            |c, request| {
                let (at, w) = (c * ch, width(c));
                // Block r of the stage: every contribution's elements of block r, one after another.
                for r in (0..n).filter(|&r| r != me) {
                    let (a, b) = (first(w, n, r), first(w, n, r + 1));
                    for j in 0..k {
                        let to = send(c).add((k * a + j * (b - a)) * size);
                        copy_range(segments, size, (at + a, at + b), Some(j), to);
                    }
                }
                let [sc, sd, rc, rd, _, _] = &counts[c];
                ffi::MPI_Ialltoallv(
                    send(c).cast(),
                    sc.as_ptr(),
                    sd.as_ptr(),
                    datatype,
                    recv(c).cast(),
                    rc.as_ptr(),
                    rd.as_ptr(),
                    datatype,
                    comm,
                    request,
                )
            },
            |c| {
                let w = width(c);
                let (a, mine) = (c * ch + first(w, n, me), len(w, me));
                // The others' contributions from the stage, this rank's from its tensors, a
                // segment's run at a time (a tensor pointer holds one segment); the sum is
                // written over the first other rank's first contribution, then kept.
                let other = usize::from(me == 0);
                let recv_at = |r: usize, j: usize, p: usize| {
                    recv(c) as usize + ((r * k + j) * mine + p) * size
                };
                let mut at = 0;
                for seg in segments {
                    let (lo, hi) = (a.max(at), (a + mine).min(at + seg.count));
                    if lo < hi {
                        let (p, l) = (lo - a, hi - lo);
                        let ptrs: Vec<usize> = (0..n)
                            .flat_map(|r| (0..k).map(move |j| (r, j)))
                            .map(|(r, j)| match r == me {
                                true => seg.ptrs[j] + (lo - at) * size,
                                false => recv_at(r, j, p),
                            })
                            .collect();
                        // Alone in the world, over its own first contribution (the gather
                        // writes every one of them afterwards anyway).
                        let write = if n > 1 { other * k } else { 0 };
                        repro::reduce_ptrs(dtype, &ptrs, write, l, avg);
                        let sum = ptrs[write] as *const u8;
                        std::ptr::copy_nonoverlapping(sum, sums(c).add(p * size), l * size);
                    }
                    at += seg.count;
                }
            },
        );
        if let Err(e) = exchanged {
            std::mem::forget(std::mem::take(&mut *scratch));
            std::mem::forget(counts);
            return Err(e);
        }
        let gathered = self.run_pieces(
            "MPI_Iallgatherv",
            chunks,
            |c, request| {
                let [_, _, _, _, gc, gd] = &counts[c];
                ffi::MPI_Iallgatherv(
                    sums(c).cast(),
                    count_of(len(width(c), me)),
                    datatype,
                    gather(c).cast(),
                    gc.as_ptr(),
                    gd.as_ptr(),
                    datatype,
                    comm,
                    request,
                )
            },
            |c| copy_range(segments, size, (c * ch, c * ch + width(c)), None, gather(c)),
        );
        if let Err(e) = gathered {
            std::mem::forget(std::mem::take(&mut *scratch));
            std::mem::forget(counts);
            return Err(e);
        }
        Ok(())
    }
}

/// Elements per chunk of [`Engine::alltoall_reproducible`]: about a [`PIECE`] of every local
/// contribution together (the stages of two chunks in flight then fit in this VM's L2), at
/// least one element per rank.
fn chunk_of(size: usize, k: usize, n: usize) -> usize {
    (PIECE / size / k.max(1)).max(n)
}
