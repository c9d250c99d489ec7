//! Sparse gradients on CUDA replicas: the same steps run on host replicas and on CUDA replicas
//! give the same gathered slices, byte for byte (the gather copies rows; coalescing sums each
//! run of equal indices in world order with the same accumulation types everywhere). Without a
//! GPU every test prints "skipped: no CUDA device" and returns.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod close;
    pub mod context;
    pub mod cuda_context;
    pub mod embedding;
    pub mod errors;
    pub mod float16;
    pub mod gpu;
    pub mod lcg;
    pub mod place;
    pub mod skip;
    pub mod sparse;
}

use std::ffi::c_void;

use common::gpu::{fake_driver_fn, for_each_transport, rank_per_replica};
use common::place::{encode, encode_indices, read_at, synchronize, Mem, Place};
use common::{abi::*, buf::*, context::*, cuda_context::*, errors::*, lcg::*};

/// A sparse gradient of the comparison: name, row length, value dtype, index dtype, and the
/// gradient whose index buffer it shares (same pointer on every replica), if any.
struct Grad {
    name: &'static str,
    row_len: usize,
    values: DType,
    indices: DType,
    shares: Option<usize>,
}

const GRADS: [Grad; 3] = [
    Grad {
        name: "emb",
        row_len: 5,
        values: DType::F32,
        indices: DType::I64,
        shares: None,
    },
    Grad {
        name: "emb_half",
        row_len: 3,
        values: DType::F16,
        indices: DType::I64,
        shares: Some(0),
    },
    Grad {
        name: "tok",
        row_len: 70,
        values: DType::BF16,
        indices: DType::I32,
        shares: None,
    },
];

const TABLE: usize = 1000;

/// Rows replica r sets at `step`: uneven, zero on some replica, with duplicate indices.
fn rows(r: usize, step: usize) -> usize {
    [7, 0, 33, 5, 12][(r + step) % 5]
}

/// What one replica reads back after a step: per gradient, (rows, indices bytes, values bytes).
type Outputs = Vec<Vec<(usize, Vec<u8>, Vec<u8>)>>;

/// Two steps of every gradient in `place`, replica r on GPU `ordinals[r]` (one host replica
/// per ordinal on the host), over `transport`; the outputs of both steps. `None` when the
/// context cannot be made here (no GPU, or the transport is missing).
fn run(
    place: &Place,
    ordinals: &[i32],
    transport: u32,
    coalesce: bool,
    op: u32,
) -> Option<Vec<Outputs>> {
    let replicas = ordinals.len();
    let ctx = place.context("sparse run", ordinals, transport, coalesce)?;
    for g in &GRADS {
        ctx.reg_sparse_all(g.name, g.row_len, g.values.code(), g.indices.code(), TABLE);
    }
    let mut steps = Vec::new();
    for step in 0..2 {
        // Buffers live until the step's allreduce_grads has run (and been synchronized).
        let mut keep: Vec<Mem> = Vec::new();
        for (r, &ordinal) in ordinals.iter().enumerate() {
            let n = rows(r, step);
            let mut g = Lcg::new((100 * step + r) as u64);
            let mut own_indices: Vec<usize> = Vec::new();
            for (k, grad) in GRADS.iter().enumerate() {
                let indices_ptr = match grad.shares {
                    Some(other) => keep[own_indices[other]].ptr(),
                    None => {
                        let v: Vec<i64> = (0..n)
                            .map(|_| g.below(if k == 0 { 20 } else { TABLE as u64 }) as i64)
                            .collect();
                        keep.push(place.mem_on(ordinal, &encode_indices(grad.indices, &v)));
                        keep.last().unwrap().ptr()
                    }
                };
                own_indices.push(keep.len() - 1);
                // Moderate values: coalesced sums stay finite (inf - inf would give NaNs whose
                // bits differ between the GPU and the CPU).
                let v: Vec<f64> = (0..n * grad.row_len).map(|_| g.spread() * 4.0).collect();
                let values = encode(grad.values, &v);
                keep.push(place.mem_on(ordinal, &values));
                let st = ctx.sparse_set_raw(
                    grad.name,
                    r,
                    indices_ptr as *const c_void,
                    keep.last().unwrap().ptr() as *const c_void,
                    n,
                );
                check(st, &format!("sparse_set {} replica {r}", grad.name));
            }
        }
        check(ctx.allreduce_grads(op), "allreduce_grads");
        check(synchronize(&ctx), "synchronize");
        let mut outputs = Vec::new();
        for r in 0..replicas {
            let mut per = Vec::new();
            for grad in &GRADS {
                let out = ctx.sparse_get(grad.name, r).expect("sparse_get");
                let i = read_at(place, out.indices as usize, out.rows * grad.indices.size());
                let v = read_at(
                    place,
                    out.values as usize,
                    out.rows * grad.row_len * grad.values.size(),
                );
                per.push((out.rows, i, v));
            }
            outputs.push(per);
        }
        steps.push(outputs);
        drop(keep);
    }
    Some(steps)
}

/// Runs `ordinals` over `transport` in `gpu` and on the host with every combination of
/// coalescing and op, and asserts equal outputs. False when the transport is missing here.
fn matches_the_host(gpu: &Place, ordinals: &[i32], transport: u32) -> bool {
    let replicas = ordinals.len();
    for coalesce in [false, true] {
        for op in [SUM, AVG] {
            let Some(device) = run(gpu, ordinals, transport, coalesce, op) else {
                return false;
            };
            let host = run(&Place::Host, ordinals, transport, coalesce, op).unwrap();
            for (step, (d, h)) in device.iter().zip(&host).enumerate() {
                for r in 0..replicas {
                    for (k, grad) in GRADS.iter().enumerate() {
                        let what = format!(
                            "GPUs {ordinals:?}, transport {transport}, coalesce {coalesce}, op \
                             {op}, step {step}, replica {r}, '{}'",
                            grad.name
                        );
                        assert_eq!(d[r][k].0, h[r][k].0, "{what}: rows");
                        assert!(d[r][k].1 == h[r][k].1, "{what}: indices differ");
                        assert!(d[r][k].2 == h[r][k].2, "{what}: values differ");
                    }
                }
            }
            // Sanity of the comparison itself: the plain gather has every row.
            if !coalesce {
                let want: usize = (0..replicas).map(|r| rows(r, 0)).sum();
                assert_eq!(device[0][0][0].0, want);
            }
        }
    }
    true
}

#[test]
fn gathers_on_cuda_replicas_match_the_host_byte_for_byte() {
    let Some(gpu) = Place::gpu("gathers_on_cuda_replicas_match_the_host_byte_for_byte") else {
        return;
    };
    // Caffe2's test_sparse_shared_indices sizes (two of the gradients share an index buffer).
    for ordinals in [&[0][..], &[0, 0], &[0, 0, 0, 0], &[0; 8]] {
        assert!(matches_the_host(&gpu, ordinals, T_AUTO));
    }
}

/// Several GPUs (scripts/fake-cuda.sh: four fake ones, under each peer-access pattern): the
/// gather crosses devices by NCCL sends and receives, or by peer copies.
#[test]
fn gathers_across_gpus_match_the_host_byte_for_byte() {
    let Some(gpu) = Place::gpus("gathers_across_gpus_match_the_host_byte_for_byte", 4) else {
        return;
    };
    for_each_transport(
        &[&[0, 1, 2, 3], &[1, 1, 2, 0], &[2, 1]],
        |ordinals, transport| matches_the_host(&gpu, ordinals, transport),
    );
}

/// Caffe2's `test_equiv_sparse` on CUDA replicas (tests/common/embedding.rs): 1, 2 and 4
/// replicas on GPU 0, and across GPUs where there are four.
#[test]
fn equiv_sparse_embedding_model_trains_alike_on_cuda_replicas() {
    let Some(gpu) = Place::gpu("equiv_sparse_embedding_model_trains_alike_on_cuda_replicas") else {
        return;
    };
    assert!(common::embedding::equiv_sparse(
        &gpu,
        [&[0], &[0, 0], &[0, 0, 0, 0]],
        T_AUTO
    ));
}

#[test]
fn equiv_sparse_across_gpus() {
    let Some(gpu) = Place::gpus("equiv_sparse_across_gpus", 4) else {
        return;
    };
    for transport in [T_NCCL, T_PEER_COPY] {
        assert!(common::embedding::equiv_sparse(
            &gpu,
            [&[2], &[3, 1], &[0, 1, 2, 3]],
            transport
        ));
    }
}

/// One NCCL rank per replica on one GPU ([`rank_per_replica`]): the gather's moves between
/// replicas become NCCL sends and receives between ranks of one GPU.
#[test]
fn gathers_over_two_nccl_ranks_on_one_gpu_when_enabled() {
    let test = "gathers_over_two_nccl_ranks_on_one_gpu_when_enabled";
    let Some(gpu) = Place::gpu(test).filter(|_| rank_per_replica(test)) else {
        return;
    };
    for ordinals in [&[0, 0][..], &[0, 0, 0]] {
        assert!(matches_the_host(&gpu, ordinals, T_NCCL));
    }
}

/// Indices out of range are found by a kernel: the step returns OK, and the next
/// dpsync_synchronize reports INCONSISTENT naming the gradient, replica, row and index; once.
#[test]
fn indices_out_of_range_are_reported_by_synchronize() {
    let Some(gpu) = Place::gpu("indices_out_of_range_are_reported_by_synchronize") else {
        return;
    };
    let Some(ctx) = cuda_context("out of range", &[0, 0], |_| {}) else {
        return;
    };
    ctx.reg_sparse_all("emb", 2, F32, I64, 10);
    let good = gpu.mem(&encode_indices(DType::I64, &[1, 2, 3]));
    let bad = gpu.mem(&encode_indices(DType::I64, &[4, 10, -1]));
    let values = gpu.mem(&Buf::random(DType::F32, 6, 1).bytes());
    for (r, idx) in [(0, &good), (1, &bad)] {
        let st = ctx.sparse_set_raw("emb", r, idx.ptr() as _, values.ptr() as _, 3);
        check(st, "sparse_set");
    }
    check(
        ctx.allreduce_grads(SUM),
        "allreduce_grads (the check runs on the device)",
    );
    expect_err(
        synchronize(&ctx),
        INCONSISTENT,
        &["'emb'", "replica 1", "row 1", "index 10", "[0, 10)"],
    );
    check(synchronize(&ctx), "reported once");
    // The context stays usable.
    for r in 0..2 {
        let st = ctx.sparse_set_raw("emb", r, good.ptr() as _, values.ptr() as _, 3);
        check(st, "sparse_set");
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    check(synchronize(&ctx), "synchronize");
    // A bound of SIZE_MAX ("only check >= 0") still refuses a negative index.
    ctx.reg_sparse_all("any", 2, F32, I64, usize::MAX);
    let negative = gpu.mem(&encode_indices(DType::I64, &[7, i64::MIN, 1]));
    // A step whose "any" slice holds i64::MIN on replica 1.
    let bad_step = || {
        for r in 0..2 {
            let st = ctx.sparse_set_raw("emb", r, good.ptr() as _, values.ptr() as _, 3);
            check(st, "sparse_set");
            let idx = if r == 0 { &good } else { &negative };
            check(
                ctx.sparse_set_raw("any", r, idx.ptr() as _, values.ptr() as _, 3),
                "set",
            );
        }
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
    };
    bad_step();
    let needle = format!("index {}", i64::MIN);
    expect_err(
        synchronize(&ctx),
        INCONSISTENT,
        &["'any'", "replica 1", "row 1", &needle],
    );
    // Several bad steps before a synchronize: the first is reported, the others counted.
    for _ in 0..3 {
        bad_step();
    }
    expect_err(
        synchronize(&ctx),
        INCONSISTENT,
        &["'any'", &needle, "(and 2 more out-of-range checks)"],
    );
    check(synchronize(&ctx), "reported once");
}

/// i32 indices go through the device check too (its own kernel instantiation).
#[test]
fn i32_indices_out_of_range_are_reported_by_synchronize() {
    let Some(gpu) = Place::gpu("i32_indices_out_of_range") else {
        return;
    };
    let Some(ctx) = cuda_context("i32 out of range", &[0, 0], |o| {
        o.set_sparse_coalesce(true);
    }) else {
        return;
    };
    ctx.reg_sparse_all("emb", 2, F32, I32, 100);
    let good = gpu.mem(&encode_indices(DType::I32, &[5, 99, 0]));
    let bad = gpu.mem(&encode_indices(DType::I32, &[5, 0, -7]));
    let values = gpu.mem(&Buf::random(DType::F32, 6, 2).bytes());
    for (r, idx) in [(0, &bad), (1, &good)] {
        let st = ctx.sparse_set_raw("emb", r, idx.ptr() as _, values.ptr() as _, 3);
        check(st, "sparse_set");
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    expect_err(
        synchronize(&ctx),
        INCONSISTENT,
        &["'emb'", "replica 0", "row 2", "index -7", "[0, 100)"],
    );
}

#[test]
fn host_memory_slices_on_a_cuda_replica_are_refused() {
    let Some(ctx) = cuda_context("host slices", &[0], |_| {}) else {
        return;
    };
    ctx.reg_sparse_all("emb", 2, F32, I64, 0);
    let idx = [1i64, 2];
    let val = [0f32; 4];
    let st = ctx.sparse_set("emb", 0, &idx, &val);
    expect_err(st, INVALID_ARGUMENT, &["'emb'", "indices", "host memory"]);
}

/// The fake driver's count of device allocations made by this thread so far (dpsync allocates
/// on the calling thread; other tests may run beside this one); `None` on a real driver.
fn fake_allocations(test: &str) -> Option<i64> {
    // SAFETY: the fake's `long fake_cuda_allocations(void)`.
    let f = unsafe { fake_driver_fn::<extern "C" fn() -> i64>(test, "fake_cuda_allocations") };
    f.map(|f| f())
}

/// Coalescing allocates its per-step device buffers (maps of equal indices, coalesced slices);
/// once warm, steps reuse those of completed steps instead of calling cuMemAlloc and cuMemFree
/// (which may wait for the device) every step — also when the row counts vary. (The spares
/// grow to the largest demand seen: a step needing more than ever before still allocates.)
#[test]
fn coalesced_steps_reuse_device_memory_once_warm() {
    let test = "coalesced_steps_reuse_device_memory_once_warm";
    let Some(gpu) = Place::gpu(test) else {
        return;
    };
    let Some(ctx) = gpu.context(test, &[0, 0], T_PEER_COPY, true) else {
        return;
    };
    ctx.reg_sparse_all("emb", 4, F32, I64, 0);
    const MAX_ROWS: usize = 64;
    let mut bufs: Vec<(Mem, Mem)> = (0..2)
        .map(|_| {
            let idx = gpu.mem(&encode_indices(DType::I64, &[0; MAX_ROWS]));
            let val = gpu.mem(&Buf::random(DType::F32, 4 * MAX_ROWS, 1).bytes());
            (idx, val)
        })
        .collect();
    let mut before = None;
    // Four different steps, repeated: once each has run, the spares cover every request.
    for step in 0..24 {
        if step == 8 {
            before = fake_allocations(test);
            if before.is_none() {
                return;
            }
        }
        let rows = [40, 61, 47, 54][step % 4];
        let mut g = Lcg::new((step % 4) as u64);
        for (r, (idx, val)) in bufs.iter_mut().enumerate() {
            let v: Vec<i64> = (0..MAX_ROWS).map(|_| g.below(30) as i64).collect();
            idx.write(&encode_indices(DType::I64, &v));
            let st = ctx.sparse_set_raw("emb", r, idx.ptr() as _, val.ptr() as _, rows);
            check(st, "sparse_set");
        }
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        check(synchronize(&ctx), "synchronize");
        let out = ctx.sparse_get("emb", 1).expect("sparse_get");
        assert!(
            out.rows > 0 && out.rows <= 30,
            "coalesced rows {}",
            out.rows
        );
    }
    let after = fake_allocations(test).expect("counter");
    assert_eq!(
        after - before.expect("read at step 8"),
        0,
        "device allocations in 16 warm coalesced steps"
    );
}

/// The gather in stream order, each replica with its own caller stream: on replica r's stream a
/// kernel writes r + 1 into the slice's values and (as bits) its indices, spinning ~0.2 s first
/// on one replica, in turn each; `allreduce_grads` gathers; a kernel on the same stream copies
/// the gathered slice out. No host synchronisation in between (trivial on the synchronous fake
/// driver; it bites on a GPU and under FAKE_CUDA_ASYNC=1). False when `transport` is not
/// available here.
fn gather_in_stream_order(test: &str, ordinals: &[i32], transport: u32, coalesce: bool) -> bool {
    use common::gpu::{set_stream, spin_kernels};
    use common::place::dptr;
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    let (rows, row_len) = (64usize, 4usize);
    let reps = ordinals.len();
    for slow in 0..reps {
        let Some(ctx) = cuda_context(test, ordinals, |o| {
            o.set_transport(transport);
            o.set_sparse_coalesce(coalesce);
        }) else {
            return false;
        };
        // Indices are the f32 bits of r + 1 (no range check): distinct per replica, all equal
        // within one, so coalescing leaves one row per replica, summed over `rows`.
        ctx.reg_sparse_all("emb", row_len, F32, I32, 0);
        let mut replicas = Vec::new();
        for (r, &ordinal) in ordinals.iter().enumerate() {
            let dev = CudaContext::new(ordinal as usize).unwrap();
            let stream = dev.new_stream().unwrap();
            let indices = stream.alloc_zeros::<f32>(rows).unwrap();
            let values = stream.alloc_zeros::<f32>(rows * row_len).unwrap();
            stream.synchronize().unwrap();
            set_stream(&ctx, r, &stream);
            let (i, v) = (dptr(&stream, &indices), dptr(&stream, &values));
            check(
                ctx.sparse_set_raw("emb", r, i as *const c_void, v as *const c_void, rows),
                "sparse_set",
            );
            let k = spin_kernels(&dev);
            let fill = |buf: &cudarc::driver::CudaSlice<f32>, n: usize, cycles: i64| {
                let (nn, value) = (n as u64, (r + 1) as f32);
                let mut b = stream.launch_builder(&k.fill);
                b.arg(buf).arg(&nn).arg(&value).arg(&cycles);
                // SAFETY: arguments match the kernel.
                unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
            };
            fill(&indices, rows, if r == slow { 400_000_000 } else { 0 }); // ~0.2 s at 2 GHz
            fill(&values, rows * row_len, 0);
            replicas.push((k, stream, indices, values));
        }
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        let (out_rows, want_index, want_value): (usize, Vec<f32>, Vec<f32>) = if coalesce {
            let idx = (1..=reps).map(|q| q as f32).collect();
            let val = (1..=reps).map(|q| (q * rows) as f32).collect();
            (reps, idx, val)
        } else {
            let per_row = (0..reps * rows)
                .map(|i| (i / rows + 1) as f32)
                .collect::<Vec<_>>();
            (reps * rows, per_row.clone(), per_row)
        };
        for (r, (k, stream, _, _)) in replicas.iter().enumerate() {
            let got = ctx.sparse_get("emb", r).unwrap();
            assert_eq!(got.rows, out_rows, "rows on replica {r}");
            let copy_out = |from: *const c_void, n: usize| {
                let out = stream.alloc_zeros::<f32>(n).unwrap();
                let (from, nn) = (from as u64, n as u64);
                let mut b = stream.launch_builder(&k.copy);
                b.arg(&from).arg(&out).arg(&nn);
                // SAFETY: `from` is the gathered slice, n elements of 4 bytes on this device.
                unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
                stream.clone_dtoh(&out).unwrap()
            };
            let indices = copy_out(got.indices, out_rows);
            let values = copy_out(got.values, out_rows * row_len);
            let what = format!(
                "{ordinals:?}, transport {transport}, coalesce {coalesce}, replica {slow} slow: \
                 replica {r}'s stream read"
            );
            assert_eq!(indices, want_index, "{what} these indices");
            for (row, chunk) in values.chunks(row_len).enumerate() {
                assert!(
                    chunk.iter().all(|&x| x == want_value[row]),
                    "{what} row {row} = {chunk:?}, want {}",
                    want_value[row]
                );
            }
        }
        check(synchronize(&ctx), "synchronize");
    }
    true
}

#[test]
fn gathers_are_ordered_by_each_replicas_stream() {
    for_each_transport(&[&[0, 0, 0]], |ordinals, transport| {
        [false, true].into_iter().all(|coalesce| {
            gather_in_stream_order("gathers_in_order", ordinals, transport, coalesce)
        })
    });
}

#[test]
fn gathers_across_gpus_are_ordered_by_each_replicas_stream() {
    let test = "gathers_across_gpus_in_order";
    if Place::gpus(test, 4).is_none() {
        return;
    }
    for_each_transport(&[&[0, 1, 2, 3]], |ordinals, transport| {
        [false, true]
            .into_iter()
            .all(|coalesce| gather_in_stream_order(test, ordinals, transport, coalesce))
    });
}

/// Coalescing waits on the host for the indices, which come after the work already queued on
/// the replica's stream. That wait is bounded by the timeout like any other: a caller stream
/// stuck until the test releases it makes `allreduce_grads` return TIMEOUT after 50 ms (the
/// context then refuses further collectives), rather than block until the stream is free. Needs asynchronous
/// streams (a GPU, or the fake driver's FAKE_CUDA_ASYNC=1).
#[test]
fn the_coalescing_wait_for_the_indices_times_out() {
    use common::gpu::{set_stream, StuckCaller};
    use common::place::dptr;
    let test = "the_coalescing_wait_for_the_indices_times_out";
    let Some(stuck) = StuckCaller::new(test, |o| {
        o.set_sparse_coalesce(true);
        o.set_timeout_ms(50);
    }) else {
        return;
    };
    let (ctx, caller) = (&stuck.ctx, &stuck.caller);
    let (rows, row_len) = (8usize, 2usize);
    let indices = caller.alloc_zeros::<i32>(rows).unwrap();
    let values = caller.alloc_zeros::<f32>(rows * row_len).unwrap();
    let spun = caller.alloc_zeros::<f32>(1024).unwrap();
    caller.synchronize().unwrap();
    ctx.reg_sparse_all("emb", row_len, F32, I32, 0);
    for r in 0..2 {
        set_stream(ctx, r, caller);
        let (i, v) = (dptr(caller, &indices), dptr(caller, &values));
        check(
            ctx.sparse_set_raw("emb", r, i as *const c_void, v as *const c_void, rows),
            "sparse_set",
        );
    }
    stuck.spin_until_released_then_fill(&spun, 1.0);
    expect_err(ctx.allreduce_grads(SUM), TIMEOUT, &["timeout"]);
    // The stream is busy until released: had the wait not been bounded, allreduce_grads would
    // have returned only once the kernel's safety net (about a minute) freed it.
    assert!(
        stuck.still_busy(),
        "allreduce_grads returned once the stream was free, not at the 50 ms timeout"
    );
    expect_err(ctx.allreduce_grads(SUM), INVALID_STATE, &["destroy"]);
    stuck.release();
    caller.synchronize().unwrap();
}
