//! Building the kernels: their CUDA C (the `.cu` files beside this one) compiled by NVRTC once
//! per GPU architecture and process, machine code first, PTX as the fallback.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::ITEMS;
use crate::error::{Error, ErrorKind, Result};

/// The kernels' CUDA C, in one module: shared types first, then one file per feature.
const SOURCES: [&str; 4] = [
    include_str!("prelude.cu"),
    include_str!("dense.cu"),
    include_str!("bmuf.cu"),
    include_str!("sparse.cu"),
];

/// The whole module's source.
pub(crate) fn source() -> String {
    SOURCES.join("\n")
}

/// What NVRTC is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Image {
    /// Machine code for `sm_XY`: loads on any driver of the same CUDA major version (minor
    /// version compatibility), whatever NVRTC 13.x built it.
    Cubin,
    /// PTX for `compute_XY`, compiled by the driver at load time: only loads if the driver is at
    /// least as new as NVRTC. The fallback when NVRTC cannot build machine code for the GPU.
    Ptx,
}

/// Every dpsync kernel compiled for compute capability `major.minor`, as an image for
/// `cuModuleLoadData` (PTX NUL-terminated). No device is needed: the offline check in the tests
/// uses this too. `--fmad=false` keeps every product rounded on its own, so BMUF gives the host
/// backend's bytes (no kernel here gains from contraction).
pub(crate) fn compile(major: i32, minor: i32, image: Image) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys as nv};
    COMPILES.fetch_add(1, Ordering::Relaxed);
    if !nvrtc_present() {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "NVRTC (libnvrtc.so.13) was not found: dpsync compiles its CUDA kernels with it \
             at run time; put its directory on LD_LIBRARY_PATH or name the file in \
             DPSYNC_NVRTC_LIBRARY (docs/API.md, \"CUDA libraries\")",
        ));
    }
    let arch = match image {
        Image::Cubin => format!("--gpu-architecture=sm_{major}{minor}"),
        Image::Ptx => format!("--gpu-architecture=compute_{major}{minor}"),
    };
    let options = [
        arch,
        format!("-DITEMS_PER_THREAD={ITEMS}"),
        "--std=c++14".to_owned(),
        "--fmad=false".to_owned(),
        // i64 sums accumulate in __int128, as the host's do in i128.
        "--device-int128".to_owned(),
    ];
    let failed = |what: String| {
        Error::new(
            ErrorKind::Backend,
            format!(
                "NVRTC could not build dpsync's kernels for sm_{major}{minor} ({image:?}): {what}"
            ),
        )
    };
    let src = CString::new(source()).expect("the kernel source has no NUL");
    let prog = result::create_program(&src, None).map_err(|e| failed(format!("{e:?}")))?;
    // SAFETY: `prog` is live until destroyed below; the out buffers are sized by NVRTC.
    unsafe {
        let built = result::compile_program(prog, &options).map_err(|e| {
            let log = result::get_program_log(prog)
                .map(|l| {
                    std::ffi::CStr::from_ptr(l.as_ptr())
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            failed(format!("{e:?}: {log}"))
        });
        let out = built.and_then(|()| match image {
            Image::Ptx => {
                let mut ptx: Vec<u8> = result::get_ptx(prog)
                    .map_err(|e| failed(format!("{e:?}")))?
                    .into_iter()
                    .map(|c| c as u8)
                    .collect();
                // NVRTC's size counts the NUL; make sure there is exactly one at the end.
                while ptx.last() == Some(&0) {
                    ptx.pop();
                }
                ptx.push(0);
                Ok(ptx)
            }
            Image::Cubin => {
                let mut size = 0usize;
                nv::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| failed(format!("{e:?}")))?;
                let mut cubin = vec![0u8; size];
                nv::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| failed(format!("{e:?}")))?;
                Ok(cubin)
            }
        });
        let _ = result::destroy_program(prog);
        out
    }
}

/// NVRTC compilations run by this process (describe's `backend.nvrtc_compiles`).
static COMPILES: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn nvrtc_compiles() -> usize {
    COMPILES.load(Ordering::Relaxed)
}

/// The kernel image for compute capability `major.minor` and how it was built: compiled once
/// per architecture and process, however many GPUs share it (a compile takes most of a second,
/// so eight GPUs of one kind would otherwise add seconds to context creation). Machine code
/// first (no driver JIT, no PTX-version limit); PTX if NVRTC cannot target the GPU directly.
/// Failures are not kept: the next context tries again.
pub(super) fn image_for(major: i32, minor: i32) -> Result<Arc<KernelImage>> {
    type ByArch = HashMap<(i32, i32), Arc<KernelImage>>;
    static IMAGES: OnceLock<Mutex<ByArch>> = OnceLock::new();
    let mut images = IMAGES.get_or_init(Default::default).lock();
    if let Some(image) = images.get(&(major, minor)) {
        return Ok(image.clone());
    }
    let (bytes, how) = match compile(major, minor, Image::Cubin) {
        Ok(cubin) => (cubin, format!("cubin sm_{major}{minor}")),
        Err(_) => (
            compile(major, minor, Image::Ptx)?,
            format!("ptx compute_{major}{minor}"),
        ),
    };
    let built = format!(
        "{how}, NVRTC {}",
        nvrtc_version().unwrap_or_else(|| "?".to_owned())
    );
    let image = Arc::new(KernelImage { bytes, built });
    images.insert((major, minor), image.clone());
    Ok(image)
}

/// A module image for `cuModuleLoadData` and how it was built (describe's `kernels`).
pub(super) struct KernelImage {
    pub(super) bytes: Vec<u8>,
    pub(super) built: String,
}

/// NVRTC's version, as "major.minor" (for describe).
pub(crate) fn nvrtc_version() -> Option<String> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain query.
    let ok = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (ok == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then(|| format!("{major}.{minor}"))
}

/// NVRTC must be present to build the kernels; cudarc panics without it, so probe first.
/// `DPSYNC_NVRTC_LIBRARY` names the file when it is not on the loader path (pip's
/// `nvidia-cuda-nvrtc`): loaded globally, it then satisfies cudarc's lookup by soname. NVRTC
/// itself opens `libnvrtc-builtins.so.*` by soname at compile time, which fails when that
/// directory is not on the loader path either, so the builtins beside it are loaded first.
pub fn nvrtc_present() -> bool {
    static PRELOADED: OnceLock<()> = OnceLock::new();
    PRELOADED.get_or_init(|| {
        if let Ok(path) = std::env::var("DPSYNC_NVRTC_LIBRARY") {
            let path = std::path::Path::new(path.trim());
            let builtins = (path.parent())
                .and_then(|dir| std::fs::read_dir(dir).ok())
                .into_iter()
                .flatten()
                .flatten()
                .map(|entry| entry.path())
                .filter(|p| {
                    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    name.starts_with("libnvrtc-builtins.so")
                });
            for lib in builtins.chain([path.to_path_buf()]) {
                use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
                // SAFETY: loading NVRTC runs no code beyond its initialisers.
                if let Ok(lib) = unsafe { Library::open(Some(&lib), RTLD_NOW | RTLD_GLOBAL) } {
                    // Kept for the process: NVRTC and cudarc resolve against it by soname.
                    std::mem::forget(lib);
                }
            }
        }
    });
    // SAFETY: probes for the library only.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
