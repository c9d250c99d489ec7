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
use crate::backend::{
    Allocation, BucketView, Collective, Layout, Links, Members, PeerOp, ReproStage, Slot,
};
use crate::error::{Error, ErrorKind, Result};
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
    let Some(owners) = Owners::of(site, bucket.dtype, bucket.elements()) else {
        return Ok(false);
    };
    if fields_pay(bucket.dtype, owners.k, owners.n) {
        let (n, k) = (owners.n, owners.k);
        by_fields(site, bucket, avg, (owners.links, owners.collective), (n, k))?;
        return Ok(true);
    }
    let _span = owners.span(site);
    let links = owners.links;
    let groups = 0..site.levels.groups.len();
    let bytes = |g: usize| owners.bytes(site.levels.groups[g].len());
    let buffers: Vec<u64> = (groups.clone())
        .map(|g| links.buffer(g, Slot::Fusion, bytes(g)))
        .collect::<Result<_>>()?;
    let unpacks: Vec<Layout> =
        (groups.map(|g| links.layout(g, bucket, Members::All))).collect::<Result<_>>()?;
    owners.queue(site, Some(bucket), avg, &buffers)?;
    for (g, layout) in unpacks.iter().enumerate() {
        links.unpack(g, bucket, *layout, buffers[g], None)?;
    }
    Ok(true)
}

/// Whether a reproducible sum of `dtype` can start before its step over these levels
/// ([`start`]): F32 or F64 across an NCCL clique of the ranks, by the route to the owners
/// (the fields route writes its result with its last kernel, from the replicas). Alike on
/// every process (the levels').
pub(super) fn starts(site: Site<'_>, dtype: DType) -> bool {
    let ranks = matches!(site.levels.route, crate::plan::Route::RanksOverClique(_));
    (Owners::of(site, dtype, 0)).is_some_and(|o| ranks && !fields_pay(dtype, o.k, o.n))
}

/// A bucket's reproducible sum over the clique queued ahead of its step ([`starts`]), on
/// buffers of its own, one per group: after the groups' streams' work, the sums are at each
/// buffer's start as one group's packed bucket (divided by `avg`); nothing of the replicas is
/// written (the caller unpacks them once the step agreed). With no bucket (`count` elements
/// of `dtype`): a failed step's stand-in for a bucket other ranks started, the same NCCL
/// calls over buffers nobody reads.
///
/// # Safety
/// As for [`allreduce`], until the queued work has run.
pub(super) unsafe fn start(
    site: Site<'_>,
    bucket: Option<&BucketView<'_>>,
    (dtype, count): (DType, usize),
    avg: Option<usize>,
) -> Result<Vec<Allocation>> {
    let Some(owners) = Owners::of(site, dtype, count) else {
        // `starts` said no: exec never starts such a bucket (an error, not a panic).
        let message = format!("a reproducible sum of {count} x {dtype:?} cannot start over NCCL");
        return Err(Error::new(ErrorKind::Panic, message));
    };
    let _span = owners.span(site);
    let groups = &site.levels.groups;
    let buffers: Vec<Allocation> = (groups.iter())
        .map(|members| site.backend.alloc(members[0], owners.bytes(members.len())))
        .collect::<Result<_>>()?;
    let ptrs: Vec<u64> = buffers.iter().map(|b| b.ptr() as u64).collect();
    owners.queue(site, bucket, avg, &ptrs)?;
    Ok(buffers)
}

/// The route to the owners over the clique for `total` elements of one dtype: the bucket,
/// segment after segment, cut into one even block per clique rank (`width` elements, the last
/// ones shorter), clique rank q owning block q.
struct Owners<'a> {
    links: &'a dyn Links,
    collective: &'a dyn Collective,
    /// Per clique rank, its replicas; this process's groups are ranks `first..`.
    blocks: Vec<Vec<usize>>,
    first: usize,
    /// Clique ranks, and every replica of the clique.
    n: usize,
    k: usize,
    dtype: DType,
    total: usize,
    width: usize,
}

impl<'a> Owners<'a> {
    /// None where the levels cross no NCCL clique or the dtype has no kernel.
    fn of(site: Site<'a>, dtype: DType, total: usize) -> Option<Owners<'a>> {
        if !matches!(dtype, DType::F32 | DType::F64) {
            return None;
        }
        let links = site.backend.links()?;
        let collective = links.collective()?;
        let (blocks, first) = owners(site.levels, site.ranks.map_or(0, |r| r.rank()))?;
        let (n, k) = (blocks.len(), blocks.iter().map(Vec::len).sum());
        Some(Owners {
            links,
            collective,
            blocks,
            first,
            n,
            k,
            dtype,
            total,
            width: total.div_ceil(n),
        })
    }

    /// Owner q's elements: `[q width, q width + count(q))`.
    fn count(&self, q: usize) -> usize {
        self.total.saturating_sub(q * self.width).min(self.width)
    }

    /// A group's buffer for `r` replicas: their packed buckets (n blocks each), then a slot
    /// per contribution from another clique rank, in (source rank, replica) order.
    fn bytes(&self, r: usize) -> usize {
        let size = self.dtype.size();
        r * self.n * self.width * size + (self.k - r) * self.width * size
    }

    fn span(&self, site: Site<'_>) -> Option<timeline::Span> {
        let (n, k, bytes) = (self.n, self.k, self.total * self.dtype.size());
        timeline::span(
            site.trace,
            "reproducible sum over NCCL",
            || json!({"clique": n, "contributions": k, "bytes": bytes}),
        )
    }

    /// Each group's replicas packed into `buffers` (with a bucket), the all-to-all, each
    /// owner's sum over its slots (with a bucket: a stand-in's are read by nobody), then the
    /// owners' sums gathered into every buffer's first packed bucket.
    ///
    /// # Safety
    /// The buffers hold [`Owners::bytes`] each; the bucket's pointers are valid.
    unsafe fn queue(
        &self,
        site: Site<'_>,
        bucket: Option<&BucketView<'_>>,
        avg: Option<usize>,
        buffers: &[u64],
    ) -> Result<()> {
        let (links, size, width) = (self.links, self.dtype.size(), self.width);
        let packed = self.n * width * size;
        // Every layout made before any transfer: nothing between the exchange and the
        // gather allocates.
        let mut packs: Vec<(usize, u64, Layout)> = Vec::new();
        let mut sums: Vec<(usize, Layout, usize)> = Vec::new();
        for (g, members) in site.levels.groups.iter().enumerate() {
            let Some(bucket) = bucket else { break };
            let (q, r, buffer) = (self.first + g, members.len(), buffers[g]);
            for (j, &replica) in members.iter().enumerate() {
                let layout = links.layout(g, bucket, Members::One(replica))?;
                packs.push((g, buffer + (j * packed) as u64, layout));
            }
            // The sum is written over every slot, the first replica's block among them: that
            // is the allgather's own block.
            let own = (0..r).map(|j| buffer + (j * packed + q * width * size) as u64);
            let received = (0..self.k - r).map(|s| buffer + (r * packed + s * width * size) as u64);
            let slots: Vec<u64> = own.chain(received).collect();
            sums.push((
                g,
                links.slots_layout(g, self.count(q), &slots)?,
                self.count(q),
            ));
        }
        let local = site.levels.groups.len();
        let count = |q: usize| self.count(q);
        let ops = moves(
            &self.blocks,
            self.first,
            local,
            buffers,
            (width, size),
            count,
        );
        for (g, at, layout) in &packs {
            links.pack(*g, bucket.expect("packs come with a bucket"), *layout, *at)?;
        }
        self.collective.exchange(&ops)?;
        for (g, layout, count) in &sums {
            if *count > 0 {
                links.reproducible(*g, self.dtype, *layout, *count, avg)?;
            }
        }
        self.collective.allgather(width * size, buffers)
    }
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
