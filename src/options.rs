//! Context options, checked when they are set (what can be checked alone) and again as a whole
//! when a context or a dry-run plan is made from them.

use crate::error::{Error, Result};
use crate::types::{Device, Transport};

/// Upper bound on replicas per process: far above any real node, low enough that a garbage
/// count is rejected instead of allocating gigabytes of bookkeeping.
pub(crate) const MAX_REPLICAS: usize = 4096;

/// Default fusion bucket capacity: 25 MiB, as PyTorch DDP. Large enough to amortise a launch
/// (NCCL: ~10 µs per call is <10 % of moving 25 MiB at 100+ GB/s), small enough that a ResNet-50
/// sized gradient set (~100 MB) splits into several buckets that can start while backward is
/// still producing the rest (see `dpsync_grad_ready`). Horovod's 64–128 MiB suits fewer, larger
/// tensors arriving together; callers can choose it.
pub(crate) const DEFAULT_FUSION_BYTES: usize = 25 << 20;

#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub replicas: Vec<Device>,
    pub transport: Transport,
    pub fusion_bytes: usize,
    /// 0 = wait forever. Read through [`Options::timeout`], which knows a world's default.
    pub timeout_ms: u64,
    /// `dpsync_options_set_timeout_ms` was called: an explicit 0 means forever, in a world too.
    pub timeout_set: bool,
    /// Row-major n x n override of the peer-access matrix, n = replica count.
    pub peer_access: Option<Vec<u8>>,
    /// Coalesce sparse gradients (each replica's slice before the gather, the result after).
    pub sparse_coalesce: bool,
    /// Float sums that depend on the contributions alone, not on how the replicas are
    /// arranged (`dpsync_options_set_reproducible`, backend/host/repro.rs).
    pub reproducible: bool,
    /// With transport NCCL: one NCCL rank per replica even where replicas share a GPU, instead
    /// of summing them on the GPU first. Only an NCCL that allows several ranks per GPU accepts
    /// it (`NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL >= 2.30); it exists to exercise multi-rank
    /// communicators on a one-GPU machine. From `DPSYNC_NCCL_RANK_PER_REPLICA=1` when the
    /// options are created.
    pub nccl_rank_per_replica: bool,
    /// A world of processes (`dpsync_options_set_world_mpi`); `None`: this process alone.
    pub world: Option<World>,
    /// The fewest ranks an elastic world goes on with (`dpsync_options_set_elastic`); 0: the
    /// world is not elastic.
    pub elastic: usize,
}

/// The communicator a world spans.
// Made only by the MPI engine: a build without it never has a world.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum World {
    /// `MPI_COMM_WORLD` (dpsync initialises MPI if nobody has).
    MpiCommWorld,
    /// The bytes of the caller's `MPI_Comm` value, copied when the option was set (its size and
    /// meaning belong to the MPI implementation: a pointer in Open MPI, an int in MPICH).
    MpiComm(Vec<u8>),
}

/// A world's timeout when none was set: long enough for the slowest rank's start-up and a
/// large model's first step, short enough that a dead rank is reported, not waited on forever.
pub(crate) const WORLD_DEFAULT_TIMEOUT_MS: u64 = 10 * 60 * 1000;

impl Default for Options {
    fn default() -> Self {
        Options {
            replicas: vec![Device::Host],
            transport: Transport::Auto,
            fusion_bytes: DEFAULT_FUSION_BYTES,
            timeout_ms: 0,
            timeout_set: false,
            peer_access: None,
            sparse_coalesce: false,
            reproducible: false,
            elastic: 0,
            nccl_rank_per_replica: std::env::var("DPSYNC_NCCL_RANK_PER_REPLICA")
                .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes")),
            world: None,
        }
    }
}

pub(crate) fn check_replica_count(count: usize, argument: &str) -> Result<()> {
    if count == 0 {
        return Err(Error::invalid(format!("{argument} must be at least 1")));
    }
    if count > MAX_REPLICAS {
        return Err(Error::invalid(format!(
            "{argument} is {count}; at most {MAX_REPLICAS} replicas per context"
        )));
    }
    Ok(())
}

impl Options {
    pub fn set_host_replicas(&mut self, count: usize) -> Result<()> {
        check_replica_count(count, "count")?;
        self.replicas = vec![Device::Host; count];
        Ok(())
    }

    pub fn set_cuda_replicas(&mut self, ordinals: &[i32]) -> Result<()> {
        check_replica_count(ordinals.len(), "count")?;
        if let Some((i, bad)) = ordinals.iter().enumerate().find(|(_, o)| **o < 0) {
            return Err(Error::invalid(format!(
                "ordinals[{i}] is {bad}; CUDA device ordinals are >= 0"
            )));
        }
        self.replicas = ordinals.iter().map(|&o| Device::Cuda(o)).collect();
        Ok(())
    }

    pub fn set_peer_access(&mut self, matrix: &[u8], n: usize) -> Result<()> {
        self.check_peer_size(n)?;
        self.peer_access = Some(matrix.iter().map(|&v| u8::from(v != 0)).collect());
        Ok(())
    }

    pub(crate) fn check_peer_size(&self, n: usize) -> Result<()> {
        if n != self.replicas.len() {
            return Err(Error::invalid(format!(
                "peer-access matrix: n is {n} but the options have {} replicas",
                self.replicas.len()
            )));
        }
        Ok(())
    }

    pub fn set_timeout_ms(&mut self, timeout_ms: u64) {
        self.timeout_ms = timeout_ms;
        self.timeout_set = true;
    }

    /// The collective timeout in ms (0 = forever): as set, else 0 alone and 10 minutes in a
    /// world, where a dead rank must not hang the others.
    pub fn timeout(&self) -> u64 {
        match (self.timeout_set, &self.world) {
            (false, Some(_)) => WORLD_DEFAULT_TIMEOUT_MS,
            _ => self.timeout_ms,
        }
    }

    pub fn has_cuda_replicas(&self) -> bool {
        self.replicas.iter().any(|d| matches!(d, Device::Cuda(_)))
    }

    /// Checks that the options fit together: the transport suits the replicas and an
    /// overriding peer matrix (set before the replicas changed) still has the right size.
    pub fn validate(&self) -> Result<()> {
        let cuda = self.has_cuda_replicas();
        match (self.transport, cuda) {
            (Transport::Host, true) => {
                return Err(Error::invalid(
                    "transport HOST needs host replicas; these options have CUDA replicas",
                ))
            }
            (Transport::Nccl | Transport::PeerCopy, false) => {
                return Err(Error::invalid(format!(
                    "transport {} needs CUDA replicas; these options have host replicas",
                    self.transport.name().to_uppercase()
                )))
            }
            _ => {}
        }
        if let Some(matrix) = &self.peer_access {
            let n = self.replicas.len();
            if matrix.len() != n * n {
                return Err(Error::invalid(format!(
                    "peer-access matrix: n is {} but the options have {n} replicas \
                     (the replicas changed after dpsync_options_set_peer_access)",
                    matrix.len().isqrt()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setters_reject_bad_values_and_keep_the_old_ones() {
        let mut o = Options::default();
        assert_eq!(o.replicas, vec![Device::Host]);
        assert!(o.set_host_replicas(0).is_err());
        assert!(o.set_host_replicas(MAX_REPLICAS + 1).is_err());
        assert!(o.set_cuda_replicas(&[0, -1]).is_err());
        assert_eq!(o.replicas, vec![Device::Host]);
        o.set_cuda_replicas(&[0, 0, 1]).unwrap();
        assert!(o.set_peer_access(&[1; 4], 2).is_err());
        o.set_peer_access(&[1, 0, 7, 0, 1, 0, 0, 0, 1], 3).unwrap();
        assert_eq!(o.peer_access.as_deref().unwrap()[2], 1);
        o.validate().unwrap();
        // Shrinking the replicas afterwards leaves a matrix of the wrong size: caught as a whole.
        o.set_cuda_replicas(&[0, 1]).unwrap();
        let err = o.validate().unwrap_err();
        assert!(err.message.contains("n is 3"), "{}", err.message);
    }

    #[test]
    fn transport_must_fit_the_replicas() {
        let mut o = Options {
            transport: Transport::Nccl,
            ..Options::default()
        };
        assert!(o.validate().unwrap_err().message.contains("transport"));
        o.set_cuda_replicas(&[0]).unwrap();
        o.validate().unwrap();
        o.transport = Transport::Host;
        assert!(o.validate().is_err());
    }
}
