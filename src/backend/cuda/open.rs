//! Opening the CUDA backend: loading the driver, checking the devices, detecting and enabling
//! peer access, choosing the transport (AUTO: NCCL if it loads and initialises, else peer
//! copies) and compiling the kernels. Touches no tensor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::driver::{self, Event, PrimaryContext, Stream};
use super::kernels::Kernels;
use super::memory::Scratch;
use super::queue::State;
use super::{nccl, CudaBackend, Group, Replica};
use crate::error::{Error, ErrorKind, Result};
use crate::options::Options;
use crate::plan::TransportChoice;
use crate::types::{Device, Transport};

/// What opening the backend found out about the machine.
pub(crate) struct Opened {
    pub backend: CudaBackend,
    /// Replica-level n x n matrix from `cuDeviceCanAccessPeer`.
    pub peer: Vec<u8>,
    pub transport: TransportChoice,
    pub reason: String,
}

fn ordinal(device: Device) -> i32 {
    match device {
        Device::Cuda(o) => o,
        Device::Host => unreachable!("the CUDA backend only gets CUDA replicas"),
    }
}

impl CudaBackend {
    /// Loads the driver, checks the devices, detects and enables peer access, picks the
    /// transport and compiles the kernels. Touches no tensor.
    pub fn open(options: &Options, planned: &[Vec<usize>]) -> Result<Opened> {
        driver::load()?;
        let count = driver::device_count()?;
        if count == 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "the CUDA driver reports no device",
            ));
        }
        let ordinals: Vec<i32> = options.replicas.iter().map(|d| ordinal(*d)).collect();
        for (r, &o) in ordinals.iter().enumerate() {
            if o < 0 || o >= count {
                return Err(Error::invalid(format!(
                    "replica {r}: CUDA device {o} does not exist (this machine has {count})"
                )));
            }
        }
        // Groups: the planner's (one per distinct GPU, in order of first replica; one per
        // replica when each is its own NCCL rank), so that group g is the plan's group g.
        let mut group_of = vec![0; ordinals.len()];
        let mut group_ordinals: Vec<i32> = Vec::with_capacity(planned.len());
        for (g, members) in planned.iter().enumerate() {
            members.iter().for_each(|&r| group_of[r] = g);
            group_ordinals.push(ordinals[members[0]]);
        }
        let ctxs: Vec<Arc<PrimaryContext>> = group_ordinals
            .iter()
            .map(|&o| PrimaryContext::retain(o).map(Arc::new))
            .collect::<Result<_>>()?;
        let peer = detect_peer_access(&ctxs, &group_of)?;
        if let Some(m) = &options.peer_access {
            let n = ordinals.len();
            for i in 0..n {
                for j in 0..n {
                    if m[i * n + j] != 0 && peer[i * n + j] == 0 {
                        return Err(Error::invalid(format!(
                            "peer_access matrix: entry [{i}][{j}] says replica {i} (cuda:{}) \
                             reads replica {j} (cuda:{}) directly, but the devices have no peer \
                             access",
                            ordinals[i], ordinals[j]
                        )));
                    }
                }
            }
        }
        let (transport, reason, nccl_library) = choose_transport(options.transport)?;
        let mut groups = Vec::with_capacity(ctxs.len());
        for (g, ctx) in ctxs.iter().enumerate() {
            let kernels = Kernels::for_device(ctx)?;
            let _bound = ctx.bind()?;
            groups.push(Group {
                local: (0..ordinals.len()).filter(|&r| group_of[r] == g).collect(),
                stream: Stream::new()?,
                progress: Event::new()?,
                scratch: Mutex::new(Scratch::default()),
                kernels,
                ctx: ctx.clone(),
            });
        }
        let mut replicas = Vec::with_capacity(ordinals.len());
        for &g in &group_of {
            let _bound = groups[g].ctx.bind()?;
            replicas.push(Replica {
                group: g,
                stream: 0,
                start: Event::new()?,
            });
        }
        let timeout = (options.timeout() > 0).then(|| Duration::from_millis(options.timeout()));
        let callers = distinct_callers(&groups, &replicas);
        let mut backend = CudaBackend {
            groups,
            replicas,
            callers,
            transport,
            nccl_library,
            comms: Mutex::new(None),
            world: Default::default(),
            shrinking: Default::default(),
            state: Mutex::new(State::default()),
            dropped: Arc::default(),
            pinned: Arc::default(),
            timeout,
            driver_version: driver::driver_version(),
            trace: Mutex::new(None),
        };
        let (transport, reason) = backend.settle_auto(options.transport, transport, reason);
        backend.transport = transport;
        Ok(Opened {
            backend,
            peer,
            transport,
            reason,
        })
    }

    /// AUTO promises NCCL only if it *initialises*: with several GPUs, create the communicators
    /// now and fall back to peer copies if that fails (NCCL requested: lazily, at first use).
    fn settle_auto(
        &self,
        requested: Transport,
        transport: TransportChoice,
        reason: String,
    ) -> (TransportChoice, String) {
        if requested != Transport::Auto || transport != TransportChoice::Nccl {
            return (transport, reason);
        }
        if self.groups.len() < 2 {
            return (transport, reason);
        }
        match self.comms(Instant::now()) {
            Ok(_) => (transport, reason),
            Err(e) => (
                TransportChoice::PeerCopy,
                format!(
                    "AUTO: NCCL loaded but its communicators did not initialise ({}); using \
                     peer_copy",
                    e.message
                ),
            ),
        }
    }
}

/// The first replica of each distinct caller stream (a stream handle names one stream of one
/// device; the legacy default stream, 0, is per device): begin and end record and wait once per
/// caller stream, since replicas often share one.
pub(crate) fn distinct_callers(groups: &[Group], replicas: &[Replica]) -> Vec<usize> {
    let mut seen: Vec<(i32, usize)> = Vec::with_capacity(replicas.len());
    let mut first = Vec::with_capacity(replicas.len());
    for (i, r) in replicas.iter().enumerate() {
        let key = (groups[r.group].ctx.ordinal, r.stream);
        if !seen.contains(&key) {
            seen.push(key);
            first.push(i);
        }
    }
    first
}

/// Replica-level peer matrix; pairs that can are enabled both ways.
fn detect_peer_access(ctxs: &[Arc<PrimaryContext>], group_of: &[usize]) -> Result<Vec<u8>> {
    let g = ctxs.len();
    let mut device = vec![0u8; g * g];
    for a in 0..g {
        for b in 0..g {
            let same = a == b || ctxs[a].ordinal == ctxs[b].ordinal;
            if same
                || (driver::can_access_peer(&ctxs[a], &ctxs[b])?
                    && driver::enable_peer_access(&ctxs[a], &ctxs[b])?)
            {
                device[a * g + b] = 1;
            }
        }
    }
    let n = group_of.len();
    let mut peer = vec![0u8; n * n];
    for i in 0..n {
        for j in 0..n {
            peer[i * n + j] = device[group_of[i] * g + group_of[j]];
        }
    }
    Ok(peer)
}

fn choose_transport(requested: Transport) -> Result<(TransportChoice, String, Option<String>)> {
    match requested {
        Transport::PeerCopy => Ok((
            TransportChoice::PeerCopy,
            "PEER_COPY requested".to_owned(),
            None,
        )),
        Transport::Nccl => match nccl::load() {
            Ok(lib) => Ok((
                TransportChoice::Nccl,
                format!("NCCL requested: {lib}"),
                Some(lib),
            )),
            Err(e) => Err(Error::new(
                ErrorKind::Unavailable,
                format!("transport NCCL was requested but {}", e.message),
            )),
        },
        _ => match nccl::load() {
            Ok(lib) => Ok((
                TransportChoice::Nccl,
                format!("AUTO: NCCL loaded: {lib}"),
                Some(lib),
            )),
            Err(e) => Ok((
                TransportChoice::PeerCopy,
                format!("AUTO: NCCL unavailable ({}); using peer_copy", e.message),
                None,
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs everywhere: where NCCL is missing (CI) AUTO must fall back and NCCL must refuse.
    #[test]
    fn missing_nccl_means_peer_copy_for_auto_and_unavailable_for_nccl() {
        if nccl::load().is_ok() {
            eprintln!("missing-NCCL paths: skipped: NCCL is installed here");
            return;
        }
        let (t, reason, lib) = choose_transport(Transport::Auto).unwrap();
        assert_eq!(t, TransportChoice::PeerCopy);
        assert!(reason.contains("NCCL unavailable") && reason.contains("libnccl.so.2"));
        assert!(lib.is_none());
        let err = choose_transport(Transport::Nccl).err().unwrap();
        assert_eq!(err.kind, ErrorKind::Unavailable);
        assert!(
            err.message.contains("DPSYNC_NCCL_LIBRARY"),
            "{}",
            err.message
        );
        let (t, _, _) = choose_transport(Transport::PeerCopy).unwrap();
        assert_eq!(t, TransportChoice::PeerCopy);
    }
}
