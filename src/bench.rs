//! The door for benchmarks that measure a primitive below the C ABI (`benches/bmuf.rs`). Not
//! part of the API: hidden from the docs, no stability promise, nothing in the header.

use crate::backend::host::HostBackend;
use crate::backend::{bmuf_state_dtype, Allocation, Backend, BmufFilter, BmufSpan};
use crate::plan::{plan_buckets, Bucket};
use crate::types::{DType, Memory};

/// The host backend's BMUF update over f32 params as `dpsync_bmuf_init` buckets them (in
/// registration order, per dtype, at most `fusion_bytes` per bucket), with its state loaded.
pub struct HostBmufUpdate {
    backend: HostBackend,
    buckets: Vec<Bucket>,
    /// Per bucket, per replica: the spans of its tensors.
    spans: Vec<Vec<Vec<BmufSpan>>>,
    /// W and D of every bucket and replica (kept alive for `spans`).
    _state: Vec<(Allocation, Allocation)>,
}

impl HostBmufUpdate {
    /// `params[r][t]` is replica r's tensor t; every replica has the same tensor sizes. The host
    /// backend reads `DPSYNC_HOST_THREADS` here.
    ///
    /// # Safety
    /// `params` stays allocated, and is not moved, while the result is used.
    pub unsafe fn new(params: &mut [Vec<Vec<f32>>], fusion_bytes: usize) -> HostBmufUpdate {
        let backend = HostBackend::new();
        let counts: Vec<usize> = params[0].iter().map(Vec::len).collect();
        let items = (counts.iter().enumerate()).map(|(i, &n)| (i, DType::F32, Memory::Host, n));
        let buckets = plan_buckets(items, fusion_bytes);
        let size = bmuf_state_dtype(DType::F32).map_or(0, |s| s.size());
        let (mut spans, mut state) = (Vec::new(), Vec::new());
        for bucket in &buckets {
            let mut per_replica = Vec::with_capacity(params.len());
            for (r, replica) in params.iter_mut().enumerate() {
                let bytes = bucket.elements * size;
                let (w, d) = (alloc(&backend, r, bytes), alloc(&backend, r, bytes));
                let mut offset = 0;
                let tensor_spans: Vec<BmufSpan> = (bucket.tensors.iter())
                    .map(|&t| {
                        let span = BmufSpan {
                            params: replica[t].as_mut_ptr() as usize,
                            w: w.ptr() + offset * size,
                            d: d.ptr() + offset * size,
                            count: counts[t],
                        };
                        offset += counts[t];
                        span
                    })
                    .collect();
                backend
                    .bmuf_load(r, DType::F32, &tensor_spans)
                    .expect("host BMUF load");
                per_replica.push(tensor_spans);
                state.push((w, d));
            }
            spans.push(per_replica);
        }
        HostBmufUpdate {
            backend,
            buckets,
            spans,
            _state: state,
        }
    }

    /// The number of buckets.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Bytes of W and D per element (the state type of f32).
    pub fn state_size() -> usize {
        bmuf_state_dtype(DType::F32).map_or(0, |s| s.size())
    }

    /// One filter step over every bucket and replica.
    pub fn update(&self, block_lr: f64, block_momentum: f64, nesterov: bool) {
        let filter = BmufFilter {
            block_lr,
            block_momentum,
            nesterov,
            default_momentum: false,
        };
        for (bucket, spans) in self.buckets.iter().zip(&self.spans) {
            for (r, s) in spans.iter().enumerate() {
                // SAFETY: `new`'s caller keeps the params; W and D live in `_state`.
                unsafe { self.backend.bmuf_update(r, bucket.dtype, s, &filter) }
                    .expect("host BMUF update");
            }
        }
    }
}

fn alloc(backend: &HostBackend, replica: usize, bytes: usize) -> Allocation {
    backend
        .alloc(replica, bytes)
        .expect("host memory for the BMUF state")
}
