//! The timeline (DPSYNC_TIMELINE): a child process traces a training step; the parent reads the
//! Chrome trace-event file back.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod float16;
    pub mod lcg;
    // Only device memory here.
    #[allow(dead_code)]
    pub mod place;
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

/// Run as a child by `cuda_collectives_get_device_spans`: two steps on two CUDA replicas.
#[test]
fn timeline_cuda_child() {
    if std::env::var_os("DPSYNC_TIMELINE_CHILD").is_none() {
        common::skip::skip(format_args!(
            "timeline_cuda_child: skipped: runs only as the child of the timeline tests"
        ));
        return;
    }
    let Some(place) = common::place::Place::gpu("timeline_cuda_child") else {
        return;
    };
    let Some(ctx) = common::cuda_context::cuda_context("timeline_cuda_child", &[0, 0], |_| {})
    else {
        return;
    };
    let bytes: Vec<u8> = (0..64u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
    let g: Vec<common::place::Mem> = (0..2).map(|_| place.mem(&bytes)).collect();
    for (r, mem) in g.iter().enumerate() {
        let st = register_raw(ctx.0, "g", GRAD, r, mem.ptr() as *mut _, 64, F32);
        check(st, "register");
    }
    check(ctx.allreduce_grads(SUM), "step");
    check(ctx.allreduce_grads(SUM), "step");
    check(common::place::synchronize(&ctx), "synchronize");
}

#[test]
fn cuda_collectives_get_device_spans() {
    let Some(events) = traced_as("timeline_cuda_child", "cuda") else {
        return;
    };
    let rows: Vec<&Value> = (events.iter())
        .filter(|e| e["name"] == "thread_name" && e["args"]["name"] == "cuda:0 (device time)")
        .collect();
    // The child's probe context (Place::gpu) has its row too; the step's context is the last.
    let row = &rows.last().expect("a device row")["tid"];
    let device = named(&events, "X", "collective on device");
    assert_eq!(device.len(), 2, "{events:?}");
    assert!(device
        .iter()
        .all(|e| e["tid"] == *row && e["dur"].as_f64().unwrap() >= 0.0));
    // Placed on the host's clock: not before the first call began (1 ms of slack).
    let first_call = named(&events, "X", "dpsync_allreduce_grads")[0]["ts"]
        .as_f64()
        .unwrap();
    assert!(
        device[0]["ts"].as_f64().unwrap() >= first_call - 1000.0,
        "{device:?}"
    );
}

fn traced(mode: &str) -> Vec<Value> {
    traced_as("timeline_child", mode).expect("the host child always traces")
}

/// The events `child` (a test of this binary) traced, or None when it printed that it was
/// skipped (no CUDA device).
fn traced_as(child: &str, mode: &str) -> Option<Vec<Value>> {
    let path = std::env::temp_dir().join(format!(
        "dpsync-timeline-{}-{child}-{mode}.json",
        std::process::id()
    ));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([child, "--exact", "--nocapture", "--test-threads=1"])
        .env("DPSYNC_TIMELINE_CHILD", mode)
        .env("DPSYNC_TIMELINE", &path)
        .output()
        .expect("the test binary runs");
    assert!(out.status.success(), "{out:?}");
    let printed =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if let Some(line) = printed.lines().find(|l| l.contains(": skipped: ")) {
        println!("{line}");
        let _ = std::fs::remove_file(&path);
        return None;
    }
    let text = std::fs::read_to_string(&path).expect("the trace file");
    let _ = std::fs::remove_file(&path);
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(events)) => Some(events),
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
