//! A clique across the ranks shrunk over the survivors of a loss (`ncclCommShrink`, NCCL
//! 2.27+) instead of made anew: the parent's operations are ended first (`NCCL_SHRINK_ABORT`:
//! they may wait on the dead peer) and the child is made in one group, not waited for.

use std::ffi::c_int;

use parking_lot::Mutex;

use super::api::{api, check, Comm, SHRINK_ABORT};
use super::{config, driver, CommSet, PrimaryContext};
use crate::error::{Error, ErrorKind, Result};

impl CommSet {
    /// Whether the loaded NCCL can shrink a clique.
    pub fn can_shrink() -> bool {
        api().is_ok_and(|api| api.comm_shrink.is_some())
    }

    /// The child of this set without clique ranks `exclude` (none of them this set's), issued
    /// on `devices` (this set's, in order) but not waited for ([`CommSet::ready`]). This set,
    /// its operations ended, stays alive until the child is ready or given up (the child is
    /// made over the parent's connections), then is aborted.
    pub fn shrink(&self, devices: &[&PrimaryContext], exclude: &[usize]) -> Result<CommSet> {
        let api = api()?;
        let Some(shrink) = api.comm_shrink else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("{} has no ncclCommShrink (NCCL 2.27+)", api.path),
            ));
        };
        let live = self.live()?;
        let mut list: Vec<c_int> = exclude.iter().map(|&r| r as c_int).collect();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); self.comms.len()];
        let _kept = driver::keep_current()?;
        // SAFETY: live parents (the guard keeps them from being aborted meanwhile); group calls
        // bracket one shrink per device, each with its context current.
        let (made, end) = unsafe {
            check(api, (api.group_start)(), "ncclGroupStart")?;
            let mut made = Ok(());
            for (i, dev) in devices.iter().enumerate() {
                let bound = dev.bind();
                if let Err(e) = bound {
                    made = made.and(Err(e));
                    continue;
                }
                let mut config = config();
                let code = shrink(
                    self.comms[i],
                    list.as_mut_ptr(),
                    list.len() as c_int,
                    &mut comms[i],
                    &mut config,
                    SHRINK_ABORT,
                );
                let rank = self.first + i;
                let what = format!("ncclCommShrink(rank {rank}, cuda:{})", dev.ordinal);
                made = made.and(check(api, code, &what));
            }
            (made, check(api, (api.group_end)(), "ncclGroupEnd (shrink)"))
        };
        drop(live);
        let below = exclude.iter().filter(|&&r| r < self.first).count();
        let child = CommSet {
            ordinals: self.ordinals.clone(),
            comms,
            first: self.first - below,
            aborted: Mutex::new(false),
        };
        if let Err(e) = made.and(end) {
            child.abort();
            return Err(e);
        }
        Ok(child)
    }

    /// The clique rank of this set's first communicator.
    pub fn first(&self) -> usize {
        self.first
    }
}
