//! The MPI engine between the ranks of a world ([`Ranks`]), through rsmpi's raw bindings
//! (`mpi::ffi`): its communicator is a duplicate of the caller's, so dpsync's traffic never
//! mixes with theirs, and every transfer is issued non-blocking and polled against the
//! world's timeout, so a dead or stuck rank gives TIMEOUT, never a hang.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void, CStr};
use std::mem::{size_of, MaybeUninit};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use mpi::ffi;
use parking_lot::{Condvar, Mutex, RwLock};
use serde_json::json;

use super::{Channel, Ranks, Segment, Ticket};
use crate::error::{Error, ErrorKind, Result};
use crate::options::World;
use crate::types::DType;
use ring::Ring;
use shm::Shared;
use steps::{Handle, Queue, Until};

mod ring;
mod shm;
mod steps;

/// Bytes per non-blocking call of a large transfer, and how many are in flight at once. A
/// waited transfer's pieces go through [`DEPTH`] stages of this size, each staged in just before
/// its call and out as soon as it completes, so that they stay in cache: Open MPI moved a
/// 100 MB allreduce this way more than twice as fast as through stages of the whole buffer, and
/// faster than its blocking allreduce in pieces. 512 KiB × 2 (1 MiB in flight, this VM's L2)
/// measured best of 128 KiB..1 MiB × 1..8 (docs/PERFORMANCE.md). Also keeps counts in C ints.
const PIECE: usize = 512 << 10;
const DEPTH: usize = 2;

/// The tag of [`Ranks::allgather_fixed`]'s point-to-point exchanges (on the collectives'
/// communicator, where nothing else sends point to point).
const TAG_GATHER: c_int = 0x6470;

/// Serialises dpsync's MPI initialisation (two contexts created at once by two threads).
static INIT: Mutex<()> = Mutex::new(());

extern "C" {
    /// The C library's: dpsync finalises the MPI it initialised when the process exits
    /// (cbindgen.toml excludes it from the header).
    fn atexit(callback: extern "C" fn()) -> c_int;
}

/// Set by the exit hook before it finalises MPI: progress threads make no MPI call after it.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Held shared by a progress thread while it calls MPI, exclusive by the exit hook while it
/// finalises: Open MPI's MPI_Finalize crashes with another thread inside MPI.
static IN_MPI: RwLock<()> = RwLock::new(());

extern "C" fn finalize_at_exit() {
    EXITING.store(true, Ordering::SeqCst);
    let _alone = IN_MPI.write();
    // SAFETY: MPI calls allowed at any time; finalised once, only if nobody did it before.
    unsafe {
        if !finalized() {
            ffi::MPI_Finalize();
        }
    }
}

fn initialized() -> bool {
    let mut flag = 0;
    // SAFETY: allowed before MPI_Init and after MPI_Finalize.
    unsafe { ffi::MPI_Initialized(&mut flag) };
    flag != 0
}

fn finalized() -> bool {
    let mut flag = 0;
    // SAFETY: as above.
    unsafe { ffi::MPI_Finalized(&mut flag) };
    flag != 0
}

fn level_name(level: c_int) -> &'static str {
    // SAFETY: link-time constants of the MPI library.
    unsafe {
        match level {
            l if l == ffi::RSMPI_THREAD_SINGLE => "MPI_THREAD_SINGLE",
            l if l == ffi::RSMPI_THREAD_FUNNELED => "MPI_THREAD_FUNNELED",
            l if l == ffi::RSMPI_THREAD_SERIALIZED => "MPI_THREAD_SERIALIZED",
            l if l == ffi::RSMPI_THREAD_MULTIPLE => "MPI_THREAD_MULTIPLE",
            _ => "an unknown thread level",
        }
    }
}

/// The world `mpi_comm` names: a copy of the caller's communicator value, which only means
/// something once MPI is initialised.
///
/// # Safety
/// A non-NULL `mpi_comm` points to an `MPI_Comm`.
pub(crate) unsafe fn world_of(mpi_comm: *const c_void) -> Result<World> {
    if mpi_comm.is_null() {
        return Ok(World::MpiCommWorld);
    }
    if !initialized() || finalized() {
        return Err(Error::new(
            ErrorKind::InvalidState,
            "mpi_comm: a communicator needs MPI initialised (and not finalised) by the caller; \
             pass NULL for MPI_COMM_WORLD and dpsync initialises MPI itself",
        ));
    }
    let bytes = std::slice::from_raw_parts(mpi_comm.cast::<u8>(), size_of::<ffi::MPI_Comm>());
    Ok(World::MpiComm(bytes.to_vec()))
}

/// Initialises MPI (MPI_THREAD_MULTIPLE) unless someone did, and checks the thread level: dpsync
/// calls MPI from whichever thread calls it, so anything less is UNAVAILABLE.
fn ensure_initialized() -> Result<()> {
    let _once = INIT.lock();
    if finalized() {
        return Err(Error::new(
            ErrorKind::InvalidState,
            "MPI is already finalised in this process: a world cannot be joined any more",
        ));
    }
    let mut provided: c_int = 0;
    // SAFETY: plain MPI calls on MPI's own outputs.
    unsafe {
        if initialized() {
            ffi::MPI_Query_thread(&mut provided);
        } else {
            let rc = ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            );
            if rc != 0 {
                return Err(backend_error("MPI_Init_thread", rc));
            }
            // Ours to finalise, at exit: contexts may live until then.
            atexit(finalize_at_exit);
        }
        if provided < ffi::RSMPI_THREAD_MULTIPLE {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "MPI provides {} only; dpsync needs MPI_THREAD_MULTIPLE (initialise MPI \
                     with MPI_Init_thread(MPI_THREAD_MULTIPLE), or use an MPI built with \
                     thread support)",
                    level_name(provided)
                ),
            ));
        }
    }
    Ok(())
}

/// MPI's words for an error code.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

fn backend_error(call: &str, code: c_int) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("{call} failed: {} (code {code})", error_string(code)),
    )
}

/// Ranks with the same key run on the same host (FNV-1a of the host name and the kernel's boot
/// id): simulated hosts of one machine (namespaces with their own names) count as several.
fn host_key() -> u64 {
    let mut name = [0u8; 256];
    // SAFETY: the buffer's length is passed; gethostname NUL-terminates what fits.
    unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    (name.iter().chain(b"\0").chain(&boot)).fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn library_version() -> String {
    // MPI_MAX_LIBRARY_VERSION_STRING is 256 in Open MPI and 8192 in MPICH.
    let mut buf = vec![0u8; 8192];
    let mut len: c_int = 0;
    // SAFETY: callable before and after initialisation; the buffer is large enough.
    unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
    let text = CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    text.trim_end().to_owned()
}

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

enum Progress {
    NotYet,
    Running(JoinHandle<()>),
    /// Why there is none: marks and the step move the queue then.
    Off(&'static str),
}

impl Progress {
    fn describe(&self) -> &'static str {
        match self {
            Progress::NotYet => "starts with the first early bucket",
            Progress::Running(_) => "running",
            Progress::Off(why) => why,
        }
    }
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
    /// The collective under way ([`Ranks::begin`]), for messages.
    call: Mutex<String>,
    /// The stages of waited transfers, reused: [`DEPTH`] slots of up to [`PIECE`] bytes each
    /// way (8-byte words: aligned for every dtype). Staged because a timed-out MPI request
    /// stays pending and may still read and write its buffers: then they are leaked, never the
    /// caller's memory (and MPI_IN_PLACE's value differs between MPI implementations, so dpsync
    /// never passes it).
    scratch: Mutex<Vec<u64>>,
    /// Ring pieces the collectives' communicator carried so far: they number the pieces'
    /// tags and shared-memory slots alike on every rank (the steps' are the queue's).
    calls_pieces: AtomicUsize,
    /// Where every rank runs on this host: the shared memory the ring pieces cross (`shm.rs`).
    shared: Option<Shared>,
    /// What `dpsync_describe` says of it: on, or why not.
    shared_note: String,
}

/// A duplicate of `parent` (non-blocking, polled within `timeout`) whose errors are returned.
///
/// # Safety
/// `parent` is a valid communicator.
unsafe fn duplicate(parent: ffi::MPI_Comm, timeout: Option<Duration>) -> Result<ffi::MPI_Comm> {
    let mut comm = MaybeUninit::<ffi::MPI_Comm>::uninit();
    let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
    check(
        "MPI_Comm_idup",
        ffi::MPI_Comm_idup(parent, comm.as_mut_ptr(), request.as_mut_ptr()),
    )?;
    let mut request = request.assume_init();
    poll(
        std::slice::from_mut(&mut request),
        &mut None,
        timeout,
        "dpsync_context_create (MPI_Comm_idup)",
    )?;
    // The request completed: MPI wrote the communicator.
    let comm = comm.assume_init();
    ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN);
    Ok(comm)
}

/// One MPI call's return code as a result.
fn check(call: &str, rc: c_int) -> Result<()> {
    match rc {
        0 => Ok(()),
        rc => Err(backend_error(call, rc)),
    }
}

fn count_of(n: usize) -> c_int {
    c_int::try_from(n).expect("chunked below C int range")
}

impl MpiRanks {
    /// See [`super::join`].
    pub(crate) fn join(world: &World, timeout_ms: u64) -> Result<MpiRanks> {
        ensure_initialized()?;
        // SAFETY: MPI is initialised; the caller's value is an MPI_Comm of this MPI (its bytes
        // were copied from one).
        let parent = unsafe {
            match world {
                World::MpiCommWorld => ffi::RSMPI_COMM_WORLD,
                World::MpiComm(bytes) => {
                    std::ptr::read_unaligned(bytes.as_ptr().cast::<ffi::MPI_Comm>())
                }
            }
        };
        let timeout = (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms));
        // SAFETY: `parent` is a valid communicator of this MPI; so is the first duplicate.
        let comm = unsafe { duplicate(parent, timeout)? };
        let steps = unsafe { duplicate(comm, timeout)? };
        let (mut rank, mut size) = (0, 0);
        // SAFETY: a valid communicator.
        unsafe {
            ffi::MPI_Comm_rank(comm, &mut rank);
            ffi::MPI_Comm_size(comm, &mut size);
        }
        let engine = Engine {
            comm: Comm(comm),
            steps: Comm(steps),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            spare: Mutex::new(Vec::new()),
            rank: rank as usize,
            size: size as usize,
            timeout,
            failed: Mutex::new(None),
            library: library_version(),
            call: Mutex::new("dpsync_context_create".to_owned()),
            scratch: Mutex::new(Vec::new()),
            calls_pieces: AtomicUsize::new(0),
            shared: None,
            shared_note: String::new(),
        };
        let mut ranks = MpiRanks {
            engine: Arc::new(engine),
            progress: Mutex::new(Progress::NotYet),
        };
        let (shared, note) = ranks.share_memory()?;
        let engine = Arc::get_mut(&mut ranks.engine).expect("not shared before join returns");
        (engine.shared, engine.shared_note) = (shared, note);
        Ok(ranks)
    }

    /// Sets up the shared memory of a world whose ranks all run on this host (collective): two
    /// exchanges of a small record. Off where `DPSYNC_MPI_SHM=0` on any rank, across hosts,
    /// beyond [`shm::MAX_RANKS`] ranks, or where a rank cannot map rank 0's object (another
    /// user, a container with its own /dev/shm): MPI carries the pieces then.
    fn share_memory(&self) -> Result<(Option<Shared>, String)> {
        const WILLING: u64 = 1;
        const CREATED: u64 = 2;
        static OBJECTS: AtomicUsize = AtomicUsize::new(0);
        let (n, me) = (self.size, self.rank);
        let willing = (2..=shm::MAX_RANKS).contains(&n)
            && std::env::var("DPSYNC_MPI_SHM").map_or(true, |v| v != "0");
        let pid = u64::from(std::process::id());
        let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let nonce = clock.map_or(0, |d| d.as_nanos() as u64)
            ^ (OBJECTS.fetch_add(1, Ordering::Relaxed) as u64).rotate_left(48);
        // This rank's mapping, and why there is none.
        let (mut mine, mut note) = (None, String::new());
        if willing && me == 0 {
            match Shared::create(pid, nonce, n) {
                Ok(s) => mine = Some(s),
                Err(e) => note = format!("off: rank 0 could not create it ({e})"),
            }
        }
        let created = mine.is_some();
        let unlink = || {
            if created {
                Shared::unlink(pid, nonce);
            }
        };
        let flags = u64::from(willing) * WILLING + u64::from(created) * CREATED;
        let record = [host_key(), pid, nonce, flags];
        let records = self.allgather_fixed(&record).inspect_err(|_| unlink())?;
        let of = |r: usize| &records[r * record.len()..(r + 1) * record.len()];
        let why_not = if n < 2 {
            Some("off: one rank".to_owned())
        } else if n > shm::MAX_RANKS {
            Some(format!("off: more than {} ranks", shm::MAX_RANKS))
        } else if (0..n).any(|r| of(r)[3] & WILLING == 0) {
            Some("off: DPSYNC_MPI_SHM=0 on a rank".to_owned())
        } else if (0..n).any(|r| of(r)[0] != of(0)[0]) {
            Some("off: the ranks run on several hosts".to_owned())
        } else if of(0)[3] & CREATED == 0 {
            Some(match note.is_empty() {
                true => "off: rank 0 could not create it".to_owned(),
                false => std::mem::take(&mut note),
            })
        } else {
            None
        };
        match &why_not {
            Some(_) => mine = None,
            None if me != 0 => match Shared::open(of(0)[1], of(0)[2], n, me) {
                Ok(s) => mine = Some(s),
                Err(e) => note = format!("off: rank {me} could not map rank 0's object ({e})"),
            },
            None => {}
        }
        // Every rank mapped it, or all stay on MPI; then the name goes.
        let mapped = self.allgather_fixed(&[u64::from(mine.is_some())]);
        unlink();
        let mapped = mapped?;
        if let Some(why) = why_not {
            return Ok((None, why));
        }
        Ok(match mapped.iter().position(|&m| m == 0) {
            Some(r) if r == me => (None, note),
            Some(r) => (None, format!("off: rank {r} could not map rank 0's object")),
            None => (mine, format!("on: all {n} ranks on this host")),
        })
    }

    /// Wakes the progress thread for a bucket just queued, starting it the first time. None
    /// where this process may run on one CPU only (`mpirun` binds each of 2 ranks to a core by
    /// default): there it would only take turns with the caller's backward pass, so marks and
    /// the step move the queue, as they do where no thread can be made.
    fn wake_progress(&self) {
        let mut progress = self.progress.lock();
        if let Progress::NotYet = *progress {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
            let engine = Arc::clone(&self.engine);
            *progress = if cpus < 2 {
                Progress::Off("off: this process may run on one CPU only")
            } else {
                match (std::thread::Builder::new().name("dpsync-mpi".into()))
                    .spawn(move || engine.progress())
                {
                    Ok(thread) => Progress::Running(thread),
                    Err(_) => Progress::Off("off: the thread could not be made"),
                }
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
        let (mut idle, mut since) = (Idle::default(), None);
        loop {
            let mut queue = self.queue.lock();
            while !self.stop.load(Ordering::Relaxed)
                && (!queue.busy() || self.failed.lock().is_some())
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

    fn refuse_if_failed(&self) -> Result<()> {
        match &*self.failed.lock() {
            None => Ok(()),
            Some(why) => Err(Error::new(
                ErrorKind::InvalidState,
                format!("this context's world failed earlier ({why}): it refuses collectives"),
            )),
        }
    }

    /// Issues one non-blocking call and waits for it; a failure fails the world.
    fn run(&self, what: &str, mut issue: impl FnMut(*mut ffi::MPI_Request) -> c_int) -> Result<()> {
        self.run_pieces(what, 1, |_, request| issue(request), |_| {})
    }

    /// Issues `pieces` non-blocking calls in order, at most [`DEPTH`] in flight, and waits for
    /// all of them within one timeout, calling `done(i)` as piece `i` completes (in order: a
    /// piece's stage, `i % DEPTH`, is free again once `done` returns); a failure fails the
    /// world.
    fn run_pieces(
        &self,
        what: &str,
        pieces: usize,
        mut issue: impl FnMut(usize, *mut ffi::MPI_Request) -> c_int,
        mut done: impl FnMut(usize),
    ) -> Result<()> {
        let mut since = None;
        let mut inflight: VecDeque<(usize, ffi::MPI_Request)> = VecDeque::with_capacity(DEPTH);
        let mut all = || -> Result<()> {
            for piece in 0..pieces {
                if inflight.len() == DEPTH {
                    let (i, mut oldest) = inflight.pop_front().expect("DEPTH > 0");
                    poll(
                        std::slice::from_mut(&mut oldest),
                        &mut since,
                        self.timeout,
                        what,
                    )?;
                    done(i);
                }
                let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
                check(what, issue(piece, request.as_mut_ptr()))?;
                // SAFETY: the call succeeded, so it wrote the request.
                inflight.push_back((piece, unsafe { request.assume_init() }));
            }
            while let Some((i, mut request)) = inflight.pop_front() {
                poll(
                    std::slice::from_mut(&mut request),
                    &mut since,
                    self.timeout,
                    what,
                )?;
                done(i);
            }
            Ok(())
        };
        all().map_err(|e| self.failing(e))
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

    /// Marks the world failed (a timeout or an MPI error mid-transfer) and names the call.
    fn failing(&self, mut e: Error) -> Error {
        e.message = format!("{}: {}", self.call.lock(), e.message);
        *self.failed.lock() = Some(e.message.clone());
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
        let mut words = self.spare.lock().pop().unwrap_or_default();
        stage(&mut words, bytes);
        words
    }
}

/// Elements per piece of a large allreduce ([`PIECE`] bytes).
fn piece_of(size: usize) -> usize {
    (PIECE / size).max(1)
}

/// A position in spans laid end to end (a bucket's segments, a broadcast's spans), moved
/// forward range after range: a waited transfer stages its pieces in order, and out in order.
#[derive(Default)]
struct Walk {
    /// The first span the next range may touch, and the elements before it.
    span: usize,
    before: usize,
}

impl Walk {
    /// `f(span, offset in it, length, offset in the range)` for every span's part of
    /// `[start, start + n)` of `lengths` laid end to end; `start` never goes back.
    fn parts(
        &mut self,
        lengths: impl Fn(usize) -> usize,
        spans: usize,
        (start, n): (usize, usize),
        mut f: impl FnMut(usize, usize, usize, usize),
    ) {
        while self.span < spans && self.before + lengths(self.span) <= start {
            self.before += lengths(self.span);
            self.span += 1;
        }
        let (mut k, mut before, end) = (self.span, self.before, start + n);
        while k < spans && before < end {
            let (from, to) = (start.max(before), end.min(before + lengths(k)));
            if to > from {
                f(k, from - before, to - from, from - start);
            }
            before += lengths(k);
            k += 1;
        }
    }
}

/// `words` grown to at least `bytes` bytes; its first byte.
fn stage(words: &mut Vec<u64>, bytes: usize) -> *mut u8 {
    let n = bytes.div_ceil(8);
    if words.len() < n {
        words.resize(n, 0);
    }
    words.as_mut_ptr().cast()
}

/// A dtype's element type, and how it is summed in the type MPI sums it in.
trait Summed: Copy + 'static {
    /// The type MPI sums it in ([`mpi_type`]).
    type Acc: Copy + 'static;
    fn widen(x: Self) -> Self::Acc;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn divide(a: Self::Acc, d: usize) -> Self::Acc;
    /// One rounding.
    fn narrow(a: Self::Acc) -> Self;
}

// `#[inline]` throughout: called once per element from generic loops, some in other files (the
// ring's sums), where an out-of-line call would cost more than the element's own work.

macro_rules! float_exact {
    ($t:ty) => {
        impl Summed for $t {
            type Acc = $t;
            #[inline]
            fn widen(x: $t) -> $t {
                x
            }
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline]
            fn divide(a: $t, d: usize) -> $t {
                a / d as $t
            }
            #[inline]
            fn narrow(a: $t) -> $t {
                a
            }
        }
    };
}
float_exact!(f32);
float_exact!(f64);

macro_rules! int_wrapping {
    ($t:ty) => {
        impl Summed for $t {
            type Acc = $t;
            #[inline]
            fn widen(x: $t) -> $t {
                x
            }
            /// Wraps on overflow (two's complement) instead of panicking in a debug build.
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline]
            fn divide(a: $t, d: usize) -> $t {
                a / d as $t
            }
            #[inline]
            fn narrow(a: $t) -> $t {
                a
            }
        }
    };
}
int_wrapping!(i32);
int_wrapping!(i64);

macro_rules! half_in_f32 {
    ($t:ty) => {
        impl Summed for $t {
            type Acc = f32;
            #[inline]
            fn widen(x: $t) -> f32 {
                x.to_f32()
            }
            #[inline]
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            #[inline]
            fn divide(a: f32, d: usize) -> f32 {
                a / d as f32
            }
            #[inline]
            fn narrow(a: f32) -> $t {
                <$t>::from_f32(a)
            }
        }
    };
}
half_in_f32!(f16);
half_in_f32!(bf16);

/// Whether `T` and `A` are one type (then widening and narrowing are the identity).
fn same_type<T: 'static, A: 'static>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<A>()
}

/// `dst[..count]` := the sum of `count` elements of `T` from element `skip` of every pointer of
/// `srcs`, widened to `T::Acc` (the type MPI sums).
///
/// # Safety
/// Every source holds `skip + count` aligned `T`, `dst` room for `count` aligned `T::Acc`.
unsafe fn gather_in<T: Summed>((srcs, skip): (&[usize], usize), dst: *mut u8, count: usize) {
    let out = std::slice::from_raw_parts_mut(dst.cast::<T::Acc>(), count);
    for (k, &src) in srcs.iter().enumerate() {
        let xs = std::slice::from_raw_parts((src as *const T).add(skip), count);
        if k == 0 && same_type::<T, T::Acc>() {
            // The widening is the identity: libc's copy beats the element loop on large
            // stages (MPI's ring, fused ResNet-50 on the 2-core VM: 33 against 36 ms).
            std::ptr::copy_nonoverlapping(xs.as_ptr().cast::<T::Acc>(), out.as_mut_ptr(), count);
        } else if k == 0 {
            out.iter_mut().zip(xs).for_each(|(o, &x)| *o = T::widen(x));
        } else {
            out.iter_mut()
                .zip(xs)
                .for_each(|(o, &x)| *o = T::add(*o, T::widen(x)));
        }
    }
}

/// `dst[skip..skip + count]` := `count` elements of `T::Acc` at `src`, divided by `avg` if
/// given, as `T` (one rounding).
///
/// # Safety
/// As for [`gather_in`], the other way round.
unsafe fn scatter_out<T: Summed>(
    src: *const u8,
    (dst, skip): (usize, usize),
    count: usize,
    avg: Option<usize>,
) {
    let (xs, out) = (
        std::slice::from_raw_parts(src.cast::<T::Acc>(), count),
        std::slice::from_raw_parts_mut((dst as *mut T).add(skip), count),
    );
    match avg {
        None if same_type::<T, T::Acc>() => {
            std::ptr::copy_nonoverlapping(xs.as_ptr().cast::<T>(), out.as_mut_ptr(), count)
        }
        None => out.iter_mut().zip(xs).for_each(|(o, &x)| *o = T::narrow(x)),
        Some(d) => (out.iter_mut().zip(xs)).for_each(|(o, &x)| *o = T::narrow(T::divide(x, d))),
    }
}

/// The MPI type a dtype is summed in, and its size (f16/bf16: f32, rounded once at the end).
fn mpi_type(dtype: DType) -> (ffi::MPI_Datatype, usize) {
    // SAFETY: link-time constants of the MPI library.
    unsafe {
        match dtype {
            DType::F32 => (ffi::RSMPI_FLOAT, 4),
            DType::F64 => (ffi::RSMPI_DOUBLE, 8),
            DType::I32 => (ffi::RSMPI_INT32_T, 4),
            DType::I64 => (ffi::RSMPI_INT64_T, 8),
            DType::F16 | DType::Bf16 => (ffi::RSMPI_FLOAT, 4),
        }
    }
}

/// Elements `range` = `(start, n)` of the segments laid end to end, each segment's
/// contributions summed into `send` in MPI's type.
///
/// # Safety
/// As for [`gather_in`]; `send` holds `n` elements.
unsafe fn stage_in(
    dtype: DType,
    segments: &[Segment<'_>],
    walk: &mut Walk,
    range: (usize, usize),
    send: *mut u8,
) {
    let size = mpi_type(dtype).1;
    walk.parts(
        |k| segments[k].count,
        segments.len(),
        range,
        |k, skip, n, at| {
            let (src, dst) = ((segments[k].ptrs, skip), send.add(at * size));
            match dtype {
                DType::F32 => gather_in::<f32>(src, dst, n),
                DType::F64 => gather_in::<f64>(src, dst, n),
                DType::F16 => gather_in::<f16>(src, dst, n),
                DType::Bf16 => gather_in::<bf16>(src, dst, n),
                DType::I32 => gather_in::<i32>(src, dst, n),
                DType::I64 => gather_in::<i64>(src, dst, n),
            }
        },
    );
}

/// `recv`, elements `range` = `(start, n)` of the outputs `(ptr, count)` laid end to end,
/// divided by `avg` and rounded once into them.
///
/// # Safety
/// As for [`scatter_out`]; `recv` holds `n` elements.
unsafe fn stage_out(
    dtype: DType,
    recv: *const u8,
    (outs, walk): (&[(usize, usize)], &mut Walk),
    range: (usize, usize),
    avg: Option<usize>,
) {
    let size = mpi_type(dtype).1;
    walk.parts(
        |k| outs[k].1,
        outs.len(),
        range,
        |k, skip, n, at| {
            let (src, dst) = (recv.add(at * size), (outs[k].0, skip));
            match dtype {
                DType::F32 => scatter_out::<f32>(src, dst, n, avg),
                DType::F64 => scatter_out::<f64>(src, dst, n, avg),
                DType::F16 => scatter_out::<f16>(src, dst, n, avg),
                DType::Bf16 => scatter_out::<bf16>(src, dst, n, avg),
                DType::I32 => scatter_out::<i32>(src, dst, n, avg),
                DType::I64 => scatter_out::<i64>(src, dst, n, avg),
            }
        },
    );
}

/// Bytes `range` = `(start, n)` of the spans `(ptr, bytes)` laid end to end, copied into the
/// stage at `stage` or, with `out`, from it.
///
/// # Safety
/// Every span is valid for its bytes; `stage` for `n`.
unsafe fn copy_spans(
    (spans, walk): (&[(usize, usize)], &mut Walk),
    range: (usize, usize),
    stage: *mut u8,
    out: bool,
) {
    walk.parts(
        |k| spans[k].1,
        spans.len(),
        range,
        |k, skip, n, at| {
            let span = (spans[k].0 as *mut u8).add(skip);
            match out {
                false => std::ptr::copy_nonoverlapping(span, stage.add(at), n),
                true => std::ptr::copy_nonoverlapping(stage.add(at), span, n),
            }
        },
    );
}

/// How long [`poll`] tests back to back, then yields between tests, before it sleeps.
const BUSY: Duration = Duration::from_micros(20);
const SPIN: Duration = Duration::from_millis(2);

/// Waits for `requests` within `timeout` (None: forever): testing back to back for the first
/// [`BUSY`] (a small collective completes within a microsecond or two, and a yield is a system
/// call that costs a good part of that), then yielding the CPU between tests until [`SPIN`] (a
/// sleep's wake-up would cost more than the whole call), then sleeping 50 µs between tests:
/// ranks oversubscribe cores in tests and small clusters, and a rank spinning for long slows
/// the one it waits for. The timeout counts from `since` (several requests of one call share
/// it), which the first test that finds them unfinished sets: a small exchange that is already
/// complete costs no clock read (a read costs a good part of such an exchange on a VM).
fn poll(
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
struct Idle {
    start: Option<Instant>,
}

impl Idle {
    /// Spins, yields or sleeps as long as this wait has lasted; TIMEOUT once `timeout` has
    /// passed since `since` (set by the first call).
    #[inline(always)]
    fn wait(
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
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Something finished: the next wait starts spinning again.
    fn reset(&mut self) {
        self.start = None;
    }
}

impl Ranks for MpiRanks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.size
    }

    fn describe(&self) -> serde_json::Value {
        let (queued, pieces, done) = self.queue.lock().state();
        json!({"engine": "mpi", "mpi_library": self.library,
               "failed": *self.failed.lock(),
               "progress_thread": self.progress.lock().describe(),
               "shared_memory": self.shared_note,
               "early_buckets": {"queued": queued, "pieces": pieces, "pieces_done": done}})
    }

    fn begin(&self, call: &str) {
        call.clone_into(&mut self.call.lock());
    }

    unsafe fn allreduce(
        &self,
        channel: Channel,
        dtype: DType,
        segments: &[Segment<'_>],
        avg: Option<usize>,
    ) -> Result<()> {
        self.refuse_if_failed()?;
        let (datatype, size) = mpi_type(dtype);
        let count: usize = segments.iter().map(|s| s.count).sum();
        let comm = self.comm_of(channel);
        let ring = self.ring(channel);
        // Held to the end: the steps' communicator carries this transfer alone meanwhile.
        let mut queue = (channel == Channel::Steps).then(|| self.queue.lock());
        if let Some(queue) = &mut queue {
            // After every bucket started ahead, on every rank.
            self.drive(queue, Until::Empty)?;
        }
        if count == 0 {
            return Ok(());
        }
        if ring.takes(count * size) {
            // The steps' ring pieces are numbered across the queue's and these.
            let pieces = count.div_ceil(ring.piece_of(size));
            let first = match queue.as_mut() {
                Some(q) => q.ring_pieces(pieces),
                None => self.calls_pieces.fetch_add(pieces, Ordering::Relaxed),
            };
            return self.ring_allreduce((ring, first), (dtype, segments, count), avg);
        }
        let piece = piece_of(size).min(count);
        let pieces = count.div_ceil(piece);
        // Slot `i % DEPTH` of piece `i`: a send area, then a receive area.
        let area = (piece * size).next_multiple_of(64);
        let mut scratch = self.scratch.lock();
        let stages = stage(&mut scratch, 2 * area * DEPTH.min(pieces));
        let at = |i: usize, k: usize| stages.add((2 * (i % DEPTH) + k) * area);
        let range = |i: usize| (i * piece, piece.min(count - i * piece));
        let outs: Vec<(usize, usize)> = segments.iter().map(|s| (s.ptrs[0], s.count)).collect();
        let (mut walk_in, mut walk_out) = (Walk::default(), Walk::default());
        let done = self.run_pieces(
            "MPI_Iallreduce",
            pieces,
            |i, request| {
                stage_in(dtype, segments, &mut walk_in, range(i), at(i, 0));
                ffi::MPI_Iallreduce(
                    at(i, 0).cast(),
                    at(i, 1).cast(),
                    count_of(range(i).1),
                    datatype,
                    ffi::RSMPI_SUM,
                    comm,
                    request,
                )
            },
            |i| stage_out(dtype, at(i, 1), (&outs, &mut walk_out), range(i), avg),
        );
        if done.is_err() {
            // Pieces still pending may read and write their stages.
            std::mem::forget(std::mem::take(&mut *scratch));
        }
        done
    }

    unsafe fn start(
        &self,
        dtype: DType,
        segments: &[Segment<'_>],
        count: usize,
        avg: Option<usize>,
    ) -> Result<Ticket> {
        self.refuse_if_failed()?;
        let size = mpi_type(dtype).1;
        let held = self.spare_stage(count * size);
        let mut queue = self.queue.lock();
        // Cut as a waited transfer of the bucket would be (a bucket off the ring is below
        // either piece size: one piece).
        let piece = self.ring(Channel::Steps).piece_of(size);
        let handle = queue.push((dtype, segments, count), (avg, piece), held);
        self.drive(&mut queue, Until::Idle)?;
        drop(queue);
        self.wake_progress();
        Ok(Ticket(Box::new(handle)))
    }

    unsafe fn release(&self, ticket: &Ticket) {
        if let Some(handle) = ticket.0.downcast_ref::<Handle>() {
            self.queue.lock().release(handle);
        }
    }

    fn poke(&self) {
        if self.refuse_if_failed().is_ok() {
            // Busy: the progress thread is moving the queue. A failure is kept in `failed`:
            // the step's allreduce_grads reports it.
            if let Some(mut queue) = self.queue.try_lock() {
                let _ = self.drive(&mut queue, Until::Idle);
            }
        }
    }

    unsafe fn finish(&self, ticket: Ticket, write: bool) -> Result<()> {
        let Ok(handle) = ticket.0.downcast::<Handle>() else {
            unreachable!("a ticket of another engine");
        };
        self.refuse_if_failed()?;
        let mut queue = self.queue.lock();
        if write {
            queue.release(&handle);
        }
        self.drive(&mut queue, Until::Done(handle.seq()))?;
        let item = queue.take(&handle).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidState,
                "a bucket started early is no longer queued in this context's world",
            )
        })?;
        // The item is ours now: the next buckets move on (progress thread) while it is copied.
        drop(queue);
        if write {
            // The pieces that completed before the step agreed (the others are written).
            let recv = item.held.as_ptr().cast::<u8>();
            let outs = (&item.outs[..], &mut Walk::default());
            stage_out(item.dtype, recv, outs, (0, item.held_count()), item.avg);
        }
        self.spare.lock().push(item.held);
        Ok(())
    }

    unsafe fn broadcast(&self, spans: &[(usize, usize)], root: usize) -> Result<()> {
        self.refuse_if_failed()?;
        let bytes: usize = spans.iter().map(|&(_, n)| n).sum();
        if bytes == 0 {
            return Ok(());
        }
        // Pieces through cache-sized stages, as in `allreduce`: slot `i % DEPTH` of piece `i`.
        let piece = PIECE.min(bytes);
        let pieces = bytes.div_ceil(piece);
        let mut scratch = self.scratch.lock();
        let stages = stage(&mut scratch, piece * DEPTH.min(pieces));
        let at = |i: usize| stages.add((i % DEPTH) * piece);
        let range = |i: usize| (i * piece, piece.min(bytes - i * piece));
        let mine = root == self.rank;
        let (mut walk_in, mut walk_out) = (Walk::default(), Walk::default());
        let sent = self.run_pieces(
            "MPI_Ibcast",
            pieces,
            |i, request| {
                if mine {
                    copy_spans((spans, &mut walk_in), range(i), at(i), false);
                }
                ffi::MPI_Ibcast(
                    at(i).cast(),
                    count_of(range(i).1),
                    ffi::RSMPI_UINT8_T,
                    root as c_int,
                    self.comm.0,
                    request,
                )
            },
            |i| {
                if !mine {
                    copy_spans((spans, &mut walk_out), range(i), at(i), true);
                }
            },
        );
        if sent.is_err() {
            std::mem::forget(std::mem::take(&mut *scratch));
        }
        sent
    }

    fn allgather_fixed(&self, words: &[u64]) -> Result<Vec<u64>> {
        self.refuse_if_failed()?;
        let (n, len) = (self.size, words.len() * 8);
        // Bruck's allgather, point to point: after each round this rank holds the records of
        // ranks rank, rank + 1, ... (mod n), twice as many as before; ceil(log2 n) rounds, one
        // exchange with 2 ranks. Open MPI's non-blocking allgather (libnbc) spends about as long
        // building its schedule as the exchange of a small record takes (docs/PERFORMANCE.md).
        // `held` is leaked on failure: a pending receive may still write it.
        let mut held = vec![0u64; words.len() * n];
        held[..words.len()].copy_from_slice(words);
        let base = held.as_mut_ptr().cast::<u8>();
        let mut since = None;
        let mut rounds = || -> Result<()> {
            let (mut have, mut dist) = (1, 1);
            while have < n {
                let blocks = dist.min(n - have);
                let (to, from) = ((self.rank + n - dist) % n, (self.rank + dist) % n);
                // SAFETY: link-time constants.
                let mut requests = unsafe { [ffi::RSMPI_REQUEST_NULL; 2] };
                // SAFETY: the receive fills records `have..have + blocks` of `held` (within it:
                // `have + blocks <= n`), the send reads the first `blocks <= have`: disjoint.
                unsafe {
                    let count = count_of(blocks * len);
                    check(
                        "MPI_Irecv",
                        ffi::MPI_Irecv(
                            base.add(have * len).cast(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            from as c_int,
                            TAG_GATHER,
                            self.comm.0,
                            &mut requests[0],
                        ),
                    )?;
                    check(
                        "MPI_Isend",
                        ffi::MPI_Isend(
                            base.cast_const().cast(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            to as c_int,
                            TAG_GATHER,
                            self.comm.0,
                            &mut requests[1],
                        ),
                    )?;
                }
                poll(
                    &mut requests,
                    &mut since,
                    self.timeout,
                    "MPI_Isend/MPI_Irecv",
                )?;
                have += blocks;
                dist *= 2;
            }
            Ok(())
        };
        if let Err(e) = rounds() {
            std::mem::forget(held);
            return Err(self.failing(e));
        }
        // `held` starts at this rank's record: rotated into rank order.
        held.rotate_right(self.rank * words.len());
        Ok(held)
    }

    fn allgather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.refuse_if_failed()?;
        // The lengths first (a fixed-size exchange), then the bytes at their offsets.
        let lengths: Vec<u64> = (self.allgather_fixed(&[(bytes.len() as u64).to_le()])?)
            .into_iter()
            .map(u64::from_le)
            .collect();
        let total: u64 = lengths.iter().sum();
        if total == 0 {
            // Nothing to move (and some MPIs refuse a gather of empty buffers).
            return Ok(vec![Vec::new(); self.size]);
        }
        if total > c_int::MAX as u64 {
            return Err(Error::invalid(format!(
                "an exchange between ranks of {total} bytes is beyond MPI's int counts"
            )));
        }
        let counts: Vec<c_int> = lengths.iter().map(|&l| l as c_int).collect();
        let offsets: Vec<c_int> = (counts.iter())
            .scan(0, |at, &n| {
                let o = *at;
                *at += n;
                Some(o)
            })
            .collect();
        let mut all = vec![0u8; total as usize];
        let send = bytes.to_vec();
        // SAFETY: counts and offsets describe `all`; every rank sends what it announced.
        let sent = self.run("MPI_Iallgatherv", |request| unsafe {
            ffi::MPI_Iallgatherv(
                send.as_ptr().cast(),
                count_of(bytes.len()),
                ffi::RSMPI_UINT8_T,
                all.as_mut_ptr().cast(),
                counts.as_ptr(),
                offsets.as_ptr(),
                ffi::RSMPI_UINT8_T,
                self.comm.0,
                request,
            )
        });
        if let Err(e) = sent {
            std::mem::forget((send, all, counts, offsets));
            return Err(e);
        }
        Ok((offsets.iter().zip(&counts))
            .map(|(&o, &n)| all[o as usize..(o + n) as usize].to_vec())
            .collect())
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
