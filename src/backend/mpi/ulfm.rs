//! User-Level Failure Mitigation (ULFM): how an elastic world's ranks learn alike that a rank
//! was lost, and make their world again over the survivors. The `MPIX_Comm_*` calls are looked
//! up at run time (`dlsym`), so one build serves an MPI with ULFM (Open MPI 5 under
//! `mpirun --with-ft ulfm`) and one without (Open MPI 4.1: elastic worlds are refused there).

use std::ffi::{c_int, c_void, CString};
use std::mem::MaybeUninit;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::calls::{backend_error, check};
use super::MpiRanks;
use crate::error::{Error, ErrorKind, Result};

/// MPIX_ERR_PROC_FAILED and MPIX_ERR_PROC_FAILED_PENDING in Open MPI 5 (mpi.h: 75, 76).
const PROC_FAILED: [c_int; 2] = [75, 76];

/// ULFM's calls dpsync uses, in the order of [`Ulfm`]'s fields.
const NAMES: [&str; 4] = [
    "MPIX_Comm_revoke",
    "MPIX_Comm_shrink",
    "MPIX_Comm_iagree",
    "MPIX_Comm_failure_ack",
];
/// Looked up after the others (its name is the same in every Open MPI 5).
const ACKED: &str = "MPIX_Comm_failure_get_acked";

type CommFn = unsafe extern "C" fn(ffi::MPI_Comm) -> c_int;
type ShrinkFn = unsafe extern "C" fn(ffi::MPI_Comm, *mut ffi::MPI_Comm) -> c_int;
type IagreeFn = unsafe extern "C" fn(ffi::MPI_Comm, *mut c_int, *mut ffi::MPI_Request) -> c_int;
type AckedFn = unsafe extern "C" fn(ffi::MPI_Comm, *mut ffi::MPI_Group) -> c_int;

/// The MPI's ULFM entry points.
struct Ulfm {
    revoke: CommFn,
    shrink: ShrinkFn,
    iagree: IagreeFn,
    failure_ack: CommFn,
    failure_get_acked: AckedFn,
}

fn lookup(name: &str) -> *mut c_void {
    let symbol = CString::new(name).expect("no NUL");
    // SAFETY: a NUL-terminated name looked up in the loaded objects.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, symbol.as_ptr()) }
}

/// The first of ULFM's calls dpsync needs that this process's MPI lacks (Open MPI 5 has them,
/// Open MPI 4 and most MPICH builds do not), or `None`.
pub(crate) fn ulfm_missing() -> Option<&'static str> {
    NAMES
        .into_iter()
        .chain([ACKED])
        .find(|name| lookup(name).is_null())
}

fn ulfm() -> Result<&'static Ulfm> {
    static ULFM: OnceLock<Option<Ulfm>> = OnceLock::new();
    let found = ULFM.get_or_init(|| {
        if ulfm_missing().is_some() {
            return None;
        }
        // SAFETY: the symbols exist (checked above) and have these C signatures (mpi-ext.h of
        // Open MPI 5: MPIX_Comm_revoke(MPI_Comm), MPIX_Comm_shrink(MPI_Comm, MPI_Comm *), ...).
        unsafe {
            Some(Ulfm {
                revoke: std::mem::transmute::<*mut c_void, CommFn>(lookup(NAMES[0])),
                shrink: std::mem::transmute::<*mut c_void, ShrinkFn>(lookup(NAMES[1])),
                iagree: std::mem::transmute::<*mut c_void, IagreeFn>(lookup(NAMES[2])),
                failure_ack: std::mem::transmute::<*mut c_void, CommFn>(lookup(NAMES[3])),
                failure_get_acked: std::mem::transmute::<*mut c_void, AckedFn>(lookup(ACKED)),
            })
        }
    });
    found.as_ref().ok_or_else(|| {
        Error::new(
            ErrorKind::Unavailable,
            "this MPI has no User-Level Failure Mitigation",
        )
    })
}

/// How many failed processes of `comm` this rank knows of (acknowledging them first).
///
/// # Safety
/// `comm` is a valid communicator.
unsafe fn failures_known(u: &Ulfm, comm: ffi::MPI_Comm) -> Result<usize> {
    check("MPIX_Comm_failure_ack", (u.failure_ack)(comm))?;
    let mut group = MaybeUninit::<ffi::MPI_Group>::uninit();
    check(
        "MPIX_Comm_failure_get_acked",
        (u.failure_get_acked)(comm, group.as_mut_ptr()),
    )?;
    let mut group = group.assume_init();
    let mut size: c_int = 0;
    ffi::MPI_Group_size(group, &mut size);
    ffi::MPI_Group_free(&mut group);
    Ok(size as usize)
}

impl MpiRanks {
    /// An elastic world's vote at the end of a collective (every rank that made the call's
    /// agreement votes): whether any rank knows of a lost rank. A rank whose part of the call
    /// failed (its transfers, or `failed_here`: its device, a peer's process seen gone before
    /// MPI noticed) votes a loss, and revokes the world's communicators first, so that every
    /// other rank's pending transfers fail too and it reaches the vote. Else ULFM's agreement
    /// may complete without a rank that died inside it, and the others would answer OK where
    /// this rank failed. `MPIX_Comm_iagree` decides alike on every survivor, polled within the
    /// world's timeout.
    pub(crate) fn vote_lost(&self, failed_here: Option<&str>) -> Result<bool> {
        let u = ulfm()?;
        let failed = self.failed.lock().is_some();
        // SAFETY: this engine's communicators; the request and flag live until it completes.
        unsafe {
            if failed || failed_here.is_some() {
                (u.revoke)(self.comm.0);
                (u.revoke)(self.steps.0);
            }
            let known = failures_known(u, self.comm.0)?;
            let mine = c_int::from(known == 0 && !failed && failed_here.is_none());
            let mut flag = mine;
            let mut request = MaybeUninit::<ffi::MPI_Request>::uninit();
            let rc = (u.iagree)(self.comm.0, &mut flag, request.as_mut_ptr());
            if PROC_FAILED.contains(&rc) {
                return Ok(self.voted_loss(format!("MPIX_Comm_iagree answered {rc} at once")));
            }
            check("MPIX_Comm_iagree", rc)?;
            let mut request = request.assume_init();
            let rc = self.wait_one(&mut request, "the elastic world's vote (MPIX_Comm_iagree)")?;
            if PROC_FAILED.contains(&rc) {
                return Ok(self.voted_loss(format!("MPIX_Comm_iagree completed with {rc}")));
            }
            check("MPIX_Comm_iagree", rc)?;
            if flag != 0 {
                return Ok(false);
            }
            let why = match (failed, known, failed_here) {
                (true, _, _) => "this rank's engine had failed".to_owned(),
                (_, k, _) if k > 0 => format!("this rank knew of {k} failed process(es)"),
                (_, _, Some(why)) => format!("this rank's part of the call failed: {why}"),
                _ => "another rank voted it (its engine or its part of the call failed, or \
                      it knew of a failed process)"
                    .to_owned(),
            };
            Ok(self.voted_loss(why))
        }
    }

    /// A vote that found a loss: why, kept as the engine's failure (describe's world
    /// `failed`) unless it failed already; true.
    fn voted_loss(&self, why: String) -> bool {
        (self.failed.lock())
            .get_or_insert_with(|| format!("the elastic world's vote found a loss: {why}"));
        true
    }

    /// Waits for `request` within the world's timeout; its return code.
    ///
    /// # Safety
    /// `request` is a valid request of this process.
    unsafe fn wait_one(&self, request: &mut ffi::MPI_Request, what: &str) -> Result<c_int> {
        let start = Instant::now();
        loop {
            let mut done: c_int = 0;
            let rc = ffi::MPI_Test(request, &mut done, ffi::RSMPI_STATUS_IGNORE);
            if rc != 0 || done != 0 {
                return Ok(rc);
            }
            if self.timeout.is_some_and(|t| start.elapsed() > t) {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "waited {} ms (the context's timeout) in {what}: a rank is stuck \
                         outside dpsync; this world is failed",
                        self.timeout.unwrap_or_default().as_millis()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// After a vote found a loss: the world's communicators revoked, shrunk to the survivors
    /// (`MPIX_Comm_shrink`), which are joined as at creation. Returns the new engine and the
    /// lost ranks (this engine's numbers), alike on every survivor.
    pub(crate) fn shrunk(&self) -> Result<(MpiRanks, Vec<usize>)> {
        let u = ulfm()?;
        // The old communicators are revoked: freeing them is left to MPI_Finalize.
        self.failed
            .lock()
            .get_or_insert_with(|| "ranks were lost".to_owned());
        // SAFETY: this engine's communicators; the groups made here are freed here.
        unsafe {
            (u.revoke)(self.comm.0);
            (u.revoke)(self.steps.0);
            let mut comm = MaybeUninit::<ffi::MPI_Comm>::uninit();
            let rc = (u.shrink)(self.comm.0, comm.as_mut_ptr());
            if rc != 0 {
                return Err(backend_error("MPIX_Comm_shrink", rc));
            }
            let mut comm = comm.assume_init();
            ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN);
            let survivors = survivors_of(self.comm.0, comm);
            let joined = survivors.and_then(|s| {
                let lost = (0..self.size).filter(|r| !s.contains(r)).collect();
                Ok((Self::join_comm(comm, self.timeout, true)?, lost))
            });
            ffi::MPI_Comm_free(&mut comm);
            joined
        }
    }
}

/// The ranks of `old` that are in `new`.
///
/// # Safety
/// Both are valid communicators.
unsafe fn survivors_of(old: ffi::MPI_Comm, new: ffi::MPI_Comm) -> Result<Vec<usize>> {
    let mut groups = [MaybeUninit::<ffi::MPI_Group>::uninit(); 2];
    check(
        "MPI_Comm_group",
        ffi::MPI_Comm_group(old, groups[0].as_mut_ptr()),
    )?;
    check(
        "MPI_Comm_group",
        ffi::MPI_Comm_group(new, groups[1].as_mut_ptr()),
    )?;
    let [mut old_group, mut new_group] = groups.map(|g| g.assume_init());
    let mut size: c_int = 0;
    ffi::MPI_Group_size(new_group, &mut size);
    let theirs: Vec<c_int> = (0..size).collect();
    let mut ours = vec![0 as c_int; theirs.len()];
    let rc = ffi::MPI_Group_translate_ranks(
        new_group,
        size,
        theirs.as_ptr(),
        old_group,
        ours.as_mut_ptr(),
    );
    ffi::MPI_Group_free(&mut old_group);
    ffi::MPI_Group_free(&mut new_group);
    check("MPI_Group_translate_ranks", rc)?;
    Ok(ours.into_iter().map(|r| r as usize).collect())
}
