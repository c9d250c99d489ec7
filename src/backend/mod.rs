//! Backends: the primitives one kind of memory offers. They trust their input (the registry and
//! the plan validated it) and return only errors a caller cannot foresee: a missing runtime, a
//! failing device call, a timeout. Algorithms over them live in [`crate::exec`].

pub mod host;
pub mod sparse;

use crate::error::{Error, ErrorKind, Result};
use crate::plan::Step;
use crate::types::{DType, ReduceOp};

pub use sparse::{Coalesced, SliceRef, ValuesRef};

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
/// CUDA ones): sparse outputs, BMUF state, staging. Zero-filled when made, freed on drop.
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

    /// Sparse gradients: the first row `i` of `rows` indices of `dtype` (I32 or I64) at `indices`
    /// on `replica` whose value is outside `[0, bound)`, as `(i, value)`; `None` if all are in
    /// range. Reads only. A device backend may run a kernel and read back the answer.
    ///
    /// # Safety
    /// `indices` is valid for `rows` aligned elements of `dtype` on `replica`.
    unsafe fn find_index_out_of_range(
        &self,
        replica: usize,
        dtype: DType,
        indices: usize,
        rows: usize,
        bound: u64,
    ) -> Result<Option<(usize, i64)>> {
        let _ = (replica, dtype, indices, rows, bound);
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
        let _ = (replica, slice);
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "sparse coalescing is not implemented on the {} backend yet",
                self.name()
            ),
        ))
    }

    /// `x := x / divisor` for `count` elements of the float `dtype` at `ptr` on `replica`
    /// (f16/bf16 computed in f32 and rounded once): sparse gradients under DPSYNC_REDUCE_AVG.
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
