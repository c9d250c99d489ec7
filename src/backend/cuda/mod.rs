//! The CUDA backend: replicas in device memory, reduced on their GPUs in stream order.
//!
//! Stream protocol (ProcessGroupNCCL's, [`Streams`]): `begin` records an event on every caller
//! stream and makes each device's communication stream wait on all of them; the collective's
//! kernels, copies and NCCL calls run on the communication streams; `end` records a completion
//! event per device and makes every caller stream wait on all of them. The host never blocks
//! except in `synchronize`, for host tensors (the callers' streams first) and for sparse
//! coalescing (the indices): each a polled wait within the timeout (`queue.rs`).
//!
//! The replicas are split into groups, one per distinct GPU (the plan's level 1). A group's
//! replicas are reduced by one table-walk kernel over the whole bucket ([`Backend::reduce`]);
//! between groups, `exec/` moves and combines the groups' fusion buffers through [`Links`]
//! (`links.rs`: pack and unpack walks, the add kernel, peer copies, events, NCCL).
//!
//! | file | concern |
//! | --- | --- |
//! | `open.rs` | driver, devices, peer access, transport choice, kernels: [`CudaBackend::open`] |
//! | `memory.rs` | scratch buffers, segment tables, spares, dropped allocations |
//! | `queue.rs` | the stream protocol, the completion queue, the one polling loop, failure |
//! | `links.rs` | level-2 primitives and NCCL's grouped calls |
//! | `bmuf.rs`, `sparse.rs` | the BMUF and sparse primitives |
//! | `stage.rs` | a world's buckets through page-locked host memory |
//! | `trace.rs` | the timeline's device spans (timed events around each collective) |
//! | `driver.rs`, `nccl.rs`, `kernels.rs` | cudarc calls and owners, NCCL, the NVRTC kernels |

mod bmuf;
mod driver;
#[cfg(test)]
mod emulate;
mod kernels;
mod links;
mod memory;
mod nccl;
mod open;
mod queue;
mod sparse;
mod stage;
mod trace;
mod world;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use parking_lot::Mutex;

use self::driver::{Event, PrimaryContext, Stream};
use self::kernels::{Kernels, Walk};
use self::memory::{Dropped, Handed, Scratch};
use self::nccl::CommSet;
use self::queue::State;
use super::{
    Allocation, Backend, BmufFilter, BmufSpan, BucketView, Coalesced, IndexCheck, Layout, Links,
    Members, SliceRef, Slot, Streams,
};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::TransportChoice;
use crate::types::{piece, DType};

use self::open::distinct_callers;

/// One group of replicas reduced together on one GPU (the plan's device group).
pub(super) struct Group {
    /// Replicas of the group, in replica order (the first is the leader).
    local: Vec<usize>,
    stream: Stream,
    /// Recorded when another device must see this one's progress.
    progress: Event,
    scratch: Mutex<Scratch>,
    kernels: Arc<Kernels>,
    /// Last: released after everything above was freed.
    ctx: Arc<PrimaryContext>,
}

pub(super) struct Replica {
    group: usize,
    /// The caller's stream (`CUstream`; 0 = the legacy default stream).
    stream: usize,
    /// Recorded on the caller's stream when a collective begins.
    start: Event,
}

pub(crate) struct CudaBackend {
    groups: Vec<Group>,
    replicas: Vec<Replica>,
    /// [`distinct_callers`] of `replicas`, kept current by `set_stream`.
    callers: Vec<usize>,
    transport: TransportChoice,
    nccl_library: Option<String>,
    comms: Mutex<Option<Arc<CommSet>>>,
    /// `comms` is this process's part of a clique across the ranks of a world
    /// ([`super::WorldCollective`]): never replaced by a local set, even after an abort.
    world: AtomicBool,
    /// An elastic world's clique across a loss (world.rs).
    shrinking: world::Shrinking,
    state: Mutex<State>,
    dropped: Arc<Mutex<Dropped>>,
    /// Early buckets' page-locked stages for reuse (`stage.rs`).
    pinned: Arc<Mutex<stage::PinnedStages>>,
    timeout: Option<Duration>,
    driver_version: i32,
    /// The timeline's device spans, when tracing.
    trace: Mutex<Option<trace::DeviceTrace>>,
}

impl CudaBackend {
    /// The device group whose replicas are exactly `members`: the kernels over one table
    /// (reduce-scatters, allgathers, reproducible sums) read and write every replica of it.
    fn one_device(&self, members: &[usize], what: &str) -> Result<&Group> {
        let group = members
            .first()
            .map(|&r| &self.groups[self.replicas[r].group]);
        match group {
            Some(g)
                if g.local.len() == members.len()
                    && members.iter().all(|r| g.local.contains(r)) =>
            {
                Ok(g)
            }
            _ => Err(Error::new(
                ErrorKind::Panic,
                format!("CUDA {what} in a kernel take the replicas of one device"),
            )),
        }
    }

    /// The `owned` kernel over `bucket` on `g` (`scatter`: the reduce-scatter, else the
    /// allgather). The kernel finds each element's owner by the contract's rule over the
    /// group's replicas, so `owned` must be that rule: checked, segment by segment.
    unsafe fn owned(
        &self,
        g: &Group,
        bucket: &BucketView<'_>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
        scatter: bool,
        avg: Option<usize>,
    ) -> Result<()> {
        let nrep = g.local.len();
        for (s, segment) in bucket.segments.iter().enumerate() {
            if (0..nrep).any(|r| owned(s, r) != piece(segment.count, r, nrep)) {
                return Err(Error::new(
                    ErrorKind::Panic,
                    "CUDA shards in a kernel follow the contract's pieces of one process",
                ));
            }
        }
        let table = self.table(g, bucket, Members::All)?;
        let _bound = g.ctx.bind()?;
        let dims = (bucket.segments.len(), nrep, bucket.elements());
        (g.kernels).owned(g.stream.0, bucket.dtype, table, dims, scatter, avg)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    unsafe fn reduce(
        &self,
        group: usize,
        _members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
    ) -> Result<()> {
        // The walk sums the group's replicas in their order (`members`' order: the plan's).
        let g = &self.groups[group];
        let table = self.table(g, bucket, Members::All)?;
        self.walk(g, bucket, table, g.local.len(), 0, Walk::Allreduce, avg)
    }

    unsafe fn reduce_owned(
        &self,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        let g = self.one_device(members, "reduce-scatters")?;
        self.owned(g, bucket, owned, true, avg)
    }

    unsafe fn spread_owned(
        &self,
        bucket: &BucketView<'_>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        let all: Vec<usize> = (0..self.replicas.len()).collect();
        let g = self.one_device(&all, "allgathers")?;
        self.owned(g, bucket, owned, false, None)
    }

    unsafe fn reduce_reproducible(
        &self,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
    ) -> Result<()> {
        let g = self.one_device(members, "reproducible sums")?;
        if !matches!(bucket.dtype, DType::F32 | DType::F64) {
            return Err(Error::new(
                ErrorKind::Panic,
                "CUDA reproducible sums take F32 or F64 (the host stages the others)",
            ));
        }
        if members.len() <= 1 {
            return Ok(()); // one contribution is its own sum, as on the host
        }
        let table = self.table(g, bucket, Members::All)?;
        let _bound = g.ctx.bind()?;
        let dims = (bucket.segments.len(), g.local.len(), bucket.elements());
        (g.kernels).reproducible(g.stream.0, bucket.dtype, table, dims, avg)
    }

    unsafe fn spread(&self, group: usize, bucket: &BucketView<'_>, root: usize) -> Result<()> {
        // Fused: the root's tensors packed into the fusion buffer, one walk writes it into every
        // replica (the root's own tensors get their own bytes): two launches instead of a copy
        // per tensor and replica.
        let bytes = bucket.dtype.size() * bucket.elements();
        let buffer = self.buffer(group, Slot::Fusion, bytes)?;
        let all = self.layout(group, bucket, Members::All)?;
        let from_root: Layout = self.layout(group, bucket, Members::One(root))?;
        self.pack(group, bucket, from_root, buffer)?;
        self.unpack(group, bucket, all, buffer, None)
    }

    fn alloc(&self, replica: usize, bytes: usize) -> Result<Allocation> {
        let g = &self.groups[self.replicas[replica].group];
        let mem = self.device_memory(g, bytes)?;
        let ptr = mem.ptr as usize;
        let owner = Handed {
            mem: Some(mem),
            sink: self.dropped.clone(),
        };
        Ok(Allocation::new(ptr, bytes, Box::new(owner)))
    }

    unsafe fn copy(
        &self,
        src_replica: usize,
        src: usize,
        dst_replica: usize,
        dst: usize,
        bytes: usize,
    ) -> Result<()> {
        // Issued on the destination's stream, after what the source's stream wrote so far
        // (a coalesced slice, say).
        let (gs, gd) = (
            self.replicas[src_replica].group,
            self.replicas[dst_replica].group,
        );
        self.order(gs, gd)?;
        if gs != gd {
            return self.copy_between(gs, src as u64, gd, dst as u64, bytes);
        }
        let g = &self.groups[gd];
        let _bound = g.ctx.bind()?;
        // SAFETY: the caller guarantees both ranges.
        driver::check(
            unsafe { sys::cuMemcpyAsync(dst as u64, src as u64, bytes, g.stream.0) },
            "cuMemcpyAsync (replica copy)",
        )
    }

    unsafe fn divide(
        &self,
        replica: usize,
        dtype: DType,
        ptr: usize,
        count: usize,
        divisor: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let g = &self.groups[self.replicas[replica].group];
        let _bound = g.ctx.bind()?;
        g.kernels
            .divide(g.stream.0, dtype, ptr as u64, count, divisor)
    }

    unsafe fn bmuf_load(&self, replica: usize, dtype: DType, spans: &[BmufSpan]) -> Result<()> {
        self.bmuf_kernel(replica, dtype, spans, None)
    }

    unsafe fn bmuf_update(
        &self,
        replica: usize,
        dtype: DType,
        spans: &[BmufSpan],
        filter: &BmufFilter,
    ) -> Result<()> {
        self.bmuf_kernel(replica, dtype, spans, Some(filter))
    }

    unsafe fn check_indices(&self, check: &IndexCheck<'_>) -> Result<()> {
        self.device_index_check(check)
    }

    unsafe fn coalesce(
        &self,
        slices: &[(usize, SliceRef<'_>)],
        reproducible: bool,
        alloc: &mut dyn FnMut(usize, usize) -> Result<Allocation>,
    ) -> Result<Vec<Coalesced>> {
        if reproducible {
            return Err(Error::new(
                ErrorKind::Panic,
                "the CUDA backend has no reproducible coalesce (exec/sparse.rs stages the rows)",
            ));
        }
        (slices.iter())
            .map(|(r, s)| self.device_coalesce(*r, s, &mut |bytes| alloc(*r, bytes)))
            .collect()
    }

    /// Waits for everything issued, then reports (once) the indices that device checks found
    /// out of range.
    fn synchronize(&self) -> Result<()> {
        self.synchronize_queue()
    }

    fn streams(&self) -> Option<&dyn Streams> {
        Some(self)
    }

    fn streams_mut(&mut self) -> Option<&mut dyn Streams> {
        Some(self)
    }

    fn links(&self) -> Option<&dyn Links> {
        Some(self)
    }

    fn world_collective(&self) -> Option<&dyn super::WorldCollective> {
        (self.transport == TransportChoice::Nccl).then_some(self)
    }

    fn describe(&self) -> serde_json::Value {
        let devices: Vec<serde_json::Value> = self
            .groups
            .iter()
            .map(|g| {
                serde_json::json!({
                    "device": format!("cuda:{}", g.ctx.ordinal),
                    "name": g.ctx.name(),
                    "replicas": g.local,
                    "multiprocessors": g.kernels.sm_count,
                    "kernels": g.kernels.built,
                })
            })
            .collect();
        let streams: Vec<String> = self
            .replicas
            .iter()
            .map(|r| {
                if r.stream == 0 {
                    "legacy default".to_owned()
                } else {
                    format!("{:#x}", r.stream)
                }
            })
            .collect();
        serde_json::json!({
            "name": self.name(),
            "driver_version": self.driver_version,
            "devices": devices,
            "caller_streams": streams,
            "nccl": self.nccl_library,
            "nccl_communicators": self.comms.lock().as_ref().map(|c| c.ranks()),
            "nccl_shrinks": self.shrinking.count.load(std::sync::atomic::Ordering::Relaxed),
            "timeout_ms": self.timeout.map(|t| t.as_millis() as u64),
            "nvrtc_compiles": kernels::nvrtc_compiles(),
        })
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Wait for outstanding collectives as synchronize does, so that a stuck one times out
        // (and is then aborted and leaked below) instead of hanging the destroy.
        let mut failed = self.state.get_mut().failed.is_some();
        if !failed {
            let mut state = self.state.lock();
            if let Err(e) = self.reap(&mut state, true) {
                self.fail(&mut state, e);
                failed = true;
            }
        }
        for g in &self.groups {
            let Ok(_bound) = g.ctx.bind() else { continue };
            if failed {
                // Queued work may never finish: freeing its memory would block. Leak it.
                let scratch = std::mem::take(&mut *g.scratch.lock());
                std::mem::forget(scratch);
            } else {
                let _ = self.sync_group(g);
                *g.scratch.lock() = Scratch::default();
            }
        }
        {
            // Allocations dropped since the last collective, and from now on.
            let mut dropped = self.dropped.lock();
            dropped.closed = Some(failed);
            let mems = std::mem::take(&mut dropped.mems);
            drop(dropped);
            if failed {
                std::mem::forget(mems);
            }
        }
        self.close_stages(failed);
        if failed {
            // As above: memory queued work may still read is leaked, not freed.
            let state = self.state.get_mut();
            std::mem::forget(std::mem::take(&mut state.pending));
            std::mem::forget(std::mem::take(&mut state.issuing));
            // Idle, but freeing may wait for a device whose work never finishes.
            std::mem::forget(std::mem::take(&mut state.spares));
            std::mem::forget(std::mem::take(&mut state.retired_host));
            if let Some(comms) = self.comms.get_mut().take() {
                comms.abort();
            }
        }
        // A shrunk clique not joined, and its parent: aborted (never ready, a finalize would wait).
        self.give_up_shrink(true);
        // The communicators go first (finalized and destroyed if this was their last context),
        // while the streams NCCL queued on and the contexts' references are still alive; the
        // fields would drop them after `groups`.
        drop(self.comms.get_mut().take());
    }
}
