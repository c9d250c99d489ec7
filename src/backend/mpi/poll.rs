//! Waiting for MPI without blocking inside it: every wait of the engine (a waited transfer's
//! requests, the ring's flights, the steps queue, the progress thread) tests and backs off
//! here, so that each can time out (a blocking call that timed out could never be taken back)
//! and none costs a small collective more than the test itself.

use std::ffi::c_int;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::calls::{check, count_of};
use super::shm::Slots;
use crate::error::{Error, ErrorKind, Result};

/// How long [`poll`] tests back to back, then yields between tests, before it sleeps.
const BUSY: Duration = Duration::from_micros(20);
const SPIN: Duration = Duration::from_millis(2);
/// How often a sleeping wait on shared memory looks at its peers' processes (elastic worlds).
const WATCH: Duration = Duration::from_millis(5);

/// Waits for `requests` within `timeout` (None: forever): testing back to back for the first
/// [`BUSY`] (a small collective completes within a microsecond or two, and a yield is a system
/// call that costs a good part of that), then yielding the CPU between tests until [`SPIN`] (a
/// sleep's wake-up would cost more than the whole call), then sleeping 50 µs between tests:
/// ranks oversubscribe cores in tests and small clusters, and a rank spinning for long slows
/// the one it waits for. The timeout counts from `since` (several requests of one call share
/// it), which the first test that finds them unfinished sets: a small exchange that is already
/// complete costs no clock read (a read costs a good part of such an exchange on a VM).
pub(super) fn poll(
    requests: &mut [ffi::MPI_Request],
    since: &mut Option<Instant>,
    timeout: Option<Duration>,
    what: &str,
) -> Result<()> {
    let mut idle = Idle::default();
    loop {
        let mut flag: c_int = 0;
        // SAFETY: requests of this process (MPI_REQUEST_NULL once complete).
        let rc = unsafe {
            ffi::MPI_Testall(
                count_of(requests.len()),
                requests.as_mut_ptr(),
                &mut flag,
                ffi::RSMPI_STATUSES_IGNORE,
            )
        };
        check(what, rc)?;
        if flag != 0 {
            return Ok(());
        }
        idle.wait(since, timeout, what)?;
    }
}

/// The back-off of [`poll`] between tests that found nothing finished.
#[derive(Default)]
pub(super) struct Idle {
    start: Option<Instant>,
    /// Shared memory whose peers' processes are watched while this wait sleeps (elastic
    /// worlds), and when they were last looked at.
    watch: Option<(Slots, Instant)>,
}

impl Idle {
    /// A wait on `slots`' counters (None: on MPI only), watching their peers where the world
    /// is elastic.
    pub(super) fn watching(slots: Option<Slots>) -> Idle {
        Idle {
            start: None,
            watch: slots.map(|s| (s, Instant::now())),
        }
    }

    /// Spins, yields or sleeps as long as this wait has lasted; TIMEOUT once `timeout` has
    /// passed since `since` (set by the first call).
    ///
    /// Always inlined: out of line, a 1-float allreduce measured 7% slower.
    #[inline(always)]
    pub(super) fn wait(
        &mut self,
        since: &mut Option<Instant>,
        timeout: Option<Duration>,
        what: &str,
    ) -> Result<()> {
        let now = Instant::now();
        if let Some(limit) = timeout {
            if now - *since.get_or_insert(now) > limit {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "waited {} ms (the context's timeout) in {what}: not every rank took \
                         part; this world is failed (a rank is dead or stuck outside dpsync)",
                        limit.as_millis()
                    ),
                ));
            }
        }
        let waited = now - *self.start.get_or_insert(now);
        if waited < BUSY {
            std::hint::spin_loop();
        } else if waited < SPIN {
            std::thread::yield_now();
        } else {
            if let Some((slots, checked)) = &mut self.watch {
                if now - *checked > WATCH {
                    *checked = now;
                    if let Some(r) = slots.gone() {
                        return Err(Error::new(
                            ErrorKind::Backend,
                            format!("in {what}: rank {r}'s process is gone"),
                        ));
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Something finished: the next wait starts spinning again.
    pub(super) fn reset(&mut self) {
        self.start = None;
    }
}
