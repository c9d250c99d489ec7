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

mod gather;
use crate::backend::host::HostBackend;
use crate::backend::{Allocation, Backend, Coalesced, IndexCheck, SliceRef, Streams, ValuesRef};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::sparse::{world_offsets, IndexGroup};
use crate::registry::sparse::SparseInput;
use crate::types::ReduceOp;
use gather::Part;

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

    /// A replica's slice as it is, standing in for its local coalescing (reproducible sums):
    /// the root's coalescing sums its rows with everyone's. Its rows are copied into library
    /// memory of the replica, as a coalesced slice would be.
    unsafe fn raw_part(&self, replica: usize, slice: &SliceRef<'_>) -> Result<Coalesced> {
        let copy = |ptr: usize, bytes: usize| -> Result<Allocation> {
            let to = self.alloc_output(replica, bytes)?;
            self.backend.copy(replica, ptr, replica, to.ptr(), bytes)?;
            Ok(to)
        };
        Ok(Coalesced {
            rows: slice.rows,
            indices: copy(slice.indices, slice.rows * slice.index_dtype.size())?,
            values: (slice.values.iter())
                .map(|v| copy(v.ptr, slice.rows * v.row_bytes()))
                .collect::<Result<_>>()?,
        })
    }

    /// The gathered rows on the root coalesced, reproducibly with `repro`: by the backend where
    /// it can, otherwise (device memory) through the host stage and the host's kernels.
    unsafe fn coalesce_root(&self, gathered: SliceRef<'_>, repro: bool) -> Result<Coalesced> {
        let via_host = match (repro, self.backend.streams(), &self.host) {
            (true, Some(streams), Some((host, _))) => Some((streams, host)),
            _ => None,
        };
        let mut one = match via_host {
            Some((streams, host)) => vec![self.coalesce_on_host(streams, host, gathered)?],
            None => (self.backend).coalesce(&[(ROOT, gathered)], repro, &mut |r, bytes| {
                self.alloc_output(r, bytes)
            })?,
        };
        one.pop()
            .ok_or_else(|| short_result(self.backend.name(), 0, 1))
    }

    /// [`Executor::coalesce_root`] of rows in device memory by the host: the rows down to the
    /// stage, coalesced by the host backend, the result up into new memory of the root.
    unsafe fn coalesce_on_host(
        &self,
        streams: &dyn Streams,
        host: &HostBackend,
        g: SliceRef<'_>,
    ) -> Result<Coalesced> {
        let index_size = g.index_dtype.size();
        let spans: Vec<(usize, usize)> = std::iter::once((g.indices, g.rows * index_size))
            .chain(g.values.iter().map(|v| (v.ptr, g.rows * v.row_bytes())))
            .collect();
        let stage = streams.host_stage(spans.iter().map(|s| s.1).sum::<usize>().max(1))?;
        let mut at = stage;
        let mut staged = Vec::with_capacity(spans.len());
        for &(ptr, bytes) in &spans {
            if bytes > 0 {
                streams.stage_copy(ROOT, at, ptr, bytes)?;
            }
            staged.push(at);
            at += bytes;
        }
        streams.wait_all()?;
        let values: Vec<ValuesRef> = (g.values.iter().zip(&staged[1..]))
            .map(|(v, &ptr)| ValuesRef { ptr, ..*v })
            .collect();
        let on_host = SliceRef {
            indices: staged[0],
            values: &values,
            ..g
        };
        let c = host
            .coalesce(&[(0, on_host)], true, &mut |r, bytes| host.alloc(r, bytes))?
            .pop()
            .ok_or_else(|| short_result(host.name(), 0, 1))?;
        // Up through the stage (the result is no larger than the rows it came from).
        let outputs = std::iter::once((&c.indices, c.rows * index_size)).chain(
            (c.values.iter())
                .zip(g.values)
                .map(|(a, v)| (a, c.rows * v.row_bytes())),
        );
        let mut at = stage;
        let mut uploads = Vec::with_capacity(spans.len());
        for (from, bytes) in outputs {
            let to = self.alloc_output(ROOT, bytes.max(1))?;
            std::ptr::copy_nonoverlapping(from.ptr() as *const u8, at as *mut u8, bytes);
            if bytes > 0 {
                streams.stage_copy(ROOT, to.ptr(), at, bytes)?;
            }
            uploads.push(to);
            at += bytes;
        }
        streams.wait_all()?;
        let indices = uploads.remove(0);
        Ok(Coalesced {
            rows: c.rows,
            indices,
            values: uploads,
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
        // Reproducible sums coalesce once, at the root, over every row: a local sum would round
        // before the other replicas' rows join it.
        let repro = self.levels.reproducible;
        let coalesced = match repro {
            true => (slices.iter())
                .map(|(r, s)| self.raw_part(*r, s))
                .collect::<Result<Vec<_>>>()?,
            false => (self.backend)
                .coalesce(&slices, false, &mut |r, bytes| self.alloc_output(r, bytes))?,
        };
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
        let alone = self.ranks().is_none() && (replicas == 1 || total == 0);
        let result: Option<Coalesced> = if alone && (!repro || total == 0) {
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
                    let result = self.coalesce_root(gathered, repro)?;
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
