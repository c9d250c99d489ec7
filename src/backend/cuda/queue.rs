//! The CUDA backend's completion queue and failure state: the stream protocol
//! ([`Streams`]: events on the callers' streams around every collective), the collectives
//! issued and not yet seen complete, what they leave behind until then, and the one polling
//! loop every host wait goes through (within the timeout, watching NCCL's asynchronous errors).
//! A timeout or a device or transport fault fails the context: every later collective is
//! refused.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::driver::{self, DeviceMemory, Event};
use super::nccl;
use super::sparse::{CheckSlot, DeferredCheck};
use super::trace::Timing;
use super::{distinct_callers, CudaBackend, Group};
use crate::backend::spares::Spares;
use crate::backend::{BucketStage, Done, Streams};
use crate::error::{Error, ErrorKind, Result};
use crate::types::Memory;

/// What a collective leaves behind until it completes, besides its completion events.
#[derive(Default)]
pub(super) struct Leftovers {
    /// Device index checks whose answers arrive with the collective.
    pub(super) checks: Vec<DeferredCheck>,
    /// The timeline's start events of the collective being issued (`trace.rs`).
    pub(super) timing_starts: Option<Vec<Event>>,
    /// Memory its queued work, or work issued before it, may still use: coalescing maps, and
    /// [`Allocation`]s dropped meanwhile ([`Dropped`]). Spares once it completes.
    pub(super) keep: Vec<DeviceMemory>,
    /// As `keep`, but not worth keeping for reuse (outgrown scratch buffers, the tables of a
    /// full cache): freed by the next `synchronize` once it completes.
    pub(super) retire: Vec<DeviceMemory>,
}

/// A collective whose completion has not been observed yet.
pub(super) struct Pending {
    issued: Instant,
    /// One completion event per group.
    done: Vec<Event>,
    leftovers: Leftovers,
    /// Its device span's events, when tracing.
    timing: Option<Timing>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) pending: VecDeque<Pending>,
    /// Completion events for reuse.
    pub(super) spare: Vec<Vec<Event>>,
    /// Gathered between `begin` and `end` for the collective being issued.
    pub(super) issuing: Leftovers,
    /// Index-check buffers for reuse.
    pub(super) check_slots: Vec<CheckSlot>,
    /// The first index found out of range by a completed device check, and how many more checks
    /// failed after it (a caller that never synchronizes must not grow this), reported by
    /// `synchronize`.
    pub(super) index_error: Option<(Error, usize)>,
    /// Set by a timeout or a device fault: every later collective is refused.
    pub(super) failed: Option<Error>,
    /// Memory of completed collectives for reuse.
    pub(super) spares: Spares<DeviceMemory>,
    /// Outgrown page-locked staging buffers (`cuMemFreeHost` may wait for the device too), freed
    /// by `synchronize`.
    pub(super) retired_host: Vec<driver::PinnedMemory>,
}

pub(super) fn deadline(issued: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| issued + t)
}

/// The deadline of NCCL setup work and group launches started at `issued` ([`nccl::setup_time`]).
pub(super) fn setup_deadline(issued: Instant, timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| issued + t.max(nccl::setup_time()))
}

/// One pause of a polling loop: yields at first, then sleeps 50 µs (a long wait should not
/// hold a core).
pub(super) fn back_off(spins: &mut u32) {
    *spins += 1;
    if *spins < 1000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl CudaBackend {
    /// Blocks the host until `group`'s stream has run everything queued on it so far, polling
    /// as `reap` does: within the timeout, watching NCCL's asynchronous errors
    /// (`cuStreamSynchronize` would wait forever behind a stuck NCCL kernel). Called inside a
    /// collective, so a timeout or an error fails the context through `collective_failed`.
    pub(super) fn wait_group(&self, group: &Group) -> Result<()> {
        let _bound = group.ctx.bind()?;
        group.progress.record(group.stream.0)?;
        self.poll(
            deadline(Instant::now(), self.timeout),
            true,
            || group.progress.query(),
            |ms| {
                format!(
                    "cuda:{}: the work queued before this collective did not finish within the \
                     {ms} ms timeout; the context refuses further collectives (destroy it)",
                    group.ctx.ordinal
                )
            },
        )
        .map(drop)
    }

    /// Polls `done` until it holds (`Ok(true)`), `limit` passes (the timeout, counted from when
    /// the wait began; `late(timeout_ms)` words the TIMEOUT) or, with `wait` false, after one
    /// look (`Ok(false)` when not done), watching NCCL's asynchronous errors meanwhile. Every
    /// host wait on the device goes through here.
    pub(super) fn poll(
        &self,
        limit: Option<Instant>,
        wait: bool,
        mut done: impl FnMut() -> Result<bool>,
        late: impl Fn(u128) -> String,
    ) -> Result<bool> {
        let (mut spins, mut looked) = (0u32, None);
        loop {
            let complete = done()?;
            if let Some(comms) = self.comms.lock().as_ref() {
                comms.async_error()?;
            }
            if complete {
                return Ok(true);
            }
            if limit.is_some_and(|d| Instant::now() >= d) {
                let ms = self.timeout.unwrap_or_default().as_millis();
                return Err(Error::new(ErrorKind::Timeout, late(ms)));
            }
            if !wait {
                return Ok(false);
            }
            self.watch_peers(&mut looked)?;
            back_off(&mut spins);
        }
    }

    pub(super) fn sync_group(&self, group: &Group) -> Result<()> {
        // SAFETY: our stream.
        driver::check(
            unsafe { sys::cuStreamSynchronize(group.stream.0) },
            "cuStreamSynchronize",
        )
    }

    /// Records each distinct caller stream's start event: it marks the work queued there so far.
    pub(super) fn mark_callers(&self) -> Result<()> {
        for r in self.callers.iter().map(|&r| &self.replicas[r]) {
            let _bound = self.groups[r.group].ctx.bind()?;
            r.start.record(r.stream as sys::CUstream)?;
        }
        Ok(())
    }

    /// Drops completed collectives; a collective older than the timeout is a TIMEOUT. With
    /// `wait`, until every one has completed.
    pub(super) fn reap(&self, state: &mut State, wait: bool) -> Result<()> {
        while let Some(front) = state.pending.front() {
            let done = || {
                for ev in &front.done {
                    if !ev.query()? {
                        return Ok(false);
                    }
                }
                Ok(true)
            };
            let late = |ms| {
                format!(
                    "a collective issued {:.1} ms ago did not complete within the {ms} ms \
                     timeout; the context refuses further collectives (destroy it)",
                    front.issued.elapsed().as_secs_f64() * 1e3,
                )
            };
            if !self.poll(deadline(front.issued, self.timeout), wait, done, late)? {
                return Ok(());
            }
            let Pending {
                done,
                leftovers,
                timing,
                ..
            } = state.pending.pop_front().expect("front exists");
            state.spare.push(done);
            if let Some(timing) = timing {
                self.emit(timing);
            }
            for check in leftovers.checks {
                let (slot, error) = check.finish();
                match (&mut state.index_error, error) {
                    (Some((_, more)), Some(_)) => *more += 1,
                    (first @ None, Some(e)) => *first = Some((e, 0)),
                    (_, None) => {}
                }
                state.check_slots.push(slot);
            }
            state.spares.put(leftovers.keep);
            state.spares.retire(leftovers.retire);
        }
        Ok(())
    }

    /// Records a failure that makes the context unusable, aborting the communicators (during
    /// an elastic world's call, once it ended: a shrink needs them, world.rs).
    pub(super) fn fail(&self, state: &mut State, err: Error) -> Error {
        if !self.holds_clique() {
            if let Some(comms) = self.comms.lock().take() {
                comms.abort();
            }
        }
        // The first failure is the one to report to every later call.
        state.failed.get_or_insert_with(|| err.clone());
        err
    }

    /// An NCCL group may be half launched: aborts the communicators (their kernels end, so the
    /// callers' streams do not wait forever) and refuses further collectives.
    pub(super) fn nccl_failed(&self, err: Error) -> Error {
        let mut state = self.state.lock();
        self.fail(&mut state, err)
    }

    pub(super) fn refuse_if_failed(state: &State) -> Result<()> {
        match &state.failed {
            Some(e) => Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "the context is unusable after an earlier failure ({}); destroy it",
                    e.message
                ),
            )),
            None => Ok(()),
        }
    }

    /// Observes the queue; a timeout or device fault poisons the context.
    pub(super) fn observe(&self, wait: bool) -> Result<()> {
        let mut state = self.state.lock();
        Self::refuse_if_failed(&state)?;
        match self.reap(&mut state, wait) {
            Ok(()) => Ok(()),
            Err(e) if e.kind == ErrorKind::Timeout || e.kind == ErrorKind::Backend => {
                Err(self.fail(&mut state, e))
            }
            Err(e) => Err(e),
        }
    }

    /// Waits for everything issued, then reports (once) the indices that device checks found
    /// out of range.
    pub(super) fn synchronize_queue(&self) -> Result<()> {
        self.observe(true)?;
        let (retired, retired_host, index_error) = {
            let mut state = self.state.lock();
            let retired = state.spares.take_retired();
            let retired_host = std::mem::take(&mut state.retired_host);
            (retired, retired_host, state.index_error.take())
        };
        // The host waits here anyway: free what retired (cuMemFree waits for the device), not
        // under the state lock.
        drop(retired);
        drop(retired_host);
        drop(self.retired_stages());
        match index_error {
            None => Ok(()),
            Some((mut first, more)) => {
                if more > 0 {
                    first.message += &format!(" (and {more} more out-of-range checks)");
                }
                Err(first)
            }
        }
    }
}

impl Streams for CudaBackend {
    fn memory_of(&self, replica: usize, ptr: usize) -> Result<Memory> {
        let group = &self.groups[self.replicas[replica].group];
        let want = group.ctx.ordinal;
        let _bound = group.ctx.bind()?;
        match driver::pointer_memory(ptr)? {
            // Managed memory is device memory for every GPU, wherever it lives now: its memory
            // type may read HOST or DEVICE depending on where it was last touched.
            Some((_, _, true)) => Ok(Memory::Device),
            None | Some((false, _, _)) => Ok(Memory::Host),
            Some((true, got, false)) if got == want => Ok(Memory::Device),
            Some((true, got, false)) => Err(Error::invalid(format!(
                "device memory of cuda:{got}, but replica {replica} is on cuda:{want}"
            ))),
        }
    }

    fn set_stream(&mut self, replica: usize, stream: usize) -> Result<()> {
        let group = &self.groups[self.replicas[replica].group];
        // The special handles: cuStreamGetCtx would answer with the calling thread's current
        // context, not the stream's.
        const LEGACY: usize = 0x1;
        const PER_THREAD: usize = 0x2;
        if stream == PER_THREAD {
            return Err(Error::invalid(format!(
                "cuda_stream: cudaStreamPerThread (0x2) for replica {replica} names a different \
                 stream on every thread, so dpsync's events would not order the caller's work; \
                 pass the stream's own handle"
            )));
        }
        // The legacy default stream of the replica's device, whichever handle names it.
        let stream = if stream == LEGACY { 0 } else { stream };
        if stream != 0 {
            let ctx = driver::stream_context(stream as sys::CUstream).map_err(|e| {
                Error::invalid(format!(
                    "cuda_stream: not a usable stream for replica {replica} ({})",
                    e.message
                ))
            })?;
            if ctx != group.ctx.ctx {
                return Err(Error::invalid(format!(
                    "cuda_stream: the stream belongs to another context than replica {replica}'s \
                     device (cuda:{}, primary context)",
                    group.ctx.ordinal
                )));
            }
        }
        self.replicas[replica].stream = stream;
        self.callers = distinct_callers(&self.groups, &self.replicas);
        Ok(())
    }

    fn begin(&self) -> Result<()> {
        self.observe(false)?;
        self.mark_callers()?;
        for g in &self.groups {
            // The stream names its context, but some drivers want it current for a wait on an
            // event of another device; cheap when it already is.
            let _bound = g.ctx.bind()?;
            for r in self.callers.iter().map(|&r| &self.replicas[r]) {
                r.start.wait_on(g.stream.0)?;
            }
        }
        let starts = self.timing_starts()?;
        self.state.lock().issuing.timing_starts = starts;
        Ok(())
    }

    fn wait_for_callers(&self) -> Result<()> {
        // Re-recording the start events is fine: the waits `begin` queued captured the earlier
        // record.
        self.mark_callers()?;
        // One deadline for all the callers: the timeout bounds the whole wait.
        let limit = deadline(Instant::now(), self.timeout);
        for &i in &self.callers {
            let start = &self.replicas[i].start;
            self.poll(
                limit,
                true,
                || start.query(),
                |ms| {
                    format!(
                        "host memory on CUDA replicas waits for the work already queued on the \
                         callers' streams, and replica {i}'s stream did not finish it within the \
                         {ms} ms timeout; the context refuses further collectives (destroy it)"
                    )
                },
            )?;
        }
        Ok(())
    }

    fn trace(&mut self, tracer: crate::timeline::Tracer) -> Result<()> {
        self.start_tracing(tracer)
    }

    fn host_stage(&self, bytes: usize) -> Result<usize> {
        self.host_stage_of(bytes)
    }

    fn bucket_stage(&self, bytes: usize) -> Result<BucketStage> {
        self.bucket_stage_of(bytes)
    }

    fn queued_done(&self) -> Result<Done> {
        self.queued_done_of()
    }

    unsafe fn stage_copy(
        &self,
        replica: usize,
        dst: usize,
        src: usize,
        bytes: usize,
    ) -> Result<()> {
        self.stage_copy_on(replica, dst, src, bytes)
    }

    fn wait_all(&self) -> Result<()> {
        self.wait_all_groups()
    }

    fn collective_failed(&self, err: Error) -> Error {
        match err.kind {
            // Running out of memory leaves the device and the communicators sound: the work
            // queued before it completes, and a later call may fit.
            ErrorKind::Backend if err.is_out_of_memory() => err,
            ErrorKind::Backend | ErrorKind::Timeout => self.nccl_failed(err),
            _ => err,
        }
    }

    fn recover(&self) -> Result<()> {
        self.recover_from_world()
    }

    fn end(&self, join: bool) -> Result<()> {
        let mut state = self.state.lock();
        // The device spans' stop events before the completion events, on the same streams: a
        // collective seen complete then has its stop events complete too.
        let timing = match state.issuing.timing_starts.take() {
            Some(starts) => Some(self.timing_stops(starts)?),
            None => None,
        };
        let mut done = match state.spare.pop() {
            Some(events) => events,
            None => {
                let mut events = Vec::with_capacity(self.groups.len());
                for g in &self.groups {
                    let _bound = g.ctx.bind()?;
                    events.push(Event::new()?);
                }
                events
            }
        };
        for (g, ev) in self.groups.iter().zip(&mut done) {
            let _bound = g.ctx.bind()?;
            ev.record(g.stream.0)?;
        }
        // Unjoined: every later collective's work follows this one on the groups' streams, so
        // the callers wait for it through that collective's events.
        let callers = if join { &self.callers[..] } else { &[] };
        for r in callers.iter().map(|&r| &self.replicas[r]) {
            let _bound = self.groups[r.group].ctx.bind()?;
            for ev in &done {
                ev.wait_on(r.stream as sys::CUstream)?;
            }
        }
        let mut leftovers = std::mem::take(&mut state.issuing);
        leftovers.keep.append(&mut self.dropped.lock().mems);
        state.pending.push_back(Pending {
            issued: Instant::now(),
            done,
            leftovers,
            timing,
        });
        Ok(())
    }
}
