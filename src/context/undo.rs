//! Nothing half-written after a loss: in an elastic world, the bytes a collective may write in
//! PARAM, STATE and COMPUTED tensors (and BMUF's own state) are copied aside once its agreement
//! passed, before any of them moves, and put back where the call answers RANK_LOST. A rank may
//! die while some survivors already wrote their results and others did not; the vote makes
//! every survivor answer alike, and this makes their bytes alike: unchanged everywhere. GRAD
//! tensors are not kept (the contract has the caller compute them again). Plain worlds copy
//! nothing.
//!
//! Sparse gathers' outputs are library-owned and new each step: nothing is copied, the previous
//! step's outputs (and the slices the step consumed) are only kept alive until the vote instead
//! of being retired at once, and on a loss they are swapped back and the new ones retired, so
//! `dpsync_sparse_get` answers what it answered before the call, on host and CUDA replicas alike.
//!
//! On CUDA replicas the copy waits for the work the callers queued before the call (it may be
//! what writes those bytes), then device memory is copied to the host on the backend's streams
//! and waited for; after a loss the backend's failure is forgotten (`Streams::recover`: the
//! failure was the world's, not the devices') and the bytes are copied back the same way.

use super::Context;
use crate::error::Result;
use crate::exec::SparseOutputs;
use crate::log;
use crate::registry::sparse::ConsumedSlices;
use crate::registry::TensorView;
use crate::types::{Memory, Role};

/// One region as it was before the call.
struct Kept {
    replica: usize,
    ptr: usize,
    memory: Memory,
    copy: Vec<u8>,
}

/// Bytes copied aside.
#[derive(Default)]
pub(super) struct Undo {
    regions: Vec<Kept>,
    /// The sparse outputs from before a step that completed here, and the slices it consumed.
    sparse: Option<(SparseOutputs, ConsumedSlices)>,
}

impl Context {
    /// Whether this context keeps bytes aside: an elastic world.
    pub(super) fn keeps_undo(&self) -> bool {
        self.options.elastic > 0 && self.in_world()
    }

    /// Copies aside the bytes of `tensors` (every replica's) a collective may write, but GRAD
    /// tensors' (called once the call's agreement passed, before its data moves).
    pub(super) fn keep_written(&self, tensors: &[&TensorView]) {
        if !self.keeps_undo() {
            return;
        }
        let regions = (tensors.iter().filter(|t| t.role != Role::Grad)).flat_map(|t| {
            let bytes = t.count * t.dtype.size();
            (t.ptrs.iter().enumerate()).map(move |(k, &p)| (k, p, bytes, t.memory))
        });
        self.keep_regions(regions.collect());
    }

    /// Copies aside memory the call may write: `(replica, address, bytes, memory)`. Where the
    /// copy fails (a device fault or a timeout on CUDA replicas) the backend is failed, so the
    /// call fails too: its bytes could not be promised.
    pub(super) fn keep_regions(&self, regions: Vec<(usize, usize, usize, Memory)>) {
        if !self.keeps_undo() || regions.iter().all(|r| r.2 == 0) {
            return;
        }
        if let Err(e) = self.copy_aside(regions) {
            log::warn(|| {
                format!(
                    "an elastic world's copy of what a call writes: {}",
                    e.message
                )
            });
            if let Some(streams) = self.executor.streams() {
                streams.collective_failed(e);
            }
        }
    }

    fn copy_aside(&self, regions: Vec<(usize, usize, usize, Memory)>) -> Result<()> {
        let streams = self.executor.streams();
        if let Some(s) = streams {
            // The bytes as the work the callers queued before this call leaves them.
            s.wait_for_callers()?;
        }
        let mut kept = Vec::with_capacity(regions.len());
        for (replica, ptr, bytes, memory) in regions {
            if bytes == 0 {
                continue;
            }
            let copy = match (memory, streams) {
                (Memory::Device, Some(s)) => {
                    let mut copy = vec![0u8; bytes];
                    // SAFETY: registered device memory of `replica` (and BMUF's own
                    // allocations) stays valid while registered; the copy is waited for below,
                    // before `copy` moves or is read.
                    unsafe { s.stage_copy(replica, copy.as_mut_ptr() as usize, ptr, bytes)? };
                    copy
                }
                // SAFETY: registered memory stays valid while registered (the C contract);
                // `bytes` is within it.
                _ => unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) }.to_vec(),
            };
            kept.push(Kept {
                replica,
                ptr,
                memory,
                copy,
            });
        }
        if let Some(s) = streams {
            s.wait_all()?;
        }
        self.membership.undo.lock().regions.extend(kept);
        Ok(())
    }

    /// Keeps the sparse outputs a step replaced and the slices it consumed (see the module).
    pub(super) fn keep_sparse(&self, old: SparseOutputs, slices: ConsumedSlices) {
        let earlier = self.membership.undo.lock().sparse.replace((old, slices));
        if let Some((outputs, _)) = earlier {
            self.executor.retire_outputs(outputs); // not reached: one step per call
        }
    }

    /// Forgets what was kept (the call completed, or answered without a loss): the sparse
    /// outputs kept are retired as a step retires those it replaces.
    pub(super) fn forget_undo(&self) {
        let mut undo = self.membership.undo.lock();
        undo.regions.clear();
        let sparse = undo.sparse.take();
        drop(undo);
        if let Some((outputs, _)) = sparse {
            self.executor.retire_outputs(outputs);
        }
    }

    /// Puts back what was kept, latest first (a region kept twice ends as first kept). On CUDA
    /// replicas the backend first forgets the failure the loss left (`Streams::recover`); an
    /// error means this process's devices cannot go on.
    pub(super) fn undo_written(&mut self) -> Result<()> {
        let (regions, sparse) = {
            let mut undo = self.membership.undo.lock();
            (std::mem::take(&mut undo.regions), undo.sparse.take())
        };
        if let Some((outputs, slices)) = sparse {
            // Retiring is safe with the failed call's device work still queued (as for a
            // failed step's outputs): their memory is reused only in stream order.
            let new = std::mem::replace(&mut self.sparse_out, outputs);
            self.executor.retire_outputs(new);
            self.sparse.restore_slices(slices);
        }
        let streams = self.executor.streams();
        if let Some(s) = streams {
            // Every stream drained first: nothing of the failed call writes after the copies.
            s.recover()?;
        }
        for kept in regions.iter().rev() {
            let (ptr, copy) = (kept.ptr, &kept.copy);
            match (kept.memory, streams) {
                // SAFETY: as in copy_aside; the copy is waited for below, before `regions`
                // is dropped.
                (Memory::Device, Some(s)) => unsafe {
                    s.stage_copy(kept.replica, ptr, copy.as_ptr() as usize, copy.len())?
                },
                // SAFETY: as in copy_aside; nothing else writes the memory now (the call
                // returned, its engine failed, every stream drained).
                _ => unsafe {
                    std::ptr::copy_nonoverlapping(copy.as_ptr(), ptr as *mut u8, copy.len())
                },
            }
        }
        if let Some(s) = streams {
            s.wait_all()?;
        }
        Ok(())
    }
}
