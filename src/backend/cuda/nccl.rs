//! NCCL, loaded at run time and driven with raw communicator handles.
//!
//! cudarc's NCCL bindings look for `libnccl.so` and `libnccl.so.{13,12,..}`, but the pip wheel
//! `nvidia-nccl-cu13` ships only `libnccl.so.2` — so dpsync loads the library itself
//! (`DPSYNC_NCCL_LIBRARY` alone when set, else `libnccl.so.2`, else `libnccl.so`) and keeps only
//! cudarc's struct layouts (`ncclUniqueId`, `ncclConfig_t`). Results and enums cross as plain
//! integers, so a code this build does not know can never become an invalid Rust enum.
//!
//! Communicators are non-blocking (so a stuck collective can be timed out and aborted), created
//! lazily and cached process-wide by the exact device set; contexts over the same devices share
//! them, and the last one to go destroys them.
//!
//! NCCL's group calls, aborts and destroys may switch the calling thread's current context
//! (its group launch sets the device of each rank and restores the *runtime's* idea of the
//! previous one, which is device 0's primary context when none was current), so every entry
//! point here keeps the caller's current context with [`driver::keep_current`].

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclConfig_t, ncclUniqueId};
use parking_lot::Mutex;

use super::driver::{self, PrimaryContext};
use super::queue::back_off;
use crate::backend::{Move, PeerOp};
use crate::error::{Error, ErrorKind, Result};
use crate::types::DType;

mod api;
mod shrink;

pub use api::load;
use api::{api, check, nccl_type, text, Api, Comm, IN_PROGRESS, SUCCESS, SUM};
pub(super) use api::{BYTES, HALF, MAX};

/// Closes an NCCL group if `issue` unwinds: NCCL's group depth is per thread, and a group left
/// open would make every later group call on this thread launch nothing (the panic itself
/// poisons the context at the C boundary).
struct OpenGroup<'a>(&'a Api);

impl Drop for OpenGroup<'_> {
    fn drop(&mut self) {
        // SAFETY: the group this guard was made for is open.
        unsafe { (self.0.group_end)() };
    }
}

/// How a group's calls are queued: rank r's on `streams[r]` with `ctxs[r]` current; the group's
/// launch must leave the in-progress state by `deadline` ([`setup_time`]; the collective's own
/// timeout bounds its completion, in the backend).
pub struct Launch<'a> {
    pub streams: Vec<CUstream>,
    pub ctxs: Vec<&'a PrimaryContext>,
    pub deadline: Option<Instant>,
}

/// The least time given to creating communicators and to launching a group, whatever the
/// collective timeout: NCCL takes seconds to set up on a multi-GPU machine and connects ranks
/// lazily, during the launch of the first group that needs a connection (a new peer for sends,
/// since 2.22 a new algorithm for collectives), which the host cannot predict. A timeout tuned
/// for steady-state steps would otherwise fail such a step (or make AUTO fall back to peer
/// copies). 60 s, or `DPSYNC_NCCL_SETUP_TIMEOUT_MS` (read once; a test aid, and for machines
/// whose setup is slower still).
pub fn setup_time() -> Duration {
    static TIME: OnceLock<Duration> = OnceLock::new();
    *TIME.get_or_init(|| {
        std::env::var("DPSYNC_NCCL_SETUP_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::from_secs(60), Duration::from_millis)
    })
}

/// Serialises the group launches of every set in the process. NCCL asks that operations on
/// different communicators be issued in one order on every rank; sets sharing GPUs (contexts
/// over [0,1] and [1,0], or over overlapping devices) could otherwise interleave their launches
/// differently on each GPU.
static LAUNCH: Mutex<()> = Mutex::new(());

/// One communicator per device of a device set (rank i = i-th device), in one clique.
pub struct CommSet {
    ordinals: Vec<i32>,
    comms: Vec<Comm>,
    /// The clique rank of `comms[0]` (0 unless the clique spans the processes of a world).
    first: usize,
    aborted: Mutex<bool>,
}

// SAFETY: handles are used under `LAUNCH` (or at teardown, when no one else holds the set).
unsafe impl Send for CommSet {}
unsafe impl Sync for CommSet {}

/// The cache of live sets by device set.
fn cache() -> &'static Mutex<HashMap<Vec<i32>, Weak<CommSet>>> {
    static CACHE: OnceLock<Mutex<HashMap<Vec<i32>, Weak<CommSet>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

impl CommSet {
    /// The set for `devices` (distinct, in rank order): the cached one, or a new one.
    pub fn get(devices: &[&PrimaryContext], deadline: Option<Instant>) -> Result<Arc<CommSet>> {
        let ordinals: Vec<i32> = devices.iter().map(|d| d.ordinal).collect();
        let live = |cache: &HashMap<Vec<i32>, Weak<CommSet>>| {
            cache
                .get(&ordinals)
                .and_then(Weak::upgrade)
                .filter(|set| !*set.aborted.lock())
        };
        if let Some(set) = live(&cache().lock()) {
            return Ok(set);
        }
        // Not under the cache lock: a failing init aborts its set, and abort takes the lock.
        let set = Arc::new(CommSet::init(devices, ordinals.clone(), deadline)?);
        let mut cache = cache().lock();
        if let Some(other) = live(&cache) {
            return Ok(other); // another context made one meanwhile; ours is finalized on drop
        }
        cache.insert(ordinals, Arc::downgrade(&set));
        Ok(set)
    }

    fn init(
        devices: &[&PrimaryContext],
        ordinals: Vec<i32>,
        deadline: Option<Instant>,
    ) -> Result<CommSet> {
        let set = CommSet::issue(devices, ordinals, unique_id()?, devices.len(), 0)?;
        set.ready(deadline)?;
        Ok(set)
    }

    /// This process's ranks `first..` of a clique of `nranks` across the processes of a world
    /// (`id` made by one of them, [`unique_id`]), issued but not waited for ([`CommSet::ready`]):
    /// the processes check that every one issued its part before any waits. Not cached: the
    /// set belongs to one context.
    pub fn world(
        devices: &[&PrimaryContext],
        id: &[u8],
        nranks: usize,
        first: usize,
    ) -> Result<CommSet> {
        // SAFETY: zeroed is a valid bit pattern for this plain C struct.
        let mut unique: ncclUniqueId = unsafe { std::mem::zeroed() };
        if id.len() != unique.internal.len() {
            return Err(Error::invalid(format!(
                "an NCCL unique id of {} bytes (expected {})",
                id.len(),
                unique.internal.len()
            )));
        }
        for (to, &from) in unique.internal.iter_mut().zip(id) {
            *to = from as _;
        }
        let ordinals = devices.iter().map(|d| d.ordinal).collect();
        CommSet::issue(devices, ordinals, unique, nranks, first)
    }

    /// One group of inits, rank `first + i` on `devices[i]`; aborted if any fails.
    fn issue(
        devices: &[&PrimaryContext],
        ordinals: Vec<i32>,
        id: ncclUniqueId,
        nranks: usize,
        first: usize,
    ) -> Result<CommSet> {
        let n = nranks as c_int;
        let end = "ncclGroupEnd (communicator init)";
        let (comms, made) = CommSet::made_per_device(devices, end, |api, i, comm| {
            let (rank, mut config) = (first + i, config());
            // SAFETY: a fresh communicator slot, this device's context current.
            let code =
                unsafe { (api.comm_init_rank_config)(comm, n, id, rank as c_int, &mut config) };
            let what = format!(
                "ncclCommInitRankConfig(rank {rank}, cuda:{})",
                devices[i].ordinal
            );
            (code, what)
        })?;
        CommSet {
            ordinals,
            comms,
            first,
            aborted: Mutex::new(false),
        }
        .unless(made)
    }

    /// One communicator made per device in one group: `make(api, i, comm)` with device `i`'s
    /// context current returns NCCL's code and the call's name for errors. The communicators,
    /// and the first failure of the calls or of the group's end (named `end`).
    fn made_per_device(
        devices: &[&PrimaryContext],
        end: &str,
        mut make: impl FnMut(&Api, usize, &mut Comm) -> (u32, String),
    ) -> Result<(Vec<Comm>, Result<()>)> {
        let api = api()?;
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        let _kept = driver::keep_current()?;
        // SAFETY: group calls bracket one call per device, each with its context current.
        unsafe { check(api, (api.group_start)(), "ncclGroupStart")? };
        let mut made = Ok(());
        for (i, dev) in devices.iter().enumerate() {
            let bound = dev.bind();
            if let Err(e) = bound {
                made = made.and(Err(e));
                continue;
            }
            let (code, what) = make(api, i, &mut comms[i]);
            made = made.and(check(api, code, &what));
        }
        // SAFETY: closes the group opened above.
        let end = check(api, unsafe { (api.group_end)() }, end);
        Ok((comms, made.and(end)))
    }

    /// This set, or `made`'s failure with the set aborted.
    fn unless(self, made: Result<()>) -> Result<CommSet> {
        match made {
            Ok(()) => Ok(self),
            Err(e) => {
                self.abort();
                Err(e)
            }
        }
    }

    /// Waits until the communicators are ready (by `deadline`); aborted if they fail.
    pub fn ready(&self, deadline: Option<Instant>) -> Result<()> {
        self.poll_ready(deadline).inspect_err(|_| self.abort())
    }

    /// The communicators, unless aborted: the guard keeps `abort` (from another context sharing
    /// the set) from freeing them while they are used.
    fn live(&self) -> Result<parking_lot::MutexGuard<'_, bool>> {
        let aborted = self.aborted.lock();
        if *aborted {
            return Err(Error::new(
                ErrorKind::Backend,
                format!(
                    "the NCCL communicators of cuda:{:?} were aborted after a failure (in this or \
                     another context over the same GPUs)",
                    self.ordinals
                ),
            ));
        }
        Ok(aborted)
    }

    /// Rank `rank`'s asynchronous state: `SUCCESS` or `IN_PROGRESS`; an error state, or a
    /// failure of the query itself, is a BACKEND_ERROR naming the rank and its device.
    fn rank_state(&self, api: &Api, rank: usize) -> Result<u32> {
        let comm = self.comms[rank];
        let failed = |what: &str, code: u32| {
            Error::new(
                ErrorKind::Backend,
                format!(
                    "{what}NCCL rank {rank} (cuda:{}): {}",
                    self.ordinals[rank],
                    text(api, code, comm)
                ),
            )
        };
        if comm.is_null() {
            return Err(Error::new(
                ErrorKind::Backend,
                format!("NCCL rank {rank} has no communicator"),
            ));
        }
        let mut state = SUCCESS;
        // SAFETY: a live communicator (the callers hold the set live, or own it alone).
        let asked = unsafe { (api.comm_get_async_error)(comm, &mut state) };
        match (asked, state) {
            (SUCCESS, SUCCESS | IN_PROGRESS) => Ok(state),
            (SUCCESS, code) => Err(failed("", code)),
            (code, _) => Err(failed("ncclCommGetAsyncError failed for ", code)),
        }
    }

    /// Polls every communicator until its queued operation left the in-progress state. The
    /// caller holds [`CommSet::live`]'s guard, or is the set's only owner.
    fn poll_ready(&self, deadline: Option<Instant>) -> Result<()> {
        let api = api()?;
        for rank in 0..self.comms.len() {
            let mut spins = 0u32;
            while self.rank_state(api, rank)? == IN_PROGRESS {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "NCCL rank {rank} (cuda:{}) did not get ready in time",
                            self.ordinals[rank]
                        ),
                    ));
                }
                back_off(&mut spins);
            }
        }
        Ok(())
    }

    /// An error a communicator reported after its calls returned, if any.
    pub fn async_error(&self) -> Result<()> {
        let api = api()?;
        let _live = self.live()?;
        for rank in 0..self.comms.len() {
            self.rank_state(api, rank)?;
        }
        Ok(())
    }

    pub fn ranks(&self) -> usize {
        self.comms.len()
    }

    /// Runs `issue` between `ncclGroupStart` and `ncclGroupEnd` with the communicators live and
    /// the process's group launches serialised, then polls until every rank left the
    /// in-progress state (by the launch's deadline) before any other call may use them.
    /// `issue` queues calls and reports the first failure; the group is closed either way.
    fn grouped(
        &self,
        what: &str,
        launch: &Launch<'_>,
        issue: impl FnOnce(&Api) -> Result<()>,
    ) -> Result<()> {
        let api = api()?;
        let order = LAUNCH.lock();
        // Held through the poll: no other context may call on these communicators before
        // they left the in-progress state (NCCL's rule for non-blocking communicators).
        let _live = self.live()?;
        let _kept = driver::keep_current()?;
        // SAFETY: group calls around calls on live communicators.
        check(api, unsafe { (api.group_start)() }, "ncclGroupStart")?;
        let open = OpenGroup(api);
        let queued = issue(api);
        std::mem::forget(open);
        // SAFETY: closes the group opened above.
        let end = check(
            api,
            unsafe { (api.group_end)() },
            &format!("ncclGroupEnd ({what})"),
        );
        // Issued: other sets may launch while this one finishes (connecting, enqueueing).
        drop(order);
        queued.and(end)?;
        self.poll_ready(launch.deadline)
    }

    /// One call per rank in one group: `call(api, rank, comm, stream)` with rank's context
    /// current; `what` names the NCCL function in errors.
    fn per_rank(
        &self,
        what: &str,
        launch: &Launch<'_>,
        call: impl Fn(&Api, usize, Comm, CUstream) -> u32,
    ) -> Result<()> {
        self.grouped(what, launch, |api| {
            let mut queued = Ok(());
            for (rank, &comm) in self.comms.iter().enumerate() {
                let done = launch.ctxs[rank].bind().and_then(|_bound| {
                    let code = call(api, rank, comm, launch.streams[rank]);
                    check(api, code, &format!("{what} (rank {rank})"))
                });
                queued = queued.and(done);
            }
            queued
        })
    }

    /// One in-place allreduce (sum) per rank on `bufs[rank]`, in one group.
    pub fn allreduce(
        &self,
        dtype: DType,
        count: usize,
        bufs: &[u64],
        launch: &Launch<'_>,
    ) -> Result<()> {
        self.allreduce_as((nccl_type(dtype), SUM), count, bufs, launch)
    }

    /// [`CommSet::allreduce`] of NCCL element type `ty` with reduction `op`.
    pub fn allreduce_as(
        &self,
        (ty, op): (u32, u32),
        count: usize,
        bufs: &[u64],
        launch: &Launch<'_>,
    ) -> Result<()> {
        self.per_rank("ncclAllReduce", launch, |api, rank, comm, stream| {
            let buf = bufs[rank] as *mut c_void;
            // SAFETY: a live communicator; the buffer holds `count` elements on rank's device.
            unsafe { (api.all_reduce)(buf, buf, count, ty, op, comm, stream) }
        })
    }

    /// One in-place broadcast per rank of `count` elements from rank `root`'s `bufs[root]` into
    /// every rank's `bufs[rank]`, in one group.
    pub fn broadcast(
        &self,
        dtype: DType,
        count: usize,
        root: usize,
        bufs: &[u64],
        launch: &Launch<'_>,
    ) -> Result<()> {
        let root = root as c_int;
        self.per_rank("ncclBroadcast", launch, |api, rank, comm, stream| {
            let buf = bufs[rank] as *mut c_void;
            // SAFETY: as for allreduce.
            unsafe { (api.broadcast)(buf, buf, count, nccl_type(dtype), root, comm, stream) }
        })
    }

    /// One in-place reduce-scatter (sum) per rank in one group: `bufs[rank]` holds a block of
    /// `count` elements per clique rank; the block of this rank's clique rank gets the sum
    /// (NCCL's in-place form: the receive buffer is the send buffer's own block).
    pub fn reduce_scatter(
        &self,
        dtype: DType,
        count: usize,
        bufs: &[u64],
        launch: &Launch<'_>,
    ) -> Result<()> {
        let block = (count * dtype.size()) as u64;
        self.per_rank("ncclReduceScatter", launch, |api, rank, comm, stream| {
            let send = bufs[rank] as *const c_void;
            let recv = (bufs[rank] + (self.first + rank) as u64 * block) as *mut c_void;
            // SAFETY: a live communicator; the buffer holds a block per clique rank.
            unsafe { (api.reduce_scatter)(send, recv, count, nccl_type(dtype), SUM, comm, stream) }
        })
    }

    /// One in-place allgather per rank in one group: `bufs[rank]` holds a block of `bytes` per
    /// clique rank; every block gets its clique rank's own (NCCL's in-place form: the send
    /// buffer is the receive buffer's own block).
    pub fn allgather(&self, bytes: usize, bufs: &[u64], launch: &Launch<'_>) -> Result<()> {
        self.per_rank("ncclAllGather", launch, |api, rank, comm, stream| {
            let recv = bufs[rank] as *mut c_void;
            let send = (bufs[rank] + ((self.first + rank) * bytes) as u64) as *const c_void;
            // SAFETY: as for reduce_scatter.
            unsafe { (api.all_gather)(send, recv, bytes, BYTES, comm, stream) }
        })
    }

    /// Point-to-point byte transfers in one group: for each move, this process's rank
    /// `src_group` sends `bytes`
    /// at `src` (queued on its stream) and rank `dst_group` receives them at `dst` (on its
    /// stream); the two differ. NCCL pairs the k-th send from a to b with the k-th
    /// receive at b from a: both are queued in the order given.
    pub fn send_recv(&self, moves: &[Move], launch: &Launch<'_>) -> Result<()> {
        self.grouped("send/recv", launch, |api| {
            let mut queued = Ok(());
            for m in moves {
                let (from, src, to, dst, bytes) = (m.src_group, m.src, m.dst_group, m.dst, m.bytes);
                let (send_comm, recv_comm) = (self.comms[from], self.comms[to]);
                // Peers by their clique rank.
                let (peer_from, peer_to) = (self.first + from, self.first + to);
                let sent = launch.ctxs[from].bind().and_then(|_bound| {
                    // SAFETY: a live communicator; `src` holds `bytes` on rank `from`'s device.
                    let code = unsafe {
                        (api.send)(
                            src as *const c_void,
                            bytes,
                            BYTES,
                            peer_to as c_int,
                            send_comm,
                            launch.streams[from],
                        )
                    };
                    check(api, code, &format!("ncclSend (rank {from} to {to})"))
                });
                let received = launch.ctxs[to].bind().and_then(|_bound| {
                    // SAFETY: as above, `dst` on rank `to`'s device.
                    let code = unsafe {
                        (api.recv)(
                            dst as *mut c_void,
                            bytes,
                            BYTES,
                            peer_from as c_int,
                            recv_comm,
                            launch.streams[to],
                        )
                    };
                    check(api, code, &format!("ncclRecv (rank {to} from {from})"))
                });
                queued = queued.and(sent).and(received);
            }
            queued
        })
    }

    /// Sends and receives to and from clique ranks (this process's or another's) in one group:
    /// each op on its group's rank and stream, in the order given (NCCL pairs the k-th send
    /// from a to b with the k-th receive at b from a).
    pub fn exchange(&self, ops: &[PeerOp], launch: &Launch<'_>) -> Result<()> {
        self.grouped("send/recv", launch, |api| {
            let mut queued = Ok(());
            for op in ops {
                let (comm, stream) = (self.comms[op.group], launch.streams[op.group]);
                let (rank, peer) = (self.first + op.group, op.peer as c_int);
                let done = launch.ctxs[op.group].bind().and_then(|_bound| {
                    // SAFETY: a live communicator; `at` holds `bytes` on the group's device.
                    let code = unsafe {
                        if op.send {
                            (api.send)(op.at as *const c_void, op.bytes, BYTES, peer, comm, stream)
                        } else {
                            (api.recv)(op.at as *mut c_void, op.bytes, BYTES, peer, comm, stream)
                        }
                    };
                    let what = if op.send { "ncclSend" } else { "ncclRecv" };
                    check(api, code, &format!("{what} (rank {rank}, peer {peer})"))
                });
                queued = queued.and(done);
            }
            queued
        })
    }

    /// Cancels everything and frees the communicators (error paths, timeouts).
    pub fn abort(&self) {
        let mut aborted = self.aborted.lock();
        if *aborted {
            return;
        }
        *aborted = true;
        let kept = driver::keep_current();
        if let Ok(api) = api() {
            for &comm in &self.comms {
                if !comm.is_null() {
                    // SAFETY: a live communicator, never used again.
                    unsafe { (api.comm_abort)(comm) };
                }
            }
        }
        drop(kept);
        // Lock order is cache, then aborted (CommSet::get): release ours first.
        drop(aborted);
        // Only our own entry: another, live set may be cached under the same devices.
        let mut cache = cache().lock();
        if cache
            .get(&self.ordinals)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), self))
        {
            cache.remove(&self.ordinals);
        }
    }
}

impl Drop for CommSet {
    fn drop(&mut self) {
        if *self.aborted.lock() {
            return;
        }
        let Ok(api) = api() else { return };
        let order = LAUNCH.lock();
        let _kept = driver::keep_current();
        // Bounded: a set whose work never ends is aborted rather than hang its last owner.
        let deadline = Some(Instant::now() + setup_time());
        // SAFETY: the last owner; finalize flushes, then destroy frees.
        unsafe {
            (api.group_start)();
            for &comm in &self.comms {
                (api.comm_finalize)(comm);
            }
            (api.group_end)();
            drop(order);
            if self.poll_ready(deadline).is_err() {
                for &comm in &self.comms {
                    (api.comm_abort)(comm);
                }
                return;
            }
            for &comm in &self.comms {
                (api.comm_destroy)(comm);
            }
        }
    }
}

/// A new NCCL unique id (the bootstrap address of a clique), as bytes.
pub fn unique_id_bytes() -> Result<Vec<u8>> {
    Ok(unique_id()?.internal.iter().map(|&c| c as u8).collect())
}

fn unique_id() -> Result<ncclUniqueId> {
    let api = api()?;
    // SAFETY: zeroed is a valid bit pattern for this plain C struct.
    let mut id: ncclUniqueId = unsafe { std::mem::zeroed() };
    // SAFETY: writes the id.
    check(
        api,
        unsafe { (api.get_unique_id)(&mut id) },
        "ncclGetUniqueId",
    )?;
    Ok(id)
}

/// NCCL_CONFIG_INITIALIZER with `blocking = 0`: every field "undefined" (library default)
/// except the ones the header fixes.
fn config() -> ncclConfig_t {
    // SAFETY: a plain C struct; every field is set below or is a null pointer.
    let mut c: ncclConfig_t = unsafe { std::mem::zeroed() };
    const UNDEF: c_int = c_int::MIN;
    c.size = std::mem::size_of::<ncclConfig_t>();
    c.magic = 0xcafe_beef;
    c.version = 23000;
    c.blocking = 0;
    c.cgaClusterSize = UNDEF;
    c.minCTAs = UNDEF;
    c.maxCTAs = UNDEF;
    c.splitShare = UNDEF;
    c.trafficClass = UNDEF;
    c.collnetEnable = UNDEF;
    c.CTAPolicy = UNDEF;
    c.shrinkShare = UNDEF;
    c.nvlsCTAs = UNDEF;
    c.nChannelsPerNetPeer = UNDEF;
    c.nvlinkCentricSched = UNDEF;
    c.graphUsageMode = UNDEF;
    c.numRmaCtx = UNDEF;
    c.maxP2pPeers = UNDEF;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_nccl_config_initializer_with_blocking_off() {
        let c = config();
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.minCTAs, c_int::MIN);
        assert!(c.netName.is_null());
    }
}
