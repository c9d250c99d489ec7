//! The sparse primitives on a CUDA replica.
//!
//! - Index range check: a kernel lowers a device word to the first bad row, a second writes
//!   that row's index beside it, and both are copied into pinned host memory, all in stream
//!   order inside the collective. The host reads the answer when the collective is seen
//!   complete; `synchronize` reports it. The host never waits for the check.
//! - Coalescing: the result's row count depends on the data and the host must know it (it
//!   sizes the outputs and `dpsync_sparse_get` returns it), so the indices are copied to the
//!   host after the work queued before them (the host waits here, polling within the
//!   timeout: `CudaBackend::wait_group`), sorted there by the
//!   backends' shared [`coalescing_order`], and the rows of each run are summed on the device
//!   by `sum_runs_<dtype>` (kernels/sparse.cu). Value rows never leave the device.

use cudarc::driver::sys;

use super::driver::{self, check, DeviceMemory, PinnedMemory};
use super::CudaBackend;
use crate::backend::{
    coalescing_order, narrow_indices, widen_indices, Allocation, Coalesced, IndexCheck, SliceRef,
};
use crate::error::Result;
use crate::types::DType;

/// The device word the check kernels write (first bad row, its index) and the host copy of it.
pub(super) struct CheckSlot {
    group: usize,
    device: DeviceMemory,
    host: PinnedMemory,
}

/// A device index check in flight; its answer is in `slot.host` once its collective completes.
pub(super) struct DeferredCheck {
    slot: CheckSlot,
    tensor: String,
    replica: usize,
    dtype: DType,
    bound: u64,
}

impl DeferredCheck {
    /// Reads the answer (the collective has completed): the slot for reuse, and the error if an
    /// index was out of range.
    pub(super) fn finish(self) -> (CheckSlot, Option<crate::error::Error>) {
        // SAFETY: 16 bytes of pinned memory the completed copy wrote.
        let [row, value] = unsafe { *(self.slot.host.ptr as *const [u64; 2]) };
        let error = (row != u64::MAX).then(|| {
            let check = IndexCheck {
                tensor: &self.tensor,
                replica: self.replica,
                dtype: self.dtype,
                indices: 0,
                rows: 0,
                bound: self.bound,
            };
            let mut err = check.error(row as usize, value as i64);
            err.message += " (found on the device after dpsync_allreduce_grads returned; that \
                            step's gathered slices hold the indices as given)";
            err
        });
        (self.slot, error)
    }
}

impl CudaBackend {
    fn check_slot(&self, group: usize) -> Result<CheckSlot> {
        let mut state = self.state.lock();
        if let Some(i) = state.check_slots.iter().position(|s| s.group == group) {
            return Ok(state.check_slots.swap_remove(i));
        }
        drop(state);
        let g = &self.groups[group];
        Ok(CheckSlot {
            group,
            device: DeviceMemory::uninit(&g.ctx, 16)?,
            host: PinnedMemory::new(&g.ctx, 16)?,
        })
    }

    /// `Backend::check_indices`: queued on the replica's device, answered by `synchronize`.
    pub(super) unsafe fn device_index_check(&self, c: &IndexCheck<'_>) -> Result<()> {
        if c.rows == 0 {
            return Ok(());
        }
        let g = self.replicas[c.replica].group;
        let slot = self.check_slot(g)?;
        let group = &self.groups[g];
        let stream = group.stream.0;
        let _bound = group.ctx.bind()?;
        let queued = (|| {
            // SAFETY: the slot's 16 bytes on this device and in pinned host memory.
            check(
                unsafe { sys::cuMemsetD8Async(slot.device.ptr, 0xff, 16, stream) },
                "cuMemsetD8Async (index check)",
            )?;
            group.kernels.index_check(
                stream,
                c.dtype,
                c.indices as u64,
                c.rows,
                c.unsigned_limit(),
                slot.device.ptr,
            )?;
            check(
                unsafe { sys::cuMemcpyDtoHAsync_v2(slot.host.ptr, slot.device.ptr, 16, stream) },
                "cuMemcpyDtoHAsync (index check)",
            )
        })();
        if let Err(e) = queued {
            // What was queued may still write the slot: leak its 32 bytes rather than free them.
            std::mem::forget(slot);
            return Err(e);
        }
        self.state.lock().issuing.checks.push(DeferredCheck {
            slot,
            tensor: c.tensor.to_owned(),
            replica: c.replica,
            dtype: c.dtype,
            bound: c.bound,
        });
        Ok(())
    }

    /// `Backend::coalesce` (module doc). Waits for the device once, for the indices.
    pub(super) unsafe fn device_coalesce(
        &self,
        replica: usize,
        slice: &SliceRef<'_>,
        alloc: &mut dyn FnMut(usize) -> Result<Allocation>,
    ) -> Result<Coalesced> {
        let group = &self.groups[self.replicas[replica].group];
        // Into page-locked memory, so that the copy is queued rather than made synchronous
        // (it would wait, without a timeout, for everything queued before it); then a bounded
        // wait. u64 words: aligned for either index type.
        let bytes = slice.rows * slice.index_dtype.size();
        let mut raw = vec![0u64; bytes.div_ceil(8)];
        if bytes > 0 {
            let host = {
                let mut scratch = group.scratch.lock();
                match scratch.host.take() {
                    Some((mem, size)) if size >= bytes => (mem, size),
                    outgrown => {
                        // Freed by the next synchronize: cuMemFreeHost may wait for the device.
                        if let Some((old, _)) = outgrown {
                            self.state.lock().retired_host.push(old);
                        }
                        let size = crate::backend::size_class(bytes, super::memory::DEVICE_FLOOR);
                        (PinnedMemory::new(&group.ctx, size)?, size)
                    }
                }
            };
            let copied = (|| {
                let _bound = group.ctx.bind()?;
                // SAFETY: `rows` indices on this device; the pinned buffer holds `bytes`.
                check(
                    unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            host.0.ptr,
                            slice.indices as u64,
                            bytes,
                            group.stream.0,
                        )
                    },
                    "cuMemcpyDtoHAsync (indices to coalesce)",
                )?;
                self.wait_group(group)
            })();
            if let Err(e) = copied {
                // The copy may still write the buffer: leak it rather than free it.
                std::mem::forget(host);
                return Err(e);
            }
            // SAFETY: the copy completed; `raw` holds at least `bytes`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    host.0.ptr as *const u8,
                    raw.as_mut_ptr().cast::<u8>(),
                    bytes,
                )
            };
            group.scratch.lock().host = Some(host);
        }
        let keys = widen_indices(slice.index_dtype, raw.as_ptr() as usize, slice.rows);
        let (unique, positions, bounds) = coalescing_order(&keys);
        let rows = unique.len();
        let index_bytes = narrow_indices(slice.index_dtype, &unique);
        let indices = alloc(index_bytes.len())?;
        let _bound = group.ctx.bind()?;
        driver::upload(indices.ptr() as u64, &index_bytes, group.stream.0)?;
        let mut values: Vec<Allocation> = Vec::with_capacity(slice.values.len());
        if rows == 0 {
            for _ in slice.values {
                values.push(alloc(0)?);
            }
            return Ok(Coalesced {
                rows,
                indices,
                values,
            });
        }
        // positions then bounds, as u64, in one device buffer that lives until the collective
        // completes (the sums read it).
        let map: Vec<u8> = positions
            .iter()
            .chain(&bounds)
            .flat_map(|&p| (p as u64).to_ne_bytes())
            .collect();
        let map_mem = self.device_memory(group, map.len())?;
        let map_ptr = map_mem.ptr;
        // Kept until the collective completes, whatever happens below.
        self.state.lock().issuing.keep.push(map_mem);
        driver::upload(map_ptr, &map, group.stream.0)?;
        let bounds_ptr = map_ptr + (positions.len() * 8) as u64;
        for v in slice.values {
            let out = alloc(rows * v.row_bytes())?;
            let _bound = group.ctx.bind()?;
            group.kernels.sum_runs(
                group.stream.0,
                v.dtype,
                v.ptr as u64,
                map_ptr,
                bounds_ptr,
                rows,
                v.row_len,
                out.ptr() as u64,
            )?;
            values.push(out);
        }
        Ok(Coalesced {
            rows,
            indices,
            values,
        })
    }
}
