//! What the steps queue writes before its step agrees and when it does: an exchanged
//! bucket's chunks written early as they land, the step's release (its outputs from then on,
//! a reduce-scatter's owned pieces), and early writes stopped and put back.

use std::sync::atomic::Ordering;

use super::{segments, Crossing, Handle, Item, Queue, Transfer};
use crate::backend::mpi::pieces::Walk;
use crate::backend::mpi::staging::{copy_out, mpi_type, only_owned, stage_in, stage_out};

impl Item {
    /// Elements `[start, end)` of `held` just landed (an exchange's, which saved their
    /// originals): written into every output too while the early writes are live (the step
    /// expected to agree, the ticket kept). Ranges come in ascending order.
    ///
    /// # Safety
    /// The outputs are valid.
    pub(super) unsafe fn write_early(
        &mut self,
        (start, end): (usize, usize),
        saved: Vec<(usize, usize)>,
    ) {
        let Some(aside) = self.aside.as_mut() else {
            return;
        };
        aside.saved(saved);
        if end <= start || !aside.live || self.abandoned.load(Ordering::Relaxed) {
            return;
        }
        let range = (start, end - start);
        let mut walks = std::mem::take(&mut self.walk_out);
        walks.resize_with(self.outs.len(), Walk::default);
        for (out, walk) in self.outs.iter().zip(walks.iter_mut()) {
            self.write_held((out, walk), range);
        }
        self.walk_out = walks;
    }

    /// Elements `(start, n)` of `held` into the outputs `out` (their walk): an exchange's
    /// sums are in the dtype's own bytes and divided already, other crossings' in MPI's type
    /// (f16 and bf16 widened) and divided as they go out.
    ///
    /// # Safety
    /// The outputs are valid.
    pub(in crate::backend::mpi) unsafe fn write_held(
        &self,
        (out, walk): (&[(usize, usize)], &mut Walk),
        (start, n): (usize, usize),
    ) {
        let exchanged = matches!(self.crossing, Crossing::Exchange { .. });
        let size = if exchanged {
            self.dtype.size()
        } else {
            mpi_type(self.dtype).1
        };
        let from = self.held.as_ptr().cast::<u8>().add(start * size);
        match exchanged {
            true => copy_out(self.dtype, from, (out, walk), (start, n)),
            false => stage_out(self.dtype, from, (out, walk), (start, n), self.avg),
        }
    }
}

impl Queue {
    /// The step agreed: the pieces of `handle`'s bucket not yet issued are written straight
    /// into its outputs as they complete. Once per item: a second release would take the
    /// pieces written directly since the first for held ones.
    ///
    /// With `owned` (the first release only), only each segment's elements `owned[s]` are
    /// written: the step is a reduce-scatter.
    pub(in crate::backend::mpi) fn release(
        &mut self,
        handle: &Handle,
        owned: Option<&[(usize, usize)]>,
    ) {
        if owned.is_some() {
            // A reduce-scatter step after all: what was written early goes back first.
            self.stop_early(Some(handle.seq));
        }
        if let Some(item) = self.item(handle.seq) {
            if let (None, Some(owned)) = (item.direct_from, owned) {
                // Nothing is written as it was: the outputs change before the next piece goes
                // out, and the held results go to them at the finish.
                let inputs = item.inputs.iter().map(|(ptrs, count)| (&ptrs[..], *count));
                item.outs = vec![only_owned(item.dtype, inputs, owned)];
                item.walk_out.clear();
            }
            // A whole bucket goes straight into the outputs only if released before it went;
            // an exchange's result is held (and copied out at the finish).
            let direct = match item.crossing {
                Crossing::Pieces => true,
                Crossing::Whole { .. } => item.issued == 0,
                Crossing::Exchange { .. } => false,
            };
            if direct {
                item.direct_from.get_or_insert(item.issued);
            }
        }
    }

    /// Early writes into the outputs stop (of item `seq`, or of every item), the originals put
    /// back (`aside.rs`): the results are held until the step agrees, as without them.
    pub(in crate::backend::mpi) fn stop_early(&mut self, seq: Option<u64>) {
        let of = |s: u64| seq.is_none_or(|q| q == s);
        for (s, _, transfer) in self.inflight.iter_mut() {
            let saved = match (of(*s), transfer) {
                (true, Transfer::Whole(whole)) => whole.stop_early(),
                (true, Transfer::Exchange(exchange)) => exchange.stop_saving(),
                _ => continue,
            };
            let item = self.items.iter_mut().find(|i| i.seq == *s);
            if let Some(aside) = item.and_then(|i| i.aside.as_mut()) {
                aside.saved(saved);
            }
        }
        for item in self.items.iter_mut().filter(|i| of(i.seq)) {
            let live = item.aside.as_ref().is_some_and(|a| a.live);
            let whole = matches!(item.crossing, Crossing::Whole { .. });
            if live && whole && item.direct_from.is_none() && item.issued > 0 {
                // Its sums are all in the outputs so far (this rank's in `held` too), and
                // `held` is where the rest will go: the first output's into it first.
                let segments = segments(&item.inputs, true);
                let held = item.held.as_mut_ptr().cast::<u8>();
                // SAFETY: the input is valid; `held` holds the bucket.
                unsafe {
                    stage_in(
                        item.dtype,
                        &segments,
                        &mut Walk::default(),
                        (0, item.count),
                        held,
                    )
                };
            }
            match (item.aside.as_mut(), item.abandoned.load(Ordering::Relaxed)) {
                // SAFETY: no transfer writes the output any more (above, and `live` off).
                (Some(aside), false) => unsafe { aside.restore() },
                // Dropped: the caller's memory is not touched any more.
                (Some(aside), true) => aside.live = false,
                (None, _) => {}
            }
        }
    }
}
