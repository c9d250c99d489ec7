//! Where a run keeps replica memory: the host, or device memory on GPUs (from cudarc's safe
//! layer, as a framework's would come from its own runtime; dpsync only ever sees raw pointers
//! and streams), and bytes of a dtype in it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use dpsync::*;

use super::buf::DType;
use super::context::{Context, Options};
use super::cuda_context::cuda_context;
use super::float16::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use super::skip::skip;

pub fn gpu() -> Arc<CudaContext> {
    CudaContext::new(0).expect("a context on GPU 0 (dpsync found one)")
}

/// The legacy default stream of GPU `ordinal`.
pub fn default_stream(ordinal: i32) -> Arc<CudaStream> {
    CudaContext::new(ordinal as usize)
        .expect("a context on a visible GPU")
        .default_stream()
}

pub fn dptr<T>(stream: &Arc<CudaStream>, s: &CudaSlice<T>) -> usize {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = s.device_ptr(stream);
    p as usize
}

/// Waits for the context's work (`dpsync_synchronize`).
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
// The host test of the comparison runs (tests/sparse.rs) uses only `Place::Host`.
#[allow(dead_code)]
pub enum Place {
    Host,
    Gpu(Vec<Arc<CudaStream>>),
}

/// The number of CUDA devices cudarc sees (0 without a driver).
pub fn device_count() -> usize {
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

// Each binary makes the places and memory its runs need.
#[allow(dead_code)]
impl Place {
    /// Every visible GPU, by ordinal; `None`, having printed "`test`: skipped: no CUDA device",
    /// when dpsync finds no GPU.
    pub fn gpu(test: &str) -> Option<Place> {
        cuda_context(test, &[0], |_| {})?;
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
            skip(format_args!(
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
    ) -> Option<Context> {
        match self {
            Place::Host => {
                let o = Options::host(ordinals.len());
                o.set_sparse_coalesce(coalesce);
                Some(Context::new(&o))
            }
            Place::Gpu(_) => cuda_context(test, ordinals, |o| {
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
    // Some binaries only read (tests/repro.rs).
    #[allow(dead_code)]
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
// Reads the outputs of sparse gathers (tests/common/embedding.rs, tests/cuda_sparse.rs).
#[allow(dead_code)]
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
// Reads back float results (tests/cuda_bmuf.rs).
#[allow(dead_code)]
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
// Writes sparse indices (tests/common/embedding.rs, tests/cuda_sparse.rs).
#[allow(dead_code)]
pub fn encode_indices(dtype: DType, v: &[i64]) -> Vec<u8> {
    match dtype {
        DType::I32 => v.iter().flat_map(|&i| (i as i32).to_ne_bytes()).collect(),
        _ => v.iter().flat_map(|&i| i.to_ne_bytes()).collect(),
    }
}

/// `v` rounded to `dtype`, as bytes.
// Writes float inputs (the GPU tests).
#[allow(dead_code)]
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
