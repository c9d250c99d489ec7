//! The timeline (DPSYNC_TIMELINE): a child process traces a training step; the parent reads the
//! Chrome trace-event file back.

mod common {
    pub mod abi;
    pub mod context;
    pub mod skip;
}

use std::process::Command;

use common::{abi::*, context::*};
use serde_json::Value;

/// Run as a child by the tests below (DPSYNC_TIMELINE set): two buckets, marks, a broadcast.
#[test]
fn timeline_child() {
    let Some(mode) = std::env::var_os("DPSYNC_TIMELINE_CHILD") else {
        common::skip::skip(format_args!(
            "timeline_child: skipped: runs only as the child of the timeline tests"
        ));
        return;
    };
    // 64 bytes: each 16-float gradient is a bucket of its own.
    let ctx = Context::host(2, Some(64));
    let mut g: Vec<Vec<Vec<f32>>> = vec![vec![vec![1.0; 16]; 2]; 2];
    let mut p: Vec<Vec<f32>> = vec![vec![3.0; 4]; 2];
    for r in 0..2 {
        ctx.reg("fc1_grad", GRAD, r, &mut g[0][r], F32);
        ctx.reg("fc2_grad", GRAD, r, &mut g[1][r], F32);
        ctx.reg("w", PARAM, r, &mut p[r], F32);
    }
    check(ctx.broadcast(PARAM, 0), "broadcast");
    check(ctx.allreduce_grads(SUM), "first step");
    for r in 0..2 {
        check(ctx.grad_ready("fc2_grad", r), "grad_ready");
    }
    check(ctx.allreduce_grads(SUM), "second step");
    if mode == "keep" {
        // Never destroyed: the exit hook must flush.
        std::mem::forget(ctx);
    }
}

fn traced(mode: &str) -> Vec<Value> {
    let path = std::env::temp_dir().join(format!(
        "dpsync-timeline-{}-{mode}.json",
        std::process::id()
    ));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "timeline_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DPSYNC_TIMELINE_CHILD", mode)
        .env("DPSYNC_TIMELINE", &path)
        .output()
        .expect("the test binary runs");
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&path).expect("the trace file");
    let _ = std::fs::remove_file(&path);
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(events)) => events,
        other => panic!("not a JSON array of events: {other:?}\n{text}"),
    }
}

fn named<'a>(events: &'a [Value], ph: &str, name: &str) -> Vec<&'a Value> {
    (events.iter())
        .filter(|e| e["ph"] == ph && e["name"] == name)
        .collect()
}

#[test]
fn a_step_shows_its_call_buckets_and_marks() {
    let events = traced("destroy");
    let calls = named(&events, "X", "dpsync_allreduce_grads");
    assert_eq!(calls.len(), 2, "{events:?}");
    let buckets = named(&events, "X", "allreduce bucket");
    // Two buckets in the first step; the second step reduced fc2's early (grad_ready).
    assert_eq!(buckets.len(), 4, "{buckets:?}");
    let names: Vec<&Value> = buckets.iter().map(|b| &b["args"]["tensors"]).collect();
    assert!(
        names.contains(&&serde_json::json!(["fc2_grad"])),
        "{names:?}"
    );
    assert!(
        buckets.iter().all(|b| b["args"]["bytes"] == 64),
        "{buckets:?}"
    );
    // Every bucket of the first step lies within its call.
    let (start, dur) = (
        calls[0]["ts"].as_f64().unwrap(),
        calls[0]["dur"].as_f64().unwrap(),
    );
    for b in &buckets[..2] {
        let ts = b["ts"].as_f64().unwrap();
        assert!(ts >= start && ts + b["dur"].as_f64().unwrap() <= start + dur + 1.0);
    }
    let marks = named(&events, "i", "grad_ready");
    assert_eq!(marks.len(), 2);
    assert_eq!(marks[1]["args"]["replica"], 1);
    assert_eq!(named(&events, "X", "dpsync_broadcast").len(), 1);
    let process = named(&events, "M", "process_name");
    assert!(process[0]["args"]["name"]
        .as_str()
        .unwrap()
        .starts_with("dpsync"));
    let thread = named(&events, "M", "thread_name");
    assert!(
        thread[0]["args"]["name"]
            .as_str()
            .unwrap()
            .contains("2 replicas, transport host"),
        "{thread:?}"
    );
}

#[test]
fn a_context_never_destroyed_is_flushed_at_exit() {
    let events = traced("keep");
    assert_eq!(named(&events, "X", "dpsync_allreduce_grads").len(), 2);
}
