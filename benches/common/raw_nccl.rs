//! Just enough of NCCL, loaded by hand, for the benchmark's baseline: the reduction a framework
//! would write without dpsync (one `ncclAllReduce` per tensor inside a group). The library is
//! found as dpsync finds it: `DPSYNC_NCCL_LIBRARY` alone when set, else `libnccl.so.2`, then
//! `libnccl.so`.

use std::ffi::{c_char, c_int, c_void, CStr};

type Comm = *mut c_void;
type NcclResult = c_int;
const NCCL_FLOAT32: c_int = 7;
/// `ncclAvg` (NCCL >= 2.10): the benchmark averages, as dpsync does there.
const NCCL_AVG: c_int = 4;

type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> NcclResult;
type InitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult;
type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;
type Group = unsafe extern "C" fn() -> NcclResult;
type Destroy = unsafe extern "C" fn(Comm) -> NcclResult;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;

pub struct Comms {
    comms: Vec<Comm>,
    all_reduce: AllReduce,
    group_start: Group,
    group_end: Group,
    destroy: Destroy,
    /// Last: the function pointers above point into it.
    _lib: libloading::Library,
}

fn open() -> Result<libloading::Library, String> {
    // As dpsync: the named library alone when DPSYNC_NCCL_LIBRARY is set (an empty path would
    // make dlopen return the program itself), else the sonames.
    let names: Vec<String> = match std::env::var("DPSYNC_NCCL_LIBRARY") {
        Ok(p) if !p.trim().is_empty() => vec![p.trim().to_owned()],
        _ => vec!["libnccl.so.2".to_owned(), "libnccl.so".to_owned()],
    };
    for name in &names {
        // SAFETY: loading NCCL runs only its initialisers.
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            return Ok(lib);
        }
    }
    Err(format!("NCCL not found (tried {names:?})"))
}

/// The NCCL the baseline would use, as "2.28.9 (NCCL_VERSION_CODE 22809)".
pub fn version() -> Result<String, String> {
    let lib = open()?;
    // SAFETY: ncclGetVersion's C signature; writes one int.
    unsafe {
        let get: GetVersion = *lib
            .get::<GetVersion>(b"ncclGetVersion\0")
            .map_err(|e| format!("NCCL symbol missing: {e}"))?;
        let mut v: c_int = 0;
        get(&mut v);
        let (major, minor, patch) = if v >= 10000 {
            (v / 10000, (v / 100) % 100, v % 100)
        } else {
            (v / 1000, (v / 100) % 10, v % 100)
        };
        Ok(format!("{major}.{minor}.{patch} (NCCL_VERSION_CODE {v})"))
    }
}

impl Comms {
    /// Two ranks on GPU 0 (`ncclCommInitAll` with devices [0, 0]); an NCCL that does not allow
    /// several ranks per GPU refuses, and the error says so.
    pub fn two_ranks_on_gpu0() -> Result<Comms, String> {
        let lib = open()?;
        // SAFETY: the C signatures of NCCL 2.x; the pointers are kept beside the library.
        unsafe {
            fn sym<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Result<T, String> {
                // SAFETY: the caller names the symbol's true type.
                unsafe { lib.get::<T>(name) }
                    .map(|s| *s)
                    .map_err(|e| format!("NCCL symbol missing: {e}"))
            }
            let init_all: InitAll = sym(&lib, b"ncclCommInitAll\0")?;
            let error_string: ErrorString = sym(&lib, b"ncclGetErrorString\0")?;
            let mut comms = vec![std::ptr::null_mut(); 2];
            let devices = [0 as c_int, 0];
            let code = init_all(comms.as_mut_ptr(), 2, devices.as_ptr());
            if code != 0 {
                let text = CStr::from_ptr(error_string(code)).to_string_lossy();
                return Err(format!(
                    "NCCL refused two ranks on one GPU ({text}); NCCL >= 2.30 with \
                     NCCL_MULTI_RANK_GPU_ENABLE=1 allows it"
                ));
            }
            Ok(Comms {
                all_reduce: sym(&lib, b"ncclAllReduce\0")?,
                group_start: sym(&lib, b"ncclGroupStart\0")?,
                group_end: sym(&lib, b"ncclGroupEnd\0")?,
                destroy: sym(&lib, b"ncclCommDestroy\0")?,
                comms,
                _lib: lib,
            })
        }
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd.
    pub fn group(&self, f: impl FnOnce()) {
        // SAFETY: balanced group calls.
        unsafe {
            assert_eq!((self.group_start)(), 0, "ncclGroupStart");
            f();
            assert_eq!((self.group_end)(), 0, "ncclGroupEnd");
        }
    }

    /// `ncclAllReduce` (average) in place of `n` f32 at `ptr` for `rank` on `stream`.
    pub fn allreduce_f32_avg_in_place(&self, rank: usize, ptr: u64, n: usize, stream: *mut c_void) {
        let p = ptr as *mut c_void;
        // SAFETY: live device memory of `n` f32 on the rank's device.
        let code =
            unsafe { (self.all_reduce)(p, p, n, NCCL_FLOAT32, NCCL_AVG, self.comms[rank], stream) };
        assert_eq!(code, 0, "ncclAllReduce rank {rank}");
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        for &c in &self.comms {
            // SAFETY: ours; the benchmark synchronized its streams.
            unsafe { (self.destroy)(c) };
        }
    }
}
