//! Gathers onto each process's root replica: every local replica's rows, and in a world every
//! rank's too (the plain world gather and the coalesced gather start here).

use super::{Gathered, ROOT};
use crate::backend::Allocation;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::transfer::Transfer;
use crate::exec::Executor;
use crate::registry::sparse::SparseInput;

/// One replica's rows in a gather onto the root: its indices and each member's values.
#[derive(Clone)]
pub(super) struct Part {
    pub(super) rows: usize,
    pub(super) indices: usize,
    pub(super) values: Vec<usize>,
}

impl Part {
    pub(super) fn empty(members: usize) -> Part {
        Part {
            rows: 0,
            indices: 0,
            values: vec![0; members],
        }
    }
}

impl Executor {
    /// Every part (one per local replica, in order) gathered onto local replica [`ROOT`] in
    /// world order, in new allocations: `(indices, values per member, rows)`, or `None` when
    /// there are no rows at all. In a world every rank's parts come too, in rank order, over
    /// the engine ([`Ranks::allgather_spans`]: host memory, device rows copied through the host
    /// stage first); each message starts with its parts' row counts.
    pub(super) unsafe fn gather_to_root(
        &self,
        members: &[&SparseInput],
        parts: &[Part],
        moved: &mut usize,
    ) -> Result<Option<(Allocation, Vec<Allocation>, usize)>> {
        let index_bytes = members[0].spec.index_dtype.size();
        let row_bytes: Vec<usize> = members.iter().map(|m| m.spec.row_bytes()).collect();
        // Where each part's rows come from, per rank: (source replica, indices, values) —
        // local parts from their replicas' memory, other ranks' from their messages (on ROOT).
        let mut sources: Vec<(usize, Part)> = Vec::new();
        let messages: Vec<Vec<u8>>;
        match self.ranks() {
            None => sources.extend(parts.iter().enumerate().map(|(r, p)| (r, p.clone()))),
            Some(ranks) => {
                let header: Vec<u8> = std::iter::once(parts.len())
                    .chain(parts.iter().map(|p| p.rows))
                    .flat_map(|n| (n as u64).to_le_bytes())
                    .collect();
                let mut spans = vec![(header.as_ptr() as usize, header.len())];
                for p in parts {
                    spans.push((p.indices, p.rows * index_bytes));
                    for (v, b) in p.values.iter().zip(&row_bytes) {
                        spans.push((*v, p.rows * b));
                    }
                }
                // Device rows go through the host stage first (the engine reads host memory).
                if let Some(streams) = self.backend.streams() {
                    let per_part = 1 + row_bytes.len();
                    let bytes: usize = spans[1..].iter().map(|s| s.1).sum();
                    let mut at = streams.host_stage(bytes)?;
                    for (i, span) in spans[1..].iter_mut().enumerate() {
                        if span.1 > 0 {
                            streams.stage_copy(i / per_part, at, span.0, span.1)?;
                        }
                        span.0 = at;
                        at += span.1;
                    }
                    streams.wait_all()?;
                }
                messages = ranks.allgather_spans(&spans)?;
                for message in &messages {
                    sources.extend(parse_parts(message, index_bytes, &row_bytes)?);
                }
            }
        }
        let total: usize = sources.iter().map(|(_, p)| p.rows).sum();
        if total == 0 {
            return Ok(None);
        }
        let indices = self.alloc_output(ROOT, total * index_bytes)?;
        let values = (row_bytes.iter())
            .map(|b| self.alloc_output(ROOT, total * b))
            .collect::<Result<Vec<_>>>()?;
        let mut batch = Vec::new();
        let mut at = 0;
        for (r, part) in sources.iter().filter(|(_, p)| p.rows > 0) {
            let to_root = |src: usize, dst: &Allocation, row_bytes: usize| Transfer {
                src_replica: *r,
                src,
                dst_replica: ROOT,
                dst: dst.ptr() + at * row_bytes,
                bytes: part.rows * row_bytes,
            };
            batch.push(to_root(part.indices, &indices, index_bytes));
            for ((&src, dst), &b) in part.values.iter().zip(&values).zip(&row_bytes) {
                batch.push(to_root(src, dst, b));
            }
            at += part.rows;
        }
        self.transfer_counted(moved, &batch)?;
        Ok(Some((indices, values, total)))
    }

    /// A world's plain gather: every replica's rows onto each rank's root in world order, then
    /// (divided by `avg` there) copied to the other local replicas.
    pub(super) unsafe fn gather_plain_world(
        &self,
        members: &[&SparseInput],
        moved: &mut usize,
        avg: Option<usize>,
    ) -> Result<(Gathered, Vec<usize>)> {
        let first = members[0];
        let sent: Vec<usize> = first.slices.iter().map(|s| s.rows).collect();
        let parts: Vec<Part> = (0..first.slices.len())
            .map(|r| Part {
                rows: first.slices[r].rows,
                indices: first.slices[r].indices,
                values: members.iter().map(|m| m.slices[r].values).collect(),
            })
            .collect();
        let gathered = match self.gather_to_root(members, &parts, moved)? {
            None => Gathered::empty(first.slices.len(), members.len()),
            Some((indices, values, rows)) => {
                let (indices, values) =
                    self.copies_from_root(members, rows, indices, values, avg, moved)?;
                Gathered {
                    rows,
                    indices,
                    values,
                }
            }
        };
        Ok((gathered, sent))
    }
}

/// A rank's message ([`Executor::gather_to_root`]) as parts pointing into it, read on the
/// root: its number of parts and their row counts, then per part its indices and each
/// member's values.
fn parse_parts(
    message: &[u8],
    index_bytes: usize,
    row_bytes: &[usize],
) -> Result<Vec<(usize, Part)>> {
    let bad = || Error::new(ErrorKind::Backend, "a rank's sparse rows arrived truncated");
    let word = |i: usize| -> Result<usize> {
        let bytes = message.get(8 * i..8 * i + 8).ok_or_else(bad)?;
        Ok(u64::from_le_bytes(bytes.try_into().map_err(|_| bad())?) as usize)
    };
    let n = word(0)?;
    let counts = (1..=n).map(word).collect::<Result<Vec<usize>>>()?;
    let mut at = 8 * (n + 1);
    let size: usize = counts
        .iter()
        .map(|&c| c * (index_bytes + row_bytes.iter().sum::<usize>()))
        .sum();
    if at + size != message.len() {
        return Err(bad());
    }
    let base = message.as_ptr() as usize;
    let mut parts = Vec::with_capacity(counts.len());
    for rows in counts {
        let indices = base + at;
        at += rows * index_bytes;
        let mut values = Vec::with_capacity(row_bytes.len());
        for b in row_bytes {
            values.push(base + at);
            at += rows * b;
        }
        parts.push((
            ROOT,
            Part {
                rows,
                indices,
                values,
            },
        ));
    }
    Ok(parts)
}
