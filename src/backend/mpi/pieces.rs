//! Transfers in cache-sized pieces: a large transfer goes as a few small non-blocking calls in
//! flight, each piece staged in just before its call and out as soon as it completes, so that
//! its bytes are still in cache both times. The waited transfers, the ring and the steps queue
//! cut and walk their buckets the same way.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::mem::MaybeUninit;

use mpi::ffi;

use super::calls::check;
use super::poll::poll;
use super::Engine;
use crate::error::Result;

/// Bytes per non-blocking call of a large transfer, and how many are in flight at once. A
/// waited transfer's pieces go through [`DEPTH`] stages of this size, each staged in just before
/// its call and out as soon as it completes, so that they stay in cache: Open MPI moved a
/// 100 MB allreduce this way more than twice as fast as through stages of the whole buffer, and
/// faster than its blocking allreduce in pieces. 512 KiB × 2 (1 MiB in flight, this VM's L2)
/// measured best of 128 KiB..1 MiB × 1..8 (docs/PERFORMANCE.md). Also keeps counts in C ints.
pub(super) const PIECE: usize = 512 << 10;
pub(super) const DEPTH: usize = 2;

/// Elements per piece of a large allreduce ([`PIECE`] bytes).
pub(super) fn piece_of(size: usize) -> usize {
    (PIECE / size).max(1)
}

/// A position in spans laid end to end (a bucket's segments, a broadcast's spans), moved
/// forward range after range: a waited transfer stages its pieces in order, and out in order.
#[derive(Default)]
pub(super) struct Walk {
    /// The first span the next range may touch, and the elements before it.
    span: usize,
    before: usize,
}

impl Walk {
    /// `f(span, offset in it, length, offset in the range)` for every span's part of
    /// `[start, start + n)` of `lengths` laid end to end; `start` never goes back.
    pub(super) fn parts(
        &mut self,
        lengths: impl Fn(usize) -> usize,
        spans: usize,
        (start, n): (usize, usize),
        mut f: impl FnMut(usize, usize, usize, usize),
    ) {
        while self.span < spans && self.before + lengths(self.span) <= start {
            self.before += lengths(self.span);
            self.span += 1;
        }
        let (mut k, mut before, end) = (self.span, self.before, start + n);
        while k < spans && before < end {
            let (from, to) = (start.max(before), end.min(before + lengths(k)));
            if to > from {
                f(k, from - before, to - from, from - start);
            }
            before += lengths(k);
            k += 1;
        }
    }
}

/// `words` grown to at least `bytes` bytes; its first byte.
pub(super) fn stage(words: &mut Vec<u64>, bytes: usize) -> *mut u8 {
    let n = bytes.div_ceil(8);
    if words.len() < n {
        words.resize(n, 0);
    }
    words.as_mut_ptr().cast()
}

impl Engine {
    /// Issues one non-blocking call and waits for it; a failure fails the world.
    pub(super) fn run(
        &self,
        what: &str,
        mut issue: impl FnMut(*mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        self.run_pieces(what, 1, |_, request| issue(request), |_| {})
    }

    /// Issues `pieces` non-blocking calls in order, at most [`DEPTH`] in flight, and waits for
    /// all of them within one timeout, calling `done(i)` as piece `i` completes (in order: a
    /// piece's stage, `i % DEPTH`, is free again once `done` returns); a failure fails the
    /// world.
    pub(super) fn run_pieces(
        &self,
        what: &str,
        pieces: usize,
        mut issue: impl FnMut(usize, *mut ffi::MPI_Request) -> c_int,
        mut done: impl FnMut(usize),
    ) -> Result<()> {
        let mut since = None;
        let mut inflight: VecDeque<(usize, ffi::MPI_Request)> = VecDeque::with_capacity(DEPTH);
        let mut all = || -> Result<()> {
            for piece in 0..pieces {
                if inflight.len() == DEPTH {
                    let (i, mut oldest) = inflight.pop_front().expect("DEPTH > 0");
                    poll(
                        std::slice::from_mut(&mut oldest),
                        &mut since,
                        self.timeout,
                        what,
                    )?;
                    done(i);
                }
                let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
                check(what, issue(piece, request.as_mut_ptr()))?;
                // SAFETY: the call succeeded, so it wrote the request.
                inflight.push_back((piece, unsafe { request.assume_init() }));
            }
            while let Some((i, mut request)) = inflight.pop_front() {
                poll(
                    std::slice::from_mut(&mut request),
                    &mut since,
                    self.timeout,
                    what,
                )?;
                done(i);
            }
            Ok(())
        };
        all().map_err(|e| self.failing(e))
    }
}
