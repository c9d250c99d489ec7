//! Reproducible sums over an NCCL clique (several GPUs in one process, or NCCL across the
//! ranks of a world), on the GPUs, by one of two routes, whichever moves fewer bytes
//! (`fields_pay`, from the levels: alike on every process).
//!
//! **To the owners** (the design of the host memory's all-to-all across ranks,
//! backend/mpi/alltoall.rs, on the device). The bucket's elements, segment after segment, are
//! cut into one even block per clique rank (`width` elements, the last one shorter): clique
//! rank q owns block q. Each GPU packs each of its replicas' buckets into its fusion buffer;
//! one NCCL group of `ncclSend`/`ncclRecv` moves every replica's block q raw to clique rank q
//! (a GPU's own blocks stay where they are); each owner sums its K contributions (every
//! replica of the world) with the one-device kernel (kernels/dense.cu `repro`: exponent max,
//! exact integer sum, one conversion, AVG divided), which writes the sum over its first
//! replica's block; `ncclAllGather` over the first replicas' packed buckets gives every GPU
//! every owner's sums, and one unpack writes them to its replicas. Bytes per GPU with R
//! replicas in a clique of N: R (N-1) blocks sent, then N-1 blocks gathered: (R+1)/2 times the
//! plain ring allreduce's 2 (N-1)/N of the bucket.
//!
//! **Fields, then integers** (`by_fields`), where GPUs hold many replicas: each GPU writes the
//! largest exponent field per element over its replicas, `ncclMax` makes it the clique's, each
//! GPU cuts its replicas onto that grid and sums them as integers, `ncclSum` of those i64
//! sums, and each GPU converts the sum back into its replicas (kernels/dense.cu
//! `repro_stage`). Two ring allreduces of (field + 8) bytes per element whatever R: 2.25 times
//! the plain bytes for F32 (a byte per field), 1.25 for F64 (two).
//!
//! Both are the host's arithmetic (backend/host/repro.rs) on the same contributions with the
//! integers summed exactly in another grouping: the host path's bytes. F32 and F64 only (the
//! kernels' dtypes; F16 and BF16 keep the host stage, exec/repro.rs).

use serde_json::json;

use super::clique::owners;
use super::Site;
use crate::backend::{BucketView, Collective, Layout, Links, Members, PeerOp, ReproStage, Slot};
use crate::error::Result;
use crate::timeline;
use crate::types::DType;

/// Every local replica of `bucket` := the reproducible sum over every replica of the clique
/// (divided by `avg`). `false` (nothing done) where the levels cross no NCCL clique or the
/// dtype has no kernel.
///
/// # Safety
/// Every pointer of the bucket is valid for its segment on its replica.
pub(super) unsafe fn allreduce(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
) -> Result<bool> {
    if !matches!(bucket.dtype, DType::F32 | DType::F64) {
        return Ok(false);
    }
    let Some(links) = site.backend.links() else {
        return Ok(false);
    };
    let Some(collective) = links.collective() else {
        return Ok(false);
    };
    let Some((blocks, first)) = owners(site.levels, site.ranks.map_or(0, |r| r.rank())) else {
        return Ok(false);
    };
    let groups = &site.levels.groups;
    let (n, total, size) = (blocks.len(), bucket.elements(), bucket.dtype.size());
    let k: usize = blocks.iter().map(Vec::len).sum();
    if fields_pay(bucket.dtype, k, n) {
        by_fields(site, bucket, avg, (links, collective), (n, k))?;
        return Ok(true);
    }
    let width = total.div_ceil(n);
    // Owner q's elements: [q width, q width + count(q)).
    let count = |q: usize| total.saturating_sub(q * width).min(width);
    let _span = timeline::span(
        site.trace,
        "reproducible sum over NCCL",
        || json!({"clique": n, "contributions": k, "bytes": total * size}),
    );
    // Group g's buffer: its replicas' packed buckets (n blocks each), then a slot per
    // contribution from another clique rank, in (source rank, replica) order.
    let packed = n * width * size;
    let mut buffers = Vec::with_capacity(groups.len());
    let mut packs: Vec<(usize, u64, Layout)> = Vec::new();
    let mut sums: Vec<(usize, Layout, usize)> = Vec::new();
    let mut unpacks: Vec<(usize, u64, Layout)> = Vec::new();
    for (g, members) in groups.iter().enumerate() {
        let (q, r) = (first + g, members.len());
        let buffer = links.buffer(g, Slot::Fusion, (r * packed) + (k - r) * width * size)?;
        for (j, &replica) in members.iter().enumerate() {
            let layout = links.layout(g, bucket, Members::One(replica))?;
            packs.push((g, buffer + (j * packed) as u64, layout));
        }
        // The sum is written over every slot, the first replica's block among them: that is
        // the allgather's own block.
        let own = (0..r).map(|j| buffer + (j * packed + q * width * size) as u64);
        let received = (0..k - r).map(|s| buffer + (r * packed + s * width * size) as u64);
        let slots: Vec<u64> = own.chain(received).collect();
        sums.push((g, links.slots_layout(g, count(q), &slots)?, count(q)));
        unpacks.push((g, buffer, links.layout(g, bucket, Members::All)?));
        buffers.push(buffer);
    }
    let ops = moves(&blocks, first, groups.len(), &buffers, (width, size), count);
    for (g, at, layout) in &packs {
        links.pack(*g, bucket, *layout, *at)?;
    }
    collective.exchange(&ops)?;
    for (g, layout, count) in &sums {
        if *count > 0 {
            links.reproducible(*g, bucket.dtype, *layout, *count, avg)?;
        }
    }
    collective.allgather(width * size, &buffers)?;
    for (g, at, layout) in &unpacks {
        links.unpack(*g, bucket, *layout, *at, None)?;
    }
    Ok(true)
}

/// Bytes of one exponent field as [`Collective::max_fields`] takes it.
fn field_bytes(dtype: DType) -> usize {
    if dtype == DType::F64 {
        2
    } else {
        1
    }
}

/// Whether the fields-then-integers route moves fewer bytes than the all-to-all for `k`
/// replicas over a clique of `n`: over the clique the all-to-all sends `(k + n) (n-1)/n`
/// buckets (every replica's foreign blocks, then the allgather), the other route two ring
/// allreduces (`2 (n-1)/n` each per GPU) of the fields and the i64 sums. So `k + n` against
/// `2 n (field + 8) / size`: above 3.5 replicas per GPU on average for F32, 1.5 for F64. The
/// levels give every process the same `k` and `n`, so every process takes the same route.
fn fields_pay(dtype: DType, k: usize, n: usize) -> bool {
    (k + n) * dtype.size() > 2 * n * (field_bytes(dtype) + 8)
}

/// Every local replica := the reproducible sum over the clique, the contributions staying on
/// their GPUs: each GPU's largest exponent field per element over its replicas, `ncclMax`
/// of those across the clique, each GPU's replicas cut onto that grid and summed as integers,
/// `ncclSum` of the i64 sums, each GPU's conversion back written to its replicas. The host's
/// arithmetic in another grouping of an exact integer sum: the host's bytes.
///
/// # Safety
/// As for [`allreduce`].
unsafe fn by_fields(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
    (links, collective): (&dyn Links, &dyn Collective),
    (n, k): (usize, usize),
) -> Result<()> {
    let (dtype, total) = (bucket.dtype, bucket.elements());
    let _span = timeline::span(
        site.trace,
        "reproducible sum over NCCL (fields, then integers)",
        || json!({"clique": n, "contributions": k, "bytes": total * dtype.size()}),
    );
    if total == 0 {
        return Ok(());
    }
    // Group g's buffer: a u64 sum per element, then a field per element.
    let mut sums = Vec::new();
    let mut fields = Vec::new();
    let mut layouts = Vec::new();
    for g in 0..site.levels.groups.len() {
        let buffer = links.buffer(g, Slot::Fusion, total * (8 + field_bytes(dtype)))?;
        sums.push(buffer);
        fields.push(buffer + (total * 8) as u64);
        layouts.push(links.layout(g, bucket, Members::All)?);
    }
    let stage = |stage: ReproStage, avg: Option<usize>| -> Result<()> {
        for (g, layout) in layouts.iter().enumerate() {
            // SAFETY: the layout is of the bucket's replicas on g; both buffers hold `total`.
            unsafe { links.repro_stage(g, bucket, *layout, (sums[g], fields[g]), stage, avg)? };
        }
        Ok(())
    };
    stage(ReproStage::Fields, None)?;
    collective.max_fields(dtype, total, &fields)?;
    stage(ReproStage::Cut, None)?;
    collective.allreduce(DType::I64, total, &sums)?;
    stage(ReproStage::Uncut, avg)
}

/// The sends and receives of the all-to-all, in one order on every process: owner after owner,
/// source clique rank after source rank, replica after replica (NCCL pairs them in order).
/// `blocks[q]` lists clique rank q's replicas; this process's groups are ranks `first..`.
fn moves(
    blocks: &[Vec<usize>],
    first: usize,
    local: usize,
    buffers: &[u64],
    (width, size): (usize, usize),
    count: impl Fn(usize) -> usize,
) -> Vec<PeerOp> {
    let mine = |q: usize| (first..first + local).contains(&q).then(|| q - first);
    let packed = blocks.len() * width * size;
    let mut ops = Vec::new();
    for q in (0..blocks.len()).filter(|&q| count(q) > 0) {
        let bytes = count(q) * size;
        // The owner's receive slots follow its own replicas' packed buckets.
        let mut slot = 0;
        for h in (0..blocks.len()).filter(|&h| h != q) {
            for j in 0..blocks[h].len() {
                if let Some(g) = mine(h) {
                    let at = buffers[g] + (j * packed + q * width * size) as u64;
                    ops.push(PeerOp {
                        group: g,
                        peer: q,
                        send: true,
                        at,
                        bytes,
                    });
                }
                if let Some(g) = mine(q) {
                    let base = blocks[q].len() * packed;
                    let at = buffers[g] + (base + slot * width * size) as u64;
                    ops.push(PeerOp {
                        group: g,
                        peer: h,
                        send: false,
                        at,
                        bytes,
                    });
                }
                slot += 1;
            }
        }
    }
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_send_meets_one_receive_of_its_size_in_order() {
        // Three clique ranks over two processes: ranks 0 and 1 here (first 0, two groups),
        // rank 2 elsewhere; replicas 2, 1, 1; 10 elements of 4 bytes: widths 4, 4, 2.
        let blocks = vec![vec![0, 1], vec![2], vec![3]];
        let count = |q: usize| 10usize.saturating_sub(q * 4).min(4);
        let here = moves(&blocks, 0, 2, &[1000, 5000], (4, 4), count);
        let there = moves(&blocks, 2, 1, &[9000], (4, 4), count);
        // Sends from a to b, and receives at b from a, in issue order, with their bytes.
        let pairs = |ops: &[PeerOp], first: usize, send: bool| -> Vec<(usize, usize, usize)> {
            (ops.iter().filter(|o| o.send == send))
                .map(|o| {
                    let me = first + o.group;
                    let (a, b) = if send { (me, o.peer) } else { (o.peer, me) };
                    (a, b, o.bytes)
                })
                .collect()
        };
        let mut sends = pairs(&here, 0, true);
        sends.extend(pairs(&there, 2, true));
        let mut recvs = pairs(&here, 0, false);
        recvs.extend(pairs(&there, 2, false));
        sends.sort_by_key(|&(a, b, _)| (a, b));
        recvs.sort_by_key(|&(a, b, _)| (a, b));
        assert_eq!(sends, recvs);
        // Each of the 4 replicas' blocks to the 2 owners other than its GPU.
        assert_eq!(sends.len(), 8);
        // Rank 0 receives rank 1's and rank 2's replicas' blocks into its slots after its two
        // packed buckets (3 blocks of 16 bytes each).
        let at: Vec<u64> = (here.iter())
            .filter(|o| !o.send && o.group == 0)
            .map(|o| o.at)
            .collect();
        assert_eq!(at, vec![1000 + 96, 1000 + 96 + 16]);
    }
}
