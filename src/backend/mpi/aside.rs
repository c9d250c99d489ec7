//! Early results written into the gradients before their step agreed, the gradients' original
//! bytes kept aside ([`Aside`]) and put back if the step fails.
//!
//! Why: a bucket started by `dpsync_grad_ready` used to hold its result until the step's
//! agreement, then copy it into the gradients. That copy (25–28 ms for ResNet-50's 100 MB on
//! the 2-core VM with one replica, 23 ms with two) came after the slowest rank's backward, so
//! a marked step gained little over an unmarked one. Written as the pieces complete, it moves
//! into backward; saving the originals is a copy made while backward runs too, with
//! non-temporal stores (the copy is read again only if the step fails).
//!
//! For a bucket whose step is expected to be an allreduce (the last step was one), each local
//! replica's output saved at its own place (output `k` at `k * count` elements):
//! - a step that agrees takes the results as they are (nothing left to copy);
//! - a step refused on every rank, or drained, puts the originals back ([`Aside::restore`]);
//! - any other collective's agreement while the bucket is in flight stops the early writes
//!   and puts the originals back ([`Queue::hold`](super::steps::Queue)): a refused call
//!   changes nothing, and the held result is written when the step agrees, as without this;
//! - a reduce-scatter step after all: the originals are put back, then the owned elements
//!   written from the held result (which the pieces fill as well).

use super::alltoall::first;
use super::pieces::Walk;
use super::staging::{copy_spans, Way};
use crate::types::DType;

/// The original bytes of a bucket's outputs, saved piece by piece as pieces are issued.
pub(super) struct Aside {
    /// `outputs * count * dtype.size()` bytes (words: from the engine's spare stages).
    pub(super) bytes: Vec<u64>,
    /// Per output, its byte spans `(ptr, bytes)`, segment after segment.
    spans: Vec<Vec<(usize, usize)>>,
    size: usize,
    count: usize,
    walks: Vec<Walk>,
    /// Elements `[0, saved)` are saved,
    saved: usize,
    /// and these `(start, n)`, saved out of order by a whole bucket's pieces (`whole.rs`).
    ranges: Vec<(usize, usize)>,
    /// Results are still written into the outputs as the pieces complete.
    pub(super) live: bool,
    /// The outputs may differ from the originals over what was saved.
    dirty: bool,
    /// Saved by an exchange in its layout (`alltoall.rs`), across this many ranks.
    exchange: Option<usize>,
}

impl Aside {
    /// For the outputs, each `(ptr, count)` per segment of `dtype` over `count` elements, into
    /// `bytes` (at least the outputs' together).
    pub(super) fn new(
        dtype: DType,
        outs: &[Vec<(usize, usize)>],
        count: usize,
        bytes: Vec<u64>,
    ) -> Aside {
        let size = dtype.size();
        Aside {
            bytes,
            spans: (outs.iter())
                .map(|out| out.iter().map(|&(p, n)| (p, n * size)).collect())
                .collect(),
            size,
            count,
            walks: outs.iter().map(|_| Walk::default()).collect(),
            saved: 0,
            ranges: Vec::new(),
            live: true,
            dirty: false,
            exchange: None,
        }
    }

    /// The originals are saved by an exchange across `n` ranks, each chunk as it sends it:
    /// the chunk of elements `[at, at + w)` at `at * outputs` elements on, rank `r`'s block
    /// of it (`alltoall::first`: its `a`, `l`) at `outputs * a` on, output `k`'s part at
    /// `k * l` on. Its ranges ([`Aside::saved`]) are whole chunks, `(at, w)`.
    pub(super) fn exchanged(&mut self, n: usize) {
        self.exchange = Some(n);
    }

    pub(super) fn outputs(&self) -> usize {
        self.spans.len()
    }

    /// Where output `k`'s element `e` is saved.
    fn at(&mut self, k: usize, e: usize) -> *mut u8 {
        // SAFETY: within the outputs' bytes.
        unsafe {
            self.bytes
                .as_mut_ptr()
                .cast::<u8>()
                .add((k * self.count + e) * self.size)
        }
    }

    /// Saves elements `[start, start + n)` of every output before results may be written
    /// there (ranges come in ascending order), and marks the outputs as about to change.
    ///
    /// # Safety
    /// The outputs are valid.
    pub(super) unsafe fn save(&mut self, (start, n): (usize, usize)) {
        if !self.live || start + n <= self.saved {
            return;
        }
        let range = (start * self.size, n * self.size);
        for k in 0..self.spans.len() {
            let to = self.at(k, start);
            copy_spans((&self.spans[k], &mut self.walks[k]), range, to, Way::Keep);
        }
        self.saved = start + n;
        self.dirty = true;
    }

    /// Where elements `[start, start + n)` of the one output are saved, for the caller to
    /// stage the originals there itself (in the dtype); counted as saved.
    pub(super) fn stage(&mut self, (start, n): (usize, usize)) -> *mut u8 {
        debug_assert!(self.live && start == self.saved, "pieces in order");
        debug_assert_eq!(self.spans.len(), 1, "one output");
        self.saved = start + n;
        self.dirty = true;
        self.at(0, start)
    }

    /// Where a whole bucket's pieces save the originals themselves, output `k`'s element `e`
    /// at `(k * count + e) * size` bytes on ([`Aside::saved`] then counts them).
    pub(super) fn base(&mut self) -> *mut u8 {
        self.at(0, 0)
    }

    /// Elements a whole bucket saved at [`Aside::base`] (of every output), in any order.
    pub(super) fn saved(&mut self, ranges: Vec<(usize, usize)>) {
        self.dirty |= !ranges.is_empty();
        self.ranges.extend(ranges);
    }

    /// The originals back over everything saved, once; the early writes stop.
    ///
    /// # Safety
    /// The outputs are valid, and no transfer writes them meanwhile.
    pub(super) unsafe fn restore(&mut self) {
        self.live = false;
        if !self.dirty {
            return;
        }
        if let Some(n) = self.exchange {
            return self.restore_exchanged(n);
        }
        let way = Way::Out { streaming: false };
        let mut ranges = std::mem::take(&mut self.ranges);
        ranges.push((0, self.saved));
        ranges.sort_unstable();
        for k in 0..self.spans.len() {
            let from = self.at(k, 0);
            let walk = &mut Walk::default();
            for &(start, n) in ranges.iter().filter(|r| r.1 > 0) {
                let range = (start * self.size, n * self.size);
                copy_spans((&self.spans[k], walk), range, from.add(range.0), way);
            }
        }
        self.dirty = false;
    }

    /// [`Aside::restore`] of what an exchange saved ([`Aside::exchanged`]).
    unsafe fn restore_exchanged(&mut self, n: usize) {
        let way = Way::Out { streaming: false };
        let mut ranges = std::mem::take(&mut self.ranges);
        ranges.sort_unstable();
        let outputs = self.spans.len();
        let base = self.at(0, 0);
        for k in 0..outputs {
            let walk = &mut Walk::default();
            for &(at, w) in &ranges {
                for r in 0..n {
                    let (a, b) = (first(w, n, r), first(w, n, r + 1));
                    let from = base.add((outputs * (at + a) + k * (b - a)) * self.size);
                    let range = ((at + a) * self.size, (b - a) * self.size);
                    copy_spans((&self.spans[k], walk), range, from, way);
                }
            }
        }
        self.dirty = false;
    }
}
