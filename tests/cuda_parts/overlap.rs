//! dpsync_grad_ready on CUDA replicas: early buckets give the host's bytes and do not make the
//! callers wait.

use super::*;

/// Tensors of the overlap runs: name, dtype, elements (several buckets at 64-byte fusion).
const OVERLAP_MODEL: [(&str, DType, usize); 5] = [
    ("a", DType::F32, 5),
    ("b", DType::F16, 9),
    ("c", DType::F32, 13),
    ("d", DType::I32, 4),
    ("e", DType::F64, 6),
];

/// Steps with every gradient declared final by dpsync_grad_ready (in backward order), SUM then
/// AVG: every replica's bytes after each step. Values are small integers, exact in every dtype
/// and order, so host and device runs must agree byte for byte. `None` without a GPU.
fn overlap_steps(place: &Place, ordinals: &[i32], transport: u32) -> Option<Vec<Vec<Vec<u8>>>> {
    let ctx = match place {
        Place::Host => Context::host(ordinals.len(), Some(64)),
        Place::Gpu(_) => cuda_context("overlap", ordinals, |o| {
            o.set_transport(transport);
            o.set_fusion_bytes(64);
        })?,
    };
    let encoded = |dtype: DType, v: &[f64]| match dtype {
        DType::I32 | DType::I64 => {
            encode_indices(dtype, &v.iter().map(|&x| x as i64).collect::<Vec<_>>())
        }
        _ => encode(dtype, v),
    };
    let mut mems: Vec<Vec<Mem>> = Vec::new();
    for (r, &ordinal) in ordinals.iter().enumerate() {
        let mut per = Vec::new();
        for &(name, dtype, n) in &OVERLAP_MODEL {
            let mem = place.mem_on(ordinal, &vec![0u8; n * dtype.size()]);
            let st = register_raw(ctx.0, name, GRAD, r, mem.ptr() as _, n, dtype.code());
            check(st, "register");
            per.push(mem);
        }
        mems.push(per);
    }
    let mut out = Vec::new();
    for (step, op) in [(0usize, SUM), (1, SUM), (2, AVG), (3, AVG)] {
        for (r, per) in mems.iter_mut().enumerate() {
            for (i, (mem, &(_, dtype, n))) in per.iter_mut().zip(&OVERLAP_MODEL).enumerate() {
                let v: Vec<f64> = (0..n).map(|e| value(r + step, e + i)).collect();
                mem.write(&encoded(dtype, &v));
            }
        }
        for &(name, _, _) in OVERLAP_MODEL.iter().rev() {
            for r in 0..ordinals.len() {
                check(ctx.grad_ready(name, r), "grad_ready");
            }
        }
        let early = &ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"];
        assert_eq!(
            early.as_u64().unwrap() > 0,
            step > 0,
            "step {step}: {early}"
        );
        check(ctx.allreduce_grads(op), "allreduce_grads");
        if let Place::Gpu(_) = place {
            check(synchronize(&ctx), "synchronize");
        }
        out.push(mems.iter().flatten().map(Mem::read).collect());
    }
    Some(out)
}

/// dpsync_grad_ready on CUDA replicas: early buckets queued on dpsync's streams (and divided on
/// the device when the op changes from SUM to AVG) give the host's bytes.
#[test]
fn grad_ready_on_cuda_replicas_gives_the_hosts_bytes() {
    let Some(gpu) = Place::gpu("grad_ready_on_cuda_replicas_gives_the_hosts_bytes") else {
        return;
    };
    let host = overlap_steps(&Place::Host, &[0, 0, 0], T_HOST).unwrap();
    let got = overlap_steps(&gpu, &[0, 0, 0], T_AUTO).unwrap();
    assert_eq!(got, host, "[0, 0, 0]");
}

#[test]
fn grad_ready_across_gpus_gives_the_hosts_bytes() {
    let Some(gpus) = Place::gpus("grad_ready_across_gpus_gives_the_hosts_bytes", 4) else {
        return;
    };
    for ordinals in [&[0, 1, 2, 3][..], &[2, 0, 2]] {
        let host = overlap_steps(&Place::Host, ordinals, T_HOST).unwrap();
        for transport in [T_NCCL, T_PEER_COPY] {
            let Some(got) = overlap_steps(&gpus, ordinals, transport) else {
                skip(format_args!(
                    "transport {transport} skipped: not available here"
                ));
                continue;
            };
            assert_eq!(got, host, "{ordinals:?} transport {transport}");
        }
    }
}

/// How often the fake driver made `stream` wait on an event; `None` on a real driver.
fn fake_waits_on(test: &str, stream: &cudarc::driver::CudaStream) -> Option<i64> {
    type WaitsOn = extern "C" fn(*mut std::ffi::c_void) -> i64;
    // SAFETY: the fake's `long fake_cuda_waits_on(void*)`.
    let f = unsafe { fake_driver_fn::<WaitsOn>(test, "fake_cuda_waits_on") };
    f.map(|f| f(stream.cu_stream() as *mut _))
}

/// A bucket reduced early by dpsync_grad_ready waits for the work already on the callers'
/// streams but does not make them wait for it (backward goes on, which is the point); the
/// allreduce_grads that ends the step does.
#[test]
fn early_buckets_do_not_make_the_callers_wait() {
    let test = "early_buckets_do_not_make_the_callers_wait";
    let Some(ctx) = cuda_context(test, &[0, 0], |o| o.set_fusion_bytes(64)) else {
        return;
    };
    let gpu = gpu();
    let caller = gpu.new_stream().unwrap();
    let bufs: Vec<_> = (0..4)
        .map(|_| caller.alloc_zeros::<f32>(16).unwrap())
        .collect();
    caller.synchronize().unwrap();
    for (t, pair) in bufs.chunks(2).enumerate() {
        for (r, b) in pair.iter().enumerate() {
            register_device(&ctx, &format!("g{t}"), GRAD, r, dptr(&caller, b), 16, F32);
        }
    }
    set_stream(&ctx, 0, &caller);
    set_stream(&ctx, 1, &caller);
    check(
        ctx.allreduce_grads(SUM),
        "the first step (the op is not known before)",
    );
    let Some(before) = fake_waits_on(test, &caller) else {
        return;
    };
    for name in ["g1", "g0"] {
        for r in 0..2 {
            check(ctx.grad_ready(name, r), "grad_ready");
        }
    }
    let early = &ctx.describe_json()["overlap"]["buckets_reduced_early_this_step"];
    assert_eq!(early, 2, "both 64-byte buckets reduced early");
    assert_eq!(
        fake_waits_on(test, &caller).unwrap(),
        before,
        "early buckets made the caller's stream wait"
    );
    check(ctx.allreduce_grads(SUM), "allreduce_grads ends the step");
    assert!(
        fake_waits_on(test, &caller).unwrap() > before,
        "allreduce_grads must make the caller's stream wait"
    );
    check(synchronize(&ctx), "synchronize");
}
