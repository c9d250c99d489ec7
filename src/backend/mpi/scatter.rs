//! A reduce-scatter through shared memory where every rank has one contribution: each rank
//! stages only the elements the other ranks own, each section in the owner's order, and each
//! rank sums its own elements from its tensors and the others' slots straight into its
//! tensors. Against the ring allreduce with its copy-out cut to the owned elements (what
//! ranks of several contributions still get), a rank reads and writes half as much staging:
//! nothing of its own elements is staged, and no summed block crosses back between ranks.
//!
//! The bytes are the allreduce's: an element is summed in the order the ring's shared-memory
//! reduction sums it (the rank of its block first, then the others ascending,
//! `ring::Flight::advance_shared`), in the same arithmetic, and divided as it is staged out.
//! Only which rank does the adding differs.

use super::pieces::Walk;
use super::ring::{add_into, block, Ring};
use super::staging::{mpi_type, stage_out};
use super::Engine;
use crate::backend::Segment;
use crate::error::Result;
use crate::types::DType;

/// One rank's owned run of a segment: `len` elements from `first`.
#[derive(Clone, Copy)]
struct Run {
    segment: usize,
    first: usize,
    len: usize,
}

/// Whether [`Engine::shared_reduce_scatter`] sums `dtype`: MPI's type for it is the dtype
/// itself, so a rank's own elements enter the sum straight from its tensors, as staged.
pub(super) fn sums_in_place(dtype: DType) -> bool {
    mpi_type(dtype).1 == dtype.size()
}

impl Engine {
    /// [`Ranks::reduce_scatter`](crate::backend::Ranks) through shared memory of one
    /// contribution per rank (`segments[s].ptrs[0]`), rank `r` owning `owners(s, r)` =
    /// `(first, count)` of segment `s` (alike on every rank), [`sums_in_place`] dtypes only.
    /// Piece `k` (numbered from `first` on the channel, counters as a ring piece's) holds, in
    /// each rank's slot, that rank's elements `[k c, (k + 1) c)` of every other rank's owned
    /// elements laid end to end, one section of `c` per other rank in ascending order.
    /// `ring_piece`: the ring allreduce's piece of this bucket, whose blocks say the order of
    /// each element's sum.
    ///
    /// # Safety
    /// As for [`Ranks::reduce_scatter`](crate::backend::Ranks); `ring` is shared.
    pub(super) unsafe fn shared_reduce_scatter(
        &self,
        (ring, first): (Ring, usize),
        (dtype, segments, ring_piece): (DType, &[Segment<'_>], usize),
        owners: &dyn Fn(usize, usize) -> (usize, usize),
        avg: Option<usize>,
    ) -> Result<()> {
        let slots = ring
            .slots()
            .expect("a reduce-scatter through shared memory without it");
        let (n, me, size) = (slots.ranks(), slots.me(), dtype.size());
        let c = section_of(size, n);
        let runs: Vec<Vec<Run>> = (0..n).map(|r| runs_of(segments, owners, r)).collect();
        let total = |r: usize| runs[r].iter().map(|run| run.len).sum::<usize>();
        let pieces = pieces_of(segments, owners, n, size);
        // Where each segment starts in the bucket, whose ring pieces and blocks cut the sums.
        let offsets: Vec<usize> = (segments.iter())
            .scan(0, |at, s| Some(std::mem::replace(at, *at + s.count)))
            .collect();
        let count = segments.iter().map(|s| s.count).sum::<usize>();
        let tensor = |run: &Run, skip: usize| {
            (segments[run.segment].ptrs[0] as *mut u8).add((run.first + skip) * size)
        };
        // The sum of a block's run, before its one rounding into the tensor.
        let mut sum = vec![0u64; (c * size).div_ceil(8)];
        let sum = sum.as_mut_ptr().cast::<u8>();
        // The channel's slots are used under its lock, as the ring's are.
        let _held = self.scratch.lock();
        let mut walks_in: Vec<Walk> = (0..n).map(|_| Walk::default()).collect();
        let mut walk_sum = Walk::default();
        let stage = |i: usize, slot: *mut u8| {
            for q in (0..n).filter(|&q| q != me) {
                let Some(range) = range_of(i, c, total(q)) else {
                    continue;
                };
                let into = slot.add(section(q, me) * c * size);
                let lengths = |k: usize| runs[q][k].len;
                walks_in[q].parts(lengths, runs[q].len(), range, |k, skip, len, at| {
                    let from = tensor(&runs[q][k], skip);
                    std::ptr::copy_nonoverlapping(from, into.add(at * size), len * size);
                });
            }
        };
        let read = |i: usize, k: usize| {
            let Some(range) = range_of(i, c, total(me)) else {
                return;
            };
            let mine = &runs[me];
            let lengths = |j: usize| mine[j].len;
            walk_sum.parts(lengths, mine.len(), range, |j, skip, len, at| {
                let own = &mine[j];
                let e = offsets[own.segment] + own.first + skip;
                let mut o = 0;
                // Cut where the ring's blocks meet: each block's elements are summed from its
                // rank's value on.
                for (b, l) in blocks((e, len), (ring_piece, count), n) {
                    let from = |r: usize| match r == me {
                        true => tensor(own, skip + o) as *const u8,
                        false => {
                            let at = (section(me, r) * c + at + o) * size;
                            slots.slot(r, k).add(at) as *const u8
                        }
                    };
                    std::ptr::copy_nonoverlapping(from(b), sum, l * size);
                    for r in (0..n).filter(|&r| r != b) {
                        add_into(dtype, sum, from(r), l);
                    }
                    let out = [(tensor(own, skip + o) as usize, l)];
                    stage_out(dtype, sum, (&out, &mut Walk::default()), (0, l), avg);
                    o += l;
                }
            });
        };
        let what = "the reduce-scatter through shared memory";
        self.through_slots((slots, first, pieces), what, stage, read)
    }
}

/// Elements of one rank's section of a slot for `ranks` ranks: a slot holds one section per
/// other rank.
fn section_of(size: usize, ranks: usize) -> usize {
    (super::shm::PIECE / size / (ranks - 1).max(1)).max(1)
}

/// The pieces of [`Engine::shared_reduce_scatter`] of `segments` owned by `owners` among
/// `ranks`: enough for the rank that owns the most (alike on every rank).
pub(super) fn pieces_of(
    segments: &[Segment<'_>],
    owners: &dyn Fn(usize, usize) -> (usize, usize),
    ranks: usize,
    size: usize,
) -> usize {
    let c = section_of(size, ranks);
    let most = (0..ranks)
        .map(|r| (0..segments.len()).map(|s| owners(s, r).1).sum::<usize>())
        .max()
        .unwrap_or(0);
    most.div_ceil(c)
}

/// Where rank `q`'s section sits in rank `r`'s slot: the others in ascending order.
fn section(q: usize, r: usize) -> usize {
    match q < r {
        true => q,
        false => q - 1,
    }
}

/// Rank `r`'s owned runs, segment after segment.
fn runs_of(
    segments: &[Segment<'_>],
    owners: &dyn Fn(usize, usize) -> (usize, usize),
    r: usize,
) -> Vec<Run> {
    (0..segments.len())
        .map(|segment| {
            let (first, len) = owners(segment, r);
            Run {
                segment,
                first,
                len,
            }
        })
        .filter(|run| run.len > 0)
        .collect()
}

/// Piece `k`'s elements of `total` owned ones, `c` per piece: `(start, n)`, or None past them.
fn range_of(k: usize, c: usize, total: usize) -> Option<(usize, usize)> {
    let start = k * c;
    (start < total).then(|| (start, c.min(total - start)))
}

/// `len` bucket elements from `e` cut where the ring allreduce's blocks meet (`piece`
/// elements per ring piece of the bucket's `count`, `ranks` blocks each): `(the block's rank,
/// elements)` in order.
fn blocks(
    (e, len): (usize, usize),
    (piece, count): (usize, usize),
    ranks: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let (mut e, end) = (e, e + len);
    std::iter::from_fn(move || {
        if e >= end {
            return None;
        }
        let i = e / piece;
        let m = piece.min(count - i * piece);
        let at = e - i * piece;
        let b = block_of(m, ranks, at);
        let (o, l) = block(m, ranks, b);
        let n = (o + l - at).min(end - e);
        e += n;
        Some((b, n))
    })
}

/// The block of `m` elements split into `n` ([`block`]) that holds element `at`.
fn block_of(m: usize, n: usize, at: usize) -> usize {
    let (q, rem) = (m / n, m % n);
    let wide = rem * (q + 1);
    match at < wide {
        true => at / (q + 1),
        false => rem + (at - wide) / q.max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::{block, block_of};

    #[test]
    fn block_of_finds_the_block_holding_each_element() {
        for m in [1, 2, 3, 7, 64, 65, 1000] {
            for n in 1..=5 {
                for at in 0..m {
                    let b = block_of(m, n, at);
                    let (o, l) = block(m, n, b);
                    assert!(
                        o <= at && at < o + l,
                        "m {m} n {n} at {at}: block {b} is {o}+{l}"
                    );
                }
            }
        }
    }
}
