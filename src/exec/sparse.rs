//! The sparse gather, written once over [`Backend`](crate::backend::Backend) primitives (`alloc`,
//! `copy`, and for coalescing, range checks and AVG the sparse primitives), so a device backend
//! runs the same algorithm. Each phase's moves are one transfer batch ([`transfer`]: over NCCL,
//! one group of sends and receives).
//!
//! - Plain: every replica's rows are copied, in world order, into a new allocation on every
//!   replica; slices sharing an index buffer (plan's [`IndexGroup`]) gather their indices once.
//! - Coalesced: each replica coalesces its slice locally, the coalesced slices are gathered onto
//!   the root (replica 0) in world order and coalesced again there, and the result is copied to
//!   every other replica. That moves `Σ unique_r + (N - 1) · unique` rows instead of
//!   `N · Σ rows_r`, and every replica ends with the root's bytes.
//!
//! The outputs are built in fresh allocations and only replace the previous step's outputs when
//! the whole `dpsync_allreduce_grads` succeeded (the context installs them).

use std::collections::HashMap;

use super::transfer::{transfer, Transfer};
use super::Executor;
use crate::backend::{Allocation, Coalesced, IndexCheck, SliceRef, ValuesRef};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::sparse::{world_offsets, IndexGroup};
use crate::registry::sparse::SparseInput;
use crate::types::ReduceOp;

/// The root of the coalesced gather.
const ROOT: usize = 0;

/// One replica's part of a gathered slice; `None` when it has no rows (C sees NULL).
type PerReplica = Vec<Option<Allocation>>;

/// What the last successful gather did, for `dpsync_describe`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SparseStats {
    pub coalesce: bool,
    /// Index gathers run (one per [`IndexGroup`]).
    pub index_gathers: usize,
    /// Bytes moved by `copy` (between replicas and within one).
    pub bytes_copied: usize,
    pub gradients: Vec<GradientStats>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradientStats {
    pub name: String,
    /// Rows each replica set.
    pub rows_set: Vec<usize>,
    /// Rows each replica contributed to the gather (after local coalescing).
    pub rows_sent: Vec<usize>,
    /// Rows of the gathered slice.
    pub rows: usize,
}

struct GroupOutput {
    rows: usize,
    indices: PerReplica,
}

struct NameOutput {
    group: usize,
    values: PerReplica,
}

/// The gathered slices of one step, in library-owned memory on each replica.
#[derive(Default)]
pub struct SparseOutputs {
    groups: Vec<GroupOutput>,
    by_name: HashMap<String, NameOutput>,
    /// Outputs of unregistered names: no longer reachable by name, but still valid memory until
    /// the next step replaces everything (the contract's lifetime).
    retired: Vec<NameOutput>,
    /// Intermediate buffers of this step (coalesced parts), by replica: free for reuse from the
    /// next step on.
    scratch: Vec<(usize, Allocation)>,
    pub stats: SparseStats,
}

impl SparseOutputs {
    /// `(indices, values, rows)` of `name` on `replica`; addresses are 0 when `rows` is 0.
    pub fn get(&self, name: &str, replica: usize) -> Option<(usize, usize, usize)> {
        let out = self.by_name.get(name)?;
        let group = &self.groups[out.group];
        let ptr = |a: &PerReplica| a.get(replica)?.as_ref().map(Allocation::ptr);
        Some((
            ptr(&group.indices).unwrap_or(0),
            ptr(&out.values).unwrap_or(0),
            group.rows,
        ))
    }

    /// Hides `name` (it was unregistered) while keeping its memory valid until the next step.
    pub fn forget(&mut self, name: &str) {
        if let Some(out) = self.by_name.remove(name) {
            self.retired.push(out);
        }
    }
}

/// The gathered indices and each member's gathered values of one group.
struct Gathered {
    rows: usize,
    indices: PerReplica,
    values: Vec<PerReplica>,
}

/// The values arrays of `members` at `ptrs` (one per member), as the coalesce primitive takes them.
fn values_refs(members: &[&SparseInput], ptrs: impl Iterator<Item = usize>) -> Vec<ValuesRef> {
    members
        .iter()
        .zip(ptrs)
        .map(|(m, ptr)| ValuesRef {
            ptr,
            dtype: m.spec.value_dtype,
            row_len: m.spec.row_len,
        })
        .collect()
}

/// A backend's coalescing returned fewer results than slices (a defect, reported, not unwound).
fn short_result(backend: &str, got: usize, want: usize) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("internal: {backend} backend coalesced {got} of {want} slices"),
    )
}

impl Executor {
    /// Gives back the outputs of a step that are no longer valid (replaced by a newer step, or
    /// never installed because the step failed): the backend reuses their memory for later
    /// steps' outputs (after the work issued so far, on a stream-ordered backend).
    ///
    /// Reuse is safe in stream order: the next gather writes after its collective's `begin`,
    /// which waits for everything the callers queued before it (their reads of these outputs
    /// included), and every earlier collective's work precedes that on dpsync's streams.
    pub fn retire_outputs(&self, outputs: SparseOutputs) {
        drop(outputs);
    }

    /// Memory for a gathered output of `bytes` on `replica` (its contents undefined: the gather
    /// writes every byte of an output).
    fn alloc_output(&self, replica: usize, bytes: usize) -> Result<Allocation> {
        self.backend.alloc(replica, bytes)
    }

    /// Runs `batch` ([`transfer`]) and counts its bytes.
    unsafe fn transfer_counted(&self, moved: &mut usize, batch: &[Transfer]) -> Result<()> {
        *moved += batch.iter().map(|t| t.bytes).sum::<usize>();
        transfer(self.backend.as_ref(), &self.levels, batch)
    }

    /// The validation that needs the replicas' memory: every index of a gradient registered
    /// with `num_embeddings > 0` lies in `[0, num_embeddings)`. Reads only; runs before any
    /// tensor is written. A group's shared indices are read once, against its tightest bound.
    /// (A device backend may defer the answer to `synchronize`: `Backend::check_indices`.)
    ///
    /// # Safety
    /// Every slice's indices are valid for its rows (the C contract).
    pub unsafe fn check_sparse_indices(
        &self,
        inputs: &[SparseInput],
        groups: &[IndexGroup],
    ) -> Result<()> {
        for group in groups {
            let Some(tightest) = group
                .members
                .iter()
                .map(|&m| &inputs[m])
                .filter(|i| i.spec.num_embeddings > 0)
                .min_by_key(|i| i.spec.num_embeddings)
            else {
                continue;
            };
            let bound = tightest.spec.num_embeddings as u64;
            for (replica, slice) in tightest.slices.iter().enumerate() {
                if slice.rows == 0 {
                    continue;
                }
                self.backend.check_indices(&IndexCheck {
                    tensor: &tightest.name,
                    replica,
                    dtype: tightest.spec.index_dtype,
                    indices: slice.indices,
                    rows: slice.rows,
                    bound,
                })?;
            }
        }
        Ok(())
    }

    /// Gathers every input (validated, index-checked) into new outputs; with `ReduceOp::Avg`
    /// the gathered values are divided by `divisor`, so that scatter-adding them gives the mean.
    ///
    /// # Safety
    /// Every slice's pointers are valid for its rows (the C contract).
    pub unsafe fn gather_sparse(
        &self,
        inputs: &[SparseInput],
        groups: &[IndexGroup],
        coalesce: bool,
        op: ReduceOp,
        divisor: usize,
    ) -> Result<SparseOutputs> {
        let mut out = SparseOutputs {
            stats: SparseStats {
                coalesce,
                index_gathers: groups.len(),
                ..SparseStats::default()
            },
            ..SparseOutputs::default()
        };
        let mut gradient_stats: Vec<Option<GradientStats>> = vec![None; inputs.len()];
        let avg = (op == ReduceOp::Avg && divisor > 1).then_some(divisor);
        for group in groups {
            let members: Vec<&SparseInput> = group.members.iter().map(|&m| &inputs[m]).collect();
            let (gathered, rows_sent) = if coalesce {
                self.gather_coalesced(&members, &mut out.stats.bytes_copied, avg, &mut out.scratch)?
            } else if self.ranks().is_some() {
                self.gather_plain_world(&members, &mut out.stats.bytes_copied, avg)?
            } else {
                let sent = members[0].slices.iter().map(|s| s.rows).collect();
                (
                    self.gather_plain(&members, &mut out.stats.bytes_copied)?,
                    sent,
                )
            };
            // Coalesced results (and a world's) were divided once on the root, before being
            // copied out.
            if let (Some(divisor), false, false) = (avg, coalesce, self.ranks().is_some()) {
                for (input, values) in members.iter().zip(&gathered.values) {
                    let count = gathered.rows * input.spec.row_len;
                    for (replica, a) in values.iter().enumerate() {
                        if let Some(a) = a {
                            self.backend.divide(
                                replica,
                                input.spec.value_dtype,
                                a.ptr(),
                                count,
                                divisor,
                            )?;
                        }
                    }
                }
            }
            let g = out.groups.len();
            for ((&m, input), values) in group.members.iter().zip(&members).zip(gathered.values) {
                out.by_name
                    .insert(input.name.clone(), NameOutput { group: g, values });
                gradient_stats[m] = Some(GradientStats {
                    name: input.name.clone(),
                    rows_set: input.slices.iter().map(|s| s.rows).collect(),
                    rows_sent: rows_sent.clone(),
                    rows: gathered.rows,
                });
            }
            out.groups.push(GroupOutput {
                rows: gathered.rows,
                indices: gathered.indices,
            });
        }
        out.stats.gradients = gradient_stats.into_iter().flatten().collect();
        Ok(out)
    }

    /// Every replica's rows onto every replica, in world order: one transfer batch for the
    /// indices and every member's values.
    unsafe fn gather_plain(&self, members: &[&SparseInput], moved: &mut usize) -> Result<Gathered> {
        let first = members[0];
        let rows: Vec<usize> = first.slices.iter().map(|s| s.rows).collect();
        let (offsets, total) = world_offsets(rows.iter().copied());
        let replicas = rows.len();
        let mut batch = Vec::new();
        // Allocates `total` rows of `row_bytes` on every replica; each replica's part goes in.
        let mut gather = |row_bytes: usize, src: &dyn Fn(usize) -> usize| -> Result<PerReplica> {
            let mut outs = Vec::with_capacity(replicas);
            for dst in 0..replicas {
                if total == 0 {
                    outs.push(None);
                    continue;
                }
                let a = self.alloc_output(dst, total * row_bytes)?;
                for (r, (&n, &at)) in rows.iter().zip(&offsets).enumerate() {
                    batch.push(Transfer {
                        src_replica: r,
                        src: src(r),
                        dst_replica: dst,
                        dst: a.ptr() + at * row_bytes,
                        bytes: n * row_bytes,
                    });
                }
                outs.push(Some(a));
            }
            Ok(outs)
        };
        let index_bytes = first.spec.index_dtype.size();
        let indices = gather(index_bytes, &|r| first.slices[r].indices)?;
        let mut values = Vec::with_capacity(members.len());
        for m in members {
            values.push(gather(m.spec.row_bytes(), &|r| m.slices[r].values)?);
        }
        self.transfer_counted(moved, &batch)?;
        Ok(Gathered {
            rows: total,
            indices,
            values,
        })
    }

    /// Coalesce locally, gather onto the root, coalesce there, divide there by `avg`, copy the
    /// result to every replica. Returns the rows each replica contributed as well. (Dividing the
    /// root's result after the copies were queued on the other replicas' streams would race
    /// with them; before, it is one division instead of N.)
    unsafe fn gather_coalesced(
        &self,
        members: &[&SparseInput],
        moved: &mut usize,
        avg: Option<usize>,
        scratch: &mut Vec<(usize, Allocation)>,
    ) -> Result<(Gathered, Vec<usize>)> {
        let first = members[0];
        let index_dtype = first.spec.index_dtype;
        let replicas = first.slices.len();
        // Each replica's slice coalesced where it lives (None: no rows), all in one call.
        let values: Vec<Vec<ValuesRef>> = (0..replicas)
            .map(|r| values_refs(members, members.iter().map(|m| m.slices[r].values)))
            .collect();
        let slices: Vec<(usize, SliceRef)> = (first.slices.iter().enumerate())
            .filter(|(_, slice)| slice.rows > 0)
            .map(|(r, slice)| {
                let slice = SliceRef {
                    index_dtype,
                    indices: slice.indices,
                    rows: slice.rows,
                    values: &values[r],
                };
                (r, slice)
            })
            .collect();
        let coalesced =
            (self.backend).coalesce(&slices, &mut |r, bytes| self.alloc_output(r, bytes))?;
        if coalesced.len() != slices.len() {
            return Err(short_result(
                self.backend.name(),
                coalesced.len(),
                slices.len(),
            ));
        }
        let mut coalesced = coalesced.into_iter();
        let mut local: Vec<Option<Coalesced>> = (first.slices.iter())
            .map(|slice| (slice.rows > 0).then(|| coalesced.next()).flatten())
            .collect();
        let sent: Vec<usize> = local
            .iter()
            .map(|c| c.as_ref().map_or(0, |c| c.rows))
            .collect();
        let total: usize = sent.iter().sum();
        // One replica (and no other rank): its coalesced slice is the result. Otherwise gather
        // onto the root.
        let result: Option<Coalesced> = if self.ranks().is_none() && (replicas == 1 || total == 0) {
            local.swap_remove(ROOT)
        } else {
            let parts: Vec<Part> = (local.iter())
                .map(|c| match c {
                    Some(c) => Part {
                        rows: c.rows,
                        indices: c.indices.ptr(),
                        values: c.values.iter().map(Allocation::ptr).collect(),
                    },
                    None => Part::empty(members.len()),
                })
                .collect();
            let gathered = self.gather_to_root(members, &parts, moved)?;
            // Copies to the root may still be reading the local slices (stream order): reused
            // from the next step on.
            for (r, part) in local.into_iter().enumerate() {
                if let Some(part) = part {
                    scratch.push((r, part.indices));
                    scratch.extend(part.values.into_iter().map(|v| (r, v)));
                }
            }
            match gathered {
                None => None,
                Some((indices, values, total)) => {
                    let refs = values_refs(members, values.iter().map(Allocation::ptr));
                    let gathered = SliceRef {
                        index_dtype,
                        indices: indices.ptr(),
                        rows: total,
                        values: &refs,
                    };
                    let result = (self.backend)
                        .coalesce(&[(ROOT, gathered)], &mut |r, bytes| {
                            self.alloc_output(r, bytes)
                        })?
                        .pop()
                        .ok_or_else(|| short_result(self.backend.name(), 0, 1))?;
                    scratch.push((ROOT, indices));
                    scratch.extend(values.into_iter().map(|v| (ROOT, v)));
                    Some(result)
                }
            }
        };
        let Some(result) = result.filter(|c| c.rows > 0) else {
            return Ok((Gathered::empty(replicas, members.len()), sent));
        };
        let rows = result.rows;
        let (indices, values) =
            self.copies_from_root(members, rows, result.indices, result.values, avg, moved)?;
        Ok((
            Gathered {
                rows,
                indices,
                values,
            },
            sent,
        ))
    }
    /// The root's gathered `rows` (`indices`, `values` per member), divided by `avg` there,
    /// and a copy on every other replica, in one batch.
    unsafe fn copies_from_root(
        &self,
        members: &[&SparseInput],
        rows: usize,
        indices: Allocation,
        values: Vec<Allocation>,
        avg: Option<usize>,
        moved: &mut usize,
    ) -> Result<(PerReplica, Vec<PerReplica>)> {
        let replicas = members[0].slices.len();
        if let Some(divisor) = avg {
            for (m, a) in members.iter().zip(&values) {
                let count = rows * m.spec.row_len;
                self.backend
                    .divide(ROOT, m.spec.value_dtype, a.ptr(), count, divisor)?;
            }
        }
        let mut batch = Vec::new();
        let mut broadcast = |a: Allocation, bytes: usize| -> Result<PerReplica> {
            let mut outs = Vec::with_capacity(replicas);
            for dst in 0..replicas {
                if dst == ROOT {
                    outs.push(None);
                    continue;
                }
                let copy = self.alloc_output(dst, bytes)?;
                batch.push(Transfer {
                    src_replica: ROOT,
                    src: a.ptr(),
                    dst_replica: dst,
                    dst: copy.ptr(),
                    bytes,
                });
                outs.push(Some(copy));
            }
            outs[ROOT] = Some(a);
            Ok(outs)
        };
        let indices = broadcast(indices, rows * members[0].spec.index_dtype.size())?;
        let mut out = Vec::with_capacity(members.len());
        for (m, a) in members.iter().zip(values) {
            out.push(broadcast(a, rows * m.spec.row_bytes())?);
        }
        self.transfer_counted(moved, &batch)?;
        Ok((indices, out))
    }

    /// Every part (one per local replica, in order) gathered onto local replica [`ROOT`] in
    /// world order, in new allocations: `(indices, values per member, rows)`, or `None` when
    /// there are no rows at all. In a world every rank's parts come too, in rank order, over
    /// the engine ([`Ranks::allgather_spans`]: host memory, device rows copied through the host
    /// stage first); each message starts with its parts' row counts.
    unsafe fn gather_to_root(
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
    unsafe fn gather_plain_world(
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

/// One replica's rows in a gather onto the root: its indices and each member's values.
#[derive(Clone)]
struct Part {
    rows: usize,
    indices: usize,
    values: Vec<usize>,
}

impl Part {
    fn empty(members: usize) -> Part {
        Part {
            rows: 0,
            indices: 0,
            values: vec![0; members],
        }
    }
}

impl Gathered {
    fn empty(replicas: usize, members: usize) -> Gathered {
        let none = || (0..replicas).map(|_| None).collect::<PerReplica>();
        Gathered {
            rows: 0,
            indices: none(),
            values: (0..members).map(|_| none()).collect(),
        }
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
