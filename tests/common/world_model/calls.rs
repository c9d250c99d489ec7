//! The calls the randomized tests draw ([`Call`]), the outcomes every rank expects
//! ([`Expect`]) and one rank's deviation from the common call ([`Dev`]).

use super::*;

#[derive(Clone, Debug)]
pub enum Call {
    Grads(u32),
    /// None: a NULL name.
    Allreduce(Option<String>, u32),
    Broadcast(u32, usize),
    Average(u32),
    BmufInit(f64, f64, bool),
    BmufStep,
    /// dpsync_reduce_scatter_grads(op).
    Scatter(u32),
    /// dpsync_allgather(roles).
    Allgather(u32),
}

impl Call {
    pub fn invoke(&self, ctx: &Context) -> dpsync_status {
        match self {
            Call::Grads(op) => ctx.allreduce_grads(*op),
            Call::Allreduce(Some(name), op) => ctx.allreduce(name, *op),
            // SAFETY: a valid context; NULL is the argument under test.
            Call::Allreduce(None, op) => unsafe { dpsync_allreduce(ctx.0, ptr::null(), *op) },
            Call::Broadcast(roles, root) => ctx.broadcast(*roles, *root),
            Call::Average(roles) => ctx.average(*roles),
            Call::BmufInit(lr, mu, nesterov) => ctx.bmuf_init(*lr, *mu, *nesterov),
            Call::BmufStep => ctx.bmuf_step(),
            // SAFETY: a valid context.
            Call::Scatter(op) => unsafe { dpsync_reduce_scatter_grads(ctx.0, *op) },
            // SAFETY: a valid context.
            Call::Allgather(roles) => unsafe { dpsync_allgather(ctx.0, *roles) },
        }
    }

    /// The function's name as the messages write it (`dpsync_allreduce(name`: not `_grads`).
    pub fn function(&self) -> &'static str {
        match self {
            Call::Grads(_) => "dpsync_allreduce_grads",
            Call::Allreduce(..) => "dpsync_allreduce(name",
            Call::Broadcast(..) => "dpsync_broadcast",
            Call::Average(_) => "dpsync_average",
            Call::BmufInit(..) => "dpsync_bmuf_init",
            Call::BmufStep => "dpsync_bmuf_step",
            Call::Scatter(_) => "dpsync_reduce_scatter_grads",
            Call::Allgather(_) => "dpsync_allgather",
        }
    }

    /// The same call with another op (reductions) or roles (broadcast, average).
    pub fn with(&self, x: u32) -> Call {
        match self {
            Call::Grads(_) => Call::Grads(x),
            Call::Allreduce(name, _) => Call::Allreduce(name.clone(), x),
            Call::Broadcast(_, root) => Call::Broadcast(x, *root),
            Call::Average(_) => Call::Average(x),
            Call::Scatter(_) => Call::Scatter(x),
            Call::Allgather(_) => Call::Allgather(x),
            _ => unreachable!("{self:?} has neither op nor roles"),
        }
    }

    /// The roles whose registrations the ranks compare for this call.
    pub fn involved(&self) -> u32 {
        match self {
            Call::Grads(_) | Call::Scatter(_) => GRAD,
            Call::Broadcast(roles, _) | Call::Average(roles) | Call::Allgather(roles) => *roles,
            Call::BmufInit(..) | Call::BmufStep => PARAM,
            Call::Allreduce(..) => 0,
        }
    }
}

/// World replica `w`'s piece of a tensor of `count` elements among `total` (dpsync_shard.h):
/// `(first element, elements)`.
pub fn piece(count: usize, w: usize, total: usize) -> (usize, usize) {
    let at = |w: usize| count * w / total;
    (at(w), at(w + 1) - at(w))
}

/// What every rank must see: success; one status (and message fragments) on every rank; or
/// rank `.0`'s own failure there, INCONSISTENT naming it and its status elsewhere.
#[derive(Clone, Debug, Default)]
pub enum Expect {
    #[default]
    Ok,
    All(dpsync_status, Vec<String>),
    Own(usize, dpsync_status, Vec<String>),
}

pub fn all(st: dpsync_status, needles: &[&str]) -> Expect {
    Expect::All(st, needles.iter().map(|s| s.to_string()).collect())
}

pub fn own(rank: usize, st: dpsync_status, needles: &[&str]) -> Expect {
    Expect::Own(rank, st, needles.iter().map(|s| s.to_string()).collect())
}

impl Expect {
    /// The status and message fragments rank `rank` must see.
    pub fn on(&self, rank: usize) -> (dpsync_status, Vec<String>) {
        let short = |s: &dpsync_status| format!("{s:?}").replace("DPSYNC_STATUS_", "");
        match self {
            Expect::Ok => (OK, vec![]),
            Expect::All(s, n) => (*s, n.clone()),
            Expect::Own(d, s, n) if *d == rank => (*s, n.clone()),
            Expect::Own(d, s, _) => (INCONSISTENT, vec![format!("rank {d}"), short(s)]),
        }
    }
}

/// Tensors registered for a deviation on this rank, undone after the call.
pub struct Temp {
    pub name: &'static str,
    pub bufs: Vec<Store>,
}

/// One rank's deviation from the common call.
#[derive(Default)]
pub struct Dev {
    pub class: &'static str,
    pub rank: usize,
    /// The deviating rank's call, when it makes another.
    pub call: Option<Call>,
    pub expect: Expect,
    pub temps: Vec<Temp>,
    /// Ranks that registered temporaries (their registrations are not the agreed ones).
    pub registered: Vec<usize>,
    /// The deviating rank registers a sparse gradient of its own.
    pub sparse_extra: bool,
    /// The deviating rank's GRADs disagree across its replicas: its marks fail.
    pub local_grad: bool,
    /// A bad index: (gradient, local replica, value) on the deviating rank.
    pub bad: Option<(usize, usize, i64)>,
}
