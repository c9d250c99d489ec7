//! Level 2 on CUDA: the groups' fusion and staging buffers, the table walks that pack a group's
//! replicas into its buffer and unpack it back, the add kernel, copies between devices, the
//! event that orders one group's stream after another's, and NCCL's grouped calls (one rank per
//! group). The algorithms that use them are in `exec/`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;

use super::driver::{self, PrimaryContext};
use super::kernels::Walk;
use super::memory::table_of;
use super::nccl::{self, CommSet};
use super::queue::setup_deadline;
use super::{CudaBackend, Group};
use crate::backend::{
    BucketView, Collective, Layout, Links, Members, Move, PeerOp, ReproStage, Slot,
};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::TransportChoice;
use crate::types::DType;

impl CudaBackend {
    /// The communicators of this context's device set (created on first use, shared).
    pub(super) fn comms(&self, issued: Instant) -> Result<Arc<CommSet>> {
        let mut slot = self.comms.lock();
        if let Some(set) = slot.as_ref() {
            return Ok(set.clone());
        }
        if self.world.load(Ordering::Relaxed) {
            // A local set would not meet the other ranks' collectives.
            return Err(Error::new(
                ErrorKind::Backend,
                "this context's NCCL communicators across the world's ranks were aborted",
            ));
        }
        let ctxs: Vec<&PrimaryContext> = self.groups.iter().map(|g| g.ctx.as_ref()).collect();
        let set = CommSet::get(&ctxs, setup_deadline(issued, self.timeout))?;
        *slot = Some(set.clone());
        Ok(set)
    }

    /// How this context's NCCL groups are queued: rank r is device group r.
    fn launch(&self, issued: Instant) -> nccl::Launch<'_> {
        nccl::Launch {
            streams: self.groups.iter().map(|g| g.stream.0).collect(),
            ctxs: self.groups.iter().map(|g| g.ctx.as_ref()).collect(),
            deadline: setup_deadline(issued, self.timeout),
        }
    }

    /// One table walk of `bucket` over `nrep` replicas of `table`, on `g`'s stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn walk(
        &self,
        g: &Group,
        bucket: &BucketView<'_>,
        table: u64,
        nrep: usize,
        fusion: u64,
        mode: Walk,
        avg: Option<usize>,
    ) -> Result<()> {
        let _bound = g.ctx.bind()?;
        let (nseg, total) = (bucket.segments.len(), bucket.elements());
        g.kernels.walk(
            g.stream.0,
            bucket.dtype,
            table,
            nseg,
            nrep,
            total,
            fusion,
            mode,
            avg,
        )
    }
}

impl Links for CudaBackend {
    fn buffer(&self, group: usize, slot: Slot, bytes: usize) -> Result<u64> {
        self.scratch(&self.groups[group], bytes, slot == Slot::Staging)
    }

    fn layout(&self, group: usize, bucket: &BucketView<'_>, members: Members) -> Result<Layout> {
        let g = &self.groups[group];
        Ok(Layout {
            table: self.table(g, bucket, members)?,
            replicas: match members {
                Members::All => g.local.len(),
                Members::One(_) => 1,
            },
        })
    }

    unsafe fn pack(
        &self,
        group: usize,
        bucket: &BucketView<'_>,
        layout: Layout,
        buffer: u64,
    ) -> Result<()> {
        let g = &self.groups[group];
        self.walk(
            g,
            bucket,
            layout.table,
            layout.replicas,
            buffer,
            Walk::Pack,
            None,
        )
    }

    unsafe fn unpack(
        &self,
        group: usize,
        bucket: &BucketView<'_>,
        layout: Layout,
        buffer: u64,
        avg: Option<usize>,
    ) -> Result<()> {
        let g = &self.groups[group];
        self.walk(
            g,
            bucket,
            layout.table,
            layout.replicas,
            buffer,
            Walk::Unpack,
            avg,
        )
    }

    fn slots_layout(&self, group: usize, count: usize, slots: &[u64]) -> Result<Layout> {
        let host = table_of(
            std::iter::once(count),
            std::iter::once(slots.iter().copied()),
        );
        Ok(Layout {
            table: self.upload_table(&self.groups[group], host)?,
            replicas: slots.len(),
        })
    }

    unsafe fn reproducible(
        &self,
        group: usize,
        dtype: DType,
        layout: Layout,
        count: usize,
        avg: Option<usize>,
    ) -> Result<()> {
        let g = &self.groups[group];
        let _bound = g.ctx.bind()?;
        let dims = (1, layout.replicas, count);
        (g.kernels).reproducible(g.stream.0, dtype, layout.table, dims, avg)
    }

    unsafe fn repro_stage(
        &self,
        group: usize,
        bucket: &BucketView<'_>,
        layout: Layout,
        buffers: (u64, u64),
        stage: ReproStage,
        avg: Option<usize>,
    ) -> Result<()> {
        let g = &self.groups[group];
        let _bound = g.ctx.bind()?;
        let dims = (bucket.segments.len(), layout.replicas, bucket.elements());
        let table = layout.table;
        (g.kernels).repro_stage(g.stream.0, bucket.dtype, table, dims, buffers, stage, avg)
    }

    unsafe fn add(
        &self,
        group: usize,
        dtype: DType,
        dst: u64,
        src: u64,
        count: usize,
    ) -> Result<()> {
        let g = &self.groups[group];
        let _bound = g.ctx.bind()?;
        g.kernels.add(g.stream.0, dtype, dst, src, count)
    }

    unsafe fn copy_between(
        &self,
        src_group: usize,
        src: u64,
        dst_group: usize,
        dst: u64,
        bytes: usize,
    ) -> Result<()> {
        let (s, d) = (&self.groups[src_group], &self.groups[dst_group]);
        let _bound = d.ctx.bind()?;
        // The peer copy names both contexts rather than relying on UVA to find them; the driver
        // stages it where the pair has no peer access.
        // SAFETY: the caller guarantees both ranges; queued on the destination's stream.
        driver::check(
            unsafe { sys::cuMemcpyPeerAsync(dst, d.ctx.ctx, src, s.ctx.ctx, bytes, d.stream.0) },
            "cuMemcpyPeerAsync",
        )
    }

    fn order(&self, from: usize, to: usize) -> Result<()> {
        if from == to {
            return Ok(());
        }
        let src = &self.groups[from];
        let _bound = src.ctx.bind()?;
        src.progress.record(src.stream.0)?;
        src.progress.wait_on(self.groups[to].stream.0)
    }

    fn collective(&self) -> Option<&dyn Collective> {
        let world = self.world.load(Ordering::Relaxed);
        (self.transport == TransportChoice::Nccl && (self.groups.len() > 1 || world))
            .then_some(self)
    }
}

/// NCCL, one rank per group. A group may be half launched when a call fails: the communicators
/// are aborted (their kernels end, so the callers' streams do not wait forever) and the context
/// refuses further collectives.
impl Collective for CudaBackend {
    fn allreduce(&self, dtype: DType, count: usize, buffers: &[u64]) -> Result<()> {
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.allreduce(dtype, count, buffers, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }

    fn max_fields(&self, dtype: DType, count: usize, buffers: &[u64]) -> Result<()> {
        let ty = if dtype == DType::F64 {
            nccl::HALF
        } else {
            nccl::BYTES
        };
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.allreduce_as((ty, nccl::MAX), count, buffers, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }

    fn broadcast(&self, dtype: DType, count: usize, root: usize, buffers: &[u64]) -> Result<()> {
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.broadcast(dtype, count, root, buffers, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }

    fn send_recv(&self, moves: &[Move]) -> Result<()> {
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.send_recv(moves, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }

    fn exchange(&self, ops: &[PeerOp]) -> Result<()> {
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.exchange(ops, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }

    fn reduce_scatter(&self, dtype: DType, count: usize, buffers: &[u64]) -> Result<()> {
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.reduce_scatter(dtype, count, buffers, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }

    fn allgather(&self, bytes: usize, buffers: &[u64]) -> Result<()> {
        let issued = Instant::now();
        (self.comms(issued))
            .and_then(|c| c.allgather(bytes, buffers, &self.launch(issued)))
            .map_err(|e| self.nccl_failed(e))
    }
}
