//! Sparse gradients seen from the context: registration (names shared with dense tensors are
//! refused), this step's slices, the check-and-gather phase of `dpsync_allreduce_grads`, the
//! gathered outputs, and their part of `describe`.

use serde_json::{json, Value};

use super::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{SparseOutputs, SparseStats};
use crate::options::Options;
use crate::plan::sparse::{
    common_groups, describe_gather, describe_sparse, group_labels, index_groups, IndexGroup,
};
use crate::registry::sparse::{SparseInput, SparseRegistry, SparseSlice, SparseSpec};
use crate::types::{Device, Memory, ReduceOp};

/// One step's checked sparse slices ([`Context::sparse_step`]).
#[derive(Default)]
pub(super) struct SparseStep {
    inputs: Vec<SparseInput>,
    groups: Vec<IndexGroup>,
}

impl SparseStep {
    /// Sparse gradients set this step.
    pub(super) fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Each input's index group on this rank ([`group_labels`]).
    pub(super) fn labels(&self) -> Vec<usize> {
        group_labels(&self.groups, self.inputs.len())
    }

    /// In a world: the index groups every rank can use, from every rank's [`Self::labels`].
    pub(super) fn regroup(&mut self, labels: &[Vec<usize>]) {
        self.groups = common_groups(labels);
    }
}

impl Context {
    /// A dense registration may not take a sparse gradient's name (unregister would not know
    /// which one is meant).
    pub(super) fn check_not_sparse(&self, name: &str) -> Result<()> {
        if self.sparse.contains(name) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!("tensor '{name}' is already registered as a sparse gradient"),
            ));
        }
        Ok(())
    }

    /// NOT_FOUND for a name that is not a sparse gradient, saying so when it is a dense tensor.
    fn check_sparse_name(&self, name: &str) -> Result<()> {
        if self.sparse.contains(name) {
            return Ok(());
        }
        let hint = if self.registry.contains(name) {
            " (it is a dense tensor, registered with dpsync_register)"
        } else {
            ""
        };
        Err(Error::new(
            ErrorKind::NotFound,
            format!("sparse gradient '{name}' is not registered{hint}"),
        ))
    }

    pub fn register_sparse(&mut self, name: &str, replica: usize, spec: SparseSpec) -> Result<()> {
        self.check_replica_of("sparse gradient", name, replica)?;
        if self.registry.contains(name) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "tensor '{name}' is already registered as a dense tensor; a sparse gradient \
                     needs a name of its own"
                ),
            ));
        }
        self.sparse.register(name, replica, spec)
    }

    pub fn sparse_set(&mut self, name: &str, replica: usize, slice: SparseSlice) -> Result<()> {
        self.check_replica_of("sparse gradient", name, replica)?;
        self.check_sparse_name(name)?;
        if let Device::Cuda(ordinal) = self.topology.devices[replica] {
            // The gather, range check and coalescing run on the device, in stream order.
            for (what, ptr) in [("indices", slice.indices), ("values", slice.values)] {
                if slice.rows == 0 || ptr == 0 {
                    continue; // the registry reports NULL with rows > 0
                }
                let memory = self.executor.memory_of(replica, ptr).map_err(|mut e| {
                    e.message = format!("sparse gradient '{name}': {what}: {}", e.message);
                    e
                })?;
                if memory != Memory::Device {
                    return Err(Error::invalid(format!(
                        "sparse gradient '{name}': {what} on replica {replica} are in host \
                         memory; slices of a CUDA replica must be in its device's memory \
                         (cuda:{ordinal})"
                    )));
                }
            }
        }
        self.sparse.set(name, replica, slice)
    }

    /// `(indices, values, rows)` of the last gather of `name` on `replica` (addresses 0 when
    /// `rows` is 0).
    pub fn sparse_get(&self, name: &str, replica: usize) -> Result<(usize, usize, usize)> {
        self.check_replica_of("sparse gradient", name, replica)?;
        self.check_sparse_name(name)?;
        self.sparse_out.get(name, replica).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidState,
                format!(
                    "sparse gradient '{name}' has not been gathered yet: its gathered slice \
                     exists after a successful dpsync_allreduce_grads that included it"
                ),
            )
        })
    }

    /// Removes the sparse gradient `name`; false when it is not one. Its last outputs stay
    /// valid until the next step, as the contract promises, but are no longer reachable.
    pub(super) fn unregister_sparse(&mut self, name: &str) -> bool {
        let found = self.sparse.unregister(name);
        if found {
            self.sparse_out.forget(name);
        }
        found
    }

    /// This step's slices, checked (all set, registrations consistent, indices in range), with
    /// their index groups; reads only.
    pub(super) fn sparse_step(&self) -> Result<SparseStep> {
        if self.sparse.is_empty() {
            return Ok(SparseStep::default());
        }
        let inputs = self.sparse.step()?;
        let groups = index_groups(&inputs);
        // SAFETY: slice memory stays valid until dpsync_allreduce_grads returns (the C contract).
        unsafe { self.executor.check_sparse_indices(&inputs, &groups)? };
        Ok(SparseStep { inputs, groups })
    }

    /// The agreement's lines for the sparse gradients of `step` (a world's ranks must register
    /// the same ones; their rows may differ).
    pub(super) fn sparse_lines(step: &SparseStep) -> Vec<String> {
        (step.inputs.iter())
            .map(|i| {
                format!(
                    "{}	sparse rows of {} x {}, indices {}",
                    i.name, i.spec.row_len, i.spec.value_dtype, i.spec.index_dtype
                )
            })
            .collect()
    }

    /// Gathers `step`'s slices into new outputs; nothing visible changes until
    /// [`Self::install_sparse`].
    pub(super) fn gather_sparse(&self, step: &SparseStep, op: ReduceOp) -> Result<SparseOutputs> {
        if step.inputs.is_empty() {
            return Ok(SparseOutputs::default());
        }
        // SAFETY: as in sparse_step.
        unsafe {
            self.executor.gather_sparse(
                &step.inputs,
                &step.groups,
                self.options.sparse_coalesce,
                op,
                self.divisor(),
            )
        }
    }

    /// The step succeeded: its outputs replace the previous ones and its slices are consumed.
    /// In an elastic world the previous outputs and the slices are kept until the call's vote
    /// (context/undo.rs): on a loss they come back, as after a failed step.
    pub(super) fn install_sparse(&mut self, outputs: SparseOutputs) {
        let old = std::mem::replace(&mut self.sparse_out, outputs);
        if self.keeps_undo() {
            let slices = self.sparse.take_slices();
            self.keep_sparse(old, slices);
        } else {
            self.executor.retire_outputs(old);
            self.sparse.consume_slices();
        }
    }
}

/// Adds the sparse gradients to a describe object: `"sparse"` (consistent registrations),
/// `"sparse_gather"` (how they are gathered) and their registration problems under `"problems"`.
pub(super) fn describe_into(json: &mut Value, sparse: &SparseRegistry, options: &Options) {
    let mut gradients = Vec::new();
    let mut problems = Vec::new();
    for (name, spec) in sparse.checked() {
        match spec {
            Ok(spec) => gradients.push(describe_sparse(name, &spec, options.sparse_coalesce)),
            Err(err) => problems.push(Value::from(err.message)),
        }
    }
    json["sparse"] = Value::from(gradients);
    json["sparse_gather"] = describe_gather(options.replicas.len(), options.sparse_coalesce);
    if let Some(list) = json["problems"].as_array_mut() {
        list.extend(problems);
    }
}

/// What the last successful gather did; `null` before the first one with sparse gradients.
pub(super) fn describe_stats(stats: &SparseStats) -> Value {
    if stats.gradients.is_empty() {
        return Value::Null;
    }
    let gradients: Vec<Value> = stats
        .gradients
        .iter()
        .map(|g| json!({"name": g.name, "rows_set": g.rows_set, "rows_sent": g.rows_sent, "rows": g.rows}))
        .collect();
    json!({
        "coalesce": stats.coalesce,
        "index_gathers": stats.index_gathers,
        "bytes_copied": stats.bytes_copied,
        "gradients": gradients,
    })
}
