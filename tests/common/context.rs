//! Owned options and contexts over the C ABI (`use dpsync::*;` only): RAII wrappers, registration
//! of Rust slices and raw pointers, describe output, the per-thread error message and the check of
//! a call's status. The integration tests and the benchmarks (benches/common/mod.rs) share it.

use dpsync::*;
use std::ffi::{c_void, CStr, CString};
use std::ptr;

const OK: dpsync_status = dpsync_status::DPSYNC_STATUS_OK;

/// Asserts `status` is OK, printing the thread's last error otherwise.
#[track_caller]
pub fn check(status: dpsync_status, what: &str) {
    assert_eq!(status, OK, "{what} failed: {}", last_error());
}

pub fn cstr(s: &str) -> CString {
    CString::new(s).expect("test names have no NUL")
}

/// The calling thread's last error message, copied.
pub fn last_error() -> String {
    // SAFETY: dpsync_last_error returns a NUL-terminated string valid until the next call.
    unsafe {
        let p = dpsync_last_error();
        assert!(!p.is_null(), "dpsync_last_error must never return NULL");
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// Owned `dpsync_options`, freed on drop.
pub struct Options(pub *mut dpsync_options);

// A wrapper per options call: each test binary and benchmark sets the few options it needs.
#[allow(dead_code)]
impl Options {
    pub fn new() -> Self {
        let mut p = ptr::null_mut();
        // SAFETY: out pointer is valid.
        check(unsafe { dpsync_options_new(&mut p) }, "dpsync_options_new");
        assert!(!p.is_null());
        Options(p)
    }

    /// Options for `n` host replicas.
    pub fn host(n: usize) -> Self {
        let o = Self::new();
        o.set_host_replicas(n);
        o
    }

    pub fn set_host_replicas(&self, n: usize) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_host_replicas(self.0, n) },
            "set_host_replicas",
        );
    }

    pub fn set_cuda_replicas(&self, ordinals: &[i32]) {
        // SAFETY: valid handle and slice.
        check(
            unsafe { dpsync_options_set_cuda_replicas(self.0, ordinals.as_ptr(), ordinals.len()) },
            "set_cuda_replicas",
        );
    }

    pub fn set_fusion_bytes(&self, bytes: usize) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_fusion_bytes(self.0, bytes) },
            "set_fusion_bytes",
        );
    }

    pub fn set_transport(&self, transport: u32) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_transport(self.0, transport) },
            "set_transport",
        );
    }

    /// The options of the ranks' world in tests/world_leave.rs and tests/world_lost.rs: `local`
    /// host replicas, a world of every rank of `mpirun` (MPI_COMM_WORLD), `timeout_ms`, and
    /// buckets of 64 bytes, so that marks start one early.
    pub fn world_of_ranks(local: usize, timeout_ms: u64) -> Self {
        let o = Self::host(local);
        o.set_timeout_ms(timeout_ms);
        o.set_fusion_bytes(64);
        // SAFETY: valid handle; NULL is MPI_COMM_WORLD.
        check(
            unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
            "set_world_mpi",
        );
        o
    }

    pub fn set_elastic(&self, min_ranks: usize) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_elastic(self.0, min_ranks) },
            "set_elastic",
        );
    }

    pub fn set_timeout_ms(&self, ms: u64) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_timeout_ms(self.0, ms) },
            "set_timeout_ms",
        );
    }

    /// `matrix` is n x n row-major.
    pub fn set_peer_access(&self, matrix: &[u8], n: usize) {
        assert_eq!(matrix.len(), n * n);
        // SAFETY: valid handle and slice.
        check(
            unsafe { dpsync_options_set_peer_access(self.0, matrix.as_ptr(), n) },
            "set_peer_access",
        );
    }

    pub fn set_sparse_coalesce(&self, coalesce: bool) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_sparse_coalesce(self.0, coalesce) },
            "set_sparse_coalesce",
        );
    }

    /// dpsync_plan_describe, or the failing status and message.
    pub fn plan(&self) -> Result<String, (dpsync_status, String)> {
        plan_describe_raw(self.0)
    }

    /// dpsync_plan_describe parsed as JSON (panics on failure).
    pub fn plan_json(&self) -> serde_json::Value {
        let s = self
            .plan()
            .unwrap_or_else(|(st, m)| panic!("plan_describe: {st:?}: {m}"));
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("plan_describe is not JSON ({e}): {s}"))
    }
}

impl Default for Options {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Options {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        unsafe { dpsync_options_free(self.0) }
    }
}

pub fn plan_describe_raw(
    options: *const dpsync_options,
) -> Result<String, (dpsync_status, String)> {
    let mut len = 0usize;
    // SAFETY: sizing call with (NULL, 0).
    let st = unsafe { dpsync_plan_describe(options, ptr::null_mut(), 0, &mut len) };
    if st != OK {
        return Err((st, last_error()));
    }
    let mut buf = vec![0u8; len + 1];
    let mut len2 = 0usize;
    // SAFETY: buffer of len + 1 bytes.
    let st =
        unsafe { dpsync_plan_describe(options, buf.as_mut_ptr().cast(), buf.len(), &mut len2) };
    if st != OK {
        return Err((st, last_error()));
    }
    assert_eq!(len, len2, "plan_describe length changed between calls");
    assert_eq!(buf[len], 0, "plan_describe must NUL-terminate");
    buf.truncate(len);
    Ok(String::from_utf8(buf).expect("describe output is UTF-8"))
}

/// Owned `dpsync_context`, destroyed on drop.
pub struct Context(pub *mut dpsync_context);

// A wrapper per context call: each test binary and benchmark makes the calls of its subject.
#[allow(dead_code)]
impl Context {
    pub fn new(options: &Options) -> Self {
        let mut p = ptr::null_mut();
        // SAFETY: valid options and out pointer.
        check(
            unsafe { dpsync_context_create(options.0, &mut p) },
            "dpsync_context_create",
        );
        assert!(!p.is_null());
        Context(p)
    }

    /// A context from `options`, or `None` when dpsync answers UNAVAILABLE (CUDA replicas without
    /// a usable GPU; [`last_error`] says why).
    pub fn new_if_available(options: &Options) -> Option<Self> {
        let mut p = ptr::null_mut();
        // SAFETY: valid options and out pointer.
        let st = unsafe { dpsync_context_create(options.0, &mut p) };
        if st == dpsync_status::DPSYNC_STATUS_UNAVAILABLE {
            return None;
        }
        check(st, "dpsync_context_create");
        Some(Context(p))
    }

    /// `n` host replicas; fusion_bytes if given (library default otherwise).
    pub fn host(n: usize, fusion: Option<usize>) -> Self {
        let o = Options::host(n);
        if let Some(f) = fusion {
            o.set_fusion_bytes(f);
        }
        Self::new(&o)
    }

    pub fn replica_count(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_replica_count(self.0, &mut n) },
            "replica_count",
        );
        n
    }

    pub fn loss_scale(&self) -> f64 {
        let mut s = 0f64;
        // SAFETY: valid handle.
        check(unsafe { dpsync_loss_scale(self.0, &mut s) }, "loss_scale");
        s
    }

    pub fn register<T>(
        &self,
        name: &str,
        role: u32,
        replica: usize,
        data: &mut [T],
        dtype: u32,
    ) -> dpsync_status {
        register(self.0, name, role, replica, data, dtype)
    }

    /// Registers `data` and asserts success.
    #[track_caller]
    pub fn reg<T>(&self, name: &str, role: u32, replica: usize, data: &mut [T], dtype: u32) {
        let st = register(self.0, name, role, replica, data, dtype);
        check(st, &format!("register '{name}' on replica {replica}"));
    }

    pub fn unregister(&self, name: &str) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: valid handle and name.
        unsafe { dpsync_unregister(self.0, c.as_ptr()) }
    }

    pub fn allreduce_grads(&self, op: u32) -> dpsync_status {
        // SAFETY: valid handle.
        unsafe { dpsync_allreduce_grads(self.0, op) }
    }

    pub fn grad_ready(&self, name: &str, replica: usize) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: valid handle and name.
        unsafe { dpsync_grad_ready(self.0, c.as_ptr(), replica) }
    }

    pub fn allreduce(&self, name: &str, op: u32) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: valid handle and name.
        unsafe { dpsync_allreduce(self.0, c.as_ptr(), op) }
    }

    pub fn broadcast(&self, roles: u32, root: usize) -> dpsync_status {
        // SAFETY: valid handle.
        unsafe { dpsync_broadcast(self.0, roles, root) }
    }

    pub fn average(&self, roles: u32) -> dpsync_status {
        // SAFETY: valid handle.
        unsafe { dpsync_average(self.0, roles) }
    }

    pub fn bmuf_init(&self, block_lr: f64, block_momentum: f64, nesterov: bool) -> dpsync_status {
        // SAFETY: valid handle.
        unsafe { dpsync_bmuf_init(self.0, block_lr, block_momentum, nesterov) }
    }

    pub fn bmuf_step(&self) -> dpsync_status {
        // SAFETY: valid handle.
        unsafe { dpsync_bmuf_step(self.0) }
    }

    pub fn describe(&self) -> String {
        describe(self.0)
    }

    pub fn describe_json(&self) -> serde_json::Value {
        let s = self.describe();
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("describe is not JSON ({e}): {s}"))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we own the handle.
        let st = unsafe { dpsync_context_destroy(self.0) };
        if !std::thread::panicking() {
            assert_eq!(st, OK, "dpsync_context_destroy: {}", last_error());
        }
    }
}

/// Registers `data` (all of it) as `name` on `replica`.
pub fn register<T>(
    ctx: *mut dpsync_context,
    name: &str,
    role: u32,
    replica: usize,
    data: &mut [T],
    dtype: u32,
) -> dpsync_status {
    register_raw(
        ctx,
        name,
        role,
        replica,
        data.as_mut_ptr().cast(),
        data.len(),
        dtype,
    )
}

pub fn register_raw(
    ctx: *mut dpsync_context,
    name: &str,
    role: u32,
    replica: usize,
    data: *mut c_void,
    count: usize,
    dtype: u32,
) -> dpsync_status {
    let c = cstr(name);
    // SAFETY: the caller keeps `data` valid while registered.
    unsafe { dpsync_register(ctx, c.as_ptr(), role, replica, data, count, dtype) }
}

/// The full describe JSON of a context (panics on failure).
pub fn describe(ctx: *const dpsync_context) -> String {
    let mut len = 0usize;
    // SAFETY: sizing call.
    check(
        unsafe { dpsync_describe(ctx, ptr::null_mut(), 0, &mut len) },
        "describe(size)",
    );
    // The text may change between the calls (a world's early buckets move on the engine's
    // progress thread, and their counters with them): sized again until it fits.
    loop {
        let mut buf = vec![0u8; len + 1];
        let mut len2 = 0usize;
        // SAFETY: buffer of len + 1 bytes.
        check(
            unsafe { dpsync_describe(ctx, buf.as_mut_ptr().cast(), buf.len(), &mut len2) },
            "describe",
        );
        if len2 > len {
            len = len2;
            continue;
        }
        assert_eq!(buf[len2], 0, "describe must NUL-terminate");
        buf.truncate(len2);
        return String::from_utf8(buf).expect("describe output is UTF-8");
    }
}
