//! Agreement before mutation, as a context makes it: in a world every collective first
//! exchanges the ranks' verdicts and fingerprints ([`world::agree`]), and a call whose
//! arguments the C boundary refused still takes part.

use serde_json::json;

use super::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::world;
use crate::log;
use crate::registry::TensorView;
use crate::timeline;
use crate::types::Memory;

impl Context {
    /// Agreement before mutation: outside a world `verdict` as it is; in a world the ranks'
    /// verdicts and the fingerprints of `call` and its `tensors` are exchanged, and every rank
    /// fails, nothing changed, unless all passed and match ([`world::agree`]). The call's text
    /// and tensor lines are made only in a world.
    pub(super) fn agree<T>(
        &self,
        verdict: &Result<T>,
        call: impl FnOnce() -> String,
        tensors: &[&TensorView],
    ) -> Result<()> {
        self.agree_world(verdict, call, tensors, Vec::new(), None)?;
        Ok(())
    }

    /// [`Context::agree`], with more lines of registrations (sparse gradients) after the
    /// tensors', and `inline`, this rank's data riding in its agreement record (decided alike
    /// on every rank: the fingerprints do not cover it). In a world every rank's records come
    /// back; `None` outside one.
    pub(super) fn agree_world<T>(
        &self,
        verdict: &Result<T>,
        call: impl FnOnce() -> String,
        tensors: &[&TensorView],
        more: Vec<String>,
        inline: Option<Vec<u8>>,
    ) -> std::result::Result<Option<world::Records>, world::Refused> {
        let verdict = verdict.as_ref().map(|_| ()).map_err(Clone::clone);
        let Some(ranks) = self.executor.ranks() else {
            return match verdict {
                Ok(()) => Ok(None),
                Err(error) => Err(world::Refused {
                    error,
                    same_call: false,
                    left: Vec::new(),
                }),
            };
        };

        let _span = timeline::span(
            self.trace.as_ref(),
            "agree",
            || json!({"tensors": tensors.len(), "inline": inline.is_some()}),
        );
        let call = call();
        if let Err(error) = self.check_member(&call) {
            return Err(world::Refused {
                error,
                same_call: false,
                left: Vec::new(),
            });
        }
        let verdict = verdict.and_then(|()| self.check_nothing_in_flight(&call));
        let mut lines: Vec<&str> = Vec::with_capacity(1 + tensors.len() + more.len());
        lines.push(&call);
        lines.extend(tensors.iter().map(|t| t.line.as_str()));
        lines.extend(more.iter().map(String::as_str));
        let step = ["dpsync_allreduce_grads", "dpsync_reduce_scatter_grads"];
        let agreed = world::agree(ranks, verdict, &lines, inline.as_deref());
        let early = self.early_buckets() > 0;
        if early && (agreed.is_err() || !step.iter().any(|s| call.starts_with(s))) {
            // Not the step of the buckets started early: what they wrote goes back.
            self.executor.hold_early();
        }
        if let Err(refused) = &agreed {
            // Taken out after the call (Context::world_call), once its own clean-up is done.
            self.membership.pending.lock().clone_from(&refused.left);
            if refused.error.kind == ErrorKind::Inconsistent {
                log::warn(|| {
                    format!(
                        "rank {}: {}: {}",
                        self.topology.rank, lines[0], refused.error.message
                    )
                });
            }
        }
        if agreed.is_ok() {
            self.keep_written(tensors);
        }
        agreed.map(Some)
    }

    /// A collective whose arguments the C boundary refused (`error`): in a world it still takes
    /// part in the agreement, so that every rank fails at once (the others with INCONSISTENT
    /// naming this rank) instead of waiting for this one until their timeout.
    pub fn refuse(&mut self, call: &str, error: Error) -> Result<()> {
        self.agree(
            &Err::<(), _>(error),
            || format!("{call}(arguments refused)"),
            &[],
        )
    }

    /// Whether a collective over `tensors` (that passed validation) sends its data inside its
    /// agreement: host memory, and every rank's replicas' bytes fit the record (decided from
    /// the replica counts every rank knows, so that every rank decides alike).
    pub(super) fn fits_inline(&self, tensors: &[&TensorView]) -> bool {
        let most = self
            .topology
            .replicas_per_rank
            .iter()
            .max()
            .copied()
            .unwrap_or(0);
        self.in_world()
            && !self.options.has_cuda_replicas()
            && tensors.iter().all(|t| t.memory == Memory::Host)
            && crate::exec::inline_bytes(tensors) * most <= world::INLINE
    }
}
