//! NCCL across the ranks of a world: this process's groups are ranks `first..` of the clique.
//! After a loss in an elastic world the clique is shrunk over the survivors where NCCL can
//! (`ncclCommShrink`, NCCL 2.27+), else made anew by the world's rebuild. A shrink needs its
//! parent alive, so while an elastic call is under way (`hold`) a failure keeps the clique
//! rather than abort it at once: the shrink ends the parent's operations itself, and a call
//! that ends without one aborts what the failure kept.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::driver::PrimaryContext;
use super::nccl::{self, CommSet};
use super::queue::setup_deadline;
use super::CudaBackend;
use crate::backend::{process_gone, WorldCollective};
use crate::error::{Error, ErrorKind, Result};
use crate::log;

/// How often a wait on the device looks at the peers' processes.
const WATCH: Duration = Duration::from_millis(5);

/// An elastic world's clique across a loss.
#[derive(Default)]
pub(super) struct Shrinking {
    /// An elastic call is under way: a failure keeps the clique.
    hold: AtomicBool,
    /// The survivors' clique `shrink` issued, and its size, until the rebuild joins it.
    child: Mutex<Option<(CommSet, usize)>>,
    /// The clique it was shrunk from: alive until the child is ready or given up.
    parent: Mutex<Option<Arc<CommSet>>>,
    /// The other ranks on this host and their processes, watched in waits on the device while
    /// an elastic call is under way ([`CudaBackend::watch_peers`]).
    watched: Mutex<Vec<(usize, u32)>>,
    /// Shrinks made (describe's "nccl_shrinks").
    pub(super) count: AtomicU64,
}

impl CudaBackend {
    /// Whether a failure keeps the clique ([`Shrinking::hold`]).
    pub(super) fn holds_clique(&self) -> bool {
        self.shrinking.hold.load(Ordering::Relaxed)
    }

    /// Aborts the clique a shrink came from, and a shrunk one not joined.
    pub(super) fn give_up_shrink(&self, child_too: bool) {
        if child_too {
            if let Some((child, _)) = self.shrinking.child.lock().take() {
                child.abort();
            }
        }
        if let Some(parent) = self.shrinking.parent.lock().take() {
            parent.abort();
        }
    }

    /// During an elastic call, every 5 ms of a wait on the device ([`CudaBackend::poll`]):
    /// the first watched rank whose process is gone, as the BACKEND_ERROR that fails the call
    /// (NCCL may never report it: ranks sharing a GPU, NVLink, shared memory).
    pub(super) fn watch_peers(&self, looked: &mut Option<Instant>) -> Result<()> {
        let now = Instant::now();
        if now - *looked.get_or_insert(now) < WATCH {
            return Ok(());
        }
        *looked = Some(now);
        let peers = self.shrinking.watched.lock();
        let gone = peers.iter().find(|&&(_, pid)| process_gone(pid));
        match gone {
            None => Ok(()),
            Some((r, _)) => Err(Error::new(
                ErrorKind::Backend,
                format!(
                    "rank {r}'s process is gone (seen while this rank waited on its device; \
                     NCCL had not reported it)"
                ),
            )),
        }
    }

    fn devices(&self) -> Vec<&PrimaryContext> {
        self.groups.iter().map(|g| g.ctx.as_ref()).collect()
    }
}

impl WorldCollective for CudaBackend {
    fn new_id(&self) -> Result<Vec<u8>> {
        nccl::unique_id_bytes()
    }

    fn issue(&self, id: &[u8], first: usize, total: usize, shrunk: bool) -> Result<()> {
        let child = self.shrinking.child.lock().take();
        let set = match child {
            Some((child, _)) if shrunk => child,
            other => {
                if let Some((child, _)) = other {
                    child.abort();
                }
                self.give_up_shrink(false);
                CommSet::world(&self.devices(), id, total, first)?
            }
        };
        // Replaces the local set AUTO may have tried at open (dropped: finalized).
        *self.comms.lock() = Some(Arc::new(set));
        self.world.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn ready(&self) -> Result<()> {
        // After `issue`: the slot holds the world's set (or it was aborted since).
        let ready = (self.comms(Instant::now()))
            .and_then(|set| set.ready(setup_deadline(Instant::now(), self.timeout)));
        // A shrunk set is ready or aborted: its parent may go.
        self.give_up_shrink(false);
        ready
    }

    fn leave(&self) {
        // Not the shrunk set: the rebuild leaves the old clique before it joins that one.
        if self.world.swap(false, Ordering::Relaxed) {
            if let Some(set) = self.comms.lock().take() {
                set.abort();
            }
        }
    }

    fn shrunk(&self, first: usize, total: usize) -> bool {
        let child = self.shrinking.child.lock();
        child
            .as_ref()
            .is_some_and(|(set, n)| set.first() == first && *n == total)
    }

    fn hold(&self, on: bool) {
        self.shrinking.hold.store(on, Ordering::Relaxed);
        if on {
            return;
        }
        self.watch(Vec::new());
        // The call ended: a shrink not joined, and a clique a failure kept, go.
        self.give_up_shrink(true);
        if self.state.lock().failed.is_some() {
            if let Some(set) = self.comms.lock().take() {
                set.abort();
            }
        }
    }

    fn watch(&self, peers: Vec<(usize, u32)>) {
        *self.shrinking.watched.lock() = peers;
    }

    fn shrink(&self, lost: &[usize], total: usize) -> bool {
        if !self.world.load(Ordering::Relaxed) || !CommSet::can_shrink() {
            return false;
        }
        let Some(parent) = self.comms.lock().take() else {
            return false; // aborted already: the rebuild makes a new clique
        };
        match parent.shrink(&self.devices(), lost) {
            Ok(child) => {
                *self.shrinking.child.lock() = Some((child, total - lost.len()));
                *self.shrinking.parent.lock() = Some(parent);
                self.shrinking.count.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                log::warn(|| {
                    format!(
                        "the NCCL clique could not be shrunk over the survivors ({}); it is made \
                         anew",
                        e.message
                    )
                });
                parent.abort();
                false
            }
        }
    }
}
