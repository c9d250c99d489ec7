//! "NCCL ops" style tests, after Caffe2's nccl_ops_test and data_parallel_model_test: allreduce
//! (SUM, AVG) and broadcast for 2..=8 host replicas, a sample of sizes 1..=1000 and every dtype,
//! against a reference that follows the summation and rounding rules exactly; a large buffer for
//! the threaded path; mixed dtypes in one allreduce_grads; the describe JSON (replicas, buckets,
//! steps); and dpsync_plan_describe for CUDA topologies (Caffe2's Pascal/Kepler seed case, the
//! pairwise trees, NCCL with replicas sharing a GPU), all through the C ABI.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
}

use common::{abi::*, buf::*, context::*, float16::*, lcg::*, reference::*};
use serde_json::Value;
use std::collections::BTreeSet;

const SIZES: [usize; 9] = [1, 2, 3, 7, 16, 31, 100, 257, 1000];

fn name_of(d: DType, size: usize) -> String {
    format!("{}_{}", d.name(), size)
}

#[derive(Debug, Clone)]
struct Step {
    op: String,
    src: Option<usize>,
    dst: Option<usize>,
    via: String,
    /// Optional extra key (not in the contract); checked only where present.
    round: Option<u64>,
}

fn steps_of(json: &Value) -> Vec<Step> {
    json["steps"]
        .as_array()
        .unwrap_or_else(|| panic!("no \"steps\": {json}"))
        .iter()
        .map(|s| Step {
            op: s["op"]
                .as_str()
                .unwrap_or_else(|| panic!("step op: {s}"))
                .to_owned(),
            src: s.get("src").and_then(Value::as_u64).map(|v| v as usize),
            dst: s.get("dst").and_then(Value::as_u64).map(|v| v as usize),
            via: s
                .get("via")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
            round: s.get("round").and_then(Value::as_u64),
        })
        .collect()
}

fn sums(steps: &[Step]) -> Vec<(usize, usize)> {
    steps
        .iter()
        .filter(|s| s.op == "sum")
        .map(|s| (s.src.expect("sum src"), s.dst.expect("sum dst")))
        .collect()
}

/// Simulates the plan on contribution counts: a sum adds src into dst, consecutive
/// nccl_allreduce steps allreduce over their replicas, and copies after the last reduction step
/// overwrite dst with src (copies before it are staging). Every replica must end with every
/// replica's contribution exactly once.
fn assert_plan_reduces(n: usize, steps: &[Step], what: &str) {
    let mut st: Vec<Vec<u32>> = (0..n)
        .map(|r| (0..n).map(|c| (c == r) as u32).collect())
        .collect();
    let last_reduce = steps
        .iter()
        .rposition(|s| s.op == "sum" || s.op == "nccl_allreduce")
        .unwrap_or_else(|| panic!("{what}: no reduction step in {steps:?}"));
    let mut i = 0;
    while i < steps.len() {
        let s = &steps[i];
        match s.op.as_str() {
            "sum" => {
                let (src, dst) = (s.src.unwrap(), s.dst.unwrap());
                assert!(
                    src < n && dst < n && src != dst,
                    "{what}: bad sum step {s:?}"
                );
                let add = st[src].clone();
                for (d, a) in st[dst].iter_mut().zip(add) {
                    *d += a;
                }
            }
            "nccl_allreduce" => {
                let mut group = Vec::new();
                while i < steps.len() && steps[i].op == "nccl_allreduce" {
                    let p = steps[i].dst.or(steps[i].src).expect("nccl step replica");
                    assert!(p < n, "{what}: {:?}", steps[i]);
                    group.push(p);
                    i += 1;
                }
                let mut total = vec![0u32; n];
                for &p in &group {
                    for (t, v) in total.iter_mut().zip(&st[p]) {
                        *t += v;
                    }
                }
                for &p in &group {
                    st[p] = total.clone();
                }
                continue;
            }
            "copy" | "broadcast" if i > last_reduce => {
                let (src, dst) = (s.src.unwrap(), s.dst.unwrap());
                assert!(src < n && dst < n, "{what}: bad copy step {s:?}");
                st[dst] = st[src].clone();
            }
            _ => {}
        }
        i += 1;
    }
    for (r, c) in st.iter().enumerate() {
        assert!(
            c.iter().all(|&v| v == 1),
            "{what}: replica {r} ends with contributions {c:?}; steps {steps:?}"
        );
    }
}

/// Allreduce and broadcast against the reference.
#[path = "collectives_parts/allreduce.rs"]
mod allreduce;

/// Rounding rules, large buffers, mixed dtypes, edge cases.
#[path = "collectives_parts/rules.rs"]
mod rules;

/// describe (host).
#[path = "collectives_parts/describe.rs"]
mod describe;

/// plan_describe (CUDA).
#[path = "collectives_parts/plan.rs"]
mod plan;
