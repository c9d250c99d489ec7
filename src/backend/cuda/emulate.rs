//! Tests that run dpsync's CUDA kernels without a GPU: the kernel sources are compiled as host
//! C++ under `kernels/emulate.hpp` (every block in turn, its threads as OS threads meeting at
//! `__syncthreads`), and launched through [`Kernels`]' own launch methods with the emulator
//! as launcher. So the parameter marshalling, the segment tables, the kernels' indexing and
//! their arithmetic are checked against the host backend, byte for byte. What this cannot check:
//! the driver, streams and events, NCCL, and the real f16 `cvt` instructions (the emulator uses
//! the compiler's `_Float16`, also round-to-nearest-even).
//!
//! Needs a C++20 compiler (`c++`, or `CXX`); without one every test prints "skipped".

use std::sync::OnceLock;

use half::{bf16, f16};

use super::kernels::{Bmuf, Kernels, Launcher, Walk, ITEMS};
use super::memory::table_of;
use crate::backend::host::HostBackend;
use crate::backend::{
    coalescing_order, Backend, BmufFilter, BmufSpan, BucketView, Segment, SliceRef, ValuesRef,
};
use crate::options::Options;
use crate::plan::{Levels, Topology};
use crate::types::{DType, ReduceOp};

/// The emulator library, built once per test process (`None`: no C++ compiler).
fn emulator() -> Option<&'static Kernels> {
    static KERNELS: OnceLock<Option<Kernels>> = OnceLock::new();
    KERNELS
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("dpsync-emu-{}", std::process::id()));
            std::fs::create_dir_all(&dir).ok()?;
            let mut src = String::from(include_str!("kernels/emulate.hpp"));
            src.push('\n');
            src.push_str(&super::kernels::source());
            let cpp = dir.join("kernels.cpp");
            std::fs::write(&cpp, src).ok()?;
            let lib = dir.join("libdpsync_emu.so");
            let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
            let out = std::process::Command::new(&cxx)
                .args([
                    "-std=c++20",
                    "-O1",
                    "-ffp-contract=off",
                    "-fPIC",
                    "-shared",
                    "-pthread",
                ])
                .arg(format!("-DITEMS_PER_THREAD={ITEMS}"))
                .arg("-o")
                .arg(&lib)
                .arg(&cpp)
                .output();
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    eprintln!("kernel emulation: skipped: cannot run {cxx}: {e}");
                    return None;
                }
            };
            assert!(
                out.status.success(),
                "the kernels do not compile as host C++ under emulate.hpp:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            // SAFETY: our library; its initialisers only fill the kernel registry.
            let lib = unsafe { libloading::Library::new(&lib) }.expect("load the emulator");
            // SAFETY: the signatures of emulate.hpp's entry points.
            let launcher = unsafe {
                Launcher::Emulated {
                    find: *lib.get(b"dpsync_emu_find\0").expect("dpsync_emu_find"),
                    launch: *lib.get(b"dpsync_emu_launch\0").expect("dpsync_emu_launch"),
                }
            };
            std::mem::forget(lib); // the function pointers live for the process
            let _ = std::fs::remove_dir_all(&dir);
            Some(Kernels::emulated(launcher).expect("every dense kernel is registered"))
        })
        .as_ref()
}

macro_rules! emulator_or_skip {
    ($test:literal) => {
        match emulator() {
            Some(k) => k,
            None => {
                eprintln!(concat!(
                    $test,
                    ": skipped: no C++ compiler for the kernel emulator"
                ));
                return;
            }
        }
    };
}

/// Raw bytes of `n` elements of `dtype` with values that exercise rounding (f16/bf16 sums that
/// round differently in the element type than in f32) but stay finite.
fn values(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    };
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let v = next() * if i % 7 == 3 { 900.0 } else { 3.0 };
        match dtype {
            DType::F32 => out.extend((v as f32).to_ne_bytes()),
            DType::F64 => out.extend((v * 1.000_000_1).to_ne_bytes()),
            DType::F16 => out.extend(f16::from_f64(v).to_bits().to_ne_bytes()),
            DType::Bf16 => out.extend(bf16::from_f64(v).to_bits().to_ne_bytes()),
            DType::I32 => out.extend(((v * 1e6) as i32 ^ (i as i32) << 28).to_ne_bytes()),
            DType::I64 => out.extend(((v * 1e15) as i64 ^ (i as i64) << 60).to_ne_bytes()),
        }
    }
    out
}

/// `v` as raw bytes of `dtype` (exact for small integers in every type).
fn small_integers(dtype: DType, v: &[i64]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match dtype {
            DType::F32 => (x as f32).to_ne_bytes().to_vec(),
            DType::F64 => (x as f64).to_ne_bytes().to_vec(),
            DType::F16 => f16::from_f64(x as f64).to_bits().to_ne_bytes().to_vec(),
            DType::Bf16 => bf16::from_f64(x as f64).to_bits().to_ne_bytes().to_vec(),
            DType::I32 => (x as i32).to_ne_bytes().to_vec(),
            DType::I64 => x.to_ne_bytes().to_vec(),
        })
        .collect()
}

/// 8-byte aligned storage for raw element bytes.
fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut w = vec![0u64; bytes.len().div_ceil(8).max(1)];
    // SAFETY: the words hold at least `bytes.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), w.as_mut_ptr().cast(), bytes.len()) };
    w
}

fn bytes_of(w: &[u64], n: usize) -> Vec<u8> {
    // SAFETY: `n` <= the words' bytes.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), n) }.to_vec()
}

/// Segment sizes that cross the kernels' chunk boundaries (1024 elements) at odd places.
const SEGMENTS: [usize; 4] = [1, 1500, 3, 2049];

/// `replicas` copies of a bucket of SEGMENTS tensors: `bufs[r][s]`.
fn bucket_buffers(dtype: DType, replicas: usize) -> Vec<Vec<Vec<u64>>> {
    (0..replicas)
        .map(|r| {
            SEGMENTS
                .iter()
                .enumerate()
                .map(|(s, &n)| aligned(&values(dtype, n, (r * 10 + s) as u64 + 1)))
                .collect()
        })
        .collect()
}

/// Every segment of every replica as bytes.
fn snapshot(dtype: DType, bufs: &[Vec<Vec<u64>>]) -> Vec<Vec<u8>> {
    bufs.iter()
        .flat_map(|r| {
            r.iter()
                .zip(SEGMENTS)
                .map(|(w, n)| bytes_of(w, n * dtype.size()))
        })
        .collect()
}

fn pointers(bufs: &mut [Vec<Vec<u64>>]) -> Vec<Vec<usize>> {
    // ptrs[s][r]
    let replicas = bufs.len();
    (0..SEGMENTS.len())
        .map(|s| {
            (0..replicas)
                .map(|r| bufs[r][s].as_mut_ptr() as usize)
                .collect()
        })
        .collect()
}

/// A bucket of SEGMENTS tensors over `ptrs[s][r]` ([`pointers`]).
fn view_of(dtype: DType, ptrs: &[Vec<usize>]) -> BucketView<'_> {
    BucketView {
        dtype,
        segments: (ptrs.iter().zip(SEGMENTS))
            .map(|(p, count)| Segment { ptrs: p, count })
            .collect(),
    }
}

/// The host backend's allreduce of the same buffers (its own levels for host replicas).
fn host_allreduce(dtype: DType, bufs: &mut [Vec<Vec<u64>>], op: ReduceOp) {
    let replicas = bufs.len();
    let mut o = Options::default();
    o.set_host_replicas(replicas).unwrap();
    let levels = Levels::new(&Topology::from_options(&o).unwrap());
    let avg = (op == ReduceOp::Avg && replicas > 1).then_some(replicas);
    let ptrs = pointers(bufs);
    let bucket = view_of(dtype, &ptrs);
    // SAFETY: every pointer holds its segment's elements.
    unsafe { HostBackend::new().reduce(0, &levels.groups[0], &bucket, avg) }.unwrap();
}

/// A walk table over `bufs` (all replicas local), as CudaBackend::table builds it.
fn walk_table(bufs: &mut [Vec<Vec<u64>>]) -> Vec<u64> {
    let ptrs = pointers(bufs);
    table_of(
        SEGMENTS.iter().copied(),
        ptrs.iter()
            .map(|p| p.iter().map(|&x| x as u64).collect::<Vec<_>>()),
    )
}

/// `bufs` with exponents over 60 binades, elements that cancel, and NaN and infinities at
/// fixed places of segment 1 (NaN; +inf and -inf; +inf alone; -inf with a NaN).
fn spread_out(dtype: DType, bufs: &mut [Vec<Vec<u64>>]) {
    let replicas = bufs.len();
    for (r, replica) in bufs.iter_mut().enumerate() {
        for (s, words) in replica.iter_mut().enumerate() {
            // SAFETY: the words hold the segment's elements of `dtype` (F32 or F64).
            unsafe {
                let n = SEGMENTS[s];
                let get = |i: usize| match dtype {
                    DType::F32 => f64::from(*words.as_ptr().cast::<f32>().add(i)),
                    _ => *words.as_ptr().cast::<f64>().add(i),
                };
                let vals: Vec<f64> = (0..n).map(get).collect();
                for (i, mut v) in vals.into_iter().enumerate() {
                    v *= 2f64.powi((i % 61) as i32 - 30);
                    if i % 9 == 4 && replicas > 1 {
                        // Cancels against the next replica's up to a small remainder.
                        v = if r % 2 == 0 { 1e6 + v * 1e-9 } else { -1e6 };
                    }
                    let special = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
                    if s == 1 && i < 4 && r < 2 {
                        v = match (i, r) {
                            (0, 0) | (3, 1) => special[0],
                            (1, 0) | (2, 0) => special[1],
                            (1, 1) | (3, 0) => special[2],
                            _ => v,
                        };
                    }
                    match dtype {
                        DType::F32 => *words.as_mut_ptr().cast::<f32>().add(i) = v as f32,
                        _ => *words.as_mut_ptr().cast::<f64>().add(i) = v,
                    }
                }
            }
        }
    }
}

#[test]
fn one_gpu_reproducible_kernel_gives_the_host_bytes() {
    let k = emulator_or_skip!("one_gpu_reproducible_kernel");
    for dtype in [DType::F32, DType::F64] {
        for (replicas, op) in [
            (2, ReduceOp::Sum),
            (3, ReduceOp::Avg),
            (4, ReduceOp::Sum),
            (5, ReduceOp::Sum),
        ] {
            let mut dev = bucket_buffers(dtype, replicas);
            spread_out(dtype, &mut dev);
            let mut host = dev.clone();
            let avg = (op == ReduceOp::Avg).then_some(replicas);
            let ptrs = pointers(&mut host);
            let bucket = view_of(dtype, &ptrs);
            let members: Vec<usize> = (0..replicas).collect();
            // SAFETY: every pointer holds its segment's elements.
            unsafe { HostBackend::new().reduce_reproducible(&members, &bucket, avg) }.unwrap();
            let table = walk_table(&mut dev);
            let total: usize = SEGMENTS.iter().sum();
            let (nseg, null) = (SEGMENTS.len(), std::ptr::null_mut());
            let table = table.as_ptr() as u64;
            k.reproducible(null, dtype, table, (nseg, replicas, total), avg)
                .unwrap();
            assert!(
                snapshot(dtype, &dev) == snapshot(dtype, &host),
                "{dtype} {op:?} on {replicas} replicas differs from the host's reproducible sum"
            );
        }
    }
}

#[test]
fn one_gpu_shard_kernels_give_the_host_bytes_for_every_dtype() {
    let k = emulator_or_skip!("one_gpu_shard_kernels");
    for dtype in DType::ALL {
        for (replicas, op) in [(3, ReduceOp::Sum), (4, ReduceOp::Avg), (5, ReduceOp::Sum)] {
            let owned = |s: usize, r: usize| crate::types::piece(SEGMENTS[s], r, replicas);
            let avg = (op == ReduceOp::Avg).then_some(replicas);
            let members: Vec<usize> = (0..replicas).collect();
            let total: usize = SEGMENTS.iter().sum();
            let dims = (SEGMENTS.len(), replicas, total);
            for scatter in [true, false] {
                let mut dev = bucket_buffers(dtype, replicas);
                let mut host = dev.clone();
                let ptrs = pointers(&mut host);
                let bucket = view_of(dtype, &ptrs);
                let h = HostBackend::new();
                // SAFETY: every pointer holds its segment's elements.
                unsafe {
                    match scatter {
                        true => h.reduce_owned(&members, &bucket, avg, &owned),
                        false => h.spread_owned(&bucket, &owned),
                    }
                }
                .unwrap();
                let table = walk_table(&mut dev);
                let (table, null) = (table.as_ptr() as u64, std::ptr::null_mut());
                let divisor = avg.filter(|_| scatter);
                k.owned(null, dtype, table, dims, scatter, divisor).unwrap();
                assert!(
                    snapshot(dtype, &dev) == snapshot(dtype, &host),
                    "{dtype} {op:?} on {replicas} replicas, scatter {scatter}: differs from the host"
                );
            }
        }
    }
}

#[test]
fn one_gpu_allreduce_walk_gives_the_host_bytes_for_every_dtype() {
    let k = emulator_or_skip!("one_gpu_allreduce_walk");
    for dtype in DType::ALL {
        for (replicas, op) in [(3, ReduceOp::Sum), (3, ReduceOp::Avg), (2, ReduceOp::Avg)] {
            let mut dev = bucket_buffers(dtype, replicas);
            let mut host = dev.clone();
            host_allreduce(dtype, &mut host, op);
            let table = walk_table(&mut dev);
            let total: usize = SEGMENTS.iter().sum();
            let avg = (op == ReduceOp::Avg).then_some(replicas);
            k.walk(
                std::ptr::null_mut(),
                dtype,
                table.as_ptr() as u64,
                SEGMENTS.len(),
                replicas,
                total,
                0,
                Walk::Allreduce,
                avg,
            )
            .unwrap();
            assert!(
                snapshot(dtype, &dev) == snapshot(dtype, &host),
                "{dtype} {op:?} on {replicas} replicas differs from the host backend"
            );
        }
    }
}

#[test]
fn pack_add_unpack_across_two_devices_sums_every_replica() {
    // Two "GPUs" with two replicas each: pack each pair, add the fusion buffers, unpack the
    // average. Partial sums travel rounded to the element type (docs/API.md, "Arithmetic"), so
    // the values are small integers whose sums are exact in every type: then the result must
    // be the host's, byte for byte.
    let k = emulator_or_skip!("pack_add_unpack");
    for dtype in [
        DType::I32,
        DType::I64,
        DType::F64,
        DType::F32,
        DType::F16,
        DType::Bf16,
    ] {
        let all: Vec<Vec<Vec<u64>>> = (0..4)
            .map(|r| {
                SEGMENTS
                    .iter()
                    .map(|&n| {
                        let v: Vec<i64> = (0..n)
                            .map(|i| ((i * 13 + r * 7) % 41) as i64 - 20)
                            .collect();
                        aligned(&small_integers(dtype, &v))
                    })
                    .collect()
            })
            .collect();
        let mut host = all.clone();
        host_allreduce(dtype, &mut host, ReduceOp::Avg);
        let total: usize = SEGMENTS.iter().sum();
        let mut gpu = [all[..2].to_vec(), all[2..].to_vec()];
        let mut fusion = [vec![0u64; total], vec![0u64; total]];
        let tables: Vec<Vec<u64>> = gpu.iter_mut().map(|g| walk_table(g)).collect();
        for g in 0..2 {
            k.walk(
                std::ptr::null_mut(),
                dtype,
                tables[g].as_ptr() as u64,
                SEGMENTS.len(),
                2,
                total,
                fusion[g].as_mut_ptr() as u64,
                Walk::Pack,
                None,
            )
            .unwrap();
        }
        let (a, b) = fusion.split_at_mut(1);
        k.add(
            std::ptr::null_mut(),
            dtype,
            a[0].as_mut_ptr() as u64,
            b[0].as_ptr() as u64,
            total,
        )
        .unwrap();
        let sum = fusion[0].clone();
        for table in &tables {
            k.walk(
                std::ptr::null_mut(),
                dtype,
                table.as_ptr() as u64,
                SEGMENTS.len(),
                2,
                total,
                sum.as_ptr() as u64,
                Walk::Unpack,
                Some(4),
            )
            .unwrap();
        }
        let got: Vec<Vec<Vec<u64>>> = gpu.concat();
        assert!(
            snapshot(dtype, &got) == snapshot(dtype, &host),
            "{dtype}: pack/add/unpack differs from the host"
        );
    }
}

#[test]
fn bmuf_kernel_gives_the_host_bytes() {
    let k = emulator_or_skip!("bmuf_kernel");
    for dtype in [DType::F32, DType::F64, DType::F16, DType::Bf16] {
        let state = crate::backend::bmuf_state_dtype(dtype).unwrap().size();
        for nesterov in [false, true] {
            let filter = BmufFilter {
                block_lr: 0.9,
                block_momentum: 0.7,
                nesterov,
                default_momentum: false,
            };
            // params, W, D per segment, for the host and the kernel.
            let make = || -> Vec<[Vec<u64>; 3]> {
                SEGMENTS
                    .iter()
                    .enumerate()
                    .map(|(s, &n)| {
                        let p = aligned(&values(dtype, n, 40 + s as u64));
                        [
                            p,
                            vec![0u64; (n * state).div_ceil(8)],
                            vec![0u64; (n * state).div_ceil(8)],
                        ]
                    })
                    .collect()
            };
            let spans = |m: &mut Vec<[Vec<u64>; 3]>| -> Vec<BmufSpan> {
                m.iter_mut()
                    .zip(SEGMENTS)
                    .map(|(t, count)| BmufSpan {
                        params: t[0].as_mut_ptr() as usize,
                        w: t[1].as_mut_ptr() as usize,
                        d: t[2].as_mut_ptr() as usize,
                        count,
                    })
                    .collect()
            };
            let (mut host, mut dev) = (make(), make());
            let (hs, ds) = (spans(&mut host), spans(&mut dev));
            let table = table_of(
                ds.iter().map(|s| s.count),
                ds.iter().map(|s| [s.params as u64, s.w as u64, s.d as u64]),
            );
            let total: usize = SEGMENTS.iter().sum();
            let run = |mode: Bmuf| {
                k.bmuf(
                    std::ptr::null_mut(),
                    dtype,
                    table.as_ptr() as u64,
                    ds.len(),
                    total,
                    mode,
                    filter.block_momentum,
                    filter.block_lr,
                )
                .unwrap()
            };
            let hb = HostBackend::new();
            // SAFETY: the spans point at live buffers of their counts.
            unsafe { hb.bmuf_load(0, dtype, &hs) }.unwrap();
            run(Bmuf::Load);
            for block in 0..3u64 {
                // The same "averaged" params on both sides, then one filter step.
                for (h, d) in host.iter_mut().zip(dev.iter_mut()) {
                    let n = h[0].len();
                    let fresh = aligned(&values(dtype, n * 8 / dtype.size(), 90 + block));
                    h[0].copy_from_slice(&fresh[..n]);
                    d[0].copy_from_slice(&fresh[..n]);
                }
                // SAFETY: as above.
                unsafe { hb.bmuf_update(0, dtype, &hs, &filter) }.unwrap();
                run(if nesterov {
                    Bmuf::Nesterov
                } else {
                    Bmuf::Classical
                });
                for (s, (h, d)) in host.iter().zip(&dev).enumerate() {
                    for (what, i, size) in [
                        ("params", 0, dtype.size()),
                        ("W", 1, state),
                        ("D", 2, state),
                    ] {
                        let n = SEGMENTS[s] * size;
                        assert!(
                            bytes_of(&h[i], n) == bytes_of(&d[i], n),
                            "{dtype} nesterov {nesterov} block {block} segment {s}: {what} differs"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn index_check_finds_the_first_row_out_of_range() {
    let k = emulator_or_skip!("index_check");
    for dtype in [DType::I32, DType::I64] {
        let n = 5000;
        for bad in [None, Some((4321usize, 1000i64)), Some((17, -5))] {
            let mut idx: Vec<i64> = (0..n as i64).map(|i| (i * 7) % 1000).collect();
            if let Some((row, v)) = bad {
                idx[row] = v;
                idx[n - 1] = 5000; // a later bad row must not win
            }
            let raw: Vec<u8> = match dtype {
                DType::I32 => idx.iter().flat_map(|&i| (i as i32).to_ne_bytes()).collect(),
                _ => idx.iter().flat_map(|&i| i.to_ne_bytes()).collect(),
            };
            let words = aligned(&raw);
            let mut found = [u64::MAX; 2];
            k.index_check(
                std::ptr::null_mut(),
                dtype,
                words.as_ptr() as u64,
                n,
                1000,
                found.as_mut_ptr() as u64,
            )
            .unwrap();
            match bad {
                None => assert_eq!(found[0], u64::MAX, "{dtype}: clean indices"),
                Some((row, v)) => {
                    assert_eq!(found[0], row as u64, "{dtype}: first bad row");
                    assert_eq!(found[1] as i64, v, "{dtype}: its index");
                }
            }
        }
    }
}

#[test]
fn run_sums_and_divide_give_the_host_coalesced_bytes() {
    let k = emulator_or_skip!("run_sums");
    let rows = 700;
    let keys: Vec<i64> = (0..rows as i64)
        .map(|i| (i * i * 31 + 7) % 97 - 3)
        .collect();
    let (unique, positions, bounds) = coalescing_order(&keys);
    let map: Vec<u64> = positions.iter().chain(&bounds).map(|&p| p as u64).collect();
    let (pos_ptr, bounds_ptr) = (map.as_ptr() as u64, map[positions.len()..].as_ptr() as u64);
    let indices = aligned(
        &keys
            .iter()
            .flat_map(|k| k.to_ne_bytes())
            .collect::<Vec<u8>>(),
    );
    for dtype in [DType::F32, DType::F64, DType::F16, DType::Bf16] {
        let row_len = 67;
        let src = aligned(&values(dtype, rows * row_len, 5));
        let vref = [ValuesRef {
            ptr: src.as_ptr() as usize,
            dtype,
            row_len,
        }];
        let slice = SliceRef {
            index_dtype: DType::I64,
            indices: indices.as_ptr() as usize,
            rows,
            values: &vref,
        };
        let hb = HostBackend::new();
        // SAFETY: the slice's buffers hold `rows` indices and rows.
        let host = unsafe { hb.coalesce_one(0, &slice) }.unwrap();
        assert_eq!(host.rows, unique.len());
        let bytes = unique.len() * row_len * dtype.size();
        let mut out = vec![0u64; bytes.div_ceil(8)];
        k.sum_runs(
            std::ptr::null_mut(),
            dtype,
            src.as_ptr() as u64,
            pos_ptr,
            bounds_ptr,
            unique.len(),
            row_len,
            out.as_mut_ptr() as u64,
        )
        .unwrap();
        // SAFETY: the host result holds `bytes`.
        let want = unsafe { std::slice::from_raw_parts(host.values[0].ptr() as *const u8, bytes) };
        assert!(
            bytes_of(&out, bytes) == want,
            "{dtype}: run sums differ from the host"
        );
        // AVG over 3 replicas, on both.
        k.divide(
            std::ptr::null_mut(),
            dtype,
            out.as_mut_ptr() as u64,
            bytes / dtype.size(),
            3,
        )
        .unwrap();
        // SAFETY: as above.
        unsafe { hb.divide(0, dtype, host.values[0].ptr(), bytes / dtype.size(), 3) }.unwrap();
        // SAFETY: as above.
        let want = unsafe { std::slice::from_raw_parts(host.values[0].ptr() as *const u8, bytes) };
        assert!(
            bytes_of(&out, bytes) == want,
            "{dtype}: division differs from the host"
        );
    }
}

/// The passes of reproducible sums over several devices.
#[path = "emulate_stages.rs"]
mod stages;
