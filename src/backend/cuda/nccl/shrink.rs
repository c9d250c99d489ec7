//! A clique across the ranks shrunk over the survivors of a loss (`ncclCommShrink`, NCCL
//! 2.27+) instead of made anew: the parent's operations are ended first (`NCCL_SHRINK_ABORT`:
//! they may wait on the dead peer) and the child is made in one group, not waited for.

use std::ffi::c_int;

use parking_lot::Mutex;

use super::api::{api, SHRINK_ABORT};
use super::{config, CommSet, PrimaryContext};
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
        let end = "ncclGroupEnd (shrink)";
        let made = CommSet::made_per_device(devices, end, |_, i, comm| {
            let mut config = config();
            // SAFETY: a live parent (the guard keeps it from being aborted meanwhile), this
            // device's context current.
            let code = unsafe {
                shrink(
                    self.comms[i],
                    list.as_mut_ptr(),
                    list.len() as c_int,
                    comm,
                    &mut config,
                    SHRINK_ABORT,
                )
            };
            let rank = self.first + i;
            (
                code,
                format!("ncclCommShrink(rank {rank}, cuda:{})", devices[i].ordinal),
            )
        });
        drop(live);
        let (comms, made) = made?;
        let below = exclude.iter().filter(|&&r| r < self.first).count();
        CommSet {
            ordinals: self.ordinals.clone(),
            comms,
            first: self.first - below,
            aborted: Mutex::new(false),
        }
        .unless(made)
    }

    /// The clique rank of this set's first communicator.
    pub fn first(&self) -> usize {
        self.first
    }
}
