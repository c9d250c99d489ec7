//! The reproducible sum where the ring's shared-memory route cannot carry it (no shared memory,
//! or several contributions per rank): every element's contributions travel raw to the rank
//! that owns its block (one all-to-all), the owner sums them with the host's reproducible
//! arithmetic (backend/host/repro.rs: the same bytes for any number and order of
//! contributions), divides, and the sums travel back (one allgather). The plain allreduce's
//! bytes per contribution, where the exponents' maximum then the integers' sum move 2.25x.

use std::ffi::c_int;

use mpi::ffi;

use super::calls::count_of;
use super::pieces::stage;
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
    /// allgather back. Staged in the engine's scratch (a timed-out request may still use it:
    /// then it is leaked, never the caller's memory).
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
        let len = |r: usize| first(count, n, r + 1) - first(count, n, r);
        let mine = len(me);
        let send_bytes = (k * count * size).next_multiple_of(64);
        let recv_bytes = (n * k * mine * size).next_multiple_of(64);
        let mut scratch = self.scratch.lock();
        let base = stage(&mut scratch, send_bytes + recv_bytes + count * size);
        let (send, recv, sums) = (
            base,
            base.add(send_bytes),
            base.add(send_bytes + recv_bytes),
        );
        // Block r of the send buffer: every contribution's elements of block r, one after another.
        for r in 0..n {
            let (a, b) = (first(count, n, r), first(count, n, r + 1));
            for c in 0..k {
                copy_range(
                    segments,
                    size,
                    (a, b),
                    Some(c),
                    send.add((k * a + c * (b - a)) * size),
                );
            }
        }
        let send_counts: Vec<c_int> = (0..n).map(|r| count_of(k * len(r))).collect();
        let send_displs: Vec<c_int> = (0..n).map(|r| count_of(k * first(count, n, r))).collect();
        let recv_counts: Vec<c_int> = vec![count_of(k * mine); n];
        let recv_displs: Vec<c_int> = (0..n).map(|r| count_of(r * k * mine)).collect();
        let comm = self.comm_of(channel);
        self.run("MPI_Ialltoallv", |request| {
            ffi::MPI_Ialltoallv(
                send.cast(),
                send_counts.as_ptr(),
                send_displs.as_ptr(),
                datatype,
                recv.cast(),
                recv_counts.as_ptr(),
                recv_displs.as_ptr(),
                datatype,
                comm,
                request,
            )
        })
        .inspect_err(|_| std::mem::forget(std::mem::take(&mut *scratch)))?;
        if mine > 0 {
            let ptrs: Vec<usize> = (0..n * k)
                .map(|j| recv as usize + j * mine * size)
                .collect();
            repro::reduce_ptrs(dtype, &ptrs, 0, mine, avg);
        }
        let counts: Vec<c_int> = (0..n).map(|r| count_of(len(r))).collect();
        let displs: Vec<c_int> = (0..n).map(|r| count_of(first(count, n, r))).collect();
        self.run("MPI_Iallgatherv", |request| {
            ffi::MPI_Iallgatherv(
                recv.cast(),
                count_of(mine),
                datatype,
                sums.cast(),
                counts.as_ptr(),
                displs.as_ptr(),
                datatype,
                comm,
                request,
            )
        })
        .inspect_err(|_| std::mem::forget(std::mem::take(&mut *scratch)))?;
        copy_range(segments, size, (0, count), None, sums);
        Ok(())
    }
}
