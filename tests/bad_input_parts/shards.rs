//! Bad input to the shard calls (ZeRO stage 1): shard, reduce-scatter and allgather.

use super::*;

impl Fx {
    /// A reduce-scatter (SUM) and an allgather of the GRADs work on the fixture, with exact
    /// results: the owned pieces get the reduction and nothing else changes, then every replica
    /// holds the whole reduction; other roles untouched throughout.
    #[track_caller]
    fn assert_shards_usable(&mut self, what: &str) {
        let n = self.n;
        let before = self.snapshot();
        check(
            reduce_scatter(self.ctx.0, SUM),
            &format!("{what}: reduce_scatter_grads afterwards"),
        );
        for ((name, role, bufs), pre) in self.tensors.iter().zip(&before) {
            let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), SUM);
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                let expect = match *role {
                    GRAD => {
                        let (at, k) = owned(p.len(), r, n);
                        spliced(p, &want, at, k)
                    }
                    _ => p.clone(),
                };
                let tag = format!("{what}: '{name}' on replica {r} after reduce_scatter_grads");
                assert_same_bytes(b, &expect, &tag);
            }
        }
        check(
            allgather(self.ctx.0, GRAD),
            &format!("{what}: allgather(GRAD) afterwards"),
        );
        for ((name, role, bufs), pre) in self.tensors.iter().zip(&before) {
            let want = reference_allreduce(&pre.iter().collect::<Vec<_>>(), SUM);
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                let expect = if *role == GRAD { &want } else { p };
                let tag = format!("{what}: '{name}' on replica {r} after allgather(GRAD)");
                assert_same_bytes(b, expect, &tag);
            }
        }
    }
}

/// dpsync_shard: NOT_FOUND for an unknown name (and for a sparse gradient, which is gathered
/// whole), INVALID_ARGUMENT naming the argument for a replica out of range, a NULL out pointer,
/// a NULL name and a NULL context; the outputs are untouched on failure and nothing else
/// changes. Valid calls follow the contract's rule for every tensor of every role.
#[test]
fn shard_rejects_bad_arguments_and_changes_nothing() {
    let mut fx = Fx::new();
    let n = fx.n;
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    let ctx = fx.ctx.0;
    let w = cstr("w");
    let (mut offset, mut count) = (0xDEAD_usize, 0xBEEF_usize);
    let untouched = |offset: usize, count: usize, what: &str| {
        assert_eq!(
            (offset, count),
            (0xDEAD, 0xBEEF),
            "{what}: outputs written by a failed dpsync_shard"
        );
    };

    for name in ["nope", "W", "w ", "g\u{e9}"] {
        let (st, o, c) = shard(ctx, name, 0);
        expect_err(st, NOT_FOUND, &[name]);
        untouched(o, c, name);
    }
    for replica in [n, n + 5, usize::MAX] {
        let (st, o, c) = shard(ctx, "w", replica);
        let m = expect_err(st, INVALID_ARGUMENT, &["replica", "'w'"]);
        untouched(o, c, &m);
    }
    // The replica out of range is named by its number.
    let (st, _, _) = shard(ctx, "g", n);
    expect_err(st, INVALID_ARGUMENT, &[&format!("replica {n}"), "'g'"]);
    // SAFETY: valid handle and name; the NULL pointers are what is tested.
    unsafe {
        let st = dpsync_shard(ctx, w.as_ptr(), 0, ptr::null_mut(), &mut count);
        expect_err(st, INVALID_ARGUMENT, &["offset"]);
        untouched(offset, count, "NULL offset");
        let st = dpsync_shard(ctx, w.as_ptr(), 0, &mut offset, ptr::null_mut());
        expect_err(st, INVALID_ARGUMENT, &["count"]);
        untouched(offset, count, "NULL count");
        let st = dpsync_shard(ctx, w.as_ptr(), 0, ptr::null_mut(), ptr::null_mut());
        assert_eq!(st, INVALID_ARGUMENT, "both out pointers NULL");
        let st = dpsync_shard(ctx, ptr::null(), 0, &mut offset, &mut count);
        expect_err(st, INVALID_ARGUMENT, &["name"]);
        untouched(offset, count, "NULL name");
        let st = dpsync_shard(ptr::null(), w.as_ptr(), 0, &mut offset, &mut count);
        expect_err(st, INVALID_ARGUMENT, &["context"]);
        untouched(offset, count, "NULL context");
        let bad_utf8 = [0x66u8, 0xff, 0xfe, 0x00];
        let st = dpsync_shard(ctx, bad_utf8.as_ptr().cast(), 0, &mut offset, &mut count);
        expect_err(st, INVALID_ARGUMENT, &["name"]);
        untouched(offset, count, "name not UTF-8");
        // A sparse gradient is gathered whole, not sharded.
        let emb = cstr("emb");
        let st = dpsync_register_sparse(ctx, emb.as_ptr(), 0, 2, F32, I64, 0);
        check(st, "register_sparse");
        let st = dpsync_shard(ctx, emb.as_ptr(), 0, &mut offset, &mut count);
        expect_err(st, NOT_FOUND, &["'emb'", "sparse"]);
        untouched(offset, count, "sparse gradient");
        check(fx.ctx.unregister("emb"), "unregister 'emb'");
    }
    assert_eq!(
        fx.ctx.describe(),
        desc,
        "failed shard calls changed the registry"
    );
    fx.assert_unchanged(&before, "failed shard calls");

    // Valid calls: the rule, for every role and dtype, the pieces covering each tensor once.
    for (name, _, bufs) in &fx.tensors {
        let len = bufs[0].len();
        let mut next = 0;
        for r in 0..n {
            let (st, o, c) = shard(ctx, name, r);
            check(st, &format!("dpsync_shard '{name}' on replica {r}"));
            assert_eq!(
                (o, c),
                owned(len, r, n),
                "'{name}' ({len} elements) on replica {r}"
            );
            assert_eq!(o, next, "'{name}': pieces in replica order");
            next += c;
        }
        assert_eq!(next, len, "'{name}': the pieces cover it");
    }
    fx.assert_usable("after failed shard calls");
    fx.assert_shards_usable("after failed shard calls");
}

/// dpsync_reduce_scatter_grads with a NULL context or an op other than SUM and AVG, and
/// dpsync_allgather with a NULL context or roles 0 or outside the four roles: INVALID_ARGUMENT
/// naming the argument, nothing changed, and both still work afterwards.
#[test]
fn reduce_scatter_and_allgather_reject_bad_arguments_and_change_nothing() {
    let mut fx = Fx::new();
    let desc = fx.ctx.describe();
    let before = fx.snapshot();
    let nul: *mut dpsync_context = ptr::null_mut();
    expect_err(reduce_scatter(nul, SUM), INVALID_ARGUMENT, &["context"]);
    expect_err(reduce_scatter(nul, 7), INVALID_ARGUMENT, &[]);
    for op in [2u32, 3, 7, 0x8000_0000, 0xFFFF_FFFF] {
        expect_err(reduce_scatter(fx.ctx.0, op), INVALID_ARGUMENT, &["op"]);
        // the status allreduce_grads gives for the same op
        let ar = fx.ctx.allreduce_grads(op);
        assert_eq!(ar, INVALID_ARGUMENT, "allreduce_grads op {op}");
    }
    fx.assert_unchanged(&before, "reduce_scatter_grads with a bad op");
    expect_err(allgather(nul, PARAM), INVALID_ARGUMENT, &["context"]);
    for roles in [0u32, 0x10, 0x1F, 0x20, 0x8000_0001, 0xFFFF_FFFF] {
        expect_err(allgather(fx.ctx.0, roles), INVALID_ARGUMENT, &["roles"]);
        fx.assert_unchanged(&before, &format!("allgather(roles={roles:#x})"));
    }
    assert_eq!(fx.ctx.describe(), desc, "the context is unchanged");
    fx.assert_unchanged(&before, "failed reduce_scatter_grads and allgather");
    fx.assert_shards_usable("after failed shard collectives");
    fx.assert_usable("after failed shard collectives");
}

/// Registrations that disagree between replicas fail dpsync_reduce_scatter_grads exactly as they
/// fail dpsync_allreduce_grads (INCONSISTENT naming the tensor and the replica), and
/// dpsync_allgather over their role as dpsync_broadcast: nothing changed on any replica. After
/// unregistering, both work again.
#[test]
fn inconsistent_registrations_fail_reduce_scatter_and_allgather() {
    for bad in Bad::ALL {
        let what = format!("{bad:?}");
        let mut fx = Fx::new();
        let mut bufs: Vec<Vec<f32>> = vec![
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
            vec![100.0, 200.0, 300.0, 400.0, 500.0, 600.0],
        ];
        let copies = bufs.clone();
        let ptrs: Vec<*mut c_void> = bufs.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        let culprit = bad.register(fx.ctx.0, &ptrs, &what);
        let before = fx.snapshot();
        let desc = fx.ctx.describe();

        let st = fx.ctx.allreduce_grads(SUM);
        let ar = expect_err(st, INCONSISTENT, &["'bad'", culprit]);
        for op in [SUM, AVG] {
            let st = reduce_scatter(fx.ctx.0, op);
            let rs = expect_err(st, INCONSISTENT, &["'bad'", culprit]);
            assert_eq!(
                rs.replace("dpsync_reduce_scatter_grads", "dpsync_allreduce_grads"),
                ar,
                "{what}: the same message as allreduce_grads"
            );
        }
        let roles = match bad {
            Bad::Role => vec![GRAD, COMPUTED, GRAD | COMPUTED, GRAD | PARAM],
            _ => vec![GRAD, GRAD | PARAM | STATE | COMPUTED],
        };
        for roles in roles {
            let want = fx.ctx.broadcast(roles, 0);
            assert_eq!(want, INCONSISTENT, "{what}: broadcast({roles:#x})");
            let st = allgather(fx.ctx.0, roles);
            expect_err(st, INCONSISTENT, &["'bad'"]);
        }
        assert_eq!(
            bufs, copies,
            "{what}: 'bad' buffers changed by a failed collective"
        );
        fx.assert_unchanged(&before, &what);
        assert_eq!(fx.ctx.describe(), desc, "{what}: the context is unchanged");

        // An allgather of roles 'bad' does not have still works, and changes only those.
        if !matches!(bad, Bad::Role) {
            check(
                allgather(fx.ctx.0, COMPUTED),
                &format!("{what}: allgather(COMPUTED)"),
            );
        }
        check(
            allgather(fx.ctx.0, STATE),
            &format!("{what}: allgather(STATE)"),
        );
        assert_eq!(bufs, copies, "{what}: 'bad' buffers changed");

        check(fx.ctx.unregister("bad"), &what);
        fx.assert_shards_usable(&what);
        assert_eq!(
            bufs, copies,
            "{what}: 'bad' buffers changed after unregister"
        );
    }
}

/// dpsync_allgather touches only the roles asked: each replica's owned piece of every such
/// tensor is copied to every other replica, every other tensor keeps its bytes.
#[test]
fn allgather_touches_only_the_roles_asked() {
    for roles in [
        PARAM,
        STATE,
        COMPUTED,
        GRAD,
        PARAM | STATE,
        PARAM | GRAD | STATE | COMPUTED,
    ] {
        let fx = Fx::new();
        let n = fx.n;
        let before = fx.snapshot();
        check(
            allgather(fx.ctx.0, roles),
            &format!("allgather({roles:#x})"),
        );
        for ((name, role, bufs), pre) in fx.tensors.iter().zip(&before) {
            // Element i comes from the replica that owns it.
            let len = pre[0].len();
            let mut want = pre[0].clone();
            for (w, src) in pre.iter().enumerate() {
                let (at, k) = owned(len, w, n);
                want = spliced(&want, src, at, k);
            }
            for (r, (b, p)) in bufs.iter().zip(pre).enumerate() {
                let expect = if roles & role != 0 { &want } else { p };
                let tag = format!("allgather({roles:#x}): '{name}' on replica {r}");
                assert_same_bytes(b, expect, &tag);
            }
        }
    }
}
