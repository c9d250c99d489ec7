//! Context creation: the replicas' backend opened, a world joined and settled (the options
//! that must agree, every rank's replicas, NCCL across the ranks where every rank can join it),
//! and the topology built from what the devices and the other ranks told, before anything is
//! planned over it.

use crate::backend::select::{self, Opened};
use crate::backend::{Backend, Ranks};
use crate::error::{Error, Result};
use crate::exec::world;
use crate::log;
use crate::options::Options;
use crate::plan::{Route, Topology, TransportChoice, WorldPlace};
use crate::types::Transport;

/// What a context runs on.
pub(super) struct Created {
    pub topology: Topology,
    pub backend: Box<dyn Backend>,
    /// The world's engine, or `None` outside a world.
    pub ranks: Option<Box<dyn Ranks>>,
}

pub(super) fn create(options: &Options) -> Result<Created> {
    let opened = options.validate().and_then(|()| select::open(options));
    let Some(w) = &options.world else {
        let Opened { topology, backend } = opened?;
        return Ok(Created {
            topology,
            backend,
            ranks: None,
        });
    };
    // Creation is collective: the engine joins, then the ranks learn each other's outcome (a
    // rank whose own options or devices failed fails every rank at once, not by the others'
    // timeout), agree on the options and learn the replica counts.
    let ranks = select::join(w, options.timeout(), options.elastic > 0)?;
    let local = (opened.as_ref()).map_err(Clone::clone).and_then(|o| {
        world_part(
            &o.topology,
            &*o.backend,
            ranks.rank() == 0,
            options.transport,
        )
    });
    let settled = world::settle(&*ranks, options, local)?;
    let Opened { topology, backend } = opened?;
    check_elastic(options, ranks.ranks())?;
    // CUDA replicas: NCCL across the ranks where every rank can join it.
    let mut nccl = None;
    if let (Some(joint), Some(c)) = (&settled.collective, backend.world_collective()) {
        if world::join_collective(&*ranks, c, joint, options.transport)? {
            nccl = Some(joint.0.clone());
        }
    }
    let topology = topology.in_world(WorldPlace {
        rank: ranks.rank(),
        size: ranks.ranks(),
        replicas_per_rank: settled.per_rank,
        nccl,
    });
    Ok(Created {
        topology,
        backend,
        ranks: Some(ranks),
    })
}

/// What this rank brings to its world: its replicas and, where its backend can join a
/// collective across the ranks, its replicas' device groups (and on rank 0 the clique's id).
pub(super) fn world_part(
    topology: &Topology,
    backend: &dyn Backend,
    first: bool,
    transport: Transport,
) -> Result<world::Local> {
    let collective = match backend.world_collective() {
        None => None,
        Some(c) => {
            let groups = crate::plan::device_groups(topology);
            let group_of = crate::plan::group_of(&groups, topology.replicas());
            // Without an id from rank 0 no rank joins: AUTO stages; NCCL asked fails creation
            // (this rank's own part failed, so every rank fails with it).
            match first.then(|| c.new_id()).transpose() {
                Ok(id) => Some((group_of, id)),
                Err(e) if transport == Transport::Nccl => return Err(e),
                Err(e) => {
                    log::warn(|| format!("no NCCL unique id: {}", e.message));
                    None
                }
            }
        }
    };
    Ok(world::Local {
        replicas: topology.replicas(),
        collective,
    })
}

/// An elastic world (the ranks agreed on its `min_ranks`): no more ranks needed than there
/// are, and an MPI that can survive a lost rank (ULFM). Alike on every rank, so every rank
/// fails alike.
fn check_elastic(options: &Options, ranks: usize) -> Result<()> {
    let min_ranks = options.elastic;
    if min_ranks == 0 {
        return Ok(());
    }
    if min_ranks > ranks {
        return Err(Error::invalid(format!(
            "dpsync_options_set_elastic: min_ranks is {min_ranks}, more than the world's {ranks} \
             ranks"
        )));
    }
    select::elastic_available()
}

/// What context creation logs: the replicas, the transport and why, the world (info); the
/// fallbacks a user may not expect (warn).
pub(super) fn log_creation(options: &Options, topology: &Topology, route: &Route) {
    log::info(|| {
        let devices: Vec<String> = topology.devices.iter().map(ToString::to_string).collect();
        let world = match topology.world_size {
            1 => String::new(),
            n => format!(
                "; world: rank {} of {n}, replicas per rank {:?}, across the ranks {}",
                topology.rank,
                topology.replicas_per_rank,
                route.name()
            ),
        };
        format!(
            "context created: {} replicas [{}], transport {} ({}){world}",
            devices.len(),
            devices.join(", "),
            topology.transport.name(),
            topology.transport_reason
        )
    });
    if !options.has_cuda_replicas() {
        return;
    }
    if options.transport == Transport::Auto && topology.transport != TransportChoice::Nccl {
        log::warn(|| format!("NCCL is not used: {}", topology.transport_reason));
    }
    if topology.transport == TransportChoice::PeerCopy {
        // Distinct GPU pairs without peer access: their sums go through host memory.
        let n = topology.devices.len();
        let mut pairs: Vec<(String, String)> = Vec::new();
        for a in 0..n {
            for b in 0..n {
                let (da, db) = (topology.devices[a], topology.devices[b]);
                let pair = (da.to_string(), db.to_string());
                if da != db && topology.peer[a * n + b] == 0 && !pairs.contains(&pair) {
                    pairs.push(pair);
                }
            }
        }
        if !pairs.is_empty() {
            log::warn(|| {
                let list: Vec<String> = pairs.iter().map(|(a, b)| format!("{a}->{b}")).collect();
                format!(
                    "no peer access between {}: those transfers are staged through host memory",
                    list.join(", ")
                )
            });
        }
    }
}
