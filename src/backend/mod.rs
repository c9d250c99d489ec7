//! Backends: the primitives one kind of memory offers. They trust their input (the registry and
//! the plan validated it) and return only errors a caller cannot foresee: a missing runtime, a
//! failing device call, a timeout. Algorithms over them live in [`crate::exec`]: a backend
//! offers buffers, copies, sum and scale kernels, a grouped transfer and stream events
//! ([`Backend`], and where they apply [`Streams`], [`Links`] and [`Collective`]).

mod bmuf;
mod collective;
mod cuda;
pub(crate) mod host;
#[cfg(feature = "mpi")]
mod mpi;
mod ranks;
pub(crate) mod select;
pub(crate) mod spares;
mod sparse;

pub use bmuf::{bmuf_state_dtype, BmufFilter, BmufSpan};
pub(crate) use collective::Collective;
pub use collective::{Move, PeerOp};
#[cfg(feature = "mpi")]
pub(crate) use ranks::allgather_packed;
#[cfg(feature = "mpi")]
pub(crate) use ranks::Gate;
pub(crate) use ranks::{process_gone, Channel, EveryRank, Ranks, Ticket};

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::types::{DType, Memory};

pub use sparse::{
    coalescing_order, narrow_indices, widen_indices, Coalesced, IndexCheck, SliceRef, ValuesRef,
};

/// The size to allocate per-step memory with, whose size varies a little from step to step
/// (sparse gathers): at least `floor`, rounded up to one of four sizes per doubling (at most a
/// quarter wasted), so that the next step's slightly larger request still fits the spare.
pub fn size_class(bytes: usize, floor: usize) -> usize {
    let b = bytes.max(floor).max(8);
    let step = b.next_power_of_two() / 8;
    b.div_ceil(step) * step
}

/// One tensor's elements on every replica: `ptrs[r]` is replica r's first element.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub ptrs: &'a [usize],
    pub count: usize,
}

/// Tensors of one dtype reduced or copied together (a fusion bucket).
#[derive(Clone, Debug)]
pub struct BucketView<'a> {
    pub dtype: DType,
    pub segments: Vec<Segment<'a>>,
}

impl BucketView<'_> {
    pub fn elements(&self) -> usize {
        self.segments.iter().map(|s| s.count).sum()
    }
}

/// Memory the library owns on one replica (host memory for host replicas, device memory for
/// CUDA ones): sparse outputs, BMUF state, staging. Its contents are undefined (whoever reads it
/// writes it first). Dropped, it goes back to its backend's [`spares::Spares`] for reuse — on a
/// stream-ordered backend only once the work issued before the drop has completed (it may still
/// read or write the memory: a replaced output, an error path), so dropping is always safe.
pub struct Allocation {
    ptr: usize,
    bytes: usize,
    /// Whatever frees the memory when dropped (a host vector, a device allocation).
    _owner: Box<dyn Send + Sync>,
}

impl Allocation {
    pub(crate) fn new(ptr: usize, bytes: usize, owner: Box<dyn Send + Sync>) -> Allocation {
        Allocation {
            ptr,
            bytes,
            _owner: owner,
        }
    }

    /// Address of the first byte, aligned to at least 16 bytes.
    pub fn ptr(&self) -> usize {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Allocation({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

/// Which buffer of a group [`Links::buffer`] returns: the fusion buffer a bucket is packed
/// into, or the staging buffer a peer's fusion buffer is copied into before it is summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Fusion,
    Staging,
}

/// One pass of a reproducible sum whose contributions stay on their devices
/// ([`Links::repro_stage`]; kernels/dense.cu `repro_stage`), per bucket element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReproStage {
    /// `fields := ` the largest exponent field over the group's replicas.
    Fields = 0,
    /// `sums := ` the group's replicas cut onto the grid of `fields` (the clique's by then),
    /// summed as integers.
    Cut = 1,
    /// Every replica of the group := `sums` (the clique's by then) converted back.
    Uncut = 2,
}

/// Which replicas of a group [`Links::pack`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Members {
    /// Every member, summed in group order.
    All,
    /// One replica of the group, copied (the root of a broadcast).
    One(usize),
}

/// A kernel's view of one bucket over some replicas of one group ([`Links::layout`]), made
/// before any transfer so that nothing between a transfer and the unpacks may allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The segment table in device memory.
    pub(crate) table: u64,
    /// How many replicas it lists per segment.
    pub(crate) replicas: usize,
}

/// The primitives of one kind of memory. The replicas are split into groups (the plan's
/// level 1, [`crate::plan::Levels`]: replicas sharing a device, or all host replicas); group
/// `g` is the plan's group `g`, as both come from one topology ([`open`]).
pub(crate) trait Backend: Send {
    fn name(&self) -> &'static str;

    /// What `dpsync_describe` shows of this backend under "backend".
    fn describe(&self) -> serde_json::Value;

    /// Level 1 in place: every member of `group` (in `members`' order, the summation order)
    /// ends with the sum over the members of each segment, divided by `avg` when given.
    ///
    /// # Safety
    /// Every pointer of the group's members is valid for `count` elements of `dtype`, and one
    /// segment's replicas do not overlap.
    unsafe fn reduce(
        &self,
        group: usize,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
    ) -> Result<()>;

    /// A reduce-scatter of a group that is the whole collective (host memory in one process,
    /// or the replicas of one GPU): replica `r`'s piece `owned(segment, r)` (first element,
    /// count) of each segment := the sum over `members` (in that order, as
    /// [`Backend::reduce`] sums), divided by `avg`; nothing else is written. CUDA's kernel
    /// finds the owners by the contract's rule, which `owned` must be. Elsewhere the executor
    /// reduces a copy of the bucket instead (exec/shard.rs).
    ///
    /// # Safety
    /// As for [`Backend::reduce`].
    unsafe fn reduce_owned(
        &self,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        let _ = (members, bucket, avg, owned);
        Err(Error::new(
            crate::error::ErrorKind::Panic,
            format!("{} offers no reduce_owned", self.name()),
        ))
    }

    /// An allgather of a group that is the whole collective (host memory in one process, or
    /// the replicas of one GPU): replica `r`'s piece `owned(segment, r)` (first element,
    /// count) of each segment copied to every other replica; nothing else is written.
    /// Elsewhere the executor broadcasts each replica's pieces instead (exec/shard.rs).
    ///
    /// # Safety
    /// As for [`Backend::spread`].
    unsafe fn spread_owned(
        &self,
        bucket: &BucketView<'_>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        let _ = (bucket, owned);
        Err(Error::new(
            crate::error::ErrorKind::Panic,
            format!("{} offers no spread_owned", self.name()),
        ))
    }

    /// [`Backend::reduce`] of a group that is the whole collective, reproducibly
    /// (`dpsync_options_set_reproducible`, backend/host/repro.rs): the float sums are a
    /// function of the members' values alone, whatever their order. The host: any float
    /// dtype. CUDA: the replicas of one device, F32 and F64 (the same arithmetic in a kernel,
    /// the same bytes). The executor asks only there; elsewhere it stages the memory through
    /// the host's kernels (exec/repro.rs).
    ///
    /// # Safety
    /// As for [`Backend::reduce`].
    unsafe fn reduce_reproducible(
        &self,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
    ) -> Result<()> {
        let _ = (members, bucket, avg);
        Err(Error::new(
            crate::error::ErrorKind::Panic,
            format!("{} offers no reduce_reproducible", self.name()),
        ))
    }

    /// Level 1 in place: every member of `group` gets replica `root`'s segments (`root` is a
    /// member).
    ///
    /// # Safety
    /// As for [`Backend::reduce`].
    unsafe fn spread(&self, group: usize, bucket: &BucketView<'_>, root: usize) -> Result<()>;

    /// At least `bytes` bytes of library-owned memory on `replica`, contents undefined: an idle
    /// block of an earlier step when one fits ([`spares::Spares`]), else fresh memory of the
    /// size class, so that the next steps' slightly larger requests still fit it.
    fn alloc(&self, replica: usize, bytes: usize) -> Result<Allocation>;

    /// Copies `bytes` from `src` on replica `src_replica` to `dst` on replica `dst_replica`, after
    /// the work already issued that writes the source.
    ///
    /// # Safety
    /// Both ranges are valid on their replicas and do not overlap.
    unsafe fn copy(
        &self,
        src_replica: usize,
        src: usize,
        dst_replica: usize,
        dst: usize,
        bytes: usize,
    ) -> Result<()>;

    /// `x := x / divisor` for `count` elements of `dtype` at `ptr` on `replica` (f16/bf16
    /// computed in f32 and rounded once, integers truncated toward zero): sparse gradients, and
    /// dense buckets summed early by `dpsync_grad_ready`, under DPSYNC_REDUCE_AVG.
    ///
    /// # Safety
    /// `ptr` is valid for `count` aligned elements of `dtype` on `replica`.
    unsafe fn divide(
        &self,
        replica: usize,
        dtype: DType,
        ptr: usize,
        count: usize,
        divisor: usize,
    ) -> Result<()>;

    /// BMUF: loads the filter state of one bucket on `replica`. For every span and element i:
    /// `w[i] = params[i]` widened exactly to [`bmuf_state_dtype`]`(dtype)`, and `d[i] = 0`.
    /// `params` is only read.
    ///
    /// # Safety
    /// Every span is valid on `replica` as [`BmufSpan`] describes; spans do not overlap.
    unsafe fn bmuf_load(&self, replica: usize, dtype: DType, spans: &[BmufSpan]) -> Result<()>;

    /// BMUF: one filter step over one bucket on `replica`, after the averaging collective has
    /// left the mean over all replicas, `A`, in `params`. Per element, in the state type `S`
    /// ([`bmuf_state_dtype`]) with `mu = block_momentum as S`, `eta = block_lr as S`, each
    /// operation rounded as written (no fused multiply-add, so that every backend gives the same
    /// bytes):
    ///
    /// ```text
    /// a  = params[i] as S                      (exact)
    /// wg = nesterov ? w[i] + mu * d[i] : w[i]
    /// g  = a - wg
    /// d' = mu * d[i] + eta * g                 -> d[i]
    /// w' = w[i] + d'                           -> w[i]
    /// params[i] = round(nesterov ? w' + mu * d' : w')   (round to nearest even, once)
    /// ```
    ///
    /// Every replica runs it on identical `A`, `W` and `D`, so every replica ends with identical
    /// bytes without a broadcast.
    ///
    /// # Safety
    /// As for [`Backend::bmuf_load`].
    unsafe fn bmuf_update(
        &self,
        replica: usize,
        dtype: DType,
        spans: &[BmufSpan],
        filter: &BmufFilter,
    ) -> Result<()>;

    /// Sparse gradients: checks that every index of `check` is in `[0, bound)`; reads only.
    /// A host backend answers now, with [`IndexCheck::error`] for the first index out of range.
    /// A stream-ordered backend may instead run the check on the device inside the current
    /// collective and report that same error from [`Backend::synchronize`].
    ///
    /// # Safety
    /// `check.indices` is valid for `rows` aligned elements of its dtype on its replica.
    unsafe fn check_indices(&self, check: &IndexCheck<'_>) -> Result<()>;

    /// Sparse gradients: coalesces each `(replica, slice)` into new memory of that replica from
    /// `alloc(replica, bytes)` (of at least the size asked; its contents need not be zero: every
    /// byte of the result is written): its indices sorted ascending without duplicates, and for
    /// each values array the rows of equal indices summed in input order (f16/bf16 accumulated in
    /// f32, every output element rounded once). Deterministic: the same input gives the same
    /// bytes on any replica. A result's row count depends on the data (a device backend has to
    /// read it back). The results are in the order of `slices`; a backend may work on them at
    /// once (the host sorts on several threads). With `reproducible`, float rows of one index
    /// are summed as reproducible sums (backend/host/repro.rs), whatever their order; backends
    /// without that refuse it (the executor coalesces their rows on the host, exec/sparse.rs).
    ///
    /// # Safety
    /// Every slice's pointers are valid on its replica for `rows` aligned indices and rows.
    unsafe fn coalesce(
        &self,
        slices: &[(usize, SliceRef<'_>)],
        reproducible: bool,
        alloc: &mut dyn FnMut(usize, usize) -> Result<Allocation>,
    ) -> Result<Vec<Coalesced>>;

    /// Waits for every operation issued so far.
    fn synchronize(&self) -> Result<()>;

    /// The stream hooks of a backend whose work is queued on device streams; `None` where work
    /// is done when a call returns (the host).
    fn streams(&self) -> Option<&dyn Streams>;

    /// [`Backend::streams`], to change a replica's stream.
    fn streams_mut(&mut self) -> Option<&mut dyn Streams>;

    /// The level-2 primitives of a backend whose groups are separate devices; `None` where every
    /// replica is in one group's memory (the host).
    fn links(&self) -> Option<&dyn Links>;

    /// This process's part of one collective over the device groups of a whole world (NCCL
    /// across ranks); `None` where the backend has none (the host, or no NCCL).
    fn world_collective(&self) -> Option<&dyn WorldCollective> {
        None
    }
}

/// Joining the ranks' device groups into one collective (NCCL: one rank per group of every
/// process, the unique id sent through the world's engine). Once joined, [`Links::collective`]
/// spans the world: its buffers are this process's groups', its roots ranks of the whole clique.
/// The steps are separate so that the processes can agree between them ([`crate::exec::world`]).
pub(crate) trait WorldCollective {
    /// A new clique's id (one process makes it; every process joins with it).
    fn new_id(&self) -> Result<Vec<u8>>;

    /// Issues this process's members, ranks `first..` of `total`, without waiting: the clique
    /// [`WorldCollective::shrink`] made where `shrunk`, else a new one (`id`).
    fn issue(&self, id: &[u8], first: usize, total: usize, shrunk: bool) -> Result<()>;

    /// Waits until the issued members are ready (the setup deadline bounds it).
    fn ready(&self) -> Result<()>;

    /// Gives the clique up (another process failed its part): collectives stay local.
    fn leave(&self);

    /// Whether a clique shrunk after a loss waits to be joined as ranks `first..` of `total`.
    fn shrunk(&self, first: usize, total: usize) -> bool;

    /// An elastic world's call begins (`on`) or ends: meanwhile a failure keeps the clique
    /// alive for a shrink; once it ended, what a failure kept is aborted.
    fn hold(&self, on: bool);

    /// While an elastic call is under way: waits on the device fail (BACKEND_ERROR) once one
    /// of `peers` (rank, process id; ranks on this host) is gone, which NCCL may never report.
    /// Empty: none (once the vote found the loss, before the streams are drained).
    fn watch(&self, peers: Vec<(usize, u32)>);

    /// After a loss, before the streams are drained: this process's members shrunk over the
    /// survivors (clique ranks `lost` of `total` excluded; issued, not waited for) and the old
    /// clique's operations ended. False where NCCL cannot shrink: the rebuild makes a new one.
    fn shrink(&self, lost: &[usize], total: usize) -> bool;
}

/// The stream protocol of a device backend: the executor brackets every collective with
/// [`Streams::begin`] and [`Streams::end`], so that its work runs after what the callers queued
/// before it and what they queue afterwards runs after it.
/// Page-locked host memory of one early bucket ([`Streams::bucket_stage`]), given back for a
/// later bucket when dropped (so dropped only once nothing reads or writes it).
pub(crate) struct BucketStage {
    pub(crate) ptr: usize,
    /// Held only: the memory goes when this is dropped.
    pub(crate) _memory: Box<dyn std::any::Any + Send>,
}

/// [`Streams::queued_done`]: `Ok(true)` once the work is done, an error if the device failed.
pub(crate) type Done = Arc<dyn Fn() -> Result<bool> + Send + Sync>;

pub(crate) trait Streams {
    /// Which memory `ptr` (registered on `replica`) is in.
    fn memory_of(&self, replica: usize, ptr: usize) -> Result<Memory>;

    /// The caller's stream (a `CUstream`, 0 = legacy default stream) for `replica`.
    fn set_stream(&mut self, replica: usize, stream: usize) -> Result<()>;

    /// Opens a collective: the work issued until [`Streams::end`] runs after the work already
    /// queued on the callers' streams.
    fn begin(&self) -> Result<()>;

    /// Blocks the host until the work already queued on the callers' streams has completed.
    /// Host memory on a device replica (a CPU op's output, or the target of a device-to-host
    /// copy on the caller's stream) is reduced by host threads, which no event can order, so
    /// the executor calls this before touching it, inside the collective's bracket (so its
    /// TIMEOUT goes through [`Streams::collective_failed`]).
    fn wait_for_callers(&self) -> Result<()>;

    /// Closes a collective: work queued on the callers' streams afterwards waits for it when
    /// `join` is true. With `join` false the callers go on unhindered (a bucket reduced early by
    /// `dpsync_grad_ready` while backward continues); a later joined collective makes them wait,
    /// as its work follows this one on the backend's own streams.
    fn end(&self, join: bool) -> Result<()>;

    /// Puts the device's own spans on the timeline from now on (timed events around every
    /// collective's work on each device).
    fn trace(&mut self, tracer: crate::timeline::Tracer) -> Result<()>;

    /// A world's level 3 through host memory: page-locked host memory of at least `bytes`
    /// (contents undefined), the same buffer for every bucket until a larger one is needed.
    fn host_stage(&self, bytes: usize) -> Result<usize>;

    /// Page-locked host memory of at least `bytes` of its own (contents undefined), reused
    /// from an earlier step's bucket when one fits: a bucket started early on the staged route
    /// keeps it until its transfer finished.
    fn bucket_stage(&self, bytes: usize) -> Result<BucketStage>;

    /// Whether everything queued so far on the backend's streams has run: an event recorded
    /// on each stream now, asked without blocking, from any thread.
    fn queued_done(&self) -> Result<Done>;

    /// Queues a copy of `bytes` from `src` to `dst` on `replica`'s stream: one range in
    /// [`Streams::host_stage`] (or other host memory that stays until [`Streams::wait_all`]:
    /// an elastic world's saved copies), the other `replica`'s device memory. Nothing waits for
    /// it until [`Streams::wait_all`].
    ///
    /// # Safety
    /// Both ranges are valid for `bytes` and do not overlap.
    unsafe fn stage_copy(&self, replica: usize, dst: usize, src: usize, bytes: usize)
        -> Result<()>;

    /// Blocks the host until the backend's streams have run everything queued so far (within
    /// the timeout): before the host reads the stage, and before it is written again.
    fn wait_all(&self) -> Result<()>;

    /// A collective opened by [`Streams::begin`] failed with `err`. Part of it may be queued
    /// (events recorded, waits queued, an NCCL group half launched), so on a device or transport
    /// failure the backend records the failure and refuses every later collective, as after a
    /// timeout. Returns the error to report.
    fn collective_failed(&self, err: Error) -> Error;

    /// An elastic world lost a rank and goes on: forgets the failure a collective recorded when
    /// its transfer between the ranks failed, once every stream has run what was queued (within
    /// the timeout). A device fault found then is recorded and returned: the context stays
    /// failed.
    fn recover(&self) -> Result<()>;
}

/// Level 2: moving and combining buffers between the groups of a backend whose groups are
/// separate devices. Work on one group is queued in order on that group's stream; work that
/// reads another group's memory is ordered after it by [`Links::order`].
pub(crate) trait Links {
    /// The group's fusion or staging buffer, at least `bytes` long, reused by every collective
    /// (contents undefined).
    fn buffer(&self, group: usize, slot: Slot, bytes: usize) -> Result<u64>;

    /// The kernels' view of `bucket` over `members` of `group` (made once per layout, then
    /// cached).
    fn layout(&self, group: usize, bucket: &BucketView<'_>, members: Members) -> Result<Layout>;

    /// Level 1 up: `buffer := Σ members` (or the one member's copy), segment after segment.
    ///
    /// # Safety
    /// `buffer` holds the bucket; `layout` was made for it with the same `members`.
    unsafe fn pack(
        &self,
        group: usize,
        bucket: &BucketView<'_>,
        layout: Layout,
        buffer: u64,
    ) -> Result<()>;

    /// Level 1 down: every member of `group` gets `buffer` (divided by `avg` when given).
    ///
    /// # Safety
    /// As for [`Links::pack`], with a layout of every member.
    unsafe fn unpack(
        &self,
        group: usize,
        bucket: &BucketView<'_>,
        layout: Layout,
        buffer: u64,
        avg: Option<usize>,
    ) -> Result<()>;

    /// The kernels' view of `count` elements at each of `slots` in `group`'s device memory (one
    /// segment, a replica per slot), made before any transfer as [`Links::layout`].
    fn slots_layout(&self, group: usize, count: usize, slots: &[u64]) -> Result<Layout>;

    /// Every slot of `layout` := the reproducible sum of the slots (divided by `avg`), by the
    /// kernel of [`Backend::reduce_reproducible`]: the host's arithmetic and bytes. F32 or F64.
    ///
    /// # Safety
    /// `layout` was made by [`Links::slots_layout`] for `count` elements on `group`.
    unsafe fn reproducible(
        &self,
        group: usize,
        dtype: DType,
        layout: Layout,
        count: usize,
        avg: Option<usize>,
    ) -> Result<()>;

    /// One pass of the reproducible sum over every replica of `group` (`layout` of every
    /// member of `bucket`, F32 or F64): `buffers` = (sums, fields): a u64 per bucket element,
    /// and a field per element (a byte for F32; for F64 two, as [`Collective::max_fields`] takes
    /// them). The host's arithmetic, so the host's bytes once the fields and sums crossed.
    ///
    /// # Safety
    /// As for [`Links::unpack`]; both buffers hold the bucket's elements on `group`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn repro_stage(
        &self,
        group: usize,
        bucket: &BucketView<'_>,
        layout: Layout,
        buffers: (u64, u64),
        stage: ReproStage,
        avg: Option<usize>,
    ) -> Result<()>;

    /// `dst := dst + src` for `count` elements of `dtype`, on `group`'s device; `src` is
    /// `group`'s memory or memory of a group it has peer access to.
    ///
    /// # Safety
    /// Both ranges hold `count` elements.
    unsafe fn add(
        &self,
        group: usize,
        dtype: DType,
        dst: u64,
        src: u64,
        count: usize,
    ) -> Result<()>;

    /// Copies `bytes` from `src` on `src_group` to `dst` on `dst_group`, queued on `dst_group`'s
    /// stream (staged by the driver where the pair has no peer access). Not ordered by itself:
    /// [`Links::order`] first.
    ///
    /// # Safety
    /// Both ranges hold `bytes`.
    unsafe fn copy_between(
        &self,
        src_group: usize,
        src: u64,
        dst_group: usize,
        dst: u64,
        bytes: usize,
    ) -> Result<()>;

    /// Makes `to`'s stream wait for the work queued so far on `from`'s.
    fn order(&self, from: usize, to: usize) -> Result<()>;

    /// The grouped collective transport (NCCL), when the backend has one.
    fn collective(&self) -> Option<&dyn Collective>;
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_waste_at_most_a_quarter_and_are_few() {
        let floor = 64 << 10;
        let mut classes = std::collections::BTreeSet::new();
        for bytes in (1..=4 << 20).step_by(997) {
            let c = size_class(bytes, floor);
            assert!(c >= bytes && c >= floor, "{bytes} -> {c}");
            assert!(
                bytes <= floor || c * 4 <= bytes * 5,
                "{bytes} -> {c} wastes over 25 %"
            );
            assert_eq!(size_class(c, floor), c, "a class is its own class");
            classes.insert(c);
        }
        // 64 KiB, then four per doubling up to 4 MiB.
        assert_eq!(classes.len(), 1 + 4 * 6, "{classes:?}");
        assert_eq!(size_class(0, 0), 8);
        assert_eq!(size_class(1000, 0), 1024);
    }
}
