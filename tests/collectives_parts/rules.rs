//! Rounding and overflow rules, the threaded path, mixed dtypes, no grads and one replica.

use super::*;

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
