//! Reduction programs: the sums and copies one allreduce makes, between which replicas, over
//! which path, in which round (steps of one round are independent of each other).

use super::topology::{Topology, TransportChoice};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOp {
    /// `dst += src`.
    Sum,
    /// `dst = src`.
    Copy,
    /// One NCCL rank (the replica `src == dst`) joins the allreduce across ranks.
    NcclAllreduce,
}

impl StepOp {
    pub fn name(self) -> &'static str {
        match self {
            StepOp::Sum => "sum",
            StepOp::Copy => "copy",
            StepOp::NcclAllreduce => "nccl_allreduce",
        }
    }
}

/// How a step reaches the source's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// Host memory, read by host threads.
    Host,
    /// Both replicas on one device.
    Local,
    /// A direct read of the peer's memory (both directions have peer access).
    Peer,
    /// Copied onto the summing device first: the pair has no peer access.
    Staged,
    /// Through an NCCL communicator.
    Nccl,
}

impl Via {
    pub fn name(self) -> &'static str {
        match self {
            Via::Host => "host",
            Via::Local => "local",
            Via::Peer => "peer",
            Via::Staged => "staged",
            Via::Nccl => "nccl",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub op: StepOp,
    pub src: usize,
    pub dst: usize,
    pub via: Via,
    pub round: usize,
    /// The NCCL rank of an `NcclAllreduce` step.
    pub rank: Option<usize>,
}

/// The allreduce program for `topology`: every replica ends with the sum, computed in the order
/// the `Sum` steps list (so the bytes are the same run after run).
pub fn allreduce_steps(topology: &Topology) -> Vec<Step> {
    if topology.replicas() <= 1 {
        return Vec::new();
    }
    let mut b = Builder {
        topology,
        steps: Vec::new(),
    };
    if topology.transport == TransportChoice::Host {
        let all: Vec<usize> = (0..topology.replicas()).collect();
        b.flat_sum(&all, 0);
        b.flat_copy(&all, all.len() - 1);
        return b.steps;
    }
    // GPU transports: replicas sharing a GPU are summed there first; one leader per GPU.
    let groups = device_groups(topology);
    let leaders: Vec<usize> = groups.iter().map(|g| g[0]).collect();
    let local_rounds = groups.iter().map(|g| g.len() - 1).max().unwrap_or(0);
    for group in &groups {
        b.flat_sum(group, 0);
    }
    let mut round = local_rounds;
    // One GPU: the local sums are the whole reduction within the process (a one-rank NCCL
    // allreduce would be a no-op launch). The ranks of a world are level 3 (through host
    // memory and MPI), not NCCL ranks here.
    let ranks = leaders.len();
    if topology.transport == TransportChoice::Nccl && ranks > 1 {
        for (rank, &leader) in leaders.iter().enumerate() {
            b.push(
                StepOp::NcclAllreduce,
                leader,
                leader,
                Via::Nccl,
                round,
                Some(rank),
            );
        }
        round += 1;
    } else if leaders.len() > 1 {
        round = if leaders.len().is_power_of_two() {
            b.tree_sum(&leaders, round)
        } else {
            b.flat_sum(&leaders, round)
        };
        round = if leaders.len().is_power_of_two() {
            b.tree_copy(&leaders, round)
        } else {
            b.flat_copy(&leaders, round)
        };
    }
    for group in &groups {
        b.flat_copy(group, round);
    }
    b.steps
}

/// Replicas grouped by device, groups in order of their first replica (one replica per group
/// when every replica is its own NCCL rank). Host memory is one group whatever the devices: the
/// host-memory tensors of CUDA replicas ([`Topology::for_host_memory`]) keep their replicas'
/// GPUs, yet are reduced together on the host (one group per GPU there would leave all but
/// each GPU's first replica out of the sums, there being no links between host groups).
pub fn device_groups(topology: &Topology) -> Vec<Vec<usize>> {
    if topology.transport == TransportChoice::Host {
        return vec![(0..topology.replicas()).collect()];
    }
    if topology.rank_per_replica {
        return (0..topology.replicas()).map(|r| vec![r]).collect();
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (replica, device) in topology.devices.iter().enumerate() {
        match groups
            .iter_mut()
            .find(|g| topology.devices[g[0]] == *device)
        {
            Some(g) => g.push(replica),
            None => groups.push(vec![replica]),
        }
    }
    groups
}

struct Builder<'a> {
    topology: &'a Topology,
    steps: Vec<Step>,
}

impl Builder<'_> {
    fn via(&self, src: usize, dst: usize) -> Via {
        let t = self.topology;
        if t.transport == TransportChoice::Host {
            Via::Host
        } else if t.devices[src] == t.devices[dst] {
            Via::Local
        } else if t.mutual_access(src, dst) {
            Via::Peer
        } else {
            Via::Staged
        }
    }

    fn push(
        &mut self,
        op: StepOp,
        src: usize,
        dst: usize,
        via: Via,
        round: usize,
        rank: Option<usize>,
    ) {
        self.steps.push(Step {
            op,
            src,
            dst,
            via,
            round,
            rank,
        });
    }

    fn pair(&mut self, op: StepOp, src: usize, dst: usize, round: usize) {
        let via = self.via(src, dst);
        self.push(op, src, dst, via, round, None);
    }

    /// `members[1..]` summed one after another into `members[0]`; returns the next free round.
    fn flat_sum(&mut self, members: &[usize], first_round: usize) -> usize {
        for (k, &src) in members.iter().enumerate().skip(1) {
            self.pair(StepOp::Sum, src, members[0], first_round + k - 1);
        }
        first_round + members.len().saturating_sub(1)
    }

    /// `members[0]` copied to all others in one round.
    fn flat_copy(&mut self, members: &[usize], round: usize) -> usize {
        for &dst in &members[1..] {
            self.pair(StepOp::Copy, members[0], dst, round);
        }
        round + usize::from(members.len() > 1)
    }

    /// Caffe2's pairwise tree, e.g. 8: (0,1)(2,3)(4,5)(6,7) → (0,2)(4,6) → (0,4).
    fn tree_sum(&mut self, members: &[usize], mut round: usize) -> usize {
        let mut stride = 1;
        while stride < members.len() {
            for i in (0..members.len()).step_by(2 * stride) {
                self.pair(StepOp::Sum, members[i + stride], members[i], round);
            }
            stride *= 2;
            round += 1;
        }
        round
    }

    /// The tree in reverse: (0→4) → (0→2)(4→6) → (0→1)(2→3)(4→5)(6→7).
    fn tree_copy(&mut self, members: &[usize], mut round: usize) -> usize {
        let mut stride = members.len() / 2;
        while stride >= 1 {
            for i in (0..members.len()).step_by(2 * stride) {
                self.pair(StepOp::Copy, members[i], members[i + stride], round);
            }
            stride /= 2;
            round += 1;
        }
        round
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;
    use crate::types::Transport;

    fn cuda(ordinals: &[i32], transport: Transport, peer: Option<&[u8]>) -> Topology {
        let mut o = Options::default();
        o.set_cuda_replicas(ordinals).unwrap();
        o.transport = transport;
        if let Some(m) = peer {
            o.set_peer_access(m, ordinals.len()).unwrap();
        }
        Topology::from_options(&o).unwrap()
    }

    #[test]
    fn rank_per_replica_gives_shared_gpus_one_nccl_rank_each_with_nccl_only() {
        for transport in [Transport::Nccl, Transport::Auto, Transport::PeerCopy] {
            let mut o = Options::default();
            o.set_cuda_replicas(&[0, 0, 1]).unwrap();
            o.transport = transport;
            o.nccl_rank_per_replica = true;
            let t = Topology::from_options(&o).unwrap();
            let steps = allreduce_steps(&t);
            let ranks: Vec<usize> = steps
                .iter()
                .filter(|s| s.op == StepOp::NcclAllreduce)
                .map(|s| s.src)
                .collect();
            if transport == Transport::Nccl {
                assert_eq!(device_groups(&t), vec![vec![0], vec![1], vec![2]]);
                assert_eq!(ranks, vec![0, 1, 2], "one rank per replica");
                assert!(steps.iter().all(|s| s.op == StepOp::NcclAllreduce));
                assert!(t.transport_reason.contains("DPSYNC_NCCL_RANK_PER_REPLICA"));
            } else {
                // AUTO may fall back to peer copies, which cannot use it: ignored there.
                assert_eq!(
                    device_groups(&t),
                    vec![vec![0, 1], vec![2]],
                    "{transport:?}"
                );
            }
            simulate(&steps, 3);
        }
    }

    fn sums_by_round(steps: &[Step]) -> Vec<Vec<(usize, usize)>> {
        let mut rounds: Vec<Vec<(usize, usize)>> = Vec::new();
        for s in steps.iter().filter(|s| s.op == StepOp::Sum) {
            let first = steps.iter().map(|s| s.round).min().unwrap();
            let r = s.round - first;
            if rounds.len() <= r {
                rounds.resize(r + 1, Vec::new());
            }
            rounds[r].push((s.src, s.dst));
        }
        rounds
    }

    /// Simulates the program on per-replica sets of contributions: every replica must end with
    /// every contribution exactly once, and a round must only read values final before it.
    fn simulate(steps: &[Step], n: usize) {
        let mut have: Vec<Vec<usize>> = (0..n).map(|i| vec![i]).collect();
        let max_round = steps.iter().map(|s| s.round).max().unwrap_or(0);
        for round in 0..=max_round {
            let before = have.clone();
            for s in steps.iter().filter(|s| s.round == round) {
                match s.op {
                    StepOp::Sum => {
                        let add = before[s.src].clone();
                        have[s.dst].extend(add);
                    }
                    StepOp::Copy => have[s.dst] = before[s.src].clone(),
                    StepOp::NcclAllreduce => {}
                }
            }
            // NCCL steps of one round reduce across all their ranks at once.
            let ranks: Vec<usize> = steps
                .iter()
                .filter(|s| s.round == round && s.op == StepOp::NcclAllreduce)
                .map(|s| s.src)
                .collect();
            if !ranks.is_empty() {
                let total: Vec<usize> = ranks.iter().flat_map(|&r| before[r].clone()).collect();
                for &r in &ranks {
                    have[r] = total.clone();
                }
            }
        }
        for (replica, got) in have.iter_mut().enumerate() {
            got.sort_unstable();
            assert_eq!(*got, (0..n).collect::<Vec<_>>(), "replica {replica}");
        }
    }

    #[test]
    fn caffe2_pairwise_trees_for_4_8_16() {
        let t = cuda(
            &[0, 1, 2, 3, 4, 5, 6, 7],
            Transport::PeerCopy,
            Some(&[1; 64]),
        );
        let steps = allreduce_steps(&t);
        assert_eq!(
            sums_by_round(&steps),
            vec![
                vec![(1, 0), (3, 2), (5, 4), (7, 6)],
                vec![(2, 0), (6, 4)],
                vec![(4, 0)]
            ]
        );
        assert!(steps.iter().all(|s| s.via == Via::Peer));
        simulate(&steps, 8);
        let t = cuda(&[0, 1, 2, 3], Transport::PeerCopy, Some(&[1; 16]));
        let steps = allreduce_steps(&t);
        assert_eq!(
            sums_by_round(&steps),
            vec![vec![(1, 0), (3, 2)], vec![(2, 0)]]
        );
        simulate(&steps, 4);
        let ordinals: Vec<i32> = (0..16).collect();
        let steps = allreduce_steps(&cuda(&ordinals, Transport::PeerCopy, None));
        assert_eq!(sums_by_round(&steps).len(), 4);
        simulate(&steps, 16);
    }

    #[test]
    fn other_counts_sum_flat_on_the_first() {
        let steps = allreduce_steps(&cuda(&[0, 1, 2], Transport::PeerCopy, None));
        assert_eq!(sums_by_round(&steps), vec![vec![(1, 0)], vec![(2, 0)]]);
        simulate(&steps, 3);
    }

    #[test]
    fn caffe2_seed_topology_reads_directly_only_between_1_and_2() {
        // GPU0 a Pascal card, GPU1 and GPU2 a Kepler pair: only 1<->2 have peer access.
        let full = [1u8, 0, 0, 0, 1, 1, 0, 1, 1];
        for devices in [vec![0, 1], vec![0, 2], vec![1, 2], vec![0, 1, 2]] {
            let n = devices.len();
            let mut m = vec![0u8; n * n];
            for i in 0..n {
                for j in 0..n {
                    m[i * n + j] = full[devices[i] as usize * 3 + devices[j] as usize];
                }
            }
            let t = cuda(&devices, Transport::PeerCopy, Some(&m));
            let steps = allreduce_steps(&t);
            simulate(&steps, n);
            for s in &steps {
                let pair = (devices[s.src], devices[s.dst]);
                let direct = matches!(pair, (1, 2) | (2, 1));
                assert_eq!(s.via == Via::Peer, direct, "{devices:?} {s:?}");
                if !direct {
                    assert_eq!(s.via, Via::Staged, "{devices:?} {s:?}");
                }
            }
        }
    }

    #[test]
    fn shared_gpus_sum_locally_then_one_nccl_rank_per_gpu() {
        let steps = allreduce_steps(&cuda(&[0, 0, 1, 1, 1], Transport::Nccl, None));
        simulate(&steps, 5);
        let nccl: Vec<_> = steps
            .iter()
            .filter(|s| s.op == StepOp::NcclAllreduce)
            .map(|s| (s.src, s.rank))
            .collect();
        assert_eq!(nccl, vec![(0, Some(0)), (2, Some(1))]);
        assert!(steps
            .iter()
            .filter(|s| s.op != StepOp::NcclAllreduce)
            .all(|s| s.via == Via::Local));
        let steps = allreduce_steps(&cuda(&[0, 0, 1, 1], Transport::PeerCopy, None));
        simulate(&steps, 4);
        assert!(steps.iter().any(|s| s.via == Via::Staged));
    }

    #[test]
    fn host_program_sums_in_replica_order_then_copies() {
        let mut o = Options::default();
        o.set_host_replicas(3).unwrap();
        let steps = allreduce_steps(&Topology::from_options(&o).unwrap());
        let ops: Vec<_> = steps.iter().map(|s| (s.op, s.src, s.dst)).collect();
        assert_eq!(
            ops,
            vec![
                (StepOp::Sum, 1, 0),
                (StepOp::Sum, 2, 0),
                (StepOp::Copy, 0, 1),
                (StepOp::Copy, 0, 2)
            ]
        );
        assert!(steps.iter().all(|s| s.via == Via::Host));
        simulate(&steps, 3);
        o.set_host_replicas(1).unwrap();
        assert!(allreduce_steps(&Topology::from_options(&o).unwrap()).is_empty());
    }
}
