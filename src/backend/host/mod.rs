//! The host backend: replicas in host memory, reduced by host threads. Always built, it runs
//! every algorithm in CI (as wgpu's noop backend does for its core).
//!
//! One allreduce reads every replica once and writes every replica once, block by block: the
//! blocks of all replicas are summed into an L1-resident accumulator and written back while
//! their cache lines are still hot, so the memory traffic equals one copy of the same bytes.
//! A bucket is split into contiguous element ranges across threads ("virtual fusion": tensors
//! are not packed into a staging buffer, which on the host would only add traffic).

mod bmuf;
mod kernels;
mod sparse;

use std::sync::OnceLock;

use half::{bf16, f16};

use super::{
    Allocation, Backend, BmufFilter, BmufSpan, BucketView, Coalesced, IndexCheck, Segment, SliceRef,
};
use crate::error::{Error, Result};
use crate::plan::{Step, StepOp, Via};
use crate::types::{DType, ReduceOp};

/// Below this many bytes touched, a call runs on the caller's thread: spawning costs ~10 µs.
const INLINE_BYTES: usize = 1 << 20;
/// Each extra thread gets at least this many bytes.
const BYTES_PER_THREAD: usize = 512 << 10;

fn hardware_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

pub struct HostBackend {
    max_threads: usize,
}

impl HostBackend {
    /// Uses every hardware thread, or `DPSYNC_HOST_THREADS` (>= 1) when set: a framework that
    /// runs its own thread pool beside dpsync may want to leave cores to it.
    pub fn new() -> HostBackend {
        let configured = std::env::var("DPSYNC_HOST_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n >= 1);
        HostBackend {
            max_threads: configured.unwrap_or_else(hardware_threads),
        }
    }

    /// Runs `f(segment, start, len)` over every element of `bucket`, split into contiguous
    /// ranges over up to `max_threads` threads when the call is large enough to pay for them.
    fn for_each_span<F>(&self, bucket: &BucketView<'_>, bytes_per_element: usize, f: F)
    where
        F: Fn(&Segment<'_>, usize, usize) + Sync,
    {
        let total = bucket.elements();
        let bytes = total.saturating_mul(bytes_per_element);
        let threads = if bytes < INLINE_BYTES {
            1
        } else {
            (bytes / BYTES_PER_THREAD).clamp(1, self.max_threads)
        };
        let run = |lo: usize, hi: usize| {
            let mut offset = 0;
            for seg in &bucket.segments {
                let (a, b) = (lo.max(offset), hi.min(offset + seg.count));
                if a < b {
                    f(seg, a - offset, b - a);
                }
                offset += seg.count;
                if offset >= hi {
                    break;
                }
            }
        };
        if threads == 1 {
            return run(0, total);
        }
        let bound = |t: usize| total * t / threads;
        std::thread::scope(|scope| {
            for t in 1..threads {
                let run = &run;
                scope.spawn(move || run(bound(t), bound(t + 1)));
            }
            run(0, bound(1));
        });
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        HostBackend::new()
    }
}

/// The order in which a flat host program sums replicas: its root, then each summed source.
fn summation_order(steps: &[Step], replicas: usize) -> Vec<usize> {
    let Some(root) = steps.first().map(|s| s.dst) else {
        return (0..replicas).collect();
    };
    let mut order = vec![root];
    for s in steps {
        // The planner gives host replicas a flat sum onto one root; anything else is a plan bug.
        assert!(s.via == Via::Host, "host backend got a {:?} step", s.via);
        if s.op == StepOp::Sum {
            assert_eq!(s.dst, root, "host programs sum onto one root");
            order.push(s.src);
        }
    }
    order
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn allreduce(
        &self,
        bucket: &BucketView<'_>,
        op: ReduceOp,
        divisor: usize,
        steps: &[Step],
    ) -> Result<()> {
        let Some(first) = bucket.segments.first() else {
            return Ok(());
        };
        let replicas = first.ptrs.len();
        if replicas <= 1 && divisor <= 1 {
            return Ok(());
        }
        let order = summation_order(steps, replicas);
        let bytes_per_element = bucket.dtype.size() * replicas * 2;
        macro_rules! run {
            ($t:ty) => {
                self.for_each_span(bucket, bytes_per_element, |seg, start, len| unsafe {
                    kernels::reduce_span::<$t>(seg.ptrs, &order, start, len, op, divisor)
                })
            };
        }
        match bucket.dtype {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            DType::F16 => run!(f16),
            DType::Bf16 => run!(bf16),
            DType::I32 => run!(i32),
            DType::I64 => run!(i64),
        }
        Ok(())
    }

    unsafe fn broadcast(&self, bucket: &BucketView<'_>, root: usize) -> Result<()> {
        let size = bucket.dtype.size();
        let Some(first) = bucket.segments.first() else {
            return Ok(());
        };
        let replicas = first.ptrs.len();
        self.for_each_span(bucket, size * replicas, |seg, start, len| {
            let src = (seg.ptrs[root] + start * size) as *const u8;
            for (r, &dst) in seg.ptrs.iter().enumerate() {
                if r != root {
                    // SAFETY: the caller guarantees valid, non-overlapping replica memory.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src,
                            (dst + start * size) as *mut u8,
                            len * size,
                        )
                    };
                }
            }
        });
        Ok(())
    }

    fn alloc(&self, _replica: usize, bytes: usize) -> Result<Allocation> {
        // u128 words: 16-byte alignment suits every dtype (and SIMD loads). Reserved fallibly:
        // a huge gathered slice must be an error, not an abort of the host process.
        let mut words: Vec<u128> = Vec::new();
        words.try_reserve_exact(bytes.div_ceil(16)).map_err(|_| {
            Error::out_of_memory(format!(
                "out of host memory: could not allocate {bytes} bytes of library memory"
            ))
        })?;
        words.resize(bytes.div_ceil(16), 0);
        let ptr = words.as_mut_ptr() as usize;
        Ok(Allocation::new(ptr, bytes, Box::new(words)))
    }

    unsafe fn copy(
        &self,
        _src_replica: usize,
        src: usize,
        _dst_replica: usize,
        dst: usize,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are valid and disjoint.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn bmuf_load(&self, _replica: usize, dtype: DType, spans: &[BmufSpan]) -> Result<()> {
        self.host_bmuf_load(dtype, spans);
        Ok(())
    }

    unsafe fn bmuf_update(
        &self,
        _replica: usize,
        dtype: DType,
        spans: &[BmufSpan],
        filter: &BmufFilter,
    ) -> Result<()> {
        self.host_bmuf_update(dtype, spans, filter);
        Ok(())
    }

    unsafe fn check_indices(&self, check: &IndexCheck<'_>) -> Result<()> {
        match sparse::find_index_out_of_range(
            check.dtype,
            check.indices,
            check.rows,
            check.unsigned_limit(),
        ) {
            Some((row, value)) => Err(check.error(row, value)),
            None => Ok(()),
        }
    }

    unsafe fn coalesce_into(
        &self,
        replica: usize,
        slice: &SliceRef<'_>,
        alloc: &mut dyn FnMut(usize) -> Result<Allocation>,
    ) -> Result<Coalesced> {
        let mut one = sparse::coalesce_many(1, &[(replica, *slice)], &mut |_, b| alloc(b))?;
        Ok(one.remove(0))
    }

    unsafe fn coalesce_many(
        &self,
        slices: &[(usize, SliceRef<'_>)],
        alloc: &mut dyn FnMut(usize, usize) -> Result<Allocation>,
    ) -> Result<Vec<Coalesced>> {
        sparse::coalesce_many(self.max_threads, slices, alloc)
    }

    unsafe fn divide(
        &self,
        _replica: usize,
        dtype: DType,
        ptr: usize,
        count: usize,
        divisor: usize,
    ) -> Result<()> {
        sparse::divide(dtype, ptr, count, divisor);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // Host collectives are complete when they return.
        Ok(())
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({"name": self.name(), "threads": self.max_threads})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_zeroed_aligned_and_copyable() {
        let b = HostBackend::new();
        let a = b.alloc(0, 40).unwrap();
        let c = b.alloc(1, 40).unwrap();
        assert_eq!(a.ptr() % 16, 0);
        assert_eq!(a.bytes(), 40);
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.ptr() as *mut u8, 40) };
        assert!(bytes.iter().all(|&x| x == 0));
        bytes.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
        unsafe { b.copy(0, a.ptr(), 1, c.ptr(), 40).unwrap() };
        let copied = unsafe { std::slice::from_raw_parts(c.ptr() as *const u8, 40) };
        assert_eq!(copied, &bytes[..]);
    }
}
