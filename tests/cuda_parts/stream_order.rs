//! Stream order: collectives and host tensors on CUDA replicas follow the callers' streams without
//! a host sync.

use super::*;

/// Grad writer spins on the caller's stream; allreduce and the reader follow with no host
/// synchronisation. `tell_dpsync == false` is the negative control: dpsync is given another
/// stream, so it does not wait for the writer and the reader sees unreduced values.
fn stream_ordering(tell_dpsync: bool) -> Option<bool> {
    let ctx = cuda_context("stream_ordering", &[0, 0], |_| {})?;
    let gpu = gpu();
    let k = spin_kernels(&gpu);
    let n = 1 << 20;
    let caller = gpu.new_stream().unwrap();
    let other = gpu.new_stream().unwrap();
    let g0 = caller.alloc_zeros::<f32>(n).unwrap();
    let g1 = caller.alloc_zeros::<f32>(n).unwrap();
    let out = caller.alloc_zeros::<f32>(n).unwrap();
    caller.synchronize().unwrap();
    register_device(&ctx, "g", GRAD, 0, dptr(&caller, &g0), n, F32);
    register_device(&ctx, "g", GRAD, 1, dptr(&caller, &g1), n, F32);
    let told = if tell_dpsync { &caller } else { &other };
    set_stream(&ctx, 0, told);
    set_stream(&ctx, 1, told);
    let cfg = LaunchConfig::for_num_elems(n as u32);
    let cycles: i64 = 200_000_000; // ~0.1 s at ~2 GHz
    for (buf, v) in [(&g0, 1.0f32), (&g1, 2.0f32)] {
        let mut b = caller.launch_builder(&k.fill);
        let (nn, vv, cc) = (n as u64, v, cycles);
        b.arg(buf).arg(&nn).arg(&vv).arg(&cc);
        // SAFETY: arguments match the kernel.
        unsafe { b.launch(cfg) }.unwrap();
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    {
        let mut b = caller.launch_builder(&k.copy);
        let nn = n as u64;
        b.arg(&g1).arg(&out).arg(&nn);
        // SAFETY: arguments match the kernel.
        unsafe { b.launch(cfg) }.unwrap();
    }
    let got = caller.clone_dtoh(&out).unwrap();
    check(synchronize(&ctx), "synchronize");
    Some(got.iter().all(|&v| v == 3.0))
}

#[test]
fn collectives_are_ordered_by_the_callers_stream_without_host_sync() {
    let Some(ordered) = stream_ordering(true) else {
        return;
    };
    assert!(
        ordered,
        "the reader after allreduce saw unreduced gradients"
    );
    if needs_async_streams("stream-ordering negative control") {
        return;
    }
    let control = stream_ordering(false).unwrap();
    assert!(
        !control,
        "negative control: without the caller's stream dpsync should not have waited"
    );
}

#[test]
fn host_tensors_on_cuda_replicas_are_reduced_on_the_host() {
    let Some(ctx) = cuda_context("host_tensors", &[0, 0], |_| {}) else {
        return;
    };
    let mut a = vec![1.0f32; 10];
    let mut b = vec![2.0f32; 10];
    ctx.reg("cpu_stat", COMPUTED, 0, &mut a, F32);
    ctx.reg("cpu_stat", COMPUTED, 1, &mut b, F32);
    let json = ctx.describe_json();
    check(ctx.average(COMPUTED), "average");
    check(synchronize(&ctx), "synchronize");
    assert_eq!(a, vec![1.5f32; 10]);
    assert_eq!(b, vec![1.5f32; 10]);
    let backend = &json["backend"];
    assert_eq!(backend["name"], "cuda", "{json}");
    assert!(backend["host_memory"].is_object(), "{json}");
}

/// Host tensors of CUDA replicas on two GPUs (peer copy and NCCL) are still one host group:
/// every replica's values are in the sum, and every replica gets it.
#[test]
fn host_tensors_of_replicas_on_two_gpus_are_reduced_together() {
    if Place::gpus("host_tensors_on_two_gpus", 2).is_none() {
        return;
    }
    for transport in [T_PEER_COPY, T_NCCL] {
        let configure = |o: &Options| o.set_transport(transport);
        let Some(ctx) = cuda_context("host_tensors_on_two_gpus", &[0, 1, 0], configure) else {
            return;
        };
        let mut v: Vec<Vec<f32>> = (1..=3).map(|r| vec![r as f32; 4]).collect();
        for (k, data) in v.iter_mut().enumerate() {
            ctx.reg("cpu_stat", COMPUTED, k, data, F32);
        }
        check(ctx.allreduce("cpu_stat", SUM), "allreduce");
        check(synchronize(&ctx), "synchronize");
        for (k, data) in v.iter().enumerate() {
            assert_eq!(data, &vec![6.0f32; 4], "transport {transport}, replica {k}");
        }
    }
}

/// Host memory on a CUDA replica is reduced by the host, but still after the work already
/// queued on the caller's stream: there, a slow kernel fills a device buffer and a copy brings
/// it into the pinned host memory registered as the GRAD; `allreduce_grads` follows with no
/// host sync, and when it returns the host tensors must hold the sum of the copied values.
#[test]
fn host_tensors_on_cuda_replicas_wait_for_the_callers_streams() {
    use cudarc::driver::sys;
    let Some(ctx) = cuda_context("host_tensors_in_stream_order", &[0, 0], |_| {}) else {
        return;
    };
    let dev = gpu();
    let k = spin_kernels(&dev);
    let n = 1usize << 10;
    let mut replicas = Vec::new();
    for r in 0..2 {
        let stream = dev.new_stream().unwrap();
        let device = stream.alloc_zeros::<f32>(n).unwrap();
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        dev.bind_to_thread().unwrap();
        // SAFETY: plain driver call; freed below.
        let rc = unsafe { sys::cuMemAllocHost_v2(&mut host, n * 4) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemAllocHost");
        // SAFETY: n f32 of pinned memory, ours.
        let slice = unsafe { std::slice::from_raw_parts_mut(host as *mut f32, n) };
        slice.fill(0.0);
        ctx.reg("cpu_grad", GRAD, r, slice, F32);
        set_stream(&ctx, r, &stream);
        replicas.push((stream, device, host as *mut f32));
    }
    for slow in 0..2 {
        let base = 10.0 * slow as f32;
        for (r, (stream, device, host)) in replicas.iter().enumerate() {
            let cycles: i64 = if r == slow { 400_000_000 } else { 0 }; // ~0.2 s at 2 GHz
            let (nn, v) = (n as u64, base + (r + 1) as f32);
            let mut b = stream.launch_builder(&k.fill);
            b.arg(device).arg(&nn).arg(&v).arg(&cycles);
            // SAFETY: arguments match the kernel.
            unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
            // SAFETY: n f32 each side; the copy is queued after the fill on the same stream.
            let rc = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.cast(),
                    dptr(stream, device) as u64,
                    n * 4,
                    stream.cu_stream(),
                )
            };
            assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemcpyDtoHAsync");
        }
        // Declared ready on both replicas (from the second step on, early buckets have an op):
        // a host bucket is still left to allreduce_grads, since reducing it here would block
        // this thread until the GPUs caught up.
        for r in 0..2 {
            check(ctx.grad_ready("cpu_grad", r), "grad_ready");
        }
        let overlap = &ctx.describe_json()["overlap"];
        assert_eq!(
            overlap["buckets_reduced_early_this_step"], 0,
            "step {slow}: {overlap}"
        );
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        let want = 2.0 * base + 3.0;
        for (r, (_, _, host)) in replicas.iter().enumerate() {
            // SAFETY: n f32 of pinned memory; dpsync reduced it before returning.
            let got = unsafe { std::slice::from_raw_parts(*host, n) };
            assert!(
                got.iter().all(|&x| x == want),
                "replica {slow} slow: replica {r}'s host tensor holds {}, want {want}",
                got[0]
            );
        }
    }
    check(synchronize(&ctx), "synchronize");
    drop(ctx);
    for (stream, _, host) in replicas {
        stream.synchronize().unwrap();
        // SAFETY: ours, no longer registered or in use.
        unsafe { sys::cuMemFreeHost(host.cast()) };
    }
}

/// The collectives of one ordering run, with the value every replica must end with when replica
/// r's tensor held r + 1 (exact in f32).
#[derive(Clone, Copy, Debug)]
enum Collective {
    Grads,
    One,
    Broadcast,
    Average,
}

impl Collective {
    fn role(self) -> u32 {
        match self {
            Collective::Grads | Collective::One => GRAD,
            Collective::Broadcast => PARAM,
            Collective::Average => COMPUTED,
        }
    }

    fn run(self, ctx: &Context, replicas: usize) -> dpsync_status {
        match self {
            Collective::Grads => ctx.allreduce_grads(SUM),
            Collective::One => ctx.allreduce("t", AVG),
            Collective::Broadcast => ctx.broadcast(PARAM, replicas - 1),
            Collective::Average => ctx.average(COMPUTED),
        }
    }

    fn expected(self, replicas: usize) -> f32 {
        let n = replicas as f32;
        match self {
            Collective::Grads => n * (n + 1.0) / 2.0,
            Collective::One | Collective::Average => (n + 1.0) / 2.0,
            Collective::Broadcast => n,
        }
    }
}

/// Every dense collective in stream order, each replica with its own caller stream
/// ([`in_stream_order`]). False when `transport` is not available here.
fn every_collective_in_stream_order(test: &str, ordinals: &[i32], transport: u32) -> bool {
    let reps = ordinals.len();
    [
        Collective::Grads,
        Collective::One,
        Collective::Broadcast,
        Collective::Average,
    ]
    .into_iter()
    .all(|c| {
        let what = format!("{c:?}");
        let issue = |ctx: &Context| c.run(ctx, reps);
        in_stream_order(
            test,
            &what,
            ordinals,
            transport,
            c.role(),
            |_| {},
            issue,
            c.expected(reps),
        )
    })
}

#[test]
fn every_collective_is_ordered_by_each_replicas_stream() {
    for_each_transport(&[&[0, 0, 0]], |ordinals, transport| {
        every_collective_in_stream_order("every_collective_in_order", ordinals, transport)
    });
}

#[test]
fn every_collective_across_gpus_is_ordered_by_each_replicas_stream() {
    let test = "every_collective_across_gpus_in_order";
    if Place::gpus(test, 4).is_none() {
        return;
    }
    for_each_transport(&ACROSS_GPUS, |ordinals, transport| {
        every_collective_in_stream_order(test, ordinals, transport)
    });
}
