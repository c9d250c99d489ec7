//! Steps that fail: missing slices, indices out of range, replicas that disagree; nothing changed.

use super::*;

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
