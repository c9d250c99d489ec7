//! Shared memory between the ranks of a world that all run on one host: the ring pieces of a
//! large allreduce ([`super::ring`]) cross through it instead of through MPI messages. Each rank
//! stages a piece straight into its own slot, sums its block of the piece from every rank's
//! slot into its slot, then copies the other ranks' summed blocks; three counters per rank
//! (pieces staged, reduced, copied out) say how far it got, and are polled against the
//! context's timeout like MPI requests. No MPI call moves the bytes and no page is pinned per
//! transfer (Open MPI's single-copy path pins every page of every transfer), and each block is
//! still summed once, at one rank: the same bytes on every rank. A rank only ever writes its own
//! slots, so a rank that times out leaves nothing half-written in another's memory, and a lost
//! rank cannot write the caller's buffers.
//!
//! One POSIX shared-memory object per context, made at join: rank 0 creates it, the others open
//! it once every rank's record (host name, boot id) says they share a host, and rank 0 unlinks
//! it once all have mapped it (or failed to: then every rank stays on MPI). That agreement is
//! `negotiate.rs`'s; this file makes, maps and reads the object.

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

use super::pieces::DEPTH;
use crate::backend::Channel;

/// Bytes before a rank's slots: three counters on their own cache lines, and the nonce.
const HEADER: usize = 4096;
/// The counters' offsets in a rank's header.
pub(super) const STAGED: usize = 0;
pub(super) const REDUCED: usize = 64;
pub(super) const OUT: usize = 128;
/// Rank 0's nonce, which the others check to know they mapped its object.
const NONCE: usize = 192;
/// Bytes per piece through shared memory: smaller than MPI's pieces, so that a piece's gradients
/// are still in this core's cache when its result is written back (read for ownership from
/// memory again otherwise). 128 KiB × 2 measured best of 64 KiB–512 KiB × 2–4: fused ResNet-50
/// 21.6–22.6 ms against 25.9 ms at 512 KiB (docs/PERFORMANCE.md).
pub(super) const PIECE: usize = 128 << 10;
/// Beyond this many ranks on one host, MPI carries the pieces (the object grows with ranks).
pub(super) const MAX_RANKS: usize = 32;

/// The mapped object: for each channel, each rank's header and [`DEPTH`] slots of [`PIECE`].
pub(super) struct Shared {
    base: *mut u8,
    len: usize,
    ranks: usize,
    me: usize,
    /// An elastic world's: every rank's process id, watched while waiting ([`Slots::gone`]).
    peers: Vec<libc::pid_t>,
}

// SAFETY: plain shared memory; each channel's slots are used under that channel's lock (the
// queue's or the waited transfers' stages), and counters are atomics.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

const STRIDE: usize = HEADER + DEPTH * PIECE;

fn bytes_for(ranks: usize) -> usize {
    2 * ranks * STRIDE
}

/// The object's name for rank 0's pid and nonce: ranks of one host see the same.
fn name_of(pid: u64, nonce: u64) -> CString {
    CString::new(format!("/dpsync-{pid}-{nonce:016x}")).expect("no NUL")
}

impl Shared {
    /// Rank 0: creates the object of `name` for `ranks` ranks, with its pages reserved (a full
    /// /dev/shm fails here rather than with SIGBUS later), and writes `nonce`.
    pub(super) fn create(pid: u64, nonce: u64, ranks: usize) -> Result<Shared, String> {
        let (name, len) = (name_of(pid, nonce), bytes_for(ranks));
        // SAFETY: plain libc calls on a name and a descriptor of our own.
        unsafe {
            let flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR;
            let fd = libc::shm_open(name.as_ptr(), flags, 0o600);
            if fd < 0 {
                return Err(format!("shm_open: {}", std::io::Error::last_os_error()));
            }
            let reserved = match libc::ftruncate(fd, len as libc::off_t) {
                0 => libc::posix_fallocate(fd, 0, len as libc::off_t),
                _ => std::io::Error::last_os_error().raw_os_error().unwrap_or(-1),
            };
            let shared = match reserved {
                0 => Shared::map(fd, len, ranks, 0),
                e => Err(format!(
                    "reserving {len} bytes of shared memory: {}",
                    std::io::Error::from_raw_os_error(e)
                )),
            };
            libc::close(fd);
            match shared {
                Ok(s) => {
                    s.word(0, Channel::Calls, NONCE)
                        .store(nonce, Ordering::Release);
                    Ok(s)
                }
                Err(e) => {
                    Shared::unlink(pid, nonce);
                    Err(e)
                }
            }
        }
    }

    /// The other ranks: opens rank 0's object and checks it is the one rank 0 made.
    pub(super) fn open(pid: u64, nonce: u64, ranks: usize, me: usize) -> Result<Shared, String> {
        let (name, len) = (name_of(pid, nonce), bytes_for(ranks));
        // SAFETY: plain libc calls; the size is checked before mapping.
        unsafe {
            let fd = libc::shm_open(name.as_ptr(), libc::O_RDWR, 0);
            if fd < 0 {
                return Err(format!("shm_open: {}", std::io::Error::last_os_error()));
            }
            let mut stat: libc::stat = std::mem::zeroed();
            let shared = match libc::fstat(fd, &mut stat) == 0 && stat.st_size as usize == len {
                true => Shared::map(fd, len, ranks, me),
                false => Err("rank 0's object has another size".to_owned()),
            };
            libc::close(fd);
            let shared = shared?;
            match shared
                .word(0, Channel::Calls, NONCE)
                .load(Ordering::Acquire)
                == nonce
            {
                true => Ok(shared),
                false => Err("another object of the same name (not rank 0's)".to_owned()),
            }
        }
    }

    /// # Safety
    /// `fd` is a shared-memory object of `len` bytes.
    unsafe fn map(fd: i32, len: usize, ranks: usize, me: usize) -> Result<Shared, String> {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let base = libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0);
        if base == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(Shared {
            base: base.cast(),
            len,
            ranks,
            me,
            peers: Vec::new(),
        })
    }

    /// Rank 0, once every rank mapped the object (or gave up): the name goes, the memory stays
    /// until the last rank unmaps it.
    pub(super) fn unlink(pid: u64, nonce: u64) {
        // SAFETY: a name of our own.
        unsafe { libc::shm_unlink(name_of(pid, nonce).as_ptr()) };
    }

    /// An elastic world: waits on the others' counters watch their processes (`pids`, in rank
    /// order), since a dead rank never moves its counters and no MPI call reports it there.
    pub(super) fn watch(&mut self, pids: Vec<libc::pid_t>) {
        self.peers = pids;
    }

    /// The view of `channel`'s slots for [`super::ring::Ring`].
    pub(super) fn slots(&self, channel: Channel) -> Slots {
        let first = match channel {
            Channel::Calls => 0,
            Channel::Steps => self.ranks,
        };
        Slots {
            // SAFETY: within the mapping (two channels of `ranks` strides).
            base: unsafe { self.base.add(first * STRIDE) },
            ranks: self.ranks,
            me: self.me,
            peers: (self.peers.as_ptr(), self.peers.len()),
        }
    }

    fn word(&self, rank: usize, channel: Channel, offset: usize) -> &AtomicU64 {
        let at = self.slots(channel).header(rank, offset);
        // SAFETY: an aligned word of the mapping, which lives as long as `self`.
        unsafe { &*at.cast::<AtomicU64>() }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: our mapping; nothing of this process uses it any more (the engine goes, and
        // the ranks' pieces never outlive a call).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// One channel's part of the [`Shared`] object, as the ring's pieces use it: plain pointers, so
/// that a [`super::ring::Ring`] stays `Copy`; valid while the engine lives.
#[derive(Clone, Copy)]
pub(super) struct Slots {
    base: *mut u8,
    ranks: usize,
    me: usize,
    /// The watched process ids ([`Shared::watch`]; none in a plain world).
    peers: (*const libc::pid_t, usize),
}

impl Slots {
    /// The first other rank whose process is gone (an elastic world's watch), or None.
    pub(super) fn gone(&self) -> Option<usize> {
        // SAFETY: the engine's vector, which outlives every use of `self`.
        let peers = unsafe { std::slice::from_raw_parts(self.peers.0, self.peers.1) };
        (0..peers.len())
            .filter(|&r| r != self.me)
            .find(|&r| crate::backend::process_gone(peers[r] as u32))
    }

    fn header(&self, rank: usize, offset: usize) -> *mut u8 {
        // SAFETY: within the channel's part of the mapping.
        unsafe { self.base.add(rank * STRIDE + offset) }
    }

    fn counter(&self, rank: usize, which: usize) -> &AtomicU64 {
        // SAFETY: an aligned word of the mapping, which outlives every use of `self`.
        unsafe { &*self.header(rank, which).cast::<AtomicU64>() }
    }

    /// `rank`'s slot for ring piece `k`.
    pub(super) fn slot(&self, rank: usize, k: usize) -> *mut u8 {
        // SAFETY: within the mapping.
        unsafe { self.header(rank, HEADER).add((k % DEPTH) * PIECE) }
    }

    /// This rank's slot for piece `k`, once every rank is done with what it held before (piece
    /// `k - DEPTH`); None: not yet.
    pub(super) fn mine_when_free(&self, k: usize) -> Option<*mut u8> {
        let free = k < DEPTH || self.least(OUT) > (k - DEPTH) as u64;
        free.then(|| self.slot(self.me, k))
    }

    /// This rank went past phase `which` of piece `k`.
    pub(super) fn publish(&self, which: usize, k: usize) {
        self.counter(self.me, which)
            .store(k as u64 + 1, Ordering::Release);
    }

    /// The first piece this rank has not taken past phase `which`.
    pub(super) fn next(&self, which: usize) -> usize {
        self.counter(self.me, which).load(Ordering::Relaxed) as usize
    }

    /// Whether every rank went past phase `which` of piece `k`.
    pub(super) fn all_past(&self, which: usize, k: usize) -> bool {
        self.least(which) > k as u64
    }

    fn least(&self, which: usize) -> u64 {
        (0..self.ranks)
            .map(|r| self.counter(r, which).load(Ordering::Acquire))
            .min()
            .unwrap_or(0)
    }

    pub(super) fn ranks(&self) -> usize {
        self.ranks
    }

    pub(super) fn me(&self) -> usize {
        self.me
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks' mappings of one object in one process: what one publishes the other sees,
    /// slots are each rank's own, and a slot is free again only once every rank is out of the
    /// piece that held it.
    #[test]
    fn two_mappings_share_counters_and_slots() {
        let (pid, nonce) = (u64::from(std::process::id()), 0x5eed_0001);
        let zero = Shared::create(pid, nonce, 2).expect("create");
        let one = Shared::open(pid, nonce, 2, 1).expect("open");
        assert!(Shared::open(pid, nonce ^ 1, 2, 1).is_err(), "another name");
        Shared::unlink(pid, nonce);
        assert!(Shared::open(pid, nonce, 2, 1).is_err(), "unlinked");
        let (a, b) = (zero.slots(Channel::Steps), one.slots(Channel::Steps));
        // Slots of the other channel are elsewhere.
        assert_ne!(zero.slots(Channel::Calls).slot(0, 0), a.slot(0, 0));
        // SAFETY: each mapping writes its own rank's slot; both are in the object.
        unsafe {
            a.slot(0, 0).write(7);
            b.slot(1, 0).write(9);
            assert_eq!(b.slot(0, 0).read(), 7);
            assert_eq!(a.slot(1, 0).read(), 9);
        }
        assert_ne!(a.slot(0, 0), a.slot(0, 1), "piece 1 has slot 1");
        assert_eq!(a.slot(0, 0), a.slot(0, DEPTH), "slot k % DEPTH");
        a.publish(STAGED, 0);
        assert!(!a.all_past(STAGED, 0), "rank 1 has not staged piece 0");
        b.publish(STAGED, 0);
        assert!(a.all_past(STAGED, 0) && b.all_past(STAGED, 0));
        assert!(!a.all_past(STAGED, 1));
        assert_eq!((a.next(STAGED), a.next(REDUCED)), (1, 0));
        // Pieces 0..DEPTH have fresh slots; piece DEPTH reuses piece 0's once both are out.
        assert!(a.mine_when_free(DEPTH - 1).is_some());
        assert!(a.mine_when_free(DEPTH).is_none());
        a.publish(OUT, 0);
        assert!(a.mine_when_free(DEPTH).is_none(), "rank 1 still reads it");
        b.publish(OUT, 0);
        assert_eq!(a.mine_when_free(DEPTH), Some(a.slot(0, 0)));
    }
}
