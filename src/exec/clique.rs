//! Shards over an NCCL clique (several GPUs in one process, or NCCL across the ranks): a bucket
//! laid out by owner, one block per clique rank holding the pieces of the world replicas on
//! that rank's GPU, padded to the largest block (NCCL's reduce-scatter and allgather take equal
//! counts per rank). `ncclReduceScatter` then leaves each GPU exactly the sums of its replicas'
//! pieces and `ncclAllGather` gives every GPU every owner's pieces: the two halves of a ring
//! allreduce, each sending half of what the allreduce sends (the allreduce's combine with the
//! pieces copied out sent the whole bucket; one broadcast per world replica launched W
//! collectives).
//!
//! Where each applies (docs/ARCHITECTURE.md, "Shards"):
//! - the reduce-scatter, where another summation order than the allreduce's keeps the contract:
//!   NCCL across the ranks (the same bytes only up to the order of the sums, as across ranks
//!   elsewhere); in one process, two GPUs (each element is one addition of the two GPUs'
//!   partial sums, which commutes: the allreduce's bytes whatever order NCCL takes) or integer
//!   dtypes (wrapping sums, exact in any order). Three GPUs or more in one process must give
//!   the allreduce's bytes, and NCCL promises no common order between `ncclReduceScatter` and
//!   `ncclAllReduce`: those floats keep the allreduce's combine (exec/dense.rs).
//! - the allgather, on every clique: it moves bytes, with no arithmetic.
//!
//! Both only where the padding costs at most the bucket again (clique ranks × the largest
//! block ≤ 2 × the bucket: the blocks are even unless one GPU holds far more replicas than the
//! others); otherwise the routes of exec/shard.rs.

use super::shard::Place;
use super::Site;
use crate::backend::{BucketView, Collective, Layout, Links, Members, Segment, Slot};
use crate::error::Result;
use crate::plan::{Across, Levels, Route};
use crate::types::{piece, DType};

/// One piece in a block: world replica `owner`'s elements `[first, first + count)` of segment
/// `segment`.
#[derive(Clone, Copy)]
struct Entry {
    owner: usize,
    segment: usize,
    first: usize,
    count: usize,
}

/// A bucket laid out by owner over the clique.
struct Packed {
    /// Per clique rank, its pieces (empty ones left out): owner after owner (ascending), each
    /// owner's segment after segment.
    blocks: Vec<Vec<Entry>>,
    /// Elements per block: the largest block's.
    width: usize,
    /// Each entry's pointers on every local replica (`ptrs[block][entry]`).
    ptrs: Vec<Vec<Vec<usize>>>,
    /// The clique rank of this process's group 0.
    first: usize,
}

/// The world replicas on each clique rank's GPU (ascending) and the clique rank of this
/// process's group 0, where the levels cross the groups with one NCCL collective.
pub(super) fn owners(levels: &Levels, rank: usize) -> Option<(Vec<Vec<usize>>, usize)> {
    match &levels.route {
        Route::Local if levels.across == Across::Collective => {
            let mut blocks = levels.groups.clone();
            blocks.iter_mut().for_each(|b| b.sort_unstable());
            Some((blocks, 0))
        }
        Route::RanksOverClique(world) => {
            let mut blocks = vec![Vec::new(); world.total()];
            let mut w = 0;
            for (r, groups) in world.group_of.iter().enumerate() {
                for &g in groups {
                    blocks[world.first(r) + g].push(w);
                    w += 1;
                }
            }
            Some((blocks, world.first(rank)))
        }
        _ => None,
    }
}

impl Packed {
    fn new(
        bucket: &BucketView<'_>,
        (owners, first): (Vec<Vec<usize>>, usize),
        place: Place,
    ) -> Packed {
        let size = bucket.dtype.size();
        let blocks: Vec<Vec<Entry>> = (owners.iter())
            .map(|ws| {
                (ws.iter())
                    .flat_map(|&owner| {
                        (bucket.segments.iter().enumerate()).filter_map(move |(segment, s)| {
                            let (first, count) = piece(s.count, owner, place.total);
                            (count > 0).then_some(Entry {
                                owner,
                                segment,
                                first,
                                count,
                            })
                        })
                    })
                    .collect()
            })
            .collect();
        let width = (blocks.iter())
            .map(|b| b.iter().map(|e| e.count).sum())
            .max()
            .unwrap_or(0);
        let ptrs = (blocks.iter())
            .map(|b| {
                (b.iter())
                    .map(|e| {
                        let seg = &bucket.segments[e.segment];
                        seg.ptrs.iter().map(|p| p + e.first * size).collect()
                    })
                    .collect()
            })
            .collect();
        Packed {
            blocks,
            width,
            ptrs,
            first,
        }
    }

    /// Whether the padded blocks cost at most the bucket again.
    fn pays(&self, bucket: &BucketView<'_>) -> bool {
        self.blocks.len() * self.width <= 2 * bucket.elements()
    }

    /// Block `q`'s entries (with `owner`, that owner's alone) as a bucket of `dtype`, and
    /// where they start in the block (elements).
    fn view(&self, dtype: DType, q: usize, owner: Option<usize>) -> (BucketView<'_>, usize) {
        let mine = |e: &Entry| owner.is_none_or(|o| o == e.owner);
        let at = self.blocks[q]
            .iter()
            .take_while(|e| !mine(e))
            .map(|e| e.count)
            .sum();
        let segments = (self.blocks[q].iter().zip(&self.ptrs[q]))
            .filter(|(e, _)| mine(e))
            .map(|(e, ptrs)| Segment {
                ptrs,
                count: e.count,
            })
            .collect();
        (BucketView { dtype, segments }, at)
    }

    /// The owners of block `q` with at least one element.
    fn owners_of(&self, q: usize) -> Vec<usize> {
        let mut owners: Vec<usize> = self.blocks[q].iter().map(|e| e.owner).collect();
        owners.dedup();
        owners
    }
}

/// The links, the collective and the bucket's owner layout where the levels cross the groups
/// with one NCCL collective.
fn packed<'a>(
    site: &Site<'a>,
    bucket: &BucketView<'_>,
    place: Place,
) -> Option<(&'a dyn Links, &'a dyn Collective, Packed)> {
    let links = site.backend.links()?;
    let collective = links.collective()?;
    let owners = owners(site.levels, site.ranks.map_or(0, |r| r.rank()))?;
    Some((links, collective, Packed::new(bucket, owners, place)))
}

/// Every local replica's owned pieces of `bucket` := their sum over every replica (divided by
/// `avg`), through `ncclReduceScatter` over the owner-packed blocks; nothing else is written.
/// `false` (nothing done) where this module's first lines say it does not apply.
///
/// # Safety
/// As for `dense::allreduce`.
pub(super) unsafe fn reduce_scatter(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    avg: Option<usize>,
    place: Place,
) -> Result<bool> {
    let Some((links, collective, packed)) = packed(&site, bucket, place) else {
        return Ok(false);
    };
    let in_world = matches!(site.levels.route, Route::RanksOverClique(_));
    let order_free = packed.blocks.len() == 2 || !bucket.dtype.is_float();
    if !(in_world || order_free) || !packed.pays(bucket) {
        return Ok(false);
    }
    if bucket.elements() == 0 {
        return Ok(true);
    }
    let (dtype, size, width) = (bucket.dtype, bucket.dtype.size(), packed.width);
    let groups = &site.levels.groups;
    let bytes = packed.blocks.len() * width * size;
    // Buffers and layouts first: nothing between the exchange and the unpacks allocates.
    let buffers: Vec<u64> = (0..groups.len())
        .map(|g| links.buffer(g, Slot::Fusion, bytes))
        .collect::<Result<_>>()?;
    let mut packs: Vec<(usize, u64, BucketView<'_>, Layout)> = Vec::new();
    let mut unpacks: Vec<(usize, u64, BucketView<'_>, Layout)> = Vec::new();
    for (g, &buffer) in buffers.iter().enumerate() {
        for q in 0..packed.blocks.len() {
            let (view, _) = packed.view(dtype, q, None);
            if view.segments.is_empty() {
                continue;
            }
            let layout = links.layout(g, &view, Members::All)?;
            packs.push((g, buffer + (q * width * size) as u64, view, layout));
        }
        // This group's block: each owner's sums into that replica alone.
        let q = packed.first + g;
        for owner in packed.owners_of(q) {
            let (view, at) = packed.view(dtype, q, Some(owner));
            let layout = links.layout(g, &view, Members::One(owner - place.offset))?;
            unpacks.push((g, buffer + ((q * width + at) * size) as u64, view, layout));
        }
    }
    for (g, at, view, layout) in &packs {
        links.pack(*g, view, *layout, *at)?;
    }
    collective.reduce_scatter(dtype, width, &buffers)?;
    for (g, at, view, layout) in &unpacks {
        links.unpack(*g, view, *layout, *at, avg)?;
    }
    Ok(true)
}

/// Every local replica's copy of `bucket` := the owners' pieces, through `ncclAllGather` over
/// the owner-packed blocks (each owner's pieces copied into its group's block first). An
/// owner's own pieces are not written. `false` (nothing done) where this module's first lines
/// say it does not apply.
///
/// # Safety
/// As for `dense::broadcast`.
pub(super) unsafe fn allgather(
    site: Site<'_>,
    bucket: &BucketView<'_>,
    place: Place,
) -> Result<bool> {
    let Some((links, collective, packed)) = packed(&site, bucket, place) else {
        return Ok(false);
    };
    if !packed.pays(bucket) {
        return Ok(false);
    }
    if bucket.elements() == 0 {
        return Ok(true);
    }
    let (dtype, size, width) = (bucket.dtype, bucket.dtype.size(), packed.width);
    let groups = &site.levels.groups;
    let bytes = packed.blocks.len() * width * size;
    let buffers: Vec<u64> = (0..groups.len())
        .map(|g| links.buffer(g, Slot::Fusion, bytes))
        .collect::<Result<_>>()?;
    let mut packs: Vec<(usize, u64, BucketView<'_>, Layout)> = Vec::new();
    let mut unpacks: Vec<(usize, u64, BucketView<'_>, Layout)> = Vec::new();
    for (g, (&buffer, members)) in buffers.iter().zip(groups).enumerate() {
        let own = packed.first + g;
        for owner in packed.owners_of(own) {
            // The owner's pieces into its block; later, into the group's other replicas.
            let (view, at) = packed.view(dtype, own, Some(owner));
            let from = owner - place.offset;
            let at = buffer + ((own * width + at) * size) as u64;
            let layout = links.layout(g, &view, Members::One(from))?;
            for &r in members.iter().filter(|&&r| r != from) {
                let (view, _) = packed.view(dtype, own, Some(owner));
                let layout = links.layout(g, &view, Members::One(r))?;
                unpacks.push((g, at, view, layout));
            }
            packs.push((g, at, view, layout));
        }
        for q in (0..packed.blocks.len()).filter(|&q| q != own) {
            let (view, _) = packed.view(dtype, q, None);
            if view.segments.is_empty() {
                continue;
            }
            let layout = links.layout(g, &view, Members::All)?;
            unpacks.push((g, buffer + (q * width * size) as u64, view, layout));
        }
    }
    for (g, at, view, layout) in &packs {
        links.pack(*g, view, *layout, *at)?;
    }
    collective.allgather(width * size, &buffers)?;
    for (g, at, view, layout) in &unpacks {
        links.unpack(*g, view, *layout, *at, None)?;
    }
    Ok(true)
}
