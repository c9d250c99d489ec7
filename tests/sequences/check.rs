//! One checked call (the file's rules, main.rs), the trace of the last calls and the failure
//! report.

use crate::buffers::first_difference;
use crate::common::{abi::*, buf::*, context::*, errors::*, reference::*};
use crate::model::{status_str, Pred, Sim, Want, LAST_STATUS, LOG_LINES, PANIC};
use dpsync::*;

impl Sim {
    pub(crate) fn note(&mut self, line: String) {
        if self.trace {
            eprintln!("seed {}: {line}", self.seed);
        }
        if self.log.len() == LOG_LINES {
            self.log.pop_front();
        }
        self.log.push_back(line);
    }

    pub(crate) fn fail(&self, what: impl std::fmt::Display) -> ! {
        let mut s = format!(
            "seed {} ({} host replicas, fusion_bytes {:?}, sparse coalesce {}), after call #{}: \
             {what}\nlast calls (all of them: DPSYNC_SEQ_SEED={} DPSYNC_SEQ_TRACE=1 cargo test --release \
             --test sequences -- --nocapture):\n",
            self.seed, self.n, self.fusion_set, self.coalesce, self.calls, self.seed
        );
        for l in &self.log {
            s.push_str("  ");
            s.push_str(l);
            s.push('\n');
        }
        panic!("{s}");
    }

    /// Runs one C call and checks it against `want` (see the file's doc comment).
    pub(crate) fn call(
        &mut self,
        what: String,
        want: Want,
        f: impl FnOnce(*mut dpsync_context) -> dpsync_status,
    ) -> dpsync_status {
        self.calls += 1;
        let before = self.contents();
        let frozen = self.frozen();
        let message_before = last_error();
        let st = f(self.ctx.0);
        let code = st as u32;
        let msg = last_error();
        self.note(format!("#{} {what} -> {}", self.calls, status_name(code)));
        if code == PANIC {
            self.fail(format!("DPSYNC_STATUS_PANIC: {msg}"));
        }
        if code > LAST_STATUS {
            self.fail(format!("status {code} is not one the contract defines"));
        }
        if self.frozen() != frozen {
            self.fail("the call wrote memory of an unregistered tensor or of a sparse slice");
        }
        match want {
            Want::Ok(pred) => {
                if st != OK {
                    self.fail(format!("expected OK, got {} ({msg})", status_str(st)));
                }
                if msg != message_before {
                    self.fail(format!(
                        "a successful call changed dpsync_last_error from {message_before:?} to \
                         {msg:?} (docs: it stays until the next failing call)"
                    ));
                }
                self.check_contents(&pred, "after a successful call");
            }
            Want::Err(allowed) => {
                let names: Vec<String> = allowed.iter().map(|&s| status_str(s)).collect();
                if st == OK {
                    self.fail(format!("expected one of {names:?}, got OK"));
                }
                if !allowed.contains(&st) {
                    self.fail(format!(
                        "expected one of {names:?}, got {} ({msg})",
                        status_str(st)
                    ));
                }
                if msg.is_empty() {
                    self.fail("a failed call left dpsync_last_error empty");
                }
                if let Some((prev, prev_msg)) = &self.last_fail {
                    if *prev != st && *prev_msg == msg {
                        self.fail(format!(
                            "a {} failure kept the message of the previous {} failure: {msg:?}",
                            status_str(st),
                            status_str(*prev)
                        ));
                    }
                }
                self.last_fail = Some((st, msg));
                self.check_unchanged(&before);
            }
        }
        st
    }

    /// A failed call changed no byte.
    pub(crate) fn check_unchanged(&self, before: &Pred) {
        for (t, tensor) in self.tensors.iter().enumerate() {
            for (r, slot) in tensor.slots.iter().enumerate() {
                let (Some(slot), Some(old)) = (slot, &before[t][r]) else {
                    continue;
                };
                if slot.buf.bytes() != old.bytes() {
                    let i = (0..old.len())
                        .find(|&i| elem_str(&slot.buf, i) != elem_str(old, i))
                        .unwrap_or(0);
                    self.fail(format!(
                        "a failed call changed tensor '{}' on replica {r}: element {i} was {}, \
                         is {}",
                        tensor.name,
                        elem_str(old, i),
                        elem_str(&slot.buf, i)
                    ));
                }
            }
        }
    }

    /// Every buffer holds the predicted bytes; replicas predicted identical are byte-identical.
    pub(crate) fn check_contents(&self, pred: &Pred, when: &str) {
        for (t, tensor) in self.tensors.iter().enumerate() {
            for (r, slot) in tensor.slots.iter().enumerate() {
                let (Some(slot), Some(want)) = (slot, &pred[t][r]) else {
                    continue;
                };
                if let Some(i) = first_difference(&slot.buf, want) {
                    self.fail(format!(
                        "{when}: tensor '{}' ({:?}, {} elements) on replica {r}: element {i} is \
                         {}, the model predicts {}",
                        tensor.name,
                        want.dtype(),
                        want.len(),
                        elem_str(&slot.buf, i),
                        elem_str(want, i)
                    ));
                }
            }
            let predicted: Vec<Vec<u8>> = pred[t].iter().flatten().map(Buf::bytes).collect();
            if tensor.spec().is_some() && predicted.windows(2).all(|w| w[0] == w[1]) {
                let actual: Vec<Vec<u8>> = (tensor.slots.iter().flatten())
                    .map(|s| s.buf.bytes())
                    .collect();
                if actual.windows(2).any(|w| w[0] != w[1]) {
                    self.fail(format!(
                        "{when}: tensor '{}': replicas do not hold identical bytes",
                        tensor.name
                    ));
                }
            }
        }
    }
}
