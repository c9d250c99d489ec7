//! The MPI engine between the ranks of a world ([`Ranks`](super::Ranks)), through rsmpi's raw
//! bindings (`mpi::ffi`): its communicator is a duplicate of the caller's, so dpsync's traffic
//! never mixes with theirs, and every transfer is issued non-blocking and polled against the
//! world's timeout, so a dead or stuck rank gives TIMEOUT, never a hang.
//!
//! This file holds the engine's state, which all its parts share; each part has its own file:
//! `init.rs` (MPI's initialisation and exit, joining a world), `negotiate.rs` (whether the
//! ranks share memory), `progress.rs` (the progress thread), `pieces.rs` (transfers in pieces),
//! `staging.rs` (elements in and out of the stages, per dtype), `poll.rs` (waiting for MPI),
//! `calls.rs` (an MPI call's errors), `ranks.rs` (the `Ranks` implementation), `ways.rs`
//! (which way a collective goes, and the waited sums the methods share), `ring.rs` (the
//! ring allreduce), `shm.rs` (the shared memory it crosses), `scatter.rs` (the reduce-scatter
//! through it), `owners.rs` (the reduce-scatter and allgather round the ring without it),
//! `steps.rs` (the buckets started early; `steps/release.rs` what they write before and at
//! their step's agreement; `whole.rs` and `aside.rs` its whole buckets through shared memory
//! and the originals of early writes), `alltoall.rs` (reproducible sums to each element's
//! owner, waited or started early) and `ulfm.rs` (elastic worlds: the vote after each call and the shrink
//! after a loss).

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use mpi::ffi;
use parking_lot::{Condvar, Mutex};

use super::Channel;
use crate::error::{Error, ErrorKind, Result};
use init::finalized;
use pieces::stage;
use progress::Progress;
use ring::Ring;
use shm::Shared;
use steps::{Queue, Until};

mod alltoall;
mod aside;
mod calls;
mod init;
mod negotiate;
mod owners;
mod pieces;
mod poll;
mod progress;
mod ranks;
mod ring;
mod scatter;
mod shm;
mod staging;
mod steps;
mod ulfm;
mod ways;
mod whole;

pub(crate) use init::{library_name, world_of};
pub(crate) use ulfm::ulfm_missing;

/// The duplicated communicator, freed when the context goes.
struct Comm(ffi::MPI_Comm);

// SAFETY: MPI_THREAD_MULTIPLE (checked at join) allows any thread to use a communicator; the
// context's lock keeps one call at a time on it.
unsafe impl Send for Comm {}
// SAFETY: likewise: shared with the progress thread, which uses the steps' communicator only
// under the queue's lock, as every other user of it does.
unsafe impl Sync for Comm {}

/// A context's engine: the [`Engine`], and the progress thread that moves the buckets started
/// early while the caller computes (Open MPI moves a transfer only inside its calls). The
/// thread starts with the first early bucket, sleeps while none is queued, and stops with the
/// context.
pub(crate) struct MpiRanks {
    engine: Arc<Engine>,
    progress: Mutex<Progress>,
}

impl std::ops::Deref for MpiRanks {
    type Target = Engine;

    fn deref(&self) -> &Engine {
        &self.engine
    }
}

pub(crate) struct Engine {
    /// Agreements, broadcasts, gathers and the transfers of every collective but the gradient
    /// steps'.
    comm: Comm,
    /// The gradient steps' bucket transfers ([`Channel::Steps`]): every rank issues a step's
    /// buckets here in bucket order, some ahead of the step (`dpsync_grad_ready`), so they must
    /// not interleave with the other collectives.
    steps: Comm,
    /// The buckets started ahead of their step, in order ([`steps`]).
    queue: Mutex<Queue>,
    /// Wakes the progress thread: a bucket was queued, or the context goes (`stop`).
    wake: Condvar,
    stop: AtomicBool,
    /// Result buffers of finished early transfers, for reuse.
    spare: Mutex<Vec<Vec<u64>>>,
    rank: usize,
    size: usize,
    timeout: Option<Duration>,
    /// Set by a timeout or a failed MPI call: the ranks may have parted ways, so every later
    /// call is refused.
    failed: Mutex<Option<String>>,
    library: String,
    /// The collective under way ([`Ranks::begin`](super::Ranks::begin)), for messages.
    call: Mutex<String>,
    /// The stages of waited transfers, reused: [`DEPTH`](pieces::DEPTH) slots of up to
    /// [`PIECE`](pieces::PIECE) bytes each way (8-byte words: aligned for every dtype). Staged
    /// because a timed-out MPI request stays pending and may still read and write its buffers:
    /// then they are leaked, never the caller's memory (and MPI_IN_PLACE's value differs
    /// between MPI implementations, so dpsync never passes it).
    scratch: Mutex<Vec<u64>>,
    /// Ring pieces the collectives' communicator carried so far: they number the pieces'
    /// tags and shared-memory slots alike on every rank (the steps' are the queue's).
    calls_pieces: AtomicUsize,
    /// Where every rank runs on this host: the shared memory the ring pieces cross (`shm.rs`).
    shared: Option<Shared>,
    /// What `dpsync_describe` says of it: on, or why not.
    shared_note: String,
    /// An elastic world's engine (`ulfm.rs`): MPI messages only, a vote after every call.
    elastic: bool,
    /// An elastic world's other ranks on this host and their processes (negotiate.rs), watched
    /// while a survivor waits on a device ([`Ranks::neighbours`](super::Ranks::neighbours)).
    neighbours: Vec<(usize, u32)>,
    /// A collective began (its agreement) since the last vote: its ranks vote after it.
    begun: AtomicBool,
    /// That collective's latest agreement passed on every rank (a failure after it is voted a
    /// loss).
    agreed: AtomicBool,
}

impl Engine {
    fn refuse_if_failed(&self) -> Result<()> {
        match &*self.failed.lock() {
            None => Ok(()),
            Some(why) => Err(Error::new(
                ErrorKind::InvalidState,
                format!("this context's world failed earlier ({why}): it refuses collectives"),
            )),
        }
    }

    fn comm_of(&self, channel: Channel) -> ffi::MPI_Comm {
        match channel {
            Channel::Calls => self.comm.0,
            Channel::Steps => self.steps.0,
        }
    }

    /// The ring of `channel`'s communicator, through its shared memory where there is some.
    fn ring(&self, channel: Channel) -> Ring {
        let slots = self.shared.as_ref().map(|s| s.slots(channel));
        Ring::new(self.comm_of(channel), self.rank, self.size, slots)
    }

    /// Marks the world failed (a timeout or an MPI error mid-transfer) and names the call. The
    /// first failure stays the world's: later ones are often its effects (a revoked
    /// communicator after an elastic world's vote).
    fn failing(&self, mut e: Error) -> Error {
        e.message = format!("{}: {}", self.call.lock(), e.message);
        self.failed.lock().get_or_insert_with(|| e.message.clone());
        e
    }

    /// Moves the steps' queue on as `until` says; a failure fails the world (and leaks the
    /// queue's buffers: MPI may still use them).
    fn drive(&self, queue: &mut Queue, until: Until) -> Result<()> {
        let spare = |held| self.spare.lock().push(held);
        let ring = self.ring(Channel::Steps);
        // SAFETY: queued inputs stay valid until their bucket is finished or its ticket
        // dropped (`Ranks::start`); the steps' communicator is ours.
        let driven = unsafe { queue.drive(&ring, until, self.timeout, spare) };
        driven.map_err(|e| {
            queue.leak();
            self.failing(e)
        })
    }

    /// A stage of at least `bytes`, from the spares if one fits.
    fn spare_stage(&self, bytes: usize) -> Vec<u64> {
        // The smallest spare that holds it, else the largest, grown: a step's buckets come
        // back in another order than they go out, and growing a stage means fresh pages to
        // fault in while the bucket crosses (a 25 MiB bucket's first phase took 14 ms
        // instead of 7 on the 2-core VM).
        let mut spare = self.spare.lock();
        let words = bytes.div_ceil(8);
        let fits = (spare.iter().enumerate())
            .filter(|(_, w)| w.len() >= words)
            .min_by_key(|(_, w)| w.len());
        let pick = fits.or_else(|| spare.iter().enumerate().max_by_key(|(_, w)| w.len()));
        let at = pick.map(|(i, _)| i);
        let mut words = at.map(|i| spare.swap_remove(i)).unwrap_or_default();
        drop(spare);
        stage(&mut words, bytes);
        words
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // A failed world may have a lost rank: freeing could wait on it, so the communicator is
        // left to MPI_Finalize. After MPI_Finalize nothing may be called.
        if self.failed.lock().is_none() && !finalized() {
            // SAFETY: our own communicator, freed once.
            unsafe {
                ffi::MPI_Comm_free(&mut self.comm.0);
                ffi::MPI_Comm_free(&mut self.steps.0);
            }
        } else {
            std::mem::forget(std::mem::take(&mut *self.scratch.lock()));
        }
        let queue = self.queue.get_mut();
        if queue.busy() {
            // Pieces in flight may still use the queue's buffers.
            queue.leak();
        }
    }
}
