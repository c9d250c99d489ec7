//! What the ranks of a world settle between them before they move data, over the engine's
//! [`Ranks::allgather`]: at context creation the options that must agree and every rank's
//! replica count ([`settle`]); before every collective, that all of them passed validation and
//! make the same call over the same registrations ([`agree`]).

use serde_json::{json, Value};

use crate::backend::{Ranks, WorldCollective};
use crate::error::{status_name, Error, Result};
use crate::log;
use crate::options::Options;
use crate::plan::WorldGroups;
use crate::types::Transport;

/// The options every rank must share, as `(name, value)`, in the order they are compared.
fn shared_options(options: &Options) -> Value {
    json!([
        ["transport", options.transport.name()],
        ["fusion_bytes", options.fusion_bytes],
        ["timeout_ms", options.timeout()],
        ["sparse_coalesce", options.sparse_coalesce],
        ["reproducible", options.reproducible],
        ["elastic", options.elastic],
    ])
}

/// "ranks 0, 2" / "rank 1".
pub(crate) fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// What a rank brings to its world at creation.
pub struct Local {
    pub replicas: usize,
    /// Where the backend can join a collective across the ranks (NCCL): each local replica's
    /// device group, and on rank 0 the clique's id.
    pub collective: Option<(Vec<usize>, Option<Vec<u8>>)>,
}

/// What the ranks settled at creation.
pub struct Settled {
    /// Local replicas of every rank, in rank order.
    pub per_rank: Vec<usize>,
    /// Where every rank can join a collective across the ranks: their groups and rank 0's id.
    pub collective: Option<(WorldGroups, Vec<u8>)>,
}

/// Context creation: every rank's replica count (and device groups), in rank order, once every
/// rank made its own part (`local`, or why it failed) and the options that must agree do.
/// Otherwise every rank fails: a failed rank with its own error, the others INCONSISTENT naming
/// it; disagreeing options INCONSISTENT naming the option and the ranks.
pub fn settle(ranks: &dyn Ranks, options: &Options, local: Result<Local>) -> Result<Settled> {
    let (groups, id) = match local.as_ref().ok().and_then(|l| l.collective.as_ref()) {
        Some((groups, id)) => (Some(groups), id.as_deref().map(hex)),
        None => (None, None),
    };
    let mine = json!({
        "replicas": local.as_ref().ok().map(|l| l.replicas),
        "status": local.as_ref().err().map(|e| e.kind.code()),
        "error": local.as_ref().err().map(|e| e.message.clone()),
        "options": shared_options(options),
        "groups": groups,
        "id": id,
    });
    let all: Vec<Value> = ranks
        .allgather(mine.to_string().as_bytes())?
        .iter()
        .map(|b| serde_json::from_slice(b).unwrap_or(Value::Null))
        .collect();
    local?;
    if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| !v["status"].is_null()) {
        let kind = (v["status"].as_u64())
            .and_then(|c| status_name(c as u32))
            .unwrap_or("an error");
        return Err(Error::inconsistent(format!(
            "dpsync_context_create: rank {r} could not create its part of the world ({kind}: \
             {}); no context was created on any rank",
            v["error"].as_str().unwrap_or("?")
        )));
    }
    let options_of = |r: usize| all[r]["options"].as_array().cloned().unwrap_or_default();
    for (i, option) in options_of(0).iter().enumerate() {
        // Ranks grouped by their value of this option, in order of first appearance.
        let mut groups: Vec<(Value, Vec<usize>)> = Vec::new();
        for r in 0..all.len() {
            let value = options_of(r).get(i).map_or(Value::Null, |o| o[1].clone());
            match groups.iter_mut().find(|(v, _)| *v == value) {
                Some((_, members)) => members.push(r),
                None => groups.push((value, vec![r])),
            }
        }
        if groups.len() > 1 {
            let parts: Vec<String> = (groups.iter())
                .map(|(v, members)| format!("{v} on {}", ranks_text(members)))
                .collect();
            return Err(Error::inconsistent(format!(
                "dpsync_context_create: the ranks' options disagree: {} is {}",
                option[0].as_str().unwrap_or("?"),
                parts.join(", ")
            )));
        }
    }
    let group_of: Option<Vec<Vec<usize>>> = (all.iter())
        .map(|v| serde_json::from_value(v["groups"].clone()).ok())
        .collect();
    let id = all[0]["id"].as_str().and_then(unhex);
    Ok(Settled {
        per_rank: (all.iter())
            .map(|v| v["replicas"].as_u64().unwrap_or(0) as usize)
            .collect(),
        collective: group_of
            .zip(id)
            .map(|(g, id)| (WorldGroups { group_of: g }, id)),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Joins the backend's collective across the ranks (NCCL over every rank's device groups), in
/// two steps each followed by an exchange of outcomes, so that no rank waits for a clique
/// another rank failed to issue. Whether it was joined: a failure on any rank makes every rank
/// leave it; then transport AUTO goes on staged through the engine (a warning says why), and
/// NCCL asked for fails creation on every rank (a failed rank with its own error, the others
/// INCONSISTENT naming it).
pub fn join_collective(
    ranks: &dyn Ranks,
    collective: &dyn WorldCollective,
    (groups, id): &(WorldGroups, Vec<u8>),
    transport: Transport,
) -> Result<bool> {
    let (first, total) = (groups.first(ranks.rank()), groups.total());
    // The clique shrunk after a loss, where every rank holds its part (a shrink that failed on
    // one leaves the others' waiting for it): else a new one.
    let shrunk = collective.shrunk(first, total);
    let shrunk = (ranks.allgather(&[shrunk as u8])?.iter()).all(|b| b[..] == [1]);
    let mut outcome = collective.issue(id, first, total, shrunk);
    let mut failed = outcomes(ranks, &outcome, "issuing")?;
    if failed.is_none() {
        outcome = collective.ready();
        failed = outcomes(ranks, &outcome, "waiting for")?;
    }
    let Some((rank, why)) = failed else {
        return Ok(true);
    };
    collective.leave();
    if transport == Transport::Nccl {
        outcome?;
        return Err(Error::inconsistent(format!(
            "dpsync_context_create: rank {rank} could not join NCCL across the ranks ({why});              no context was created on any rank"
        )));
    }
    log::warn(|| {
        format!("NCCL is not used across the ranks: rank {rank}: {why}; staging through MPI")
    });
    Ok(false)
}

/// Every rank's outcome of one step of [`join_collective`]: the first failed rank and why.
fn outcomes(
    ranks: &dyn Ranks,
    outcome: &Result<()>,
    step: &str,
) -> Result<Option<(usize, String)>> {
    let mine = json!(outcome.as_ref().err().map(|e| e.message.clone()));
    let all = ranks.allgather(mine.to_string().as_bytes())?;
    Ok(all.iter().enumerate().find_map(|(r, b)| {
        let v: Value = serde_json::from_slice(b).unwrap_or(Value::Null);
        v.as_str()
            .map(|e| (r, format!("{step} its NCCL communicators: {e}")))
    }))
}

/// A 64-bit hash of the lines, the same on every rank for the same lines whatever the build: 8
/// bytes at a time (a byte-wise hash cost a tenth of a small collective), each line's length
/// after its bytes. Each step is a bijection of the state, so lines that differ in one word
/// never collide.
fn fingerprint(lines: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |w: u64| h = (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    for line in lines {
        let mut words = line.as_bytes().chunks_exact(8);
        for w in &mut words {
            mix(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let mut tail = [0u8; 8];
        tail[..words.remainder().len()].copy_from_slice(words.remainder());
        mix(u64::from_le_bytes(tail));
        mix(line.len() as u64);
    }
    h
}

/// Bytes of a call's data that ride in its agreement record ([`agree`]): a small collective
/// then costs one exchange instead of two.
pub(crate) const INLINE: usize = 240;

/// The agreement record, in bytes: status (8, little-endian), fingerprint (8, little-endian),
/// inline data.
const RECORD: usize = 16 + INLINE;

/// Every rank's agreement record, in rank order, [`RECORD`] bytes each in 8-byte words: what
/// [`agree`] gives when every rank agreed.
pub struct Records(Vec<u64>);

impl Records {
    /// Where rank `rank`'s inline data starts (8-byte aligned).
    pub fn inline_ptr(&mut self, rank: usize) -> usize {
        self.0.as_mut_ptr() as usize + rank * RECORD + 16
    }

    /// Rank `rank`'s inline data ([`INLINE`] bytes, zeros past what it sent).
    pub fn inline(&self, rank: usize) -> &[u8] {
        // SAFETY: the record's bytes, within the vector; u8 has no alignment.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 8) };
        &bytes[rank * RECORD + 16..(rank + 1) * RECORD]
    }
}

/// Why a collective failed on every rank ([`agree`]).
#[derive(Debug)]
pub struct Refused {
    /// This rank's error: its own where its own input failed, INCONSISTENT where another
    /// rank's did or the calls differ, else (ranks left, the others agreed) one that
    /// [`Error::is_world_changed`]: the call is to be made again over the remaining ranks.
    pub error: Error,
    /// Whether every rank made this same call (its first line): a failed `allreduce_grads`
    /// needs it, since only then does every rank drain its early buckets. Ranks that left at
    /// this exchange do not count.
    pub same_call: bool,
    /// The ranks that left at this exchange (`dpsync_leave`), ascending.
    pub left: Vec<usize>,
}

/// The status word of a rank that leaves at this exchange (`dpsync_leave`); no failure
/// status has it.
const LEAVING: u32 = 0x4c45_4156;

/// The first line a leaving rank shows in the second exchange.
const LEAVE_CALL: &str = "dpsync_leave()";

/// What a rank that left learned of its departure ([`leave`]).
pub struct Departure {
    /// Every rank that left at that exchange, this one included.
    pub left: Vec<usize>,
    /// The others were making a gradient step together, whose buckets some started early:
    /// this rank drains them with them (stand-ins) before it goes.
    pub step: bool,
}

/// `dpsync_leave`: this rank's part in the others' next agreement ([`agree`]), as a rank that
/// leaves. Its record and its line say so; the others finish their call without it.
pub fn leave(ranks: &dyn Ranks) -> Result<Departure> {
    ranks.begin(LEAVE_CALL);
    let mut record = [0u64; RECORD / 8];
    record[0] = u64::from(LEAVING).to_le();
    ranks.allgather_fixed(&record)?;
    // Not every rank agreed (this one leaves): every rank takes the second exchange.
    let mine = json!({"error": null, "status": LEAVING, "lines": [LEAVE_CALL]});
    let all = second_exchange(ranks, &mine)?;
    let left = leavers(&all);
    let stay: Vec<&Value> = (all.iter().enumerate())
        .filter(|(r, _)| !left.contains(r))
        .map(|(_, v)| v)
        .collect();
    let call = |v: &Value| v["lines"][0].as_str().unwrap_or("").to_owned();
    let step = stay.first().is_some_and(|first| {
        let first = call(first);
        stay.iter().all(|v| call(v) == first)
            && ["dpsync_allreduce_grads", "dpsync_reduce_scatter_grads"]
                .iter()
                .any(|s| first.starts_with(s))
    });
    Ok(Departure { left, step })
}

/// Every rank's verdict, status and lines (the second exchange of [`agree`]).
fn second_exchange(ranks: &dyn Ranks, mine: &Value) -> Result<Vec<Value>> {
    Ok(ranks
        .allgather(mine.to_string().as_bytes())?
        .iter()
        .map(|b| serde_json::from_slice(b).unwrap_or(Value::Null))
        .collect())
}

/// The ranks whose status in the second exchange says they leave.
fn leavers(all: &[Value]) -> Vec<usize> {
    (all.iter().enumerate())
        .filter(|(_, v)| v["status"] == LEAVING)
        .map(|(r, _)| r)
        .collect()
}

impl From<Refused> for Error {
    fn from(refused: Refused) -> Error {
        refused.error
    }
}

/// Agreement before mutation: `verdict` is this rank's validation, `lines` its call (first line)
/// and the registrations the call involves (one line per tensor, `name\tdescription`, in
/// order). One fixed-size allgather of (status, fingerprint, `inline`) when everything agrees;
/// otherwise a second one of the verdicts' messages and the lines, so that every rank can say
/// what differs, and every rank fails: with its own error where its own input failed, else
/// INCONSISTENT naming the ranks and the first difference.
///
/// `inline` (at most [`INLINE`] bytes) is this rank's data riding in its record (a small
/// collective's data, or what a call needs to know of the other ranks); the fingerprints do not
/// cover it. On agreement every rank's record comes back.
pub fn agree(
    ranks: &dyn Ranks,
    verdict: Result<()>,
    lines: &[&str],
    inline: Option<&[u8]>,
) -> std::result::Result<Records, Refused> {
    let refused = |error: Error| Refused {
        error,
        same_call: false,
        left: Vec::new(),
    };
    if let Some(call) = lines.first() {
        ranks.begin(call);
    }
    let status = match &verdict {
        Ok(()) => 0u32,
        Err(e) => e.kind.code(),
    };
    let mut record = [0u64; RECORD / 8];
    record[0] = u64::from(status).to_le();
    record[1] = fingerprint(lines).to_le();
    if let Some(data) = inline {
        // SAFETY: the record's bytes, borrowed while `record` is not otherwise used.
        let bytes = unsafe { std::slice::from_raw_parts_mut(record.as_mut_ptr().cast(), RECORD) };
        bytes[16..16 + data.len()].copy_from_slice(data);
    }
    let records = ranks.allgather_fixed(&record).map_err(refused)?;
    let agreed = records.chunks(RECORD / 8).all(|r| r[..2] == record[..2]);
    if agreed && status == 0 {
        ranks.agreed();
        return Ok(Records(records));
    }
    // Every rank saw the same records, so every rank takes this second exchange.
    let mine = json!({
        "error": verdict.as_ref().err().map(|e| e.message.clone()),
        "status": status,
        "lines": lines,
    });
    let mut all = second_exchange(ranks, &mine).map_err(refused)?;
    let left = leavers(&all);
    // The ranks that leave stand for none of the call: in the stayers' stead their entries
    // repeat this rank's, so that the disagreement found names stayers by their ranks.
    for &r in &left {
        all[r] = mine.clone();
    }
    let same_call = all.iter().all(|v| v["lines"][0] == lines[0]);
    let stayers_agree = (records.chunks(RECORD / 8).enumerate())
        .all(|(r, rec)| left.contains(&r) || rec[..2] == record[..2]);
    let error = match verdict {
        Err(own) => own,
        Ok(()) if !left.is_empty() && stayers_agree => Error::world_changed(format!(
            "{}: {} left the world; the call is made again without {}",
            lines.first().copied().unwrap_or("a collective"),
            ranks_text(&left),
            if left.len() == 1 { "it" } else { "them" }
        )),
        Ok(()) => Error::inconsistent(disagreement(&all)),
    };
    Err(Refused {
        error,
        same_call,
        left,
    })
}

/// What the first disagreeing rank does differently, in words.
fn disagreement(all: &[Value]) -> String {
    if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v["status"] != 0) {
        let kind = (v["status"].as_u64())
            .and_then(|c| status_name(c as u32))
            .unwrap_or("an error");
        return format!(
            "rank {r} failed its own checks ({kind}: {}); nothing was changed on any rank",
            v["error"].as_str().unwrap_or("?")
        );
    }
    let lines = |r: usize| -> Vec<String> {
        (all[r]["lines"].as_array().into_iter().flatten())
            .map(|l| l.as_str().unwrap_or("").to_owned())
            .collect()
    };
    let first = lines(0);
    for r in 1..all.len() {
        let other = lines(r);
        if other == first {
            continue;
        }
        let call = |l: &[String]| l.first().cloned().unwrap_or_default();
        if call(&first) != call(&other) {
            return format!("rank 0 called {}, rank {r} {}", call(&first), call(&other));
        }
        return tensors_differ(&first[1..], &other[1..], r);
    }
    "the ranks' calls differ".to_owned()
}

/// The first tensor registered differently on rank 0 and rank `r` (lines `name\tdescription`).
fn tensors_differ(first: &[String], other: &[String], r: usize) -> String {
    let split = |l: &String| -> (String, String) {
        let (name, what) = l.split_once('\t').unwrap_or((l.as_str(), ""));
        (name.to_owned(), what.to_owned())
    };
    let (a, b): (Vec<_>, Vec<_>) = (
        first.iter().map(split).collect(),
        other.iter().map(split).collect(),
    );
    for (name, what) in &a {
        match b.iter().find(|(n, _)| n == name) {
            None => {
                return format!("tensor '{name}' is registered on rank 0 only, not on rank {r}")
            }
            Some((_, theirs)) if theirs != what => {
                return format!("tensor '{name}': rank {r} has {theirs}, rank 0 has {what}")
            }
            _ => {}
        }
    }
    if let Some((name, _)) = b.iter().find(|(n, _)| !a.iter().any(|(m, _)| m == n)) {
        return format!("tensor '{name}' is registered on rank {r} only, not on rank 0");
    }
    let at = a.iter().zip(&b).position(|(x, y)| x.0 != y.0).unwrap_or(0);
    format!(
        "the tensors are registered in another order on rank {r} than on rank 0 (position {at}: \
         '{}' on rank 0, '{}' on rank {r})",
        a.get(at).map_or("", |t| t.0.as_str()),
        b.get(at).map_or("", |t| t.0.as_str())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(call: &str, tensors: &[&str]) -> Value {
        json!({"status": 0, "error": null,
               "lines": std::iter::once(call).chain(tensors.iter().copied()).collect::<Vec<_>>()})
    }

    #[test]
    fn disagreements_name_the_ranks_and_the_first_difference() {
        let a = lines("dpsync_allreduce_grads(op=SUM)", &["w\tGRAD 10 x f32"]);
        let b = lines("dpsync_broadcast(roles=1, root=0)", &["w\tGRAD 10 x f32"]);
        assert_eq!(
            disagreement(&[a.clone(), b]),
            "rank 0 called dpsync_allreduce_grads(op=SUM), rank 1 dpsync_broadcast(roles=1, root=0)"
        );
        let c = lines("dpsync_allreduce_grads(op=SUM)", &["w\tGRAD 11 x f32"]);
        assert_eq!(
            disagreement(&[a.clone(), a.clone(), c]),
            "tensor 'w': rank 2 has GRAD 11 x f32, rank 0 has GRAD 10 x f32"
        );
        let d = lines(
            "dpsync_allreduce_grads(op=SUM)",
            &["w\tGRAD 10 x f32", "extra\tGRAD 1 x f32"],
        );
        assert!(disagreement(&[a.clone(), d]).contains("'extra' is registered on rank 1 only"));
        let failed = json!({"status": crate::error::ErrorKind::NotFound.code(),
                            "error": "no tensor 'x'", "lines": ["c"]});
        let msg = disagreement(&[a, failed]);
        assert!(
            msg.starts_with("rank 1 failed") && msg.contains("NOT_FOUND"),
            "{msg}"
        );
    }

    #[test]
    fn fingerprints_follow_every_byte_and_the_line_breaks() {
        assert_ne!(fingerprint(&["ab", "c"]), fingerprint(&["a", "bc"]));
        assert_ne!(fingerprint(&["ab", ""]), fingerprint(&["ab"]));
        assert_eq!(fingerprint(&["ab"]), fingerprint(&["ab"]));
        // Every byte of a line longer than a word, the tail's too.
        let line = "w_grad\tGRAD 1000 x f32";
        for at in 0..line.len() {
            let mut other = line.as_bytes().to_vec();
            other[at] ^= 1;
            let other = String::from_utf8(other).unwrap();
            assert_ne!(
                fingerprint(&["c", line]),
                fingerprint(&["c", &other]),
                "byte {at}"
            );
        }
    }
}
