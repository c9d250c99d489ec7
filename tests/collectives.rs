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

// ------------------------------------------------------------------ helpers self-test

#[test]
fn f16_and_bf16_helpers_match_the_half_crate() {
    use half::{bf16, f16};
    for h in 0..=u16::MAX {
        let a = f16_to_f32(h);
        let b = f16::from_bits(h).to_f32();
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "f16 {h:#x}"
        );
        let a = bf16_to_f32(h);
        let b = bf16::from_bits(h).to_f32();
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "bf16 {h:#x}"
        );
    }
    let mut g = Lcg::new(5);
    let check_one = |x: f32| {
        let (a, b) = (f32_to_f16(x), f16::from_f32(x).to_bits());
        assert!(
            a == b || (x.is_nan() && a & 0x7c00 == 0x7c00 && a & 0x3ff != 0),
            "f16 of {x:e}"
        );
        let (a, b) = (f32_to_bf16(x), bf16::from_f32(x).to_bits());
        assert!(
            a == b || (x.is_nan() && a & 0x7f80 == 0x7f80 && a & 0x7f != 0),
            "bf16 of {x:e}"
        );
    };
    for _ in 0..2_000_000 {
        check_one(f32::from_bits(g.next_u32()));
    }
    for _ in 0..200_000 {
        check_one((g.spread() * 70000.0) as f32);
        check_one((g.spread() * 1e-5) as f32);
    }
    // exact ties
    for h in 0..0x7bffu16 {
        let lo = f16_to_f32(h) as f64;
        let hi = f16_to_f32(h + 1) as f64;
        check_one(((lo + hi) / 2.0) as f32);
    }
    for x in [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        65520.0,
        65519.99,
    ] {
        check_one(x);
    }
}

// ------------------------------------------------------------------ allreduce / broadcast

/// Every dtype x SIZES registered as GRAD on `n` replicas of `ctx`.
struct Grid {
    n: usize,
    /// (name, per-replica buffers)
    tensors: Vec<(String, Vec<Buf>)>,
}

impl Grid {
    fn new(ctx: &Context, n: usize) -> Grid {
        let mut tensors = Vec::new();
        for d in DType::ALL {
            for s in SIZES {
                let name = name_of(d, s);
                let mut bufs: Vec<Buf> = (0..n).map(|_| Buf::zeros(d, s)).collect();
                for (r, b) in bufs.iter_mut().enumerate() {
                    ctx.reg_buf(&name, GRAD, r, b);
                }
                tensors.push((name, bufs));
            }
        }
        Grid { n, tensors }
    }

    fn fill(&mut self, seed: u64) {
        for (t, (_, bufs)) in self.tensors.iter_mut().enumerate() {
            for (r, b) in bufs.iter_mut().enumerate() {
                b.fill_random(seed * 1_000_003 + (t * 64 + r) as u64);
            }
        }
    }

    fn snapshot(&self) -> Vec<Vec<Buf>> {
        self.tensors.iter().map(|(_, b)| b.clone()).collect()
    }

    /// Every tensor on every replica equals the reference reduction of `before`.
    #[track_caller]
    fn expect_reduced(&self, before: &[Vec<Buf>], op: u32, what: &str) {
        for ((name, bufs), pre) in self.tensors.iter().zip(before) {
            let refs: Vec<&Buf> = pre.iter().collect();
            let want = reference_allreduce(&refs, op);
            for (r, b) in bufs.iter().enumerate() {
                assert_same_bytes(
                    b,
                    &want,
                    &format!("{what}: '{name}' on replica {r} of {}", self.n),
                );
            }
        }
    }
}

#[test]
fn allreduce_grads_every_dtype_size_and_replica_count() {
    for n in 2..=8 {
        let ctx = Context::host(n, Some(4096));
        let mut grid = Grid::new(&ctx, n);
        for (round, op) in [SUM, AVG, SUM].into_iter().enumerate() {
            grid.fill(n as u64 * 10 + round as u64);
            let before = grid.snapshot();
            check(ctx.allreduce_grads(op), "allreduce_grads");
            grid.expect_reduced(&before, op, &format!("allreduce_grads op {op}"));
        }
    }
}

#[test]
fn allreduce_by_name_every_dtype_size_and_replica_count() {
    for n in 2..=8 {
        let ctx = Context::host(n, None);
        let mut grid = Grid::new(&ctx, n);
        for (round, op) in [SUM, AVG].into_iter().enumerate() {
            grid.fill(n as u64 * 10 + round as u64 + 5);
            let before = grid.snapshot();
            let names: Vec<String> = grid.tensors.iter().map(|(s, _)| s.clone()).collect();
            for name in &names {
                check(ctx.allreduce(name, op), &format!("allreduce('{name}')"));
            }
            grid.expect_reduced(&before, op, &format!("allreduce op {op}"));
        }
    }
}

#[test]
fn allreduce_by_name_touches_only_that_tensor() {
    let n = 3;
    let ctx = Context::host(n, None);
    let mut grid = Grid::new(&ctx, n);
    grid.fill(3);
    let before = grid.snapshot();
    check(ctx.allreduce("f32_100", SUM), "allreduce");
    for ((name, bufs), pre) in grid.tensors.iter().zip(&before) {
        if name == "f32_100" {
            continue;
        }
        for r in 0..n {
            assert_same_bytes(&bufs[r], &pre[r], &format!("'{name}' on {r}"));
        }
    }
    // any role can be reduced by name
    let mut params: Vec<Buf> = (0..n)
        .map(|r| Buf::random(DType::F64, 10, 40 + r as u64))
        .collect();
    let mut states: Vec<Buf> = (0..n)
        .map(|r| Buf::random(DType::I64, 2, 50 + r as u64))
        .collect();
    for r in 0..n {
        ctx.reg_buf("param", PARAM, r, &mut params[r]);
        ctx.reg_buf("state", STATE, r, &mut states[r]);
    }
    let (p0, s0) = (params.clone(), states.clone());
    check(ctx.allreduce("param", AVG), "allreduce(PARAM)");
    check(ctx.allreduce("state", SUM), "allreduce(STATE)");
    let wp = reference_allreduce(&p0.iter().collect::<Vec<_>>(), AVG);
    let ws = reference_allreduce(&s0.iter().collect::<Vec<_>>(), SUM);
    for r in 0..n {
        assert_same_bytes(&params[r], &wp, "param");
        assert_same_bytes(&states[r], &ws, "state");
    }
}

/// Many small tensors packed into buckets, and a large bucket whose thread ranges straddle tensor
/// boundaries: every element still reduced exactly once, in replica order.
#[test]
fn many_tensors_in_buckets_are_each_reduced_exactly() {
    let n = 3;
    for (tensors, max_count, fusion) in
        [(500usize, 40u64, Some(256usize)), (120, 40_000, Some(GIB))]
    {
        let ctx = Context::host(n, fusion);
        let mut g = Lcg::new(tensors as u64);
        let mut all: Vec<Vec<Buf>> = Vec::new();
        for t in 0..tensors {
            let d = DType::ALL[g.below(6) as usize];
            let c = 1 + g.below(max_count) as usize;
            let mut per: Vec<Buf> = (0..n)
                .map(|r| Buf::random(d, c, (t * 8 + r) as u64))
                .collect();
            for (r, b) in per.iter_mut().enumerate() {
                ctx.reg_buf(&format!("t{t}"), GRAD, r, b);
            }
            all.push(per);
        }
        for op in [SUM, AVG] {
            let before = all.clone();
            check(ctx.allreduce_grads(op), "allreduce_grads");
            for (t, (per, pre)) in all.iter().zip(&before).enumerate() {
                let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), op);
                for (r, b) in per.iter().enumerate() {
                    assert_same_bytes(
                        b,
                        &want,
                        &format!("t{t} op {op} replica {r} ({tensors} tensors)"),
                    );
                }
            }
            for (t, per) in all.iter_mut().enumerate() {
                for (r, b) in per.iter_mut().enumerate() {
                    b.fill_random((t * 8 + r) as u64 + 1_000_000);
                }
            }
        }
    }
}

#[test]
fn broadcast_every_dtype_size_root_and_replica_count() {
    for n in 2..=8 {
        let ctx = Context::host(n, None);
        let mut grid = Grid::new(&ctx, n);
        let mut roots = vec![0, n / 2, n - 1];
        roots.dedup();
        for root in roots {
            grid.fill(n as u64 * 100 + root as u64);
            let before = grid.snapshot();
            check(ctx.broadcast(GRAD, root), "broadcast");
            for ((name, bufs), pre) in grid.tensors.iter().zip(&before) {
                for (r, b) in bufs.iter().enumerate() {
                    assert_same_bytes(b, &pre[root], &format!("'{name}' on {r}, root {root}/{n}"));
                }
            }
        }
    }
}

#[test]
fn average_is_allreduce_avg_of_the_roles() {
    let n = 5;
    let ctx = Context::host(n, None);
    let mut bufs: Vec<Vec<Buf>> = DType::ALL
        .iter()
        .map(|&d| (0..n).map(|r| Buf::random(d, 33, 900 + r as u64)).collect())
        .collect();
    for (d, per) in DType::ALL.iter().zip(bufs.iter_mut()) {
        for (r, b) in per.iter_mut().enumerate() {
            ctx.reg_buf(&format!("bn_{}", d.name()), COMPUTED, r, b);
        }
    }
    let before = bufs.clone();
    check(ctx.average(COMPUTED), "average");
    for (d, (per, pre)) in DType::ALL.iter().zip(bufs.iter().zip(&before)) {
        let refs: Vec<&Buf> = pre.iter().collect();
        let want = reference_allreduce(&refs, AVG);
        for (r, b) in per.iter().enumerate() {
            assert_same_bytes(b, &want, &format!("bn_{} on {r}", d.name()));
        }
    }
}

/// Hand-computed cases for the rules the reference encodes, so that the reference itself is
/// pinned down.
#[test]
fn rounding_and_overflow_rules_on_known_values() {
    let n = 3;
    let ctx = Context::host(n, None);
    // i32: the sum overflows i32; SUM wraps, AVG uses the wide sum and truncates toward zero.
    let mut a: Vec<Vec<i32>> = vec![
        vec![i32::MAX, -7, i32::MIN],
        vec![i32::MAX, 0, i32::MIN],
        vec![1, 1, -1],
    ];
    // i64 likewise.
    let mut b: Vec<Vec<i64>> = vec![
        vec![i64::MAX, -7, i64::MIN],
        vec![i64::MAX, 0, i64::MIN],
        vec![1, 1, -1],
    ];
    // f16: 40000 + 40000 overflows f16 but not the f32 accumulator; AVG = 80000/3 fits.
    let h = |x: f32| f32_to_f16(x);
    let mut c: Vec<Vec<u16>> = vec![vec![h(40000.0)], vec![h(40000.0)], vec![h(0.0)]];
    // bf16: 1 + 2^-8 + 2^-8: in bf16 each add rounds back to 1; in f32 the sum is 1 + 2^-7.
    let bb = |x: f32| f32_to_bf16(x);
    let e = 2f32.powi(-8);
    let mut d: Vec<Vec<u16>> = vec![vec![bb(1.0)], vec![bb(e)], vec![bb(e)]];
    // f32: order matters: (1e8 + 1) + -1e8 = 0 in f32 but 1 in any other grouping that pairs the
    // big values first.
    let mut f: Vec<Vec<f32>> = vec![vec![1e8], vec![1.0], vec![-1e8]];
    for r in 0..n {
        ctx.reg("i32", GRAD, r, &mut a[r], I32);
        ctx.reg("i64", GRAD, r, &mut b[r], I64);
        ctx.reg("f16", GRAD, r, &mut c[r], F16);
        ctx.reg("bf16", GRAD, r, &mut d[r], BF16);
        ctx.reg("f32", GRAD, r, &mut f[r], F32);
    }
    let (a0, b0, c0, d0, f0) = (a.clone(), b.clone(), c.clone(), d.clone(), f.clone());
    check(ctx.allreduce_grads(SUM), "allreduce_grads SUM");
    for r in 0..n {
        assert_eq!(a[r], vec![-1, -6, -1], "i32 SUM wraps, replica {r}");
        assert_eq!(b[r], vec![-1, -6, -1], "i64 SUM wraps, replica {r}");
        assert_eq!(c[r], vec![0x7c00], "f16 SUM of 80000 is +inf, replica {r}");
        assert_eq!(
            d[r],
            vec![bb(1.0 + 2.0 * e)],
            "bf16 accumulates in f32, replica {r}"
        );
        assert_eq!(f[r], vec![0.0], "f32 sums ((r0 + r1) + r2), replica {r}");
    }
    for r in 0..n {
        a[r].copy_from_slice(&a0[r]);
        b[r].copy_from_slice(&b0[r]);
        c[r].copy_from_slice(&c0[r]);
        d[r].copy_from_slice(&d0[r]);
        f[r].copy_from_slice(&f0[r]);
    }
    check(ctx.allreduce_grads(AVG), "allreduce_grads AVG");
    let wide32 = (2 * i32::MAX as i64 + 1) / 3;
    let wide64 = ((2 * i64::MAX as i128 + 1) / 3) as i64;
    let min64 = ((2 * i64::MIN as i128 - 1) / 3) as i64;
    for r in 0..n {
        assert_eq!(
            a[r],
            vec![wide32 as i32, -2, -1431655765],
            "i32 AVG, replica {r}"
        );
        assert_eq!(b[r], vec![wide64, -2, min64], "i64 AVG, replica {r}");
        assert_eq!(
            c[r],
            vec![h(80000.0 / 3.0)],
            "f16 AVG rounds once, replica {r}"
        );
        assert_eq!(
            d[r],
            vec![bb((1.0 + 2.0 * e) / 3.0)],
            "bf16 AVG, replica {r}"
        );
        assert_eq!(f[r], vec![0.0], "f32 AVG, replica {r}");
    }
}

#[test]
fn large_buffers_take_the_threaded_path_exactly() {
    let n = 4;
    let count = 3_000_000;
    let ctx = Context::host(n, None);
    let mut big: Vec<Buf> = (0..n)
        .map(|r| Buf::random(DType::F32, count, 50 + r as u64))
        .collect();
    let mut half: Vec<Buf> = (0..n)
        .map(|r| Buf::random(DType::BF16, 1_000_003, 60 + r as u64))
        .collect();
    let mut wide: Vec<Buf> = (0..n)
        .map(|r| Buf::random(DType::I64, 1_000_001, 70 + r as u64))
        .collect();
    for r in 0..n {
        ctx.reg_buf("big", GRAD, r, &mut big[r]);
        ctx.reg_buf("half", GRAD, r, &mut half[r]);
        ctx.reg_buf("wide", GRAD, r, &mut wide[r]);
    }
    for op in [SUM, AVG] {
        for via_grads in [false, true] {
            let pre = (big.clone(), half.clone(), wide.clone());
            if via_grads {
                check(ctx.allreduce_grads(op), "allreduce_grads");
            } else {
                for name in ["big", "half", "wide"] {
                    check(ctx.allreduce(name, op), name);
                }
            }
            for (got, pre, name) in [
                (&big, &pre.0, "big"),
                (&half, &pre.1, "half"),
                (&wide, &pre.2, "wide"),
            ] {
                let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), op);
                for (r, b) in got.iter().enumerate() {
                    assert_same_bytes(
                        b,
                        &want,
                        &format!("'{name}' op {op} grads {via_grads} replica {r}"),
                    );
                }
            }
            // fresh distinct data for the next round
            for (r, b) in big.iter_mut().enumerate() {
                b.fill_random(op as u64 * 10 + via_grads as u64 + r as u64 * 100);
            }
            for (r, b) in half.iter_mut().enumerate() {
                b.fill_random(op as u64 * 10 + via_grads as u64 + r as u64 * 100 + 1);
            }
            for (r, b) in wide.iter_mut().enumerate() {
                b.fill_random(op as u64 * 10 + via_grads as u64 + r as u64 * 100 + 2);
            }
        }
    }
    // broadcast of the big buffer from the last replica
    let pre = big.clone();
    check(ctx.broadcast(GRAD, n - 1), "broadcast");
    for (r, b) in big.iter().enumerate() {
        assert_same_bytes(b, &pre[n - 1], &format!("big broadcast replica {r}"));
    }
}

/// Mixed dtypes in one allreduce_grads, for several fusion sizes: exact results, and identical
/// bytes whatever the fusion size.
#[test]
fn allreduce_grads_mixed_dtypes_in_one_step_any_fusion() {
    let n = 4;
    let shapes: [(DType, usize); 9] = [
        (DType::F32, 300),
        (DType::F16, 77),
        (DType::I64, 9),
        (DType::F32, 5),
        (DType::BF16, 1000),
        (DType::F64, 40),
        (DType::I32, 129),
        (DType::F16, 3),
        (DType::F32, 4096),
    ];
    let mut results: Vec<(Option<usize>, Vec<Vec<u8>>)> = Vec::new();
    for fusion in [Some(0), Some(16), Some(1024), None, Some(GIB)] {
        for op in [SUM, AVG] {
            let ctx = Context::host(n, fusion);
            let mut ts: Vec<Vec<Buf>> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(d, c))| {
                    (0..n)
                        .map(|r| Buf::random(d, c, (i * 10 + r) as u64))
                        .collect()
                })
                .collect();
            for (i, per) in ts.iter_mut().enumerate() {
                for (r, b) in per.iter_mut().enumerate() {
                    ctx.reg_buf(&format!("g{i}"), GRAD, r, b);
                }
            }
            let before = ts.clone();
            check(ctx.allreduce_grads(op), "allreduce_grads");
            let mut bytes = Vec::new();
            for (i, (per, pre)) in ts.iter().zip(&before).enumerate() {
                let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), op);
                for (r, b) in per.iter().enumerate() {
                    assert_same_bytes(
                        b,
                        &want,
                        &format!("g{i} op {op} fusion {fusion:?} replica {r}"),
                    );
                }
                bytes.push(per[0].bytes());
            }
            if op == SUM {
                results.push((fusion, bytes));
            }
        }
    }
    for (f, b) in &results[1..] {
        assert_eq!(b, &results[0].1, "fusion {f:?} vs {:?}", results[0].0);
    }
}

#[test]
fn allreduce_grads_with_no_grads_and_single_replica() {
    let ctx = Context::host(3, None);
    check(ctx.allreduce_grads(SUM), "no GRAD registered");
    let mut p: Vec<Vec<f32>> = vec![vec![1.0, 2.0]; 3];
    for (r, v) in p.iter_mut().enumerate() {
        v[0] += r as f32;
        ctx.reg("p", PARAM, r, v, F32);
    }
    check(ctx.allreduce_grads(AVG), "only a PARAM registered");
    assert_eq!(
        p,
        vec![vec![1.0, 2.0], vec![2.0, 2.0], vec![3.0, 2.0]],
        "PARAM untouched"
    );

    let one = Context::host(1, None);
    assert_eq!(one.loss_scale(), 1.0);
    let mut g = Buf::random(DType::F16, 31, 4);
    one.reg_buf("g", GRAD, 0, &mut g);
    let pre = g.clone();
    for op in [SUM, AVG] {
        check(one.allreduce_grads(op), "1 replica");
        assert_same_bytes(&g, &reference_allreduce(&[&pre], op), "1 replica");
        assert_same_bytes(&g, &pre, "1 replica is the identity");
    }
    check(unsafe { dpsync::dpsync_synchronize(one.0) }, "synchronize");
}

// ------------------------------------------------------------------ describe (host)

fn grad_names_in_buckets(json: &Value) -> Vec<String> {
    buckets(json)
        .iter()
        .flat_map(|b| b.tensors.clone())
        .collect()
}

#[derive(Debug)]
struct Bucket {
    dtype: String,
    bytes: u64,
    elements: u64,
    tensors: Vec<String>,
}

fn buckets(json: &Value) -> Vec<Bucket> {
    json["buckets"]
        .as_array()
        .unwrap_or_else(|| panic!("describe has no \"buckets\" array: {json}"))
        .iter()
        .map(|b| Bucket {
            dtype: b["dtype"].as_str().expect("bucket dtype").to_owned(),
            bytes: b["bytes"].as_u64().expect("bucket bytes"),
            elements: b["elements"].as_u64().expect("bucket elements"),
            tensors: b["tensors"]
                .as_array()
                .expect("bucket tensors")
                .iter()
                .map(|t| t.as_str().expect("tensor name").to_owned())
                .collect(),
        })
        .collect()
}

/// Checks the bucket properties for GRADs registered in `order` (name, dtype, count).
fn check_buckets(json: &Value, order: &[(&str, DType, usize)], fusion: u64) -> Vec<Bucket> {
    let bs = buckets(json);
    let mut seen = Vec::new();
    for b in &bs {
        assert!(!b.tensors.is_empty(), "empty bucket {b:?}");
        let mut bytes = 0u64;
        let mut elems = 0u64;
        for t in &b.tensors {
            let (_, d, c) = order
                .iter()
                .find(|(n, _, _)| n == t)
                .unwrap_or_else(|| panic!("bucket lists '{t}', which is not a GRAD"));
            assert_eq!(d.name(), b.dtype, "'{t}' in a {} bucket", b.dtype);
            bytes += (c * d.size()) as u64;
            elems += *c as u64;
            seen.push(t.clone());
        }
        assert_eq!(b.bytes, bytes, "bucket bytes {b:?}");
        assert_eq!(b.elements, elems, "bucket elements {b:?}");
        assert!(
            b.bytes <= fusion || b.tensors.len() == 1,
            "bucket over fusion_bytes {fusion}: {b:?}"
        );
    }
    let mut sorted = seen.clone();
    sorted.sort();
    let mut want: Vec<String> = order.iter().map(|(n, _, _)| n.to_string()).collect();
    want.sort();
    assert_eq!(sorted, want, "every GRAD exactly once");
    // Per dtype, the buckets walk the tensors in reverse registration order.
    for d in DType::ALL {
        let got: Vec<String> = bs
            .iter()
            .filter(|b| b.dtype == d.name())
            .flat_map(|b| b.tensors.clone())
            .collect();
        let want: Vec<String> = order
            .iter()
            .rev()
            .filter(|(_, dt, _)| *dt == d)
            .map(|(n, _, _)| n.to_string())
            .collect();
        assert_eq!(
            got,
            want,
            "{} tensors in reverse registration order",
            d.name()
        );
    }
    // The first bucket starts with the last registered GRAD.
    if let Some(first) = bs.first() {
        assert_eq!(
            first.tensors[0],
            order.last().unwrap().0,
            "reduced last-registered first"
        );
    }
    bs
}

const MIXED: [(&str, DType, usize); 8] = [
    ("a_grad", DType::F32, 4),
    ("b_grad", DType::F32, 10),
    ("c_grad", DType::F64, 3),
    ("d_grad", DType::F32, 20),
    ("e_grad", DType::F16, 8),
    ("f_grad", DType::F32, 2),
    ("g_grad", DType::I32, 5),
    ("h_grad", DType::BF16, 3),
];

/// Registers MIXED as GRADs (plus a PARAM and a COMPUTED that must not appear in buckets).
fn register_mixed(ctx: &Context, n: usize) -> Vec<Vec<Buf>> {
    let mut keep = Vec::new();
    for r in 0..n {
        let mut p = Buf::zeros(DType::F32, 7);
        ctx.reg_buf("p", PARAM, r, &mut p);
        keep.push(vec![p]);
    }
    for (name, d, c) in MIXED {
        let mut per = Vec::new();
        for r in 0..n {
            let mut b = Buf::random(d, c, r as u64);
            ctx.reg_buf(name, GRAD, r, &mut b);
            per.push(b);
        }
        keep.push(per);
    }
    for r in 0..n {
        let mut q = Buf::zeros(DType::F64, 2);
        ctx.reg_buf("q", COMPUTED, r, &mut q);
        keep.push(vec![q]);
    }
    keep
}

#[test]
fn describe_lists_replicas_transport_and_settings() {
    let ctx = Context::host(1, None);
    let j = ctx.describe_json();
    assert_eq!(j["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(j["rank"], 0);
    assert_eq!(j["world_size"], 1);
    assert_eq!(j["transport"], "host");
    assert_eq!(j["fusion_bytes"], 26214400, "default fusion_bytes");
    assert_eq!(j["loss_scale"].as_f64(), Some(1.0));
    assert_eq!(j["replicas"].as_array().map(|a| a.len()), Some(1));

    let n = 5;
    let ctx = Context::host(n, Some(12345));
    let j = ctx.describe_json();
    let reps = j["replicas"].as_array().expect("replicas");
    assert_eq!(reps.len(), n);
    for (i, r) in reps.iter().enumerate() {
        assert_eq!(r["index"], i, "{r}");
        assert_eq!(r["device"], "host", "{r}");
    }
    assert_eq!(j["fusion_bytes"], 12345);
    assert_eq!(j["loss_scale"].as_f64(), Some(1.0 / n as f64));
    assert_eq!(j["transport"], "host");
    assert!(j["transport_reason"].is_string(), "{j}");
    let pa = j["peer_access"].as_array().expect("peer_access");
    assert_eq!(pa.len(), n);
    for row in pa {
        assert_eq!(row.as_array().map(|r| r.len()), Some(n));
        assert!(
            row.as_array().unwrap().iter().all(|v| *v == 0 || *v == 1),
            "{row}"
        );
    }
    assert_eq!(j["problems"], serde_json::json!([]), "no problems yet");
    assert_eq!(j["buckets"], serde_json::json!([]), "no GRADs yet");
}

#[test]
fn describe_buckets_reverse_order_per_dtype_within_fusion_bytes() {
    let n = 3;
    for fusion in [0u64, 16, 64, 100, GIB as u64] {
        let ctx = Context::host(n, Some(fusion as usize));
        let _keep = register_mixed(&ctx, n);
        let j = ctx.describe_json();
        assert_eq!(j["fusion_bytes"], fusion);
        let bs = check_buckets(&j, &MIXED, fusion);
        if fusion == 0 {
            assert_eq!(
                bs.len(),
                MIXED.len(),
                "fusion 0: every tensor its own bucket: {bs:?}"
            );
        }
        if fusion == 100 {
            // b_grad (40 B) and a_grad (16 B) are adjacent f32 tensors that fit together.
            assert!(bs.len() < MIXED.len(), "fusion 100 fuses something: {bs:?}");
        }
        // steps are present, over these replicas, on the host
        let steps = j["steps"]
            .as_array()
            .unwrap_or_else(|| panic!("no steps: {j}"));
        assert!(!steps.is_empty(), "steps for {n} replicas: {j}");
        for s in steps {
            assert!(s["op"].is_string(), "{s}");
            for k in ["src", "dst"] {
                if let Some(v) = s.get(k) {
                    assert!(v.as_u64().map(|v| v < n as u64) == Some(true), "{s}");
                }
            }
            if let Some(v) = s.get("via") {
                assert_eq!(v.as_str(), Some("host"), "{s}");
            }
        }
        let st = steps_of(&j);
        assert_plan_reduces(n, &st, &format!("host plan, fusion {fusion}"));
        // host: ((r0 + r1) + r2), summed into replica 0 in replica order
        let want: Vec<(usize, usize)> = (1..n).map(|r| (r, 0)).collect();
        assert_eq!(sums(&st), want, "host sums in replica order");
        // describe is a pure function of the registry
        let again = ctx.describe();
        assert_eq!(serde_json::from_str::<Value>(&again).unwrap(), j);
    }
}

#[test]
fn describe_one_dtype_fuses_into_one_bucket_when_it_fits() {
    let order: Vec<(&str, DType, usize)> = vec![
        ("w0", DType::F32, 10),
        ("w1", DType::F32, 1),
        ("w2", DType::F32, 100),
        ("w3", DType::F32, 7),
        ("w4", DType::F32, 33),
    ];
    let n = 2;
    for fusion in [0usize, 8, 43, 44, 603, 604, GIB] {
        let ctx = Context::host(n, Some(fusion));
        let mut keep = Vec::new();
        for (name, d, c) in &order {
            for r in 0..n {
                let mut b = Buf::zeros(*d, *c);
                ctx.reg_buf(name, GRAD, r, &mut b);
                keep.push(b);
            }
        }
        let bs = check_buckets(&ctx.describe_json(), &order, fusion as u64);
        match fusion {
            // w1 + w0 is 44 bytes: over 43
            0 | 8 | 43 => assert_eq!(bs.len(), 5, "{bs:?}"),
            603 => assert!(bs.len() >= 2, "604 bytes do not fit in 603: {bs:?}"),
            604 | GIB => {
                assert_eq!(bs.len(), 1, "all 604 bytes fit in one bucket: {bs:?}");
                assert_eq!(bs[0].tensors, vec!["w4", "w3", "w2", "w1", "w0"]);
                assert_eq!(bs[0].bytes, 604);
            }
            _ => assert!(bs.len() < 5, "{bs:?}"),
        }
    }
}

#[test]
fn grad_order_is_the_order_of_first_registration_on_any_replica() {
    let n = 2;
    let ctx = Context::host(n, Some(0));
    let mut bufs: Vec<Vec<f32>> = vec![vec![0.0; 3]; 8];
    let mut it = bufs.iter_mut();
    let mut next = || it.next().unwrap();
    // replica 1 registers first, in forward order; replica 0 later, in another order
    ctx.reg("x", GRAD, 1, next(), F32);
    ctx.reg("y", GRAD, 1, next(), F32);
    ctx.reg("z", GRAD, 1, next(), F32);
    ctx.reg("z", GRAD, 0, next(), F32);
    ctx.reg("x", GRAD, 0, next(), F32);
    ctx.reg("y", GRAD, 0, next(), F32);
    assert_eq!(
        grad_names_in_buckets(&ctx.describe_json()),
        vec!["z", "y", "x"]
    );
    // unregister and register again: the name is new, so it is now the last registered
    check(ctx.unregister("y"), "unregister");
    ctx.reg("y", GRAD, 0, next(), F32);
    ctx.reg("y", GRAD, 1, next(), F32);
    assert_eq!(
        grad_names_in_buckets(&ctx.describe_json()),
        vec!["y", "z", "x"]
    );
}

#[test]
fn describe_reports_registration_problems_and_unregister() {
    let n = 3;
    let ctx = Context::host(n, Some(64));
    let _keep = register_mixed(&ctx, n);
    let mut bad = vec![0f32; 4];
    ctx.reg("bad_grad", GRAD, 0, &mut bad, F32);
    let j = ctx.describe_json();
    let problems = j["problems"].as_array().expect("problems");
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap_or("").contains("'bad_grad'")),
        "problems should name 'bad_grad': {problems:?}"
    );
    check(ctx.unregister("bad_grad"), "unregister");
    check(ctx.unregister("c_grad"), "unregister");
    let j = ctx.describe_json();
    assert_eq!(j["problems"], serde_json::json!([]));
    let names = grad_names_in_buckets(&j);
    assert!(!names.contains(&"c_grad".to_owned()), "{names:?}");
    assert_eq!(names.len(), MIXED.len() - 1);
}

#[test]
fn describe_truncates_like_snprintf() {
    let ctx = Context::host(2, None);
    let full = ctx.describe();
    let total = full.len();
    assert!(total > 20);
    for cap in [1usize, 2, 10, total - 1, total, total + 1, total + 50] {
        let mut buf = vec![0xAAu8; cap + 8];
        let mut len = usize::MAX;
        let st = unsafe { dpsync::dpsync_describe(ctx.0, buf.as_mut_ptr().cast(), cap, &mut len) };
        check(st, "describe with a small buffer");
        assert_eq!(len, total, "*length is the full length (capacity {cap})");
        let written = (cap - 1).min(total);
        assert_eq!(
            &buf[..written],
            &full.as_bytes()[..written],
            "capacity {cap}"
        );
        assert_eq!(
            buf[written], 0,
            "NUL after {written} bytes (capacity {cap})"
        );
        assert!(
            buf[cap..].iter().all(|&b| b == 0xAA),
            "wrote past capacity {cap}"
        );
    }
    // the same rules for plan_describe
    let o = Options::host(2);
    let full = o.plan().expect("plan_describe");
    let mut buf = vec![0xAAu8; 9];
    let mut len = 0usize;
    let st = unsafe { dpsync::dpsync_plan_describe(o.0, buf.as_mut_ptr().cast(), 5, &mut len) };
    check(st, "plan_describe truncated");
    assert_eq!(len, full.len());
    assert_eq!(&buf[..4], &full.as_bytes()[..4]);
    assert_eq!(buf[4], 0);
    assert!(buf[5..].iter().all(|&b| b == 0xAA));
}

#[test]
fn plan_describe_for_host_options_matches_describe_of_a_context() {
    let o = Options::host(4);
    o.set_fusion_bytes(4096);
    let j = o.plan_json();
    assert_eq!(j["transport"], "host");
    assert_eq!(j["fusion_bytes"], 4096);
    assert_eq!(j["replicas"].as_array().map(|a| a.len()), Some(4));
    for (i, r) in j["replicas"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["device"], "host");
        assert_eq!(r["index"], i);
    }
    let ctx = Context::new(&o);
    let d = ctx.describe_json();
    assert_eq!(d["replicas"], j["replicas"]);
    assert_eq!(d["transport"], j["transport"]);
    assert_eq!(d["steps"], j["steps"]);
}

// ------------------------------------------------------------------ plan_describe (CUDA)

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

fn cuda_plan(ordinals: &[i32], peer: Option<&[u8]>, transport: u32) -> Value {
    let o = Options::new();
    o.set_cuda_replicas(ordinals);
    if let Some(m) = peer {
        o.set_peer_access(m, ordinals.len());
    }
    o.set_transport(transport);
    o.plan_json()
}

/// Checks "via" against the matrix and the devices; returns the plan's steps.
fn check_peer_plan(ordinals: &[i32], matrix: &[u8], what: &str) -> Vec<Step> {
    let n = ordinals.len();
    let j = cuda_plan(ordinals, Some(matrix), T_PEER_COPY);
    assert_eq!(j["transport"], "peer_copy", "{what}");
    let reps = j["replicas"].as_array().expect("replicas");
    assert_eq!(reps.len(), n, "{what}");
    for (i, r) in reps.iter().enumerate() {
        assert_eq!(r["device"], format!("cuda:{}", ordinals[i]), "{what}: {r}");
    }
    let pa: Vec<Vec<u8>> = j["peer_access"]
        .as_array()
        .expect("peer_access")
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u8)
                .collect()
        })
        .collect();
    let want: Vec<Vec<u8>> = matrix
        .chunks(n)
        .map(|c| c.iter().map(|&v| (v != 0) as u8).collect())
        .collect();
    assert_eq!(pa, want, "{what}: peer_access is the override");
    let peer = |a: usize, b: usize| matrix[a * n + b] != 0 && matrix[b * n + a] != 0;
    let st = steps_of(&j);
    for s in &st {
        if s.via == "peer" {
            let (a, b) = (s.src.unwrap(), s.dst.unwrap());
            assert!(
                peer(a, b),
                "{what}: direct peer step without peer access both ways: {s:?}"
            );
        }
        if s.op == "sum" {
            let (a, b) = (s.src.unwrap(), s.dst.unwrap());
            if ordinals[a] == ordinals[b] {
                assert_eq!(s.via, "local", "{what}: {s:?}");
            } else if !peer(a, b) {
                assert_eq!(
                    s.via, "staged",
                    "{what}: sum between devices without peer access {s:?}"
                );
            }
        }
    }
    assert_plan_reduces(n, &st, what);
    st
}

#[test]
fn plan_seed_topology_pascal_and_kepler_pair() {
    // GPU0 alone (Pascal), GPU1 <-> GPU2 (Kepler pair) with peer access.
    let dev_peer = |a: i32, b: i32| a == b || (a != 0 && b != 0);
    for ordinals in [vec![0, 1], vec![0, 2], vec![1, 2], vec![0, 1, 2]] {
        let n = ordinals.len();
        let mut m = vec![0u8; n * n];
        for i in 0..n {
            for k in 0..n {
                m[i * n + k] = dev_peer(ordinals[i], ordinals[k]) as u8;
            }
        }
        let what = format!("devices {ordinals:?}");
        let st = check_peer_plan(&ordinals, &m, &what);
        let s = sums(&st);
        assert_eq!(s.len(), n - 1, "{what}: n - 1 sums: {st:?}");
        if ordinals == [1, 2] {
            assert!(
                st.iter().filter(|s| s.op == "sum").all(|s| s.via == "peer"),
                "{what}: {st:?}"
            );
        }
        if ordinals == [0, 1] || ordinals == [0, 2] {
            assert!(
                st.iter().all(|s| s.via != "peer"),
                "{what}: no peer access at all: {st:?}"
            );
        }
    }
}

fn all_peer(n: usize) -> Vec<u8> {
    vec![1u8; n * n]
}

/// Sum steps must come in these rounds (order inside a round free).
fn assert_rounds(st: &[Step], rounds: &[&[(usize, usize)]], what: &str) {
    let s = sums(st);
    let total: usize = rounds.iter().map(|r| r.len()).sum();
    assert_eq!(s.len(), total, "{what}: sum steps {s:?}");
    let mut at = 0;
    for (k, round) in rounds.iter().enumerate() {
        let got: BTreeSet<(usize, usize)> = s[at..at + round.len()].iter().copied().collect();
        let want: BTreeSet<(usize, usize)> = round.iter().copied().collect();
        assert_eq!(got, want, "{what}: round {k} (src, dst) of {s:?}");
        at += round.len();
    }
    for x in st.iter().filter(|s| s.op == "sum") {
        assert_eq!(
            x.via, "peer",
            "{what}: all-peer topology reads directly: {x:?}"
        );
    }
    // Where steps carry a round number, each expected round is one round, in increasing order.
    let summed: Vec<&Step> = st.iter().filter(|s| s.op == "sum").collect();
    if summed.iter().all(|s| s.round.is_some()) {
        let mut at = 0;
        let mut last: Option<u64> = None;
        for round in rounds {
            let nums: BTreeSet<u64> = summed[at..at + round.len()]
                .iter()
                .map(|s| s.round.unwrap())
                .collect();
            assert_eq!(
                nums.len(),
                1,
                "{what}: one round number per round: {summed:?}"
            );
            let r = *nums.iter().next().unwrap();
            assert!(
                last.is_none_or(|l| r > l),
                "{what}: rounds increase: {summed:?}"
            );
            last = Some(r);
            at += round.len();
        }
    }
}

#[test]
fn plan_pairwise_trees_like_caffe2() {
    let ord: Vec<i32> = (0..16).collect();
    let st = check_peer_plan(&ord[..4], &all_peer(4), "4 all-peer");
    assert_rounds(&st, &[&[(1, 0), (3, 2)], &[(2, 0)]], "4 all-peer");

    let st = check_peer_plan(&ord[..8], &all_peer(8), "8 all-peer");
    assert_rounds(
        &st,
        &[
            &[(1, 0), (3, 2), (5, 4), (7, 6)],
            &[(2, 0), (6, 4)],
            &[(4, 0)],
        ],
        "8 all-peer",
    );

    let st = check_peer_plan(&ord[..16], &all_peer(16), "16 all-peer");
    let r1: Vec<(usize, usize)> = (0..8).map(|k| (2 * k + 1, 2 * k)).collect();
    let r2: Vec<(usize, usize)> = (0..4).map(|k| (4 * k + 2, 4 * k)).collect();
    assert_rounds(
        &st,
        &[&r1, &r2, &[(4, 0), (12, 8)], &[(8, 0)]],
        "16 all-peer",
    );

    // other counts: a flat sum on the first replica
    for n in [2usize, 3, 5, 6, 7] {
        let what = format!("{n} all-peer");
        let st = check_peer_plan(&ord[..n], &all_peer(n), &what);
        let got: BTreeSet<(usize, usize)> = sums(&st).into_iter().collect();
        let want: BTreeSet<(usize, usize)> = (1..n).map(|r| (r, 0)).collect();
        assert_eq!(got, want, "{what}");
        assert_eq!(sums(&st).len(), n - 1, "{what}");
    }
}

#[test]
fn plan_pairwise_tree_with_partial_peer_access_never_reads_without_it() {
    // 4 replicas on 4 GPUs, peer access only within {0,1} and {2,3} (two PCIe switches).
    let mut m = vec![0u8; 16];
    for i in 0..4 {
        for k in 0..4 {
            m[i * 4 + k] = (i / 2 == k / 2) as u8;
        }
    }
    let st = check_peer_plan(&[0, 1, 2, 3], &m, "two islands");
    let s = sums(&st);
    assert_eq!(s.len(), 3, "{st:?}");
    // one-way access is not enough for a direct read
    let mut one_way = all_peer(3);
    one_way[1] = 0; // replica 0 cannot read replica 1, replica 1 can read replica 0
    let st = check_peer_plan(&[0, 1, 2], &one_way, "one-way 0<-1");
    for x in &st {
        if x.via == "peer" {
            let pair = (
                x.src.unwrap().min(x.dst.unwrap()),
                x.src.unwrap().max(x.dst.unwrap()),
            );
            assert_ne!(pair, (0, 1), "{x:?}");
        }
    }
}

#[test]
fn plan_nccl_with_replicas_sharing_a_gpu() {
    let ordinals = [0, 0, 1, 1];
    let j = cuda_plan(&ordinals, None, T_NCCL);
    assert_eq!(j["transport"], "nccl");
    let st = steps_of(&j);
    let s: Vec<&Step> = st.iter().filter(|s| s.op == "sum").collect();
    assert_eq!(s.len(), 2, "one local sum per GPU pair: {st:?}");
    let mut leaders = BTreeSet::new();
    for x in &s {
        let (a, b) = (x.src.unwrap(), x.dst.unwrap());
        assert_eq!(
            ordinals[a], ordinals[b],
            "local sums stay on one GPU: {x:?}"
        );
        assert_eq!(x.via, "local", "{x:?}");
        leaders.insert(ordinals[b]);
    }
    assert_eq!(leaders, BTreeSet::from([0, 1]));
    let nccl: Vec<&Step> = st.iter().filter(|s| s.op == "nccl_allreduce").collect();
    assert_eq!(nccl.len(), 2, "one nccl_allreduce per distinct GPU: {st:?}");
    let gpus: BTreeSet<i32> = nccl
        .iter()
        .map(|x| ordinals[x.dst.or(x.src).expect("nccl step replica")])
        .collect();
    assert_eq!(gpus, BTreeSet::from([0, 1]), "{st:?}");
    for x in &nccl {
        assert_eq!(x.via, "nccl", "{x:?}");
    }
    for x in st.iter().filter(|s| s.op == "copy") {
        assert_eq!(
            ordinals[x.src.unwrap()],
            ordinals[x.dst.unwrap()],
            "copies back stay local: {x:?}"
        );
    }
    assert_plan_reduces(4, &st, "nccl [0,0,1,1]");

    // distinct GPUs: NCCL only
    let j = cuda_plan(&[0, 1, 2], None, T_NCCL);
    let st = steps_of(&j);
    assert_eq!(
        st.iter().filter(|s| s.op == "nccl_allreduce").count(),
        3,
        "{st:?}"
    );
    assert!(sums(&st).is_empty(), "{st:?}");
    assert_plan_reduces(3, &st, "nccl [0,1,2]");
}

#[test]
fn plan_peer_copy_with_replicas_sharing_a_gpu_sums_locally() {
    let ordinals = [0, 0, 1, 1];
    let mut m = vec![0u8; 16];
    for i in 0..4 {
        for k in 0..4 {
            m[i * 4 + k] = (ordinals[i] == ordinals[k]) as u8;
        }
    }
    let st = check_peer_plan(&ordinals, &m, "peer_copy [0,0,1,1] no peer");
    assert_eq!(sums(&st).len(), 3, "{st:?}");
}
