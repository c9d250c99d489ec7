//! MPI's life in this process and a context's entry into a world: dpsync initialises MPI only
//! where the caller did not (then finalises it at exit, after its own progress threads are out
//! of MPI), and a context joins through duplicates of the caller's communicator, so that its
//! traffic never mixes with theirs.

use std::ffi::{c_int, c_void, CStr};
use std::mem::{size_of, MaybeUninit};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mpi::ffi;
use parking_lot::{Condvar, Mutex, RwLock};

use super::calls::{backend_error, check};
use super::poll::poll;
use super::progress::Progress;
use super::steps::Queue;
use super::{Comm, Engine, MpiRanks};
use crate::error::{Error, ErrorKind, Result};
use crate::options::World;

/// Serialises dpsync's MPI initialisation (two contexts created at once by two threads).
static INIT: Mutex<()> = Mutex::new(());

extern "C" {
    /// The C library's: dpsync finalises the MPI it initialised when the process exits
    /// (cbindgen.toml excludes it from the header).
    fn atexit(callback: extern "C" fn()) -> c_int;
}

/// Set by the exit hook before it finalises MPI: progress threads make no MPI call after it.
pub(super) static EXITING: AtomicBool = AtomicBool::new(false);

/// Held shared by a progress thread while it calls MPI, exclusive by the exit hook while it
/// finalises: Open MPI's MPI_Finalize crashes with another thread inside MPI.
pub(super) static IN_MPI: RwLock<()> = RwLock::new(());

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

pub(super) fn finalized() -> bool {
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

/// The MPI library's name and version, on one line.
pub(crate) fn library_name() -> String {
    library_version()
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_owned()
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

impl MpiRanks {
    /// See [`crate::backend::join`].
    pub(crate) fn join(world: &World, timeout_ms: u64, elastic: bool) -> Result<MpiRanks> {
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
        // SAFETY: `parent` is a valid communicator of this MPI.
        unsafe { Self::join_comm(parent, timeout, elastic) }
    }

    /// The engine of the ranks that remain when `left` (ranks of this engine) leave: a
    /// communicator of the others made from this one's group (only they take part), joined as
    /// at creation.
    pub(crate) fn remaining(&self, left: &[usize]) -> Result<MpiRanks> {
        let excluded: Vec<std::ffi::c_int> = left.iter().map(|&r| r as std::ffi::c_int).collect();
        // SAFETY: this engine's valid communicator; the groups and the new communicator are
        // freed here once joined (the engine keeps its own duplicates).
        unsafe {
            let mut group = MaybeUninit::<ffi::MPI_Group>::uninit();
            check(
                "MPI_Comm_group",
                ffi::MPI_Comm_group(self.comm.0, group.as_mut_ptr()),
            )?;
            let mut group = group.assume_init();
            let mut rest = MaybeUninit::<ffi::MPI_Group>::uninit();
            let made = check(
                "MPI_Group_excl",
                ffi::MPI_Group_excl(
                    group,
                    excluded.len() as _,
                    excluded.as_ptr(),
                    rest.as_mut_ptr(),
                ),
            );
            ffi::MPI_Group_free(&mut group);
            made?;
            let mut rest = rest.assume_init();
            let mut comm = MaybeUninit::<ffi::MPI_Comm>::uninit();
            let made = check(
                "MPI_Comm_create_group",
                ffi::MPI_Comm_create_group(self.comm.0, rest, 0x6470, comm.as_mut_ptr()),
            );
            ffi::MPI_Group_free(&mut rest);
            made?;
            let mut comm = comm.assume_init();
            let joined = Self::join_comm(comm, self.timeout, self.elastic);
            ffi::MPI_Comm_free(&mut comm);
            joined
        }
    }

    /// Joins the ranks of `parent` (collective over them); `elastic`: a world that survives
    /// lost ranks, whose pieces never cross shared memory (a dead peer's counters would be
    /// waited on forever), only MPI messages, whose failures ULFM reports.
    ///
    /// # Safety
    /// `parent` is a valid communicator of this MPI.
    pub(super) unsafe fn join_comm(
        parent: ffi::MPI_Comm,
        timeout: Option<Duration>,
        elastic: bool,
    ) -> Result<MpiRanks> {
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
            elastic,
            begun: AtomicBool::new(false),
            agreed: AtomicBool::new(false),
            neighbours: Vec::new(),
        };
        let mut ranks = MpiRanks {
            engine: Arc::new(engine),
            progress: Mutex::new(Progress::NotYet),
        };
        let (shared, note, neighbours) = ranks.share_memory()?;
        let engine = Arc::get_mut(&mut ranks.engine).expect("not shared before join returns");
        (engine.shared, engine.shared_note, engine.neighbours) = (shared, note, neighbours);
        Ok(ranks)
    }
}
