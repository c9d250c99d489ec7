//! The progress thread: Open MPI moves a transfer only inside its calls, so without a thread
//! calling in, a bucket started early would advance only at the caller's later marks. It moves
//! the steps queue while the caller computes, and must be out of MPI before the context goes
//! and before the exit hook finalises MPI.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::init::{EXITING, IN_MPI};
use super::poll::Idle;
use super::steps::Until;
use super::{Engine, MpiRanks};

pub(super) enum Progress {
    NotYet,
    Running(JoinHandle<()>),
    /// Why there is none: marks and the step move the queue then.
    Off(&'static str),
}

impl Progress {
    pub(super) fn describe(&self) -> &'static str {
        match self {
            Progress::NotYet => "starts with the first early bucket",
            Progress::Running(_) => "running",
            Progress::Off(why) => why,
        }
    }
}

impl MpiRanks {
    /// Whether the progress thread moves the queue: the caller's marks then leave the
    /// queue to it. A pass on the caller's thread stages and sums pieces for hundreds of
    /// microseconds, which delays the caller's next work (a GPU's next kernels, the next
    /// marks) when the thread would do the same in the caller's idle time: with ResNet-50's
    /// 161 marks the backward took 60–88 ms instead of 53 on the 2-core VM (PERFORMANCE.md).
    pub(super) fn thread_moves(&self) -> bool {
        matches!(*self.progress.lock(), Progress::Running(_))
    }

    /// Wakes the progress thread for a bucket just queued, starting it the first time. It
    /// runs even where this process may use one CPU only (`mpirun` binds each of 2 ranks to a
    /// core by default): a GPU's backward, or any caller waiting for its data, leaves that CPU
    /// free, and only a thread of dpsync's own then moves the buckets while the caller is
    /// outside dpsync. Where the caller computes on that CPU, the thread yields to it as soon
    /// as a test finds nothing to do ([`Idle`]).
    pub(super) fn wake_progress(&self) {
        let mut progress = self.progress.lock();
        if let Progress::NotYet = *progress {
            let engine = Arc::clone(&self.engine);
            *progress = match (std::thread::Builder::new().name("dpsync-mpi".into()))
                .spawn(move || engine.progress())
            {
                Ok(thread) => Progress::Running(thread),
                Err(_) => Progress::Off("off: the thread could not be made"),
            };
        }
        self.wake.notify_one();
    }
}

impl Engine {
    /// The progress thread: while buckets are queued, moves them on without waiting, then
    /// backs off as a waited transfer does (spin, yield, 50 µs sleeps) until something moves
    /// again; sleeps while nothing is queued or the world failed.
    fn progress(&self) {
        // The lowest priority: the thread takes the CPU the caller leaves, and the caller's
        // threads, woken while it moves a bucket, run at once rather than at the end of its
        // slice (each of 161 marks came 20–200 µs late at the default priority). Where the
        // caller computes on every CPU, the step moves the buckets itself.
        // SAFETY: this thread's own priority (Linux: a thread id is a process id here).
        unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) };
        let (mut idle, mut since) = (Idle::default(), None);
        loop {
            let mut queue = self.queue.lock();
            while !self.stop.load(Ordering::Relaxed)
                && (!queue.moving() || self.failed.lock().is_some())
            {
                idle.reset();
                self.wake.wait(&mut queue);
            }
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let before = queue.moves();
            {
                let _mpi = IN_MPI.read();
                if EXITING.load(Ordering::SeqCst) {
                    return;
                }
                // A failure is kept in `failed` (the step reports it) and leaks the queue.
                let _ = self.drive(&mut queue, Until::Idle);
            }
            let moved = queue.moves() != before;
            drop(queue);
            if moved {
                idle.reset();
            }
            // No timeout: never an error.
            let _ = idle.wait(&mut since, None, "");
        }
    }
}

impl Drop for MpiRanks {
    fn drop(&mut self) {
        // The progress thread first: it may be inside MPI with the queue.
        self.stop.store(true, Ordering::Relaxed);
        {
            let _queue = self.queue.lock();
            self.wake.notify_all();
        }
        if let Progress::Running(thread) =
            std::mem::replace(self.progress.get_mut(), Progress::NotYet)
        {
            let _ = thread.join();
        }
    }
}
