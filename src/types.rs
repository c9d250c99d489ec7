//! Plain value types shared by every layer: element types, roles, reduce ops, transports and
//! devices. The C enums live in `ffi`; these are the checked Rust side of them.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    F16,
    Bf16,
    I32,
    I64,
}

impl DType {
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::Bf16,
        DType::I32,
        DType::I64,
    ];

    /// The C code (`DPSYNC_DTYPE_*`) of this type, or `None` for an unknown value.
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// This type's C code (`DPSYNC_DTYPE_*`).
    pub fn code(self) -> u32 {
        DType::ALL.iter().position(|&d| d == self).expect("in ALL") as u32
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Floating-point (f32, f64, f16, bf16), as opposed to the integer types.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::I64)
    }

    /// f16 or bf16: summed in f32 everywhere, rounded once.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::Bf16)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Role of a tensor. The C values are bit flags so that a mask can name several roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Param,
    Grad,
    Computed,
    State,
}

impl Role {
    pub(crate) const ALL_BITS: u32 = 0xF;

    /// Exactly one role bit; anything else is `None`.
    pub fn from_code(code: u32) -> Option<Role> {
        match code {
            1 => Some(Role::Param),
            2 => Some(Role::Grad),
            4 => Some(Role::Computed),
            8 => Some(Role::State),
            _ => None,
        }
    }

    pub fn bit(self) -> u32 {
        match self {
            Role::Param => 1,
            Role::Grad => 2,
            Role::Computed => 4,
            Role::State => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Param => "PARAM",
            Role::Grad => "GRAD",
            Role::Computed => "COMPUTED",
            Role::State => "STATE",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A non-empty set of roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoleMask(u32);

impl RoleMask {
    /// A mask with at least one role bit and no unknown bit.
    pub fn from_bits(bits: u32) -> Option<RoleMask> {
        (bits != 0 && bits & !Role::ALL_BITS == 0).then_some(RoleMask(bits))
    }

    pub fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    pub fn bits(self) -> u32 {
        self.0
    }
}

impl From<Role> for RoleMask {
    fn from(role: Role) -> Self {
        RoleMask(role.bit())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the total number of replicas in the world.
    Avg,
}

impl ReduceOp {
    pub fn from_code(code: u32) -> Option<ReduceOp> {
        match code {
            0 => Some(ReduceOp::Sum),
            1 => Some(ReduceOp::Avg),
            _ => None,
        }
    }
}

/// Transport requested in the options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Auto,
    Nccl,
    PeerCopy,
    Host,
}

impl Transport {
    pub fn from_code(code: u32) -> Option<Transport> {
        match code {
            0 => Some(Transport::Auto),
            1 => Some(Transport::Nccl),
            2 => Some(Transport::PeerCopy),
            3 => Some(Transport::Host),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Nccl => "nccl",
            Transport::PeerCopy => "peer_copy",
            Transport::Host => "host",
        }
    }
}

/// Where a replica's tensors live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Host,
    Cuda(i32),
}

/// Which memory a tensor's elements are in. A CUDA replica may hold host tensors (made by CPU
/// ops in a GPU model); they are found by pointer attributes and reduced on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Memory {
    Host,
    Device,
}

impl Memory {
    pub fn name(self) -> &'static str {
        match self {
            Memory::Host => "host",
            Memory::Device => "device",
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// World replica `w`'s piece of a tensor of `count` elements among `total` replicas (the
/// contract's rule, dpsync_shard.h): `(first element, elements)`, elements
/// `[count * w / total, count * (w + 1) / total)`.
pub fn piece(count: usize, w: usize, total: usize) -> (usize, usize) {
    let at = |w: usize| (count as u128 * w as u128 / total.max(1) as u128) as usize;
    (at(w), at(w + 1) - at(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_reject_unknown_values() {
        for (code, dtype) in DType::ALL.iter().enumerate() {
            assert_eq!(DType::from_code(code as u32), Some(*dtype));
        }
        assert_eq!(DType::from_code(6), None);
        assert_eq!(Role::from_code(3), None);
        assert_eq!(Role::from_code(0), None);
        assert_eq!(Role::from_code(8), Some(Role::State));
        assert!(RoleMask::from_bits(0).is_none());
        assert!(RoleMask::from_bits(0x10).is_none());
        let mask = RoleMask::from_bits(0b1001).unwrap();
        assert!(mask.contains(Role::Param) && mask.contains(Role::State));
        assert!(!mask.contains(Role::Grad));
        assert_eq!(ReduceOp::from_code(2), None);
        assert_eq!(Transport::from_code(4), None);
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    }
}
