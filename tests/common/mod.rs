//! Safe helpers shared by the integration tests. Everything here drives dpsync only through its
//! C ABI (`use dpsync::*;`): RAII wrappers for options and contexts, registration of Rust slices,
//! the per-thread error message, describe output, typed host buffers for every dtype, a
//! deterministic LCG and f16/bf16 conversions written here (cross-checked against `half` in
//! tests/collectives.rs).
#![allow(dead_code)]

pub mod embedding;
pub mod gpu;

use dpsync::*;
use std::ffi::{c_void, CStr, CString};
use std::ptr;

pub const OK: dpsync_status = dpsync_status::DPSYNC_STATUS_OK;
pub const INVALID_ARGUMENT: dpsync_status = dpsync_status::DPSYNC_STATUS_INVALID_ARGUMENT;
pub const NOT_FOUND: dpsync_status = dpsync_status::DPSYNC_STATUS_NOT_FOUND;
pub const CONFLICT: dpsync_status = dpsync_status::DPSYNC_STATUS_CONFLICT;
pub const INCONSISTENT: dpsync_status = dpsync_status::DPSYNC_STATUS_INCONSISTENT;
pub const UNAVAILABLE: dpsync_status = dpsync_status::DPSYNC_STATUS_UNAVAILABLE;
pub const INVALID_STATE: dpsync_status = dpsync_status::DPSYNC_STATUS_INVALID_STATE;

pub const PARAM: u32 = dpsync_role::DPSYNC_ROLE_PARAM as u32;
pub const GRAD: u32 = dpsync_role::DPSYNC_ROLE_GRAD as u32;
pub const COMPUTED: u32 = dpsync_role::DPSYNC_ROLE_COMPUTED as u32;
pub const STATE: u32 = dpsync_role::DPSYNC_ROLE_STATE as u32;

pub const SUM: u32 = dpsync_reduce_op::DPSYNC_REDUCE_SUM as u32;
pub const AVG: u32 = dpsync_reduce_op::DPSYNC_REDUCE_AVG as u32;

pub const T_AUTO: u32 = dpsync_transport::DPSYNC_TRANSPORT_AUTO as u32;
pub const T_NCCL: u32 = dpsync_transport::DPSYNC_TRANSPORT_NCCL as u32;
pub const T_PEER_COPY: u32 = dpsync_transport::DPSYNC_TRANSPORT_PEER_COPY as u32;
pub const T_HOST: u32 = dpsync_transport::DPSYNC_TRANSPORT_HOST as u32;

pub const F32: u32 = dpsync_dtype::DPSYNC_DTYPE_F32 as u32;
pub const F64: u32 = dpsync_dtype::DPSYNC_DTYPE_F64 as u32;
pub const F16: u32 = dpsync_dtype::DPSYNC_DTYPE_F16 as u32;
pub const BF16: u32 = dpsync_dtype::DPSYNC_DTYPE_BF16 as u32;
pub const I32: u32 = dpsync_dtype::DPSYNC_DTYPE_I32 as u32;
pub const I64: u32 = dpsync_dtype::DPSYNC_DTYPE_I64 as u32;

pub const GIB: usize = 1 << 30;

/// Asserts `status` is OK, printing the thread's last error otherwise.
#[track_caller]
pub fn check(status: dpsync_status, what: &str) {
    assert_eq!(status, OK, "{what} failed: {}", last_error());
}

/// Asserts a failure: the exact status, and a last-error message containing every needle.
#[track_caller]
pub fn expect_err(status: dpsync_status, want: dpsync_status, needles: &[&str]) -> String {
    let msg = last_error();
    assert_eq!(
        status, want,
        "expected {want:?}, got {status:?} (last error: {msg:?})"
    );
    assert!(!msg.is_empty(), "a failed call must leave a message");
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} should name {n:?}");
    }
    msg
}

pub fn cstr(s: &str) -> CString {
    CString::new(s).expect("test names have no NUL")
}

/// Says on the test's real stderr why a test did not run its subject. `eprintln!` would be
/// captured by the test harness and shown only for failures, so a skipped GPU test would pass
/// silently; a write to the stderr handle is not captured.
pub fn skip(why: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{why}");
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

pub fn status_name(status: u32) -> String {
    // SAFETY: static string.
    unsafe {
        let p = dpsync_status_name(status);
        assert!(!p.is_null());
        CStr::from_ptr(p).to_str().unwrap().to_owned()
    }
}

/// Owned `dpsync_options`, freed on drop.
pub struct Options(pub *mut dpsync_options);

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

    /// Registers a typed buffer and asserts success.
    #[track_caller]
    pub fn reg_buf(&self, name: &str, role: u32, replica: usize, buf: &mut Buf) {
        let st = register_raw(
            self.0,
            name,
            role,
            replica,
            buf.ptr(),
            buf.len(),
            buf.dtype().code(),
        );
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
    let mut buf = vec![0u8; len + 1];
    let mut len2 = 0usize;
    // SAFETY: buffer of len + 1 bytes.
    check(
        unsafe { dpsync_describe(ctx, buf.as_mut_ptr().cast(), buf.len(), &mut len2) },
        "describe",
    );
    assert_eq!(len, len2, "describe length changed between calls");
    assert_eq!(buf[len], 0, "describe must NUL-terminate");
    buf.truncate(len);
    String::from_utf8(buf).expect("describe output is UTF-8")
}

// ------------------------------------------------------------------ deterministic data

/// 64-bit LCG (Knuth's MMIX constants); the high bits are used.
#[derive(Clone)]
pub struct Lcg(u64);

impl Lcg {
    pub fn new(seed: u64) -> Self {
        let mut l = Lcg(seed ^ 0x9E37_79B9_7F4A_7C15);
        l.next_u64();
        l
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = self.0;
        // xorshift the output so low bits are usable as well
        x ^ (x >> 29)
    }

    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A value with a wide spread of magnitudes (so that summation order matters).
    pub fn spread(&mut self) -> f64 {
        let m = self.uniform(-1.0, 1.0);
        let e = self.below(21) as i32 - 10;
        m * 2f64.powi(e)
    }
}

// ------------------------------------------------------------------ f16 / bf16

/// f32 -> IEEE binary16 bits, round to nearest even (subnormals, infinities, NaN).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        let nan = if man != 0 {
            0x200 | (man >> 13) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let mut r = m >> shift;
        let rem = m & ((1u32 << shift) - 1);
        let half = 1u32 << (shift - 1);
        if rem > half || (rem == half && (r & 1) == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && (r & 1) == 1) {
        r += 1;
    }
    sign | r as u16
}

/// IEEE binary16 bits -> f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    if exp == 0 {
        let v = man as f32 * 2f32.powi(-24);
        return if sign != 0 { -v } else { v };
    }
    if exp == 0x1f {
        return f32::from_bits(sign | 0x7f80_0000 | (man << 13));
    }
    f32::from_bits(sign | ((exp + 112) << 23) | (man << 13))
}

/// f32 -> bfloat16 bits, round to nearest even; NaN stays NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    (r >> 16) as u16
}

/// bfloat16 bits -> f32 (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

// ------------------------------------------------------------------ typed host buffers

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
}

impl DType {
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
    ];

    pub fn code(self) -> u32 {
        match self {
            DType::F32 => F32,
            DType::F64 => F64,
            DType::F16 => F16,
            DType::BF16 => BF16,
            DType::I32 => I32,
            DType::I64 => I64,
        }
    }

    /// The name describe uses.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

/// Element-wise sum of `vs` in replica order, divided by `divisor` when given.
fn sum_in_order<T>(vs: &[&Vec<T>], len: usize, divisor: Option<T>) -> Vec<T>
where
    T: Copy + std::ops::Add<Output = T> + std::ops::Div<Output = T>,
{
    (0..len)
        .map(|i| {
            let s = vs[1..].iter().fold(vs[0][i], |s, v| s + v[i]);
            divisor.map_or(s, |d| s / d)
        })
        .collect()
}

/// A host tensor of one dtype (f16/bf16 stored as raw bits).
#[derive(Clone, Debug, PartialEq)]
pub enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<u16>),
    BF16(Vec<u16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl Buf {
    pub fn zeros(dtype: DType, n: usize) -> Buf {
        match dtype {
            DType::F32 => Buf::F32(vec![0.0; n]),
            DType::F64 => Buf::F64(vec![0.0; n]),
            DType::F16 => Buf::F16(vec![0; n]),
            DType::BF16 => Buf::BF16(vec![0; n]),
            DType::I32 => Buf::I32(vec![0; n]),
            DType::I64 => Buf::I64(vec![0; n]),
        }
    }

    /// Deterministic contents that stress the reduction rules: wide magnitudes for floats (order
    /// matters), values near the f16 limit (a sum in f16 would overflow, one in f32 does not),
    /// full-range integers (sums overflow the type).
    pub fn random(dtype: DType, n: usize, seed: u64) -> Buf {
        let mut b = Buf::zeros(dtype, n);
        b.fill_random(seed);
        b
    }

    /// Overwrites the contents in place (the pointer stays the same).
    pub fn fill_random(&mut self, seed: u64) {
        let mut g = Lcg::new(seed);
        match self {
            Buf::F32(v) => v.iter_mut().for_each(|x| *x = (g.spread() * 8.0) as f32),
            Buf::F64(v) => v
                .iter_mut()
                .for_each(|x| *x = g.spread() * 8.0 + g.spread() * 1e-9),
            Buf::F16(v) => v.iter_mut().enumerate().for_each(|(i, x)| {
                let f = if i % 13 == 5 {
                    g.uniform(30000.0, 60000.0) * if g.below(2) == 0 { 1.0 } else { -1.0 }
                } else {
                    g.spread() * 4.0
                };
                *x = f32_to_f16(f as f32)
            }),
            Buf::BF16(v) => v
                .iter_mut()
                .for_each(|x| *x = f32_to_bf16((g.spread() * 100.0) as f32)),
            Buf::I32(v) => v.iter_mut().enumerate().for_each(|(i, x)| {
                *x = if i % 3 == 0 {
                    g.below(2001) as i32 - 1000
                } else {
                    g.next_u32() as i32
                }
            }),
            Buf::I64(v) => v.iter_mut().enumerate().for_each(|(i, x)| {
                *x = if i % 3 == 0 {
                    g.below(2001) as i64 - 1000
                } else {
                    g.next_u64() as i64
                }
            }),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::F64(_) => DType::F64,
            Buf::F16(_) => DType::F16,
            Buf::BF16(_) => DType::BF16,
            Buf::I32(_) => DType::I32,
            Buf::I64(_) => DType::I64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buf::F32(v) => v.len(),
            Buf::F64(v) => v.len(),
            Buf::F16(v) | Buf::BF16(v) => v.len(),
            Buf::I32(v) => v.len(),
            Buf::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ptr(&mut self) -> *mut c_void {
        match self {
            Buf::F32(v) => v.as_mut_ptr().cast(),
            Buf::F64(v) => v.as_mut_ptr().cast(),
            Buf::F16(v) | Buf::BF16(v) => v.as_mut_ptr().cast(),
            Buf::I32(v) => v.as_mut_ptr().cast(),
            Buf::I64(v) => v.as_mut_ptr().cast(),
        }
    }

    /// The raw bytes (native endianness).
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Buf::F32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::F64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::F16(v) | Buf::BF16(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::I32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Buf::I64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
        }
    }

    /// Copies `other`'s contents into self without reallocating (same dtype and length).
    pub fn copy_from(&mut self, other: &Buf) {
        match (self, other) {
            (Buf::F32(a), Buf::F32(b)) => a.copy_from_slice(b),
            (Buf::F64(a), Buf::F64(b)) => a.copy_from_slice(b),
            (Buf::F16(a), Buf::F16(b)) | (Buf::BF16(a), Buf::BF16(b)) => a.copy_from_slice(b),
            (Buf::I32(a), Buf::I32(b)) => a.copy_from_slice(b),
            (Buf::I64(a), Buf::I64(b)) => a.copy_from_slice(b),
            _ => panic!("copy_from between different dtypes"),
        }
    }
}

/// Widening and rounding conversions of a 16-bit float format.
type HalfConv = (fn(u16) -> f32, fn(f32) -> u16);

/// The reference allreduce of /tmp/spec/semantics.md: replicas summed in order
/// ((r0 + r1) + r2) + ...; f32 in f32, f64 in f64; f16/bf16 accumulated in f32, divided by N for
/// AVG, rounded once; i32 summed in i64 and i64 in i128, SUM wrapping to the type, AVG the wide
/// sum divided by N truncated toward zero.
pub fn reference_allreduce(inputs: &[&Buf], op: u32) -> Buf {
    let n = inputs.len();
    assert!(n >= 1);
    let len = inputs[0].len();
    let avg = op == AVG;
    macro_rules! collect {
        ($variant:ident) => {{
            let vs: Vec<_> = inputs
                .iter()
                .map(|b| match b {
                    Buf::$variant(v) => v,
                    _ => panic!("mixed dtypes"),
                })
                .collect();
            for v in &vs {
                assert_eq!(v.len(), len);
            }
            vs
        }};
    }
    match inputs[0].dtype() {
        DType::F32 => Buf::F32(sum_in_order(&collect!(F32), len, avg.then_some(n as f32))),
        DType::F64 => Buf::F64(sum_in_order(&collect!(F64), len, avg.then_some(n as f64))),
        DType::F16 | DType::BF16 => {
            let is_f16 = inputs[0].dtype() == DType::F16;
            let vs: Vec<&Vec<u16>> = inputs
                .iter()
                .map(|b| match b {
                    Buf::F16(v) | Buf::BF16(v) => v,
                    _ => panic!("mixed dtypes"),
                })
                .collect();
            let (to, from): HalfConv = if is_f16 {
                (f16_to_f32, f32_to_f16)
            } else {
                (bf16_to_f32, f32_to_bf16)
            };
            let out: Vec<u16> = (0..len)
                .map(|i| {
                    let mut s = to(vs[0][i]);
                    for v in &vs[1..] {
                        s += to(v[i]);
                    }
                    if avg {
                        s /= n as f32;
                    }
                    from(s)
                })
                .collect();
            if is_f16 {
                Buf::F16(out)
            } else {
                Buf::BF16(out)
            }
        }
        DType::I32 => {
            let vs = collect!(I32);
            Buf::I32(
                (0..len)
                    .map(|i| {
                        let s: i64 = vs.iter().map(|v| v[i] as i64).sum();
                        if avg {
                            (s / n as i64) as i32
                        } else {
                            s as i32
                        }
                    })
                    .collect(),
            )
        }
        DType::I64 => {
            let vs = collect!(I64);
            Buf::I64(
                (0..len)
                    .map(|i| {
                        let s: i128 = vs.iter().map(|v| v[i] as i128).sum();
                        if avg {
                            (s / n as i128) as i64
                        } else {
                            s as i64
                        }
                    })
                    .collect(),
            )
        }
    }
}

/// Asserts two buffers hold the same bytes, reporting the first differing element.
#[track_caller]
pub fn assert_same_bytes(got: &Buf, want: &Buf, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.len(), want.len(), "{what}: length");
    if got.bytes() != want.bytes() {
        let sz = got.dtype().size();
        let (gb, wb) = (got.bytes(), want.bytes());
        let i = (0..got.len())
            .find(|&i| gb[i * sz..(i + 1) * sz] != wb[i * sz..(i + 1) * sz])
            .unwrap();
        panic!(
            "{what}: element {i} of {} differs: got {}, want {}",
            got.len(),
            elem_str(got, i),
            elem_str(want, i)
        );
    }
}

pub fn elem_str(b: &Buf, i: usize) -> String {
    match b {
        Buf::F32(v) => format!("{:e} ({:#010x})", v[i], v[i].to_bits()),
        Buf::F64(v) => format!("{:e} ({:#018x})", v[i], v[i].to_bits()),
        Buf::F16(v) => format!("{} ({:#06x})", f16_to_f32(v[i]), v[i]),
        Buf::BF16(v) => format!("{} ({:#06x})", bf16_to_f32(v[i]), v[i]),
        Buf::I32(v) => v[i].to_string(),
        Buf::I64(v) => v[i].to_string(),
    }
}

/// Bytes of an f32 slice.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Element-wise |a - b| <= atol + rtol * |b|.
#[track_caller]
pub fn assert_allclose(a: &[f32], b: &[f32], rtol: f32, atol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{what}: element {i}: {x} vs {y} (rtol {rtol}, atol {atol})"
        );
    }
}

pub const TIMEOUT: dpsync_status = dpsync_status::DPSYNC_STATUS_TIMEOUT;

/// A context over CUDA `ordinals`, or `None` (after printing the skip line a GPU test owes its
/// reader) when this machine has no usable CUDA device.
pub fn cuda_context(test: &str, ordinals: &[i32], configure: impl Fn(&Options)) -> Option<Context> {
    let o = Options::new();
    o.set_cuda_replicas(ordinals);
    configure(&o);
    let mut p = ptr::null_mut();
    // SAFETY: valid options and out pointer.
    let st = unsafe { dpsync_context_create(o.0, &mut p) };
    if st == UNAVAILABLE {
        // On the GPU machine (scripts/gpu-check.sh) a missing NVRTC or NCCL must fail the run,
        // not turn every GPU test into a pass that tested nothing.
        if std::env::var("DPSYNC_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!(
                "{test}: DPSYNC_REQUIRE_GPU=1, but creating the CUDA context was UNAVAILABLE: {}",
                last_error()
            );
        }
        skip(format_args!(
            "{test}: skipped: no CUDA device ({})",
            last_error()
        ));
        return None;
    }
    check(st, "dpsync_context_create (CUDA)");
    Some(Context(p))
}

// ------------------------------------------------------------------ sparse gradients

impl Options {
    pub fn set_sparse_coalesce(&self, coalesce: bool) {
        // SAFETY: valid handle.
        check(
            unsafe { dpsync_options_set_sparse_coalesce(self.0, coalesce) },
            "set_sparse_coalesce",
        );
    }
}

/// The gathered slice of a sparse gradient on one replica, as `dpsync_sparse_get` returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseOut {
    pub indices: *const c_void,
    pub values: *const c_void,
    pub rows: usize,
}

impl SparseOut {
    /// A copy of the gathered indices (`T` = i32 or i64, as registered).
    pub fn indices<T: Copy>(&self) -> Vec<T> {
        if self.rows == 0 {
            return Vec::new();
        }
        // SAFETY: the library keeps `rows` indices at this address until the next step.
        unsafe { std::slice::from_raw_parts(self.indices.cast::<T>(), self.rows) }.to_vec()
    }

    /// A copy of the gathered values: `rows × row_len` elements of `T` (u16 for f16/bf16).
    pub fn values<T: Copy>(&self, row_len: usize) -> Vec<T> {
        if self.rows == 0 {
            return Vec::new();
        }
        // SAFETY: as for indices.
        unsafe { std::slice::from_raw_parts(self.values.cast::<T>(), self.rows * row_len) }.to_vec()
    }
}

impl Context {
    pub fn register_sparse(
        &self,
        name: &str,
        replica: usize,
        row_len: usize,
        value_dtype: u32,
        index_dtype: u32,
        num_embeddings: usize,
    ) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: valid handle and name.
        unsafe {
            dpsync_register_sparse(
                self.0,
                c.as_ptr(),
                replica,
                row_len,
                value_dtype,
                index_dtype,
                num_embeddings,
            )
        }
    }

    /// Registers a sparse gradient on every replica and asserts success.
    #[track_caller]
    pub fn reg_sparse_all(
        &self,
        name: &str,
        row_len: usize,
        value_dtype: u32,
        index_dtype: u32,
        num_embeddings: usize,
    ) {
        for r in 0..self.replica_count() {
            let st =
                self.register_sparse(name, r, row_len, value_dtype, index_dtype, num_embeddings);
            check(st, &format!("register_sparse '{name}' on replica {r}"));
        }
    }

    pub fn sparse_set_raw(
        &self,
        name: &str,
        replica: usize,
        indices: *const c_void,
        values: *const c_void,
        rows: usize,
    ) -> dpsync_status {
        let c = cstr(name);
        // SAFETY: the caller keeps the buffers valid until allreduce_grads returns.
        unsafe { dpsync_sparse_set(self.0, c.as_ptr(), replica, indices, values, rows) }
    }

    /// Sets `indices.len()` rows (NULL pointers when there are none).
    pub fn sparse_set<I, V>(
        &self,
        name: &str,
        replica: usize,
        indices: &[I],
        values: &[V],
    ) -> dpsync_status {
        let rows = indices.len();
        let (i, v) = if rows == 0 {
            (ptr::null(), ptr::null())
        } else {
            (indices.as_ptr().cast(), values.as_ptr().cast())
        };
        self.sparse_set_raw(name, replica, i, v, rows)
    }

    /// `dpsync_sparse_get`, or the failing status.
    pub fn sparse_get(&self, name: &str, replica: usize) -> Result<SparseOut, dpsync_status> {
        let c = cstr(name);
        let mut out = SparseOut {
            indices: ptr::null(),
            values: ptr::null(),
            rows: 0,
        };
        // SAFETY: valid handle, name and out pointers.
        let st = unsafe {
            dpsync_sparse_get(
                self.0,
                c.as_ptr(),
                replica,
                &mut out.indices,
                &mut out.values,
                &mut out.rows,
            )
        };
        if st == OK {
            Ok(out)
        } else {
            Err(st)
        }
    }

    /// `dpsync_sparse_get`, asserting success.
    #[track_caller]
    pub fn gathered(&self, name: &str, replica: usize) -> SparseOut {
        self.sparse_get(name, replica).unwrap_or_else(|st| {
            panic!(
                "sparse_get '{name}' on replica {replica}: {st:?}: {}",
                last_error()
            )
        })
    }
}
