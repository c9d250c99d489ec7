//! The C enums' values as the tests pass them (`u32` for the fields the C API takes as integers),
//! and the sizes they use.
// One constant per value of the C enums: a binary names the few it passes, so in any one of
// them most of this table is unused.
#![allow(dead_code)]

use dpsync::*;

pub const OK: dpsync_status = dpsync_status::DPSYNC_STATUS_OK;
pub const INVALID_ARGUMENT: dpsync_status = dpsync_status::DPSYNC_STATUS_INVALID_ARGUMENT;
pub const NOT_FOUND: dpsync_status = dpsync_status::DPSYNC_STATUS_NOT_FOUND;
pub const CONFLICT: dpsync_status = dpsync_status::DPSYNC_STATUS_CONFLICT;
pub const INCONSISTENT: dpsync_status = dpsync_status::DPSYNC_STATUS_INCONSISTENT;
pub const UNAVAILABLE: dpsync_status = dpsync_status::DPSYNC_STATUS_UNAVAILABLE;
pub const INVALID_STATE: dpsync_status = dpsync_status::DPSYNC_STATUS_INVALID_STATE;
pub const TIMEOUT: dpsync_status = dpsync_status::DPSYNC_STATUS_TIMEOUT;

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
