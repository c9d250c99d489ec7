//! The dense collectives of one bucket, level by level ([`Levels`]): reduce each group up (level
//! 1), combine the groups across the top (level 2), spread the result back down.
//!
//! - One group (host replicas, or every CUDA replica on one GPU): [`Backend::reduce`] /
//!   [`Backend::spread`] in place.
//! - Several groups (GPUs): each group's replicas packed into its fusion buffer
//!   ([`Links::pack`]: the local sum, or the root's copy for a broadcast); the buffers combined
//!   by one grouped collective (NCCL) or by the plan's steps (a peer read, or a staged copy,
//!   then an add; result copies); each buffer unpacked into its group's replicas (with the AVG
//!   division). Buffers and layouts are made first, so that nothing between the exchange and
//!   the unpacks allocates.
//! - A world of processes (host replicas): level 1 in place without the AVG division, then the
//!   ranks' sum of local replica 0's bucket with the division ([`Ranks::allreduce`], one
//!   message), and local replica 0's result spread to the others ([`Backend::spread`]). Half
//!   types go to the engine unreduced, so their f32 sum is rounded once.
//! - A world of processes on device replicas, NCCL across the ranks: levels 1 and 2 as in one
//!   process, level 2's collective spanning every rank's device groups.
//! - A world of processes on device replicas otherwise: levels 1 and 2 as in one process, then
//!   local replica 0's bucket through page-locked host memory ([`Streams::host_stage`]) to the
//!   ranks' sum, and back into every local replica (f16/bf16: every local replica's bucket, to
//!   be summed in f32 and rounded once).

use super::staged::{allreduce_staged, contributions, stage_in, stage_out};
use super::Site;
use crate::backend::{
    Allocation, Backend, BucketView, Channel, Layout, Links, Members, Ranks, Slot,
};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::{Across, Levels, Route, Step, StepOp, Via};
use crate::timeline::{self, Tracer};
use crate::types::DType;
use serde_json::json;

/// Every replica of `site` ends with the sum of `bucket` over all replicas (divided by `avg`).
///
/// # Safety
/// Every pointer of the bucket is valid for its segment on its replica.
pub(super) unsafe fn allreduce(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
) -> Result<()> {
    if site.levels.reproducible && bucket.dtype.is_float() {
        return super::repro::allreduce(site, bucket, avg);
    }
    let Site {
        backend,
        levels,
        ranks,
        trace,
        channel,
        ..
    } = site;
    match (&levels.route, ranks, backend.streams()) {
        (Route::Local, ..) => allreduce_levels(backend, levels, bucket, avg, false),
        // Levels 2 and 3 in one collective over the world's device groups (NCCL).
        (Route::RanksOverClique(_), ..) => allreduce_levels(backend, levels, bucket, avg, true),
        (Route::RanksFromHost, Some(ranks), _) => {
            allreduce_ranks(backend, levels, (ranks, channel), bucket, avg, trace)
        }
        (Route::RanksStaged, Some(ranks), Some(streams)) => {
            allreduce_staged(site, streams, ranks, bucket, avg)
        }
        (route, ..) => unreachable!("route {route:?} without its engine"),
    }
}

/// Levels 1 and 2 (in `world`: level 2 is the collective across the ranks too).
///
/// # Safety
/// As for [`allreduce`].
pub(super) unsafe fn allreduce_levels(
    backend: &dyn Backend,
    levels: &Levels,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
    world: bool,
) -> Result<()> {
    let replicas: usize = levels.groups.iter().map(Vec::len).sum();
    if bucket.elements() == 0 || (replicas <= 1 && avg.is_none() && !world) {
        return Ok(());
    }
    let links = match (&levels.across, backend.links()) {
        (Across::Nothing, _) | (_, None) => {
            for (g, members) in levels.groups.iter().enumerate() {
                backend.reduce(g, members, bucket, avg)?;
            }
            return Ok(());
        }
        (_, Some(links)) => links,
    };
    let (buffers, layouts) = sum_up(links, levels, bucket)?;
    unpack_all(links, bucket, &layouts, &buffers, avg)
}

/// Levels 1 and 2 up: every group's replicas packed into its fusion buffer and the buffers
/// combined, so that each ends with the process's sum (the replicas are not written); the
/// buffers and their layouts.
///
/// # Safety
/// As for [`allreduce`].
unsafe fn sum_up(
    links: &dyn Links,
    levels: &Levels,
    bucket: &BucketView<'_>,
) -> Result<(Vec<u64>, Vec<Layout>)> {
    let (buffers, layouts) = fusion_buffers(links, levels, bucket)?;
    for (g, (&layout, &buffer)) in layouts.iter().zip(&buffers).enumerate() {
        links.pack(g, bucket, layout, buffer)?;
    }
    combine(links, levels, bucket, &buffers)?;
    Ok((buffers, layouts))
}

/// The process's sum of `bucket` over levels 1 and 2 in group 0's fusion buffer (laid end to
/// end, as the walk packs it), the replicas unchanged: a staged bucket started early on a rank
/// of several replicas. The same kernels and order as [`allreduce_levels`], so the same sums.
///
/// # Safety
/// As for [`allreduce`]; the buffer holds the sum once the work queued on group 0 ran, until
/// the next collective on the groups' streams.
pub(super) unsafe fn sum_into_fusion(
    backend: &dyn Backend,
    levels: &Levels,
    bucket: &BucketView<'_>,
) -> Result<u64> {
    let Some(links) = backend.links() else {
        let message = format!("{} offers no links for levels 1 and 2", backend.name());
        return Err(Error::new(ErrorKind::Panic, message));
    };
    Ok(sum_up(links, levels, bucket)?.0[0])
}

/// A reduce-scatter over levels 1 and 2 (several groups, or NCCL across the ranks): every
/// group's replicas packed and the buffers combined exactly as [`allreduce`] does (so the same
/// sums), the result divided by `avg` in each group's buffer (the unpack's arithmetic), and each
/// replica's owned pieces (`owned(segment, replica)`) copied out of its group's buffer: nothing
/// else of the replicas is written, and no copy of the bucket is made. `false` (nothing done)
/// where the levels have no such combine.
///
/// # Safety
/// As for [`allreduce`].
pub(super) unsafe fn reduce_scatter_levels(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
    owned: &dyn Fn(usize, usize) -> (usize, usize),
) -> Result<bool> {
    let (backend, levels) = (site.backend, site.levels);
    let combined = matches!(levels.route, Route::Local | Route::RanksOverClique(_));
    let links = match (&levels.across, backend.links()) {
        (Across::Nothing, _) | (_, None) => return Ok(false),
        (_, Some(links)) if combined => links,
        _ => return Ok(false),
    };
    if bucket.elements() == 0 {
        return Ok(true);
    }
    let (buffers, _) = sum_up(links, levels, bucket)?;
    copy_owned_out(
        (backend, links),
        &levels.groups,
        bucket,
        &buffers,
        avg,
        owned,
    )?;
    Ok(true)
}

/// A reduce-scatter's end on the groups' summed buffers (`groups[g]`'s in `buffers[g]`):
/// each divided by `avg` (the unpack's arithmetic), then each replica's owned pieces
/// (`owned(segment, replica)`) copied out of its group's buffer, on the groups' streams.
///
/// # Safety
/// Every buffer holds the bucket, summed (or queued to be).
unsafe fn copy_owned_out(
    (backend, links): (&dyn Backend, &dyn Links),
    groups: &[Vec<usize>],
    bucket: &BucketView<'_>,
    buffers: &[u64],
    avg: Option<usize>,
    owned: &dyn Fn(usize, usize) -> (usize, usize),
) -> Result<()> {
    let (dtype, size) = (bucket.dtype, bucket.dtype.size());
    for (g, (members, &buffer)) in groups.iter().zip(buffers).enumerate() {
        if let Some(divisor) = avg {
            backend.divide(
                members[0],
                dtype,
                buffer as usize,
                bucket.elements(),
                divisor,
            )?;
        }
        let mut at = 0;
        for (s, segment) in bucket.segments.iter().enumerate() {
            for &r in members {
                let (first, count) = owned(s, r);
                if count > 0 {
                    let src = buffer + ((at + first) * size) as u64;
                    let dst = (segment.ptrs[r] + first * size) as u64;
                    links.copy_between(g, src, g, dst, count * size)?;
                }
            }
            at += segment.count;
        }
    }
    Ok(())
}

/// A gradient bucket started ahead of `dpsync_allreduce_grads` with NCCL across the ranks
/// (`dpsync_grad_ready`): every group's replicas packed into a buffer of the bucket's own and
/// the buffers summed over the world's groups, queued on the groups' streams; nothing is
/// written into the replicas until [`finish_started`]. The buffers, in group order.
///
/// # Safety
/// As for [`allreduce`], until the bucket is finished.
pub(super) unsafe fn start_in_groups(
    site: Site<'_>,
    bucket: &BucketView<'_>,
) -> Result<Vec<Allocation>> {
    let (links, collective) = world_links(site.backend);
    let bytes = bucket.dtype.size() * bucket.elements();
    let buffers = own_buffers(site, bytes)?;
    for (g, buffer) in buffers.iter().enumerate() {
        let layout = links.layout(g, bucket, Members::All)?;
        links.pack(g, bucket, layout, buffer.ptr() as u64)?;
    }
    let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr() as u64).collect();
    collective.allreduce(bucket.dtype, bucket.elements(), &ptrs)?;
    Ok(buffers)
}

/// Writes a bucket [`start_in_groups`] started: every group's buffer into its replicas
/// (divided by `avg`), after the collective on the groups' streams; with `owned` (a
/// reduce-scatter step), only each replica's owned pieces, as [`reduce_scatter_levels`]
/// writes them (the collective is its combine: the same sums).
///
/// # Safety
/// As for [`start_in_groups`], with the same bucket.
pub(super) unsafe fn finish_started(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    buffers: &[Allocation],
    avg: Option<usize>,
    owned: Option<&dyn Fn(usize, usize) -> (usize, usize)>,
) -> Result<()> {
    let (links, _) = world_links(site.backend);
    if let Some(owned) = owned {
        let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr() as u64).collect();
        let groups = &site.levels.groups;
        return copy_owned_out((site.backend, links), groups, bucket, &ptrs, avg, owned);
    }
    for (g, buffer) in buffers.iter().enumerate() {
        let layout = links.layout(g, bucket, Members::All)?;
        links.unpack(g, bucket, layout, buffer.ptr() as u64, avg)?;
    }
    Ok(())
}

/// A failed step's stand-in for a bucket other ranks started and this one did not: the same
/// collective over buffers of `count` elements of `dtype`, read by nobody.
pub(super) fn stand_in_groups(site: Site<'_>, dtype: DType, count: usize) -> Result<()> {
    let (_, collective) = world_links(site.backend);
    let buffers = own_buffers(site, dtype.size() * count)?;
    let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr() as u64).collect();
    collective.allreduce(dtype, count, &ptrs)
}

/// A buffer of `bytes` per group on its device (freed once the work queued on it has run).
fn own_buffers(site: Site<'_>, bytes: usize) -> Result<Vec<Allocation>> {
    (site.levels.groups.iter())
        .map(|members| site.backend.alloc(members[0], bytes))
        .collect()
}

/// The links and the world-wide collective of a backend joined to one (NCCL across the ranks).
fn world_links(backend: &dyn Backend) -> (&dyn Links, &dyn crate::backend::Collective) {
    let links = backend
        .links()
        .expect("a collective across the ranks needs device links");
    let collective = links
        .collective()
        .expect("joined to a collective across the ranks");
    (links, collective)
}

/// Every group's fusion buffer for `bucket` and its layout over all the group's replicas, made
/// before any transfer, so that nothing between the exchange and the unpacks allocates.
fn fusion_buffers(
    links: &dyn Links,
    levels: &Levels,
    bucket: &BucketView<'_>,
) -> Result<(Vec<u64>, Vec<Layout>)> {
    let bytes = bucket.dtype.size() * bucket.elements();
    let groups = 0..levels.groups.len();
    let buffers =
        (groups.clone().map(|g| links.buffer(g, Slot::Fusion, bytes))).collect::<Result<_>>()?;
    let layouts = (groups.map(|g| links.layout(g, bucket, Members::All))).collect::<Result<_>>()?;
    Ok((buffers, layouts))
}

/// Level 1 down: every group's buffer into its replicas (divided by `avg`).
///
/// # Safety
/// As for [`Links::unpack`], for every group.
unsafe fn unpack_all(
    links: &dyn Links,
    bucket: &BucketView<'_>,
    layouts: &[Layout],
    buffers: &[u64],
    avg: Option<usize>,
) -> Result<()> {
    for (g, (&layout, &buffer)) in layouts.iter().zip(buffers).enumerate() {
        links.unpack(g, bucket, layout, buffer, avg)?;
    }
    Ok(())
}

/// The walk with level 3, host memory (one group): local sum, the ranks' sum of the leader's
/// bucket with the AVG division, the leader's result spread to the other local replicas. Half
/// types skip the local sum: the engine sums every local replica with the ranks' in f32 and
/// rounds once.
///
/// # Safety
/// As for [`allreduce`].
unsafe fn allreduce_ranks(
    backend: &dyn Backend,
    levels: &Levels,
    (ranks, channel): (&dyn Ranks, Channel),
    bucket: &BucketView<'_>,
    avg: Option<usize>,
    trace: Option<&Tracer>,
) -> Result<()> {
    if bucket.elements() == 0 {
        return Ok(());
    }
    let members = &levels.groups[0];
    let leader = members[0];
    let contributors: &[usize] = if bucket.dtype.is_half() {
        members
    } else {
        if members.len() > 1 {
            let _span = timeline::span(trace, "local sum", || json!({"replicas": members.len()}));
            backend.reduce(0, members, bucket, None)?;
        }
        std::slice::from_ref(&leader)
    };
    {
        let _span = timeline::span(trace, "across ranks", || json!({"ranks": ranks.ranks()}));
        contributions(bucket, contributors, |segments| {
            ranks.allreduce(channel, bucket.dtype, segments, avg)
        })?;
    }
    if members.len() > 1 {
        let _span = timeline::span(trace, "spread", || json!({"replicas": members.len()}));
        backend.spread(0, bucket, leader)?;
    }
    Ok(())
}

/// Level 2 of an allreduce: every group's buffer ends with the sum of all of them.
fn combine(
    links: &dyn Links,
    levels: &Levels,
    bucket: &BucketView<'_>,
    buffers: &[u64],
) -> Result<()> {
    let (dtype, count) = (bucket.dtype, bucket.elements());
    match &levels.across {
        Across::Nothing => Ok(()),
        Across::Collective => match links.collective() {
            Some(c) => c.allreduce(dtype, count, buffers),
            None => unreachable!("a collective level on a backend without one"),
        },
        Across::Steps(steps) => {
            // SAFETY: every buffer holds the bucket.
            unsafe { run_steps(links, &levels.group_of(), steps, bucket, buffers) }
        }
    }
}

/// The plan's cross-group sums and copies on the groups' fusion buffers.
///
/// # Safety
/// Every buffer holds the bucket.
unsafe fn run_steps(
    links: &dyn Links,
    group_of: &[usize],
    steps: &[Step],
    bucket: &BucketView<'_>,
    buffers: &[u64],
) -> Result<()> {
    let (dtype, count) = (bucket.dtype, bucket.elements());
    let bytes = dtype.size() * count;
    // (source, reader) pairs: the source's buffer must not be rewritten (the next bucket's pack)
    // before the reader's stream has read it.
    let mut reads: Vec<(usize, usize)> = Vec::new();
    for step in steps {
        let (gs, gd) = (group_of[step.src], group_of[step.dst]);
        links.order(gs, gd)?;
        if !reads.contains(&(gs, gd)) {
            reads.push((gs, gd));
        }
        match (step.op, step.via) {
            (StepOp::Sum, Via::Peer) => links.add(gd, dtype, buffers[gd], buffers[gs], count)?,
            (StepOp::Sum, _) => {
                let staging = links.buffer(gd, Slot::Staging, bytes)?;
                links.copy_between(gs, buffers[gs], gd, staging, bytes)?;
                links.add(gd, dtype, buffers[gd], staging, count)?;
            }
            (StepOp::Copy, _) => links.copy_between(gs, buffers[gs], gd, buffers[gd], bytes)?,
            (StepOp::NcclAllreduce, _) => unreachable!("NCCL steps only in collective levels"),
        }
    }
    for (gs, gd) in reads {
        links.order(gd, gs)?;
    }
    Ok(())
}

/// Every replica of `site` gets local replica `root`'s bytes of `bucket` on rank `root_rank`
/// (0 outside a world).
///
/// # Safety
/// As for [`allreduce`].
pub(super) unsafe fn broadcast(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    root_rank: usize,
    root: usize,
) -> Result<()> {
    let Site {
        backend,
        levels,
        ranks,
        trace,
        ..
    } = site;
    if let (Some(ranks), false) = (ranks, levels.route == Route::Local) {
        let _span = timeline::span(trace, "across ranks (broadcast)", || json!({}));
        if bucket.elements() == 0 {
            return Ok(());
        }
        return match (&levels.route, backend.links(), backend.streams()) {
            (Route::RanksOverClique(world), Some(links), _) => {
                // One collective over the world's device groups, rooted at the root's group.
                let mine = (ranks.rank() == root_rank).then(|| levels.group_of()[root]);
                let nccl_root = world.nccl_rank(root_rank, root);
                broadcast_groups(links, levels, bucket, mine.map(|g| (g, root)), nccl_root)
            }
            (Route::RanksStaged, _, Some(streams)) => {
                // Device replicas: the root's bytes through the host stage to every local
                // replica.
                let host = match ranks.rank() == root_rank {
                    true => stage_out(streams, bucket, root)?,
                    false => streams.host_stage(bucket.dtype.size() * bucket.elements())?,
                };
                ranks.broadcast(
                    &[(host, bucket.dtype.size() * bucket.elements())],
                    root_rank,
                )?;
                stage_in(streams, levels, bucket, host)
            }
            (Route::RanksFromHost, ..) => {
                // Level 3 (host memory, one group): the root's rank sends its root replica's
                // bytes to every rank's local replica 0, then each rank spreads them locally.
                let members = &levels.groups[0];
                let leader = if ranks.rank() == root_rank {
                    root
                } else {
                    members[0]
                };
                let size = bucket.dtype.size();
                let spans: Vec<(usize, usize)> = (bucket.segments.iter())
                    .map(|s| (s.ptrs[leader], s.count * size))
                    .collect();
                ranks.broadcast(&spans, root_rank)?;
                if members.len() > 1 {
                    backend.spread(0, bucket, leader)?;
                }
                Ok(())
            }
            (route, ..) => unreachable!("route {route:?} without its engine"),
        };
    }
    let replicas: usize = levels.groups.iter().map(Vec::len).sum();
    if bucket.elements() == 0 || replicas <= 1 {
        return Ok(());
    }
    let group_of = levels.group_of();
    let links = match backend.links() {
        Some(links) if levels.groups.len() > 1 => links,
        // One group: in place.
        _ => return backend.spread(group_of[root], bucket, root),
    };
    let root_group = group_of[root];
    broadcast_groups(links, levels, bucket, Some((root_group, root)), root_group)
}

/// Level 2 of a broadcast: local replica `root` of group `root_group` (where this process has
/// the root) packed into its group's buffer, the buffers made equal (the collective's rank
/// `collective_root` is the root's group: in a world, a rank of the whole clique), every
/// group's buffer unpacked into its replicas.
///
/// # Safety
/// As for [`allreduce`].
unsafe fn broadcast_groups(
    links: &dyn Links,
    levels: &Levels,
    bucket: &BucketView<'_>,
    root: Option<(usize, usize)>,
    collective_root: usize,
) -> Result<()> {
    let bytes = bucket.dtype.size() * bucket.elements();
    let (buffers, layouts) = fusion_buffers(links, levels, bucket)?;
    if let Some((root_group, root)) = root {
        let root_layout = links.layout(root_group, bucket, Members::One(root))?;
        links.pack(root_group, bucket, root_layout, buffers[root_group])?;
    }
    match (&levels.across, links.collective(), root) {
        (Across::Collective, Some(c), _) => {
            c.broadcast(bucket.dtype, bucket.elements(), collective_root, &buffers)?
        }
        (_, _, None) => unreachable!("a broadcast from another rank without a collective"),
        (_, _, Some((root_group, _))) => {
            let others = || (0..buffers.len()).filter(|&g| g != root_group);
            for g in others() {
                links.order(root_group, g)?;
                links.copy_between(root_group, buffers[root_group], g, buffers[g], bytes)?;
            }
            // The root's buffer must not be repacked before every copy has read it.
            for g in others() {
                links.order(g, root_group)?;
            }
        }
    }
    unpack_all(links, bucket, &layouts, &buffers, None)
}
