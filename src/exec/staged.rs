//! Device replicas in a world whose ranks are crossed through page-locked host memory and the
//! MPI engine (transport PEER_COPY, or a rank that cannot join NCCL): levels 1 and 2 as in one
//! process, then the bucket staged out to the ranks' sum (or reduce-scatter) and back.

use super::dense::allreduce_levels;
use super::Site;
use crate::backend::{BucketView, EveryRank, Ranks, Segment, Streams};
use crate::error::Result;
use crate::plan::{Levels, Route};
use crate::timeline;
use serde_json::json;

/// `f` over the bucket's segments as the engine takes them: each segment's pointers on
/// `replicas` (this rank's contributions; the first gets the result).
pub(super) fn contributions<R>(
    bucket: &BucketView<'_>,
    replicas: &[usize],
    f: impl FnOnce(&[Segment<'_>]) -> R,
) -> R {
    let ptrs: Vec<Vec<usize>> = (bucket.segments.iter())
        .map(|s| replicas.iter().map(|&r| s.ptrs[r]).collect())
        .collect();
    with_ptrs(bucket, &ptrs, f)
}

/// `f` of the bucket's segments with `ptrs[s]` as segment `s`'s contributions.
pub(super) fn with_ptrs<R>(
    bucket: &BucketView<'_>,
    ptrs: &[Vec<usize>],
    f: impl FnOnce(&[Segment<'_>]) -> R,
) -> R {
    let segments: Vec<Segment<'_>> = (bucket.segments.iter().zip(ptrs))
        .map(|(s, ptrs)| Segment {
            ptrs,
            count: s.count,
        })
        .collect();
    f(&segments)
}

/// The walk with level 3 on device replicas, through host memory: levels 1 and 2 as in one
/// process (every local replica ends with the process's sum), local replica 0's bucket copied
/// into the page-locked stage, the ranks' sum with the AVG division on the host, and the result
/// copied into every local replica. f16/bf16 skip levels 1 and 2: every local replica's bucket
/// goes to the stage and the engine sums them with the other ranks' in f32, rounding once.
///
/// # Safety
/// As for [`allreduce`].
pub(super) unsafe fn allreduce_staged(
    site: Site<'_>,
    streams: &dyn Streams,
    ranks: &dyn Ranks,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
) -> Result<()> {
    if bucket.elements() == 0 {
        return Ok(());
    }
    let trace = site.trace;
    let contributors: Vec<usize> = match bucket.dtype.is_half() {
        true => (0..site.levels.groups.iter().map(Vec::len).sum()).collect(),
        false => {
            let _span = timeline::span(trace, "local levels", || json!({}));
            allreduce_levels(site.backend, site.levels, bucket, None, false)?;
            vec![0]
        }
    };
    let bytes = bucket.dtype.size() * bucket.elements();
    let host = {
        let _span = timeline::span(trace, "to host", || json!({}));
        let host = streams.host_stage(bytes * contributors.len())?;
        for (k, &replica) in contributors.iter().enumerate() {
            copy_out(streams, bucket, replica, host + k * bytes)?;
        }
        streams.wait_all()?;
        host
    };
    let staged: Vec<usize> = (0..contributors.len()).map(|k| host + k * bytes).collect();
    let segment = Segment {
        ptrs: &staged,
        count: bucket.elements(),
    };
    {
        let _span = timeline::span(trace, "across ranks", || json!({"ranks": ranks.ranks()}));
        ranks.allreduce(site.channel, bucket.dtype, &[segment], avg)?;
    }
    let _span = timeline::span(trace, "from host", || json!({}));
    stage_in(streams, site.levels, bucket, host)
}

/// A reduce-scatter over the staged route: every local replica's bucket copied into the
/// page-locked stage (nothing summed on the devices, so no replica's other elements change),
/// the engine's reduce-scatter of those contributions on the host (each rank's elements summed
/// at that rank where the engine can: `every_rank`), then each local replica's own elements
/// copied back: `owned` holds every local replica's `(first, count)` of every segment, as
/// [`Ranks::reduce_scatter`] takes them. `false` (nothing written) where the engine cannot
/// (reproducible sums it cannot do in one exchange) or the route is another.
///
/// # Safety
/// As for [`allreduce`].
pub(super) unsafe fn reduce_scatter_staged(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    (owned, every_rank): (&[(usize, usize)], Option<EveryRank<'_>>),
    avg: Option<usize>,
    reproducible: bool,
) -> Result<bool> {
    let (Route::RanksStaged, Some(ranks), Some(streams)) =
        (&site.levels.route, site.ranks, site.backend.streams())
    else {
        return Ok(false);
    };
    if bucket.elements() == 0 {
        return Ok(true);
    }
    let replicas = bucket.segments.first().map_or(0, |s| s.ptrs.len());
    let bytes = bucket.dtype.size() * bucket.elements();
    let host = {
        let _span = timeline::span(site.trace, "to host", || json!({}));
        let host = streams.host_stage(bytes * replicas)?;
        for k in 0..replicas {
            copy_out(streams, bucket, k, host + k * bytes)?;
        }
        streams.wait_all()?;
        host
    };
    // Each segment's place in every contribution's stage.
    let staged: Vec<Vec<usize>> = (offsets(bucket).iter())
        .map(|&o| (0..replicas).map(|k| host + k * bytes + o).collect())
        .collect();
    let done = {
        let _span = timeline::span(
            site.trace,
            "across ranks",
            || json!({"ranks": ranks.ranks()}),
        );
        with_ptrs(bucket, &staged, |segments| {
            let data = (bucket.dtype, segments, owned);
            ranks.reduce_scatter(site.channel, data, avg, reproducible, every_rank)
        })?
    };
    if !done {
        return Ok(false);
    }
    let _span = timeline::span(site.trace, "from host", || json!({}));
    copy_owned_back(streams, bucket, owned, |s, k| staged[s][k])?;
    streams.wait_all()?;
    Ok(true)
}

/// The bucket of local replica `replica`, copied into the host stage segment after segment;
/// the stage's address once the copies are done.
///
/// # Safety
/// As for [`allreduce`].
pub(super) unsafe fn stage_out(
    streams: &dyn Streams,
    bucket: &BucketView<'_>,
    replica: usize,
) -> Result<usize> {
    let host = streams.host_stage(bucket.dtype.size() * bucket.elements())?;
    copy_out(streams, bucket, replica, host)?;
    streams.wait_all()?;
    Ok(host)
}

/// Queues the copies of local replica `replica`'s bucket into the host stage at `at`, segment
/// after segment.
///
/// # Safety
/// As for [`allreduce`]; the stage holds the bucket from `at`.
pub(super) unsafe fn copy_out(
    streams: &dyn Streams,
    bucket: &BucketView<'_>,
    replica: usize,
    at: usize,
) -> Result<()> {
    let size = bucket.dtype.size();
    let mut at = at;
    for s in &bucket.segments {
        streams.stage_copy(replica, at, s.ptrs[replica], s.count * size)?;
        at += s.count * size;
    }
    Ok(())
}

/// The host stage copied into every local replica's segments; done (the stage is free again)
/// when this returns.
///
/// # Safety
/// As for [`allreduce`]; the stage holds the bucket.
pub(super) unsafe fn stage_in(
    streams: &dyn Streams,
    levels: &Levels,
    bucket: &BucketView<'_>,
    host: usize,
) -> Result<()> {
    let size = bucket.dtype.size();
    for &replica in levels.groups.iter().flatten() {
        let mut at = 0;
        for s in &bucket.segments {
            streams.stage_copy(replica, s.ptrs[replica], host + at, s.count * size)?;
            at += s.count * size;
        }
    }
    streams.wait_all()
}

/// A staged early bucket's result (at `stage`, the bucket laid end to end) copied back into
/// every local replica: whole, or only each replica's `owned` pieces (`(first, count)` per
/// segment and replica, as [`reduce_scatter_staged`] takes them: a reduce-scatter step); done
/// when this returns.
///
/// # Safety
/// As for [`allreduce`]; the stage holds the bucket.
pub(super) unsafe fn stage_back(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    stage: usize,
    owned: Option<&[(usize, usize)]>,
) -> Result<()> {
    let streams = site.backend.streams().expect("the staged route is CUDA's");
    let Some(owned) = owned else {
        return stage_in(streams, site.levels, bucket, stage);
    };
    let offsets = offsets(bucket);
    copy_owned_back(streams, bucket, owned, |s, _| stage + offsets[s])?;
    streams.wait_all()
}

/// Each segment's place in a stage that holds the bucket laid end to end.
fn offsets(bucket: &BucketView<'_>) -> Vec<usize> {
    let size = bucket.dtype.size();
    (bucket.segments.iter())
        .scan(0, |at, s| Some(std::mem::replace(at, *at + s.count * size)))
        .collect()
}

/// Queues the copies of every local replica's `owned` pieces (`owned[s * replicas + k]`) of
/// each segment `s` from the stage, where `from(s, k)` holds that segment for replica `k`.
///
/// # Safety
/// As for [`allreduce`]; the stage holds every segment `from` names.
unsafe fn copy_owned_back(
    streams: &dyn Streams,
    bucket: &BucketView<'_>,
    owned: &[(usize, usize)],
    from: impl Fn(usize, usize) -> usize,
) -> Result<()> {
    let size = bucket.dtype.size();
    let replicas = bucket.segments.first().map_or(0, |s| s.ptrs.len());
    for (s, segment) in bucket.segments.iter().enumerate() {
        for k in 0..replicas {
            let (first, count) = owned[s * replicas + k];
            if count > 0 {
                let (dst, src) = (segment.ptrs[k] + first * size, from(s, k) + first * size);
                streams.stage_copy(k, dst, src, count * size)?;
            }
        }
    }
    Ok(())
}
