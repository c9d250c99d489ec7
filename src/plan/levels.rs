//! The levels of a dense collective: which replicas reduce together first, and how their
//! results meet. The executor walks them (reduce up, exchange across the top, spread down);
//! `describe` prints them, so what is printed is what runs.
//!
//! - Level 1, **replicas**: the replicas of one group (sharing a GPU, or all host replicas of
//!   the process) are summed on that device: in place when the group is the whole collective,
//!   else into the group's fusion buffer, with the result spread back into every member.
//! - Level 2, **devices**: the groups' fusion buffers are combined by one grouped collective
//!   (NCCL, one rank per group) or by the plan's sum and copy steps between group leaders.
//!
//! - Level 3, **ranks**: in a world of processes, each rank's local result (its replica 0's
//!   bucket) is summed across the ranks through MPI, then spread down as above.

use serde_json::{json, Value};

use super::steps::{allreduce_steps, device_groups, Step, StepOp, Via};
use super::topology::{Topology, TransportChoice, WorldGroups};

/// How the groups of one process combine their fusion buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Across {
    /// One group: level 1 is the whole collective, reduced in place.
    Nothing,
    /// One grouped collective over every group's fusion buffer (NCCL, a rank per group).
    Collective,
    /// Sums and copies between the group leaders' fusion buffers, in this order (peer reads,
    /// staged copies): the cross-device steps of the plan's program.
    Steps(Vec<Step>),
}

/// The levels of one context's dense collectives over memory of one kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Levels {
    /// Level 1: replicas by group, each in summation order (its first is the leader); groups
    /// in order of their first replica. Group `g` is the backend's group `g`.
    pub groups: Vec<Vec<usize>>,
    /// Level 2.
    pub across: Across,
    /// Level 3: replicas per rank of the world, in rank order (one entry outside a world:
    /// no level 3).
    pub ranks: Vec<usize>,
    /// How level 3 moves a bucket: `"mpi"` from host memory, `"mpi_staged"` from device memory
    /// through page-locked host memory, `"nccl"` as part of level 2's collective, which then
    /// spans every device group of the world.
    pub ranks_via: &'static str,
    /// With `"nccl"`: the world's groups, which name a broadcast's root in the clique.
    pub world: Option<WorldGroups>,
}

impl Levels {
    pub fn new(topology: &Topology) -> Levels {
        let groups = device_groups(topology);
        let program = allreduce_steps(topology);
        let across = if topology.world_nccl.is_some()
            || program.iter().any(|s| s.op == StepOp::NcclAllreduce)
        {
            Across::Collective
        } else if groups.len() > 1 {
            let group_of = group_of(&groups, topology.replicas());
            Across::Steps(
                (program.into_iter())
                    .filter(|s| s.via != Via::Local && group_of[s.src] != group_of[s.dst])
                    .collect(),
            )
        } else {
            Across::Nothing
        };
        debug_assert!(
            topology.transport != TransportChoice::Host || groups.len() <= 1,
            "host memory is one group"
        );
        Levels {
            groups,
            across,
            ranks: topology.replicas_per_rank.clone(),
            ranks_via: match (topology.transport, &topology.world_nccl) {
                (TransportChoice::Host, _) => "mpi",
                (_, Some(_)) => "nccl",
                _ => "mpi_staged",
            },
            world: topology.world_nccl.clone(),
        }
    }

    /// The group of every replica.
    pub fn group_of(&self) -> Vec<usize> {
        group_of(&self.groups, self.groups.iter().map(Vec::len).sum())
    }

    /// Whether level 1 is the whole collective (every bucket reduced in place).
    pub fn in_place(&self) -> bool {
        self.across == Across::Nothing && self.ranks.len() <= 1
    }

    /// The levels as `dpsync_describe` shows them.
    pub fn describe(&self) -> Value {
        let across = match &self.across {
            Across::Nothing => json!({"level": "devices", "via": "none"}),
            Across::Collective => json!({"level": "devices", "via": "nccl"}),
            Across::Steps(steps) => json!({"level": "devices", "via": "steps",
                                           "steps": steps.len()}),
        };
        let mut levels = vec![json!({"level": "replicas", "groups": self.groups}), across];
        if self.ranks.len() > 1 {
            let mut ranks = json!({"level": "ranks", "via": self.ranks_via,
                                   "ranks": self.ranks.len(), "replicas_per_rank": self.ranks});
            if let Some(world) = &self.world {
                // Levels 2 and 3 are one NCCL collective over every rank's device groups.
                ranks["nccl_ranks"] = world.total().into();
            }
            levels.push(ranks);
        }
        json!(levels)
    }
}

/// The group of each of `replicas` replicas, from the groups' members.
pub fn group_of(groups: &[Vec<usize>], replicas: usize) -> Vec<usize> {
    let mut of = vec![0; replicas];
    for (g, members) in groups.iter().enumerate() {
        members.iter().for_each(|&r| of[r] = g);
    }
    of
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;
    use crate::types::Transport;

    fn cuda(ordinals: &[i32], transport: Transport) -> Topology {
        let mut o = Options::default();
        o.set_cuda_replicas(ordinals).unwrap();
        o.transport = transport;
        Topology::from_options(&o).unwrap()
    }

    #[test]
    fn host_replicas_are_one_group_reduced_in_place() {
        let mut o = Options::default();
        o.set_host_replicas(3).unwrap();
        let levels = Levels::new(&Topology::from_options(&o).unwrap());
        assert_eq!(levels.groups, vec![vec![0, 1, 2]]);
        assert!(levels.in_place());
    }

    #[test]
    fn gpus_are_groups_joined_by_nccl_or_by_the_cross_device_steps() {
        let nccl = Levels::new(&cuda(&[0, 1, 0, 1], Transport::Nccl));
        assert_eq!(nccl.groups, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(nccl.across, Across::Collective);
        assert_eq!(nccl.group_of(), vec![0, 1, 0, 1]);

        let peer = Levels::new(&cuda(&[0, 1, 0, 1], Transport::PeerCopy));
        let Across::Steps(steps) = &peer.across else {
            panic!("{:?}", peer.across)
        };
        // Leader 1 summed into leader 0, the result copied back; no local step.
        let shape: Vec<(StepOp, usize, usize)> =
            steps.iter().map(|s| (s.op, s.src, s.dst)).collect();
        assert_eq!(shape, vec![(StepOp::Sum, 1, 0), (StepOp::Copy, 0, 1)]);

        let one_gpu = Levels::new(&cuda(&[0, 0], Transport::Nccl));
        assert!(
            one_gpu.in_place(),
            "one GPU: no NCCL launch, reduced in place"
        );
    }

    #[test]
    fn a_world_over_nccl_is_one_collective_over_every_ranks_groups() {
        // This rank: two replicas on one GPU (one group); the world: 2 ranks, 3 GPUs in all.
        let mut world = cuda(&[0, 0], Transport::Nccl);
        world.replicas_per_rank = vec![2, 2];
        world.world_nccl = Some(WorldGroups {
            group_of: vec![vec![0, 0], vec![0, 1]],
        });
        let levels = Levels::new(&world);
        assert_eq!(
            levels.across,
            Across::Collective,
            "one group, yet a collective"
        );
        assert_eq!(levels.ranks_via, "nccl");
        assert!(!levels.in_place());
        let w = levels.world.as_ref().unwrap();
        assert_eq!((w.first(0), w.first(1), w.total()), (0, 1, 3));
        assert_eq!(
            (w.nccl_rank(0, 1), w.nccl_rank(1, 0), w.nccl_rank(1, 1)),
            (0, 1, 2)
        );
        assert_eq!(levels.describe()[2]["nccl_ranks"], 3);
    }
}
