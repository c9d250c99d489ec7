//! Sparse gradient slices on host replicas, through the C ABI:
//!
//! - Caffe2's `test_equiv_sparse`: an embedding-bag model trained with sparse SGD on 1, 2 and 4
//!   replicas ends with the same table (allclose), with both index dtypes, coalescing on and off.
//! - Caffe2's `test_sparse_shared_indices`: three slices sharing one indices buffer; on 1, 2, 4
//!   and 8 replicas every replica's gathered slices have equal lengths, one shared index gather,
//!   and exactly as many gathered indices as value rows.
//! - Uneven and zero row counts, i32/i64 indices, f16/bf16/f64 values, AVG, coalesced results
//!   against a reference.
//! - Every bad input: the status, a message naming the gradient and replica, and nothing
//!   changed (dense gradients, previous outputs, the slices already set).

mod common {
    pub mod abi;
    pub mod buf;
    pub mod close;
    pub mod context;
    pub mod cuda_context;
    pub mod embedding;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod place;
    pub mod skip;
    pub mod sparse;
}

use common::{abi::*, context::*, errors::*, float16::*, lcg::*, sparse::*};
use dpsync::*;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr;

const INVALID_STATE: dpsync_status = dpsync_status::DPSYNC_STATUS_INVALID_STATE;

// ------------------------------------------------------------------ index buffers of either dtype

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Idx {
    I32,
    I64,
}

impl Idx {
    fn code(self) -> u32 {
        match self {
            Idx::I32 => I32,
            Idx::I64 => I64,
        }
    }
}

/// Indices in the registered dtype, kept alive until the step that reads them.
#[derive(Clone, Debug)]
enum IdxBuf {
    I32(Vec<i32>),
    I64(Vec<i64>),
}

impl IdxBuf {
    fn new(kind: Idx, v: &[i64]) -> IdxBuf {
        match kind {
            Idx::I32 => IdxBuf::I32(v.iter().map(|&i| i as i32).collect()),
            Idx::I64 => IdxBuf::I64(v.to_vec()),
        }
    }

    fn len(&self) -> usize {
        match self {
            IdxBuf::I32(v) => v.len(),
            IdxBuf::I64(v) => v.len(),
        }
    }

    fn ptr(&self) -> *const c_void {
        if self.len() == 0 {
            return ptr::null();
        }
        match self {
            IdxBuf::I32(v) => v.as_ptr().cast(),
            IdxBuf::I64(v) => v.as_ptr().cast(),
        }
    }
}

/// The gathered indices widened to i64.
fn gathered_indices(out: &SparseOut, kind: Idx) -> Vec<i64> {
    match kind {
        Idx::I32 => out.indices::<i32>().into_iter().map(i64::from).collect(),
        Idx::I64 => out.indices::<i64>(),
    }
}

/// The reference coalescing: each replica's rows of equal index summed in input order, then the
/// replicas' sums in world order; each level accumulates in `A` and rounds once to `T`.
fn coalesce_ref<T: Copy, A: Copy + std::ops::Add<Output = A>>(
    parts: &[(Vec<i64>, Vec<T>)],
    row_len: usize,
    widen: fn(T) -> A,
    narrow: fn(A) -> T,
) -> (Vec<i64>, Vec<T>) {
    fn sum_into<T: Copy, A: Copy + std::ops::Add<Output = A>>(
        map: &mut BTreeMap<i64, Vec<A>>,
        index: i64,
        row: &[T],
        widen: fn(T) -> A,
    ) {
        match map.get_mut(&index) {
            Some(acc) => acc
                .iter_mut()
                .zip(row)
                .for_each(|(a, &x)| *a = *a + widen(x)),
            None => {
                map.insert(index, row.iter().map(|&x| widen(x)).collect());
            }
        }
    }
    let mut total: BTreeMap<i64, Vec<A>> = BTreeMap::new();
    for (indices, values) in parts {
        let mut local: BTreeMap<i64, Vec<A>> = BTreeMap::new();
        for (k, &i) in indices.iter().enumerate() {
            sum_into(
                &mut local,
                i,
                &values[k * row_len..(k + 1) * row_len],
                widen,
            );
        }
        for (i, acc) in local {
            let rounded: Vec<T> = acc.into_iter().map(narrow).collect();
            sum_into(&mut total, i, &rounded, widen);
        }
    }
    let keys = total.keys().copied().collect();
    let values = total
        .into_values()
        .flat_map(|acc| acc.into_iter().map(narrow))
        .collect();
    (keys, values)
}

fn id_f32(x: f32) -> f32 {
    x
}

fn id_f64(x: f64) -> f64 {
    x
}

fn sparse_stats(ctx: &Context) -> serde_json::Value {
    ctx.describe_json()["sparse_last_step"].clone()
}

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

// ------------------------------------------------------------------ bad input

/// Replica-order buffers for two sparse gradients and one dense gradient on 3 replicas.
struct Fx {
    ctx: Context,
    coalesce: bool,
    dense: Vec<Vec<f32>>,
    idx64: Vec<Vec<i64>>,
    vals64: Vec<Vec<f32>>,
    idx32: Vec<Vec<i32>>,
    vals32: Vec<Vec<f32>>,
}

const N: usize = 3;

impl Fx {
    /// Registered, with one successful step done (so there are outputs to keep).
    fn new(coalesce: bool) -> Fx {
        let o = Options::host(N);
        o.set_sparse_coalesce(coalesce);
        let ctx = Context::new(&o);
        let mut fx = Fx {
            ctx,
            coalesce,
            dense: (0..N).map(|r| vec![r as f32 + 1.0; 4]).collect(),
            idx64: (0..N).map(|r| vec![r as i64, 9]).collect(),
            vals64: (0..N).map(|r| vec![r as f32; 4]).collect(),
            idx32: (0..N).map(|r| vec![r as i32 * 2]).collect(),
            vals32: (0..N).map(|r| vec![r as f32 + 0.5]).collect(),
        };
        for r in 0..N {
            fx.ctx.reg("g", GRAD, r, &mut fx.dense[r], F32);
        }
        fx.ctx.reg_sparse_all("emb", 2, F32, I64, 10);
        fx.ctx.reg_sparse_all("emb32", 1, F32, I32, 10);
        fx.set_all();
        check(fx.ctx.allreduce_grads(SUM), "first step");
        // Distinct per replica again, so that a reduction would show.
        for (r, d) in fx.dense.iter_mut().enumerate() {
            d.iter_mut().for_each(|x| *x = r as f32 * 10.0);
        }
        fx
    }

    fn set(&self, name: &str, r: usize) {
        let st = match name {
            "emb" => self
                .ctx
                .sparse_set(name, r, &self.idx64[r], &self.vals64[r]),
            _ => self
                .ctx
                .sparse_set(name, r, &self.idx32[r], &self.vals32[r]),
        };
        check(st, &format!("set '{name}' on {r}"));
    }

    fn set_all(&self) {
        for r in 0..N {
            self.set("emb", r);
            self.set("emb32", r);
        }
    }

    /// Every replica's outputs: pointers and contents.
    fn outputs(&self) -> Vec<(SparseOut, Vec<i64>, Vec<f32>)> {
        let mut v = Vec::new();
        for r in 0..N {
            let o = self.ctx.gathered("emb", r);
            v.push((o, o.indices::<i64>(), o.values::<f32>(2)));
            let o = self.ctx.gathered("emb32", r);
            let i = o.indices::<i32>().into_iter().map(i64::from).collect();
            v.push((o, i, o.values::<f32>(1)));
        }
        v
    }

    /// A failed allreduce_grads: status and message, dense gradients and earlier outputs as they
    /// were; then `fix` and the step succeeds (the slices set before the failure still count).
    #[track_caller]
    fn fails_then_recovers(
        &mut self,
        want: dpsync_status,
        needles: &[&str],
        fix: impl FnOnce(&mut Fx),
    ) {
        let dense = self.dense.clone();
        let outputs = self.outputs();
        expect_err(self.ctx.allreduce_grads(SUM), want, needles);
        assert_eq!(self.dense, dense, "a failed step changed a dense gradient");
        assert_eq!(
            self.outputs(),
            outputs,
            "a failed step changed the gathered slices"
        );
        fix(self);
        check(self.ctx.allreduce_grads(SUM), "the step after the fix");
        let sum: f32 = (0..N).map(|r| r as f32 * 10.0).sum();
        assert!(
            self.dense.iter().all(|d| d.iter().all(|&x| x == sum)),
            "{:?}",
            self.dense
        );
        // Indices r and 9 on every replica r: 9 repeats.
        let rows = if self.coalesce { N + 1 } else { 2 * N };
        assert_eq!(self.ctx.gathered("emb", 1).rows, rows);
    }
}

#[test]
fn a_slice_missing_on_a_replica_fails_the_step_and_changes_nothing() {
    for coalesce in [false, true] {
        let mut fx = Fx::new(coalesce);
        fx.set("emb", 0);
        fx.set("emb", 1);
        fx.set("emb32", 0);
        fx.set("emb32", 1);
        fx.set("emb32", 2);
        fx.fails_then_recovers(
            INCONSISTENT,
            &["'emb'", "replica 2", "dpsync_sparse_set"],
            |fx| fx.set("emb", 2),
        );
    }
}

#[test]
fn indices_out_of_range_fail_the_step_and_change_nothing() {
    for coalesce in [false, true] {
        // Too large (i64), negative (i64), too large (i32), negative (i32).
        for (name, replica, bad, needle) in [
            ("emb", 1, 10i64, "index 10 at row 1 on replica 1"),
            ("emb", 2, -1, "index -1 at row 1 on replica 2"),
            ("emb32", 0, 10, "index 10 at row 0 on replica 0"),
            (
                "emb32",
                2,
                i32::MIN as i64,
                "index -2147483648 at row 0 on replica 2",
            ),
        ] {
            let mut fx = Fx::new(coalesce);
            if name == "emb" {
                fx.idx64[replica][1] = bad;
            } else {
                fx.idx32[replica][0] = bad as i32;
            }
            // Indices are read by the step, so a buffer filled after sparse_set counts.
            fx.set_all();
            fx.fails_then_recovers(
                INCONSISTENT,
                &[&format!("'{name}'"), needle, "[0, 10)"],
                |fx| {
                    fx.idx64[replica][1] = 9;
                    fx.idx32[replica][0] = 0;
                },
            );
        }
    }
}

#[test]
fn no_range_check_without_num_embeddings() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("free", 1, F32, I64, 0);
    check(ctx.sparse_set("free", 0, &[-5i64], &[1f32]), "set");
    check(ctx.sparse_set("free", 1, &[i64::MAX], &[2f32]), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    assert_eq!(ctx.gathered("free", 1).indices::<i64>(), vec![-5, i64::MAX]);
}

/// A bound at or above 2^63 (SIZE_MAX: "only check >= 0") still refuses negative indices: the
/// unsigned comparison that covers both ends needs the bound capped at 2^63.
#[test]
fn negative_indices_are_out_of_range_under_any_bound() {
    let huge = [usize::MAX, (1usize << 63) + 5, 1usize << 63];
    for (num_embeddings, coalesce) in huge.iter().flat_map(|&n| [(n, false), (n, true)]) {
        let o = Options::host(2);
        o.set_sparse_coalesce(coalesce);
        let ctx = Context::new(&o);
        ctx.reg_sparse_all("e32", 1, F32, I32, num_embeddings);
        ctx.reg_sparse_all("e64", 1, F32, I64, num_embeddings);
        for (bad32, bad64) in [(-2i32, -2i64), (i32::MIN, i64::MIN)] {
            check(ctx.sparse_set("e32", 0, &[3i32], &[1f32]), "set");
            check(ctx.sparse_set("e32", 1, &[bad32], &[1f32]), "set");
            check(ctx.sparse_set("e64", 0, &[i64::MAX], &[1f32]), "set");
            check(ctx.sparse_set("e64", 1, &[4i64], &[1f32]), "set");
            let needle = format!("index {bad32}");
            expect_err(
                ctx.allreduce_grads(SUM),
                INCONSISTENT,
                &["'e32'", "replica 1", &needle],
            );
            check(ctx.sparse_set("e32", 1, &[5i32], &[1f32]), "set");
            check(ctx.sparse_set("e64", 1, &[bad64], &[1f32]), "set");
            let needle = format!("index {bad64}");
            expect_err(
                ctx.allreduce_grads(SUM),
                INCONSISTENT,
                &["'e64'", "replica 1", &needle],
            );
            // The largest index an i64 can hold is in range.
            check(ctx.sparse_set("e64", 1, &[i64::MAX], &[1f32]), "set");
            check(ctx.allreduce_grads(SUM), "allreduce_grads");
        }
    }
}

#[test]
fn replicas_that_disagree_fail_the_step_naming_gradient_and_replica() {
    for (needles, register) in [
        (
            ["'late'", "replica 2", "not registered"],
            Box::new(|c: &Context| {
                check(c.register_sparse("late", 0, 2, F32, I64, 10), "r0");
                check(c.register_sparse("late", 1, 2, F32, I64, 10), "r1");
            }) as Box<dyn Fn(&Context)>,
        ),
        (
            ["'late'", "replica 1", "row_len 3"],
            Box::new(|c: &Context| {
                check(c.register_sparse("late", 0, 2, F32, I64, 10), "r0");
                check(c.register_sparse("late", 1, 3, F32, I64, 10), "r1");
                check(c.register_sparse("late", 2, 2, F32, I64, 10), "r2");
            }),
        ),
        (
            ["'late'", "replica 2", "value dtype f16"],
            Box::new(|c: &Context| {
                check(c.register_sparse("late", 0, 2, F32, I64, 10), "r0");
                check(c.register_sparse("late", 1, 2, F32, I64, 10), "r1");
                check(c.register_sparse("late", 2, 2, F16, I64, 10), "r2");
            }),
        ),
        (
            ["'late'", "replica 1", "index dtype i32"],
            Box::new(|c: &Context| {
                check(c.register_sparse("late", 0, 2, F32, I64, 10), "r0");
                check(c.register_sparse("late", 1, 2, F32, I32, 10), "r1");
                check(c.register_sparse("late", 2, 2, F32, I64, 10), "r2");
            }),
        ),
        (
            ["'late'", "replica 1", "num_embeddings 11"],
            Box::new(|c: &Context| {
                check(c.register_sparse("late", 0, 2, F32, I64, 10), "r0");
                check(c.register_sparse("late", 1, 2, F32, I64, 11), "r1");
                check(c.register_sparse("late", 2, 2, F32, I64, 10), "r2");
            }),
        ),
    ] {
        for coalesce in [false, true] {
            let mut fx = Fx::new(coalesce);
            register(&fx.ctx);
            fx.set_all();
            fx.fails_then_recovers(INCONSISTENT, &needles, |fx| {
                check(fx.ctx.unregister("late"), "unregister");
            });
        }
    }
}

#[test]
fn register_sparse_rejects_bad_arguments_and_changes_nothing() {
    let ctx = Context::host(3, None);
    let name = cstr("emb");
    let empty = cstr("");
    // SAFETY: deliberate NULL and bad arguments; valid otherwise.
    unsafe {
        let st = dpsync_register_sparse(ptr::null_mut(), name.as_ptr(), 0, 4, F32, I64, 0);
        expect_err(st, INVALID_ARGUMENT, &["context is NULL"]);
        let st = dpsync_register_sparse(ctx.0, ptr::null(), 0, 4, F32, I64, 0);
        expect_err(st, INVALID_ARGUMENT, &["name is NULL"]);
        let st = dpsync_register_sparse(ctx.0, empty.as_ptr(), 0, 4, F32, I64, 0);
        expect_err(st, INVALID_ARGUMENT, &["name is empty"]);
    }
    let cases: [(usize, usize, u32, u32, &[&str]); 7] = [
        (3, 4, F32, I64, &["replica 3", "3 replicas"]),
        (1, 0, F32, I64, &["row_len is 0", "'emb'", "replica 1"]),
        (1, 4, I32, I64, &["value_dtype is 4", "'emb'", "replica 1"]),
        (2, 4, 99, I64, &["value_dtype is 99", "'emb'", "replica 2"]),
        (
            0,
            4,
            F32,
            F32,
            &["index_dtype is 0", "I32/I64", "'emb'", "replica 0"],
        ),
        (0, 4, F32, 6, &["index_dtype is 6", "'emb'"]),
        (
            1,
            usize::MAX,
            F64,
            I64,
            &["row_len", "too large", "'emb'", "replica 1"],
        ),
    ];
    for (replica, row_len, vd, id, needles) in cases {
        let st = ctx.register_sparse("emb", replica, row_len, vd, id, 0);
        expect_err(st, INVALID_ARGUMENT, needles);
    }
    let json = ctx.describe_json();
    assert_eq!(json["sparse"], serde_json::json!([]), "nothing registered");
    assert_eq!(json["problems"], serde_json::json!([]));
    // Identical again: no-op. Different on the same replica: CONFLICT, the first one kept.
    check(ctx.register_sparse("emb", 1, 4, F32, I64, 0), "register");
    check(
        ctx.register_sparse("emb", 1, 4, F32, I64, 0),
        "identical again",
    );
    let st = ctx.register_sparse("emb", 1, 4, F32, I64, 5);
    expect_err(
        st,
        CONFLICT,
        &["'emb'", "replica 1", "num_embeddings 0", "num_embeddings 5"],
    );
    let st = ctx.register_sparse("emb", 1, 4, BF16, I64, 0);
    expect_err(st, CONFLICT, &["'emb'", "replica 1"]);
    ctx.reg_sparse_all("emb", 4, F32, I64, 0);
    // Dense and sparse names are one namespace.
    let mut dense = vec![0f32; 4];
    ctx.reg("w_grad", GRAD, 0, &mut dense, F32);
    let st = ctx.register_sparse("w_grad", 0, 4, F32, I64, 0);
    expect_err(st, CONFLICT, &["'w_grad'", "dense"]);
    let st = ctx.register("emb", GRAD, 0, &mut dense, F32);
    expect_err(st, CONFLICT, &["'emb'", "sparse gradient"]);
    let json = ctx.describe_json();
    assert_eq!(json["sparse"].as_array().unwrap().len(), 1);
    assert_eq!(json["sparse"][0]["num_embeddings"], 0);
}

/// (name, replica, indices, values, rows, expected status, message needles)
type SetCase<'a> = (
    &'a str,
    usize,
    *const c_void,
    *const c_void,
    usize,
    dpsync_status,
    &'a [&'a str],
);

#[test]
fn sparse_set_rejects_bad_arguments_and_keeps_the_slice_already_set() {
    let ctx = Context::host(3, None);
    ctx.reg_sparse_all("emb", 2, F32, I64, 0);
    check(
        ctx.register_sparse("partial", 0, 2, F32, I64, 0),
        "register",
    );
    let mut dense = [vec![1f32], vec![1f32], vec![1f32]];
    for (r, d) in dense.iter_mut().enumerate() {
        ctx.reg("w_grad", GRAD, r, d, F32);
    }
    let idx = [4i64, 5];
    let vals = [1f32, 2., 3., 4.];
    let good: Vec<(Vec<i64>, Vec<f32>)> = (0..3)
        .map(|r| (vec![r as i64], vec![r as f32; 2]))
        .collect();
    for (r, (i, v)) in good.iter().enumerate() {
        check(ctx.sparse_set("emb", r, i, v), "set");
    }
    let (ip, vp) = (
        idx.as_ptr().cast::<c_void>(),
        vals.as_ptr().cast::<c_void>(),
    );
    let cases: [SetCase; 8] = [
        (
            "emb",
            1,
            ip,
            ptr::null(),
            2,
            INVALID_ARGUMENT,
            &["values is NULL", "'emb'", "replica 1"],
        ),
        (
            "emb",
            2,
            ptr::null(),
            vp,
            1,
            INVALID_ARGUMENT,
            &["indices is NULL", "'emb'", "replica 2"],
        ),
        (
            "emb",
            3,
            ip,
            vp,
            2,
            INVALID_ARGUMENT,
            &["replica 3", "3 replicas"],
        ),
        (
            "nope",
            0,
            ip,
            vp,
            2,
            NOT_FOUND,
            &["'nope'", "not registered"],
        ),
        ("w_grad", 0, ip, vp, 2, NOT_FOUND, &["'w_grad'", "dense"]),
        (
            "partial",
            2,
            ip,
            vp,
            2,
            INCONSISTENT,
            &["'partial'", "not registered on replica 2"],
        ),
        (
            "emb",
            0,
            ip.wrapping_byte_add(4),
            vp,
            1,
            INVALID_ARGUMENT,
            &["indices", "aligned", "'emb'"],
        ),
        (
            "emb",
            0,
            ip,
            vp.wrapping_byte_add(2),
            1,
            INVALID_ARGUMENT,
            &["values", "aligned", "replica 0"],
        ),
    ];
    for (name, replica, i, v, rows, want, needles) in cases {
        expect_err(ctx.sparse_set_raw(name, replica, i, v, rows), want, needles);
    }
    let st = ctx.sparse_set_raw("emb", 0, ip, vp, usize::MAX / 2);
    expect_err(st, INVALID_ARGUMENT, &["too large", "'emb'", "replica 0"]);
    let c = cstr("emb");
    // SAFETY: deliberate NULL context and name.
    unsafe {
        expect_err(
            dpsync_sparse_set(ptr::null_mut(), c.as_ptr(), 0, ip, vp, 1),
            INVALID_ARGUMENT,
            &["context is NULL"],
        );
        expect_err(
            dpsync_sparse_set(ctx.0, ptr::null(), 0, ip, vp, 1),
            INVALID_ARGUMENT,
            &["name is NULL"],
        );
    }
    check(ctx.unregister("partial"), "unregister");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let out = ctx.gathered("emb", 0);
    assert_eq!(
        out.indices::<i64>(),
        vec![0, 1, 2],
        "the failed sets changed no slice"
    );
    assert_eq!(out.values::<f32>(2), vec![0., 0., 1., 1., 2., 2.]);
}

#[test]
fn sparse_get_rejects_bad_arguments_and_writes_no_output() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("emb", 1, F32, I32, 0);
    let c = cstr("emb");
    let sentinel = 0x5a5a as *const c_void;
    let (mut i, mut v, mut rows) = (sentinel, sentinel, 77usize);
    // SAFETY: valid handle and out pointers; deliberate bad arguments.
    let get = |name: *const std::ffi::c_char, replica, i: *mut *const c_void, v, rows| unsafe {
        dpsync_sparse_get(ctx.0, name, replica, i, v, rows)
    };
    expect_err(
        get(c.as_ptr(), 0, &mut i, &mut v, &mut rows),
        INVALID_STATE,
        &["'emb'", "dpsync_allreduce_grads"],
    );
    check(ctx.sparse_set("emb", 0, &[1i32], &[1f32]), "set");
    check(ctx.sparse_set("emb", 1, &[2i32], &[2f32]), "set");
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    // The dense collective on a sparse name says what the name is.
    expect_err(
        ctx.allreduce("emb", SUM),
        NOT_FOUND,
        &["'emb'", "sparse gradient"],
    );
    let nope = cstr("nope");
    expect_err(
        get(nope.as_ptr(), 0, &mut i, &mut v, &mut rows),
        NOT_FOUND,
        &["'nope'"],
    );
    expect_err(
        get(c.as_ptr(), 2, &mut i, &mut v, &mut rows),
        INVALID_ARGUMENT,
        &["replica 2"],
    );
    expect_err(
        get(ptr::null(), 0, &mut i, &mut v, &mut rows),
        INVALID_ARGUMENT,
        &["name is NULL"],
    );
    expect_err(
        get(c.as_ptr(), 0, ptr::null_mut(), &mut v, &mut rows),
        INVALID_ARGUMENT,
        &["indices is NULL"],
    );
    expect_err(
        get(c.as_ptr(), 0, &mut i, ptr::null_mut(), &mut rows),
        INVALID_ARGUMENT,
        &["values is NULL"],
    );
    expect_err(
        get(c.as_ptr(), 0, &mut i, &mut v, ptr::null_mut()),
        INVALID_ARGUMENT,
        &["rows is NULL"],
    );
    assert_eq!(
        (i, v, rows),
        (sentinel, sentinel, 77),
        "outputs are written only on success"
    );
    // SAFETY: deliberate NULL context.
    let st =
        unsafe { dpsync_sparse_get(ptr::null_mut(), c.as_ptr(), 0, &mut i, &mut v, &mut rows) };
    expect_err(st, INVALID_ARGUMENT, &["context is NULL"]);
    check(get(c.as_ptr(), 1, &mut i, &mut v, &mut rows), "get");
    assert_eq!(rows, 2);
    // SAFETY: NULL options.
    let st = unsafe { dpsync_options_set_sparse_coalesce(ptr::null_mut(), true) };
    expect_err(st, INVALID_ARGUMENT, &["options is NULL"]);
}

#[test]
fn unregister_removes_a_sparse_gradient() {
    let ctx = Context::host(2, None);
    ctx.reg_sparse_all("emb", 1, F32, I64, 0);
    ctx.reg_sparse_all("keep", 1, F32, I64, 0);
    for r in 0..2 {
        check(ctx.sparse_set("emb", r, &[r as i64], &[1f32]), "set");
        check(ctx.sparse_set("keep", r, &[r as i64], &[2f32]), "set");
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let old = ctx.gathered("emb", 1);
    check(ctx.unregister("emb"), "unregister");
    expect_err(ctx.unregister("emb"), NOT_FOUND, &["'emb'"]);
    assert_eq!(ctx.sparse_get("emb", 0), Err(NOT_FOUND));
    // Its outputs stay readable until the next step, as the contract promises.
    assert_eq!(old.values::<f32>(1), vec![1., 1.]);
    assert_eq!(ctx.gathered("keep", 0).values::<f32>(1), vec![2., 2.]);
    // Registered again: a new gradient, not gathered yet.
    ctx.reg_sparse_all("emb", 3, F64, I32, 0);
    expect_err(
        ctx.sparse_get("emb", 0).map(|_| OK).unwrap_or_else(|s| s),
        INVALID_STATE,
        &["'emb'"],
    );
    for r in 0..2 {
        check(
            ctx.sparse_set("emb", r, &[] as &[i32], &[] as &[f64]),
            "set",
        );
        check(
            ctx.sparse_set("keep", r, &[] as &[i64], &[] as &[f32]),
            "set",
        );
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    assert_eq!(ctx.gathered("emb", 0).rows, 0);
    // A dense name is unregistered as before.
    let mut d = [vec![0f32], vec![0f32]];
    for (r, b) in d.iter_mut().enumerate() {
        ctx.reg("dense", GRAD, r, b, F32);
    }
    check(ctx.unregister("dense"), "unregister dense");
}
