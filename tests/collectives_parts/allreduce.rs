//! Allreduce and broadcast against the reference: every dtype, size, root and replica count.

use super::*;

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
