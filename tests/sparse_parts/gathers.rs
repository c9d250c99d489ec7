//! Sparse gathers that work: Caffe2's equivalence and shared indices, row counts, dtypes, AVG,
//! outputs, describe.

use super::*;

// ------------------------------------------------------------------ Caffe2's test_equiv_sparse

/// The model and the comparisons are in tests/common/embedding.rs, shared with the CUDA version
/// (tests/cuda_sparse.rs).
#[test]
fn equiv_sparse_embedding_model_trains_alike_on_1_2_and_4_replicas_coalesced_or_not() {
    let sets: [&[i32]; 3] = [&[0], &[0, 0], &[0, 0, 0, 0]];
    assert!(common::embedding::equiv_sparse(
        &common::place::Place::Host,
        sets,
        T_AUTO
    ));
}

// ------------------------------------------------------------------ Caffe2's test_sparse_shared_indices

#[test]
fn shared_indices_gather_once_and_match_the_value_rows_on_1_2_4_8_replicas() {
    for coalesce in [false, true] {
        for n in [1usize, 2, 4, 8] {
            let o = Options::host(n);
            o.set_sparse_coalesce(coalesce);
            let ctx = Context::new(&o);
            // Three slices of different row lengths and dtypes over one indices buffer.
            ctx.reg_sparse_all("a", 2, F32, I64, 6);
            ctx.reg_sparse_all("b", 3, F64, I64, 6);
            ctx.reg_sparse_all("c", 1, F16, I64, 6);
            let mut g = Lcg::new(n as u64 * 31 + coalesce as u64);
            let idx: Vec<Vec<i64>> = (0..n)
                .map(|r| (0..2 + r).map(|_| g.below(6) as i64).collect())
                .collect();
            let a: Vec<Vec<f32>> = idx
                .iter()
                .map(|i| (0..i.len() * 2).map(|_| g.spread() as f32).collect())
                .collect();
            let b: Vec<Vec<f64>> = idx
                .iter()
                .map(|i| (0..i.len() * 3).map(|_| g.spread()).collect())
                .collect();
            let c: Vec<Vec<u16>> = idx
                .iter()
                .map(|i| {
                    (0..i.len())
                        .map(|_| f32_to_f16(g.spread() as f32))
                        .collect()
                })
                .collect();
            for r in 0..n {
                check(ctx.sparse_set("a", r, &idx[r], &a[r]), "set a");
                check(ctx.sparse_set("b", r, &idx[r], &b[r]), "set b");
                check(ctx.sparse_set("c", r, &idx[r], &c[r]), "set c");
            }
            check(ctx.allreduce_grads(SUM), "allreduce_grads");
            let parts = |v: &[Vec<f32>]| -> Vec<(Vec<i64>, Vec<f32>)> {
                idx.iter().cloned().zip(v.iter().cloned()).collect()
            };
            let (want_idx, want_a, want_b, want_c) = if coalesce {
                let (i, va) = coalesce_ref(&parts(&a), 2, id_f32, id_f32);
                let pb: Vec<_> = idx.iter().cloned().zip(b.iter().cloned()).collect();
                let pc: Vec<_> = idx.iter().cloned().zip(c.iter().cloned()).collect();
                let (_, vb) = coalesce_ref(&pb, 3, id_f64, id_f64);
                let (_, vc) = coalesce_ref(&pc, 1, f16_to_f32, f32_to_f16);
                (i, va, vb, vc)
            } else {
                (idx.concat(), a.concat(), b.concat(), c.concat())
            };
            let what = format!("{n} replicas, coalesce {coalesce}");
            for d in 0..n {
                let (ga, gb, gc) = (
                    ctx.gathered("a", d),
                    ctx.gathered("b", d),
                    ctx.gathered("c", d),
                );
                assert_eq!(ga.rows, want_idx.len(), "{what}: rows on replica {d}");
                assert_eq!(
                    (gb.rows, gc.rows),
                    (ga.rows, ga.rows),
                    "{what}: replica {d}"
                );
                assert_eq!(ga.indices, gb.indices, "{what}: one shared index gather");
                assert_eq!(ga.indices, gc.indices, "{what}: one shared index gather");
                assert_eq!(
                    ga.indices::<i64>(),
                    want_idx,
                    "{what}: indices on replica {d}"
                );
                assert_eq!(ga.values::<f32>(2), want_a, "{what}: 'a' on replica {d}");
                assert_eq!(gb.values::<f64>(3), want_b, "{what}: 'b' on replica {d}");
                assert_eq!(gc.values::<u16>(1), want_c, "{what}: 'c' on replica {d}");
            }
            let stats = sparse_stats(&ctx);
            assert_eq!(stats["index_gathers"], 1, "{what}: {stats}");
            if !coalesce {
                let rows: usize = idx.iter().map(Vec::len).sum();
                let bytes = n * rows * (8 + 2 * 4 + 3 * 8 + 2);
                assert_eq!(stats["bytes_copied"], bytes, "{what}: indices copied once");
            }
        }
    }
}

#[test]
fn a_shared_buffer_with_other_lengths_is_gathered_separately() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("a", 1, F32, I32, 0);
    ctx.reg_sparse_all("b", 1, F32, I32, 0);
    let idx = [vec![1i32, 2, 3], vec![4i32, 5]];
    let vals = [vec![1f32, 2., 3.], vec![4f32, 5.]];
    check(ctx.sparse_set("a", 0, &idx[0], &vals[0]), "set");
    check(ctx.sparse_set("a", 1, &idx[1], &vals[1]), "set");
    // 'b' reads the same buffers, but only the first two rows on replica 0.
    check(ctx.sparse_set("b", 0, &idx[0][..2], &vals[0][..2]), "set");
    check(ctx.sparse_set("b", 1, &idx[1], &vals[1]), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    for d in 0..2 {
        let (a, b) = (ctx.gathered("a", d), ctx.gathered("b", d));
        assert_eq!(a.indices::<i32>(), vec![1, 2, 3, 4, 5]);
        assert_eq!(a.values::<f32>(1), vec![1., 2., 3., 4., 5.]);
        assert_eq!(b.indices::<i32>(), vec![1, 2, 4, 5]);
        assert_eq!(b.values::<f32>(1), vec![1., 2., 4., 5.]);
        assert_ne!(a.indices, b.indices);
    }
    assert_eq!(sparse_stats(&ctx)["index_gathers"], 2);
}

// ------------------------------------------------------------------ row counts, dtypes, AVG

#[test]
fn uneven_and_zero_row_counts_with_both_index_dtypes() {
    let row_len = 3;
    for coalesce in [false, true] {
        for kind in [Idx::I32, Idx::I64] {
            let o = Options::host(4);
            o.set_sparse_coalesce(coalesce);
            let ctx = Context::new(&o);
            ctx.reg_sparse_all("emb", row_len, F32, kind.code(), 1000);
            for (step, rows) in [[3usize, 0, 5, 0], [0, 0, 0, 0], [0, 0, 0, 2], [1, 1, 1, 1]]
                .iter()
                .enumerate()
            {
                let mut g = Lcg::new(step as u64);
                let idx: Vec<Vec<i64>> = rows
                    .iter()
                    .map(|&n| (0..n).map(|_| g.below(4) as i64 * 250).collect())
                    .collect();
                let vals: Vec<Vec<f32>> = rows
                    .iter()
                    .map(|&n| (0..n * row_len).map(|_| g.below(100) as f32).collect())
                    .collect();
                let bufs: Vec<IdxBuf> = idx.iter().map(|i| IdxBuf::new(kind, i)).collect();
                for r in 0..4 {
                    let v = if vals[r].is_empty() {
                        ptr::null()
                    } else {
                        vals[r].as_ptr().cast()
                    };
                    check(
                        ctx.sparse_set_raw("emb", r, bufs[r].ptr(), v, rows[r]),
                        "set",
                    );
                }
                check(ctx.allreduce_grads(SUM), "allreduce_grads");
                let parts: Vec<_> = idx.iter().cloned().zip(vals.iter().cloned()).collect();
                let (want_idx, want_vals) = if coalesce {
                    coalesce_ref(&parts, row_len, id_f32, id_f32)
                } else {
                    (idx.concat(), vals.concat())
                };
                let what = format!("rows {rows:?}, {kind:?}, coalesce {coalesce}");
                for d in 0..4 {
                    let out = ctx.gathered("emb", d);
                    assert_eq!(
                        gathered_indices(&out, kind),
                        want_idx,
                        "{what}, replica {d}"
                    );
                    assert_eq!(out.values::<f32>(row_len), want_vals, "{what}, replica {d}");
                    if out.rows == 0 {
                        assert!(out.indices.is_null() && out.values.is_null(), "{what}");
                    }
                }
                let stats = sparse_stats(&ctx);
                assert_eq!(stats["gradients"][0]["rows_set"], serde_json::json!(rows));
            }
        }
    }
}

#[test]
fn half_and_double_values_gather_exactly_and_coalesce_in_f32() {
    // big + 1 + 1: added one at a time in 16 bits it stays big; in f32 it is big + 2, which
    // both formats represent (11 significant bits for f16, 8 for bf16).
    for (dtype, big, to, from) in [
        (
            F16,
            2048.0,
            f16_to_f32 as fn(u16) -> f32,
            f32_to_f16 as fn(f32) -> u16,
        ),
        (BF16, 256.0, bf16_to_f32, f32_to_bf16),
    ] {
        for coalesce in [false, true] {
            let o = Options::host(3);
            o.set_sparse_coalesce(coalesce);
            let ctx = Context::new(&o);
            ctx.reg_sparse_all("h", 1, dtype, I64, 0);
            let idx = [vec![7i64, 3], vec![7i64], vec![7i64]];
            let vals = [vec![from(big), from(0.5)], vec![from(1.0)], vec![from(1.0)]];
            for r in 0..3 {
                check(ctx.sparse_set("h", r, &idx[r], &vals[r]), "set");
            }
            check(ctx.allreduce_grads(SUM), "allreduce_grads");
            for d in 0..3 {
                let out = ctx.gathered("h", d);
                if coalesce {
                    assert_eq!(out.indices::<i64>(), vec![3, 7]);
                    let v: Vec<f32> = out.values::<u16>(1).into_iter().map(to).collect();
                    assert_eq!(v, vec![0.5, big + 2.0], "dtype {dtype}, replica {d}");
                } else {
                    assert_eq!(out.indices::<i64>(), vec![7, 3, 7, 7]);
                    assert_eq!(out.values::<u16>(1), vals.concat(), "bytes kept");
                }
            }
        }
    }
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("d", 2, F64, I32, 0);
    let v0 = [1e-300f64, -2.5];
    let v1 = [3.25f64, 1e300, 7.0, -0.0];
    check(ctx.sparse_set("d", 0, &[9i32], &v0), "set");
    check(ctx.sparse_set("d", 1, &[0i32, 9], &v1), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let out = ctx.gathered("d", 1);
    assert_eq!(out.indices::<i32>(), vec![9, 0, 9]);
    let bits: Vec<u64> = out.values::<f64>(2).iter().map(|x| x.to_bits()).collect();
    let want: Vec<u64> = v0.iter().chain(&v1).map(|x| x.to_bits()).collect();
    assert_eq!(bits, want);
}

#[test]
fn avg_divides_gathered_values_by_the_replica_count() {
    for coalesce in [false, true] {
        let o = Options::host(4);
        o.set_sparse_coalesce(coalesce);
        let ctx = Context::new(&o);
        ctx.reg_sparse_all("e", 2, F32, I64, 0);
        let mut dense: Vec<Vec<f32>> = (0..4).map(|r| vec![r as f32 * 4.0]).collect();
        for (r, d) in dense.iter_mut().enumerate() {
            ctx.reg("g", GRAD, r, d, F32);
        }
        let vals: Vec<Vec<f32>> = (0..4).map(|r| vec![r as f32 + 1.0, -8.0]).collect();
        for (r, v) in vals.iter().enumerate() {
            check(ctx.sparse_set("e", r, &[5i64], v), "set");
        }
        check(ctx.allreduce_grads(AVG), "allreduce_grads");
        let out = ctx.gathered("e", 2);
        if coalesce {
            assert_eq!(out.values::<f32>(2), vec![2.5, -8.0]); // (1+2+3+4)/4, 4 x -8 / 4
        } else {
            let want: Vec<f32> = vals.concat().iter().map(|x| x / 4.0).collect();
            assert_eq!(out.values::<f32>(2), want);
        }
        assert!(
            dense.iter().all(|d| d[0] == 6.0),
            "dense AVG too: {dense:?}"
        );
    }
}

#[test]
fn outputs_live_until_the_next_step_and_slices_must_be_set_again() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("e", 1, F32, I32, 0);
    check(ctx.sparse_set("e", 0, &[1i32], &[1f32]), "set");
    check(ctx.sparse_set("e", 1, &[2i32], &[2f32]), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let first = ctx.gathered("e", 0);
    assert_eq!(ctx.gathered("e", 0), first, "stable until the next step");
    // Consumed by the step: the next one needs new slices.
    expect_err(
        ctx.allreduce_grads(SUM),
        INCONSISTENT,
        &["'e'", "replica 0", "no slice"],
    );
    assert_eq!(
        first.values::<f32>(1),
        vec![1., 2.],
        "a failed step keeps the outputs"
    );
    // Setting twice before a step: the second slice replaces the first.
    check(ctx.sparse_set("e", 0, &[3i32], &[3f32]), "set");
    check(ctx.sparse_set("e", 0, &[4i32, 5], &[4f32, 5.]), "set");
    check(ctx.sparse_set("e", 1, &[6i32], &[6f32]), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    assert_eq!(ctx.gathered("e", 1).indices::<i32>(), vec![4, 5, 6]);
}

#[test]
fn outputs_are_double_buffered_and_keep_their_values_for_one_step() {
    // Step k writes into the memory step k - 2 produced (those slices are no longer valid), so a
    // steady stream allocates nothing; step k - 1's slices are untouched by step k.
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("e", 2, F32, I64, 0);
    let mut seen = Vec::new();
    for step in 0..4i64 {
        // The slices must live until allreduce_grads (dpsync keeps the pointers).
        let (i0, v0) = ([step], [step as f32, 0.]);
        let (i1, v1) = ([step + 10], [1., step as f32]);
        check(ctx.sparse_set("e", 0, &i0, &v0), "set");
        check(ctx.sparse_set("e", 1, &i1, &v1), "set");
        let before = seen.last().map(|o: &SparseOut| o.values::<f32>(2));
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        let out = ctx.gathered("e", 0);
        assert_eq!(out.indices::<i64>(), vec![step, step + 10]);
        if let (Some(prev), Some(before)) = (seen.last(), before) {
            assert_ne!(
                prev.values, out.values,
                "step {step} wrote into last step's slice"
            );
            assert_eq!(
                prev.values::<f32>(2),
                before,
                "last step's slice kept its values"
            );
        }
        if step >= 2 {
            assert_eq!(
                out.values,
                seen[step as usize - 2].values,
                "step {step} reused k - 2"
            );
        }
        seen.push(out);
    }
}

// ------------------------------------------------------------------ describe

#[test]
fn describe_lists_sparse_gradients_and_the_last_gather() {
    let o = Options::host(2);
    o.set_sparse_coalesce(true);
    let plan = o.plan_json();
    assert_eq!(plan["sparse"], serde_json::json!([]));
    assert_eq!(plan["sparse_gather"]["coalesce"], true);
    let ctx = Context::new(&o);
    assert!(ctx.describe_json()["sparse_last_step"].is_null());
    ctx.reg_sparse_all("emb", 8, BF16, I32, 100);
    check(ctx.register_sparse("half", 0, 4, F32, I64, 0), "register");
    let json = ctx.describe_json();
    assert_eq!(
        json["sparse"],
        serde_json::json!([{"name": "emb", "row_len": 8, "value_dtype": "bf16",
                            "index_dtype": "i32", "num_embeddings": 100, "coalesce": true}])
    );
    let problems = json["problems"].to_string();
    assert!(
        problems.contains("sparse gradient 'half': not registered on replica 1"),
        "{problems}"
    );
    check(ctx.unregister("half"), "unregister");
    let vals = vec![0u16; 8];
    check(ctx.sparse_set("emb", 0, &[3i32], &vals), "set");
    check(ctx.sparse_set("emb", 1, &[3i32], &vals), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let stats = sparse_stats(&ctx);
    assert_eq!(stats["coalesce"], true);
    assert_eq!(stats["gradients"][0]["rows"], 1, "{stats}");
    assert_eq!(
        stats["gradients"][0]["rows_sent"],
        serde_json::json!([1, 1])
    );
}
