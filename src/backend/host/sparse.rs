//! Sparse-gradient primitives on host memory: index range scan, coalescing (sort, dedupe, sum
//! rows) and division for AVG. Row sums reuse the dense kernels' accumulate-and-round-once rules,
//! so a coalesced f16 row is rounded exactly as a dense f16 sum would be.

use half::{bf16, f16};

use super::kernels::{Reducible, BLOCK};
use crate::backend::{
    coalescing_order, narrow_indices, widen_indices, Allocation, Coalesced, SliceRef,
};
use crate::error::Result;
use crate::types::{DType, ReduceOp};

pub(super) unsafe fn find_index_out_of_range(
    dtype: DType,
    ptr: usize,
    rows: usize,
    bound: u64,
) -> Option<(usize, i64)> {
    if rows == 0 {
        return None;
    }
    // Compare as u64: a negative index wraps to 2^63 or more, so with `bound` at most 2^63
    // (`IndexCheck::unsigned_limit`) one comparison covers both ends.
    fn scan<T: Copy + Into<i64>>(v: &[T], bound: u64) -> Option<(usize, i64)> {
        v.iter()
            .position(|&i| (i.into() as u64) >= bound)
            .map(|p| (p, v[p].into()))
    }
    match dtype {
        DType::I32 => scan(std::slice::from_raw_parts(ptr as *const i32, rows), bound),
        DType::I64 => scan(std::slice::from_raw_parts(ptr as *const i64, rows), bound),
        other => unreachable!("the registry admits only i32/i64 indices, got {other}"),
    }
}

/// `out` = the sum of the rows `rows` of `src`, added in that order, `row_len` elements each,
/// accumulated in `acc` (at least `min(row_len, BLOCK)` long; reused across rows because zeroing
/// a whole block per row would cost more than the sum of a short row).
unsafe fn sum_rows<T: Reducible>(
    src: *const T,
    rows: &[usize],
    row_len: usize,
    out: *mut T,
    acc: &mut [T::Acc],
) {
    let mut done = 0;
    while done < row_len {
        let n = BLOCK.min(row_len - done);
        let row = |r: usize| std::slice::from_raw_parts(src.add(r * row_len + done), n);
        // load overwrites acc[..n], so it needs no zeroing between rows.
        T::load(row(rows[0]), &mut acc[..n]);
        for &r in &rows[1..] {
            T::accumulate(row(r), &mut acc[..n]);
        }
        let out = std::slice::from_raw_parts_mut(out.add(done), n);
        T::store(&acc[..n], ReduceOp::Sum, 1, out);
        done += n;
    }
}

/// Sums each run of equal indices into consecutive output rows: run `k` is
/// `positions[bounds[k]..bounds[k + 1]]`, positions of input rows in input order.
unsafe fn sum_runs<T: Reducible>(
    src: usize,
    positions: &[usize],
    bounds: &[usize],
    row_len: usize,
    dst: usize,
) {
    let (src, dst) = (src as *const T, dst as *mut T);
    let mut acc = vec![T::Acc::default(); BLOCK.min(row_len)];
    for (k, run) in bounds.windows(2).enumerate() {
        if run[1] - run[0] == 1 {
            // A lone row is its own sum, bit for bit (widening a half to f32 and rounding it
            // back is exact): one copy instead of a pass through the accumulator. On skewed
            // streams most indices occur once.
            let r = positions[run[0]];
            std::ptr::copy_nonoverlapping(src.add(r * row_len), dst.add(k * row_len), row_len);
            continue;
        }
        sum_rows(
            src,
            &positions[run[0]..run[1]],
            row_len,
            dst.add(k * row_len),
            &mut acc,
        );
    }
}

/// [`sum_runs`] with every run of several rows a reproducible sum.
unsafe fn sum_runs_repro<T: super::repro::Cut>(
    src: usize,
    positions: &[usize],
    bounds: &[usize],
    row_len: usize,
    dst: usize,
) {
    let size = std::mem::size_of::<T>();
    for (k, run) in bounds.windows(2).enumerate() {
        let out = dst + k * row_len * size;
        match run[1] - run[0] {
            // A lone row is its own sum (the same bytes wherever it came from).
            1 => std::ptr::copy_nonoverlapping(
                (src + positions[run[0]] * row_len * size) as *const u8,
                out as *mut u8,
                row_len * size,
            ),
            _ => super::repro::sum_rows::<T>(src, &positions[run[0]..run[1]], row_len, out),
        }
    }
}

/// [`crate::backend::Backend::coalesce`] on the host: the sorts, then the row sums, run on
/// up to `threads` threads, one slice per thread at a time (the sorts are CPU-bound; four
/// replicas' slices of a few thousand rows take a few hundred microseconds on one thread). The
/// outputs are allocated in order on the calling thread, since `alloc` is the caller's.
pub(super) unsafe fn coalesce_many(
    threads: usize,
    slices: &[(usize, SliceRef<'_>)],
    reproducible: bool,
    alloc: &mut dyn FnMut(usize, usize) -> Result<Allocation>,
) -> Result<Vec<Coalesced>> {
    let bytes: usize = (slices.iter())
        .map(|(_, s)| {
            s.values
                .iter()
                .map(|v| s.rows * v.row_bytes())
                .sum::<usize>()
        })
        .sum();
    // Below a MiB of rows the threads would cost more than they save.
    let threads = if bytes < 1 << 20 { 1 } else { threads };
    let orders = in_parallel(threads, slices, |(_, s)| {
        coalescing_order(&widen_indices(s.index_dtype, s.indices, s.rows))
    });
    let mut out = Vec::with_capacity(slices.len());
    for ((replica, slice), (unique, _, _)) in slices.iter().zip(&orders) {
        let index_bytes = narrow_indices(slice.index_dtype, unique);
        let indices = alloc(*replica, index_bytes.len())?;
        std::ptr::copy_nonoverlapping(
            index_bytes.as_ptr(),
            indices.ptr() as *mut u8,
            index_bytes.len(),
        );
        let values = (slice.values.iter())
            .map(|v| alloc(*replica, unique.len() * v.row_bytes()))
            .collect::<Result<Vec<_>>>()?;
        out.push(Coalesced {
            rows: unique.len(),
            indices,
            values,
        });
    }
    // Each job writes only its own slice's new outputs (pointers: an Allocation stays here).
    let jobs: Vec<(&SliceRef, _, Vec<usize>)> = (slices.iter().zip(&orders).zip(&out))
        .map(|(((_, slice), order), c)| {
            (slice, order, c.values.iter().map(Allocation::ptr).collect())
        })
        .collect();
    in_parallel(
        threads,
        &jobs,
        |(slice, (unique, positions, bounds), ptrs)| {
            if unique.is_empty() {
                return;
            }
            for (v, &dst) in slice.values.iter().zip(ptrs) {
                let (p, b, n) = (positions.as_slice(), bounds.as_slice(), v.row_len);
                match v.dtype {
                    DType::F32 if reproducible => sum_runs_repro::<f32>(v.ptr, p, b, n, dst),
                    DType::F64 if reproducible => sum_runs_repro::<f64>(v.ptr, p, b, n, dst),
                    DType::F16 if reproducible => sum_runs_repro::<f16>(v.ptr, p, b, n, dst),
                    DType::Bf16 if reproducible => sum_runs_repro::<bf16>(v.ptr, p, b, n, dst),
                    DType::F32 => sum_runs::<f32>(v.ptr, p, b, n, dst),
                    DType::F64 => sum_runs::<f64>(v.ptr, p, b, n, dst),
                    DType::F16 => sum_runs::<f16>(v.ptr, p, b, n, dst),
                    DType::Bf16 => sum_runs::<bf16>(v.ptr, p, b, n, dst),
                    DType::I32 => sum_runs::<i32>(v.ptr, p, b, n, dst),
                    DType::I64 => sum_runs::<i64>(v.ptr, p, b, n, dst),
                }
            }
        },
    );
    Ok(out)
}

/// `f` over `items`, on up to `threads` threads (items taken in turn from a shared counter), the
/// results in item order.
fn in_parallel<I: Sync, R: Send>(
    threads: usize,
    items: &[I],
    f: impl Fn(&I) -> R + Sync,
) -> Vec<R> {
    let threads = threads.clamp(1, items.len().max(1));
    if threads == 1 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            done.push((i, f(item)));
        }
        done
    };
    let mut results: Vec<(usize, R)> = std::thread::scope(|scope| {
        let others: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        let mut all = work();
        for t in others {
            all.extend(t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        all
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

unsafe fn divide_span<T: Reducible>(ptr: usize, count: usize, divisor: usize) {
    let ptr = ptr as *mut T;
    let mut acc = [T::Acc::default(); BLOCK];
    let mut done = 0;
    while done < count {
        let n = BLOCK.min(count - done);
        let span = std::slice::from_raw_parts_mut(ptr.add(done), n);
        T::load(span, &mut acc[..n]);
        T::store(&acc[..n], ReduceOp::Avg, divisor, span);
        done += n;
    }
}

pub(super) unsafe fn divide(dtype: DType, ptr: usize, count: usize, divisor: usize) {
    if count == 0 {
        return;
    }
    match dtype {
        DType::F32 => divide_span::<f32>(ptr, count, divisor),
        DType::F64 => divide_span::<f64>(ptr, count, divisor),
        DType::F16 => divide_span::<f16>(ptr, count, divisor),
        DType::Bf16 => divide_span::<bf16>(ptr, count, divisor),
        DType::I32 => divide_span::<i32>(ptr, count, divisor),
        DType::I64 => divide_span::<i64>(ptr, count, divisor),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::backend::{Backend, ValuesRef};

    fn coalesce_host<I: Copy, V: Copy>(
        index_dtype: DType,
        indices: &[I],
        value_dtype: DType,
        values: &[V],
        row_len: usize,
    ) -> (Vec<I>, Vec<V>) {
        let b = HostBackend::new();
        let vref = [ValuesRef {
            ptr: values.as_ptr() as usize,
            dtype: value_dtype,
            row_len,
        }];
        let slice = SliceRef {
            index_dtype,
            indices: indices.as_ptr() as usize,
            rows: indices.len(),
            values: &vref,
        };
        let c = unsafe { b.coalesce_one(0, &slice) }.unwrap();
        let idx = unsafe { std::slice::from_raw_parts(c.indices.ptr() as *const I, c.rows) };
        let val =
            unsafe { std::slice::from_raw_parts(c.values[0].ptr() as *const V, c.rows * row_len) };
        (idx.to_vec(), val.to_vec())
    }

    #[test]
    fn coalesce_sorts_dedupes_and_sums_in_input_order() {
        let (idx, val) = coalesce_host(
            DType::I64,
            &[7i64, 2, 7, -1, 2],
            DType::F32,
            &[1f32, 10., 2., 20., 3., 30., 4., 40., 5., 50.],
            2,
        );
        assert_eq!(idx, vec![-1, 2, 7]);
        assert_eq!(val, vec![4., 40., 7., 70., 4., 40.]);
    }

    #[test]
    fn coalesce_accumulates_halves_in_f32_and_keeps_i32_indices() {
        // 2048 + 1 + 1 rounds back to 2048 twice in f16 arithmetic; in f32 it is 2050.
        let v = [2048f32, 1.0, 1.0, 5.0].map(f16::from_f32);
        let (idx, val) = coalesce_host(DType::I32, &[3i32, 3, 3, 0], DType::F16, &v, 1);
        assert_eq!(idx, vec![0, 3]);
        assert_eq!(val, vec![f16::from_f32(5.0), f16::from_f32(2050.0)]);
    }

    #[test]
    fn coalesce_handles_rows_longer_than_a_block_and_empty_slices() {
        let row_len = BLOCK + 3;
        let values: Vec<f64> = (0..3 * row_len).map(|i| i as f64).collect();
        let (idx, val) = coalesce_host(DType::I64, &[5i64, 5, 5], DType::F64, &values, row_len);
        assert_eq!(idx, vec![5]);
        for (j, x) in val.iter().enumerate() {
            assert_eq!(*x, (3 * j + 3 * row_len) as f64, "element {j}");
        }
        let (idx, val) = coalesce_host::<i32, f32>(DType::I32, &[], DType::F32, &[], 4);
        assert!(idx.is_empty() && val.is_empty());
    }

    #[test]
    fn coalescing_several_slices_on_threads_gives_each_slices_own_result() {
        // Four slices of 4096 rows x 32 f32 (2 MiB in all: above the threading threshold),
        // different index streams, coalesced together on 3 threads and one by one on 1.
        let (rows, row_len) = (4096usize, 32usize);
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        let data: Vec<(Vec<i64>, Vec<f32>)> = (0..4)
            .map(|s| {
                let idx = (0..rows)
                    .map(|_| (next() % (500 + 300 * s)) as i64)
                    .collect();
                let val = (0..rows * row_len)
                    .map(|_| (next() % 1000) as f32 / 8.0)
                    .collect();
                (idx, val)
            })
            .collect();
        let refs: Vec<[ValuesRef; 1]> = (data.iter())
            .map(|(_, v)| {
                [ValuesRef {
                    ptr: v.as_ptr() as usize,
                    dtype: DType::F32,
                    row_len,
                }]
            })
            .collect();
        let slices: Vec<(usize, SliceRef)> = (data.iter().zip(&refs).enumerate())
            .map(|(r, ((idx, _), vref))| {
                let slice = SliceRef {
                    index_dtype: DType::I64,
                    indices: idx.as_ptr() as usize,
                    rows,
                    values: vref,
                };
                (r, slice)
            })
            .collect();
        let b = HostBackend::new();
        let read = |c: &Coalesced| unsafe {
            let idx = std::slice::from_raw_parts(c.indices.ptr() as *const i64, c.rows);
            let val = std::slice::from_raw_parts(c.values[0].ptr() as *const f32, c.rows * row_len);
            (idx.to_vec(), val.to_vec())
        };
        let together =
            unsafe { coalesce_many(3, &slices, false, &mut |r, bytes| b.alloc(r, bytes)) }.unwrap();
        assert_eq!(together.len(), 4);
        for (k, s) in slices.iter().enumerate() {
            let alone = unsafe {
                coalesce_many(1, std::slice::from_ref(s), false, &mut |r, n| b.alloc(r, n))
            }
            .unwrap();
            assert!(together[k].rows > 0 && together[k].rows < rows, "slice {k}");
            assert_eq!(read(&together[k]), read(&alone[0]), "slice {k}");
        }
    }

    #[test]
    fn range_scan_reports_the_first_negative_or_too_large_index() {
        let v = [0i32, 9, -3, 10];
        let f = |b| unsafe { find_index_out_of_range(DType::I32, v.as_ptr() as usize, 4, b) };
        assert_eq!(f(10), Some((2, -3)));
        let w = [0i64, 9, 10];
        let g = |b| unsafe { find_index_out_of_range(DType::I64, w.as_ptr() as usize, 3, b) };
        assert_eq!(g(10), Some((2, 10)));
        assert_eq!(g(11), None);
    }

    #[test]
    fn divide_rounds_halves_once() {
        let mut v = [bf16::from_f32(3.0), bf16::from_f32(-7.0)];
        unsafe { divide(DType::Bf16, v.as_mut_ptr() as usize, 2, 2) };
        assert_eq!(v, [bf16::from_f32(1.5), bf16::from_f32(-3.5)]);
        let mut w = [1f32, 2., 3.];
        unsafe { divide(DType::F32, w.as_mut_ptr() as usize, 3, 4) };
        assert_eq!(w, [0.25, 0.5, 0.75]);
    }
}
