//! Loading NCCL: the library dpsync opens itself (pip's wheel ships only `libnccl.so.2`, which
//! cudarc does not look for), the entry points it calls, and how its results read.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclConfig_t, ncclUniqueId};
use libloading::Library;

use crate::error::{Error, ErrorKind, Result};
use crate::types::DType;

pub(super) type Comm = *mut c_void;
pub(super) const SUCCESS: u32 = 0;
pub(super) const IN_PROGRESS: u32 = 7;
pub(super) const SUM: u32 = 0;
pub(crate) const MAX: u32 = 2;
/// `ncclFloat16`: F64's exponent fields travel as halves' bits (`Collective::max_fields`).
pub(crate) const HALF: u32 = 6;
/// `ncclUint8`: point-to-point transfers move raw bytes.
pub(crate) const BYTES: u32 = 1;

pub(super) type Shrink =
    unsafe extern "C" fn(Comm, *mut c_int, c_int, *mut Comm, *mut ncclConfig_t, c_int) -> u32;
/// `NCCL_SHRINK_ABORT`: the parent's operations are ended before the child is made.
pub(super) const SHRINK_ABORT: c_int = 1;

pub(super) struct Api {
    _lib: Library,
    pub(super) path: String,
    pub(super) version: c_int,
    pub(super) get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> u32,
    pub(super) comm_init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> u32,
    pub(super) comm_get_async_error: unsafe extern "C" fn(Comm, *mut u32) -> u32,
    pub(super) comm_finalize: unsafe extern "C" fn(Comm) -> u32,
    pub(super) comm_destroy: unsafe extern "C" fn(Comm) -> u32,
    pub(super) comm_abort: unsafe extern "C" fn(Comm) -> u32,
    /// `ncclCommShrink(comm, exclude, count, newcomm, config, flags)`: NCCL 2.27+ only.
    pub(super) comm_shrink: Option<Shrink>,
    pub(super) all_reduce:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, u32, u32, Comm, CUstream) -> u32,
    pub(super) broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, u32, c_int, Comm, CUstream) -> u32,
    /// `ncclReduceScatter(send, recv, recvcount, type, op, comm, stream)`.
    pub(super) reduce_scatter:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, u32, u32, Comm, CUstream) -> u32,
    /// `ncclAllGather(send, recv, sendcount, type, comm, stream)`.
    pub(super) all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, u32, Comm, CUstream) -> u32,
    pub(super) send: unsafe extern "C" fn(*const c_void, usize, u32, c_int, Comm, CUstream) -> u32,
    pub(super) recv: unsafe extern "C" fn(*mut c_void, usize, u32, c_int, Comm, CUstream) -> u32,
    pub(super) group_start: unsafe extern "C" fn() -> u32,
    pub(super) group_end: unsafe extern "C" fn() -> u32,
    pub(super) get_error_string: unsafe extern "C" fn(u32) -> *const c_char,
    pub(super) get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
}

/// Loads the library `DPSYNC_NCCL_LIBRARY` names, alone (a user who names a library gets that
/// one or an error saying why, not whichever NCCL the loader finds), else `libnccl.so.2`, else
/// `libnccl.so`.
fn load_api() -> Result<Api, String> {
    let named = std::env::var("DPSYNC_NCCL_LIBRARY")
        .ok()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty());
    if let Some(path) = named {
        // SAFETY: loading NCCL runs its initialisers, which only register with CUDA.
        return match unsafe { Library::new(&path) } {
            Ok(lib) => bind(lib, path),
            Err(e) => Err(format!(
                "DPSYNC_NCCL_LIBRARY={path} could not be loaded ({e}); unset it to use the \
                 libnccl.so.2 on the loader path"
            )),
        };
    }
    let names = ["libnccl.so.2", "libnccl.so"];
    let mut last = String::new();
    for name in names {
        // SAFETY: as above.
        match unsafe { Library::new(name) } {
            Ok(lib) => return bind(lib, name.to_owned()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!(
        "NCCL was not found (tried {}; last error: {last}); set DPSYNC_NCCL_LIBRARY to the \
         path of libnccl.so.2 (docs/API.md, \"CUDA libraries\")",
        names.join(", ")
    ))
}

fn bind(lib: Library, path: String) -> Result<Api, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is NCCL's documented prototype.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("{path} has no {}: {e}", $name))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> u32 = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { get_version(&mut version) };
    let api = Api {
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank_config: sym!("ncclCommInitRankConfig"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_finalize: sym!("ncclCommFinalize"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        // SAFETY: as `sym!`; absent before NCCL 2.27 (the world's clique is then made anew).
        comm_shrink: unsafe { lib.get::<Shrink>(b"ncclCommShrink\0") }
            .ok()
            .map(|f| *f),
        all_reduce: sym!("ncclAllReduce"),
        broadcast: sym!("ncclBroadcast"),
        reduce_scatter: sym!("ncclReduceScatter"),
        all_gather: sym!("ncclAllGather"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
        path,
        _lib: lib,
    };
    Ok(api)
}

pub(super) fn api() -> Result<&'static Api> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load_api)
        .as_ref()
        .map_err(|e| Error::new(ErrorKind::Unavailable, e.clone()))
}

/// Loads NCCL; describes it as "libnccl.so.2 (NCCL 2.27.7)".
pub fn load() -> Result<String> {
    let api = api()?;
    let v = api.version;
    let (major, minor, patch) = if v >= 10000 {
        (v / 10000, (v / 100) % 100, v % 100)
    } else {
        (v / 1000, (v / 100) % 10, v % 100)
    };
    Ok(format!("{} (NCCL {major}.{minor}.{patch})", api.path))
}

/// NCCL's name for `code`, with `ncclGetLastError`'s message: the detail (which call, which
/// system error). `comm` is null for calls that have none (init, group calls).
pub(super) fn text(api: &Api, code: u32, comm: Comm) -> String {
    // SAFETY: NCCL returns static or per-thread NUL-terminated strings.
    unsafe {
        let s = CStr::from_ptr((api.get_error_string)(code)).to_string_lossy();
        let last = (api.get_last_error)(comm);
        let last = if last.is_null() {
            String::new()
        } else {
            CStr::from_ptr(last).to_string_lossy().into_owned()
        };
        if last.is_empty() {
            format!("{s} (ncclResult {code})")
        } else {
            format!("{s} (ncclResult {code}); NCCL's last message: {last}")
        }
    }
}

pub(super) fn check(api: &Api, code: u32, what: &str) -> Result<()> {
    if code == SUCCESS || code == IN_PROGRESS {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Backend,
        format!("{what} failed: {}", text(api, code, std::ptr::null_mut())),
    ))
}

pub(super) fn nccl_type(dtype: DType) -> u32 {
    match dtype {
        DType::I32 => 2,
        DType::I64 => 4,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::Bf16 => 9,
    }
}
