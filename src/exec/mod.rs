//! Algorithms, written once over the [`Backend`] primitives: dense allreduce by buckets,
//! broadcast, average. Inputs are validated before they get here (registry and plan); the
//! executor only turns plan data into backend calls.

mod sparse;

pub use sparse::{GradientStats, SparseOutputs, SparseStats};

use crate::backend::{Backend, BucketView, Segment};
use crate::error::Result;
use crate::plan::{plan_buckets, Bucket, Step};
use crate::registry::TensorView;
use crate::types::ReduceOp;

pub struct Executor {
    backend: Box<dyn Backend>,
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
        .map(|(i, t)| (i, t.dtype, t.count));
    plan_buckets(items, fusion_bytes)
}

impl Executor {
    pub fn new(backend: Box<dyn Backend>) -> Executor {
        Executor { backend }
    }

    pub fn describe_backend(&self) -> serde_json::Value {
        self.backend.describe()
    }

    /// Reduces `buckets` (indices into `tensors`) in order.
    ///
    /// # Safety
    /// Every registered pointer is valid (the C contract makes that the caller's duty).
    pub unsafe fn allreduce_buckets(
        &self,
        buckets: &[Bucket],
        tensors: &[&TensorView],
        op: ReduceOp,
        divisor: usize,
        steps: &[Step],
    ) -> Result<()> {
        for bucket in buckets {
            self.backend
                .allreduce(&view(bucket, tensors), op, divisor, steps)?;
        }
        Ok(())
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
        steps: &[Step],
        fusion_bytes: usize,
    ) -> Result<()> {
        let buckets = buckets_for(tensors, fusion_bytes);
        self.allreduce_buckets(&buckets, tensors, op, divisor, steps)
    }

    /// Copies `tensors` from replica `root` to every other replica.
    ///
    /// # Safety
    /// As for [`Executor::allreduce_buckets`].
    pub unsafe fn broadcast(
        &self,
        tensors: &[&TensorView],
        root: usize,
        fusion_bytes: usize,
    ) -> Result<()> {
        for bucket in buckets_for(tensors, fusion_bytes) {
            self.backend.broadcast(&view(&bucket, tensors), root)?;
        }
        Ok(())
    }

    pub fn synchronize(&self) -> Result<()> {
        self.backend.synchronize()
    }
}
