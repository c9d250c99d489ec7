//! The plan: pure data computed from the options, the topology and the registry — which
//! transport runs, how each level of a collective moves data ([`Levels`], [`Route`]: built once
//! per context from the topology), which tensors share a fusion bucket ([`Plan`]: per registry
//! generation), and which reduction steps move which bytes between which replicas. No device is touched here, so the same plan is printed by
//! `dpsync_plan_describe` on any machine and executed by a live context.

mod buckets;
mod describe;
mod levels;
pub mod sparse;
mod steps;
mod topology;

pub use buckets::{plan_buckets, Bucket};
pub use describe::describe;
pub use levels::{group_of, Across, Levels, Route};
pub use steps::{device_groups, Step, StepOp, Via};
pub use topology::{Topology, TransportChoice, WorldGroups, WorldPlace};

use crate::registry::Snapshot;
use crate::types::Role;

/// Everything a collective needs to know about how to run, for one registry generation.
#[derive(Clone, Debug)]
pub struct Plan {
    pub generation: u64,
    /// GRAD tensors fused into buckets, last registered first. Indices refer to
    /// `Snapshot::tensors`.
    pub buckets: Vec<Bucket>,
}

impl Plan {
    pub fn new(snapshot: &Snapshot, fusion_bytes: usize) -> Plan {
        let grads = snapshot
            .tensors
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, t)| t.role == Role::Grad)
            .map(|(i, t)| (i, t.dtype, t.memory, t.count));
        Plan {
            generation: snapshot.generation,
            buckets: plan_buckets(grads, fusion_bytes),
        }
    }
}
