//! A world's level 3 on CUDA replicas through host memory: the process's sum copied from the
//! device into page-locked host memory, handed to the engine between the ranks (MPI), and the
//! result copied back, all on the groups' streams inside the collective; the host waits for the
//! copies (polled within the timeout) before the engine reads the buffer or it is reused.

use cudarc::driver::sys;

use std::sync::Arc;

use parking_lot::Mutex;

use super::driver::{self, PinnedMemory};
use super::CudaBackend;
use crate::backend::spares::{Block, Spares};
use crate::backend::{size_class, BucketStage, Done};
use crate::error::Result;

/// Page-locked buffers start at this size (a size class, as device scratch).
const STAGE_FLOOR: usize = 64 << 10;

/// The page-locked stages of early buckets whose transfers finished, for the next step's:
/// `cuMemAllocHost` is slow and `cuMemFreeHost` waits for the device, so a stage made and freed
/// per bucket would cost more than the overlap gains on a GPU.
#[derive(Default)]
pub(super) struct PinnedStages {
    spares: Spares<PinnedMemory>,
    /// `Some(leak)` after the backend's `Drop` ([`CudaBackend::close_stages`]).
    closed: Option<bool>,
}

impl Block for PinnedMemory {
    fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A [`BucketStage`]'s memory: back to the [`PinnedStages`] when dropped (the executor drops
/// it only once nothing reads or writes it; else it forgets the whole stage).
struct Lent {
    mem: Option<PinnedMemory>,
    home: Arc<Mutex<PinnedStages>>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else { return };
        let mut home = self.home.lock();
        match home.closed {
            None => home.spares.put([mem]),
            Some(false) => {
                drop(home);
                drop(mem);
            }
            Some(true) => std::mem::forget(mem),
        }
    }
}

impl CudaBackend {
    /// Group 0's page-locked stage of at least `bytes`, grown by size class; its address.
    pub(super) fn host_stage_of(&self, bytes: usize) -> Result<usize> {
        let group = &self.groups[0];
        let mut scratch = group.scratch.lock();
        match &scratch.stage {
            Some((mem, size)) if *size >= bytes => Ok(mem.ptr as usize),
            _ => {
                // Every copy into or out of the old buffer has been waited for (`wait_groups`
                // after each use), so it may go now.
                let size = size_class(bytes, STAGE_FLOOR);
                let mem = PinnedMemory::new(&group.ctx, size)?;
                let ptr = mem.ptr as usize;
                scratch.stage = Some((mem, size));
                Ok(ptr)
            }
        }
    }

    /// [`Streams::bucket_stage`](crate::backend::Streams): page-locked memory of group 0's
    /// device context, an earlier bucket's when one fits, else fresh by size class (out of
    /// memory: again once the idle stages are freed).
    pub(super) fn bucket_stage_of(&self, bytes: usize) -> Result<BucketStage> {
        let reused = self.pinned.lock().spares.take(bytes, |_| true);
        let mem = match reused {
            Some(mem) => mem,
            None => {
                let ctx = &self.groups[0].ctx;
                let size = size_class(bytes, STAGE_FLOOR);
                PinnedMemory::new(ctx, size).or_else(|_| {
                    drop(self.pinned.lock().spares.release(|_| true));
                    PinnedMemory::new(ctx, size)
                })?
            }
        };
        Ok(BucketStage {
            ptr: mem.ptr as usize,
            _memory: Box::new(Lent {
                mem: Some(mem),
                home: self.pinned.clone(),
            }),
        })
    }

    /// The early buckets' stages beyond the spares' limit, for `synchronize` to free.
    pub(super) fn retired_stages(&self) -> Vec<PinnedMemory> {
        self.pinned.lock().spares.take_retired()
    }

    /// At destroy: the idle stages freed, or leaked when `failed` (freeing may wait for a
    /// device whose work never finishes); stages lent out are too when they come back.
    pub(super) fn close_stages(&self, failed: bool) {
        let mut pinned = self.pinned.lock();
        pinned.closed = Some(failed);
        let spares = std::mem::take(&mut pinned.spares);
        drop(pinned);
        if failed {
            std::mem::forget(spares);
        }
    }

    /// [`Streams::queued_done`](crate::backend::Streams): an event recorded on every group's
    /// stream; `cuEventQuery` needs no current context, so any thread may ask.
    pub(super) fn queued_done_of(&self) -> Result<Done> {
        let events = (self.groups.iter())
            .map(|g| {
                let _bound = g.ctx.bind()?;
                let event = driver::Event::new()?;
                event.record(g.stream.0)?;
                Ok(event)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(move || {
            for e in &events {
                if !e.query()? {
                    return Ok(false);
                }
            }
            Ok(true)
        }))
    }

    /// `bytes` from `src` to `dst` on `replica`'s group stream, after the work queued there.
    ///
    /// # Safety
    /// One range is in the stage, the other device memory of `replica`, both `bytes` long.
    pub(super) unsafe fn stage_copy_on(
        &self,
        replica: usize,
        dst: usize,
        src: usize,
        bytes: usize,
    ) -> Result<()> {
        let group = &self.groups[self.replicas[replica].group];
        let _bound = group.ctx.bind()?;
        driver::check(
            sys::cuMemcpyAsync(dst as u64, src as u64, bytes, group.stream.0),
            "cuMemcpyAsync (a world's host stage)",
        )
    }

    /// [`crate::backend::Streams::recover`]: the failure forgotten, then every stream and
    /// pending collective waited for (also without a failure: a call that completed here may
    /// still be writing); whatever fails then is recorded again. The NCCL
    /// communicators are aborted first and stay so: a clique across the ranks is joined anew
    /// by the world's rebuild, a local one made again when next needed.
    pub(super) fn recover_from_world(&self) -> Result<()> {
        // A rank was lost (or left): the communicators are aborted before the streams are
        // drained, whether or not this process's failure aborted them. Real NCCL may report a
        // dead peer to none of the survivors (ranks sharing a GPU, NVLink) and then waits for
        // it until aborted, and a survivor whose own call failed only in MPI would drain into
        // its timeout (the randomized test's CUDA kill variant, seed 4).
        if let Some(comms) = self.comms.lock().take() {
            comms.abort();
        }
        let was = self.state.lock().failed.take();
        let sound = self.wait_all_groups().and_then(|()| self.observe(true));
        sound.map_err(|e| {
            let mut state = self.state.lock();
            if let Some(was) = was {
                state.failed = Some(was);
            }
            self.fail(&mut state, e)
        })
    }

    /// Blocks the host until every group's stream has run what was queued on it so far.
    pub(super) fn wait_all_groups(&self) -> Result<()> {
        self.groups.iter().try_for_each(|g| self.wait_group(g))
    }
}
