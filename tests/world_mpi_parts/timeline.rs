//! Every rank writes its own timeline (`timeline_body`).

use super::*;

#[test]
fn every_rank_writes_its_own_timeline() {
    if under_mpirun() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("dpsync-world-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pattern = dir.join("trace-%r.json");
    launch(
        "timeline::timeline_body",
        2,
        120,
        Some(("DPSYNC_TIMELINE", &pattern)),
    );
    for rank in 0..2 {
        let path = dir.join(format!("trace-{rank}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        let has = |ph: &str, name: &str| events.iter().any(|e| e["ph"] == ph && e["name"] == name);
        assert!(
            has("X", "agree") && has("X", "across ranks") && has("X", "local sum"),
            "{text}"
        );
        let process = events.iter().find(|e| e["name"] == "process_name").unwrap();
        assert_eq!(process["args"]["name"], format!("dpsync rank {rank} of 2"));
        assert!(events.iter().all(|e| e["pid"] == rank));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A step on two local replicas under DPSYNC_TIMELINE (set by the launcher above).
#[test]
fn timeline_body() {
    let Some(_) = as_rank("timeline_body") else {
        return;
    };
    let ctx = Context::new(&world_options(2));
    let mut g: Vec<Vec<f32>> = vec![vec![1.0; 1000]; 2];
    for (k, buf) in g.iter_mut().enumerate() {
        ctx.reg("g", GRAD, k, buf, F32);
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    assert_eq!(g[1][7], 4.0);
}
