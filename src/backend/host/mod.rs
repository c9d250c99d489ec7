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
// The MPI engine's allgather streams its large copies out as the host's does.
#[cfg(feature = "mpi")]
pub(crate) use kernels::copy_streaming;
pub(crate) mod repro;
mod sparse;

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use half::{bf16, f16};

use super::spares::{Block, Spares};
use super::{
    size_class, Allocation, Backend, BmufFilter, BmufSpan, BucketView, Coalesced, IndexCheck,
    Links, Segment, SliceRef, Streams,
};
use crate::error::{Error, Result};
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
    /// Idle library memory, reused by `alloc` (host work is done when a call returns, so a
    /// dropped allocation is idle at once).
    spares: Arc<Mutex<Spares<Words>>>,
}

/// The threads a host backend made now would use.
pub(crate) fn host_threads() -> usize {
    HostBackend::new().max_threads
}

/// Host library memory: u128 words, so 16-byte aligned for every dtype (and SIMD loads).
struct Words(Vec<u128>);

impl Block for Words {
    fn bytes(&self) -> usize {
        self.0.len() * 16
    }
}

/// The owner of an [`Allocation`]'s words: gives them back to the spares on drop.
struct Pooled {
    words: Option<Words>,
    spares: Arc<Mutex<Spares<Words>>>,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut spares = self.spares.lock();
        spares.put(self.words.take());
        let retired = spares.take_retired();
        drop(spares);
        drop(retired);
    }
}

/// Fresh host memory is at least a page ([`size_class`]).
const PAGE: usize = 4096;

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
            spares: Arc::default(),
        }
    }

    /// Runs `f(segment, start, len)` over every element of `bucket`, split into contiguous
    /// ranges over up to `max_threads` threads when the call is large enough to pay for them.
    /// [`kernels::reduce_span`] over every span of `bucket` (`touched` replicas' bytes per
    /// element size the threads), the result written to every replica or to `only`.
    ///
    /// # Safety
    /// As for [`Backend::reduce`].
    unsafe fn reduce_spans(
        &self,
        bucket: &BucketView<'_>,
        members: &[usize],
        touched: usize,
        avg: Option<usize>,
        only: Option<usize>,
    ) {
        let (op, divisor) = match avg {
            Some(divisor) => (ReduceOp::Avg, divisor),
            None => (ReduceOp::Sum, 1),
        };
        let bytes_per_element = bucket.dtype.size() * touched;
        macro_rules! run {
            ($t:ty) => {
                self.for_each_span(bucket, bytes_per_element, |seg, start, len| unsafe {
                    kernels::reduce_span::<$t>(seg.ptrs, members, start, len, op, divisor, only)
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
    }

    fn for_each_span<F>(&self, bucket: &BucketView<'_>, bytes_per_element: usize, f: F)
    where
        F: Fn(&Segment<'_>, usize, usize) + Sync,
    {
        let bytes = bucket.elements().saturating_mul(bytes_per_element);
        let threads = if bytes < INLINE_BYTES {
            1
        } else {
            (bytes / BYTES_PER_THREAD).clamp(1, self.max_threads)
        };
        for_each_range(bucket, threads, |seg, start, len, _| f(seg, start, len));
    }
}

/// Runs `f(segment, first element in it, count, first element in the bucket)` over the
/// elements of `bucket`, split into contiguous ranges over `threads` threads.
pub(crate) fn for_each_range<F>(bucket: &BucketView<'_>, threads: usize, f: F)
where
    F: Fn(&Segment<'_>, usize, usize, usize) + Sync,
{
    let total = bucket.elements();
    let run = |lo: usize, hi: usize| {
        let mut offset = 0;
        for seg in &bucket.segments {
            let (a, b) = (lo.max(offset), hi.min(offset + seg.count));
            if a < b {
                f(seg, a - offset, b - a, a);
            }
            offset += seg.count;
            if offset >= hi {
                break;
            }
        }
    };
    if threads <= 1 {
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

/// A spread of an owned piece copies this many bytes from its owner to every other replica
/// before the next: the block stays in L1 while it is written out.
const COPY_BLOCK: usize = 32 << 10;
/// A spread of an owned piece writing at least this many bytes uses non-temporal stores
/// ([`kernels::copy_streaming`]); smaller ones leave the bytes in cache for the caller.
pub(crate) const STREAM_BYTES: usize = 8 << 20;

/// [`kernels::copy_streaming`]'s plain counterpart.
///
/// # Safety
/// As for [`std::ptr::copy_nonoverlapping`].
unsafe fn copy_plain(src: *const u8, dst: *mut u8, bytes: usize) {
    std::ptr::copy_nonoverlapping(src, dst, bytes)
}

/// `owned(segment, replica)` of every segment and replica, segment after segment: the
/// `&dyn Fn` is not shared with the threads, its answers are.
fn owned_pieces(
    bucket: &BucketView<'_>,
    replicas: usize,
    owned: &dyn Fn(usize, usize) -> (usize, usize),
) -> Vec<(usize, usize)> {
    (0..bucket.segments.len())
        .flat_map(|i| (0..replicas).map(move |r| owned(i, r)))
        .collect()
}

/// The index in `bucket` of `seg`, one of its segments (as [`HostBackend::for_each_span`] hands
/// them out).
fn segment_index(bucket: &BucketView<'_>, seg: &Segment<'_>) -> usize {
    let index = (seg as *const Segment<'_> as usize - bucket.segments.as_ptr() as usize)
        / std::mem::size_of::<Segment<'_>>();
    debug_assert!(std::ptr::eq(&bucket.segments[index], seg));
    index
}

/// `f(owner, first, count)` for every owner's part of elements `[start, start + len)`, where
/// `pieces[owner]` is the owner's `(first element, count)`.
fn for_each_owned(
    pieces: &[(usize, usize)],
    start: usize,
    len: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    for (owner, &(at, count)) in pieces.iter().enumerate() {
        let (a, b) = (start.max(at), (start + len).min(at + count));
        if a < b {
            f(owner, a, b - a);
        }
    }
}

#[cfg(test)]
impl HostBackend {
    /// [`Backend::coalesce`] of one slice, into fresh memory.
    ///
    /// # Safety
    /// As for [`Backend::coalesce`].
    pub(crate) unsafe fn coalesce_one(
        &self,
        replica: usize,
        slice: &SliceRef<'_>,
    ) -> Result<Coalesced> {
        let mut one = self.coalesce(&[(replica, *slice)], false, &mut |r, bytes| {
            self.alloc(r, bytes)
        })?;
        Ok(one.remove(0))
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        HostBackend::new()
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn reduce(
        &self,
        _group: usize,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
    ) -> Result<()> {
        // Reads and writes every replica.
        let replicas = bucket.segments.first().map_or(0, |s| s.ptrs.len());
        self.reduce_spans(bucket, members, replicas * 2, avg, None);
        Ok(())
    }

    unsafe fn reduce_owned(
        &self,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        let Some(replicas) = bucket.segments.first().map(|s| s.ptrs.len()) else {
            return Ok(());
        };
        let (op, divisor) = match avg {
            Some(divisor) => (ReduceOp::Avg, divisor),
            None => (ReduceOp::Sum, 1),
        };
        // One pass over the whole bucket: each thread's range is cut where the owners' pieces
        // meet, and each cut summed onto its owner alone. Reads every replica, writes one.
        let pieces = owned_pieces(bucket, replicas, owned);
        let bytes_per_element = bucket.dtype.size() * (replicas + 1);
        macro_rules! run {
            ($t:ty) => {
                self.for_each_span(bucket, bytes_per_element, |seg, start, len| {
                    let mine = &pieces[segment_index(bucket, seg) * replicas..][..replicas];
                    for_each_owned(mine, start, len, |owner, at, n| unsafe {
                        kernels::reduce_span::<$t>(
                            seg.ptrs,
                            members,
                            at,
                            n,
                            op,
                            divisor,
                            Some(owner),
                        )
                    })
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

    unsafe fn spread_owned(
        &self,
        bucket: &BucketView<'_>,
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        let Some(replicas) = bucket.segments.first().map(|s| s.ptrs.len()) else {
            return Ok(());
        };
        if replicas <= 1 {
            return Ok(());
        }
        let size = bucket.dtype.size();
        let pieces = owned_pieces(bucket, replicas, owned);
        // Large copies stream past the caches: the destinations are not read first.
        let writes = bucket.elements().saturating_mul(size * (replicas - 1));
        let copy = match writes >= STREAM_BYTES {
            true => kernels::copy_streaming,
            false => copy_plain,
        };
        // One pass over the whole bucket: each owner's piece copied to the other replicas a
        // block at a time, so the source is read from memory once. Reads one, writes the rest.
        self.for_each_span(bucket, size * replicas, |seg, start, len| {
            let mine = &pieces[segment_index(bucket, seg) * replicas..][..replicas];
            for_each_owned(mine, start, len, |owner, at, n| {
                let mut done = 0;
                while done < n {
                    let bytes = (COPY_BLOCK / size).min(n - done) * size;
                    let offset = (at + done) * size;
                    let src = (seg.ptrs[owner] + offset) as *const u8;
                    for (r, &dst) in seg.ptrs.iter().enumerate() {
                        if r != owner {
                            // SAFETY: the caller guarantees valid, non-overlapping replicas.
                            unsafe { copy(src, (dst + offset) as *mut u8, bytes) };
                        }
                    }
                    done += bytes / size;
                }
            })
        });
        Ok(())
    }

    unsafe fn reduce_reproducible(
        &self,
        members: &[usize],
        bucket: &BucketView<'_>,
        avg: Option<usize>,
    ) -> Result<()> {
        if members.len() <= 1 {
            // One contribution is its own sum (AVG divides by 1): left as it is, as the
            // executor leaves a world of one replica.
            return Ok(());
        }
        let replicas = bucket.segments.first().map_or(0, |s| s.ptrs.len());
        let bytes_per_element = bucket.dtype.size() * replicas * 2;
        repro::for_float!(bucket.dtype, T => {
            self.for_each_span(bucket, bytes_per_element, |seg, start, len| unsafe {
                repro::reduce_span::<T>(seg.ptrs, (members, members), start, len, avg)
            });
            Ok(())
        }, _ => self.reduce(0, members, bucket, avg))
    }

    unsafe fn spread(&self, _group: usize, bucket: &BucketView<'_>, root: usize) -> Result<()> {
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
        let reused = self.spares.lock().take(bytes, |_| true);
        let mut words = match reused {
            Some(words) => words,
            None => {
                // Reserved fallibly: a huge gathered slice must be an error, not an abort of the
                // host process.
                let n = size_class(bytes, PAGE).div_ceil(16);
                let mut v: Vec<u128> = Vec::new();
                v.try_reserve_exact(n).map_err(|_| {
                    Error::out_of_memory(format!(
                        "out of host memory: could not allocate {bytes} bytes of library memory"
                    ))
                })?;
                v.resize(n, 0);
                Words(v)
            }
        };
        let ptr = words.0.as_mut_ptr() as usize;
        let owner = Pooled {
            words: Some(words),
            spares: self.spares.clone(),
        };
        Ok(Allocation::new(ptr, bytes, Box::new(owner)))
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

    unsafe fn coalesce(
        &self,
        slices: &[(usize, SliceRef<'_>)],
        reproducible: bool,
        alloc: &mut dyn FnMut(usize, usize) -> Result<Allocation>,
    ) -> Result<Vec<Coalesced>> {
        sparse::coalesce_many(self.max_threads, slices, reproducible, alloc)
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

    fn streams(&self) -> Option<&dyn Streams> {
        None
    }

    fn streams_mut(&mut self) -> Option<&mut dyn Streams> {
        None
    }

    fn links(&self) -> Option<&dyn Links> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_copyable_and_reused_once_dropped() {
        let b = HostBackend::new();
        let a = b.alloc(0, 40).unwrap();
        let c = b.alloc(1, 40).unwrap();
        assert_eq!(a.ptr() % 16, 0);
        assert_eq!(a.bytes(), 40);
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.ptr() as *mut u8, 40) };
        bytes.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
        unsafe { b.copy(0, a.ptr(), 1, c.ptr(), 40).unwrap() };
        let copied = unsafe { std::slice::from_raw_parts(c.ptr() as *const u8, 40) };
        assert_eq!(copied, &bytes[..]);
        // A page-sized class: a request of up to 2 KiB takes it back, a larger one does not fit.
        let (ptr, small) = (a.ptr(), c.ptr());
        drop(a);
        assert_eq!(
            b.alloc(0, 2000).unwrap().ptr(),
            ptr,
            "the idle block is reused"
        );
        drop(c);
        assert_ne!(
            b.alloc(0, 5000).unwrap().ptr(),
            small,
            "too small: fresh memory"
        );
    }
}
