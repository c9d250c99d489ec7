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

/// How a collective crosses the levels above one process's groups. Decided once, from the
/// topology: the executor dispatches on it, `dpsync_describe` prints it (the ranks level's
/// `via`, the world's `cross_rank`). A new collective is one more operation over these routes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// One process: level 1, then level 2 as [`Across`] says.
    Local,
    /// Across ranks from host memory: level 1 in place, then local replica 0's bucket over the
    /// engine (MPI), spread back down.
    RanksFromHost,
    /// Across ranks from device memory: levels 1 and 2, then local replica 0's bucket staged
    /// through page-locked host memory to the engine, and back into every local replica.
    RanksStaged,
    /// Across ranks over one NCCL clique: level 2's collective spans every rank's device
    /// groups, which name a broadcast's root in it.
    RanksOverClique(WorldGroups),
}

impl Route {
    /// The name `dpsync_describe` shows: the ranks level's `via` and the world's `cross_rank`.
    pub fn name(&self) -> &'static str {
        match self {
            Route::Local => "local",
            Route::RanksFromHost => "mpi",
            Route::RanksStaged => "mpi_staged",
            Route::RanksOverClique(_) => "nccl",
        }
    }

    fn of(topology: &Topology) -> Route {
        match (topology.in_world, topology.transport, &topology.world_nccl) {
            (false, _, _) => Route::Local,
            (_, TransportChoice::Host, _) => Route::RanksFromHost,
            (_, _, Some(world)) => Route::RanksOverClique(world.clone()),
            _ => Route::RanksStaged,
        }
    }
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
    /// How the levels are crossed.
    pub route: Route,
    /// The whole reduction program of one allreduce in one process (describe's `steps`;
    /// level 2's steps are taken from it).
    pub program: Vec<Step>,
    /// Float sums go through the reproducible path (exec/repro.rs) whatever the route.
    pub reproducible: bool,
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
                (program.iter())
                    .filter(|s| s.via != Via::Local && group_of[s.src] != group_of[s.dst])
                    .copied()
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
            route: Route::of(topology),
            program,
            reproducible: topology.reproducible,
        }
    }

    /// The clique's groups where the route crosses the ranks over NCCL.
    pub fn clique(&self) -> Option<&WorldGroups> {
        match &self.route {
            Route::RanksOverClique(world) => Some(world),
            _ => None,
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
            let mut ranks = json!({"level": "ranks", "via": self.route.name(),
                                   "ranks": self.ranks.len(), "replicas_per_rank": self.ranks});
            if let Some(world) = self.clique() {
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
    use crate::plan::WorldPlace;
    use crate::types::Transport;

    fn cuda(ordinals: &[i32], transport: Transport) -> Topology {
        let mut o = Options::default();
        o.set_cuda_replicas(ordinals).unwrap();
        o.transport = transport;
        Topology::from_options(&o).unwrap()
    }

    /// Every class of topology: its route, and describe's levels and steps read from the same
    /// `Levels` value the executor dispatches on.
    #[test]
    fn every_topology_has_one_route_that_describe_shows() {
        let mut host = Options::default();
        host.set_host_replicas(2).unwrap();
        let host = Topology::from_options(&host).unwrap();
        let mut peer = cuda(&[0, 1], Transport::PeerCopy);
        peer.peer = vec![1; 4];
        let place = |nccl: Option<WorldGroups>| WorldPlace {
            rank: 1,
            size: 2,
            replicas_per_rank: vec![1, 2],
            nccl,
        };
        let clique = WorldGroups {
            group_of: vec![vec![0], vec![0, 1]],
        };
        let classes = [
            ("host", host.clone(), Route::Local),
            ("one GPU", cuda(&[0, 0], Transport::Nccl), Route::Local),
            ("GPUs with peer access", peer, Route::Local),
            (
                "GPUs without",
                cuda(&[0, 1], Transport::PeerCopy),
                Route::Local,
            ),
            ("NCCL", cuda(&[0, 1], Transport::Nccl), Route::Local),
            (
                "world, host",
                host.in_world(place(None)),
                Route::RanksFromHost,
            ),
            (
                "world, staged",
                cuda(&[0, 1], Transport::PeerCopy).in_world(place(None)),
                Route::RanksStaged,
            ),
            (
                "world, NCCL",
                cuda(&[0, 1], Transport::Nccl).in_world(place(Some(clique.clone()))),
                Route::RanksOverClique(clique),
            ),
        ];
        let snapshot = crate::registry::Registry::new(2).snapshot();
        for (class, topology, route) in classes {
            let levels = Levels::new(&topology);
            assert_eq!(levels.route, route, "{class}");
            let plan = crate::plan::Plan::new(&snapshot, 1 << 20);
            let json = crate::plan::describe(&topology, &levels, &plan, &snapshot, 1 << 20);
            assert_eq!(json["levels"], levels.describe(), "{class}");
            assert_eq!(
                json["steps"].as_array().map(Vec::len),
                Some(levels.program.len()),
                "{class}"
            );
            let ranks = json["levels"].as_array().unwrap().get(2).cloned();
            match route {
                Route::Local => assert_eq!(ranks, None, "{class}"),
                _ => assert_eq!(ranks.unwrap()["via"], levels.route.name(), "{class}"),
            }
        }
    }

    #[test]
    fn host_replicas_are_one_group_reduced_in_place() {
        let mut o = Options::default();
        o.set_host_replicas(3).unwrap();
        let levels = Levels::new(&Topology::from_options(&o).unwrap());
        assert_eq!(levels.groups, vec![vec![0, 1, 2]]);
        assert!(levels.in_place());
    }

    /// Host-memory tensors of CUDA replicas on several GPUs (one NCCL rank per replica too):
    /// one group of every replica, reduced together on the host, in one process and across
    /// the ranks of a world.
    #[test]
    fn host_memory_of_cuda_replicas_is_one_group_whatever_their_gpus() {
        let mut per_replica = Options::default();
        per_replica.set_cuda_replicas(&[0, 1, 0]).unwrap();
        per_replica.transport = Transport::Nccl;
        per_replica.nccl_rank_per_replica = true;
        let place = WorldPlace {
            rank: 1,
            size: 3,
            replicas_per_rank: vec![1, 2, 1],
            nccl: None,
        };
        for (class, topology) in [
            ("peer copy", cuda(&[0, 1, 0], Transport::PeerCopy)),
            ("NCCL", cuda(&[0, 1, 0], Transport::Nccl)),
            (
                "rank per replica",
                Topology::from_options(&per_replica).unwrap(),
            ),
            (
                "world, staged",
                cuda(&[0, 1], Transport::PeerCopy).in_world(place),
            ),
        ] {
            let levels = Levels::new(&topology.for_host_memory());
            let all: Vec<usize> = (0..topology.replicas()).collect();
            assert_eq!(levels.groups, vec![all], "{class}");
            assert_eq!(levels.across, Across::Nothing, "{class}");
            let route = match topology.in_world {
                true => Route::RanksFromHost,
                false => Route::Local,
            };
            assert_eq!(levels.route, route, "{class}");
        }
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
        let world = cuda(&[0, 0], Transport::Nccl).in_world(WorldPlace {
            rank: 0,
            size: 2,
            replicas_per_rank: vec![2, 2],
            nccl: Some(WorldGroups {
                group_of: vec![vec![0, 0], vec![0, 1]],
            }),
        });
        let levels = Levels::new(&world);
        assert_eq!(
            levels.across,
            Across::Collective,
            "one group, yet a collective"
        );
        assert_eq!(levels.route.name(), "nccl");
        assert!(!levels.in_place());
        let w = levels.clique().unwrap();
        assert_eq!((w.first(0), w.first(1), w.total()), (0, 1, 3));
        assert_eq!(
            (w.nccl_rank(0, 1), w.nccl_rank(1, 0), w.nccl_rank(1, 1)),
            (0, 1, 2)
        );
        assert_eq!(levels.describe()[2]["nccl_ranks"], 3);
    }
}
