//! Shards (ZeRO stage 1) seen from the context: which piece of a tensor a replica owns,
//! `dpsync_reduce_scatter_grads` (a gradient step whose dense buckets write only the owned
//! pieces; the rest of the step is `allreduce_grads`') and `dpsync_allgather`.

use serde_json::json;

use super::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::shard::{piece, Place};
use crate::registry::TensorView;
use crate::timeline;
use crate::types::{ReduceOp, RoleMask};

/// What a gradient step's dense buckets write on each replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    /// Every element (`dpsync_allreduce_grads`).
    Allreduce,
    /// The replica's own pieces (`dpsync_reduce_scatter_grads`).
    ReduceScatter,
}

impl Shape {
    /// The C call, as the agreement and the timeline name it.
    pub(super) fn call(self) -> &'static str {
        match self {
            Shape::Allreduce => "dpsync_allreduce_grads",
            Shape::ReduceScatter => "dpsync_reduce_scatter_grads",
        }
    }
}

impl Context {
    /// Where this process's replicas stand among the world's.
    pub(super) fn place(&self) -> Place {
        Place {
            offset: self.topology.world_offset(),
            total: self.topology.world_replicas(),
        }
    }

    /// `(offset, count)` of the piece of tensor `name` that local replica `replica` owns.
    pub fn shard(&mut self, name: &str, replica: usize) -> Result<(usize, usize)> {
        self.check_replica_of("tensor", name, replica)?;
        let (snapshot, _) = self.prepare();
        let count = match snapshot.lookup(name) {
            Ok(t) => t.count,
            Err(e) if e.kind == ErrorKind::NotFound && self.sparse.contains(name) => {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "tensor '{name}' is a sparse gradient: it is gathered whole, not \
                         sharded; dpsync_shard takes dense tensors"
                    ),
                ))
            }
            Err(e) => return Err(e),
        };
        let place = self.place();
        Ok(piece(count, place.offset + replica, place.total))
    }

    pub fn reduce_scatter_grads(&mut self, op: ReduceOp) -> Result<()> {
        self.reduce_grads(op, Shape::ReduceScatter)
    }

    /// Buckets `dpsync_grad_ready` reduced this step took the previous step's shape, as they
    /// take its op. Reduce-scattered ones serve an allreduce step too (it gathers their pieces,
    /// [`Context::early_scattered`]), and in a world started ones serve either
    /// ([`Executor::early_serves_either`]); but whole ones would have written
    /// outside the owned pieces, so a reduce-scatter after them is refused, as AVG after SUM
    /// buckets is.
    ///
    /// [`Executor::early_serves_either`]: crate::exec::Executor::early_serves_either
    pub(super) fn check_shape(&self, shape: Shape) -> Result<()> {
        let early = self.early_buckets();
        let serves = self.overlap_scatters() || self.executor.early_serves_either();
        if shape == Shape::Allreduce || early == 0 || serves {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::InvalidState,
            format!(
                "dpsync_grad_ready already reduced {early} bucket(s) of this step whole, as the \
                 previous step's dpsync_allreduce_grads did; finish this step with \
                 dpsync_allreduce_grads (early buckets take the previous step's shape, as they \
                 take its op)"
            ),
        ))
    }

    /// Every replica's copy of `tensors` := the owners' pieces.
    pub(super) fn gather_pieces(&self, tensors: &[&TensorView]) -> Result<()> {
        let topology = &self.topology;
        // SAFETY: registered memory stays valid while registered (the C contract).
        unsafe {
            self.executor.allgather(
                tensors,
                self.place(),
                |w| topology.locate(w),
                self.options.fusion_bytes,
            )
        }
    }

    /// Every replica's copy of the tensors whose role is in `roles` := the owners' pieces.
    pub fn allgather(&mut self, roles: RoleMask) -> Result<()> {
        let _call = timeline::span(
            self.trace.as_ref(),
            "dpsync_allgather",
            || json!({"roles": roles.bits()}),
        );
        let (snapshot, _) = self.prepare();
        let selected = snapshot.select(roles);
        self.agree(
            &selected,
            || format!("dpsync_allgather(roles={:#x})", roles.bits()),
            selected.as_deref().unwrap_or_default(),
        )?;
        let tensors: Vec<&TensorView> = selected?;
        self.gather_pieces(&tensors)
    }
}
