//! Nothing half-written after a loss: in an elastic world, the bytes a collective may write in
//! PARAM, STATE and COMPUTED tensors (and BMUF's own state) are copied aside once its agreement
//! passed, before any of them moves, and put back where the call answers RANK_LOST. A rank may
//! die while some survivors already wrote their results and others did not; the vote makes
//! every survivor answer alike, and this makes their bytes alike: unchanged everywhere. GRAD
//! tensors are not kept (the contract has the caller compute them again). Plain worlds copy
//! nothing.

use super::Context;
use crate::registry::TensorView;
use crate::types::{Memory, Role};

/// Host bytes copied aside: `(address, bytes)` as they were before the call.
#[derive(Default)]
pub(super) struct Undo {
    regions: Vec<(usize, Vec<u8>)>,
}

impl Context {
    /// Whether this context keeps bytes aside: an elastic world of host replicas.
    fn keeps_undo(&self) -> bool {
        self.options.elastic > 0 && self.in_world() && !self.options.has_cuda_replicas()
    }

    /// Copies aside the bytes of `tensors` (every replica's) a collective may write, but GRAD
    /// tensors' (called once the call's agreement passed, before its data moves).
    pub(super) fn keep_written(&self, tensors: &[&TensorView]) {
        if !self.keeps_undo() {
            return;
        }
        let regions = tensors
            .iter()
            .filter(|t| t.role != Role::Grad && t.memory == Memory::Host)
            .flat_map(|t| t.ptrs.iter().map(|&p| (p, t.count * t.dtype.size())));
        self.keep_regions(regions);
    }

    /// Copies aside host memory the call may write: `(address, bytes)`.
    pub(super) fn keep_regions(&self, regions: impl Iterator<Item = (usize, usize)>) {
        if !self.keeps_undo() {
            return;
        }
        let mut undo = self.membership.undo.lock();
        for (ptr, bytes) in regions {
            if bytes == 0 {
                continue;
            }
            // SAFETY: registered memory (and BMUF's own allocations) stays valid while
            // registered (the C contract); `bytes` is within it.
            let copy = unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) }.to_vec();
            undo.regions.push((ptr, copy));
        }
    }

    /// Forgets what was kept (the call completed, or answered without a loss).
    pub(super) fn forget_undo(&self) {
        self.membership.undo.lock().regions.clear();
    }

    /// Puts back what was kept, latest first (a region kept twice ends as first kept).
    pub(super) fn undo_written(&self) {
        let regions = std::mem::take(&mut self.membership.undo.lock().regions);
        for (ptr, copy) in regions.into_iter().rev() {
            // SAFETY: as in keep_regions; nothing else writes the memory now (the call
            // returned, its engine failed).
            unsafe { std::ptr::copy_nonoverlapping(copy.as_ptr(), ptr as *mut u8, copy.len()) };
        }
    }
}
