//! Moving a batch of byte ranges between replicas (the sparse gather's phases), written once
//! over [`Backend::copy`] and, between the devices of a backend with a grouped transport,
//! [`Collective::send_recv`](crate::backend::Collective::send_recv).

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::backend::{Backend, Move};
use crate::error::Result;
use crate::plan::{Across, Levels};

/// One copy of a batch: `bytes` from `src` on replica `src_replica` to `dst` on replica
/// `dst_replica`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub src_replica: usize,
    pub src: usize,
    pub dst_replica: usize,
    pub dst: usize,
    pub bytes: usize,
}

/// Runs `batch`, whose transfers are independent (none reads memory another writes), skipping
/// empty ones. Where the groups are joined by a grouped collective (NCCL), the moves between
/// groups become sends and receives in one group: a destination group receives each source
/// range once, and its other replicas copy it locally after the receive. Otherwise every
/// transfer is one [`Backend::copy`].
///
/// # Safety
/// As for [`Backend::copy`], for every transfer.
pub(super) unsafe fn transfer(
    backend: &dyn Backend,
    levels: &Levels,
    batch: &[Transfer],
) -> Result<()> {
    let collective = match (&levels.across, backend.links().and_then(|l| l.collective())) {
        (Across::Collective, Some(c)) if levels.groups.len() > 1 => c,
        _ => return copy_each(backend, batch),
    };
    let group_of = levels.group_of();
    let mut moves = Vec::new();
    // Copies within a group: from the source itself, or from where a receive put it.
    let mut local = Vec::new();
    let mut after_receive = Vec::new();
    // (source address, bytes, destination group) -> where that group received it.
    let mut received: HashMap<(usize, usize, usize), (usize, usize)> = HashMap::new();
    for t in batch.iter().filter(|t| t.bytes > 0) {
        let (gs, gd) = (group_of[t.src_replica], group_of[t.dst_replica]);
        if gs == gd {
            local.push(*t);
            continue;
        }
        match received.entry((t.src, t.bytes, gd)) {
            Entry::Occupied(at) => {
                let (src_replica, src) = *at.get();
                after_receive.push(Transfer {
                    src_replica,
                    src,
                    ..*t
                });
            }
            Entry::Vacant(slot) => {
                slot.insert((t.dst_replica, t.dst));
                moves.push(Move {
                    src_group: gs,
                    src: t.src as u64,
                    dst_group: gd,
                    dst: t.dst as u64,
                    bytes: t.bytes,
                });
            }
        }
    }
    // Not behind the receives on their streams: they do not need them.
    copy_each(backend, &local)?;
    if !moves.is_empty() {
        collective.send_recv(&moves)?;
    }
    // On the destinations' streams, after their receives.
    copy_each(backend, &after_receive)
}

/// One [`Backend::copy`] per non-empty transfer.
///
/// # Safety
/// As for [`transfer`].
unsafe fn copy_each(backend: &dyn Backend, batch: &[Transfer]) -> Result<()> {
    for t in batch.iter().filter(|t| t.bytes > 0) {
        backend.copy(t.src_replica, t.src, t.dst_replica, t.dst, t.bytes)?;
    }
    Ok(())
}
