//! The replicas' devices, who can read whose memory, and the transport that follows.

use crate::error::Result;
use crate::options::Options;
use crate::types::{Device, Transport};

/// The transport a plan runs on (AUTO resolved).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    Host,
    Nccl,
    PeerCopy,
}

impl TransportChoice {
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Host => "host",
            TransportChoice::Nccl => "nccl",
            TransportChoice::PeerCopy => "peer_copy",
        }
    }
}

/// Where the peer-access matrix came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerSource {
    /// Host replicas share one address space.
    Host,
    /// `dpsync_options_set_peer_access`.
    Override,
    /// Queried from the driver by a live context.
    Detected,
    /// A dry run without an override: no device was asked, so no pair of distinct GPUs is
    /// assumed to have access (the plan that is correct on every machine).
    Assumed,
}

impl PeerSource {
    pub fn name(self) -> &'static str {
        match self {
            PeerSource::Host => "host",
            PeerSource::Override => "override",
            PeerSource::Detected => "detected",
            PeerSource::Assumed => "assumed",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    pub devices: Vec<Device>,
    /// Row-major n x n, n = replicas; `peer[i * n + j] == 1`: replica i's device reads j's memory.
    pub peer: Vec<u8>,
    pub peer_source: PeerSource,
    /// A live context's detected matrix when an override replaced it (`None` otherwise: then
    /// `peer` is the detected one, or there was nothing to detect).
    pub peer_detected: Option<Vec<u8>>,
    pub transport: TransportChoice,
    pub transport_reason: String,
    /// This process's rank and the number of processes (0 and 1 outside a world).
    pub rank: usize,
    pub world_size: usize,
    /// Local replicas of every rank, in rank order (outside a world: this process's count).
    pub replicas_per_rank: Vec<usize>,
    /// One NCCL rank per replica, not per distinct GPU (`Options::nccl_rank_per_replica`,
    /// honoured with transport NCCL only).
    pub rank_per_replica: bool,
    /// In a world of CUDA replicas: NCCL across the ranks (one NCCL rank per device group of
    /// every rank), where every rank could join it; `None`: staged through MPI, or no world.
    pub world_nccl: Option<WorldGroups>,
    /// In a world of processes (of one rank, too): collectives go through its engine.
    pub in_world: bool,
    /// Float sums reproducible whatever the arrangement (`Options::reproducible`).
    pub reproducible: bool,
}

/// Where a process stands in its world, as the ranks settled it ([`Topology::in_world`]).
pub struct WorldPlace {
    pub rank: usize,
    pub size: usize,
    /// Local replicas of every rank, in rank order.
    pub replicas_per_rank: Vec<usize>,
    /// NCCL across the ranks, where every rank joined it.
    pub nccl: Option<WorldGroups>,
}

/// The device groups of every rank of a world, as the ranks of one NCCL clique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldGroups {
    /// Per rank: the device group of each of its local replicas (groups numbered from 0).
    pub group_of: Vec<Vec<usize>>,
}

impl WorldGroups {
    /// Per rank: its device groups (its NCCL ranks).
    fn groups(&self, rank: usize) -> usize {
        self.group_of[rank].iter().max().map_or(0, |&g| g + 1)
    }

    /// The NCCL rank of rank `rank`'s first group.
    pub fn first(&self, rank: usize) -> usize {
        (0..rank).map(|r| self.groups(r)).sum()
    }

    /// The NCCL ranks of rank `rank`.
    pub fn ranks_of(&self, rank: usize) -> std::ops::Range<usize> {
        self.first(rank)..self.first(rank) + self.groups(rank)
    }

    /// NCCL ranks in the whole clique.
    pub fn total(&self) -> usize {
        self.first(self.group_of.len())
    }

    /// The NCCL rank of local replica `local` of rank `rank`.
    pub fn nccl_rank(&self, rank: usize, local: usize) -> usize {
        self.first(rank) + self.group_of[rank][local]
    }
}

impl Topology {
    /// The topology the options describe, before any device is asked: without an override,
    /// no pair of distinct GPUs is assumed to have peer access (a live context then takes in
    /// what the devices say, [`Topology::detected`]).
    pub fn from_options(options: &Options) -> Result<Topology> {
        options.validate()?;
        let devices = options.replicas.clone();
        let n = devices.len();
        let cuda = options.has_cuda_replicas();
        let (peer, peer_source) = match (&options.peer_access, cuda) {
            (Some(m), _) => (m.clone(), PeerSource::Override),
            (None, false) => (vec![1; n * n], PeerSource::Host),
            (None, true) => (vec![0; n * n], PeerSource::Assumed),
        };
        let (transport, transport_reason) = match (options.transport, cuda) {
            (_, false) => (
                TransportChoice::Host,
                "host replicas: multi-threaded reduction in host memory".to_owned(),
            ),
            (Transport::Nccl, true) => (TransportChoice::Nccl, "NCCL requested".to_owned()),
            (Transport::PeerCopy, true) => {
                (TransportChoice::PeerCopy, "PEER_COPY requested".to_owned())
            }
            (_, true) => (
                TransportChoice::Nccl,
                "AUTO: NCCL, if it loads and initialises when the context is created; \
                 otherwise peer_copy (a dry run does not load it)"
                    .to_owned(),
            ),
        };
        let rank_per_replica =
            cuda && options.transport == Transport::Nccl && options.nccl_rank_per_replica;
        let transport_reason = if rank_per_replica {
            transport_reason + "; one NCCL rank per replica (DPSYNC_NCCL_RANK_PER_REPLICA)"
        } else {
            transport_reason
        };
        let mut topology = Topology {
            devices,
            peer,
            peer_source,
            peer_detected: None,
            transport,
            transport_reason,
            rank: 0,
            world_size: 1,
            replicas_per_rank: vec![n],
            rank_per_replica,
            world_nccl: None,
            in_world: false,
            reproducible: options.reproducible,
        };
        topology.own_devices_readable();
        Ok(topology)
    }

    /// Takes in a live context's `detected` peer matrix (replica by replica): it becomes the
    /// matrix unless `options` override it, and is then shown beside the override.
    pub fn detected(&mut self, options: &Options, detected: Vec<u8>) {
        match options.peer_access {
            Some(_) => self.peer_detected = Some(detected),
            None => {
                self.peer = detected;
                self.peer_source = PeerSource::Detected;
            }
        }
        self.own_devices_readable();
    }

    /// This topology placed in a world, as its ranks settled it at creation: the last part of
    /// building a live context's topology, before anything is planned over it.
    pub fn in_world(self, place: WorldPlace) -> Topology {
        Topology {
            rank: place.rank,
            world_size: place.size,
            replicas_per_rank: place.replicas_per_rank,
            world_nccl: place.nccl,
            in_world: true,
            ..self
        }
    }

    /// A device always reads its own memory, whatever a matrix says.
    fn own_devices_readable(&mut self) {
        let n = self.replicas();
        for i in 0..n {
            for j in 0..n {
                if self.devices[i] == self.devices[j] {
                    self.peer[i * n + j] = 1;
                }
            }
        }
    }

    /// The same replicas seen as one address space: how host-memory tensors are reduced.
    pub fn for_host_memory(&self) -> Topology {
        let n = self.replicas();
        Topology {
            peer: vec![1; n * n],
            peer_source: PeerSource::Host,
            transport: TransportChoice::Host,
            transport_reason: "host memory: multi-threaded reduction".to_owned(),
            world_nccl: None,
            ..self.clone()
        }
    }

    pub fn replicas(&self) -> usize {
        self.devices.len()
    }

    /// Replicas over all processes: the divisor of AVG and of the loss scale.
    pub fn world_replicas(&self) -> usize {
        self.replicas_per_rank.iter().sum()
    }

    /// The rank holding world replica `index` (below [`Topology::world_replicas`]) and its
    /// local index there.
    pub fn locate(&self, index: usize) -> (usize, usize) {
        let (mut rank, mut local) = (0, index);
        while local >= self.replicas_per_rank[rank] {
            local -= self.replicas_per_rank[rank];
            rank += 1;
        }
        (rank, local)
    }

    /// The world index of this process's replica 0 (rank offsets: rank 0's replicas first).
    pub fn world_offset(&self) -> usize {
        self.replicas_per_rank[..self.rank].iter().sum()
    }

    /// Whether a kernel on `a`'s device may read `b`'s memory directly and vice versa.
    pub fn mutual_access(&self, a: usize, b: usize) -> bool {
        let n = self.replicas();
        self.peer[a * n + b] != 0 && self.peer[b * n + a] != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_device_pairs_always_have_access() {
        let mut o = Options::default();
        o.set_cuda_replicas(&[0, 0, 1]).unwrap();
        o.set_peer_access(&[0; 9], 3).unwrap();
        let t = Topology::from_options(&o).unwrap();
        assert_eq!(t.peer, vec![1, 1, 0, 1, 1, 0, 0, 0, 1]);
        assert_eq!(t.peer_source, PeerSource::Override);
        assert!(t.mutual_access(0, 1) && !t.mutual_access(1, 2));
        assert_eq!(t.transport, TransportChoice::Nccl);
    }

    #[test]
    fn host_replicas_plan_the_host_transport() {
        let mut o = Options::default();
        o.set_host_replicas(4).unwrap();
        let t = Topology::from_options(&o).unwrap();
        assert_eq!(t.transport, TransportChoice::Host);
        assert_eq!(t.peer, vec![1; 16]);
        assert_eq!(t.world_replicas(), 4);
    }

    #[test]
    fn world_indices_locate_their_rank_and_local_replica() {
        let mut o = Options::default();
        o.set_host_replicas(2).unwrap();
        let mut t = Topology::from_options(&o).unwrap();
        (t.rank, t.world_size, t.replicas_per_rank) = (1, 3, vec![3, 2, 1]);
        assert_eq!((t.world_replicas(), t.world_offset()), (6, 3));
        let located: Vec<(usize, usize)> = (0..6).map(|w| t.locate(w)).collect();
        assert_eq!(located, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]);
    }
}
