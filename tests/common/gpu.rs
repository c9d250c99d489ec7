//! CUDA helpers for the GPU tests: the tests' own kernels, caller streams, registration of device
//! memory, and the skips of tests that need more than this machine has.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use dpsync::*;

use super::abi::{F32, T_NCCL, T_PEER_COPY};
use super::context::{check, register_raw, Context, Options};
use super::cuda_context::cuda_context;
use super::place::{dptr, gpu, synchronize};
use super::skip::skip;

/// The tests' kernels (tests/fakecuda/spin.cu: NVRTC compiles them here; scripts/fake-cuda.sh
/// builds them into the fake CUDA driver).
pub const SPIN: &str = include_str!("../fakecuda/spin.cu");

pub struct Spin {
    pub fill: cudarc::driver::CudaFunction,
    pub copy: cudarc::driver::CudaFunction,
    pub until: cudarc::driver::CudaFunction,
}

/// A context on [0, 0] whose replicas both use one caller stream, with the test kernels to
/// keep that stream busy until the test releases it: the timeout tests' setup. The stream stays
/// busy however slow the machine, so the timeout cannot be missed.
// The timeout tests' setup (tests/cuda.rs, tests/cuda_sparse.rs).
#[allow(dead_code)]
pub struct StuckCaller {
    pub ctx: Context,
    pub caller: Arc<CudaStream>,
    spin: Spin,
    /// One page-locked i32 that the spinning kernel polls: non-zero releases it.
    release: *mut i32,
}

#[allow(dead_code)] // as StuckCaller
impl StuckCaller {
    /// `None`, having said why, without asynchronous streams (the synchronous fake cannot keep a
    /// stream busy) or without a GPU. The caller stream is not yet given to dpsync.
    pub fn new(test: &str, configure: impl Fn(&Options)) -> Option<StuckCaller> {
        use cudarc::driver::sys;
        if needs_async_streams(test) {
            return None;
        }
        let ctx = cuda_context(test, &[0, 0], configure)?;
        let gpu = gpu();
        let spin = spin_kernels(&gpu);
        let caller = gpu.new_stream().unwrap();
        gpu.bind_to_thread().unwrap();
        let mut release: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: plain driver call; freed on drop.
        let rc = unsafe { sys::cuMemAllocHost_v2(&mut release, 4) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemAllocHost");
        let release = release.cast::<i32>();
        // SAFETY: 4 bytes of page-locked memory, ours.
        unsafe { release.write_volatile(0) };
        Some(StuckCaller {
            ctx,
            caller,
            spin,
            release,
        })
    }

    /// Queues on the caller stream a kernel that spins until [`StuckCaller::release`] (or, as a
    /// safety net, about a minute), then fills `buf` with `value`.
    pub fn spin_until_released_then_fill(&self, buf: &CudaSlice<f32>, value: f32) {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let n = buf.len();
        let mut b = self.caller.launch_builder(&self.spin.until);
        let (nn, release, cycles) = (n as u64, self.release as u64, 120_000_000_000i64);
        b.arg(buf).arg(&nn).arg(&value).arg(&release).arg(&cycles);
        // SAFETY: arguments match the kernel (`release` is its `const int*`, page-locked).
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    }

    /// Whether the caller stream still has work to do: an event recorded there now is not yet
    /// complete.
    pub fn still_busy(&self) -> bool {
        let now = self.caller.record_event(None).expect("cuEventRecord");
        !now.try_is_complete().expect("cuEventQuery")
    }

    /// Lets the spinning kernel end.
    pub fn release(&self) {
        // SAFETY: our page-locked i32, polled by the kernel.
        unsafe { self.release.write_volatile(1) };
    }
}

impl Drop for StuckCaller {
    fn drop(&mut self) {
        self.release();
        let _ = self.caller.synchronize();
        // SAFETY: ours; the kernel that read it has ended.
        unsafe { cudarc::driver::sys::cuMemFreeHost(self.release.cast()) };
    }
}

pub fn spin_kernels(ctx: &Arc<CudaContext>) -> Spin {
    let ptx = cudarc::nvrtc::compile_ptx(SPIN).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).expect("load test kernels");
    Spin {
        fill: module.load_function("spin_then_fill").unwrap(),
        copy: module.load_function("copy_out").unwrap(),
        until: module
            .load_function("spin_until_released_then_fill")
            .unwrap(),
    }
}

// For dense device tensors (tests/cuda.rs, and in_stream_order).
#[allow(dead_code)]
pub fn register_device(
    ctx: &Context,
    name: &str,
    role: u32,
    replica: usize,
    ptr: usize,
    n: usize,
    dtype: u32,
) {
    let st = register_raw(
        ctx.0,
        name,
        role,
        replica,
        ptr as *mut std::ffi::c_void,
        n,
        dtype,
    );
    check(st, &format!("register '{name}' on replica {replica}"));
}

pub fn set_stream(ctx: &Context, replica: usize, stream: &Arc<CudaStream>) {
    // SAFETY: a live context and stream.
    let st = unsafe { dpsync_set_stream(ctx.0, replica, stream.cu_stream() as *mut _) };
    check(st, "dpsync_set_stream");
}

/// True (after printing why the test is skipped) on the fake CUDA driver in its synchronous
/// mode, where every launch and copy is complete when the call returns: tests of asynchrony
/// (timeouts, stream-order negative controls) need a real GPU or the fake's FAKE_CUDA_ASYNC=1
/// (streams as worker threads; scripts/fake-cuda.sh runs the GPU tests both ways).
pub fn needs_async_streams(test: &str) -> bool {
    let env = |k: &str| std::env::var(k).as_deref() == Ok("1");
    let synchronous = env("DPSYNC_FAKE_CUDA") && !env("FAKE_CUDA_ASYNC");
    if synchronous {
        skip(format_args!(
            "{test}: skipped: needs asynchronous streams (a real GPU, or the fake CUDA driver \
             with FAKE_CUDA_ASYNC=1)"
        ));
    }
    synchronous
}

/// True when DPSYNC_NCCL_RANK_PER_REPLICA=1 (read when options are created) gives every replica
/// its own NCCL rank; otherwise prints why `test` is skipped. Several ranks on one GPU need an
/// NCCL that allows them (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30): scripts/gpu-check.sh and
/// scripts/fake-cuda.sh run the tests named `*two_nccl_ranks*` that way.
pub fn rank_per_replica(test: &str) -> bool {
    let on = std::env::var("DPSYNC_NCCL_RANK_PER_REPLICA").as_deref() == Ok("1");
    if !on {
        skip(format_args!(
            "{test}: skipped: set DPSYNC_NCCL_RANK_PER_REPLICA=1 (and NCCL_MULTI_RANK_GPU_ENABLE=1 \
             on NCCL >= 2.30) to run it"
        ));
    }
    on
}

/// A test-only function the fake CUDA driver exports (`fake_cuda_*` counters); `None`, after
/// printing why `test` is skipped, on a real driver, which has no such symbol.
///
/// # Safety
/// `F` must be the symbol's true `extern "C"` signature.
// For the tests that read the fake driver's counters (tests/cuda.rs, tests/cuda_sparse.rs).
#[allow(dead_code)]
pub unsafe fn fake_driver_fn<F: Copy>(test: &str, symbol: &str) -> Option<F> {
    // SAFETY: opens the driver library this process already loaded (dpsync did); the caller
    // vouches for the signature.
    let found = unsafe {
        let lib = libloading::Library::new("libcuda.so.1").ok();
        lib.and_then(|l| Some(*l.get::<F>(symbol.as_bytes()).ok()?))
    };
    if found.is_none() {
        skip(format_args!(
            "{test}: skipped: needs the fake CUDA driver's {symbol}"
        ));
    }
    found
}

/// The replica layouts of the `*across_gpus*` tests (four GPUs, and a shared one).
// For the `*across_gpus*` tests of dense collectives and BMUF (tests/cuda.rs, tests/cuda_bmuf.rs).
#[allow(dead_code)]
pub const ACROSS_GPUS: [&[i32]; 2] = [&[0, 1, 2, 3], &[2, 0, 2]];

/// One collective in stream order, each replica with its own caller stream: a kernel on replica
/// r's stream writes r + 1 into tensor "t" of `role` (on one replica, in turn each, it spins for
/// ~0.2 s first); `issue` runs the collective; a kernel on the same stream copies the tensor out.
/// No host synchronisation in between, so every copy reads `want` only if dpsync waited for
/// every replica's stream and made every one wait for its work. (Trivial on the synchronous fake
/// driver; it bites on a GPU and under FAKE_CUDA_ASYNC=1.) `prepare` runs once the tensors are
/// registered (e.g. `dpsync_bmuf_init`). False when `transport` is not available here.
// For the stream-order tests of dense collectives and BMUF (tests/cuda.rs, tests/cuda_bmuf.rs).
#[allow(dead_code, clippy::too_many_arguments)]
pub fn in_stream_order(
    test: &str,
    what: &str,
    ordinals: &[i32],
    transport: u32,
    role: u32,
    prepare: impl Fn(&Context),
    issue: impl Fn(&Context) -> dpsync_status,
    want: f32,
) -> bool {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let n = 1usize << 12;
    let cfg = LaunchConfig::for_num_elems(n as u32);
    for slow in 0..ordinals.len() {
        let Some(ctx) = cuda_context(test, ordinals, |o| o.set_transport(transport)) else {
            return false;
        };
        let mut replicas = Vec::new();
        for (r, &ordinal) in ordinals.iter().enumerate() {
            let dev = CudaContext::new(ordinal as usize).unwrap();
            let stream = dev.new_stream().unwrap();
            let t = stream.alloc_zeros::<f32>(n).unwrap();
            let out = stream.alloc_zeros::<f32>(n).unwrap();
            stream.synchronize().unwrap();
            register_device(&ctx, "t", role, r, dptr(&stream, &t), n, F32);
            set_stream(&ctx, r, &stream);
            replicas.push((spin_kernels(&dev), stream, t, out));
        }
        prepare(&ctx);
        for (r, (k, stream, t, _)) in replicas.iter().enumerate() {
            let cycles: i64 = if r == slow { 400_000_000 } else { 0 }; // ~0.2 s at 2 GHz
            let (nn, v) = (n as u64, (r + 1) as f32);
            let mut b = stream.launch_builder(&k.fill);
            b.arg(t).arg(&nn).arg(&v).arg(&cycles);
            // SAFETY: arguments match the kernel.
            unsafe { b.launch(cfg) }.unwrap();
        }
        check(issue(&ctx), what);
        for (k, stream, t, out) in &replicas {
            let nn = n as u64;
            let mut b = stream.launch_builder(&k.copy);
            b.arg(t).arg(out).arg(&nn);
            // SAFETY: arguments match the kernel.
            unsafe { b.launch(cfg) }.unwrap();
        }
        for (r, (_, stream, _, out)) in replicas.iter().enumerate() {
            let got = stream.clone_dtoh(out).unwrap();
            let bad = got.iter().position(|&x| x != want);
            assert!(
                bad.is_none(),
                "{what} on {ordinals:?}, transport {transport}, replica {slow} slow: replica \
                 {r}'s stream read {} at element {}, want {want}",
                got[bad.unwrap()],
                bad.unwrap()
            );
        }
        check(synchronize(&ctx), "synchronize");
    }
    true
}

/// Runs `case(ordinals, transport)` over NCCL and PEER_COPY for each of `layouts`. A case
/// returns false when its transport cannot be used here: that is printed, and the transport's
/// other layouts are skipped.
pub fn for_each_transport(layouts: &[&[i32]], mut case: impl FnMut(&[i32], u32) -> bool) {
    for transport in [T_NCCL, T_PEER_COPY] {
        for ordinals in layouts {
            if !case(ordinals, transport) {
                skip(format_args!(
                    "transport {transport} skipped: not available here"
                ));
                break;
            }
        }
    }
}
