//! A reduce-scatter through shared memory where every rank has one contribution: each rank
//! stages only the elements the other ranks own, each section in the owner's order, and each
//! rank sums its own elements from its tensors and the others' slots straight into its
//! tensors, in one pass (each source read once, the tensor written once). Against the ring
//! allreduce with its copy-out cut to the owned elements (what ranks of several contributions
//! still get), a rank reads and writes half as much staging: nothing of its own elements is
//! staged, and no summed block crosses back between ranks. Sections are staged raw (f16 and
//! bf16 at their own width, where the ring stages them widened to f32).
//!
//! The bytes are the allreduce's: an element is summed in the order the ring's shared-memory
//! reduction sums it (the rank of its block first, then the others ascending,
//! `ring::Flight::advance_shared`), in the same arithmetic (MPI's type for the dtype, widened
//! exactly), divided and rounded once as the ring stages it out. Only which rank does the
//! adding differs.

use std::sync::atomic::Ordering;

use half::{bf16, f16};

use super::pieces::Walk;
use super::steps::Queue;

use super::ring::{block, Ring, Sum};
use super::staging::{mpi_type, Summed};
use super::Engine;
use crate::backend::{Channel, Segment};
use crate::error::Result;
use crate::types::DType;

/// One rank's owned run of a segment: `len` elements from `first`.
#[derive(Clone, Copy)]
pub(super) struct Run {
    pub(super) segment: usize,
    pub(super) first: usize,
    pub(super) len: usize,
}

/// Every rank's owned elements of a bucket, each rank's laid end to end and moved `c` at a
/// time: piece `k` carries elements `[k c, (k + 1) c)` of every rank's (alike on every rank).
/// [`Engine::shared_reduce_scatter`] lays them in the slots, `owners.rs` in ring pieces.
pub(super) struct Owned {
    /// Each rank's owned runs, segment after segment.
    pub(super) runs: Vec<Vec<Run>>,
    /// Each rank's owned elements in all.
    pub(super) totals: Vec<usize>,
    /// Each rank's elements per piece.
    pub(super) c: usize,
    /// Pieces: enough for the rank that owns the most.
    pub(super) pieces: usize,
}

impl Owned {
    /// `segments` segments among `ranks`, rank `r` owning `owners(s, r)` = `(first, count)` of
    /// segment `s`, `c` of each rank's per piece.
    pub(super) fn new(
        segments: usize,
        owners: &dyn Fn(usize, usize) -> (usize, usize),
        ranks: usize,
        c: usize,
    ) -> Owned {
        let runs: Vec<Vec<Run>> = (0..ranks).map(|r| runs_of(segments, owners, r)).collect();
        let totals: Vec<usize> = (runs.iter())
            .map(|runs| runs.iter().map(|run| run.len).sum())
            .collect();
        let pieces = totals.iter().max().unwrap_or(&0).div_ceil(c);
        Owned {
            runs,
            totals,
            c,
            pieces,
        }
    }
}

impl Engine {
    /// [`Ranks::reduce_scatter`](crate::backend::Ranks) through shared memory of one
    /// contribution per rank (`segments[s].ptrs[0]`, `count` elements in all), every rank's
    /// elements `owned` (laid out for this many ranks and `dtype`'s size). Piece `k`
    /// (numbered from `first` on the channel, counters as a ring piece's) holds, in each
    /// rank's slot, that rank's elements `[k c, (k + 1) c)` of every other rank's owned
    /// elements laid end to end, raw, one section of `c` per other rank in ascending order.
    /// `ring_piece`: the ring allreduce's piece of this bucket, whose blocks say the order of
    /// each element's sum.
    ///
    /// # Safety
    /// As for [`Ranks::reduce_scatter`](crate::backend::Ranks); `ring` is shared.
    pub(super) unsafe fn shared_reduce_scatter(
        &self,
        (ring, first): (Ring, usize),
        (dtype, segments, count): (DType, &[Segment<'_>], usize),
        (owned, ring_piece): (&Owned, usize),
        (sum, avg): (Sum, Option<usize>),
    ) -> Result<()> {
        let slots = ring
            .slots()
            .expect("a reduce-scatter through shared memory without it");
        let (n, me, size) = (slots.ranks(), slots.me(), dtype.size());
        let Owned {
            runs, totals, c, ..
        } = owned;
        let c = *c;
        // Where each segment starts in the bucket, whose ring pieces and blocks cut the sums.
        let offsets: Vec<usize> = (segments.iter())
            .scan(0, |at, s| Some(std::mem::replace(at, *at + s.count)))
            .collect();
        let tensor = |run: &Run, skip: usize| {
            (segments[run.segment].ptrs[0] as *mut u8).add((run.first + skip) * size)
        };
        // The channel's slots are used under its lock, as the ring's are.
        let _held = self.scratch.lock();
        let mut walks_in: Vec<Walk> = (0..n).map(|_| Walk::default()).collect();
        let mut walk_sum = Walk::default();
        let stage = |i: usize, slot: *mut u8| {
            for q in (0..n).filter(|&q| q != me) {
                let Some(range) = range_of(i, c, totals[q]) else {
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
        // A block's sources in its sum's order, reused block after block.
        let mut from: Vec<*const u8> = Vec::with_capacity(n);
        let read = |i: usize, k: usize| {
            let Some(range) = range_of(i, c, totals[me]) else {
                return;
            };
            let mine = &runs[me];
            let lengths = |j: usize| mine[j].len;
            walk_sum.parts(lengths, mine.len(), range, |j, skip, len, at| {
                let own = &mine[j];
                if let Sum::Reproducible(avg) = sum {
                    // Exact: the same bytes in any order, so no cutting at the ring's blocks.
                    let ptrs: Vec<usize> = (0..n)
                        .map(|r| match r == me {
                            true => tensor(own, skip) as usize,
                            false => {
                                slots.slot(r, k).add((section(me, r) * c + at) * size) as usize
                            }
                        })
                        .collect();
                    crate::backend::host::repro::reduce_ptrs(dtype, &ptrs, me, len, avg);
                    return;
                }
                let e = offsets[own.segment] + own.first + skip;
                let mut o = 0;
                // Cut where the ring's blocks meet: each block's elements are summed from its
                // rank's value on.
                for (b, l) in blocks((e, len), (ring_piece, count), n) {
                    let of = |r: usize| match r == me {
                        true => tensor(own, skip + o) as *const u8,
                        false => {
                            let at = (section(me, r) * c + at + o) * size;
                            slots.slot(r, k).add(at) as *const u8
                        }
                    };
                    from.clear();
                    from.extend(std::iter::once(b).chain((0..n).filter(|&r| r != b)).map(of));
                    sum_in_order(dtype, tensor(own, skip + o), &from, l, avg);
                    o += l;
                }
            });
        };
        let what = "the reduce-scatter through shared memory";
        self.through_slots((slots, first, owned.pieces), what, stage, read)
    }
}

impl Engine {
    /// [`Ranks::allreduce`](crate::backend::Ranks) through shared memory of one contribution
    /// per rank: [`Engine::shared_reduce_scatter`] in place, each segment cut evenly among the
    /// ranks, then [`Engine::shared_allgather`] of those cuts. The ring allreduce through shared
    /// memory stages every element into a slot, sums a block there and copies every block out
    /// again; this stages only what other ranks own and sums straight into the tensors, so
    /// each rank reads and writes less (docs/PERFORMANCE.md). The bytes are the ring's: the
    /// reduce-scatter sums each element in the ring's order and arithmetic (whatever the
    /// owners), and the allgather copies them. `queue`: the steps' queue when `channel` is
    /// theirs (numbering the pieces there), held by the caller.
    ///
    /// # Safety
    /// As for [`Ranks::allreduce`](crate::backend::Ranks); the channel's ring is shared.
    pub(super) unsafe fn shared_allreduce(
        &self,
        channel: Channel,
        mut queue: Option<&mut Queue>,
        dtype: DType,
        segments: &[Segment<'_>],
        sum: (Sum, Option<usize>),
    ) -> Result<()> {
        let ring = self.ring(channel);
        let n = ring.ranks();
        let count: usize = segments.iter().map(|s| s.count).sum();
        let cut = |s: usize, r: usize| block(segments[s].count, n, r);
        let owners = Owned::new(segments.len(), &cut, n, section_of(dtype.size(), n));
        let mut number = |pieces: usize| match queue.as_deref_mut() {
            Some(q) => q.ring_pieces(pieces),
            None => self.calls_pieces.fetch_add(pieces, Ordering::Relaxed),
        };
        let first = number(owners.pieces);
        let ring_piece = ring.piece_of(mpi_type(dtype).1).min(count);
        let data = (dtype, segments, count);
        self.shared_reduce_scatter((ring, first), data, (&owners, ring_piece), sum)?;
        let size = dtype.size();
        let spans: Vec<(usize, usize)> = (segments.iter())
            .map(|s| (s.ptrs[0], s.count * size))
            .collect();
        let bytes = |s: usize, r: usize| {
            let (first, len) = cut(s, r);
            (first * size, len * size)
        };
        let parts = parts_of(&spans, &bytes, n);
        let total = count * size;
        let first = number(total.div_ceil(ring.piece_of(1)));
        self.shared_allgather((ring, first), total, &parts)
    }
}

/// Each rank's owned bytes of `spans` (`owned(s, r)` = `(offset, bytes)` of span `s`), the
/// rest null: what rank `r` stages for an allgather, and what the others copy out
/// ([`copy_spans`](super::staging::copy_spans)).
pub(super) fn parts_of(
    spans: &[(usize, usize)],
    owned: &dyn Fn(usize, usize) -> (usize, usize),
    ranks: usize,
) -> Vec<Vec<(usize, usize)>> {
    (0..ranks)
        .map(|r| {
            let mut part = Vec::with_capacity(3 * spans.len());
            for (s, &(ptr, len)) in spans.iter().enumerate() {
                let (offset, n) = owned(s, r);
                part.extend([(0, offset), (ptr + offset, n), (0, len - offset - n)]);
            }
            part
        })
        .collect()
}

/// Elements of one rank's section of a slot for `ranks` ranks: a slot holds one section per
/// other rank ([`Owned`]'s `c` through shared memory).
pub(super) fn section_of(size: usize, ranks: usize) -> usize {
    (super::shm::PIECE / size / (ranks - 1).max(1)).max(1)
}

/// Where rank `q`'s section sits in rank `r`'s slot: the others in ascending order.
pub(super) fn section(q: usize, r: usize) -> usize {
    match q < r {
        true => q,
        false => q - 1,
    }
}

/// Rank `r`'s owned runs, segment after segment.
fn runs_of(segments: usize, owners: &dyn Fn(usize, usize) -> (usize, usize), r: usize) -> Vec<Run> {
    (0..segments)
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
pub(super) fn range_of(k: usize, c: usize, total: usize) -> Option<(usize, usize)> {
    let start = k * c;
    (start < total).then(|| (start, c.min(total - start)))
}

/// `out[..len]` = `from[0][..len]` + `from[1][..len]` + … in that order, in MPI's type for
/// `dtype` (each source raw `dtype`, widened as staging would), divided by `avg` and rounded
/// once: the ring's sum and its staging out, in one pass that reads each source once and
/// writes `out` once. `out` may be one of the sources: each chunk is read whole before it is
/// written.
///
/// # Safety
/// Every source holds `len` elements of `dtype`, and `out` room for them.
pub(super) unsafe fn sum_in_order(
    dtype: DType,
    out: *mut u8,
    from: &[*const u8],
    len: usize,
    avg: Option<usize>,
) {
    match dtype {
        DType::F32 => sum_chunks::<f32>(out, from, len, avg),
        DType::F64 => sum_chunks::<f64>(out, from, len, avg),
        DType::F16 => sum_chunks::<f16>(out, from, len, avg),
        DType::Bf16 => sum_chunks::<bf16>(out, from, len, avg),
        DType::I32 => sum_chunks::<i32>(out, from, len, avg),
        DType::I64 => sum_chunks::<i64>(out, from, len, avg),
    }
}

/// [`sum_in_order`] for `T`, [`CHUNK`] elements at a time in registers.
unsafe fn sum_chunks<T: Summed>(out: *mut u8, from: &[*const u8], len: usize, avg: Option<usize>) {
    let out = out.cast::<T>();
    let mut done = 0;
    while done < len {
        let l = CHUNK.min(len - done);
        let source = |r: usize| from[r].cast::<T>().add(done);
        let mut acc = [T::Acc::default(); CHUNK];
        let (acc, first) = (&mut acc[..l], source(0));
        for (i, a) in acc.iter_mut().enumerate() {
            *a = T::widen(first.add(i).read());
        }
        for r in 1..from.len() {
            let s = source(r);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = T::add(*a, T::widen(s.add(i).read()));
            }
        }
        let o = out.add(done);
        match avg {
            None => acc
                .iter()
                .enumerate()
                .for_each(|(i, &a)| o.add(i).write(T::narrow(a))),
            Some(d) => (acc.iter().enumerate())
                .for_each(|(i, &a)| o.add(i).write(T::narrow(T::divide(a, d)))),
        }
        done += l;
    }
}

/// Elements [`sum_chunks`] sums at a time: a few vector registers' worth.
const CHUNK: usize = 64;

/// `len` bucket elements from `e` cut where the ring allreduce's blocks meet (`piece`
/// elements per ring piece of the bucket's `count`, `ranks` blocks each): `(the block's rank,
/// elements)` in order.
pub(super) fn blocks(
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
    use super::{block, block_of, sum_in_order, CHUNK};
    use crate::backend::mpi::pieces::Walk;
    use crate::backend::mpi::ring::add_into;
    use crate::backend::mpi::staging::{mpi_type, stage_in, stage_out};
    use crate::backend::Segment;
    use crate::types::DType;

    /// `v` as `dtype`'s bytes (integers: rounded).
    fn encode(dtype: DType, v: f64) -> Vec<u8> {
        match dtype {
            DType::F32 => (v as f32).to_ne_bytes().to_vec(),
            DType::F64 => v.to_ne_bytes().to_vec(),
            DType::F16 => half::f16::from_f64(v).to_ne_bytes().to_vec(),
            DType::Bf16 => half::bf16::from_f64(v).to_ne_bytes().to_vec(),
            DType::I32 => (v.round() as i32).to_ne_bytes().to_vec(),
            DType::I64 => (v.round() as i64).to_ne_bytes().to_vec(),
        }
    }

    /// `bytes` in 8-byte words (the tail zero).
    fn words(bytes: &[u8]) -> Vec<u64> {
        (bytes.chunks(8))
            .map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                u64::from_ne_bytes(w)
            })
            .collect()
    }

    /// `sum_in_order` gives the ring's bytes: each source staged into MPI's type, summed
    /// after the first with the ring's `add_into`, staged out with its division; at lengths
    /// around its chunk, with the output one of the sources (as the in-place sum writes).
    #[test]
    fn one_pass_sum_gives_the_ring_arithmetic() {
        for dtype in DType::ALL {
            let size = dtype.size();
            for len in [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7] {
                for sources in 2..=4 {
                    for avg in [None, Some(3)] {
                        // Values whose sums round, small enough for every dtype.
                        // Each source in words, so that every dtype's elements are aligned.
                        let raw: Vec<Vec<u64>> = (0..sources)
                            .map(|r| {
                                let bytes: Vec<u8> = (0..len)
                                    .flat_map(|i| {
                                        let v = (i % 13) as f64 * 0.37 + r as f64 * 1.3 - 2.0;
                                        encode(dtype, v)
                                    })
                                    .collect();
                                words(&bytes)
                            })
                            .collect();
                        // The ring: widened, summed in order, staged out.
                        let wide = mpi_type(dtype).1;
                        let mut acc = vec![0u64; (len * wide).div_ceil(8)];
                        let mut term = vec![0u64; (len * wide).div_ceil(8)];
                        let mut want = vec![0u64; (len * size).div_ceil(8)];
                        // SAFETY: every buffer holds `len` elements of its type.
                        unsafe {
                            for (r, src) in raw.iter().enumerate() {
                                let ptrs = [src.as_ptr() as usize];
                                let seg = [Segment {
                                    ptrs: &ptrs,
                                    count: len,
                                }];
                                let into = match r {
                                    0 => acc.as_mut_ptr().cast::<u8>(),
                                    _ => term.as_mut_ptr().cast::<u8>(),
                                };
                                stage_in(dtype, &seg, &mut Walk::default(), (0, len), into);
                                if r > 0 {
                                    let (a, t) = (acc.as_mut_ptr().cast(), term.as_ptr().cast());
                                    add_into(dtype, a, t, len);
                                }
                            }
                            let outs = [(want.as_mut_ptr() as usize, len)];
                            let acc = acc.as_ptr().cast::<u8>();
                            stage_out(dtype, acc, (&outs, &mut Walk::default()), (0, len), avg);
                        }
                        // One pass, written over source 1.
                        let mut got = raw.clone();
                        let from: Vec<*const u8> = got.iter().map(|v| v.as_ptr().cast()).collect();
                        let out = got[1].as_mut_ptr().cast();
                        // SAFETY: as above; the output is a source, read before written.
                        unsafe { sum_in_order(dtype, out, &from, len, avg) };
                        let what = format!("{dtype:?} len {len} sources {sources} avg {avg:?}");
                        assert_eq!(got[1], want, "{what}");
                    }
                }
            }
        }
    }

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
