//! A context: the options it was made with, the topology, the registry, the cached plan and the
//! executor. This is the whole library seen from Rust; `ffi` only translates C calls into it.

mod agreement;
mod create;
mod elastic;
mod overlap;
mod shard;
mod sparse;
mod undo;

use shard::Shape;

use std::borrow::Cow;
use std::sync::Arc;

use crate::backend::Channel;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::bmuf::{self, BmufState};
use crate::exec::{Executor, SparseOutputs};
use crate::log;
use crate::options::Options;
use crate::plan::{self, Bucket, Levels, Plan, Topology};
use crate::registry::sparse::SparseRegistry;
use crate::registry::{self, Registration, Registry, Snapshot, TensorView};
use crate::timeline::{self, Tracer};
use crate::types::{DType, Device, Memory, ReduceOp, Role, RoleMask};
use serde_json::json;

pub struct Context {
    options: Options,
    topology: Topology,
    registry: Registry,
    /// Registry checked and planned at one generation; rebuilt lazily after (un)registration.
    prepared: Option<(Arc<Snapshot>, Arc<Plan>)>,
    executor: Executor,
    /// The BMUF filter since the last dpsync_bmuf_init.
    bmuf: Option<BmufState>,
    /// Sparse gradients and their slices for the coming step (context/sparse.rs).
    sparse: SparseRegistry,
    /// The last successful step's gathered sparse slices.
    sparse_out: SparseOutputs,
    /// This step's `dpsync_grad_ready` marks and the buckets they reduced (context/overlap.rs).
    overlap: overlap::Overlap,
    /// The timeline (`DPSYNC_TIMELINE`), or `None`.
    trace: Option<Tracer>,
    /// Who the world is made of now (context/elastic.rs).
    membership: elastic::Membership,
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Some(t) = &self.trace {
            t.flush();
        }
    }
}

/// The description of the options' topology with no tensors and no device: a dry run.
pub fn plan_describe(options: &Options) -> Result<String> {
    let topology = Topology::from_options(options)?;
    let snapshot = Registry::new(topology.replicas()).snapshot();
    let plan = Plan::new(&snapshot, options.fusion_bytes);
    let levels = Levels::new(&topology);
    let mut json = plan::describe(&topology, &levels, &plan, &snapshot, options.fusion_bytes);
    sparse::describe_into(
        &mut json,
        &SparseRegistry::new(topology.replicas()),
        options,
    );
    Ok(json.to_string())
}

impl Context {
    pub fn new(options: &Options) -> Result<Context> {
        let create::Created {
            topology,
            backend,
            ranks,
        } = create::create(options)?;
        let trace = Tracer::for_context(
            topology.rank,
            &match topology.world_size {
                1 => format!("dpsync (process {})", std::process::id()),
                n => format!("dpsync rank {} of {n}", topology.rank),
            },
            &format!(
                "{} replicas, transport {}",
                topology.replicas(),
                topology.transport.name()
            ),
        );
        let mut executor = Executor::new(backend, &topology, ranks);
        create::log_creation(options, &topology, &executor.levels().route);
        executor.set_tracer(trace.clone());
        Ok(Context {
            membership: elastic::Membership::new(topology.rank, topology.world_size),
            options: options.clone(),
            registry: Registry::new(topology.replicas()),
            sparse: SparseRegistry::new(topology.replicas()),
            sparse_out: SparseOutputs::default(),
            executor,
            trace,
            topology,
            prepared: None,
            bmuf: None,
            overlap: overlap::Overlap::default(),
        })
    }

    pub fn replica_count(&self) -> usize {
        self.topology.replicas()
    }

    /// This process's rank and the number of ranks (0 and 1 outside a world).
    pub fn rank(&self) -> (usize, usize) {
        (self.topology.rank, self.topology.world_size)
    }

    /// Replicas in the whole world, and the world index of this process's replica 0.
    pub fn world_replicas(&self) -> (usize, usize) {
        (self.topology.world_replicas(), self.topology.world_offset())
    }

    /// 1 / replicas in the world: the loss factor that turns a SUM of gradients into a mean.
    pub fn loss_scale(&self) -> f64 {
        1.0 / self.topology.world_replicas() as f64
    }

    fn check_replica(&self, replica: usize, argument: &str) -> Result<()> {
        registry::check_replica(replica, self.replica_count(), argument)
    }

    /// [`Context::check_replica`] for a call on one tensor (`what` 'name'): the message names it.
    fn check_replica_of(&self, what: &str, name: &str, replica: usize) -> Result<()> {
        self.check_replica(replica, "replica").map_err(|mut e| {
            e.message = format!("{what} '{name}': {}", e.message);
            e
        })
    }

    pub fn set_stream(&mut self, replica: usize, stream: usize) -> Result<()> {
        self.check_replica(replica, "replica")?;
        self.executor.set_stream(replica, stream)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.executor.synchronize()
    }

    pub fn register(
        &mut self,
        name: &str,
        role: Role,
        replica: usize,
        ptr: usize,
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        self.check_replica_of("tensor", name, replica)?;
        let memory = match self.topology.devices[replica] {
            Device::Host => Memory::Host,
            Device::Cuda(_) => self.executor.memory_of(replica, ptr).map_err(|mut e| {
                // The same error (its kind, out of memory or not), named.
                e.message = format!("tensor '{name}': data: {}", e.message);
                e
            })?,
        };
        self.check_not_sparse(name)?;
        let reg = Registration {
            role,
            ptr,
            count,
            dtype,
            memory,
        };
        // An identical registration is a no-op, also mid-step.
        if self.registry.registered_as(name, replica) != Some(&reg) {
            self.check_not_mid_step(name, "register")?;
        }
        self.registry.register(name, replica, reg)
    }

    pub fn unregister(&mut self, name: &str) -> Result<()> {
        if self.unregister_sparse(name) {
            return Ok(());
        }
        if self.registry.contains(name) {
            self.check_not_mid_step(name, "unregister")?;
        }
        self.registry.unregister(name)
    }

    /// The checked registry and its plan for the current generation.
    fn prepare(&mut self) -> (Arc<Snapshot>, Arc<Plan>) {
        let generation = self.registry.generation();
        match &self.prepared {
            Some((s, p)) if s.generation == generation => (s.clone(), p.clone()),
            _ => {
                let snapshot = Arc::new(self.registry.snapshot());
                let plan = Arc::new(Plan::new(&snapshot, self.options.fusion_bytes));
                log::debug(|| {
                    format!(
                        "plan rebuilt (registry generation {}): {} tensors, {} gradient \
                         buckets of at most {} bytes",
                        snapshot.generation,
                        snapshot.tensors.len(),
                        plan.buckets.len(),
                        self.options.fusion_bytes
                    )
                });
                self.prepared = Some((snapshot.clone(), plan.clone()));
                (snapshot, plan)
            }
        }
    }

    pub fn describe(&mut self) -> String {
        let (snapshot, plan) = self.prepare();
        let levels = self.executor.levels();
        let mut json = plan::describe(
            &self.topology,
            levels,
            &plan,
            &snapshot,
            self.options.fusion_bytes,
        );
        sparse::describe_into(&mut json, &self.sparse, &self.options);
        json["sparse_last_step"] = sparse::describe_stats(&self.sparse_out.stats);
        json["overlap"] = self.describe_overlap();
        json["backend"] = self.executor.describe_backend();
        if let Some(state) = &self.bmuf {
            json["bmuf"] = state.describe();
        }
        if let Some(ranks) = self.executor.ranks() {
            let mut world = ranks.describe();
            world["rank"] = self.topology.rank.into();
            world["ranks"] = self.topology.world_size.into();
            world["replicas_per_rank"] = self.topology.replicas_per_rank.clone().into();
            world["cross_rank"] = levels.route.name().into();
            self.describe_membership(&mut world);
            json["world"] = world;
        }
        json.to_string()
    }

    /// Whether this context spans a world of processes.
    pub fn in_world(&self) -> bool {
        self.executor.ranks().is_some()
    }

    fn divisor(&self) -> usize {
        self.topology.world_replicas()
    }

    pub fn allreduce_grads(&mut self, op: ReduceOp) -> Result<()> {
        self.reduce_grads(op, Shape::Allreduce)
    }

    /// A gradient step: `dpsync_allreduce_grads`, or `dpsync_reduce_scatter_grads`
    /// (context/shard.rs), which differs only in what its dense buckets write.
    fn reduce_grads(&mut self, op: ReduceOp, shape: Shape) -> Result<()> {
        let call = shape.call();
        let _call = timeline::span(
            self.trace.as_ref(),
            call,
            || json!({"op": format!("{op:?}")}),
        );
        let (snapshot, plan) = self.prepare();
        let tensors: Vec<&TensorView> = snapshot.tensors.iter().collect();
        // Buckets dpsync_grad_ready reduced this step are not reduced again (context/overlap.rs).
        let split = self.split_buckets(&plan, &tensors, op);
        // Everything checked before any byte moves (in a world, before the agreement): the
        // dense GRADs, the early buckets' op (and shape), then this step's sparse slices (set
        // everywhere, indices in range).
        let verdict = (snapshot.grads_to_reduce())
            .and_then(|()| split.as_ref().map(drop).map_err(Clone::clone))
            .and_then(|()| self.check_shape(shape))
            .and_then(|()| self.sparse_step());
        if verdict.is_ok()
            && self.sparse.is_empty()
            && !tensors.iter().any(|t| t.role == Role::Grad)
        {
            log::warn(|| {
                format!(
                    "{call}: no GRAD tensor is registered, so there is nothing to reduce \
                 (gradients are registered with DPSYNC_ROLE_GRAD)"
                )
            });
        }
        let mut lines: Vec<&TensorView> = Vec::new();
        if self.in_world() {
            lines.extend(snapshot.tensors.iter().filter(|t| t.role == Role::Grad));
        }
        let sparse_lines = match &verdict {
            Ok(step) if self.in_world() => Self::sparse_lines(step),
            _ => Vec::new(),
        };
        // What the others must know of this rank's step (context/overlap.rs, "Worlds").
        let inline = match &verdict {
            Ok(step) if self.in_world() => Some(self.step_record(step)),
            _ => None,
        };
        let records = match self.agree_world(
            &verdict,
            || format!("{call}(op={op:?})"),
            &lines,
            sparse_lines,
            inline,
        ) {
            Ok(records) => records,
            Err(refused) => {
                // Every rank failed alike; when every rank was in this call, the buckets some
                // started early are matched and dropped (otherwise they stay for the next step).
                if refused.same_call {
                    if let Err(d) = self.drain_world_buckets(&plan) {
                        // The world failed meanwhile (the engine refuses from now on): the
                        // agreement's error is the one to report.
                        log::warn(|| format!("draining the early buckets: {}", d.message));
                    }
                }
                return Err(refused.error);
            }
        };
        let mut step = verdict?;
        let (left, summed) = match records {
            // Every rank starts what any rank started early, and gathers with the index
            // groups every rank can use.
            Some(records) => self.settle_world_step(&records, &mut step, &plan, &tensors, op)?,
            None => split?,
        };
        let started = self.take_started();
        // Buckets reduce-scattered early that an allreduce step completes.
        let scattered = match shape {
            Shape::Allreduce => self.early_scattered(&plan, &tensors),
            Shape::ReduceScatter => Vec::new(),
        };
        let buckets: Cow<'_, [Bucket]> = if left.len() == plan.buckets.len() {
            Cow::Borrowed(&plan.buckets)
        } else {
            Cow::Owned(left.iter().map(|&b| plan.buckets[b].clone()).collect())
        };
        // Sparse slices are gathered into new library-owned outputs first, the early buckets'
        // results written only then: a failed gather leaves every tensor as it was. On CUDA
        // replicas both run as one collective, in stream order.
        let done = self.executor.bracket(|| {
            let sparse = match self.gather_sparse(&step, op) {
                Ok(sparse) => sparse,
                Err(e) => {
                    if let Err(d) = self.executor.drain_early(started, &[]) {
                        log::warn(|| format!("draining the early buckets: {}", d.message));
                    }
                    return Err(e);
                }
            };
            // SAFETY: registered memory stays valid while registered (the C contract).
            let dense = self
                .finish_world_buckets(started, &snapshot.tensors, (&plan, shape))
                .and_then(|()| unsafe {
                    match shape {
                        Shape::Allreduce => (self.executor).allreduce_buckets(
                            &buckets,
                            &tensors,
                            op,
                            self.divisor(),
                            Channel::Steps,
                        ),
                        Shape::ReduceScatter => (self.executor).reduce_scatter_buckets(
                            &buckets,
                            &tensors,
                            op,
                            self.divisor(),
                            self.place(),
                        ),
                    }
                    .and_then(|()| match scattered.is_empty() {
                        true => Ok(()),
                        false => self.gather_pieces(&scattered),
                    })
                    .and_then(|()| {
                        let scatter = (shape == Shape::ReduceScatter).then(|| self.place());
                        self.executor.divide(&summed, self.divisor(), scatter)
                    })
                });
            if let Err(e) = dense {
                // Queued copies may still write the new outputs: freed when they are done.
                self.executor.retire_outputs(sparse);
                return Err(e);
            }
            Ok(sparse)
        });
        match done {
            Ok(sparse) => {
                self.install_sparse(sparse);
                self.end_overlap_step(op, shape, snapshot.generation);
                Ok(())
            }
            Err(e) => {
                // The step's early transfers are gone (drained or finished): the next step
                // starts afresh.
                self.overlap.forget();
                Err(e)
            }
        }
    }

    pub fn allreduce(&mut self, name: &str, op: ReduceOp) -> Result<()> {
        let _call = timeline::span(
            self.trace.as_ref(),
            "dpsync_allreduce",
            || json!({"name": name, "op": format!("{op:?}")}),
        );
        let (snapshot, _) = self.prepare();
        let tensor = if self.sparse.contains(name) {
            Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "tensor '{name}' is not a dense tensor: it is a sparse gradient, gathered by \
                     dpsync_allreduce_grads"
                ),
            ))
        } else {
            snapshot.lookup(name)
        };
        let involved: Vec<&TensorView> = tensor.iter().copied().collect();
        // SAFETY: registered memory stays valid while registered (the C contract).
        let inline = (tensor.is_ok() && self.fits_inline(&involved))
            .then(|| unsafe { self.executor.inline_data(&involved) });
        let small = inline.is_some();
        let records = self.agree_world(
            &tensor,
            || format!("dpsync_allreduce(name='{name}', op={op:?})"),
            &involved,
            Vec::new(),
            inline,
        )?;
        let tensor = tensor?;
        // SAFETY: as in allreduce_grads.
        unsafe {
            match records {
                Some(records) if small => self.executor.allreduce_inline(
                    &[tensor],
                    op,
                    self.divisor(),
                    records,
                    &self.topology.replicas_per_rank,
                ),
                _ => (self.executor).allreduce(
                    &[tensor],
                    op,
                    self.divisor(),
                    self.options.fusion_bytes,
                ),
            }
        }
    }

    /// `root` is a world replica index (rank offsets first; the local index outside a world).
    pub fn broadcast(&mut self, roles: RoleMask, root: usize) -> Result<()> {
        let _call = timeline::span(
            self.trace.as_ref(),
            "dpsync_broadcast",
            || json!({"roles": roles.bits(), "root": root}),
        );
        let (snapshot, _) = self.prepare();
        let world_replicas = self.topology.world_replicas();
        let selected = registry::check_replica(root, world_replicas, "root_replica")
            .and_then(|()| snapshot.select(roles));
        let involved = selected.as_deref().unwrap_or_default();
        self.agree(
            &selected,
            || format!("dpsync_broadcast(roles={:#x}, root={root})", roles.bits()),
            involved,
        )?;
        let tensors = selected?;
        let (root_rank, local) = self.topology.locate(root);
        // SAFETY: as in allreduce_grads.
        unsafe {
            self.executor
                .broadcast(&tensors, root_rank, local, self.options.fusion_bytes)
        }
    }

    pub fn average(&mut self, roles: RoleMask) -> Result<()> {
        let _call = timeline::span(
            self.trace.as_ref(),
            "dpsync_average",
            || json!({"roles": roles.bits()}),
        );
        let (snapshot, _) = self.prepare();
        let selected = snapshot.select(roles);
        self.agree(
            &selected,
            || format!("dpsync_average(roles={:#x})", roles.bits()),
            selected.as_deref().unwrap_or_default(),
        )?;
        let tensors = selected?;
        // SAFETY: as in allreduce_grads.
        unsafe {
            self.executor.allreduce(
                &tensors,
                ReduceOp::Avg,
                self.divisor(),
                self.options.fusion_bytes,
            )
        }
    }

    /// Starts (or restarts) BMUF over the PARAM tensors. Everything is checked and the state
    /// allocated before world replica 0's params are broadcast (in a world, every rank agrees
    /// first), and the previous filter is kept when anything fails.
    pub fn bmuf_init(&mut self, block_lr: f64, block_momentum: f64, nesterov: bool) -> Result<()> {
        let _call = timeline::span(self.trace.as_ref(), "dpsync_bmuf_init", || json!({}));
        let (snapshot, _) = self.prepare();
        let params = bmuf::params_to_filter(&snapshot);
        let state = bmuf::filter(
            block_lr,
            block_momentum,
            nesterov,
            self.topology.world_replicas(),
        )
        .and_then(|filter| {
            let params = params.as_deref().map_err(Clone::clone)?;
            let (generation, fusion) = (snapshot.generation, self.options.fusion_bytes);
            self.executor
                .bmuf_prepare(filter, params, generation, fusion)
        });
        self.agree(
            &state,
            || format!("dpsync_bmuf_init(block_lr={block_lr}, block_momentum={block_momentum}, nesterov={nesterov})"),
            params.as_deref().unwrap_or_default(),
        )?;
        let state = state?;
        // SAFETY: as in allreduce_grads.
        unsafe {
            self.executor
                .bmuf_start(&state, self.options.fusion_bytes)?
        };
        self.bmuf = Some(state);
        Ok(())
    }

    pub fn bmuf_step(&mut self) -> Result<()> {
        let _call = timeline::span(self.trace.as_ref(), "dpsync_bmuf_step", || json!({}));
        let (snapshot, _) = self.prepare();
        let divisor = self.divisor();
        let verdict = match self.bmuf.as_mut() {
            None => Err(bmuf::not_started()),
            Some(state) => state.check_params(&snapshot),
        };
        let params = match self.in_world() {
            true => snapshot.select(Role::Param.into()).unwrap_or_default(),
            false => Vec::new(),
        };
        self.agree(&verdict, || "dpsync_bmuf_step()".to_owned(), &params)?;
        let state = self.bmuf.as_ref().ok_or_else(bmuf::not_started)?;
        // The filter's state lives where the replicas do.
        let memory = match self.options.has_cuda_replicas() {
            true => Memory::Device,
            false => Memory::Host,
        };
        if self.keeps_undo() {
            let regions = state.regions().into_iter();
            self.keep_regions(regions.map(|(k, p, bytes)| (k, p, bytes, memory)).collect());
        }
        // SAFETY: as in allreduce_grads; check_params vouches for the state's pointers.
        unsafe { self.executor.bmuf_step(state, divisor) }
    }
}
