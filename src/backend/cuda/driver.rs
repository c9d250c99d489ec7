//! The CUDA driver through cudarc's `sys` layer: loading it without panicking, turning
//! `CUresult`s into [`Error`]s, and small owners for contexts, streams, events and memory.
//!
//! cudarc loads libcuda lazily and panics when it is missing, so [`load`] checks
//! `is_culib_present()` before any other call.

use std::ffi::CStr;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use crate::error::{Error, ErrorKind, Result};

/// Loads the driver and runs `cuInit` once per process.
pub fn load() -> Result<()> {
    static LOADED: OnceLock<Result<()>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: only probes for the library; loads nothing into cudarc's state.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    "the CUDA driver library (libcuda.so.1) was not found: no NVIDIA driver is \
                     installed, or it is not on the loader path",
                ));
            }
            // SAFETY: the library is present.
            check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| {
                Error::new(
                    ErrorKind::Unavailable,
                    format!("the CUDA driver did not initialise: {}", e.message),
                )
            })
        })
        .clone()
}

/// `Ok` for `CUDA_SUCCESS`, else a BACKEND_ERROR naming `what` and the driver's text (marked
/// out of memory for `CUDA_ERROR_OUT_OF_MEMORY`).
pub fn check(result: sys::CUresult, what: &str) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let message = format!("{what} failed: {}", describe(result));
    Err(if result == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Error::out_of_memory(message)
    } else {
        Error::new(ErrorKind::Backend, message)
    })
}

/// "CUDA_ERROR_X: text" for a driver result.
pub fn describe(result: sys::CUresult) -> String {
    let mut name = std::ptr::null();
    let mut text = std::ptr::null();
    // SAFETY: the driver writes static strings (or leaves the pointers null).
    unsafe {
        sys::cuGetErrorName(result, &mut name);
        sys::cuGetErrorString(result, &mut text);
    }
    let show = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{result:?}")
        } else {
            // SAFETY: a NUL-terminated static string from the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{}: {}", show(name), show(text))
}

pub fn device_count() -> Result<i32> {
    let mut n = 0;
    // SAFETY: plain query after load().
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

pub fn driver_version() -> i32 {
    let mut v = 0;
    // SAFETY: plain query after load().
    unsafe { sys::cuDriverGetVersion(&mut v) };
    v
}

/// A device's primary context (the one the CUDA runtime, PyTorch included, uses), retained
/// for the owner's lifetime.
pub struct PrimaryContext {
    pub ordinal: i32,
    pub device: sys::CUdevice,
    pub ctx: sys::CUcontext,
}

// SAFETY: CUDA contexts may be used from any thread.
unsafe impl Send for PrimaryContext {}
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(ordinal: i32) -> Result<PrimaryContext> {
        let mut device = 0;
        // SAFETY: plain driver calls after load().
        unsafe {
            check(sys::cuDeviceGet(&mut device, ordinal), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
                "cuDevicePrimaryCtxRetain",
            )?;
            Ok(PrimaryContext {
                ordinal,
                device,
                ctx,
            })
        }
    }

    /// Makes this context current on the calling thread until the guard drops, then restores
    /// the caller's: a framework's own current context must not change under it.
    pub fn bind(&self) -> Result<Bound> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: plain driver calls on a retained context.
        unsafe {
            check(sys::cuCtxGetCurrent(&mut previous), "cuCtxGetCurrent")?;
            if previous != self.ctx {
                check(sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")?;
            }
        }
        Ok(Bound {
            previous,
            changed: previous != self.ctx,
        })
    }

    pub fn attribute(&self, attribute: sys::CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: plain query.
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut v, attribute, self.device) },
            "cuDeviceGetAttribute",
        )?;
        Ok(v)
    }

    pub fn name(&self) -> String {
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: the driver writes a NUL-terminated name into the buffer.
        unsafe {
            if sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.device)
                != sys::CUresult::CUDA_SUCCESS
            {
                return format!("cuda:{}", self.ordinal);
            }
            CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
        }
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// Keeps the calling thread's current context: restores it when the guard drops, whatever
/// happened in between (NCCL's group calls may switch it).
pub fn keep_current() -> Result<Bound> {
    let mut previous = std::ptr::null_mut();
    // SAFETY: plain driver call.
    check(
        unsafe { sys::cuCtxGetCurrent(&mut previous) },
        "cuCtxGetCurrent",
    )?;
    Ok(Bound {
        previous,
        changed: true,
    })
}

/// Restores the previously current context on drop.
pub struct Bound {
    previous: sys::CUcontext,
    changed: bool,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restores what was current before (possibly null).
            unsafe { sys::cuCtxSetCurrent(self.previous) };
        }
    }
}

/// A stream the library created (non-blocking: no implicit sync with the legacy stream).
pub struct Stream(pub sys::CUstream);
// SAFETY: CUDA streams may be used from any thread.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    /// Needs the owning context current.
    pub fn new() -> Result<Stream> {
        let mut s = std::ptr::null_mut();
        check(
            // SAFETY: plain driver call.
            unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            },
            "cuStreamCreate",
        )?;
        Ok(Stream(s))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream is ours; the driver releases it once its work is done.
        unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// An event without timing (cheapest to record and wait on).
pub struct Event(pub sys::CUevent);
// SAFETY: CUDA events may be used from any thread.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// Needs the owning context current.
    pub fn new() -> Result<Event> {
        let mut e = std::ptr::null_mut();
        check(
            // SAFETY: plain driver call.
            unsafe {
                sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(Event(e))
    }

    /// An event that keeps time (for the timeline's device spans). Needs the owning context
    /// current.
    pub fn timed() -> Result<Event> {
        let mut e = std::ptr::null_mut();
        check(
            // SAFETY: plain driver call.
            unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
            "cuEventCreate (timed)",
        )?;
        Ok(Event(e))
    }

    /// Milliseconds from this event to `later` (both timed, recorded and complete, on one
    /// device).
    pub fn elapsed_ms(&self, later: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: live events.
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.0, later.0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }

    /// Needs the stream's context current (the legacy stream 0 is per context).
    pub fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: both handles are live.
        check(
            unsafe { sys::cuEventRecord(self.0, stream) },
            "cuEventRecord",
        )
    }

    /// Makes `stream` wait for this event's last record (the host does not block).
    pub fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: both handles are live.
        check(
            unsafe { sys::cuStreamWaitEvent(stream, self.0, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// `Ok(true)` when complete, `Ok(false)` while pending, an error if the device failed.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "a collective on the device (cuEventQuery)").map(|_| true),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours.
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// Device memory from `cuMemAlloc` (not a stream-ordered pool: peer reads need plain
/// allocations, which peer access covers without per-pool access lists).
pub struct DeviceMemory {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    /// Bound to free it (and kept retained until then).
    ctx: Arc<PrimaryContext>,
}

impl DeviceMemory {
    /// `bytes` on `ctx`'s device, contents undefined: for buffers the next work on their stream
    /// overwrites completely (tables and maps uploaded in order, fusion buffers packed into).
    pub fn uninit(ctx: &Arc<PrimaryContext>, bytes: usize) -> Result<DeviceMemory> {
        let _bound = ctx.bind()?;
        let mut ptr = 0;
        // SAFETY: plain driver call; at least one byte so the pointer is distinct.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
            "cuMemAlloc (library memory on a CUDA replica)",
        )?;
        Ok(DeviceMemory {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// Whether this memory is on `ctx`'s device.
    pub fn is_on(&self, ctx: &Arc<PrimaryContext>) -> bool {
        Arc::ptr_eq(&self.ctx, ctx)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let Ok(_bound) = self.ctx.bind() else { return };
        // SAFETY: ours; cuMemFree waits for the device's work using it to finish.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Copies `bytes` from host memory to `dst` in order on `stream` (the current context's). The
/// driver stages a pageable source before returning, so `bytes` may be dropped afterwards; a
/// synchronous cuMemcpyHtoD would use the legacy stream, unordered with dpsync's streams.
pub fn upload(dst: sys::CUdeviceptr, bytes: &[u8], stream: sys::CUstream) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` holds at least `bytes.len()` bytes on the current context's device.
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, bytes.as_ptr().cast(), bytes.len(), stream) },
        "cuMemcpyHtoDAsync",
    )
}

/// Page-locked host memory from `cuMemAllocHost`: the target of asynchronous device-to-host
/// copies that the host reads later (a pageable target would make the copy block the host).
pub struct PinnedMemory {
    pub ptr: *mut std::ffi::c_void,
    pub bytes: usize,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: plain host memory, read only after the copies into it completed.
unsafe impl Send for PinnedMemory {}
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    pub fn new(ctx: &Arc<PrimaryContext>, bytes: usize) -> Result<PinnedMemory> {
        let _bound = ctx.bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: plain driver call.
        check(
            unsafe { sys::cuMemAllocHost_v2(&mut ptr, bytes.max(1)) },
            "cuMemAllocHost",
        )?;
        Ok(PinnedMemory {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let Ok(_bound) = self.ctx.bind() else { return };
        // SAFETY: ours.
        unsafe { sys::cuMemFreeHost(self.ptr) };
    }
}

/// Where a pointer lives, from its attributes: `None` for memory CUDA does not know (pageable
/// host memory: the driver answers CUDA_ERROR_INVALID_VALUE), else (is device memory, device
/// ordinal (plain device memory only, else -1), is managed). Any other failure is an error, not
/// "host": treating device memory as host memory would make host threads dereference it. Needs
/// a context current.
pub fn pointer_memory(ptr: usize) -> Result<Option<(bool, i32, bool)>> {
    let mut kind: u32 = 0;
    // SAFETY: attribute queries only read the driver's tables.
    let known = unsafe {
        sys::cuPointerGetAttribute(
            &mut kind as *mut u32 as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as sys::CUdeviceptr,
        )
    };
    if known == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    check(known, "cuPointerGetAttribute")?;
    let query = |attribute, out: *mut std::ffi::c_void, what: &str| {
        // SAFETY: as above; `out` has room for the attribute's value.
        check(
            unsafe { sys::cuPointerGetAttribute(out, attribute, ptr as sys::CUdeviceptr) },
            &format!("cuPointerGetAttribute ({what})"),
        )
    };
    let mut managed: u32 = 0;
    query(
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        &mut managed as *mut u32 as *mut std::ffi::c_void,
        "is managed",
    )?;
    let device = kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        || kind == sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;
    // Only plain device memory needs its device (host and managed memory are reachable).
    let mut ordinal: i32 = -1;
    if device && managed == 0 {
        query(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            &mut ordinal as *mut i32 as *mut std::ffi::c_void,
            "device ordinal",
        )?;
    }
    Ok(Some((device, ordinal, managed != 0)))
}

/// Whether `a` can read `b`'s memory directly.
pub fn can_access_peer(a: &PrimaryContext, b: &PrimaryContext) -> Result<bool> {
    let mut can = 0;
    // SAFETY: plain query.
    check(
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.device, b.device) },
        "cuDeviceCanAccessPeer",
    )?;
    Ok(can != 0)
}

/// Lets kernels in `a`'s context read `b`'s memory: whether it could. Already enabled (by us,
/// another context or the framework) is fine; a device out of peer connections
/// (CUDA_ERROR_TOO_MANY_PEERS) or a pair the driver refuses after all is `false`, so that pair
/// uses staged copies instead.
pub fn enable_peer_access(a: &PrimaryContext, b: &PrimaryContext) -> Result<bool> {
    use sys::CUresult as R;
    let _bound = a.bind()?;
    // SAFETY: a is current; b is retained.
    match unsafe { sys::cuCtxEnablePeerAccess(b.ctx, 0) } {
        R::CUDA_SUCCESS | R::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(true),
        R::CUDA_ERROR_TOO_MANY_PEERS | R::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => Ok(false),
        other => check(other, "cuCtxEnablePeerAccess").map(|_| false),
    }
}

/// The context a caller's stream belongs to.
pub fn stream_context(stream: sys::CUstream) -> Result<sys::CUcontext> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the driver validates the handle as far as it can.
    check(
        unsafe { sys::cuStreamGetCtx(stream, &mut ctx) },
        "cuStreamGetCtx",
    )?;
    Ok(ctx)
}
