//! dpsync's CUDA kernels (sources in `kernels/*.cu`), compiled with NVRTC once per device (per
//! process) and cached.
//!
//! The bucket kernels walk a *table* of segments (one per tensor of a fusion bucket) so one
//! launch covers a whole bucket: `segs[s] = {offset in the bucket, count}` and
//! `ptrs[s * nrep + r]` the address of segment s on local replica r. f16/bf16 accumulate in f32,
//! i32 in i64, i64 in 128 bits, f32 in f32 and f64 in f64: the same types and order as the host
//! backend, so a local reduction gives the host's bytes (kernels/prelude.cu).

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{check, PrimaryContext};
use crate::backend::ReproStage;
use crate::error::{Error, ErrorKind, Result};
use crate::types::DType;

mod nvrtc;

use nvrtc::image_for;
pub(crate) use nvrtc::nvrtc_compiles;
#[cfg(test)]
pub(crate) use nvrtc::{compile, nvrtc_present, source, Image};

/// Threads per block and elements per thread in one chunk of a table walk.
pub(crate) const THREADS: u32 = 256;
pub(crate) const ITEMS: u32 = 4;
pub(crate) const CHUNK: usize = (THREADS * ITEMS) as usize;

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

/// What the BMUF kernel does (formula: `Backend::bmuf_update`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bmuf {
    /// `W := params`, `D := 0`.
    Load = 0,
    Classical = 1,
    Nesterov = 2,
}

/// The kernels besides the dense walk and add, by name prefix and the dtypes they exist for
/// (kernels/bmuf.cu, kernels/sparse.cu).
const NAMED: &[(&str, &[DType])] = &[
    ("bmuf", &FLOATS),
    ("sum_runs", &FLOATS),
    ("divide", &DType::ALL),
    ("repro", &[DType::F32, DType::F64]),
    ("repro_stage", &[DType::F32, DType::F64]),
    ("owned", &DType::ALL),
    ("index_check", &[DType::I32, DType::I64]),
    ("index_report", &[DType::I32, DType::I64]),
];
const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::Bf16];

/// The compiled module of one device, every kernel looked up when it loads.
pub struct Kernels {
    module: sys::CUmodule,
    walk: [sys::CUfunction; 6],
    add: [sys::CUfunction; 6],
    /// [`NAMED`], keyed by (name prefix, dtype), so a launch formats no string.
    named: HashMap<(&'static str, DType), sys::CUfunction>,
    pub sm_count: u32,
    /// What was loaded ("cubin sm_90", or "ptx compute_90" when NVRTC could not target the GPU)
    /// and by which NVRTC, for describe.
    pub built: String,
    /// The module lives in the device's primary context: releasing the last retain would reset
    /// the context and unload it under the cache, so the cache keeps one retain for the process
    /// (as the CUDA runtime does). `None` for the emulator.
    _ctx: Option<Arc<PrimaryContext>>,
    launcher: Launcher,
}

/// How kernels are found and launched: by the driver, or (tests) by the host emulator of
/// `emulate.rs`, which runs the same CUDA C on CPU threads.
#[derive(Clone, Copy)]
pub(crate) enum Launcher {
    Driver,
    #[allow(dead_code)] // made by the emulation tests only
    Emulated {
        find: unsafe extern "C" fn(*const std::ffi::c_char) -> *const std::ffi::c_void,
        launch: unsafe extern "C" fn(*const std::ffi::c_void, u32, u32, *mut *mut std::ffi::c_void),
    },
}

// SAFETY: modules and functions are usable from any thread.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

fn slot(dtype: DType) -> usize {
    DType::ALL.iter().position(|d| *d == dtype).unwrap_or(0)
}

/// A kernel parameter as `cuLaunchKernel` takes it.
fn arg<T>(value: &mut T) -> *mut std::ffi::c_void {
    (value as *mut T).cast()
}

impl Kernels {
    /// The kernels of `ctx`'s device: compiled on first use, then shared by every context.
    pub fn for_device(ctx: &Arc<PrimaryContext>) -> Result<Arc<Kernels>> {
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

    fn build(ctx: &Arc<PrimaryContext>) -> Result<Kernels> {
        use sys::CUdevice_attribute as A;
        let major = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let image = image_for(major, minor)?;
        let _bound = ctx.bind()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: a CUBIN, or NUL-terminated PTX; the context is current.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, image.bytes.as_ptr().cast()) },
            "cuModuleLoadData (dpsync kernels)",
        )?;
        let sm_count = sm_count.max(1) as u32;
        Kernels::new(
            module,
            sm_count,
            image.built.clone(),
            Some(ctx.clone()),
            Launcher::Driver,
        )
    }

    /// The kernels of a loaded module (or the emulator's), with the dense ones looked up.
    fn new(
        module: sys::CUmodule,
        sm_count: u32,
        built: String,
        ctx: Option<Arc<PrimaryContext>>,
        launcher: Launcher,
    ) -> Result<Kernels> {
        let mut kernels = Kernels {
            module,
            walk: [std::ptr::null_mut(); 6],
            add: [std::ptr::null_mut(); 6],
            named: HashMap::new(),
            sm_count,
            built,
            _ctx: ctx,
            launcher,
        };
        for (i, dtype) in DType::ALL.iter().enumerate() {
            kernels.walk[i] = kernels.lookup(&format!("walk_{}", dtype.name()))?;
            kernels.add[i] = kernels.lookup(&format!("add_{}", dtype.name()))?;
        }
        // Every other kernel too, now: with the driver's lazy loading (the default since CUDA
        // 12.2) a function is loaded when first looked up, which may wait for the device, and
        // that must not happen in the middle of a collective, behind NCCL kernels.
        for &(prefix, dtypes) in NAMED {
            for &dtype in dtypes {
                let f = kernels.lookup(&format!("{prefix}_{}", dtype.name()))?;
                kernels.named.insert((prefix, dtype), f);
            }
        }
        Ok(kernels)
    }

    /// Kernels run by the host emulator (tests): `module` is unused, handles are the
    /// emulator's, one "multiprocessor" keeps grids small.
    #[cfg(test)]
    pub(crate) fn emulated(launcher: Launcher) -> Result<Kernels> {
        let built = "host emulation".to_owned();
        Kernels::new(std::ptr::null_mut(), 1, built, None, launcher)
    }

    fn lookup(&self, name: &str) -> Result<sys::CUfunction> {
        let c = CString::new(name).expect("kernel names have no NUL");
        if let Launcher::Emulated { find, .. } = self.launcher {
            // SAFETY: a NUL-terminated name; the emulator returns a registry entry or NULL.
            let f = unsafe { find(c.as_ptr()) };
            if f.is_null() {
                return Err(Error::new(
                    ErrorKind::Backend,
                    format!("no kernel {name} (emulator)"),
                ));
            }
            return Ok(f as sys::CUfunction);
        }
        let mut f = std::ptr::null_mut();
        // SAFETY: the module is loaded; looking up a function needs no current context.
        check(
            unsafe { sys::cuModuleGetFunction(&mut f, self.module, c.as_ptr()) },
            &format!("cuModuleGetFunction({name})"),
        )?;
        Ok(f)
    }

    /// `{prefix}_{dtype}` (e.g. `bmuf_f16`), one of [`NAMED`] (looked up at load).
    fn named(&self, prefix: &'static str, dtype: DType) -> Result<sys::CUfunction> {
        self.named.get(&(prefix, dtype)).copied().ok_or_else(|| {
            Error::new(
                ErrorKind::Backend,
                format!("no kernel {prefix}_{} in dpsync's module", dtype.name()),
            )
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
        let (mut fusion, mut mode_i) = (fusion, mode as i32);
        let between = [arg(&mut fusion), arg(&mut mode_i)];
        let f = self.walk[slot(dtype)];
        let dims = (nseg, nrep, total);
        self.launch_table(f, stream, (table, dims), &between, divisor, "walk")
    }

    /// Launches `f`, a kernel over a segment table (`segs, ptrs, nseg, nrep, total`, then
    /// `between`, then `avg, divisor`) of `total` elements, on `stream`. `between` points at
    /// the caller's arguments, which outlive the launch.
    fn launch_table(
        &self,
        f: sys::CUfunction,
        stream: sys::CUstream,
        (table, (nseg, nrep, total)): (sys::CUdeviceptr, (usize, usize, usize)),
        between: &[*mut std::ffi::c_void],
        divisor: Option<usize>,
        name: &str,
    ) -> Result<()> {
        let mut segs = table;
        let mut ptrs = table + (nseg * 16) as u64;
        let mut nseg_i = nseg as i32;
        let mut nrep_i = nrep as i32;
        let mut total_u = total as u64;
        let mut avg = i32::from(divisor.is_some());
        let mut div = divisor.unwrap_or(1) as f64;
        // At most three in between (repro_stage's): a fixed array, no allocation per launch.
        let mut params = [std::ptr::null_mut(); 10];
        let head = [
            arg(&mut segs),
            arg(&mut ptrs),
            arg(&mut nseg_i),
            arg(&mut nrep_i),
            arg(&mut total_u),
        ];
        let n = head.len() + between.len() + 2;
        params[..5].copy_from_slice(&head);
        params[5..5 + between.len()].copy_from_slice(between);
        params[n - 2] = arg(&mut avg);
        params[n - 1] = arg(&mut div);
        let grid = self.grid(total, CHUNK);
        self.launch(f, grid, stream, &mut params[..n], name)
    }

    /// The reproducible sum (kernels/dense.cu `repro`) of `nrep` replicas of a table of `nseg`
    /// segments over `total` elements (`dims`) of an F32 or F64 bucket into every replica,
    /// divided by `divisor`, on `stream` (the context is current).
    pub fn reproducible(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        table: sys::CUdeviceptr,
        dims: (usize, usize, usize),
        divisor: Option<usize>,
    ) -> Result<()> {
        let f = self.named("repro", dtype)?;
        self.launch_table(f, stream, (table, dims), &[], divisor, "repro")
    }

    /// One pass (`stage`) of the reproducible sum over several devices (kernels/dense.cu
    /// `repro_stage`) over `nrep` replicas of a table of `nseg` segments over `total` elements
    /// (`dims`) of an F32 or F64 bucket: `sums` holds `total` u64, `fields` `total` of the
    /// dtype's field type (u8, or u16 for F64). On `stream` (the context is current).
    #[allow(clippy::too_many_arguments)]
    pub fn repro_stage(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        table: sys::CUdeviceptr,
        dims: (usize, usize, usize),
        (sums, fields): (sys::CUdeviceptr, sys::CUdeviceptr),
        stage: ReproStage,
        divisor: Option<usize>,
    ) -> Result<()> {
        let f = self.named("repro_stage", dtype)?;
        let (mut sums, mut fields, mut mode) = (sums, fields, stage as i32);
        let between = [arg(&mut sums), arg(&mut fields), arg(&mut mode)];
        self.launch_table(f, stream, (table, dims), &between, divisor, "repro_stage")
    }

    /// The shards of `nrep` replicas of a table of `nseg` segments over `total` elements
    /// (`dims`; kernels/dense.cu `owned`): with `scatter`, each replica's piece of every segment := the sum over the
    /// replicas (walk's order), divided by `divisor`; otherwise each owner's piece copied to
    /// the other replicas. On `stream` (the context is current).
    pub fn owned(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        table: sys::CUdeviceptr,
        dims: (usize, usize, usize),
        scatter: bool,
        divisor: Option<usize>,
    ) -> Result<()> {
        let f = self.named("owned", dtype)?;
        let mut scatter_i = i32::from(scatter);
        self.launch_table(
            f,
            stream,
            (table, dims),
            &[arg(&mut scatter_i)],
            divisor,
            "owned",
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
        let mut params = [arg(&mut dst), arg(&mut src), arg(&mut n64)];
        let grid = self.grid(n, CHUNK);
        self.launch(self.add[slot(dtype)], grid, stream, &mut params, "add")
    }

    /// The BMUF kernel over a three-pointer table (params, W, D per segment) of `total`
    /// elements of the PARAM `dtype`: [`Bmuf::Load`] or one filter step.
    #[allow(clippy::too_many_arguments)]
    pub fn bmuf(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        table: sys::CUdeviceptr,
        nseg: usize,
        total: usize,
        mode: Bmuf,
        block_momentum: f64,
        block_lr: f64,
    ) -> Result<()> {
        let f = self.named("bmuf", dtype)?;
        let mut segs = table;
        let mut ptrs = table + (nseg * 16) as u64;
        let mut nseg_i = nseg as i32;
        let mut total_u = total as u64;
        let mut mode_i = mode as i32;
        let (mut mu, mut eta) = (block_momentum, block_lr);
        let mut params = [
            arg(&mut segs),
            arg(&mut ptrs),
            arg(&mut nseg_i),
            arg(&mut total_u),
            arg(&mut mode_i),
            arg(&mut mu),
            arg(&mut eta),
        ];
        self.launch(f, self.grid(total, CHUNK), stream, &mut params, "bmuf")
    }

    /// Lowers `found[0]` (a device u64, ~0 when clean) to the first row of `rows` indices of
    /// `dtype` at `indices` outside `[0, bound)`, then writes that row's index to `found[1]`.
    pub fn index_check(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        indices: sys::CUdeviceptr,
        rows: usize,
        bound: u64,
        found: sys::CUdeviceptr,
    ) -> Result<()> {
        let (mut idx, mut rows_u, mut bound, mut found) = (indices, rows as u64, bound, found);
        let check = self.named("index_check", dtype)?;
        let mut params = [
            arg(&mut idx),
            arg(&mut rows_u),
            arg(&mut bound),
            arg(&mut found),
        ];
        let grid = self.grid(rows, CHUNK);
        self.launch(check, grid, stream, &mut params, "index_check")?;
        let report = self.named("index_report", dtype)?;
        let mut params = [arg(&mut idx), arg(&mut found)];
        self.launch(report, 1, stream, &mut params, "index_report")
    }

    /// Output row k of `runs` rows of `row_len` elements of `dtype` at `dst` := the sum of the
    /// `src` rows `positions[bounds[k]..bounds[k + 1]]` (device u64 arrays), in that order.
    #[allow(clippy::too_many_arguments)]
    pub fn sum_runs(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        src: sys::CUdeviceptr,
        positions: sys::CUdeviceptr,
        bounds: sys::CUdeviceptr,
        runs: usize,
        row_len: usize,
        dst: sys::CUdeviceptr,
    ) -> Result<()> {
        let f = self.named("sum_runs", dtype)?;
        let (mut src, mut positions, mut bounds, mut dst) = (src, positions, bounds, dst);
        let (mut runs_u, mut row_len_u) = (runs as u64, row_len as u64);
        let mut params = [
            arg(&mut src),
            arg(&mut positions),
            arg(&mut bounds),
            arg(&mut runs_u),
            arg(&mut row_len_u),
            arg(&mut dst),
        ];
        let grid = self.grid(runs * row_len, CHUNK);
        self.launch(f, grid, stream, &mut params, "sum_runs")
    }

    /// `x[i] /= divisor` for `n` elements of the float `dtype`, rounded once.
    pub fn divide(
        &self,
        stream: sys::CUstream,
        dtype: DType,
        x: sys::CUdeviceptr,
        n: usize,
        divisor: usize,
    ) -> Result<()> {
        let f = self.named("divide", dtype)?;
        let (mut x, mut n64, mut div) = (x, n as u64, divisor as f64);
        let mut params = [arg(&mut x), arg(&mut n64), arg(&mut div)];
        self.launch(f, self.grid(n, CHUNK), stream, &mut params, "divide")
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
        if let Launcher::Emulated { launch, .. } = self.launcher {
            // SAFETY: as below; the emulator runs the kernel to completion before returning.
            unsafe {
                launch(
                    f as *const std::ffi::c_void,
                    grid,
                    THREADS,
                    params.as_mut_ptr(),
                )
            };
            return Ok(());
        }
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
        if let Launcher::Driver = self.launcher {
            // SAFETY: cached for the process; unloaded only if the cache is ever dropped.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the Rust side launches, by name.
    fn entry_points() -> Vec<String> {
        let mut names = Vec::new();
        for dtype in DType::ALL {
            let n = dtype.name();
            names.push(format!("walk_{n}"));
            names.push(format!("add_{n}"));
            names.push(format!("divide_{n}"));
            names.push(format!("owned_{n}"));
            if matches!(dtype, DType::F32 | DType::F64) {
                names.push(format!("repro_{n}"));
                names.push(format!("repro_stage_{n}"));
            }
            if dtype.is_float() {
                names.push(format!("bmuf_{n}"));
                names.push(format!("sum_runs_{n}"));
            } else {
                names.push(format!("index_check_{n}"));
                names.push(format!("index_report_{n}"));
            }
        }
        names
    }

    /// Runs without a GPU wherever NVRTC is found (scripts/test.sh fetches pip's
    /// nvidia-cuda-nvrtc): the CUDA C compiles for the architectures dpsync targets, and
    /// every kernel the Rust side names is in the PTX. With `DPSYNC_PTXAS` naming ptxas (pip's
    /// nvidia-cuda-nvcc), the PTX is also assembled, which checks the inline PTX.
    #[test]
    fn kernels_compile_offline_for_ampere_and_hopper() {
        if !nvrtc_present() {
            eprintln!(
                "offline kernel compile: skipped: NVRTC not found (set DPSYNC_NVRTC_LIBRARY)"
            );
            return;
        }
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = compile(major, minor, Image::Ptx).unwrap_or_else(|e| panic!("{}", e.message));
            let ptx = String::from_utf8(ptx).expect("PTX is text");
            let ptx = ptx.trim_end_matches('\0');
            let cubin =
                compile(major, minor, Image::Cubin).unwrap_or_else(|e| panic!("{}", e.message));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "sm_{major}{minor}: a CUBIN is an ELF image"
            );
            for name in entry_points() {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "sm_{major}{minor}: no kernel {name} in the PTX"
                );
            }
            let Ok(ptxas) = std::env::var("DPSYNC_PTXAS") else {
                eprintln!("ptxas check: skipped: DPSYNC_PTXAS is not set");
                continue;
            };
            let dir = std::env::temp_dir().join(format!("dpsync-ptx-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join(format!("kernels_sm{major}{minor}.ptx"));
            std::fs::write(&file, ptx).unwrap();
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch=sm_{major}{minor}"))
                .arg(&file)
                .arg("-o")
                .arg(dir.join("kernels.cubin"))
                .output()
                .unwrap_or_else(|e| panic!("could not run {ptxas}: {e}"));
            assert!(
                out.status.success(),
                "ptxas sm_{major}{minor} rejected the PTX:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn every_launched_kernel_is_defined_in_the_source() {
        let src = source();
        for macro_name in ["DENSE_KERNELS", "BMUF_KERNELS", "SPARSE_VALUE_KERNELS"] {
            for dtype in DType::ALL.iter().filter(|d| d.is_float()) {
                let line = format!("\n{macro_name}(");
                assert!(
                    src.split(&line)
                        .skip(1)
                        .any(|rest| rest.contains(&format!(", {})", dtype.name()))),
                    "{macro_name} is not instantiated for {}",
                    dtype.name()
                );
            }
        }
        assert_eq!(CHUNK, 1024);
    }

    /// prelude.cu's default ITEMS_PER_THREAD (for builds that pass no -D, as the fake CUDA
    /// driver's) is the Rust side's ITEMS.
    #[test]
    fn the_default_items_per_thread_is_items() {
        let prelude = include_str!("kernels/prelude.cu");
        let lines: Vec<&str> = prelude.lines().map(str::trim).collect();
        let at = lines
            .iter()
            .position(|l| *l == "#ifndef ITEMS_PER_THREAD")
            .expect("prelude.cu defaults ITEMS_PER_THREAD");
        let value = lines[at + 1]
            .strip_prefix("#define ITEMS_PER_THREAD ")
            .expect("the #define follows the #ifndef");
        assert_eq!(value.trim().parse::<u32>(), Ok(ITEMS));
        assert_eq!(lines[at + 2], "#endif");
    }
}
