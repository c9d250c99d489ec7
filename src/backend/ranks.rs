//! Level 3's primitive: the engine between the ranks (processes) of a world, and what its
//! transfers carry.

use super::Segment;
use crate::error::{Error, Result};
use crate::types::DType;

/// Level 3: the ranks (processes) of a world. Every rank makes the same calls in the same order
/// (the executor's agreement sees to it); each call returns once this rank's part is done, or
/// fails with TIMEOUT when the others did not take part within the world's timeout, after which
/// every call is refused (INVALID_STATE: the ranks may have parted ways).
pub(crate) trait Ranks: Send {
    /// This process's rank and the number of ranks.
    fn rank(&self) -> usize;
    fn ranks(&self) -> usize;

    /// What `dpsync_describe` shows of the engine under "world" (engine, library).
    fn describe(&self) -> serde_json::Value;

    /// The collective the next exchanges belong to (its call, e.g.
    /// `dpsync_allreduce(name='w', op=Sum)`): errors, timeouts above all, name it.
    fn begin(&self, call: &str);

    /// The collective's agreement passed on every rank: from now on a failure of this rank's
    /// part of it is voted a loss ([`Ranks::vote_lost`]), so that every survivor answers it
    /// alike.
    fn agreed(&self) {}

    /// Every segment's `ptrs[0]` := the sum over the ranks of the sum of its `ptrs` (this
    /// rank's contributions: the leader alone after a local reduction, or every local replica),
    /// divided by `avg` if given; the same bytes on every rank. The segments travel as one
    /// message (a fused bucket), in order. f16/bf16 are summed and divided in f32 and rounded
    /// once, so exec hands their local replicas over unreduced.
    ///
    /// # Safety
    /// Every pointer is valid for `count` aligned elements of `dtype` in host memory.
    unsafe fn allreduce(
        &self,
        channel: Channel,
        dtype: DType,
        segments: &[Segment<'_>],
        avg: Option<usize>,
    ) -> Result<()>;

    /// The reproducible sum (backend/host/repro.rs) of every segment over the ranks, divided by
    /// `avg` if given, into its `ptrs` (at least `ptrs[0]`), where the engine can compute it from
    /// the ranks' raw values: any float, `contributions[r]` on rank r (this rank's: every
    /// segment's `ptrs`; one F32/F64 per rank through shared memory: its ring; otherwise every
    /// contribution's slice sent raw to the slice's owner rank, summed there, the sums
    /// gathered back). The same bytes as the exponents' maximum then the integers' sum
    /// (exec/repro.rs). `false` (and nothing moved) where it cannot, alike on every rank.
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`].
    unsafe fn allreduce_reproducible(
        &self,
        channel: Channel,
        data: (DType, &[Segment<'_>], &[usize]),
        avg: Option<usize>,
    ) -> Result<bool>;

    /// A reduce-scatter: the sum of [`Ranks::allreduce`] (or, with `reproducible`, of
    /// [`Ranks::allreduce_reproducible`]), written to each contribution's own elements alone:
    /// `owned` holds `(first, count)` for every contribution of every segment (segment after
    /// segment, in `ptrs` order, ascending), and `ptrs[j]` gets the sum in its elements only.
    /// Nothing else of the segments is written. The engine may read and write less than an
    /// allreduce does (through shared memory it copies out the owned elements alone). `false`
    /// (nothing moved) only with `reproducible`, where the engine's ring cannot sum it in one
    /// exchange (the callers then reduce-scatter a copy), alike on every rank. `every_rank`: every rank's elements, which lets an
    /// engine sum each rank's at that rank ([`EveryRank`]).
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`].
    unsafe fn reduce_scatter(
        &self,
        channel: Channel,
        data: (DType, &[Segment<'_>], &[(usize, usize)]),
        avg: Option<usize>,
        reproducible: bool,
        every_rank: Option<EveryRank<'_>>,
    ) -> Result<bool>;

    /// An allgather of owned ranges: every span `s` (`(ptr, bytes)`, alike in size on every
    /// rank) gets each rank `r`'s bytes `owned(s, r)` = `(offset, bytes)` (the ranks' ranges
    /// disjoint, alike on every rank); this rank's own ranges are only read. One exchange:
    /// every rank's owned bytes in one [`Ranks::allgather_spans`], each rank's unpacked into
    /// its ranges; an engine may do better (through shared memory, one copy each way).
    ///
    /// # Safety
    /// Every span is valid for its bytes in host memory.
    unsafe fn allgather_owned(
        &self,
        spans: &[(usize, usize)],
        owned: &dyn Fn(usize, usize) -> (usize, usize),
    ) -> Result<()> {
        allgather_packed(self, spans, owned)
    }

    /// Every element of `data` := its maximum over the ranks: unsigned integers of one byte,
    /// or of two in native order with `wide` (the exponents of reproducible sums,
    /// exec/repro.rs). One message per piece, on `channel`.
    fn allreduce_max(&self, channel: Channel, data: &mut [u8], wide: bool) -> Result<()>;

    /// Starts a gradient step's bucket transfer on [`Channel::Steps`] without waiting for it
    /// (`dpsync_grad_ready` in a world), after the buckets started before it: every segment's
    /// contributions (its `ptrs`) are read and summed as its pieces are issued (now, at later
    /// pokes, or in `finish`), and [`Ranks::finish`] writes the result into every one of
    /// them. `count` elements in all; no segments: zeros of that size (a stand-in for a
    /// bucket another rank started, when a failed step is drained). A ticket dropped
    /// unfinished sends zeros for what is left. With `early` and one contribution per
    /// segment, the results may be written into it as the pieces complete, its original
    /// bytes kept aside and put back if the step fails (`finish` without `write`, or
    /// [`Ranks::hold`]). With `gate`, nothing of the contributions is read before the gate
    /// says they are ready (a device-to-host copy still running into them). With
    /// `reproducible` (every rank's contributions, this rank's every segment's `ptrs`), the
    /// sum is [`Ranks::allreduce_reproducible`]'s (its bytes), where
    /// [`Ranks::starts_reproducibly`] says the engine can.
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`], until `finish` or until the ticket is dropped.
    unsafe fn start(
        &self,
        dtype: DType,
        segments: &[Segment<'_>],
        count: usize,
        avg_early_reproducible: (Option<usize>, bool, Option<&[usize]>),
        gate: Option<Gate>,
    ) -> Result<Ticket>;

    /// Whether [`Ranks::start`] can sum a bucket of `dtype` reproducibly (host contributions):
    /// the engine's own reproducible sum of the ranks' raw values, as the started transfer
    /// goes. Alike on every rank.
    fn starts_reproducibly(&self, dtype: DType) -> bool {
        let _ = dtype;
        false
    }

    /// A collective other than the started transfers' step is being agreed: results written
    /// early go back to the original bytes, and the rest are held until the step agrees (a
    /// refused call changes nothing).
    fn hold(&self);

    /// Waits for a started transfer within the timeout (a timeout fails the world) and, with
    /// `write`, writes its result.
    ///
    /// # Safety
    /// The outputs given to [`Ranks::start`] are still valid.
    unsafe fn finish(&self, ticket: Ticket, write: bool) -> Result<()>;

    /// The step of a started transfer agreed ([`Ranks::finish`] will write its result): its
    /// pieces completing from now on may be written into the outputs at once. Called for
    /// every started transfer of the step before the first is finished, so that the later
    /// buckets' results land in place while the earlier are finished. With `owned` (the step
    /// is a reduce-scatter; as for [`Ranks::reduce_scatter`], a piece per contribution), only
    /// the contributions' own elements are written: a started bucket serves either step.
    ///
    /// # Safety
    /// As for [`Ranks::finish`] with `write`.
    unsafe fn release(&self, ticket: &Ticket, owned: Option<&[(usize, usize)]>);

    /// Lets started transfers advance without waiting (issuing the next pieces as others
    /// complete): an MPI moves a non-blocking collective only inside its calls, so
    /// `dpsync_grad_ready` pokes the step's transfers at every mark (backward runs meanwhile).
    fn poke(&self);

    /// Every span `(ptr, bytes)` := rank `root`'s, as one message.
    ///
    /// # Safety
    /// Every span is valid for `bytes` bytes in host memory.
    unsafe fn broadcast(&self, spans: &[(usize, usize)], root: usize) -> Result<()>;

    /// Every rank's `bytes` (of any length), in rank order.
    fn allgather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// The engine of the ranks that remain when `left` leave (called by every remaining rank
    /// alone), renumbered in their order.
    fn without(&self, left: &[usize]) -> Result<Box<dyn Ranks>>;

    /// An elastic world's vote after a collective (every rank that made its agreement votes):
    /// whether a rank was lost, alike on every survivor; `None` where nothing was agreed since
    /// the last vote, or the world is not elastic. `failed_here`: why this rank's part of the
    /// call failed after its agreement passed (its device, a copy, a peer's process seen gone),
    /// which this rank votes a loss for.
    fn vote_lost(&self, failed_here: Option<&str>) -> Result<Option<bool>>;

    /// An elastic world's other ranks on this host and their process ids: the CUDA backend
    /// watches them in its waits on the device (`WorldCollective::watch`).
    fn neighbours(&self) -> Vec<(usize, u32)> {
        Vec::new()
    }

    /// After a vote found a loss: the engine of the survivors (renumbered in their order) and
    /// the lost ranks (this engine's numbers), alike on every survivor.
    fn shrunk(&self) -> Result<(Box<dyn Ranks>, Vec<usize>)>;

    /// Every rank's `words`, as many on every rank, concatenated in rank order: one exchange
    /// where [`Ranks::allgather`] needs two (the lengths first). Words keep records aligned for
    /// any dtype.
    fn allgather_fixed(&self, words: &[u64]) -> Result<Vec<u64>>;

    /// Every rank's spans `(ptr, bytes)`, each rank's concatenated, in rank order (one
    /// message: a sparse gather's rows).
    ///
    /// # Safety
    /// Every span is valid for `bytes` bytes in host memory.
    unsafe fn allgather_spans(&self, spans: &[(usize, usize)]) -> Result<Vec<Vec<u8>>> {
        let mut mine = Vec::with_capacity(spans.iter().map(|s| s.1).sum());
        for &(ptr, bytes) in spans.iter().filter(|s| s.1 > 0) {
            mine.extend_from_slice(std::slice::from_raw_parts(ptr as *const u8, bytes));
        }
        self.allgather(&mine)
    }
}

/// Every rank's elements of a [`Ranks::reduce_scatter`], alike on every rank.
// Read by the engine only (the MPI one is built with the `mpi` feature).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
#[derive(Clone, Copy)]
pub(crate) struct EveryRank<'a> {
    /// Rank `r`'s `(first, count)` of segment `s`: its contributions' pieces end to end.
    pub(crate) owned: &'a dyn Fn(usize, usize) -> (usize, usize),
    /// Whether every rank has one contribution.
    pub(crate) one_each: bool,
}

/// [`Ranks::allgather_owned`] as one [`Ranks::allgather_spans`] of every rank's owned bytes,
/// each rank's unpacked into its ranges: any engine's way.
///
/// # Safety
/// As for [`Ranks::allgather_owned`].
pub(crate) unsafe fn allgather_packed(
    ranks: &(impl Ranks + ?Sized),
    spans: &[(usize, usize)],
    owned: &dyn Fn(usize, usize) -> (usize, usize),
) -> Result<()> {
    let me = ranks.rank();
    let range = |s: usize, r: usize| {
        let (offset, bytes) = owned(s, r);
        (spans[s].0 + offset, bytes)
    };
    let mine: Vec<(usize, usize)> = (0..spans.len()).map(|s| range(s, me)).collect();
    let all = ranks.allgather_spans(&mine)?;
    for (r, bytes) in all.iter().enumerate().filter(|&(r, _)| r != me) {
        let mut at = 0;
        for s in 0..spans.len() {
            let (ptr, n) = range(s, r);
            let Some(part) = bytes.get(at..at + n) else {
                return Err(Error::inconsistent(format!(
                    "dpsync_allgather: rank {r} sent {} bytes, fewer than the pieces it owns",
                    bytes.len()
                )));
            };
            std::ptr::copy_nonoverlapping(part.as_ptr(), ptr as *mut u8, n);
            at += n;
        }
    }
    Ok(())
}

/// Which of the engine's channels a transfer goes on: the collectives', or the gradient
/// steps' (whose buckets may start ahead of `dpsync_allreduce_grads`, so they keep an order of
/// their own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Channel {
    Calls,
    Steps,
}

/// A transfer started by [`Ranks::start`], finished by [`Ranks::finish`] (the engine's own
/// state, opaque here). Dropped unfinished, it leaks its buffers: the transfer may still write.
// Read by the engine only (the MPI one is built with the `mpi` feature).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) struct Ticket(pub(crate) Box<dyn std::any::Any + Send>);

/// Whether a started transfer's contributions are ready to be read ([`Ranks::start`]): asked
/// by whichever thread moves the transfers, until it says yes; an error fails the world.
pub(crate) type Gate = Box<dyn FnMut() -> Result<bool> + Send>;

/// Whether process `pid` of this host is gone (a world's rank that died: MPI may not report it
/// where a survivor waits). Without worlds (no `mpi` feature) there is none to ask about.
pub(crate) fn process_gone(pid: u32) -> bool {
    #[cfg(feature = "mpi")]
    {
        // SAFETY: signal 0 only asks whether the process exists.
        let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
        rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = pid;
        false
    }
}
