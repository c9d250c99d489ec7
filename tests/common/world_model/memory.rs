//! Where the randomized tests keep their tensors and slices: host buffers, or device memory
//! of CUDA replicas ([`Where`], [`Store`]).

use super::*;

/// Where a run keeps its tensors and slices: host buffers (host replicas), or device memory of
/// CUDA replicas, local replica `k` on GPU `ordinals[k]` of `place`.
// Each binary makes one of them (tests/world_random.rs Host, world_random_cuda.rs Cuda).
#[allow(dead_code)]
pub enum Where {
    Host,
    Cuda(Place, Vec<i32>),
}

/// One tensor or slice on one local replica, where its run keeps it.
pub enum Store {
    Host(Buf),
    /// Device memory holding a buffer of this dtype (the bytes of [`Buf::bytes`]).
    Device(Mem, DType),
}

/// A buffer of `dt` holding `bytes` (native endianness).
pub fn buf_of(dt: DType, bytes: &[u8]) -> Buf {
    let mut b = Buf::zeros(dt, bytes.len() / dt.size());
    let n = b.len() * dt.size();
    // SAFETY: `b` holds `n` bytes, and `bytes` at least as many.
    unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr().cast::<u8>(), n) };
    b
}

impl Where {
    /// `b` on local replica `k`: as it is on the host; on a CUDA replica, a copy in its GPU's
    /// memory, except an empty buffer: its dangling address stays (a slice of no rows, whose
    /// pointers the library never reads, as an empty tensor's data pointer can be anything).
    pub fn put(&self, k: usize, b: Buf) -> Store {
        match self {
            Where::Cuda(place, ordinals) if !b.is_empty() => {
                Store::Device(place.mem_on(ordinals[k], &b.bytes()), b.dtype())
            }
            _ => Store::Host(b),
        }
    }

    /// A copy of `bytes` bytes of a library output at `ptr` on one of this rank's replicas.
    pub fn fetch(&self, ptr: *const c_void, bytes: usize) -> Vec<u8> {
        match self {
            _ if bytes == 0 => Vec::new(),
            // SAFETY: the library keeps its outputs valid until the next step.
            Where::Host => unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), bytes) }.to_vec(),
            Where::Cuda(..) => download(ptr as usize, bytes),
        }
    }

    pub fn cuda(&self) -> bool {
        matches!(self, Where::Cuda(..))
    }
}

impl Store {
    pub fn ptr(&mut self) -> *mut c_void {
        match self {
            Store::Host(b) => b.ptr(),
            Store::Device(m, _) => m.ptr() as *mut c_void,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Store::Host(b) => b.len(),
            Store::Device(m, dt) => m.len() / dt.size(),
        }
    }

    /// The elements as f64 (from the device: once the work queued on its replica's stream ran).
    pub fn vals(&self) -> Vec<f64> {
        match self {
            Store::Host(b) => vals_of(b),
            Store::Device(m, dt) => vals_of(&buf_of(*dt, &m.read())),
        }
    }

    /// Writes `vals` into the first elements, rounded to the dtype (as [`store`]).
    pub fn set(&mut self, vals: &[f64]) {
        match self {
            Store::Host(b) => store(b, vals),
            Store::Device(m, dt) => {
                let n = m.len() / dt.size();
                let mut b = match vals.len() < n {
                    true => buf_of(*dt, &m.read()),
                    false => Buf::zeros(*dt, n),
                };
                store(&mut b, vals);
                m.write(&b.bytes());
            }
        }
    }
}
