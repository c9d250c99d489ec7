//! Backends: the primitives one kind of memory offers. They trust their input (the registry and
//! the plan validated it) and return only errors a caller cannot foresee: a missing runtime, a
//! failing device call, a timeout. Algorithms over them live in [`crate::exec`].

pub mod host;

use crate::error::Result;
use crate::plan::Step;
use crate::types::{DType, ReduceOp};

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

    /// Waits for every operation issued so far.
    fn synchronize(&self) -> Result<()>;

    /// What `dpsync_describe` shows of this backend under "backend".
    fn describe(&self) -> serde_json::Value;
}
