//! The grouped collective transport of a backend whose groups are separate devices (NCCL: one
//! rank per group, every call of one collective launched in one group).

use crate::error::Result;
use crate::types::DType;

/// One move of a [`Collective::send_recv`] group: `bytes` at `src` on group `src_group` to `dst`
/// on group `dst_group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub src_group: usize,
    pub src: u64,
    pub dst_group: usize,
    pub dst: u64,
    pub bytes: usize,
}

/// One point-to-point half of a [`Collective::exchange`]: this process's group `group` sends
/// (`send`) or receives `bytes` at `at` to or from clique rank `peer`, which may be in another
/// process of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerOp {
    pub group: usize,
    pub peer: usize,
    pub send: bool,
    pub at: u64,
    pub bytes: usize,
}

/// One grouped call over every group at once (NCCL: a rank per group, launched in one group).
/// A failure may leave part of it queued: the backend fails the context before returning it.
///
/// The clique may span the ranks of a world ([`crate::backend::WorldCollective`]): its ranks
/// are then every process's groups in rank order (the plan's [`crate::plan::WorldGroups`]).
pub(crate) trait Collective {
    /// `buffers[g] := Σ buffers` for `count` elements of `dtype`, on every group.
    fn allreduce(&self, dtype: DType, count: usize, buffers: &[u64]) -> Result<()>;

    /// `buffers[g] := max over buffers`, element by element, of the exponent fields of
    /// `count` elements of an F32 bucket (a byte each: `ncclUint8`) or an F64 bucket (two
    /// bytes each, the bits of a positive normal half `0x400 + field`: `ncclFloat16`, since
    /// NCCL has no 16-bit integer; the max of such halves is the max of their bits).
    fn max_fields(&self, dtype: DType, count: usize, buffers: &[u64]) -> Result<()>;

    /// `buffers[g] := buffers[root]` for `count` elements of `dtype`.
    fn broadcast(&self, dtype: DType, count: usize, root: usize, buffers: &[u64]) -> Result<()>;

    /// Every move as a send and a receive, all in one group.
    fn send_recv(&self, moves: &[Move]) -> Result<()>;

    /// Every op as an `ncclSend` or `ncclRecv`, all in one group. NCCL pairs the k-th send
    /// from a to b with the k-th receive at b from a: every process issues them in one order.
    fn exchange(&self, ops: &[PeerOp]) -> Result<()>;

    /// In place: every `buffers[g]` holds one block of `count` elements of `dtype` per clique
    /// rank, in clique rank order; group g's own block (that of its clique rank) := the sum of
    /// that block over the clique (`ncclReduceScatter`, which sends a ring allreduce's first
    /// half). The other blocks are left undefined.
    fn reduce_scatter(&self, dtype: DType, count: usize, buffers: &[u64]) -> Result<()>;

    /// In place: every `buffers[g]` holds one block of `bytes` per clique rank; every block of
    /// every buffer := its clique rank's own block (`ncclAllGather`, a ring allreduce's second
    /// half).
    fn allgather(&self, bytes: usize, buffers: &[u64]) -> Result<()>;
}
