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

/// Leaves this rank's world (uneven inputs: its data ran out before the others'): instead of
/// its next collective, this rank stands for its part in the next collective the other ranks
/// make, whatever that call is (buckets they started early with dpsync_grad_ready included).
/// The ranks agree there that it leaves; the call completes on the others without this rank's
/// replicas, its results over the remaining replicas only, and from then on the remaining
/// ranks are renumbered 0..n-1 in their previous order, AVG, dpsync_loss_scale, BMUF's mean and
/// default momentum and the shards' cut count the remaining replicas, and dpsync_world_epoch
/// has grown by one. Several ranks may leave at the same call; when every rank leaves, the
/// world ends and every dpsync_leave returns OK. Returns when that call is agreed (TIMEOUT
/// within the context's timeout if the others never call). Afterwards this context refuses
/// collectives (DPSYNC_STATUS_INVALID_STATE), still answers queries, and is destroyed as
/// usual. Works in every world, elastic or not; DPSYNC_STATUS_INVALID_STATE on a context
/// without a world.
#[no_mangle]
pub unsafe extern "C" fn dpsync_leave(context: *mut dpsync_context) -> dpsync_status {
    with_context(context, |ctx| ctx.leave())
}

/// Makes a world elastic: with `min_ranks` >= 1 it goes on without lost ranks while at least
/// `min_ranks` ranks remain (each survivor gets DPSYNC_STATUS_RANK_LOST from the collective the
/// loss interrupted, naming the lost ranks); 0 turns it off (the default). Every rank must give
/// the same value (otherwise dpsync_context_create is DPSYNC_STATUS_INCONSISTENT naming the
/// option and the ranks); on a context with no world it changes nothing. Elastic worlds need an
/// MPI with User-Level Failure Mitigation (Open MPI 5 started with `mpirun --with-ft ulfm`):
/// where the MPI lacks it, dpsync_context_create of an elastic world is
/// DPSYNC_STATUS_UNAVAILABLE, its message saying what is missing and how to get it; so is
/// every elastic world in this version, which does not yet recover lost ranks (docs/API.md).
/// DPSYNC_STATUS_INVALID_ARGUMENT for NULL options.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_elastic(
    options: *mut dpsync_options,
    min_ranks: usize,
) -> dpsync_status {
    entry(|| {
        try_mut(options, "options")?.inner.elastic = min_ranks;
        Ok(())
    })
}

/// `epoch`: how many times this rank's world has changed since dpsync_context_create (0 at
/// first; one more for every collective at which ranks left or were lost). `first_rank`: this
/// rank's number at creation, which never changes (e.g. to keep its part of the data set). A
/// context without a world has epoch 0 and first_rank 0. DPSYNC_STATUS_INVALID_ARGUMENT for
/// NULL pointers.
#[no_mangle]
pub unsafe extern "C" fn dpsync_world_epoch(
    context: *const dpsync_context,
    epoch: *mut u64,
    first_rank: *mut usize,
) -> dpsync_status {
    with_context(context, |ctx| {
        let (e, f) = ctx.world_epoch();
        let (epoch, first_rank) = (try_mut(epoch, "epoch")?, try_mut(first_rank, "first_rank")?);
        (*epoch, *first_rank) = (e, f);
        Ok(())
    })
}
