//! The CUDA backend: replicas in device memory, reduced on their GPUs in stream order.
//!
//! Stream protocol (DESIGN.md point 4, ProcessGroupNCCL's): [`Backend::begin`] records an event
//! on every caller stream and makes each device's communication stream wait on all of them;
//! the collective's kernels, copies and NCCL calls run on the communication streams;
//! [`Backend::end`] records a completion event per device and makes every caller stream wait
//! on all of them. The host never blocks except in [`Backend::synchronize`], for host tensors
//! (the callers' streams first) and for sparse coalescing (the indices): each a polled wait
//! within the timeout.
//!
//! One bucket: the replicas of each device are summed by one table-walk kernel (into a fusion
//! buffer when other devices take part, or straight back into every replica when the device
//! is alone); between devices, one grouped NCCL allreduce or the plan's peer/staged sum and copy
//! steps on the fusion buffers; then one kernel writes the (averaged) result into every local
//! replica.
//!
//! A broadcast is fused the same way: the root's tensors packed into its device's fusion
//! buffer, one grouped `ncclBroadcast` or one peer copy per other device, one unpack walk per
//! device.
//!
//! The sparse gather moves bytes between replicas ([`Backend::transfer`]): with NCCL, the moves
//! between devices are sends and receives in one group (each destination device receives a
//! range once; its other replicas copy it locally); otherwise `cuMemcpyAsync` copies on the
//! destination's stream, after an event from the source's.

mod bmuf;
mod driver;
#[cfg(test)]
mod emulate;
mod kernels;
mod nccl;
mod sparse;

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use parking_lot::Mutex;

use self::driver::{DeviceMemory, Event, PrimaryContext, Stream};
use self::kernels::{Kernels, Walk};
use self::nccl::CommSet;
use self::sparse::{CheckSlot, DeferredCheck};
use super::{
    size_class, Allocation, Backend, BmufFilter, BmufSpan, BucketView, Coalesced, IndexCheck,
    SliceRef, Transfer,
};
use crate::error::{Error, ErrorKind, Result};
use crate::options::Options;
use crate::plan::{device_groups, Step, StepOp, Topology, TransportChoice, Via};
use crate::types::{DType, Device, Memory, ReduceOp, Transport};

/// Library scratch memory of one device, grown on demand and reused by every collective.
#[derive(Default)]
struct Scratch {
    fusion: Option<DeviceMemory>,
    staging: Option<DeviceMemory>,
    /// Page-locked memory the host reads device data into (coalescing), and its size.
    host: Option<(driver::PinnedMemory, usize)>,
    /// Segment tables by content (they only change when the registry does).
    tables: HashMap<TableKey, DeviceMemory>,
}

/// A segment table as a cache key: equal only when every word is, but hashed on at most 64
/// words spread over it. Looked up on every collective: hashing all of ResNet-50's 5 KiB table
/// took about a third of the host time of issuing `allreduce_grads` (perf, fake driver). Tables
/// that differ only between the sampled words share a hash and are told apart by comparison.
#[derive(PartialEq, Eq)]
struct TableKey(Vec<u64>);

impl Hash for TableKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let words = &self.0;
        let stride = words.len().div_ceil(64).max(1);
        // Folded first (FxHash's step), then one write: a SipHash round per word would cost
        // more than the rest of the lookup.
        let fold = words
            .iter()
            .step_by(stride)
            .chain(words.last())
            .fold(words.len() as u64, |h, &w| {
                (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95)
            });
        state.write_u64(fold);
    }
}

/// Tables kept before the cache is flushed (a framework re-registering every step).
const MAX_TABLES: usize = 4096;

/// One group of replicas reduced together on one GPU (the plan's device group).
struct Group {
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

struct Replica {
    group: usize,
    /// The caller's stream (`CUstream`; 0 = the legacy default stream).
    stream: usize,
    /// Recorded on the caller's stream when a collective begins.
    start: Event,
}

/// What a collective leaves behind until it completes, besides its completion events.
#[derive(Default)]
struct Leftovers {
    /// Device index checks whose answers arrive with the collective.
    checks: Vec<DeferredCheck>,
    /// Memory its queued work, or work issued before it, may still use: coalescing maps, and
    /// [`Allocation`]s dropped meanwhile ([`Dropped`]). Spares once it completes.
    keep: Vec<DeviceMemory>,
    /// As `keep`, but not worth keeping for reuse (outgrown scratch buffers, the tables of a
    /// full cache): freed by the next `synchronize` once it completes.
    retire: Vec<DeviceMemory>,
}

/// Where this backend's dropped [`Allocation`]s go. Work already queued may still use them, so
/// `end` attaches them to the collective it ends, and they are freed when that completes. Once
/// the backend is gone (its `Drop` waited for all work), they are freed at once — or leaked, like
/// the rest, when the backend failed and queued work may never finish.
#[derive(Default)]
struct Dropped {
    mems: Vec<DeviceMemory>,
    /// `Some(leak)` after the backend's `Drop`.
    closed: Option<bool>,
}

/// The owner of an [`Allocation`]'s device memory: hands it to [`Dropped`] on drop.
struct Handed {
    mem: Option<DeviceMemory>,
    sink: Arc<Mutex<Dropped>>,
}

impl Drop for Handed {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else { return };
        let mut sink = self.sink.lock();
        match sink.closed {
            None => sink.mems.push(mem),
            Some(false) => {
                drop(sink);
                drop(mem);
            }
            Some(true) => std::mem::forget(mem),
        }
    }
}

/// Idle device memory of completed collectives (coalescing maps, outputs replaced by newer
/// ones), reused for the next per-step buffers: freeing and allocating them every step would
/// call `cuMemFree`, which waits for the whole device (the callers' streams included) and so
/// blocks the host. Nothing is freed while a collective is issued: spares beyond
/// [`MAX_SPARES`] retire and are freed by `synchronize` (which blocks anyway), by an
/// allocation that ran out of memory, or at destroy.
#[derive(Default)]
struct Spares {
    mems: Vec<DeviceMemory>,
    retired: Vec<DeviceMemory>,
    /// Outgrown page-locked staging buffers (`cuMemFreeHost` may wait for the device too).
    retired_host: Vec<driver::PinnedMemory>,
}

/// Spares kept for reuse at most; the oldest beyond that retire.
const MAX_SPARES: usize = 32;

/// Fresh per-step device memory is at least 64 KiB ([`size_class`]): the driver's allocation
/// granularity makes smaller buffers no cheaper.
const DEVICE_FLOOR: usize = 64 << 10;

impl Spares {
    /// The smallest spare on `ctx`'s device that holds `bytes` without wasting more than half
    /// of itself (small requests take anything up to 64 KiB).
    fn take(&mut self, ctx: &Arc<PrimaryContext>, bytes: usize) -> Option<DeviceMemory> {
        let most = bytes.saturating_mul(2).max(64 << 10);
        let i = (self.mems.iter().enumerate())
            .filter(|(_, m)| m.is_on(ctx) && m.bytes >= bytes && m.bytes <= most)
            .min_by_key(|(_, m)| m.bytes)
            .map(|(i, _)| i)?;
        Some(self.mems.remove(i))
    }

    /// Every spare and retired allocation on `ctx`'s device, for the caller to free (outside
    /// the state lock).
    fn release(&mut self, ctx: &Arc<PrimaryContext>) -> Vec<DeviceMemory> {
        let (mut mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.mems)
            .into_iter()
            .partition(|m| m.is_on(ctx));
        self.mems = others;
        let (retired, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|m| m.is_on(ctx));
        self.retired = others;
        mine.extend(retired);
        mine
    }

    /// Takes memory no queued work uses any more.
    fn put(&mut self, mems: Vec<DeviceMemory>) {
        self.mems.extend(mems);
        let excess = self.mems.len().saturating_sub(MAX_SPARES);
        self.retired.extend(self.mems.drain(..excess));
    }
}

/// A collective whose completion has not been observed yet.
struct Pending {
    issued: Instant,
    /// One completion event per group.
    done: Vec<Event>,
    leftovers: Leftovers,
}

#[derive(Default)]
struct State {
    pending: VecDeque<Pending>,
    /// Completion events for reuse.
    spare: Vec<Vec<Event>>,
    /// Gathered between `begin` and `end` for the collective being issued.
    issuing: Leftovers,
    /// Index-check buffers for reuse.
    check_slots: Vec<CheckSlot>,
    /// The first index found out of range by a completed device check, and how many more checks
    /// failed after it (a caller that never synchronizes must not grow this), reported by
    /// `synchronize`.
    index_error: Option<(Error, usize)>,
    /// Set by a timeout or a device fault: every later collective is refused.
    failed: Option<Error>,
    /// Memory of completed collectives for reuse.
    spares: Spares,
}

pub struct CudaBackend {
    groups: Vec<Group>,
    replicas: Vec<Replica>,
    /// [`distinct_callers`] of `replicas`, kept current by `set_stream`.
    callers: Vec<usize>,
    transport: TransportChoice,
    nccl_library: Option<String>,
    comms: Mutex<Option<Arc<CommSet>>>,
    state: Mutex<State>,
    dropped: Arc<Mutex<Dropped>>,
    timeout: Option<Duration>,
    driver_version: i32,
}

/// What opening the backend found out about the machine.
pub struct Opened {
    pub backend: CudaBackend,
    /// Replica-level n x n matrix from `cuDeviceCanAccessPeer`.
    pub peer: Vec<u8>,
    pub transport: TransportChoice,
    pub reason: String,
}

fn ordinal(device: Device) -> i32 {
    match device {
        Device::Cuda(o) => o,
        Device::Host => unreachable!("the CUDA backend only gets CUDA replicas"),
    }
}

fn deadline(issued: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| issued + t)
}

/// The deadline of NCCL setup work and group launches started at `issued` ([`nccl::setup_time`]).
fn setup_deadline(issued: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| issued + t.max(nccl::setup_time()))
}

/// One pause of a polling loop: yields at first, then sleeps 50 µs (a long wait should not
/// hold a core).
pub(super) fn back_off(spins: &mut u32) {
    *spins += 1;
    if *spins < 1000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl CudaBackend {
    /// Loads the driver, checks the devices, detects and enables peer access, picks the
    /// transport and compiles the kernels. Touches no tensor.
    pub fn open(options: &Options) -> Result<Opened> {
        driver::load()?;
        let count = driver::device_count()?;
        if count == 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "the CUDA driver reports no device",
            ));
        }
        let ordinals: Vec<i32> = options.replicas.iter().map(|d| ordinal(*d)).collect();
        for (r, &o) in ordinals.iter().enumerate() {
            if o < 0 || o >= count {
                return Err(Error::invalid(format!(
                    "replica {r}: CUDA device {o} does not exist (this machine has {count})"
                )));
            }
        }
        // Groups: the planner's (one per distinct GPU, in order of first replica; one per
        // replica when each is its own NCCL rank).
        let planned = device_groups(&Topology::from_options(options, None)?);
        let mut group_of = vec![0; ordinals.len()];
        let mut group_ordinals: Vec<i32> = Vec::with_capacity(planned.len());
        for (g, members) in planned.iter().enumerate() {
            members.iter().for_each(|&r| group_of[r] = g);
            group_ordinals.push(ordinals[members[0]]);
        }
        let ctxs: Vec<Arc<PrimaryContext>> = group_ordinals
            .iter()
            .map(|&o| PrimaryContext::retain(o).map(Arc::new))
            .collect::<Result<_>>()?;
        let peer = detect_peer_access(&ctxs, &group_of)?;
        if let Some(m) = &options.peer_access {
            let n = ordinals.len();
            for i in 0..n {
                for j in 0..n {
                    if m[i * n + j] != 0 && peer[i * n + j] == 0 {
                        return Err(Error::invalid(format!(
                            "peer_access matrix: entry [{i}][{j}] says replica {i} (cuda:{}) \
                             reads replica {j} (cuda:{}) directly, but the devices have no peer \
                             access",
                            ordinals[i], ordinals[j]
                        )));
                    }
                }
            }
        }
        let (transport, reason, nccl_library) = choose_transport(options.transport)?;
        let mut groups = Vec::with_capacity(ctxs.len());
        for (g, ctx) in ctxs.iter().enumerate() {
            let kernels = Kernels::for_device(ctx)?;
            let _bound = ctx.bind()?;
            groups.push(Group {
                local: (0..ordinals.len()).filter(|&r| group_of[r] == g).collect(),
                stream: Stream::new()?,
                progress: Event::new()?,
                scratch: Mutex::new(Scratch::default()),
                kernels,
                ctx: ctx.clone(),
            });
        }
        let mut replicas = Vec::with_capacity(ordinals.len());
        for &g in &group_of {
            let _bound = groups[g].ctx.bind()?;
            replicas.push(Replica {
                group: g,
                stream: 0,
                start: Event::new()?,
            });
        }
        let timeout = (options.timeout_ms > 0).then(|| Duration::from_millis(options.timeout_ms));
        let callers = distinct_callers(&groups, &replicas);
        let mut backend = CudaBackend {
            groups,
            replicas,
            callers,
            transport,
            nccl_library,
            comms: Mutex::new(None),
            state: Mutex::new(State::default()),
            dropped: Arc::default(),
            timeout,
            driver_version: driver::driver_version(),
        };
        let (transport, reason) = backend.settle_auto(options.transport, transport, reason);
        backend.transport = transport;
        Ok(Opened {
            backend,
            peer,
            transport,
            reason,
        })
    }

    /// AUTO promises NCCL only if it *initialises*: with several GPUs, create the communicators
    /// now and fall back to peer copies if that fails (NCCL requested: lazily, at first use).
    fn settle_auto(
        &self,
        requested: Transport,
        transport: TransportChoice,
        reason: String,
    ) -> (TransportChoice, String) {
        if requested != Transport::Auto || transport != TransportChoice::Nccl {
            return (transport, reason);
        }
        if self.groups.len() < 2 {
            return (transport, reason);
        }
        match self.comms(Instant::now()) {
            Ok(_) => (transport, reason),
            Err(e) => (
                TransportChoice::PeerCopy,
                format!(
                    "AUTO: NCCL loaded but its communicators did not initialise ({}); using \
                     peer_copy",
                    e.message
                ),
            ),
        }
    }

    /// The communicators of this context's device set (created on first use, shared).
    fn comms(&self, issued: Instant) -> Result<Arc<CommSet>> {
        let mut slot = self.comms.lock();
        if let Some(set) = slot.as_ref() {
            return Ok(set.clone());
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

    /// The segment table of `bucket` for `group`, in device memory (uploaded once per layout).
    fn table(&self, group: &Group, bucket: &BucketView<'_>) -> Result<u64> {
        let counts = bucket.segments.iter().map(|seg| seg.count);
        let ptrs = bucket
            .segments
            .iter()
            .map(|seg| group.local.iter().map(|&r| seg.ptrs[r] as u64));
        self.upload_table(group, table_of(counts, ptrs))
    }

    /// A table built by [`table_of`] in device memory on `group`'s device, uploaded the first
    /// time its content is seen and reused afterwards.
    fn upload_table(&self, group: &Group, host: Vec<u64>) -> Result<u64> {
        let host = TableKey(host);
        let mut scratch = group.scratch.lock();
        if let Some(mem) = scratch.tables.get(&host) {
            return Ok(mem.ptr);
        }
        if scratch.tables.len() >= MAX_TABLES {
            // Tables in the cache may still be read by queued kernels, this collective's
            // included: they are freed (or reused) once it completes, not now.
            let old = std::mem::take(&mut scratch.tables).into_values();
            self.state.lock().issuing.retire.extend(old);
        }
        let bytes: Vec<u8> = host.0.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let _bound = group.ctx.bind()?;
        let mem = self.fresh_memory(group, bytes.len())?;
        // In order on the group's stream, before the kernels that read the table.
        driver::upload(mem.ptr, &bytes, group.stream.0)?;
        let ptr = mem.ptr;
        scratch.tables.insert(host, mem);
        Ok(ptr)
    }

    /// At least `bytes` of device memory on `group`'s device for work about to be queued on
    /// its stream, contents undefined: a spare of a completed collective when one fits, else
    /// a fresh allocation of the size class ([`Spares`]).
    fn device_memory(&self, group: &Group, bytes: usize) -> Result<DeviceMemory> {
        if let Some(mem) = self.state.lock().spares.take(&group.ctx, bytes) {
            return Ok(mem);
        }
        self.fresh_memory(group, size_class(bytes, DEVICE_FLOOR))
    }

    /// A new allocation of `bytes` on `group`'s device. Out of memory, the idle spares on that
    /// device are freed and the allocation is tried once more.
    fn fresh_memory(&self, group: &Group, bytes: usize) -> Result<DeviceMemory> {
        DeviceMemory::uninit(&group.ctx, bytes).or_else(|first| {
            let idle = self.state.lock().spares.release(&group.ctx);
            if idle.is_empty() {
                return Err(first);
            }
            drop(idle); // cuMemFree each
            DeviceMemory::uninit(&group.ctx, bytes)
        })
    }

    /// Blocks the host until `group`'s stream has run everything queued on it so far, polling
    /// as `reap` does: within the timeout, watching NCCL's asynchronous errors
    /// (`cuStreamSynchronize` would wait forever behind a stuck NCCL kernel). Called inside a
    /// collective, so a timeout or an error fails the context through `collective_failed`.
    fn wait_group(&self, group: &Group) -> Result<()> {
        let _bound = group.ctx.bind()?;
        group.progress.record(group.stream.0)?;
        self.poll(
            deadline(Instant::now(), self.timeout),
            || group.progress.query(),
            |ms| {
                format!(
                    "cuda:{}: the work queued before this collective did not finish within the \
                     {ms} ms timeout; the context refuses further collectives (destroy it)",
                    group.ctx.ordinal
                )
            },
        )
    }

    /// Polls `done` until it holds or `limit` passes (the timeout, counted from when the wait
    /// began), watching NCCL's asynchronous errors meanwhile; `late(timeout_ms)` words the
    /// TIMEOUT.
    fn poll(
        &self,
        limit: Option<Instant>,
        done: impl Fn() -> Result<bool>,
        late: impl Fn(u128) -> String,
    ) -> Result<()> {
        let mut spins = 0u32;
        while !done()? {
            if let Some(comms) = self.comms.lock().as_ref() {
                comms.async_error()?;
            }
            if limit.is_some_and(|d| Instant::now() >= d) {
                let ms = self.timeout.unwrap_or_default().as_millis();
                return Err(Error::new(ErrorKind::Timeout, late(ms)));
            }
            back_off(&mut spins);
        }
        Ok(())
    }

    fn sync_group(&self, group: &Group) -> Result<()> {
        // SAFETY: our stream.
        driver::check(
            unsafe { sys::cuStreamSynchronize(group.stream.0) },
            "cuStreamSynchronize",
        )
    }

    /// A scratch buffer of at least `bytes` (fusion or staging) on `group`'s device.
    fn scratch(&self, group: &Group, bytes: usize, staging: bool) -> Result<u64> {
        let mut scratch = group.scratch.lock();
        let slot = if staging {
            &mut scratch.staging
        } else {
            &mut scratch.fusion
        };
        if let Some(mem) = slot.as_ref().filter(|m| m.bytes >= bytes) {
            return Ok(mem.ptr);
        }
        if let Some(old) = slot.take() {
            // The old buffer may still be read by queued work, on this device or (peer reads
            // and copies) on another: freed (or reused) once this collective completes, which
            // is after all of that on every device.
            self.state.lock().issuing.retire.push(old);
        }
        let mem = self.fresh_memory(group, bytes)?;
        let ptr = mem.ptr;
        *slot = Some(mem);
        Ok(ptr)
    }

    /// Records each distinct caller stream's start event: it marks the work queued there so far.
    fn mark_callers(&self) -> Result<()> {
        for r in self.callers.iter().map(|&r| &self.replicas[r]) {
            let _bound = self.groups[r.group].ctx.bind()?;
            r.start.record(r.stream as sys::CUstream)?;
        }
        Ok(())
    }

    /// Makes `to`'s stream wait for the work queued so far on `from`'s.
    fn order(&self, from: usize, to: usize) -> Result<()> {
        if from == to {
            return Ok(());
        }
        let src = &self.groups[from];
        let _bound = src.ctx.bind()?;
        src.progress.record(src.stream.0)?;
        src.progress.wait_on(self.groups[to].stream.0)
    }

    /// Drops completed collectives; a collective older than the timeout is a TIMEOUT.
    fn reap(&self, state: &mut State, wait: bool) -> Result<()> {
        while let Some(front) = state.pending.front() {
            let limit = deadline(front.issued, self.timeout);
            let mut spins = 0u32;
            loop {
                let mut complete = true;
                for ev in &front.done {
                    if !ev.query()? {
                        complete = false;
                        break;
                    }
                }
                if let Some(comms) = self.comms.lock().as_ref() {
                    comms.async_error()?;
                }
                if complete {
                    break;
                }
                if limit.is_some_and(|d| Instant::now() >= d) {
                    let waited = front.issued.elapsed();
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "a collective issued {:.1} ms ago did not complete within the \
                             {} ms timeout; the context refuses further collectives (destroy it)",
                            waited.as_secs_f64() * 1e3,
                            self.timeout.unwrap_or_default().as_millis()
                        ),
                    ));
                }
                if !wait {
                    return Ok(());
                }
                back_off(&mut spins);
            }
            let Pending {
                done, leftovers, ..
            } = state.pending.pop_front().expect("front exists");
            state.spare.push(done);
            for check in leftovers.checks {
                let (slot, error) = check.finish();
                match (&mut state.index_error, error) {
                    (Some((_, more)), Some(_)) => *more += 1,
                    (first @ None, Some(e)) => *first = Some((e, 0)),
                    (_, None) => {}
                }
                state.check_slots.push(slot);
            }
            state.spares.put(leftovers.keep);
            state.spares.retired.extend(leftovers.retire);
        }
        Ok(())
    }

    /// Records a failure that makes the context unusable, aborting the communicators.
    fn fail(&self, state: &mut State, err: Error) -> Error {
        if let Some(comms) = self.comms.lock().take() {
            comms.abort();
        }
        // The first failure is the one to report to every later call.
        state.failed.get_or_insert_with(|| err.clone());
        err
    }

    /// An NCCL group may be half launched: aborts the communicators (their kernels end, so the
    /// callers' streams do not wait forever) and refuses further collectives.
    fn nccl_failed(&self, err: Error) -> Error {
        let mut state = self.state.lock();
        self.fail(&mut state, err)
    }

    /// [`Backend::transfer`] over NCCL: the transfers between devices become sends and receives
    /// in one group (a destination device gets each source range once; its other replicas copy
    /// it locally after the receive); transfers within a device are copies.
    unsafe fn nccl_transfer(&self, batch: &[Transfer]) -> Result<()> {
        let issued = Instant::now();
        let mut moves = Vec::new();
        // Copies within a device: from the source itself, or from where a receive put it.
        let mut local = Vec::new();
        let mut after_receive = Vec::new();
        // (source address, bytes, destination group) -> where that group received it.
        let mut received: HashMap<(usize, usize, usize), (usize, usize)> = HashMap::new();
        for t in batch.iter().filter(|t| t.bytes > 0) {
            let (gs, gd) = (
                self.replicas[t.src_replica].group,
                self.replicas[t.dst_replica].group,
            );
            if gs == gd {
                local.push(*t);
                continue;
            }
            match received.entry((t.src, t.bytes, gd)) {
                std::collections::hash_map::Entry::Occupied(at) => {
                    let (src_replica, src) = *at.get();
                    after_receive.push(Transfer {
                        src_replica,
                        src,
                        ..*t
                    });
                }
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert((t.dst_replica, t.dst));
                    moves.push((gs, t.src as u64, gd, t.dst as u64, t.bytes));
                }
            }
        }
        // Not behind the receives on their streams: they do not need them.
        super::copy_each(self, &local)?;
        if !moves.is_empty() {
            self.comms(issued)?
                .send_recv(&moves, &self.launch(issued))
                .map_err(|e| self.nccl_failed(e))?;
        }
        // On the destinations' streams, after their receives.
        super::copy_each(self, &after_receive)
    }

    /// One table walk of `bucket` over `nrep` replicas of `table`, on `g`'s stream.
    #[allow(clippy::too_many_arguments)]
    fn walk(
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

    /// [`Backend::broadcast`], fused: the root's tensors are packed into its device's fusion
    /// buffer (one walk), which reaches every other device's by one grouped `ncclBroadcast`
    /// or, over PEER_COPY, one peer copy each (staged by the driver where a pair has no peer
    /// access); then one walk per device writes it into every local replica (the root's own
    /// tensors get their own bytes). Two launches per device instead of a copy per tensor and
    /// replica.
    unsafe fn fused_broadcast(&self, bucket: &BucketView<'_>, root: usize) -> Result<()> {
        let total = bucket.elements();
        if total == 0 || self.replicas.len() == 1 {
            return Ok(());
        }
        let issued = Instant::now();
        let bytes = bucket.dtype.size() * total;
        let root_group = self.replicas[root].group;
        // Buffers and tables first, as for the allreduce: nothing that may allocate or wait is
        // left between the exchange and the unpacks.
        let mut fusion = Vec::with_capacity(self.groups.len());
        let mut tables = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            fusion.push(self.scratch(g, bytes, false)?);
            tables.push(self.table(g, bucket)?);
        }
        let rg = &self.groups[root_group];
        let counts = bucket.segments.iter().map(|seg| seg.count);
        let root_only = bucket.segments.iter().map(|seg| [seg.ptrs[root] as u64]);
        let root_table = self.upload_table(rg, table_of(counts, root_only))?;
        let root_fusion = fusion[root_group];
        self.walk(rg, bucket, root_table, 1, root_fusion, Walk::Pack, None)?;
        if self.groups.len() > 1 && self.transport == TransportChoice::Nccl {
            self.comms(issued)?
                .broadcast(
                    bucket.dtype,
                    total,
                    root_group,
                    &fusion,
                    &self.launch(issued),
                )
                .map_err(|e| self.nccl_failed(e))?;
        } else {
            for (gi, g) in self.groups.iter().enumerate() {
                if gi == root_group {
                    continue;
                }
                self.order(root_group, gi)?;
                let _bound = g.ctx.bind()?;
                // SAFETY: both fusion buffers hold `bytes`; ordered after the pack.
                driver::check(
                    unsafe {
                        sys::cuMemcpyPeerAsync(
                            fusion[gi],
                            g.ctx.ctx,
                            root_fusion,
                            rg.ctx.ctx,
                            bytes,
                            g.stream.0,
                        )
                    },
                    "cuMemcpyPeerAsync (broadcast)",
                )?;
            }
            // The root's fusion buffer must not be repacked before every copy has read it.
            for gi in (0..self.groups.len()).filter(|&gi| gi != root_group) {
                self.order(gi, root_group)?;
            }
        }
        for (g, (&fb, &table)) in self.groups.iter().zip(fusion.iter().zip(&tables)) {
            self.walk(g, bucket, table, g.local.len(), fb, Walk::Unpack, None)?;
        }
        Ok(())
    }

    fn refuse_if_failed(state: &State) -> Result<()> {
        match &state.failed {
            Some(e) => Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "the context is unusable after an earlier failure ({}); destroy it",
                    e.message
                ),
            )),
            None => Ok(()),
        }
    }

    /// Observes the queue; a timeout or device fault poisons the context.
    fn observe(&self, wait: bool) -> Result<()> {
        let mut state = self.state.lock();
        Self::refuse_if_failed(&state)?;
        match self.reap(&mut state, wait) {
            Ok(()) => Ok(()),
            Err(e) if e.kind == ErrorKind::Timeout || e.kind == ErrorKind::Backend => {
                Err(self.fail(&mut state, e))
            }
            Err(e) => Err(e),
        }
    }

    /// The cross-device part of a bucket on the fusion buffers.
    fn exchange(
        &self,
        dtype: DType,
        total: usize,
        fusion: &[u64],
        steps: &[Step],
        issued: Instant,
    ) -> Result<()> {
        let bytes = dtype.size() * total;
        if self.transport == TransportChoice::Nccl {
            return self
                .comms(issued)?
                .allreduce(dtype, total, fusion, &self.launch(issued));
        }
        // (source, reader) pairs: the source's fusion buffer must not be rewritten (next bucket's
        // pack) before the reader's stream has read it.
        let mut reads: Vec<(usize, usize)> = Vec::new();
        for step in steps {
            let (gs, gd) = (self.replicas[step.src].group, self.replicas[step.dst].group);
            if gs == gd || step.via == Via::Local {
                continue; // local sums and copies are the pack and unpack walks
            }
            self.order(gs, gd)?;
            if !reads.contains(&(gs, gd)) {
                reads.push((gs, gd));
            }
            let (src, dst) = (&self.groups[gs], &self.groups[gd]);
            let _bound = dst.ctx.bind()?;
            match (step.op, step.via) {
                (StepOp::Sum, Via::Peer) => {
                    dst.kernels
                        .add(dst.stream.0, dtype, fusion[gd], fusion[gs], total)?;
                }
                (StepOp::Sum, _) => {
                    let staging = self.scratch(dst, bytes, true)?;
                    // SAFETY: both buffers hold `bytes`; ordered on dst's stream.
                    driver::check(
                        unsafe {
                            sys::cuMemcpyPeerAsync(
                                staging,
                                dst.ctx.ctx,
                                fusion[gs],
                                src.ctx.ctx,
                                bytes,
                                dst.stream.0,
                            )
                        },
                        "cuMemcpyPeerAsync (staged operand)",
                    )?;
                    dst.kernels
                        .add(dst.stream.0, dtype, fusion[gd], staging, total)?;
                }
                (StepOp::Copy, _) => {
                    // SAFETY: as above.
                    driver::check(
                        unsafe {
                            sys::cuMemcpyPeerAsync(
                                fusion[gd],
                                dst.ctx.ctx,
                                fusion[gs],
                                src.ctx.ctx,
                                bytes,
                                dst.stream.0,
                            )
                        },
                        "cuMemcpyPeerAsync (result copy)",
                    )?;
                }
                (StepOp::NcclAllreduce, _) => unreachable!("NCCL steps only in NCCL plans"),
            }
        }
        for (gs, gd) in reads {
            self.order(gd, gs)?;
        }
        Ok(())
    }
}

/// The first replica of each distinct caller stream (a stream handle names one stream of one
/// device; the legacy default stream, 0, is per device): begin and end record and wait once per
/// caller stream, since replicas often share one.
fn distinct_callers(groups: &[Group], replicas: &[Replica]) -> Vec<usize> {
    let mut seen: Vec<(i32, usize)> = Vec::with_capacity(replicas.len());
    let mut first = Vec::with_capacity(replicas.len());
    for (i, r) in replicas.iter().enumerate() {
        let key = (groups[r.group].ctx.ordinal, r.stream);
        if !seen.contains(&key) {
            seen.push(key);
            first.push(i);
        }
    }
    first
}

/// A kernel table: `{offset, count}` per segment, then each segment's pointers (one per local
/// replica for the walks; params, W and D for BMUF).
fn table_of<P: IntoIterator<Item = u64>>(
    counts: impl Iterator<Item = usize>,
    ptrs: impl Iterator<Item = P>,
) -> Vec<u64> {
    // Room for each segment's offset, count and two pointers (two replicas per GPU, or the
    // BMUF triple's first two); more grows once. Built on every collective: no repeated growth.
    let mut host = Vec::with_capacity(counts.size_hint().0 * 4);
    let mut offset = 0u64;
    for count in counts {
        host.push(offset);
        host.push(count as u64);
        offset += count as u64;
    }
    for seg in ptrs {
        host.extend(seg);
    }
    host
}

/// Replica-level peer matrix; pairs that can are enabled both ways.
fn detect_peer_access(ctxs: &[Arc<PrimaryContext>], group_of: &[usize]) -> Result<Vec<u8>> {
    let g = ctxs.len();
    let mut device = vec![0u8; g * g];
    for a in 0..g {
        for b in 0..g {
            let same = a == b || ctxs[a].ordinal == ctxs[b].ordinal;
            if same
                || (driver::can_access_peer(&ctxs[a], &ctxs[b])?
                    && driver::enable_peer_access(&ctxs[a], &ctxs[b])?)
            {
                device[a * g + b] = 1;
            }
        }
    }
    let n = group_of.len();
    let mut peer = vec![0u8; n * n];
    for i in 0..n {
        for j in 0..n {
            peer[i * n + j] = device[group_of[i] * g + group_of[j]];
        }
    }
    Ok(peer)
}

fn choose_transport(requested: Transport) -> Result<(TransportChoice, String, Option<String>)> {
    match requested {
        Transport::PeerCopy => Ok((
            TransportChoice::PeerCopy,
            "PEER_COPY requested".to_owned(),
            None,
        )),
        Transport::Nccl => match nccl::load() {
            Ok(lib) => Ok((
                TransportChoice::Nccl,
                format!("NCCL requested: {lib}"),
                Some(lib),
            )),
            Err(e) => Err(Error::new(
                ErrorKind::Unavailable,
                format!("transport NCCL was requested but {}", e.message),
            )),
        },
        _ => match nccl::load() {
            Ok(lib) => Ok((
                TransportChoice::Nccl,
                format!("AUTO: NCCL loaded: {lib}"),
                Some(lib),
            )),
            Err(e) => Ok((
                TransportChoice::PeerCopy,
                format!("AUTO: NCCL unavailable ({}); using peer_copy", e.message),
                None,
            )),
        },
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn memory_of(&self, replica: usize, ptr: usize) -> Result<Memory> {
        let group = &self.groups[self.replicas[replica].group];
        let want = group.ctx.ordinal;
        let _bound = group.ctx.bind()?;
        match driver::pointer_memory(ptr)? {
            // Managed memory is device memory for every GPU, wherever it lives now: its memory
            // type may read HOST or DEVICE depending on where it was last touched.
            Some((_, _, true)) => Ok(Memory::Device),
            None | Some((false, _, _)) => Ok(Memory::Host),
            Some((true, got, false)) if got == want => Ok(Memory::Device),
            Some((true, got, false)) => Err(Error::invalid(format!(
                "device memory of cuda:{got}, but replica {replica} is on cuda:{want}"
            ))),
        }
    }

    fn set_stream(&mut self, replica: usize, stream: usize) -> Result<()> {
        let group = &self.groups[self.replicas[replica].group];
        // The special handles: cuStreamGetCtx would answer with the calling thread's current
        // context, not the stream's.
        const LEGACY: usize = 0x1;
        const PER_THREAD: usize = 0x2;
        if stream == PER_THREAD {
            return Err(Error::invalid(format!(
                "cuda_stream: cudaStreamPerThread (0x2) for replica {replica} names a different \
                 stream on every thread, so dpsync's events would not order the caller's work; \
                 pass the stream's own handle"
            )));
        }
        // The legacy default stream of the replica's device, whichever handle names it.
        let stream = if stream == LEGACY { 0 } else { stream };
        if stream != 0 {
            let ctx = driver::stream_context(stream as sys::CUstream).map_err(|e| {
                Error::invalid(format!(
                    "cuda_stream: not a usable stream for replica {replica} ({})",
                    e.message
                ))
            })?;
            if ctx != group.ctx.ctx {
                return Err(Error::invalid(format!(
                    "cuda_stream: the stream belongs to another context than replica {replica}'s \
                     device (cuda:{}, primary context)",
                    group.ctx.ordinal
                )));
            }
        }
        self.replicas[replica].stream = stream;
        self.callers = distinct_callers(&self.groups, &self.replicas);
        Ok(())
    }

    fn begin(&self) -> Result<()> {
        self.observe(false)?;
        self.mark_callers()?;
        for g in &self.groups {
            // The stream names its context, but some drivers want it current for a wait on an
            // event of another device; cheap when it already is.
            let _bound = g.ctx.bind()?;
            for r in self.callers.iter().map(|&r| &self.replicas[r]) {
                r.start.wait_on(g.stream.0)?;
            }
        }
        Ok(())
    }

    fn in_place(&self) -> bool {
        self.groups.len() == 1
    }

    fn wait_for_callers(&self) -> Result<()> {
        // Re-recording the start events is fine: the waits `begin` queued captured the earlier
        // record.
        self.mark_callers()?;
        // One deadline for all the callers: the timeout bounds the whole wait.
        let limit = deadline(Instant::now(), self.timeout);
        for &i in &self.callers {
            let start = &self.replicas[i].start;
            self.poll(
                limit,
                || start.query(),
                |ms| {
                    format!(
                        "host memory on CUDA replicas waits for the work already queued on the \
                         callers' streams, and replica {i}'s stream did not finish it within the \
                         {ms} ms timeout; the context refuses further collectives (destroy it)"
                    )
                },
            )?;
        }
        Ok(())
    }

    fn collective_failed(&self, err: Error) -> Error {
        match err.kind {
            // Running out of memory leaves the device and the communicators sound: the work
            // queued before it completes, and a later call may fit.
            ErrorKind::Backend if err.is_out_of_memory() => err,
            ErrorKind::Backend | ErrorKind::Timeout => self.nccl_failed(err),
            _ => err,
        }
    }

    fn end(&self, join: bool) -> Result<()> {
        let mut state = self.state.lock();
        let mut done = match state.spare.pop() {
            Some(events) => events,
            None => {
                let mut events = Vec::with_capacity(self.groups.len());
                for g in &self.groups {
                    let _bound = g.ctx.bind()?;
                    events.push(Event::new()?);
                }
                events
            }
        };
        for (g, ev) in self.groups.iter().zip(&mut done) {
            let _bound = g.ctx.bind()?;
            ev.record(g.stream.0)?;
        }
        // Unjoined: every later collective's work follows this one on the groups' streams, so
        // the callers wait for it through that collective's events.
        let callers = if join { &self.callers[..] } else { &[] };
        for r in callers.iter().map(|&r| &self.replicas[r]) {
            let _bound = self.groups[r.group].ctx.bind()?;
            for ev in &done {
                ev.wait_on(r.stream as sys::CUstream)?;
            }
        }
        let mut leftovers = std::mem::take(&mut state.issuing);
        leftovers.keep.append(&mut self.dropped.lock().mems);
        state.pending.push_back(Pending {
            issued: Instant::now(),
            done,
            leftovers,
        });
        Ok(())
    }

    unsafe fn allreduce(
        &self,
        bucket: &BucketView<'_>,
        op: ReduceOp,
        divisor: usize,
        steps: &[Step],
    ) -> Result<()> {
        let total = bucket.elements();
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        if total == 0 || (self.replicas.len() == 1 && avg.is_none()) {
            return Ok(());
        }
        let dtype = bucket.dtype;
        let walk = |g: &Group, table: u64, fusion: u64, mode: Walk, avg: Option<usize>| {
            self.walk(g, bucket, table, g.local.len(), fusion, mode, avg)
        };
        if self.groups.len() == 1 {
            let g = &self.groups[0];
            return walk(g, self.table(g, bucket)?, 0, Walk::Allreduce, avg);
        }
        let issued = Instant::now();
        let bytes = dtype.size() * total;
        let mut fusion = Vec::with_capacity(self.groups.len());
        let mut tables = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let fb = self.scratch(g, bytes, false)?;
            let table = self.table(g, bucket)?;
            walk(g, table, fb, Walk::Pack, None)?;
            fusion.push(fb);
            tables.push(table);
        }
        if let Err(e) = self.exchange(dtype, total, &fusion, steps, issued) {
            return Err(if self.transport == TransportChoice::Nccl {
                self.nccl_failed(e)
            } else {
                e
            });
        }
        for (i, g) in self.groups.iter().enumerate() {
            walk(g, tables[i], fusion[i], Walk::Unpack, avg)?;
        }
        Ok(())
    }

    unsafe fn broadcast(&self, bucket: &BucketView<'_>, root: usize) -> Result<()> {
        self.fused_broadcast(bucket, root)
    }

    fn alloc(&self, replica: usize, bytes: usize) -> Result<Allocation> {
        let g = &self.groups[self.replicas[replica].group];
        let mem = self.device_memory(g, bytes)?;
        mem.zero(bytes, g.stream.0)?;
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
        let g = &self.groups[gd];
        let _bound = g.ctx.bind()?;
        if gs == gd {
            // SAFETY: the caller guarantees both ranges.
            return driver::check(
                unsafe { sys::cuMemcpyAsync(dst as u64, src as u64, bytes, g.stream.0) },
                "cuMemcpyAsync (replica copy)",
            );
        }
        // Between devices, the peer copy names both contexts rather than relying on UVA to find
        // them; the driver stages it where the pair has no peer access.
        // SAFETY: as above.
        driver::check(
            unsafe {
                sys::cuMemcpyPeerAsync(
                    dst as u64,
                    g.ctx.ctx,
                    src as u64,
                    self.groups[gs].ctx.ctx,
                    bytes,
                    g.stream.0,
                )
            },
            "cuMemcpyPeerAsync (replica copy)",
        )
    }

    unsafe fn transfer(&self, batch: &[Transfer]) -> Result<()> {
        if self.transport == TransportChoice::Nccl && self.groups.len() > 1 {
            self.nccl_transfer(batch)
        } else {
            super::copy_each(self, batch)
        }
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

    unsafe fn coalesce_into(
        &self,
        replica: usize,
        slice: &SliceRef<'_>,
        alloc: &mut dyn FnMut(usize) -> Result<Allocation>,
    ) -> Result<Coalesced> {
        self.device_coalesce(replica, slice, alloc)
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

    /// Waits for everything issued, then reports (once) the indices that device checks found
    /// out of range.
    fn synchronize(&self) -> Result<()> {
        self.observe(true)?;
        let (retired, retired_host, index_error) = {
            let mut state = self.state.lock();
            let spares = &mut state.spares;
            let retired = std::mem::take(&mut spares.retired);
            let retired_host = std::mem::take(&mut spares.retired_host);
            (retired, retired_host, state.index_error.take())
        };
        // The host waits here anyway: free what retired (cuMemFree waits for the device), not
        // under the state lock.
        drop(retired);
        drop(retired_host);
        match index_error {
            None => Ok(()),
            Some((mut first, more)) => {
                if more > 0 {
                    first.message += &format!(" (and {more} more out-of-range checks)");
                }
                Err(first)
            }
        }
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
        if failed {
            // As above: memory queued work may still read is leaked, not freed.
            let state = self.state.get_mut();
            std::mem::forget(std::mem::take(&mut state.pending));
            std::mem::forget(std::mem::take(&mut state.issuing));
            // Idle, but freeing may wait for a device whose work never finishes.
            std::mem::forget(std::mem::take(&mut state.spares));
            if let Some(comms) = self.comms.get_mut().take() {
                comms.abort();
            }
        }
        // The communicators go first (finalized and destroyed if this was their last context),
        // while the streams NCCL queued on and the contexts' references are still alive; the
        // fields would drop them after `groups`.
        drop(self.comms.get_mut().take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of(key: &TableKey) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        h.finish()
    }

    #[test]
    fn table_keys_differing_between_sampled_words_stay_distinct() {
        // 644 words (ResNet-50 on two replicas): a stride of 11, so word 5 is not sampled.
        let a: Vec<u64> = (0..644).map(|i| 0x7f00_0000_0000 + i * 4096).collect();
        let mut b = a.clone();
        b[5] += 8;
        let (ka, kb) = (TableKey(a.clone()), TableKey(b));
        assert_eq!(hash_of(&ka), hash_of(&kb), "word 5 is not sampled");
        assert!(ka != kb);
        let mut cache = HashMap::new();
        cache.insert(ka, 1);
        cache.insert(kb, 2);
        assert_eq!(cache.len(), 2, "same hash, different tables: two entries");
        assert_eq!(cache.get(&TableKey(a.clone())), Some(&1));
        // A sampled word and the length change the hash.
        let mut c = a.clone();
        c[0] += 8;
        assert_ne!(hash_of(&TableKey(c)), hash_of(&TableKey(a.clone())));
        assert_ne!(hash_of(&TableKey(a[..643].to_vec())), hash_of(&TableKey(a)));
    }

    /// Runs everywhere: where NCCL is missing (CI) AUTO must fall back and NCCL must refuse.
    #[test]
    fn missing_nccl_means_peer_copy_for_auto_and_unavailable_for_nccl() {
        if nccl::load().is_ok() {
            eprintln!("missing-NCCL paths: skipped: NCCL is installed here");
            return;
        }
        let (t, reason, lib) = choose_transport(Transport::Auto).unwrap();
        assert_eq!(t, TransportChoice::PeerCopy);
        assert!(reason.contains("NCCL unavailable") && reason.contains("libnccl.so.2"));
        assert!(lib.is_none());
        let err = choose_transport(Transport::Nccl).err().unwrap();
        assert_eq!(err.kind, ErrorKind::Unavailable);
        assert!(
            err.message.contains("DPSYNC_NCCL_LIBRARY"),
            "{}",
            err.message
        );
        let (t, _, _) = choose_transport(Transport::PeerCopy).unwrap();
        assert_eq!(t, TransportChoice::PeerCopy);
    }
}
