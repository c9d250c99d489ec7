//! Reduction kernels, compiled with NVRTC once per device (per process) and cached.
//!
//! Every kernel walks a *table* of segments (one per tensor of a fusion bucket) so one launch
//! covers a whole bucket: `segs[s] = {offset in the bucket, count}` and `ptrs[s * nrep + r]`
//! the address of segment s on local replica r. f16/bf16 accumulate in f32, i32 and i64 in
//! i64, f32 in f32 and f64 in f64: the same types and order as the host backend, so a local
//! reduction gives the host's bytes.
//!
//! The source uses no CUDA headers (NVRTC ships none for fp16 before some versions), so f16
//! conversions are inline PTX and bf16 rounding is done on the bits (round to nearest even).

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{check, PrimaryContext};
use crate::error::{Error, ErrorKind, Result};
use crate::types::DType;

/// Threads per block and elements per thread in one chunk of a table walk.
pub(crate) const THREADS: u32 = 256;
pub(crate) const ITEMS: u32 = 4;
pub(crate) const CHUNK: usize = (THREADS * ITEMS) as usize;

const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef long long i64;
struct f16_t { unsigned short x; };
struct bf16_t { unsigned short x; };
struct Seg { u64 offset; u64 count; };

template <class T> struct Num;
template <> struct Num<float> {
  typedef float A;
  static __device__ __forceinline__ A load(float v) { return v; }
  static __device__ __forceinline__ float store(A a) { return a; }
};
template <> struct Num<double> {
  typedef double A;
  static __device__ __forceinline__ A load(double v) { return v; }
  static __device__ __forceinline__ double store(A a) { return a; }
};
template <> struct Num<int> {
  typedef i64 A;
  static __device__ __forceinline__ A load(int v) { return (A)v; }
  static __device__ __forceinline__ int store(A a) { return (int)a; }
};
template <> struct Num<i64> {
  typedef i64 A;
  static __device__ __forceinline__ A load(i64 v) { return v; }
  static __device__ __forceinline__ i64 store(A a) { return a; }
};
template <> struct Num<f16_t> {
  typedef float A;
  static __device__ __forceinline__ A load(f16_t v) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x)); return f;
  }
  static __device__ __forceinline__ f16_t store(A a) {
    f16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(a)); return h;
  }
};
template <> struct Num<bf16_t> {
  typedef float A;
  static __device__ __forceinline__ A load(bf16_t v) {
    return __uint_as_float(((unsigned)v.x) << 16);
  }
  static __device__ __forceinline__ bf16_t store(A a) {
    unsigned u = __float_as_uint(a);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) { b.x = (unsigned short)((u >> 16) | 0x40u); return b; }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.x = (unsigned short)(u >> 16);
    return b;
  }
};

template <class A> __device__ __forceinline__ A divide(A a, double d) { return a / (A)d; }

// The segment holding bucket element e, searching from s (elements only move forward).
__device__ __forceinline__ int seek(const Seg* segs, int nseg, int s, u64 e) {
  while (s + 1 < nseg && e >= segs[s + 1].offset) ++s;
  return s;
}

// First segment of a chunk by binary search.
__device__ __forceinline__ int find(const Seg* segs, int nseg, u64 e) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (segs[mid].offset <= e) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// mode 0: every local replica := sum (optionally / divisor)           (one-device allreduce)
// mode 1: fusion[e] := sum of local replicas                          (pack before a transport)
// mode 2: every local replica := fusion[e] (optionally / divisor)     (unpack after it)
template <class T>
__device__ void walk(const Seg* segs, const u64* ptrs, int nseg, int nrep, u64 total,
                     T* fusion, int mode, int avg, double divisor) {
  typedef typename Num<T>::A A;
  const u64 chunk = (u64)blockDim.x * ITEMS_PER_THREAD;
  const u64 chunks = (total + chunk - 1) / chunk;
  __shared__ int first;
  for (u64 c = blockIdx.x; c < chunks; c += gridDim.x) {
    __syncthreads();
    if (threadIdx.x == 0) first = find(segs, nseg, c * chunk);
    __syncthreads();
    int s = first;
    for (int k = 0; k < ITEMS_PER_THREAD; ++k) {
      u64 e = c * chunk + (u64)k * blockDim.x + threadIdx.x;
      if (e >= total) break;
      s = seek(segs, nseg, s, e);
      u64 i = e - segs[s].offset;
      const u64* p = ptrs + (u64)s * nrep;
      if (mode == 2) {
        A v = Num<T>::load(fusion[e]);
        if (avg) v = divide(v, divisor);
        T out = Num<T>::store(v);
        for (int r = 0; r < nrep; ++r) ((T*)p[r])[i] = out;
        continue;
      }
      A acc = Num<T>::load(((const T*)p[0])[i]);
      for (int r = 1; r < nrep; ++r) acc += Num<T>::load(((const T*)p[r])[i]);
      if (mode == 1) { fusion[e] = Num<T>::store(acc); continue; }
      if (avg) acc = divide(acc, divisor);
      T out = Num<T>::store(acc);
      for (int r = 0; r < nrep; ++r) ((T*)p[r])[i] = out;
    }
  }
}

// dst[i] += src[i] over a contiguous buffer (cross-device sums of fusion buffers).
template <class T>
__device__ void add(T* dst, const T* src, u64 n) {
  typedef typename Num<T>::A A;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    A v = Num<T>::load(dst[i]) + Num<T>::load(src[i]);
    dst[i] = Num<T>::store(v);
  }
}

#define DEFINE(T, NAME)                                                                      \
  extern "C" __global__ void walk_##NAME(const Seg* segs, const u64* ptrs, int nseg,         \
                                         int nrep, u64 total, T* fusion, int mode, int avg,  \
                                         double divisor) {                                   \
    walk<T>(segs, ptrs, nseg, nrep, total, fusion, mode, avg, divisor);                      \
  }                                                                                          \
  extern "C" __global__ void add_##NAME(T* dst, const T* src, u64 n) { add<T>(dst, src, n); }

DEFINE(float, f32)
DEFINE(double, f64)
DEFINE(f16_t, f16)
DEFINE(bf16_t, bf16)
DEFINE(int, i32)
DEFINE(i64, i64)
"#;

/// What a table walk does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// Every local replica gets the (scaled) sum of the local replicas.
    Allreduce = 0,
    /// The fusion buffer gets the sum of the local replicas.
    Pack = 1,
    /// Every local replica gets the (scaled) fusion buffer.
    Unpack = 2,
}

/// The compiled module of one device.
pub struct Kernels {
    module: sys::CUmodule,
    walk: [sys::CUfunction; 6],
    add: [sys::CUfunction; 6],
    pub sm_count: u32,
}

// SAFETY: modules and functions are usable from any thread.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

fn slot(dtype: DType) -> usize {
    DType::ALL.iter().position(|d| *d == dtype).unwrap_or(0)
}

/// NVRTC must be present to build the kernels; cudarc panics without it, so probe first.
/// `DPSYNC_NVRTC_LIBRARY` names the file when it is not on the loader path (pip's
/// `nvidia-cuda-nvrtc`): loaded globally, it then satisfies cudarc's lookup by soname.
pub fn nvrtc_present() -> bool {
    static PRELOADED: OnceLock<()> = OnceLock::new();
    PRELOADED.get_or_init(|| {
        if let Ok(path) = std::env::var("DPSYNC_NVRTC_LIBRARY") {
            use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
            // SAFETY: loading NVRTC runs no code beyond its initialisers.
            if let Ok(lib) = unsafe { Library::open(Some(path.trim()), RTLD_NOW | RTLD_GLOBAL) } {
                // Kept for the process: cudarc will resolve symbols from it.
                std::mem::forget(lib);
            }
        }
    });
    // SAFETY: probes for the library only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

impl Kernels {
    /// The kernels of `ctx`'s device: compiled on first use, then shared by every context.
    pub fn for_device(ctx: &PrimaryContext) -> Result<Arc<Kernels>> {
        static CACHE: OnceLock<Mutex<HashMap<i32, Arc<Kernels>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let mut cache = cache.lock();
        if let Some(k) = cache.get(&ctx.ordinal) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::build(ctx)?);
        cache.insert(ctx.ordinal, k.clone());
        Ok(k)
    }

    fn build(ctx: &PrimaryContext) -> Result<Kernels> {
        if !nvrtc_present() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "NVRTC (libnvrtc.so.13) was not found: dpsync compiles its CUDA kernels with it \
                 at run time; put its directory on LD_LIBRARY_PATH or name the file in \
                 DPSYNC_NVRTC_LIBRARY (see README)",
            ));
        }
        use sys::CUdevice_attribute as A;
        let major = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![
                format!("--gpu-architecture=compute_{major}{minor}"),
                format!("-DITEMS_PER_THREAD={ITEMS}"),
                "--std=c++14".to_owned(),
            ],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                format!("NVRTC could not compile dpsync's kernels for sm_{major}{minor}: {e:?}"),
            )
        })?;
        let image = CString::new(ptx.to_src())
            .map_err(|_| Error::new(ErrorKind::Backend, "NVRTC returned PTX with a NUL byte"))?;
        let _bound = ctx.bind()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; the context is current.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) },
            "cuModuleLoadData (dpsync kernels)",
        )?;
        let get = |name: String| -> Result<sys::CUfunction> {
            let c = CString::new(name.clone()).expect("kernel names have no NUL");
            let mut f = std::ptr::null_mut();
            // SAFETY: the module is loaded.
            check(
                unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
                &format!("cuModuleGetFunction({name})"),
            )?;
            Ok(f)
        };
        let mut walk = [std::ptr::null_mut(); 6];
        let mut add = [std::ptr::null_mut(); 6];
        for (i, dtype) in DType::ALL.iter().enumerate() {
            walk[i] = get(format!("walk_{}", dtype.name()))?;
            add[i] = get(format!("add_{}", dtype.name()))?;
        }
        Ok(Kernels {
            module,
            walk,
            add,
            sm_count: sm_count.max(1) as u32,
        })
    }

    fn grid(&self, work_items: usize, per_block: usize) -> u32 {
        let blocks = work_items.div_ceil(per_block.max(1)).max(1);
        // Enough blocks to fill the device several times over; the kernels loop beyond that.
        blocks.min(self.sm_count as usize * 16) as u32
    }

    /// A table walk over `total` elements of a bucket on `stream` (the context is current).
    #[allow(clippy::too_many_arguments)]
    pub fn walk(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        table: sys::CUdeviceptr,
        nseg: usize,
        nrep: usize,
        total: usize,
        fusion: sys::CUdeviceptr,
        mode: Walk,
        divisor: Option<usize>,
    ) -> Result<()> {
        let mut segs = table;
        let mut ptrs = table + (nseg * 16) as u64;
        let mut nseg_i = nseg as i32;
        let mut nrep_i = nrep as i32;
        let mut total_u = total as u64;
        let mut fusion = fusion;
        let mut mode_i = mode as i32;
        let mut avg = i32::from(divisor.is_some());
        let mut div = divisor.unwrap_or(1) as f64;
        let mut params: [*mut std::ffi::c_void; 9] = [
            (&mut segs as *mut u64).cast(),
            (&mut ptrs as *mut u64).cast(),
            (&mut nseg_i as *mut i32).cast(),
            (&mut nrep_i as *mut i32).cast(),
            (&mut total_u as *mut u64).cast(),
            (&mut fusion as *mut u64).cast(),
            (&mut mode_i as *mut i32).cast(),
            (&mut avg as *mut i32).cast(),
            (&mut div as *mut f64).cast(),
        ];
        self.launch(
            self.walk[slot(dtype)],
            self.grid(total, CHUNK),
            stream,
            &mut params,
            "walk",
        )
    }

    /// `dst[i] += src[i]` for `n` elements on `stream` (the context is current).
    pub fn add(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        n: usize,
    ) -> Result<()> {
        let (mut dst, mut src, mut n64) = (dst, src, n as u64);
        let mut params: [*mut std::ffi::c_void; 3] = [
            (&mut dst as *mut u64).cast(),
            (&mut src as *mut u64).cast(),
            (&mut n64 as *mut u64).cast(),
        ];
        let grid = self.grid(n, CHUNK);
        self.launch(self.add[slot(dtype)], grid, stream, &mut params, "add")
    }

    /// One launch of `THREADS`-thread blocks on `stream` (the context is current).
    fn launch(
        &self,
        f: sys::CUfunction,
        grid: u32,
        stream: sys::CUstream,
        params: &mut [*mut std::ffi::c_void],
        name: &str,
    ) -> Result<()> {
        // SAFETY: the callers build `params` to match the kernel's signature; the buffers they
        // point at are live device memory ordered on `stream`.
        let result = unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        // The message is only formatted on failure: launches are on the hot path.
        if result == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        check(result, &format!("cuLaunchKernel({name})"))
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: cached for the process; unloaded only if the cache is ever dropped.
        unsafe { sys::cuModuleUnload(self.module) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_kernels_in_the_source() {
        assert!(SOURCE.contains("#define DEFINE(T, NAME)"));
        for dtype in DType::ALL {
            let name = dtype.name();
            assert!(
                SOURCE.contains(&format!(", {name})")),
                "no kernels for {name}"
            );
        }
        assert_eq!(CHUNK, 1024);
    }
}
