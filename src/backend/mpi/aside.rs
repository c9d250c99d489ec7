//! Early results written into the gradients before their step agreed, the gradients' original
//! bytes kept aside ([`Aside`]) and put back if the step fails.
//!
//! Why: a bucket started by `dpsync_grad_ready` used to hold its result until the step's
//! agreement, then copy it into the gradients. That copy (25–28 ms for ResNet-50's 100 MB on
//! the 2-core VM) came after the slowest rank's backward, so with one replica per rank a
//! marked step was no faster than an unmarked one. Written as the pieces complete, it moves
//! into backward; saving the originals is a copy made while backward runs too.
//!
//! Only for a bucket of one local replica (its output is its input: the originals are what
//! the pieces read) whose step is expected to be an allreduce (the last step was one):
//! - a step that agrees takes the results as they are (nothing left to copy);
//! - a step refused on every rank, or drained, puts the originals back ([`Aside::restore`]);
//! - any other collective's agreement while the bucket is in flight stops the early writes
//!   and puts the originals back ([`Queue::hold`](super::steps::Queue)): a refused call
//!   changes nothing, and the held result is written when the step agrees, as without this;
//! - a reduce-scatter step after all: the originals are put back, then the owned elements
//!   written from the held result (which the pieces fill as well).

use super::pieces::Walk;
use super::staging::{copy_spans, Way};
use crate::types::DType;

/// The original bytes of a bucket's one output, saved piece by piece as pieces are issued.
pub(super) struct Aside {
    /// `count * dtype.size()` bytes (words: from the engine's spare stages).
    pub(super) bytes: Vec<u64>,
    /// The output as byte spans `(ptr, bytes)`, segment after segment.
    spans: Vec<(usize, usize)>,
    size: usize,
    walk: Walk,
    /// Elements `[0, saved)` are saved,
    saved: usize,
    /// and these `(start, n)`, saved out of order by a whole bucket's pieces (`whole.rs`).
    ranges: Vec<(usize, usize)>,
    /// Results are still written into the output as the pieces complete.
    pub(super) live: bool,
    /// The output may differ from the originals over `[0, saved)`.
    dirty: bool,
}

impl Aside {
    /// For the output `(ptr, count)` per segment of `dtype`, into `bytes` (at least the
    /// bucket's).
    pub(super) fn new(dtype: DType, out: &[(usize, usize)], bytes: Vec<u64>) -> Aside {
        let size = dtype.size();
        Aside {
            bytes,
            spans: out.iter().map(|&(p, n)| (p, n * size)).collect(),
            size,
            walk: Walk::default(),
            saved: 0,
            ranges: Vec::new(),
            live: true,
            dirty: false,
        }
    }

    /// Saves elements `[start, start + n)` before results may be written there (ranges come
    /// in ascending order), and marks the output as about to change.
    ///
    /// # Safety
    /// The output is valid.
    pub(super) unsafe fn save(&mut self, (start, n): (usize, usize)) {
        if !self.live || start + n <= self.saved {
            return;
        }
        let to = self.bytes.as_mut_ptr().cast::<u8>().add(start * self.size);
        let range = (start * self.size, n * self.size);
        copy_spans((&self.spans, &mut self.walk), range, to, Way::In);
        self.saved = start + n;
        self.dirty = true;
    }

    /// Where elements `[start, start + n)` are saved, for the caller to stage the originals
    /// there itself (in the dtype); counted as saved.
    pub(super) fn stage(&mut self, (start, n): (usize, usize)) -> *mut u8 {
        debug_assert!(self.live && start == self.saved, "pieces in order");
        self.saved = start + n;
        self.dirty = true;
        // SAFETY: within the bucket's bytes.
        unsafe { self.bytes.as_mut_ptr().cast::<u8>().add(start * self.size) }
    }

    /// Where a whole bucket's pieces save the originals themselves, element `e` at
    /// `e * size` bytes on ([`Aside::saved`] then counts them).
    pub(super) fn base(&mut self) -> *mut u8 {
        self.bytes.as_mut_ptr().cast()
    }

    /// Elements a whole bucket saved at [`Aside::base`], in any order.
    pub(super) fn saved(&mut self, ranges: Vec<(usize, usize)>) {
        self.dirty |= !ranges.is_empty();
        self.ranges.extend(ranges);
    }

    /// The originals back over everything saved, once; the early writes stop.
    ///
    /// # Safety
    /// The output is valid, and no transfer writes it meanwhile.
    pub(super) unsafe fn restore(&mut self) {
        self.live = false;
        if !self.dirty {
            return;
        }
        let from = self.bytes.as_mut_ptr().cast::<u8>();
        let way = Way::Out { streaming: false };
        let mut ranges = std::mem::take(&mut self.ranges);
        ranges.push((0, self.saved));
        ranges.sort_unstable();
        let walk = &mut Walk::default();
        for (start, n) in ranges.into_iter().filter(|r| r.1 > 0) {
            let range = (start * self.size, n * self.size);
            copy_spans((&self.spans, walk), range, from.add(range.0), way);
        }
        self.dirty = false;
    }
}
