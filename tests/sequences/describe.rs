//! `dpsync_describe` checked against the model.

use std::ffi::c_char;
use std::ptr;

use crate::common::abi::*;
use crate::model::{Sim, Want};
use dpsync::*;

impl Sim {
    pub(crate) fn op_describe(&mut self) {
        let mut len = 0usize;
        let want = self.unchanged();
        // SAFETY: sizing call (NULL, 0).
        self.call("describe(NULL, 0)".into(), want, |ctx| unsafe {
            dpsync_describe(ctx, ptr::null_mut(), 0, &mut len)
        });
        let mut buf = vec![0xAAu8; len + 1];
        let mut len2 = 0usize;
        let want = self.unchanged();
        let p = buf.as_mut_ptr().cast::<c_char>();
        let cap = buf.len();
        // SAFETY: a buffer of len + 1 bytes.
        self.call("describe(buf, len + 1)".into(), want, |ctx| unsafe {
            dpsync_describe(ctx, p, cap, &mut len2)
        });
        if len2 != len || buf[len] != 0 {
            self.fail(format!(
                "describe: length {len2} (sizing said {len}), byte at len is {}",
                buf[len]
            ));
        }
        let text = String::from_utf8(buf[..len].to_vec())
            .unwrap_or_else(|_| self.fail("describe output is not UTF-8"));
        let json: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| self.fail(format!("describe is not JSON ({e}): {text}")));
        self.check_describe(&json, &text);
        if len > 0 && self.chance(0.3) {
            let cap = 1 + self.g.below(len as u64) as usize;
            let mut small = vec![0xAAu8; cap];
            let mut len3 = 0usize;
            let want = self.unchanged();
            let p = small.as_mut_ptr().cast::<c_char>();
            // SAFETY: a buffer of `cap` bytes.
            self.call(format!("describe(buf, {cap})"), want, |ctx| unsafe {
                dpsync_describe(ctx, p, cap, &mut len3)
            });
            if len3 != len || small[..cap - 1] != text.as_bytes()[..cap - 1] || small[cap - 1] != 0
            {
                self.fail(format!(
                    "describe into {cap} bytes: length {len3} (want {len}), not the truncated, \
                     NUL-terminated text"
                ));
            }
        }
        if self.chance(0.15) {
            // SAFETY: length NULL is refused.
            self.call(
                "describe(NULL, 0, length NULL)".into(),
                Want::Err(vec![INVALID_ARGUMENT]),
                |ctx| unsafe { dpsync_describe(ctx, ptr::null_mut(), 0, ptr::null_mut()) },
            );
        }
        if self.chance(0.15) {
            let mut l = 0usize;
            // SAFETY: buffer NULL with capacity > 0 is refused.
            self.call(
                "describe(NULL, 16)".into(),
                Want::Err(vec![INVALID_ARGUMENT]),
                |ctx| unsafe { dpsync_describe(ctx, ptr::null_mut(), 16, &mut l) },
            );
        }
    }

    /// The description agrees with the model (docs/API.md "Describing the plan", "Overlap",
    /// "BMUF", "Sparse gradients").
    pub(crate) fn check_describe(&self, j: &serde_json::Value, text: &str) {
        let fail = |what: String| -> ! { self.fail(format!("describe: {what}\n{text}")) };
        let replicas = j["replicas"]
            .as_array()
            .unwrap_or_else(|| fail("no replicas".into()));
        if replicas.len() != self.n || replicas.iter().any(|r| r["device"] != "host") {
            fail(format!("replicas should be {} host replicas", self.n));
        }
        if j["transport"] != "host" {
            fail("transport should be host".into());
        }
        if j["fusion_bytes"].as_u64() != Some(self.fusion as u64) {
            fail(format!("fusion_bytes should be {}", self.fusion));
        }
        let scale = j["loss_scale"].as_f64().unwrap_or(f64::NAN);
        if (scale - 1.0 / self.n as f64).abs() > 1e-12 {
            fail(format!("loss_scale {scale}, want 1/{}", self.n));
        }
        let consistent = self.tensors.iter().filter(|t| t.spec().is_some()).count();
        if j["tensors"].as_u64() != Some(consistent as u64) {
            fail(format!(
                "tensors should be {consistent} (the consistent ones)"
            ));
        }
        // buckets
        let mut want: Vec<(String, Vec<String>, u64, u64)> = (self.buckets().into_iter())
            .map(|b| {
                let bytes = (b.elements * b.dtype.size()) as u64;
                (b.dtype.name().to_owned(), b.names, b.elements as u64, bytes)
            })
            .collect();
        let mut got: Vec<(String, Vec<String>, u64, u64)> = (j["buckets"].as_array())
            .unwrap_or_else(|| fail("no buckets".into()))
            .iter()
            .map(|b| {
                let names = (b["tensors"].as_array().into_iter().flatten())
                    .map(|n| n.as_str().unwrap_or("?").to_owned())
                    .collect();
                let dtype = b["dtype"].as_str().unwrap_or("?").to_owned();
                let elements = b["elements"].as_u64().unwrap_or(u64::MAX);
                (
                    dtype,
                    names,
                    elements,
                    b["bytes"].as_u64().unwrap_or(u64::MAX),
                )
            })
            .collect();
        want.sort();
        got.sort();
        if got != want {
            fail(format!("buckets {got:?}, the model predicts {want:?}"));
        }
        // problems: one per inconsistent dense name or sparse gradient, naming it
        let mut bad: Vec<&str> = (self.tensors.iter())
            .filter(|t| t.spec().is_none())
            .map(|t| t.name.as_str())
            .collect();
        bad.extend(
            (self.sparse.iter())
                .filter(|s| s.spec().is_none())
                .map(|s| s.name.as_str()),
        );
        let problems: Vec<&str> = (j["problems"].as_array())
            .unwrap_or_else(|| fail("no problems list".into()))
            .iter()
            .map(|p| p.as_str().unwrap_or(""))
            .collect();
        if problems.len() != bad.len()
            || !bad
                .iter()
                .all(|n| problems.iter().any(|p| p.contains(&format!("'{n}'"))))
        {
            fail(format!(
                "problems {problems:?}, the model's inconsistent names {bad:?}"
            ));
        }
        // sparse gradients
        let mut sparse_got: Vec<&str> = (j["sparse"].as_array().into_iter().flatten())
            .map(|s| s["name"].as_str().unwrap_or("?"))
            .collect();
        let mut sparse_want: Vec<&str> = (self.sparse.iter())
            .filter(|s| s.spec().is_some())
            .map(|s| s.name.as_str())
            .collect();
        sparse_got.sort_unstable();
        sparse_want.sort_unstable();
        if sparse_got != sparse_want {
            fail(format!(
                "sparse {sparse_got:?}, the model has {sparse_want:?}"
            ));
        }
        // overlap
        let o = &j["overlap"];
        let (marks, early) = match &self.marks {
            Some(m) => (m.ready.len(), m.reduced.iter().filter(|&&r| r).count()),
            None => (0, 0),
        };
        let op = match self.last_op {
            Some(SUM) => serde_json::json!("SUM"),
            Some(_) => serde_json::json!("AVG"),
            None => serde_json::Value::Null,
        };
        if o["marks_this_step"].as_u64() != Some(marks as u64)
            || o["buckets_reduced_early_this_step"].as_u64() != Some(early as u64)
            || o["buckets_reduced_early_last_step"].as_u64() != Some(self.last_step_early as u64)
            || o["op"] != op
        {
            fail(format!(
                "overlap {o}, the model has {marks} marks, {early} early buckets, {} last step, \
                 op {op}",
                self.last_step_early
            ));
        }
        // BMUF
        match &self.bmuf {
            None if !j["bmuf"].is_null() => fail("bmuf shown before a successful bmuf_init".into()),
            None => {}
            Some(b) => {
                let mu = j["bmuf"]["block_momentum"].as_f64().unwrap_or(f64::NAN);
                let lr = j["bmuf"]["block_lr"].as_f64().unwrap_or(f64::NAN);
                if (mu - b.mu).abs() > 1e-12
                    || (lr - b.lr).abs() > 1e-12
                    || j["bmuf"]["nesterov"] != b.nesterov
                    || j["bmuf"]["tensors"].as_u64() != Some(b.params.len() as u64)
                {
                    fail(format!(
                        "bmuf {}, the model has mu {}, lr {}, nesterov {}, {} tensors",
                        j["bmuf"],
                        b.mu,
                        b.lr,
                        b.nesterov,
                        b.params.len()
                    ));
                }
            }
        }
    }
}
