//! A world whose membership shrinks: ranks that leave (`dpsync_leave`, uneven inputs) and what
//! the others do when they learn of it at a collective's agreement: the world made again over
//! the remaining ranks (renumbered, recounted), then the call made again over it.

use serde_json::{json, Value};

use super::{create, Context};
use crate::backend::Ranks;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::world::{self, ranks_text};
use crate::log;
use crate::plan::WorldPlace;

/// Who this rank's world is made of now, against its creation.
#[derive(Default)]
pub(super) struct Membership {
    /// How many times the world changed since creation (`dpsync_world_epoch`).
    pub epoch: u64,
    /// This rank's number at creation.
    pub first_rank: usize,
    /// The creation rank of every present rank, in present rank order.
    pub creation: Vec<usize>,
    /// Ranks that left (`dpsync_leave`), by their rank at creation, ascending.
    pub left: Vec<usize>,
    /// Ranks lost (elastic worlds), by their rank at creation, ascending.
    pub lost: Vec<usize>,
    /// Why this context refuses collectives: it left its world, or the world could not be
    /// made again after others left.
    pub departed: Option<String>,
    /// Ranks (present numbers) that left at the last agreement, not yet taken out (set where
    /// the context is borrowed shared).
    pub pending: parking_lot::Mutex<Vec<usize>>,
    /// What the present call may write, kept to be put back on a loss (context/undo.rs).
    pub undo: parking_lot::Mutex<super::undo::Undo>,
}

impl Membership {
    pub fn new(rank: usize, ranks: usize) -> Membership {
        Membership {
            first_rank: rank,
            creation: (0..ranks).collect(),
            ..Membership::default()
        }
    }
}

impl Context {
    /// A collective call (`body`), made again when ranks left at its agreement and every
    /// remaining rank had passed it: then the world is first made over the remaining ranks.
    pub fn world_call(&mut self, body: impl FnMut(&mut Context) -> Result<()>) -> Result<()> {
        // An elastic world's NCCL clique outlives a failure until the vote (world.rs there).
        let held = self.options.elastic > 0 && self.topology.world_nccl.is_some();
        let hold = |ctx: &Context, on: bool| {
            if let Some(c) = ctx.executor.world_collective() {
                c.hold(on);
            }
        };
        if held {
            hold(self, true);
        }
        let outcome = self.world_calls(body, held);
        if held {
            hold(self, false);
        }
        outcome
    }

    /// The other ranks on this host, watched in the backend's waits on the device during the
    /// call (`held`): the present engine's, made again with each world (a rank that left may
    /// end its process once it left).
    fn watch_neighbours(&self, held: bool) {
        if let (true, Some(c), Some(ranks)) = (
            held,
            self.executor.world_collective(),
            self.executor.ranks(),
        ) {
            c.watch(ranks.neighbours());
        }
    }

    /// [`Context::world_call`]'s loop.
    fn world_calls(
        &mut self,
        mut body: impl FnMut(&mut Context) -> Result<()>,
        held: bool,
    ) -> Result<()> {
        loop {
            self.forget_undo();
            self.watch_neighbours(held);
            let outcome = body(self);
            let left = std::mem::take(&mut *self.membership.pending.lock());
            if !left.is_empty() {
                if let Err(e) = self.without(&left) {
                    self.membership.departed = Some(format!(
                        "the world could not be made again after {} left: {}",
                        ranks_text(&left),
                        e.message
                    ));
                    return Err(e);
                }
            }
            let outcome = match left.is_empty() {
                true => {
                    let outcome = self.device_done(outcome);
                    self.vote(outcome)
                }
                false => outcome,
            };
            self.forget_undo();
            match outcome {
                Err(e) if e.is_world_changed() => continue,
                outcome => return outcome,
            }
        }
    }

    /// An elastic world over an NCCL clique: the call's device work waited for before the vote
    /// (the host blocks until it completed). A collective in the clique whose peer dies after
    /// the call answered OK would otherwise leave its tensors half-written with nothing to
    /// undo them; waited for, its failure is the call's and the vote finds the loss. Like
    /// every wait on the device during the call, it watches the other ranks on this host
    /// (`WorldCollective::watch`).
    fn device_done(&self, outcome: Result<()>) -> Result<()> {
        if outcome.is_err() || self.options.elastic == 0 || self.topology.world_nccl.is_none() {
            return outcome;
        }
        match self.executor.streams() {
            Some(s) => s.wait_all().map_err(|e| s.collective_failed(e)),
            None => outcome,
        }
    }

    /// A vote found a loss, yet every rank survived: a rank's part of the call failed (a
    /// transfer, a timeout, its device). The world fails on every rank, as a plain world's
    /// does: each rank whose call failed answers its error, the others BACKEND_ERROR, not
    /// RANK_LOST (the world does not go on). What the call wrote is put back where it can be.
    fn failed_alike(&mut self, outcome: Result<()>) -> Result<()> {
        // The context fails whatever comes of the undo.
        let _ = self.undo_written();
        // The engine says why the vote found a loss, where that is not this call's error.
        let failed = self
            .executor
            .ranks()
            .map(|r| r.describe()["failed"].clone());
        let why = match (failed, &outcome) {
            (Some(Value::String(why)), Err(e)) if why.contains(&e.message) => String::new(),
            (Some(Value::String(why)), _) => format!("{why}; "),
            _ => String::new(),
        };
        let mut e = outcome.err().unwrap_or_else(|| {
            Error::new(ErrorKind::Backend, "the call failed on a rank of the world")
        });
        e.message = format!(
            "{} ({why}every rank survived; this world is failed)",
            e.message
        );
        self.membership.departed = Some(e.message.clone());
        Err(e)
    }

    /// An elastic world's end of a call: the survivors vote on whether a rank was lost (alike
    /// on all of them); if so the world is made again over them and the call answers
    /// RANK_LOST, its GRAD tensors to be computed again and the call made again.
    pub(super) fn vote(&mut self, outcome: Result<()>) -> Result<()> {
        let Some(ranks) = self.executor.ranks() else {
            return outcome;
        };
        if self.membership.departed.is_some() {
            // Left (or failed): no world to vote in. A leaver's `dpsync_leave` began a call
            // that never voted, and a vote now would wait alone on the old communicator.
            return outcome;
        }
        // A failure of this rank's own part after the agreement (its device, the watch of the
        // other ranks' processes) is voted a loss; a refusal is alike on every rank.
        let here = match &outcome {
            Err(e) if matches!(e.kind, ErrorKind::Backend | ErrorKind::Timeout) => {
                Some(e.message.as_str())
            }
            _ => None,
        };
        let lost = match ranks.vote_lost(here) {
            Ok(None | Some(false)) => return outcome,
            Ok(Some(true)) => ranks.shrunk(),
            Err(e) => Err(e),
        };
        if let Some(c) = self.executor.world_collective() {
            c.watch(Vec::new()); // the dead are known: the drains below must not fail on them
        }
        if matches!(&lost, Ok((_, gone)) if gone.is_empty()) {
            return self.failed_alike(outcome);
        }
        if let Ok((_, gone)) = &lost {
            if !gone.is_empty() && self.topology.world_size - gone.len() >= self.options.elastic {
                self.shrink_collective(gone);
            }
        }
        // Every survivor voted alike: none keeps what the call wrote (BMUF's state included,
        // before its recount below).
        if let Err(e) = self.undo_written() {
            let why = format!(
                "a rank was lost, and what the call wrote could not be put back: {}",
                e.message
            );
            self.membership.departed = Some(why);
            return Err(e);
        }
        let fail = |ctx: &mut Context, why: String| {
            ctx.membership.departed = Some(why.clone());
            Err(Error::new(ErrorKind::RankLost, why))
        };
        let (engine, lost) = match lost {
            Ok(shrunk) => shrunk,
            Err(e) => {
                let why = format!(
                    "the world could not be made again after a loss: {}",
                    e.message
                );
                self.membership.departed = Some(why);
                return Err(e);
            }
        };
        let before = self.topology.world_size;
        let named = ranks_text(&lost);
        let remain = before - lost.len();
        if remain < self.options.elastic {
            let gone: Vec<usize> = lost.iter().map(|&r| self.creation(r)).collect();
            self.note_change("lost", &gone);
            return fail(
                self,
                format!(
                    "{named} (numbers before the loss) lost; {remain} ranks remain, fewer than \
                     the world's min_ranks {} (dpsync_options_set_elastic): this context is \
                     failed",
                    self.options.elastic
                ),
            );
        }
        if let Err(e) = self.rebuild(engine, &lost, "lost") {
            return fail(
                self,
                format!(
                    "{named} lost, and the world could not be made again: {}",
                    e.message
                ),
            );
        }
        Err(Error::new(
            ErrorKind::RankLost,
            format!(
                "{named} (numbers before the loss) lost; the world goes on with {remain} ranks \
                 (epoch {}): compute this step's gradients again and make the call again",
                self.membership.epoch
            ),
        ))
    }

    /// The NCCL clique shrunk over the survivors, `gone` (ranks before the loss) excluded,
    /// before the streams are drained: the shrink ends what waits on the dead. Where NCCL
    /// cannot, the rebuild makes a new clique.
    fn shrink_collective(&self, gone: &[usize]) {
        let (Some(groups), Some(c)) = (&self.topology.world_nccl, self.executor.world_collective())
        else {
            return;
        };
        let lost: Vec<usize> = gone.iter().flat_map(|&r| groups.ranks_of(r)).collect();
        c.shrink(&lost, groups.total());
    }

    /// Refuses a collective on a context that left its world.
    pub(super) fn check_member(&self, call: &str) -> Result<()> {
        match &self.membership.departed {
            None => Ok(()),
            Some(why) => Err(Error::new(
                ErrorKind::InvalidState,
                format!("{call}: {why}: this context refuses collectives (queries still work)"),
            )),
        }
    }

    /// `dpsync_leave`: this rank's part in the others' next collective, as a rank that leaves;
    /// returns once they agreed on it. The context then refuses collectives.
    pub fn leave(&mut self) -> Result<()> {
        self.check_member("dpsync_leave")?;
        let Some(ranks) = self.executor.ranks() else {
            return Err(Error::new(
                ErrorKind::InvalidState,
                "dpsync_leave: this context has no world (dpsync_options_set_world_mpi): there \
                 is no other rank to leave",
            ));
        };
        let departure = world::leave(ranks)?;
        if departure.step {
            // The others' gradient step drains the buckets some of them started early; this
            // rank's stand-ins complete them.
            let (_, plan) = self.prepare();
            if let Err(e) = self.drain_world_buckets(&plan) {
                log::warn(|| format!("dpsync_leave: draining the early buckets: {}", e.message));
            }
        }
        self.overlap.forget();
        self.executor.leave_collective();
        let left: Vec<usize> = departure.left.iter().map(|&r| self.creation(r)).collect();
        let me = self.membership.first_rank;
        self.note_change("left", &left);
        self.membership.departed = Some(format!("rank {me} (at creation) left its world"));
        Ok(())
    }

    /// `dpsync_world_epoch`: how often the world changed, and this rank's number at creation.
    pub fn world_epoch(&self) -> (u64, usize) {
        (self.membership.epoch, self.membership.first_rank)
    }

    /// What `dpsync_describe`'s "world" object adds: "elastic", "epoch", "lost", "left".
    pub(super) fn describe_membership(&self, world: &mut Value) {
        world["elastic"] = self.options.elastic.into();
        world["epoch"] = self.membership.epoch.into();
        world["first_rank"] = self.membership.first_rank.into();
        world["lost"] = self.membership.lost.clone().into();
        world["left"] = self.membership.left.clone().into();
        if let Some(why) = &self.membership.departed {
            world["departed"] = why.clone().into();
        }
    }

    /// The creation rank of present rank `r`.
    fn creation(&self, r: usize) -> usize {
        self.membership.creation.get(r).copied().unwrap_or(r)
    }

    /// The epoch grows, the change is logged and traced.
    fn note_change(&mut self, what: &str, ranks: &[usize]) {
        let m = &mut self.membership;
        m.epoch += 1;
        let list = match what {
            "left" => &mut m.left,
            _ => &mut m.lost,
        };
        list.extend_from_slice(ranks);
        list.sort_unstable();
        let (epoch, me) = (m.epoch, m.first_rank);
        log::info(|| {
            format!(
                "rank {me} (at creation): world epoch {epoch}: {} (at creation) {what}; {} \
                 ranks remain",
                ranks_text(ranks),
                self.topology.world_size
            )
        });
        if let Some(t) = &self.trace {
            t.instant("world_changed", json!({"epoch": epoch, what: ranks}));
        }
    }

    /// The remaining ranks make their world again without `left` (present numbers): a new
    /// engine over them, their replicas settled anew (and the NCCL clique rebuilt where there
    /// was one), the topology renumbered and recounted; what was planned or started for the
    /// old world is forgotten.
    fn without(&mut self, left: &[usize]) -> Result<()> {
        let ranks = (self.executor.ranks()).expect("ranks leave only a world");
        let engine = ranks.without(left)?;
        self.rebuild(engine, left, "left")
    }

    /// The world made again over `engine`'s ranks, those of the old one but `gone` (old
    /// numbers), which `what` ("left" or "lost").
    fn rebuild(&mut self, engine: Box<dyn Ranks>, gone: &[usize], what: &str) -> Result<()> {
        let left = gone;
        let local = create::world_part(
            &self.topology,
            self.executor.backend(),
            engine.rank() == 0,
            self.options.transport,
        );
        let settled = world::settle(&*engine, &self.options, local)?;
        self.executor.leave_collective();
        let mut nccl = None;
        if let (Some(joint), Some(c)) = (&settled.collective, self.executor.world_collective()) {
            if world::join_collective(&*engine, c, joint, self.options.transport)? {
                nccl = Some(joint.0.clone());
            }
        }
        let creation: Vec<usize> = (0..self.membership.creation.len())
            .filter(|r| !left.contains(r))
            .map(|r| self.creation(r))
            .collect();
        let gone: Vec<usize> = left.iter().map(|&r| self.creation(r)).collect();
        self.topology = self.topology.clone().in_world(WorldPlace {
            rank: engine.rank(),
            size: engine.ranks(),
            replicas_per_rank: settled.per_rank,
            nccl,
        });
        self.executor.rejoin(&self.topology, engine);
        self.membership.creation = creation;
        self.prepared = None;
        self.overlap.forget();
        // Nothing starts early until a step succeeds in the new world.
        self.overlap.agreed = None;
        let replicas = self.topology.world_replicas();
        if let Some(state) = self.bmuf.as_mut() {
            state.recount(replicas);
        }
        self.note_change(what, &gone);
        Ok(())
    }
}
