//! BMUF, blockwise model-update filtering (Chen & Huo, ICASSP 2016), written once over the
//! [`Backend`](crate::backend::Backend) primitives so that every backend runs the same algorithm:
//!
//! - `bmuf_init`: allocate the global model `W` and block momentum `D` on every replica (one
//!   allocation each per fusion bucket, in the state type of `bmuf_state_dtype`), broadcast
//!   replica 0's PARAMs, and load `W = params`, `D = 0` on every replica.
//! - `bmuf_step`: per bucket, the averaging collective (the plan's allreduce program with
//!   `ReduceOp::Avg`) leaves the mean `A` in every replica's params; then every replica runs the
//!   update primitive on its own copy of the state. The inputs are identical bytes on every
//!   replica, so the outputs are too: no broadcast of the new model is needed.
//!
//! The state also remembers which PARAM tensors it was made for. The checks below run in
//! `Context` before any executor call (the executor itself trusts its input).

use serde_json::json;

use super::{buckets_for, Executor};
use crate::backend::{bmuf_state_dtype, Allocation, BmufFilter, BmufSpan, Channel};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::Bucket;
use crate::registry::{Snapshot, TensorView};
use crate::types::{ReduceOp, Role};

/// `W` and `D` of one bucket on one replica.
struct ReplicaState {
    w: Allocation,
    d: Allocation,
}

/// A context's filter, from `dpsync_bmuf_init` to the next one.
pub struct BmufState {
    filter: BmufFilter,
    /// The PARAM tensors `bmuf_init` took, in registration order; `buckets` index them.
    params: Vec<TensorView>,
    /// The registry generation at which `params` last matched the registry.
    checked_generation: u64,
    buckets: Vec<Bucket>,
    /// `state[bucket][replica]`.
    state: Vec<Vec<ReplicaState>>,
}

// ------------------------------------------------------------------ checks (run by Context)

/// The filter constants for a world of `world_replicas` replicas: `block_momentum < 0` selects
/// `1 - 1/N`; otherwise it must be in [0, 1) (NaN is refused). `block_lr` must be finite and
/// > 0 (the C boundary refuses a non-finite one first, with the same status).
pub fn filter(
    block_lr: f64,
    block_momentum: f64,
    nesterov: bool,
    world_replicas: usize,
) -> Result<BmufFilter> {
    if !(block_lr.is_finite() && block_lr > 0.0) {
        return Err(Error::invalid(format!(
            "block_lr is {block_lr}: it must be a finite number > 0 (usually 1)"
        )));
    }
    let default = 1.0 - 1.0 / world_replicas as f64;
    // The contract's "block_momentum < 0 selects the default" holds for -inf too; NaN is
    // neither negative nor in range.
    let momentum = if block_momentum < 0.0 {
        default
    } else if (0.0..1.0).contains(&block_momentum) {
        block_momentum
    } else {
        return Err(Error::invalid(format!(
            "block_momentum is {block_momentum}: it must be in [0, 1), or negative for the \
             default 1 - 1/N (= {default} with N = {world_replicas} replicas)"
        )));
    };
    Ok(BmufFilter {
        block_lr,
        block_momentum: momentum,
        nesterov,
        default_momentum: block_momentum < 0.0,
    })
}

/// The PARAM tensors `bmuf_init` filters: all of them consistent (else INCONSISTENT naming
/// one), at least one (else INVALID_STATE), all floating-point (else INVALID_ARGUMENT naming
/// the tensor: an integer has no meaningful momentum).
pub fn params_to_filter(snapshot: &Snapshot) -> Result<Vec<&TensorView>> {
    let params = snapshot.select(Role::Param.into())?;
    if params.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidState,
            "no PARAM tensor is registered: BMUF filters the PARAM tensors, register them first",
        ));
    }
    if let Some(t) = params.iter().find(|t| bmuf_state_dtype(t.dtype).is_none()) {
        return Err(Error::invalid(format!(
            "tensor '{}' is a PARAM of dtype {}: BMUF filters floating-point PARAMs only \
             (register integer tensors as STATE or COMPUTED)",
            t.name, t.dtype
        )));
    }
    Ok(params)
}

/// `bmuf_step` without a filter.
pub fn not_started() -> Error {
    Error::new(
        ErrorKind::InvalidState,
        "dpsync_bmuf_step before dpsync_bmuf_init: register the PARAM tensors, then call \
         dpsync_bmuf_init once to start the filter",
    )
}

impl BmufState {
    /// The PARAM tensors registered now must be exactly those `bmuf_init` took (same names,
    /// memory, counts, dtypes): the state was laid out for them. Otherwise INVALID_STATE naming
    /// a tensor that changed. GRAD, COMPUTED and STATE tensors may come and go freely.
    pub fn check_params(&mut self, snapshot: &Snapshot) -> Result<()> {
        if snapshot.generation == self.checked_generation {
            return Ok(());
        }
        let now = snapshot.select(Role::Param.into())?;
        let changed = |name: &str, what: &str| {
            Err(Error::new(
                ErrorKind::InvalidState,
                format!(
                    "PARAM tensor '{name}' {what} after dpsync_bmuf_init: the filter state no \
                     longer matches the model; call dpsync_bmuf_init again to restart the filter \
                     from replica 0's params"
                ),
            ))
        };
        for t in &now {
            match self.params.iter().find(|p| p.name == t.name) {
                None => return changed(&t.name, "was registered"),
                Some(p) if p != *t => return changed(&t.name, "was registered again differently"),
                Some(_) => {}
            }
        }
        if let Some(p) = self
            .params
            .iter()
            .find(|p| !now.iter().any(|t| t.name == p.name))
        {
            return changed(&p.name, "was unregistered");
        }
        self.checked_generation = snapshot.generation;
        Ok(())
    }

    /// The world's replicas changed (ranks left): a default block momentum `1 - 1/N` counts
    /// the replicas that remain.
    pub fn recount(&mut self, world_replicas: usize) {
        if self.filter.default_momentum {
            self.filter.block_momentum = 1.0 - 1.0 / world_replicas as f64;
        }
    }

    /// The filter's own memory, `(replica, address, bytes)` of every bucket's `W` and `D` on
    /// every replica (what an elastic world keeps aside during a step, context/undo.rs).
    pub fn regions(&self) -> Vec<(usize, usize, usize)> {
        let mut all = Vec::with_capacity(2 * self.state.iter().map(Vec::len).sum::<usize>());
        for bucket in &self.state {
            for (k, r) in bucket.iter().enumerate() {
                all.push((k, r.w.ptr(), r.w.bytes()));
                all.push((k, r.d.ptr(), r.d.bytes()));
            }
        }
        all
    }

    /// What `dpsync_describe` shows under "bmuf".
    pub fn describe(&self) -> serde_json::Value {
        let state_bytes: usize = self.state.iter().map(|r| 2 * r[0].w.bytes()).sum();
        json!({
            "block_lr": self.filter.block_lr,
            "block_momentum": self.filter.block_momentum,
            "nesterov": self.filter.nesterov,
            "tensors": self.params.len(),
            "buckets": self.buckets.len(),
            "state_bytes_per_replica": state_bytes,
        })
    }

    fn replicas(&self) -> usize {
        self.params[0].ptrs.len()
    }

    /// Bucket `b`'s tensors on `replica`, each with its slice of the bucket's W and D.
    fn spans(&self, b: usize, replica: usize) -> Vec<BmufSpan> {
        let bucket = &self.buckets[b];
        let size = bmuf_state_dtype(bucket.dtype).map_or(0, |s| s.size());
        let state = &self.state[b][replica];
        let mut offset = 0;
        bucket
            .tensors
            .iter()
            .map(|&i| {
                let t = &self.params[i];
                let span = BmufSpan {
                    params: t.ptrs[replica],
                    w: state.w.ptr() + offset * size,
                    d: state.d.ptr() + offset * size,
                    count: t.count,
                };
                offset += t.count;
                span
            })
            .collect()
    }
}

// ------------------------------------------------------------------ the algorithm

impl Executor {
    /// A filter over `params` (checked by [`params_to_filter`]): its state allocated on every
    /// replica, nothing loaded yet ([`Executor::bmuf_start`]). Allocating first lets a world
    /// agree on every rank's outcome before any PARAM byte changes.
    pub fn bmuf_prepare(
        &self,
        filter: BmufFilter,
        params: &[&TensorView],
        generation: u64,
        fusion_bytes: usize,
    ) -> Result<BmufState> {
        let buckets = buckets_for(params, fusion_bytes);
        let replicas = params[0].ptrs.len();
        let mut state = Vec::with_capacity(buckets.len());
        for bucket in &buckets {
            let size = bmuf_state_dtype(bucket.dtype).map_or(0, |s| s.size());
            let bytes = bucket.elements * size;
            // The state lives where the params do (host params of a CUDA replica: host memory).
            let backend = self.backend_for(bucket.memory);
            let per_replica = (0..replicas)
                .map(|r| {
                    Ok(ReplicaState {
                        w: backend.alloc(r, bytes)?,
                        d: backend.alloc(r, bytes)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            state.push(per_replica);
        }
        Ok(BmufState {
            filter,
            params: params.iter().map(|t| (*t).clone()).collect(),
            checked_generation: generation,
            buckets,
            state,
        })
    }

    /// Starts `bmuf`: world replica 0's params broadcast, `W = params`, `D = 0` everywhere.
    ///
    /// # Safety
    /// Every registered pointer is valid (the C contract).
    pub unsafe fn bmuf_start(&self, bmuf: &BmufState, fusion_bytes: usize) -> Result<()> {
        let params: Vec<&TensorView> = bmuf.params.iter().collect();
        // One collective in stream order. Replica 0 of rank 0 first: the broadcast does not
        // change its params, and a backend without the BMUF primitives fails here, before any
        // PARAM byte has changed. Other ranks' replica 0 loads after the broadcast.
        let root_here = self.ranks().is_none_or(|r| r.rank() == 0);
        self.bracket(|| {
            if root_here {
                self.bmuf_load(bmuf, 0)?;
            }
            self.broadcast(&params, 0, 0, fusion_bytes)?;
            let first = if root_here { 1 } else { 0 };
            for r in first..bmuf.replicas() {
                self.bmuf_load(bmuf, r)?;
            }
            Ok(())
        })
    }

    unsafe fn bmuf_load(&self, bmuf: &BmufState, replica: usize) -> Result<()> {
        for (b, bucket) in bmuf.buckets.iter().enumerate() {
            self.backend_to_touch(bucket.memory)?.bmuf_load(
                replica,
                bucket.dtype,
                &bmuf.spans(b, replica),
            )?;
        }
        Ok(())
    }

    /// One filter step: per bucket, average the params over all replicas (`divisor` = replicas
    /// in the world; across ranks too), then update every replica's params and state.
    ///
    /// # Safety
    /// As for [`Executor::bmuf_init`]; `bmuf` matches the registry
    /// ([`BmufState::check_params`]).
    pub unsafe fn bmuf_step(&self, bmuf: &BmufState, divisor: usize) -> Result<()> {
        let tensors: Vec<&TensorView> = bmuf.params.iter().collect();
        // One collective: on CUDA each bucket's update kernels follow its averaging in stream
        // order, and the callers' streams wait for the last of them.
        self.bracket(|| {
            for (b, bucket) in bmuf.buckets.iter().enumerate() {
                self.allreduce_buckets(
                    std::slice::from_ref(bucket),
                    &tensors,
                    ReduceOp::Avg,
                    divisor,
                    Channel::Calls,
                )?;
                let backend = self.backend_to_touch(bucket.memory)?;
                for r in 0..bmuf.replicas() {
                    backend.bmuf_update(r, bucket.dtype, &bmuf.spans(b, r), &bmuf.filter)?;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_momentum_selects_one_minus_one_over_n() {
        for (n, want) in [(1, 0.0), (2, 0.5), (4, 0.75)] {
            let f = filter(1.0, -1.0, false, n).unwrap();
            assert_eq!(f.block_momentum, want);
        }
        let f = filter(0.5, 0.0, true, 8).unwrap();
        assert_eq!((f.block_lr, f.block_momentum, f.nesterov), (0.5, 0.0, true));
        assert_eq!(filter(1.0, -0.0, false, 4).unwrap().block_momentum, 0.0);
        let f = filter(1.0, f64::NEG_INFINITY, false, 4).unwrap();
        assert_eq!(f.block_momentum, 0.75, "-inf is negative: the default");
    }

    #[test]
    fn out_of_range_and_non_finite_constants_are_refused() {
        for (lr, mu, argument) in [
            (0.0, 0.5, "block_lr"),
            (-1.0, 0.5, "block_lr"),
            (f64::NAN, 0.5, "block_lr"),
            (f64::INFINITY, 0.5, "block_lr"),
            (1.0, 1.0, "block_momentum"),
            (1.0, 1.5, "block_momentum"),
            (1.0, f64::NAN, "block_momentum"),
            (1.0, f64::INFINITY, "block_momentum"),
        ] {
            let err = filter(lr, mu, false, 4).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidArgument);
            assert!(err.message.starts_with(argument), "{}", err.message);
        }
    }
}
