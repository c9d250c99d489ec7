//! Backends: the primitives one kind of memory offers. They trust their input (the registry and
//! the plan validated it) and return only errors a caller cannot foresee: a missing runtime, a
//! failing device call, a timeout. Algorithms over them live in [`crate::exec`].

mod bmuf;
pub mod cuda;
pub mod host;
pub mod sparse;

pub use bmuf::{bmuf_state_dtype, BmufFilter, BmufSpan};

use crate::error::{Error, ErrorKind, Result};
use crate::plan::Step;
use crate::types::{DType, Memory, ReduceOp};

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

/// One copy of a [`Backend::transfer`] batch: `bytes` from `src` on replica `src_replica` to
/// `dst` on replica `dst_replica`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub src_replica: usize,
    pub src: usize,
    pub dst_replica: usize,
    pub dst: usize,
    pub bytes: usize,
}

/// Memory the library owns on one replica (host memory for host replicas, device memory for
/// CUDA ones): sparse outputs, BMUF state, staging. Zero-filled when made, freed on drop — by a
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

pub trait Backend: Send {
    fn name(&self) -> &'static str;

    /// Which memory `ptr` (registered on `replica`) is in. The host backend has only host memory.
    fn memory_of(&self, _replica: usize, _ptr: usize) -> Result<Memory> {
        Ok(Memory::Host)
    }

    /// The caller's stream (a `CUstream`, 0 = legacy default stream) for `replica`.
    fn set_stream(&mut self, replica: usize, _stream: usize) -> Result<()> {
        Err(Error::invalid(format!(
            "replica {replica} is a host replica: streams belong to CUDA replicas"
        )))
    }

    /// Opens a collective: the work issued until [`Backend::end`] runs after the work already
    /// queued on the callers' streams (stream-ordered backends record and wait on events here).
    fn begin(&self) -> Result<()> {
        Ok(())
    }

    /// Blocks the host until the work already queued on the callers' streams has completed.
    /// Host memory on a device replica (a CPU op's output, or the target of a device-to-host
    /// copy on the caller's stream) is reduced by host threads, which no event can order, so
    /// the executor calls this before touching it, inside the collective's bracket (so its
    /// TIMEOUT goes through [`Backend::collective_failed`]). A no-op where there are no such
    /// streams.
    fn wait_for_callers(&self) -> Result<()> {
        Ok(())
    }

    /// Closes a collective: work queued on the callers' streams afterwards waits for it when
    /// `join` is true. With `join` false the callers go on unhindered (a bucket reduced early by
    /// `dpsync_grad_ready` while backward continues); a later joined collective makes them wait,
    /// as its work follows this one on the backend's own streams.
    fn end(&self, join: bool) -> Result<()> {
        let _ = join;
        Ok(())
    }

    /// A collective opened by [`Backend::begin`] failed with `err`. A stream-ordered backend may
    /// have queued part of it (events recorded, waits queued, an NCCL group half launched), so
    /// on a device or transport failure it records the failure and refuses every later
    /// collective, as after a timeout. Returns the error to report.
    fn collective_failed(&self, err: Error) -> Error {
        err
    }

    /// True when the size of a bucket buys nothing here — no fusion buffer, every replica
    /// reduced in place (CUDA replicas all on one GPU) — so the executor passes all consecutive
    /// buckets of one dtype as one: one kernel launch instead of one per bucket.
    fn in_place(&self) -> bool {
        false
    }

    /// Reduces every segment across replicas in place by the plan's `steps`; with
    /// `ReduceOp::Avg` the sum is divided by `divisor` (replicas in the world).
    ///
    /// # Safety
    /// Every pointer is valid for `count` elements of `dtype`, and one segment's replicas do not
    /// overlap.
    unsafe fn allreduce(
        &self,
        bucket: &BucketView<'_>,
        op: ReduceOp,
        divisor: usize,
        steps: &[Step],
    ) -> Result<()>;

    /// Copies every segment from replica `root` to the others.
    ///
    /// # Safety
    /// As for [`Backend::allreduce`].
    unsafe fn broadcast(&self, bucket: &BucketView<'_>, root: usize) -> Result<()>;

    /// `bytes` zero-filled bytes of library-owned memory on `replica`.
    fn alloc(&self, replica: usize, bytes: usize) -> Result<Allocation>;

    /// Copies `bytes` from `src` on replica `src_replica` to `dst` on replica `dst_replica`.
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

    /// Runs a batch of copies (skipping empty ones) that are independent: no transfer reads
    /// memory another one writes. A backend with a collective transport may move the batch in
    /// one go (NCCL sends and receives in one group) instead of copy by copy.
    ///
    /// # Safety
    /// As for [`Backend::copy`], for every transfer.
    unsafe fn transfer(&self, batch: &[Transfer]) -> Result<()> {
        copy_each(self, batch)
    }

    /// BMUF: loads the filter state of one bucket on `replica`. For every span and element i:
    /// `w[i] = params[i]` widened exactly to [`bmuf_state_dtype`]`(dtype)`, and `d[i] = 0`.
    /// `params` is only read.
    ///
    /// # Safety
    /// Every span is valid on `replica` as [`BmufSpan`] describes; spans do not overlap.
    unsafe fn bmuf_load(&self, replica: usize, dtype: DType, spans: &[BmufSpan]) -> Result<()> {
        let _ = (replica, dtype, spans);
        Err(bmuf_unavailable(self.name()))
    }

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
    ) -> Result<()> {
        let _ = (replica, dtype, spans, filter);
        Err(bmuf_unavailable(self.name()))
    }

    /// Sparse gradients: checks that every index of `check` is in `[0, bound)`; reads only.
    /// A host backend answers now, with [`IndexCheck::error`] for the first index out of range.
    /// A stream-ordered backend may instead run the check on the device inside the current
    /// collective and report that same error from [`Backend::synchronize`].
    ///
    /// # Safety
    /// `check.indices` is valid for `rows` aligned elements of its dtype on its replica.
    unsafe fn check_indices(&self, check: &IndexCheck<'_>) -> Result<()> {
        let _ = check;
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "sparse index range checks are not implemented on the {} backend yet",
                self.name()
            ),
        ))
    }

    /// Sparse gradients: coalesces `slice` on `replica` into new allocations on that replica:
    /// its indices sorted ascending without duplicates, and for each values array the rows of
    /// equal indices summed in input order (f16/bf16 accumulated in f32, every output element
    /// rounded once). Deterministic: the same input gives the same bytes on any replica. The
    /// result's row count depends on the data (a device backend has to read it back).
    ///
    /// # Safety
    /// The slice's pointers are valid on `replica` for `rows` aligned indices and rows.
    unsafe fn coalesce(&self, replica: usize, slice: &SliceRef<'_>) -> Result<Coalesced> {
        self.coalesce_into(replica, slice, &mut |bytes| self.alloc(replica, bytes))
    }

    /// [`Backend::coalesce`], with the result's memory from `alloc` (memory of `replica`, of at
    /// least the size asked; its contents need not be zero: every byte of the result is written).
    ///
    /// # Safety
    /// As for [`Backend::coalesce`].
    unsafe fn coalesce_into(
        &self,
        replica: usize,
        slice: &SliceRef<'_>,
        alloc: &mut dyn FnMut(usize) -> Result<Allocation>,
    ) -> Result<Coalesced> {
        let _ = (replica, slice, alloc);
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "sparse coalescing is not implemented on the {} backend yet",
                self.name()
            ),
        ))
    }

    /// [`Backend::coalesce_into`] for several slices, each `(replica, slice)`, with `alloc(replica,
    /// bytes)` for the results: a backend may work on them at once (the host sorts on several
    /// threads). The results are in the order of `slices`.
    ///
    /// # Safety
    /// As for [`Backend::coalesce`], for every slice.
    unsafe fn coalesce_many(
        &self,
        slices: &[(usize, SliceRef<'_>)],
        alloc: &mut dyn FnMut(usize, usize) -> Result<Allocation>,
    ) -> Result<Vec<Coalesced>> {
        (slices.iter())
            .map(|(r, s)| self.coalesce_into(*r, s, &mut |bytes| alloc(*r, bytes)))
            .collect()
    }

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
    ) -> Result<()> {
        let _ = (replica, dtype, ptr, count, divisor);
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "sparse averaging is not implemented on the {} backend yet",
                self.name()
            ),
        ))
    }

    /// Waits for every operation issued so far.
    fn synchronize(&self) -> Result<()>;

    /// What `dpsync_describe` shows of this backend under "backend".
    fn describe(&self) -> serde_json::Value;
}

/// [`Backend::transfer`] as one [`Backend::copy`] per non-empty transfer.
///
/// # Safety
/// As for [`Backend::transfer`].
unsafe fn copy_each<B: Backend + ?Sized>(backend: &B, batch: &[Transfer]) -> Result<()> {
    for t in batch.iter().filter(|t| t.bytes > 0) {
        backend.copy(t.src_replica, t.src, t.dst_replica, t.dst, t.bytes)?;
    }
    Ok(())
}

/// What a backend without the BMUF primitives answers.
fn bmuf_unavailable(backend: &str) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("BMUF is not implemented on the {backend} backend yet"),
    )
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
