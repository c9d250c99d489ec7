//! The BMUF primitives on a CUDA replica: one launch of the fused `bmuf_<dtype>` kernel per
//! bucket (kernels/bmuf.cu), on the replica's device's communication stream, so it follows the
//! bucket's averaging collective in stream order. Its table (params, W, D per tensor) does not
//! change between blocks, so it is uploaded once and found in the table cache afterwards.

use super::kernels::Bmuf;
use super::memory::table_of;
use super::CudaBackend;
use crate::backend::{BmufFilter, BmufSpan};
use crate::error::Result;
use crate::types::DType;

impl CudaBackend {
    /// `W := params, D := 0` without a filter; one filter step with one.
    pub(super) fn bmuf_kernel(
        &self,
        replica: usize,
        dtype: DType,
        spans: &[BmufSpan],
        filter: Option<&BmufFilter>,
    ) -> Result<()> {
        let total: usize = spans.iter().map(|s| s.count).sum();
        if total == 0 {
            return Ok(());
        }
        let group = &self.groups[self.replicas[replica].group];
        let host = table_of(
            spans.iter().map(|s| s.count),
            spans
                .iter()
                .map(|s| [s.params as u64, s.w as u64, s.d as u64]),
        );
        let table = self.upload_table(group, host)?;
        let (mode, mu, eta) = match filter {
            None => (Bmuf::Load, 0.0, 0.0),
            Some(f) if f.nesterov => (Bmuf::Nesterov, f.block_momentum, f.block_lr),
            Some(f) => (Bmuf::Classical, f.block_momentum, f.block_lr),
        };
        let _bound = group.ctx.bind()?;
        group.kernels.bmuf(
            group.stream.0,
            dtype,
            table,
            spans.len(),
            total,
            mode,
            mu,
            eta,
        )
    }
}
