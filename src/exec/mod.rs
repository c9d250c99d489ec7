//! Algorithms, written once over the [`Backend`] primitives: dense allreduce and broadcast by
//! buckets over the plan's [`Levels`] (in [`dense`]), average, the sparse gather (in
//! [`sparse`], moving bytes by [`transfer`]) and BMUF (in [`bmuf`]). Inputs are validated
//! before they get here (registry and plan); the executor only turns plan data into backend
//! calls.
//!
//! A context has one backend for its replicas' memory (host threads, or CUDA) and, where that
//! backend is stream-ordered ([`Backend::streams`]), a host backend for tensors that live in
//! host memory (CPU ops in a GPU model).

pub mod bmuf;
mod clique;
mod dense;
mod early;
mod repro;
mod repro_clique;
pub mod shard;
mod sparse;
mod staged;
mod transfer;
pub mod world;

pub use sparse::{SparseOutputs, SparseStats};

use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::host::HostBackend;
use crate::backend::{Backend, BucketView, Channel, Ranks, Segment, Streams};
use crate::error::{Error, Result};
use crate::plan::{plan_buckets, Bucket, Levels, Topology};
use crate::registry::TensorView;
use crate::timeline::{self, Span, Tracer};
use crate::types::{Memory, ReduceOp};
use serde_json::json;

pub struct Executor {
    /// The backend of the replicas' own memory.
    backend: Box<dyn Backend>,
    /// Its levels (from the context's topology, as the backend's groups are).
    levels: Levels,
    /// Host-memory tensors on stream-ordered replicas, with their levels (one group); `None`
    /// when `backend` is already the host's.
    host: Option<(HostBackend, Levels)>,
    /// A `begin`/`end` bracket is open: work inside it needs no bracket of its own.
    in_bracket: AtomicBool,
    /// Level 3, the other processes of a world.
    ranks: Option<Box<dyn Ranks>>,
    /// The timeline, when `DPSYNC_TIMELINE` is set.
    trace: Option<Tracer>,
    /// The reproducible sums' exponents and integers, kept for the next bucket.
    repro: parking_lot::Mutex<repro::Scratch>,
}

/// Marks the bracket closed even if its work unwinds.
struct Open<'a>(&'a AtomicBool);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

fn view<'a>(bucket: &Bucket, tensors: &[&'a TensorView]) -> BucketView<'a> {
    BucketView {
        dtype: bucket.dtype,
        segments: bucket
            .tensors
            .iter()
            .map(|&i| Segment {
                ptrs: &tensors[i].ptrs,
                count: tensors[i].count,
            })
            .collect(),
    }
}

/// Buckets for an ad-hoc set of tensors (broadcast, average): same fusion rule as gradients.
fn buckets_for(tensors: &[&TensorView], fusion_bytes: usize) -> Vec<Bucket> {
    let items = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (i, t.dtype, t.memory, t.count));
    plan_buckets(items, fusion_bytes)
}

/// `buckets` with every run of consecutive device buckets of one dtype joined into one (device
/// memory reduced in place: a bucket's size buys nothing there, one launch does it all); host
/// buckets as they are.
fn merge_device_buckets(buckets: &[Bucket]) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::with_capacity(buckets.len());
    for b in buckets {
        match out.last_mut() {
            Some(last)
                if b.memory == Memory::Device
                    && last.memory == Memory::Device
                    && last.dtype == b.dtype =>
            {
                last.tensors.extend_from_slice(&b.tensors);
                last.elements += b.elements;
            }
            _ => out.push(b.clone()),
        }
    }
    out
}

/// The backend of one kind of memory, its levels, the ranks of a world above them, and the
/// timeline.
#[derive(Clone, Copy)]
struct Site<'a> {
    backend: &'a dyn Backend,
    levels: &'a Levels,
    ranks: Option<&'a dyn Ranks>,
    trace: Option<&'a Tracer>,
    /// Which of the engine's channels level 3 uses.
    channel: Channel,
    /// Scratch memory of the reproducible sums.
    repro: &'a parking_lot::Mutex<repro::Scratch>,
}

impl Executor {
    /// `backend` and `topology` as [`crate::backend::select::open`] gave them; `ranks`: the world's
    /// engine ([`crate::backend::select::join`]), whose ranks the topology already counts.
    pub(crate) fn new(
        backend: Box<dyn Backend>,
        topology: &Topology,
        ranks: Option<Box<dyn Ranks>>,
    ) -> Executor {
        let host = backend.streams().is_some().then(|| {
            let host = HostBackend::new();
            (host, Levels::new(&topology.for_host_memory()))
        });
        Executor {
            backend,
            levels: Levels::new(topology),
            host,
            in_bracket: AtomicBool::new(false),
            ranks,
            trace: None,
            repro: Default::default(),
        }
    }

    /// The levels of the replicas' memory, with their route: what every collective over that
    /// memory runs (and what describe shows).
    pub fn levels(&self) -> &Levels {
        &self.levels
    }

    /// Traces this executor's buckets and levels on the timeline.
    pub(crate) fn set_tracer(&mut self, trace: Option<Tracer>) {
        if let (Some(t), Some(streams)) = (&trace, self.backend.streams_mut()) {
            // Without the device's spans the host's still come.
            if let Err(e) = streams.trace(t.clone()) {
                crate::log::warn(|| format!("timeline: no device spans: {}", e.message));
            }
        }
        self.trace = trace;
    }

    /// The world's engine, in a world.
    pub(crate) fn ranks(&self) -> Option<&dyn Ranks> {
        self.ranks.as_deref()
    }

    /// The replicas' backend (what a world is joined with).
    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The backend's part of a collective across the ranks, where it has one.
    pub(crate) fn world_collective(&self) -> Option<&dyn crate::backend::WorldCollective> {
        self.backend.world_collective()
    }

    /// Gives up the collective across the ranks (NCCL), if one was joined: the world changed.
    pub(crate) fn leave_collective(&self) {
        if let Some(c) = self.backend.world_collective() {
            c.leave();
        }
    }

    /// The world changed: its new engine and this rank's place in it.
    pub(crate) fn rejoin(&mut self, topology: &Topology, ranks: Box<dyn Ranks>) {
        self.levels = Levels::new(topology);
        // Host-memory tensors on device replicas cross the new world too.
        if let Some((_, levels)) = self.host.as_mut() {
            *levels = Levels::new(&topology.for_host_memory());
        }
        self.ranks = Some(ranks);
    }

    pub fn describe_backend(&self) -> serde_json::Value {
        let mut json = self.backend.describe();
        if let Some((host, _)) = &self.host {
            json["host_memory"] = host.describe();
        }
        json
    }

    /// The stream hooks, on a stream-ordered backend.
    pub(crate) fn streams(&self) -> Option<&dyn Streams> {
        self.backend.streams()
    }

    pub fn memory_of(&self, replica: usize, ptr: usize) -> Result<Memory> {
        self.streams()
            .map_or(Ok(Memory::Host), |s| s.memory_of(replica, ptr))
    }

    pub fn set_stream(&mut self, replica: usize, stream: usize) -> Result<()> {
        match self.backend.streams_mut() {
            Some(streams) => streams.set_stream(replica, stream),
            None => Err(Error::invalid(format!(
                "replica {replica} is a host replica: streams belong to CUDA replicas"
            ))),
        }
    }

    /// Runs `work` between the backend's `begin` and `end` when it touches device memory, so
    /// that it is ordered with the callers' streams; host work needs no bracket, and neither
    /// does work inside an open one ([`Executor::bracket`]).
    fn collective(&self, buckets: &[Bucket], work: impl FnOnce() -> Result<()>) -> Result<()> {
        if !buckets.iter().any(|b| b.memory == Memory::Device) {
            return work();
        }
        self.bracket(work)
    }

    /// Runs `work` as one collective of a stream-ordered backend: its `begin` before it, `end`
    /// after it (even after a failure: the callers' streams must not wait forever). The
    /// collectives `work` issues join this bracket. Elsewhere `work` runs as it is.
    pub fn bracket<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        self.bracket_joined(true, work)
    }

    /// [`Executor::bracket`]; with `join` false the callers' streams do not wait for `work`
    /// ([`Streams::end`]).
    fn bracket_joined<T>(&self, join: bool, work: impl FnOnce() -> Result<T>) -> Result<T> {
        let Some(streams) = self.streams() else {
            return work();
        };
        if self.in_bracket.load(Ordering::Relaxed) {
            return work();
        }
        let failed = |e| streams.collective_failed(e);
        streams.begin().map_err(failed)?;
        self.in_bracket.store(true, Ordering::Relaxed);
        let result = {
            let _open = Open(&self.in_bracket);
            work()
        };
        // Mapped whatever `work` gave: a failed `end` alone may leave the callers unjoined.
        let closed = streams.end(join).map_err(failed);
        let value = result.map_err(failed)?;
        closed?;
        Ok(value)
    }

    /// The backend and levels of memory of `memory`'s kind.
    fn site(&self, memory: Memory) -> Site<'_> {
        match (memory, &self.host) {
            (Memory::Host, Some((host, levels))) => Site {
                backend: host,
                levels,
                ranks: self.ranks(),
                trace: self.trace.as_ref(),
                channel: Channel::Calls,
                repro: &self.repro,
            },
            _ => Site {
                backend: self.backend.as_ref(),
                levels: &self.levels,
                ranks: self.ranks(),
                trace: self.trace.as_ref(),
                channel: Channel::Calls,
                repro: &self.repro,
            },
        }
    }

    /// The backend for memory of `memory`'s kind.
    fn backend_for(&self, memory: Memory) -> &dyn Backend {
        self.site(memory).backend
    }

    /// Whether touching memory of `memory`'s kind makes the host wait for the callers' streams
    /// (host tensors on device replicas: [`Executor::site_to_touch`]).
    pub fn touching_waits(&self, memory: Memory) -> bool {
        memory == Memory::Host && self.host.is_some()
    }

    /// The site to read or write memory of `memory`'s kind now. Host memory on device replicas
    /// is touched by the host at once, so the host first waits for the work the callers queued
    /// before this call (it may be what writes that memory): the collective then starts after
    /// it, as the stream contract promises.
    fn site_to_touch(&self, memory: Memory) -> Result<Site<'_>> {
        if self.touching_waits(memory) {
            if let Some(streams) = self.streams() {
                streams.wait_for_callers()?;
            }
        }
        Ok(self.site(memory))
    }

    /// [`Executor::site_to_touch`]'s backend.
    fn backend_to_touch(&self, memory: Memory) -> Result<&dyn Backend> {
        Ok(self.site_to_touch(memory)?.backend)
    }

    /// Reduces `buckets` (indices into `tensors`) in order, level by level.
    ///
    /// # Safety
    /// Every registered pointer is valid (the C contract makes that the caller's duty).
    pub unsafe fn allreduce_buckets(
        &self,
        buckets: &[Bucket],
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
        channel: Channel,
    ) -> Result<()> {
        let merged;
        let buckets = if self.levels.in_place() {
            merged = merge_device_buckets(buckets);
            &merged
        } else {
            buckets
        };
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        self.collective(buckets, || {
            for (b, bucket) in buckets.iter().enumerate() {
                let _span = self.bucket_span("allreduce bucket", b, bucket, tensors);
                let site = Site {
                    channel,
                    ..self.site_to_touch(bucket.memory)?
                };
                dense::allreduce(site, &view(bucket, tensors), avg)?;
            }
            Ok(())
        })
    }

    /// One bucket reduced ahead of `dpsync_allreduce_grads` (`dpsync_grad_ready`): after the
    /// work already on the callers' streams, but without making them wait for it, so backward
    /// goes on; `allreduce_grads`, which follows it on the backend's streams, makes them wait.
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`].
    pub unsafe fn allreduce_early(
        &self,
        bucket: &Bucket,
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
    ) -> Result<()> {
        let bucket = std::slice::from_ref(bucket);
        self.bracket_joined(false, || {
            self.allreduce_buckets(bucket, tensors, op, divisor, Channel::Calls)
        })
    }

    /// Reduces `tensors`, fused by dtype into buckets of at most `fusion_bytes`.
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`].
    pub unsafe fn allreduce(
        &self,
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
        fusion_bytes: usize,
    ) -> Result<()> {
        let buckets = buckets_for(tensors, fusion_bytes);
        self.allreduce_buckets(&buckets, tensors, op, divisor, Channel::Calls)
    }

    /// `x := x / divisor` for every replica's copy of `tensors` (gradients summed earlier,
    /// finished as an AVG); with `scatter` (a reduce-scatter step), each replica's owned piece
    /// alone. Device tensors must be inside a [`Executor::bracket`].
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`].
    pub unsafe fn divide(
        &self,
        tensors: &[&TensorView],
        divisor: usize,
        scatter: Option<shard::Place>,
    ) -> Result<()> {
        if divisor <= 1 {
            return Ok(());
        }
        for t in tensors {
            let backend = self.backend_to_touch(t.memory)?;
            for (replica, &ptr) in t.ptrs.iter().enumerate() {
                let (first, count) = match scatter {
                    Some(place) => shard::piece(t.count, place.offset + replica, place.total),
                    None => (0, t.count),
                };
                if count > 0 {
                    let at = ptr + first * t.dtype.size();
                    backend.divide(replica, t.dtype, at, count, divisor)?;
                }
            }
        }
        Ok(())
    }

    /// Copies `tensors` from local replica `root` of rank `root_rank` (0 outside a world) to
    /// every other replica.
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`].
    pub unsafe fn broadcast(
        &self,
        tensors: &[&TensorView],
        root_rank: usize,
        root: usize,
        fusion_bytes: usize,
    ) -> Result<()> {
        let buckets = buckets_for(tensors, fusion_bytes);
        self.collective(&buckets, || {
            for (b, bucket) in buckets.iter().enumerate() {
                let _span = self.bucket_span("broadcast bucket", b, bucket, tensors);
                let site = self.site_to_touch(bucket.memory)?;
                dense::broadcast(site, &view(bucket, tensors), root_rank, root)?;
            }
            Ok(())
        })
    }

    pub fn synchronize(&self) -> Result<()> {
        self.backend.synchronize()
    }

    /// A timeline span for bucket `b`: its tensors' names, dtype, memory and bytes.
    fn bucket_span(
        &self,
        name: &str,
        b: usize,
        bucket: &Bucket,
        tensors: &[&TensorView],
    ) -> Option<Span> {
        timeline::span(self.trace.as_ref(), name, || {
            let names: Vec<&str> = (bucket.tensors.iter())
                .map(|&t| tensors[t].name.as_str())
                .collect();
            json!({"bucket": b, "dtype": bucket.dtype.to_string(),
                   "memory": format!("{:?}", bucket.memory), "tensors": names,
                   "bytes": bucket.elements * bucket.dtype.size()})
        })
    }

    /// A small collective's data for its agreement ([`world::agree`]): every local replica's
    /// `tensors`, replica after replica, each tensor at an 8-byte aligned offset
    /// ([`inline_bytes`] per replica).
    ///
    /// # Safety
    /// Every tensor is registered host memory (the caller checked: `Context::fits_inline`).
    pub unsafe fn inline_data(&self, tensors: &[&TensorView]) -> Vec<u8> {
        let block = inline_bytes(tensors);
        let replicas = tensors.first().map_or(0, |t| t.ptrs.len());
        let mut out = vec![0u8; block * replicas];
        for k in 0..replicas {
            let mut at = k * block;
            for t in tensors {
                let bytes = t.count * t.dtype.size();
                std::ptr::copy_nonoverlapping(
                    t.ptrs[k] as *const u8,
                    out[at..].as_mut_ptr(),
                    bytes,
                );
                at += bytes.next_multiple_of(8);
            }
        }
        out
    }

    /// Finishes a small allreduce whose data came with its agreement: `records` hold every
    /// rank's local replicas' bytes ([`Executor::inline_data`]; `per_rank` replicas each). The
    /// host sums them in world order (the summation order of one process holding every
    /// replica), divides for AVG, and writes the result into every local replica.
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`]; `records` came from [`world::agree`] with the
    /// inline data of these `tensors` on every rank.
    pub unsafe fn allreduce_inline(
        &self,
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
        mut records: world::Records,
        per_rank: &[usize],
    ) -> Result<()> {
        let block = inline_bytes(tensors);
        let mut world_blocks = Vec::with_capacity(per_rank.iter().sum());
        for (r, &n) in per_rank.iter().enumerate() {
            let base = records.inline_ptr(r);
            world_blocks.extend((0..n).map(|k| base + k * block));
        }
        let members: Vec<usize> = (0..world_blocks.len()).collect();
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        let backend = self.backend_for(Memory::Host);
        // One list of pointers for every tensor: its world blocks to sum, then the result's
        // first block and this rank's replicas to spread it to.
        let locals = tensors.first().map_or(0, |t| t.ptrs.len());
        let mut ptrs: Vec<usize> = Vec::with_capacity(world_blocks.len().max(1 + locals));
        let mut offset = 0;
        for t in tensors {
            ptrs.clear();
            ptrs.extend(world_blocks.iter().map(|p| p + offset));
            let sum = BucketView {
                dtype: t.dtype,
                segments: vec![Segment {
                    ptrs: &ptrs,
                    count: t.count,
                }],
            };
            // Every block of the records ends with the result; the first is copied out.
            match self.levels.reproducible && t.dtype.is_float() {
                true => backend.reduce_reproducible(&members, &sum, avg)?,
                false => backend.reduce(0, &members, &sum, avg)?,
            }
            drop(sum);
            ptrs.truncate(1);
            ptrs.extend_from_slice(&t.ptrs);
            let spread = BucketView {
                dtype: t.dtype,
                segments: vec![Segment {
                    ptrs: &ptrs,
                    count: t.count,
                }],
            };
            backend.spread(0, &spread, 0)?;
            offset += (t.count * t.dtype.size()).next_multiple_of(8);
        }
        Ok(())
    }
}

/// Bytes of one replica's `tensors` in a small collective's inline data, each tensor 8-byte
/// aligned.
pub fn inline_bytes(tensors: &[&TensorView]) -> usize {
    (tensors.iter())
        .map(|t| (t.count * t.dtype.size()).next_multiple_of(8))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    fn bucket(dtype: DType, memory: Memory, tensors: &[usize]) -> Bucket {
        Bucket {
            dtype,
            memory,
            tensors: tensors.to_vec(),
            elements: 10 * tensors.len(),
        }
    }

    #[test]
    fn in_place_backends_get_one_bucket_per_run_of_a_device_dtype() {
        let (d, h) = (Memory::Device, Memory::Host);
        let merged = merge_device_buckets(&[
            bucket(DType::F32, d, &[0, 1]),
            bucket(DType::F32, d, &[2]),
            bucket(DType::F16, d, &[3]),
            bucket(DType::F16, h, &[4]),
            bucket(DType::F16, h, &[5]),
            bucket(DType::F32, d, &[6]),
        ]);
        let shape: Vec<(DType, Memory, Vec<usize>, usize)> = merged
            .into_iter()
            .map(|b| (b.dtype, b.memory, b.tensors, b.elements))
            .collect();
        assert_eq!(
            shape,
            vec![
                (DType::F32, d, vec![0, 1, 2], 30),
                (DType::F16, d, vec![3], 10),
                (DType::F16, h, vec![4], 10),
                (DType::F16, h, vec![5], 10),
                (DType::F32, d, vec![6], 10),
            ]
        );
    }
}
