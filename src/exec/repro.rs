//! Reproducible sums over every route (`dpsync_options_set_reproducible`): the same bytes
//! whatever the arrangement of the replicas, so each float bucket leaves the plan's levels and
//! goes through the host's kernels (backend/host/repro.rs) in three pieces:
//!
//! 1. the largest exponent field of every element over this process's replicas, then over the
//!    ranks (an MPI_MAX allreduce of one byte per element, two for f64: "exponent max across
//!    ranks");
//! 2. every contribution cut onto the integer grid that field sets and summed exactly, then
//!    summed over the ranks as i64 on the route's engine ("integer sum across ranks");
//! 3. the sum turned back into the dtype once (AVG divided) and written to every replica.
//!
//! Host memory in one process runs all three block by block ([`Backend::reduce_reproducible`]),
//! and so do F32 and F64 replicas of one device in one process, in a kernel. A world (host
//! replicas, or device replicas through the host stage) hands the bucket to the engine's own
//! reproducible sum (`direct`: the ranks' raw values, any float). F32 and F64
//! over an NCCL clique (several GPUs in one process, NCCL across the ranks) stay on the GPUs:
//! each block raw to its owner GPU, summed there by the same kernel, gathered back, or, where
//! GPUs hold many replicas, each GPU's exponent fields and integer sums across the clique
//! (exec/repro_clique.rs). Other device memory (F16/BF16, peer copies, CUDA replicas staged
//! across ranks) goes through the host stage, every replica's bucket to the host and the
//! result back (docs/ARCHITECTURE.md, "Reproducible sums", says why).
//! Integer buckets never come here: their sums are exact already.

use serde_json::json;

use super::staged::{copy_out, stage_in};
use super::Site;
use crate::backend::host::{host_threads, repro};
use crate::backend::{BucketView, Channel, Ranks, Segment};
use crate::error::Result;
use crate::timeline;
use crate::types::DType;

/// The exponents and integers of the last bucket's [`pieces`], reused by the next.
#[derive(Default)]
pub(super) struct Scratch {
    exps: Vec<u16>,
    sums: Vec<i64>,
    /// The exponents as they cross the ranks, one byte each (every dtype but f64).
    narrow: Vec<u8>,
    /// The host's threads for the kernels (`DPSYNC_HOST_THREADS` or the hardware's), read at
    /// the context's first reproducible bucket; 0 before.
    threads: usize,
}

/// Every replica of `site` ends with the reproducible sum of `bucket` over all replicas
/// (divided by `avg`).
///
/// # Safety
/// Every pointer of the bucket is valid for its segment on its replica.
pub(super) unsafe fn allreduce(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
) -> Result<()> {
    // One replica in the world: its values are already their own sum.
    if bucket.elements() == 0 || site.levels.ranks.iter().sum::<usize>() <= 1 {
        return Ok(());
    }
    let replicas: Vec<usize> = site.levels.groups.iter().flatten().copied().collect();
    let Some(streams) = site.backend.streams() else {
        return match site.ranks {
            None => site.backend.reduce_reproducible(&replicas, bucket, avg),
            Some(_) => pieces(site, bucket, &replicas, &replicas, avg),
        };
    };
    // Replicas of one device in one process, F32 or F64: the device's own kernel.
    let one_device = site.levels.in_place() && site.levels.groups.len() == 1;
    if one_device && matches!(bucket.dtype, DType::F32 | DType::F64) {
        return site.backend.reduce_reproducible(&replicas, bucket, avg);
    }
    // Several GPUs over an NCCL clique, F32 or F64: to each element's owner and back.
    if super::repro_clique::allreduce(site, bucket, avg)? {
        return Ok(());
    }
    let bytes = bucket.dtype.size() * bucket.elements();
    let host = {
        let _span = timeline::span(site.trace, "to host", || json!({}));
        let host = streams.host_stage(bytes * replicas.len())?;
        for (k, &replica) in replicas.iter().enumerate() {
            copy_out(streams, bucket, replica, host + k * bytes)?;
        }
        streams.wait_all()?;
        host
    };
    let staged: Vec<usize> = (0..replicas.len()).map(|k| host + k * bytes).collect();
    let view = BucketView {
        dtype: bucket.dtype,
        segments: vec![Segment {
            ptrs: &staged,
            count: bucket.elements(),
        }],
    };
    let members: Vec<usize> = (0..staged.len()).collect();
    // The result lands in the first stage slot, which `stage_in` copies to every replica.
    pieces(site, &view, &members, &[0], avg)?;
    let _span = timeline::span(site.trace, "from host", || json!({}));
    stage_in(streams, site.levels, bucket, host)
}

/// The three pieces over host memory: `members`' contributions, the ranks' above them, the
/// result written to `write_to`.
///
/// # Safety
/// `view`'s pointers of `members` are valid host memory, those of `write_to` writable.
unsafe fn pieces(
    site: Site<'_>,
    view: &BucketView<'_>,
    members: &[usize],
    write_to: &[usize],
    avg: Option<usize>,
) -> Result<()> {
    let n = view.elements();
    // Every rank's contributions its replicas (the levels' counts), so the engine's choice of
    // route is alike on every rank; it writes every member (`write_to` among them).
    let as_counted = site
        .ranks
        .is_some_and(|r| site.levels.ranks.get(r.rank()) == Some(&members.len()));
    if let (Some(ranks), true) = (site.ranks, as_counted) {
        if direct(site, ranks, view, members, avg)? {
            return Ok(());
        }
    }
    let mut scratch = site.repro.lock();
    if scratch.threads == 0 {
        scratch.threads = host_threads();
    }
    let Scratch {
        exps,
        sums,
        narrow,
        threads,
    } = &mut *scratch;
    let threads = *threads;
    // Kept from bucket to bucket: fresh memory of this size would cost more in page faults
    // than the sums themselves.
    exps.clear();
    exps.resize(n, 1);
    sums.resize(n, 0);
    let sums = &mut sums[..n];
    repro::exponents(view, members, exps, threads);
    if let Some(ranks) = site.ranks {
        let _span = timeline::span(
            site.trace,
            "exponent max across ranks",
            || json!({"ranks": ranks.ranks(), "bytes": n * repro::field_bytes(view.dtype)}),
        );
        max_across(ranks, site.channel, view.dtype, (exps, narrow))?;
    }
    repro::cut_sum(view, members, exps, sums, threads);
    if let Some(ranks) = site.ranks {
        let _span = timeline::span(
            site.trace,
            "integer sum across ranks",
            || json!({"ranks": ranks.ranks(), "bytes": n * 8}),
        );
        let ptrs = [sums.as_mut_ptr() as usize];
        let segment = Segment {
            ptrs: &ptrs,
            count: n,
        };
        ranks.allreduce(site.channel, DType::I64, &[segment], None)?;
    }
    repro::write_sums(view, write_to, (sums, exps), avg, threads);
    Ok(())
}

/// A world (host replicas, or device replicas staged to the host, any number on each rank):
/// the engine's reproducible sum from the ranks' raw values
/// ([`Ranks::allreduce_reproducible`]: through shared memory, or to each element's owner and
/// back), where it has one for the bucket (the same answer on every rank); the result in
/// every member's memory.
///
/// # Safety
/// As for [`pieces`].
unsafe fn direct(
    site: Site<'_>,
    ranks: &dyn Ranks,
    view: &BucketView<'_>,
    members: &[usize],
    avg: Option<usize>,
) -> Result<bool> {
    let ptrs: Vec<Vec<usize>> = (view.segments.iter())
        .map(|s| members.iter().map(|&m| s.ptrs[m]).collect())
        .collect();
    let segments: Vec<Segment<'_>> = (view.segments.iter().zip(&ptrs))
        .map(|(s, p)| Segment {
            ptrs: p,
            count: s.count,
        })
        .collect();
    let _span = timeline::span(
        site.trace,
        "reproducible sum across ranks",
        || json!({"ranks": ranks.ranks(), "bytes": view.elements() * view.dtype.size()}),
    );
    let data = (view.dtype, &segments[..], &site.levels.ranks[..]);
    ranks.allreduce_reproducible(site.channel, data, avg)
}

/// `exps[i] := max over the ranks of their exps[i]` (one byte each where the dtype's field
/// fits one).
fn max_across(
    ranks: &dyn Ranks,
    channel: Channel,
    dtype: DType,
    (exps, narrow): (&mut [u16], &mut Vec<u8>),
) -> Result<()> {
    if repro::field_bytes(dtype) == 2 {
        // SAFETY: u16s viewed as their bytes, in native order.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(exps.as_mut_ptr().cast::<u8>(), exps.len() * 2)
        };
        return ranks.allreduce_max(channel, bytes, true);
    }
    narrow.clear();
    narrow.extend(exps.iter().map(|&e| e as u8));
    ranks.allreduce_max(channel, narrow, false)?;
    for (e, &b) in exps.iter_mut().zip(narrow.iter()) {
        *e = u16::from(b);
    }
    Ok(())
}
