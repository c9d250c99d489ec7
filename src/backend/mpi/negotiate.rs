//! Whether a world's ring pieces cross through shared memory, agreed at join: every rank must
//! take the same path, or the two sides of a bucket would meet different protocols, so the
//! ranks exchange what each found (host, willingness, rank 0's object) and all decide from the
//! same records. The object itself, and its mapping, are `shm.rs`'s.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::shm::{self, Shared};
use super::MpiRanks;
use crate::backend::Ranks;
use crate::error::Result;

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

impl MpiRanks {
    /// Sets up the shared memory of a world whose ranks all run on this host (collective): two
    /// exchanges of a small record. Off where `DPSYNC_MPI_SHM=0` on any rank, across hosts,
    /// beyond [`shm::MAX_RANKS`] ranks, or where a rank cannot map rank 0's object (another
    /// user, a container with its own /dev/shm): MPI carries the pieces then. Also an elastic
    /// world's other ranks on this host, with their processes (`Ranks::neighbours`).
    pub(super) fn share_memory(&self) -> Result<(Option<Shared>, String, Neighbours)> {
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
        let neighbours: Neighbours = (0..n)
            .filter(|&r| self.elastic && r != me && of(r)[0] == record[0])
            .map(|r| (r, of(r)[1] as u32))
            .collect();
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
            return Ok((None, why, neighbours));
        }
        Ok(match mapped.iter().position(|&m| m == 0) {
            Some(r) if r == me => (None, note, neighbours),
            Some(r) => (
                None,
                format!("off: rank {r} could not map rank 0's object"),
                neighbours,
            ),
            None => {
                if let (true, Some(shared)) = (self.elastic, mine.as_mut()) {
                    shared.watch((0..n).map(|r| of(r)[1] as libc::pid_t).collect());
                }
                (mine, format!("on: all {n} ranks on this host"), neighbours)
            }
        })
    }
}

/// Other ranks on this host and their process ids.
type Neighbours = Vec<(usize, u32)>;
