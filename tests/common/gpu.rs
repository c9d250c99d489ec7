//! CUDA helpers for the GPU tests: device memory, streams and test kernels from cudarc's safe
//! layer, as a framework's would come from its own runtime; dpsync only ever sees raw pointers
//! and streams.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use dpsync::*;

use super::{
    bf16_to_f32, check, f16_to_f32, f32_to_bf16, f32_to_f16, register_raw, Context, DType,
};

pub fn gpu() -> Arc<CudaContext> {
    CudaContext::new(0).expect("a context on GPU 0 (dpsync found one)")
}

/// The legacy default stream of GPU `ordinal`.
pub fn default_stream(ordinal: i32) -> Arc<CudaStream> {
    CudaContext::new(ordinal as usize)
        .expect("a context on a visible GPU")
        .default_stream()
}

pub const SPIN: &str = r#"
extern "C" __global__ void spin_then_fill(float* out, unsigned long long n, float value,
                                          long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) out[i] = value;
}
extern "C" __global__ void copy_out(const float* in, float* out, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) out[i] = in[i];
}
"#;

pub struct Spin {
    pub fill: cudarc::driver::CudaFunction,
    pub copy: cudarc::driver::CudaFunction,
}

/// A context on [0, 0] whose replicas both use one caller stream, with the test kernels to
/// keep that stream busy: the timeout tests' setup.
pub struct StuckCaller {
    pub ctx: Context,
    pub caller: Arc<CudaStream>,
    spin: Spin,
}

impl StuckCaller {
    /// `None`, having said why, without asynchronous streams (the synchronous fake cannot keep a
    /// stream busy) or without a GPU. The caller stream is not yet given to dpsync.
    pub fn new(test: &str, configure: impl Fn(&super::Options)) -> Option<StuckCaller> {
        if needs_async_streams(test) {
            return None;
        }
        let ctx = super::cuda_context(test, &[0, 0], configure)?;
        let gpu = gpu();
        let spin = spin_kernels(&gpu);
        let caller = gpu.new_stream().unwrap();
        Some(StuckCaller { ctx, caller, spin })
    }

    /// Queues on the caller stream a kernel that spins about a second, then fills `buf` with
    /// `value`.
    pub fn spin_a_second_then_fill(&self, buf: &CudaSlice<f32>, value: f32) {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let n = buf.len();
        let mut b = self.caller.launch_builder(&self.spin.fill);
        let (nn, cycles) = (n as u64, 2_000_000_000i64);
        b.arg(buf).arg(&nn).arg(&value).arg(&cycles);
        // SAFETY: arguments match the kernel.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
    }
}

pub fn spin_kernels(ctx: &Arc<CudaContext>) -> Spin {
    let ptx = cudarc::nvrtc::compile_ptx(SPIN).expect("NVRTC compiles the test kernels");
    let module = ctx.load_module(ptx).expect("load test kernels");
    Spin {
        fill: module.load_function("spin_then_fill").unwrap(),
        copy: module.load_function("copy_out").unwrap(),
    }
}

pub fn dptr<T>(stream: &Arc<CudaStream>, s: &CudaSlice<T>) -> usize {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = s.device_ptr(stream);
    p as usize
}

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

pub fn synchronize(ctx: &Context) -> dpsync_status {
    // SAFETY: a live context.
    unsafe { dpsync_synchronize(ctx.0) }
}

/// A copy of `bytes` bytes of device memory at `ptr` (any device: unified addressing).
pub fn download(ptr: usize, bytes: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes];
    if bytes > 0 {
        gpu().bind_to_thread().expect("bind GPU 0");
        // SAFETY: the caller names live device memory of at least `bytes`.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, ptr as u64) }
            .expect("device-to-host copy");
    }
    out
}

/// Device memory on `stream`'s device holding `bytes` (at least one byte, so the pointer is
/// valid even for an empty slice).
pub fn upload(stream: &Arc<CudaStream>, bytes: &[u8]) -> CudaSlice<u8> {
    if bytes.is_empty() {
        return stream.alloc_zeros::<u8>(1).unwrap();
    }
    stream.clone_htod(bytes).unwrap()
}

/// Where a comparison run keeps replica memory: the host, or GPUs (the default stream of every
/// visible device, by ordinal).
pub enum Place {
    Host,
    Gpu(Vec<Arc<CudaStream>>),
}

/// The number of CUDA devices cudarc sees (0 without a driver).
pub fn device_count() -> usize {
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

impl Place {
    /// Every visible GPU, by ordinal; `None`, having printed "`test`: skipped: no CUDA device",
    /// when dpsync finds no GPU.
    pub fn gpu(test: &str) -> Option<Place> {
        super::cuda_context(test, &[0], |_| {})?;
        let streams = (0..device_count())
            .map(|d| default_stream(d as i32))
            .collect();
        Some(Place::Gpu(streams))
    }

    /// As [`Place::gpu`], with at least `n` GPUs: otherwise prints "`test`: skipped: needs `n`
    /// CUDA devices" (scripts/fake-cuda.sh runs these tests with four fake devices).
    pub fn gpus(test: &str, n: usize) -> Option<Place> {
        let place = Place::gpu(test)?;
        let found = device_count();
        if found < n {
            super::skip(format_args!(
                "{test}: skipped: needs {n} CUDA devices, found {found}"
            ));
            return None;
        }
        Some(place)
    }

    /// A context with one replica per entry of `ordinals` in this place (host replicas, or CUDA
    /// replicas on those GPUs over `transport`), with sparse coalescing as given; `None` when
    /// the CUDA context cannot be made here.
    pub fn context(
        &self,
        test: &str,
        ordinals: &[i32],
        transport: u32,
        coalesce: bool,
    ) -> Option<super::Context> {
        match self {
            Place::Host => {
                let o = super::Options::host(ordinals.len());
                o.set_sparse_coalesce(coalesce);
                Some(super::Context::new(&o))
            }
            Place::Gpu(_) => super::cuda_context(test, ordinals, |o| {
                o.set_sparse_coalesce(coalesce);
                o.set_transport(transport);
            }),
        }
    }

    /// `bytes` in memory of this place (on GPU 0 for a GPU place).
    pub fn mem(&self, bytes: &[u8]) -> Mem {
        self.mem_on(0, bytes)
    }

    /// `bytes` in memory of this place, on GPU `ordinal` for a GPU place.
    pub fn mem_on(&self, ordinal: i32, bytes: &[u8]) -> Mem {
        match self {
            Place::Host => {
                let mut words = vec![0u64; bytes.len().div_ceil(8).max(1)];
                // SAFETY: the words hold at least `bytes.len()` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        words.as_mut_ptr().cast::<u8>(),
                        bytes.len(),
                    )
                };
                Mem::Host(words, bytes.len())
            }
            Place::Gpu(streams) => {
                let stream = &streams[ordinal as usize];
                let d = upload(stream, bytes);
                stream.synchronize().unwrap();
                Mem::Device(d, stream.clone())
            }
        }
    }
}

/// One buffer on one replica, in the place of its run. Host words keep every dtype aligned.
pub enum Mem {
    Host(Vec<u64>, usize),
    Device(CudaSlice<u8>, Arc<CudaStream>),
}

impl Mem {
    pub fn ptr(&self) -> usize {
        match self {
            Mem::Host(words, _) => words.as_ptr() as usize,
            Mem::Device(d, stream) => dptr(stream, d),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Mem::Host(_, n) => *n,
            Mem::Device(d, _) => d.len(),
        }
    }

    pub fn read(&self) -> Vec<u8> {
        match self {
            Mem::Host(words, n) => {
                // SAFETY: the words hold `n` bytes.
                unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), *n) }.to_vec()
            }
            Mem::Device(_, stream) => {
                stream.synchronize().unwrap();
                download(self.ptr(), self.len())
            }
        }
    }

    /// Overwrites the contents in place (the address stays the same).
    pub fn write(&mut self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.len());
        match self {
            Mem::Host(words, n) => {
                // SAFETY: the words hold `n` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        words.as_mut_ptr().cast::<u8>(),
                        *n,
                    )
                }
            }
            Mem::Device(d, stream) => {
                stream.memcpy_htod(bytes, d).unwrap();
                stream.synchronize().unwrap();
            }
        }
    }
}

/// Bytes of `ptr` in the place of a run (`bytes` of host memory, or device memory).
pub fn read_at(place: &Place, ptr: usize, bytes: usize) -> Vec<u8> {
    if bytes == 0 {
        return Vec::new(); // an empty output's address is NULL
    }
    match place {
        // SAFETY: the caller names `bytes` of live host memory (a dpsync output).
        Place::Host => unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) }.to_vec(),
        Place::Gpu(streams) => {
            streams.iter().for_each(|s| s.synchronize().unwrap());
            download(ptr, bytes)
        }
    }
}

/// f64 view of float bytes of `dtype`.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()) as f64)
            .collect(),
        DType::F64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_ne_bytes(b.try_into().unwrap()))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_ne_bytes([b[0], b[1]])) as f64)
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_ne_bytes([b[0], b[1]])) as f64)
            .collect(),
        _ => panic!("not a float dtype"),
    }
}

/// Indices as bytes of the index `dtype` (I32 or I64).
pub fn encode_indices(dtype: DType, v: &[i64]) -> Vec<u8> {
    match dtype {
        DType::I32 => v.iter().flat_map(|&i| (i as i32).to_ne_bytes()).collect(),
        _ => v.iter().flat_map(|&i| i.to_ne_bytes()).collect(),
    }
}

/// `v` rounded to `dtype`, as bytes.
pub fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| (*x as f32).to_ne_bytes()).collect(),
        DType::F64 => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| f32_to_f16(*x as f32).to_ne_bytes())
            .collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|x| f32_to_bf16(*x as f32).to_ne_bytes())
            .collect(),
        _ => panic!("not a float dtype"),
    }
}

/// True (after printing why the test is skipped) on the fake CUDA driver in its synchronous
/// mode, where every launch and copy is complete when the call returns: tests of asynchrony
/// (timeouts, stream-order negative controls) need a real GPU or the fake's FAKE_CUDA_ASYNC=1
/// (streams as worker threads; scripts/fake-cuda.sh runs the GPU tests both ways).
pub fn needs_async_streams(test: &str) -> bool {
    let env = |k: &str| std::env::var(k).as_deref() == Ok("1");
    let synchronous = env("DPSYNC_FAKE_CUDA") && !env("FAKE_CUDA_ASYNC");
    if synchronous {
        super::skip(format_args!(
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
        super::skip(format_args!(
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
pub unsafe fn fake_driver_fn<F: Copy>(test: &str, symbol: &str) -> Option<F> {
    // SAFETY: opens the driver library this process already loaded (dpsync did); the caller
    // vouches for the signature.
    let found = unsafe {
        let lib = libloading::Library::new("libcuda.so.1").ok();
        lib.and_then(|l| Some(*l.get::<F>(symbol.as_bytes()).ok()?))
    };
    if found.is_none() {
        super::skip(format_args!(
            "{test}: skipped: needs the fake CUDA driver's {symbol}"
        ));
    }
    found
}

/// The replica layouts of the `*across_gpus*` tests (four GPUs, and a shared one).
pub const ACROSS_GPUS: [&[i32]; 2] = [&[0, 1, 2, 3], &[2, 0, 2]];

/// One collective in stream order, each replica with its own caller stream: a kernel on replica
/// r's stream writes r + 1 into tensor "t" of `role` (on one replica, in turn each, it spins for
/// ~0.2 s first); `issue` runs the collective; a kernel on the same stream copies the tensor out.
/// No host synchronisation in between, so every copy reads `want` only if dpsync waited for
/// every replica's stream and made every one wait for its work. (Trivial on the synchronous fake
/// driver; it bites on a GPU and under FAKE_CUDA_ASYNC=1.) `prepare` runs once the tensors are
/// registered (e.g. `dpsync_bmuf_init`). False when `transport` is not available here.
#[allow(clippy::too_many_arguments)]
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
        let Some(ctx) = super::cuda_context(test, ordinals, |o| o.set_transport(transport)) else {
            return false;
        };
        let mut replicas = Vec::new();
        for (r, &ordinal) in ordinals.iter().enumerate() {
            let dev = CudaContext::new(ordinal as usize).unwrap();
            let stream = dev.new_stream().unwrap();
            let t = stream.alloc_zeros::<f32>(n).unwrap();
            let out = stream.alloc_zeros::<f32>(n).unwrap();
            stream.synchronize().unwrap();
            register_device(&ctx, "t", role, r, dptr(&stream, &t), n, super::F32);
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
    for transport in [super::T_NCCL, super::T_PEER_COPY] {
        for ordinals in layouts {
            if !case(ordinals, transport) {
                super::skip(format_args!(
                    "transport {transport} skipped: not available here"
                ));
                break;
            }
        }
    }
}
