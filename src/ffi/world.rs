//! Worlds of several processes: `dpsync_options_set_world_mpi`, `dpsync_rank`,
//! `dpsync_world_replicas`. Present in every build; without an MPI engine the first one is
//! UNAVAILABLE and a context is always a world of one rank.

use std::ffi::c_void;

use super::boundary::{dpsync_context, entry, try_mut, with_context};
use super::options::dpsync_options;
use super::status::dpsync_status;

/// Makes contexts created from these options span a world of processes over MPI: `mpi_comm`
/// points to the caller's `MPI_Comm` variable (its value is copied), NULL means
/// `MPI_COMM_WORLD`. Every collective then covers every replica of every rank, and world replica
/// indices (rank 0's replicas first) name broadcast roots and order sparse gathers.
/// DPSYNC_STATUS_UNAVAILABLE, with nothing changed, when the library was built without MPI
/// (the message says so).
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_world_mpi(
    options: *mut dpsync_options,
    mpi_comm: *const c_void,
) -> dpsync_status {
    entry(|| {
        let options = try_mut(options, "options")?;
        options.inner.world = Some(crate::backend::select::world_of(mpi_comm)?);
        Ok(())
    })
}

/// This process's rank and the number of ranks: 0 and 1 outside a world.
#[no_mangle]
pub unsafe extern "C" fn dpsync_rank(
    context: *const dpsync_context,
    rank: *mut usize,
    ranks: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let (r, n) = ctx.rank();
        let (rank, ranks) = (try_mut(rank, "rank")?, try_mut(ranks, "ranks")?);
        (*rank, *ranks) = (r, n);
        Ok(())
    })
}

/// Replicas in the whole world, and the world index of this process's local replica 0 (outside
/// a world: the replica count and 0).
#[no_mangle]
pub unsafe extern "C" fn dpsync_world_replicas(
    context: *const dpsync_context,
    total: *mut usize,
    offset: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let (t, o) = ctx.world_replicas();
        let (total, offset) = (try_mut(total, "total")?, try_mut(offset, "offset")?);
        (*total, *offset) = (t, o);
        Ok(())
    })
}
