//! Deterministic pseudo-random data.

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
