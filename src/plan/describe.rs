//! The plan as JSON, for `dpsync_describe` and `dpsync_plan_describe`.

use serde_json::{json, Value};

use super::{Levels, Plan, Topology};
use crate::registry::Snapshot;

/// The JSON object; a live context adds what its backend reports under "backend". `levels`
/// are the ones the executor runs (describe's `steps` and `levels` are read from them).
pub fn describe(
    topology: &Topology,
    levels: &Levels,
    plan: &Plan,
    snapshot: &Snapshot,
    fusion_bytes: usize,
) -> Value {
    let n = topology.replicas();
    let replicas: Vec<Value> = topology
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| json!({"index": i, "device": d.to_string(), "rank": topology.rank}))
        .collect();
    let peer: Vec<Vec<u8>> = topology.peer.chunks(n.max(1)).map(<[u8]>::to_vec).collect();
    let buckets: Vec<Value> = plan
        .buckets
        .iter()
        .map(|b| {
            let names: Vec<&str> = b
                .tensors
                .iter()
                .map(|&i| snapshot.tensors[i].name.as_str())
                .collect();
            json!({"dtype": b.dtype.name(), "memory": b.memory.name(), "bytes": b.bytes(), "elements": b.elements, "tensors": names})
        })
        .collect();
    let steps: Vec<Value> = levels
        .program
        .iter()
        .map(|s| {
            let mut step = json!({"op": s.op.name(), "src": s.src, "dst": s.dst,
                                  "via": s.via.name(), "round": s.round});
            if let Some(rank) = s.rank {
                step["rank"] = json!(rank);
            }
            step
        })
        .collect();
    let problems: Vec<&str> = snapshot.problems().map(|e| e.message.as_str()).collect();
    let mut out = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "rank": topology.rank,
        "world_size": topology.world_size,
        "replicas": replicas,
        "transport": topology.transport.name(),
        "transport_reason": topology.transport_reason,
        "peer_access": peer,
        "peer_access_source": topology.peer_source.name(),
        "fusion_bytes": fusion_bytes,
        "reproducible": topology.reproducible,
        "loss_scale": 1.0 / topology.world_replicas() as f64,
        "tensors": snapshot.tensors.len(),
        "buckets": buckets,
        "steps": steps,
        "levels": levels.describe(),
        "problems": problems,
    });
    if let Some(detected) = &topology.peer_detected {
        let rows: Vec<Vec<u8>> = detected.chunks(n.max(1)).map(<[u8]>::to_vec).collect();
        out["peer_access_detected"] = json!(rows);
    }
    out
}
