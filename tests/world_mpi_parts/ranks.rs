//! Worlds of 2, 3 and 4 ranks: `rank_body`'s collectives, describe and agreement failures on every
//! rank.

use super::*;

#[test]
fn worlds_of_two_three_and_four_ranks() {
    if under_mpirun() {
        return; // a rank runs rank_body only
    }
    for n in [2, 3, 4] {
        launch("ranks::rank_body", n, 300, None);
    }
}

#[test]
fn rank_body() {
    let Some((rank, ranks)) = as_rank("rank_body") else {
        return;
    };
    let local = rank + 1;
    let total: usize = (1..=ranks).sum();
    let offset: usize = (1..=rank).sum();
    let ctx = Context::new(&world_options(local));
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");

    // Who is where.
    let (mut r, mut n, mut t, mut o) = (9, 9, 9, 9);
    unsafe {
        check(dpsync_rank(ctx.0, &mut r, &mut n), "dpsync_rank");
        check(
            dpsync_world_replicas(ctx.0, &mut t, &mut o),
            "world_replicas",
        );
    }
    assert_eq!((r, n, t, o), (rank, ranks, total, offset), "{}", tag("ids"));
    assert_eq!(ctx.replica_count(), local);
    assert_eq!(ctx.loss_scale(), 1.0 / total as f64);
    let d = ctx.describe_json();
    let world = &d["world"];
    assert_eq!(world["engine"], "mpi");
    assert_eq!(world["rank"], rank);
    assert_eq!(world["ranks"], ranks);
    let per_rank: Vec<usize> = (1..=ranks).collect();
    assert_eq!(world["replicas_per_rank"], serde_json::json!(per_rank));
    assert_eq!(world["cross_rank"], "mpi");
    assert!(world["mpi_library"].as_str().is_some_and(|s| !s.is_empty()));
    let levels = d["levels"].as_array().unwrap();
    assert_eq!(levels.last().unwrap()["level"], "ranks", "{d}");

    // Gradients: two f32 tensors (one bucket of two segments), i64, f16.
    let len = [1000usize, 3, 5, 4];
    let mut w32: Vec<Vec<f32>> = vec![vec![0.0; len[0]]; local];
    let mut b32: Vec<Vec<f32>> = vec![vec![0.0; len[1]]; local];
    let mut s64: Vec<Vec<i64>> = vec![vec![0; len[2]]; local];
    let mut h16: Vec<Vec<u16>> = vec![vec![0; len[3]]; local];
    let mut g16: Vec<Vec<u16>> = vec![vec![0; len[3]]; local];
    let fill = |w32: &mut Vec<Vec<f32>>,
                b32: &mut Vec<Vec<f32>>,
                s64: &mut Vec<Vec<i64>>,
                h16: &mut Vec<Vec<u16>>,
                g16: &mut Vec<Vec<u16>>| {
        for k in 0..local {
            let w = offset + k;
            w32[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(w, i) as f32);
            b32[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = -value(w, i) as f32);
            s64[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = value(w, i) << 40);
            h16[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = f32_to_f16(value(w, i) as f32));
            g16[k]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = f32_to_bf16(value(w, i) as f32));
        }
    };
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    for k in 0..local {
        ctx.reg("w_grad", GRAD, k, &mut w32[k], F32);
        ctx.reg("b_grad", GRAD, k, &mut b32[k], F32);
        ctx.reg("s_grad", GRAD, k, &mut s64[k], I64);
        ctx.reg("h_grad", GRAD, k, &mut h16[k], F16);
        ctx.reg("g_grad", GRAD, k, &mut g16[k], BF16);
    }
    // Σ over world replicas of value(w, i) = (i + 1) * total * (total + 1) / 2.
    let sum = |i: usize| ((i + 1) * total * (total + 1) / 2) as i64;
    check(ctx.allreduce_grads(SUM), &tag("allreduce_grads SUM"));
    for k in 0..local {
        for i in 0..len[0] {
            assert_eq!(w32[k][i], sum(i) as f32, "{}", tag(&format!("w[{k}][{i}]")));
        }
        for i in 0..len[1] {
            assert_eq!(b32[k][i], -sum(i) as f32, "{}", tag("b"));
        }
        for i in 0..len[2] {
            assert_eq!(s64[k][i], sum(i) << 40, "{}", tag("s"));
        }
        for i in 0..len[3] {
            assert_eq!(f16_to_f32(h16[k][i]), sum(i) as f32, "{}", tag("h"));
            assert_eq!(bf16_to_f32(g16[k][i]), sum(i) as f32, "{}", tag("g"));
        }
    }
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    check(ctx.allreduce_grads(AVG), &tag("allreduce_grads AVG"));
    for k in 0..local {
        for i in 0..len[0] {
            let want = sum(i) as f64 / total as f64;
            assert_eq!(w32[k][i], want as f32, "{}", tag("w avg"));
        }
        for i in 0..len[2] {
            // Integers: the sum divided, truncated toward zero.
            assert_eq!(s64[k][i], (sum(i) << 40) / total as i64, "{}", tag("s avg"));
        }
    }

    // dpsync_allreduce of one tensor, SUM.
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    check(ctx.allreduce("s_grad", SUM), &tag("allreduce s_grad"));
    for k in 0..local {
        assert_eq!(s64[k][2], sum(2) << 40, "{}", tag("allreduce one tensor"));
        assert_eq!(w32[k][0], value(offset + k, 0) as f32, "others untouched");
    }

    // A bucket larger than the engine's pieces (512 KiB): several transfers in flight.
    let big_n = 700_000;
    let mut big: Vec<Vec<f32>> = (0..local)
        .map(|k| {
            (0..big_n)
                .map(|i| ((offset + k) * 3 + i % 1000) as f32)
                .collect()
        })
        .collect();
    for (k, buf) in big.iter_mut().enumerate() {
        ctx.reg("big", STATE, k, buf, F32);
    }
    check(ctx.allreduce("big", SUM), &tag("allreduce big"));
    for buf in &big {
        for i in [0, 131_071, 131_072, 262_144, 524_288, big_n - 1] {
            let want: usize = (0..total).map(|w| w * 3 + i % 1000).sum();
            assert_eq!(buf[i], want as f32, "{}", tag(&format!("big[{i}]")));
        }
    }
    check(ctx.unregister("big"), "unregister big");

    // Broadcast from the last world replica: the last rank's last local replica (not its 0).
    let mut p: Vec<Vec<f64>> = (0..local)
        .map(|k| (0..7).map(|i| ((offset + k) * 100 + i) as f64).collect())
        .collect();
    for (k, buf) in p.iter_mut().enumerate() {
        ctx.reg("p", PARAM, k, buf, F64);
    }
    let root = total - 1;
    check(ctx.broadcast(PARAM, root), &tag("broadcast"));
    for buf in &p {
        for (i, &x) in buf.iter().enumerate() {
            assert_eq!(x, (root * 100 + i) as f64, "{}", tag("broadcast value"));
        }
    }
    assert_eq!(
        ctx.broadcast(PARAM, total),
        INVALID_ARGUMENT,
        "root out of the world"
    );
    assert!(last_error().contains("root_replica"), "{}", last_error());

    // Registrations that differ between ranks: INCONSISTENT everywhere, nothing changed.
    fill(&mut w32, &mut b32, &mut s64, &mut h16, &mut g16);
    let mut odd: Vec<Vec<f32>> = vec![vec![1.0; if rank == 1 { 11 } else { 10 }]; local];
    for (k, buf) in odd.iter_mut().enumerate() {
        ctx.reg("odd_grad", GRAD, k, buf, F32);
    }
    assert_eq!(ctx.allreduce_grads(SUM), INCONSISTENT, "{}", tag("odd"));
    let msg = last_error();
    assert!(
        msg.contains("'odd_grad'") && msg.contains("rank 1"),
        "{}",
        tag(&msg)
    );
    assert_eq!(
        w32[0][1],
        value(offset, 1) as f32,
        "{}",
        tag("nothing changed")
    );
    check(ctx.unregister("odd_grad"), "unregister");

    // A call that fails on rank 0 only: its own status there, INCONSISTENT naming it elsewhere.
    let name = if rank == 0 {
        "no_such_tensor"
    } else {
        "s_grad"
    };
    let st = ctx.allreduce(name, SUM);
    let msg = last_error();
    if rank == 0 {
        assert_eq!(st, NOT_FOUND, "{msg}");
    } else {
        assert_eq!(st, INCONSISTENT, "{msg}");
        assert!(msg.contains("rank 0") && msg.contains("NOT_FOUND"), "{msg}");
    }
    assert_eq!(
        s64[0][1],
        value(offset, 1) << 40,
        "{}",
        tag("nothing changed")
    );
    // Ranks making different calls: INCONSISTENT on every rank naming both calls, nothing
    // changed. Another reduce op, then another operation.
    let op = if rank == 0 { SUM } else { AVG };
    assert_eq!(ctx.allreduce("s_grad", op), INCONSISTENT, "{}", tag("op"));
    let msg = last_error();
    assert!(
        msg.contains("rank 0 called dpsync_allreduce(name='s_grad', op=Sum)")
            && msg.contains("dpsync_allreduce(name='s_grad', op=Avg)"),
        "{}",
        tag(&msg)
    );
    let st = if rank == 0 {
        ctx.allreduce_grads(SUM)
    } else {
        ctx.allreduce("s_grad", SUM)
    };
    assert_eq!(st, INCONSISTENT, "{}", tag("operation"));
    let msg = last_error();
    assert!(
        msg.contains("rank 0 called dpsync_allreduce_grads")
            && msg.contains("dpsync_allreduce(name="),
        "{}",
        tag(&msg)
    );
    assert_eq!(
        s64[0][1],
        value(offset, 1) << 40,
        "{}",
        tag("nothing changed")
    );
    // And the context still works.
    check(ctx.allreduce("s_grad", SUM), &tag("after the failures"));
    assert_eq!(s64[0][1], sum(1) << 40);

    half_sums_round_once(&ctx, rank, local, offset, total);
    for coalesce in [false, true] {
        sparse_over_the_world(rank, local, offset, total, coalesce);
    }
    bmuf_over_the_world(&ctx, rank, local, offset, total);

    // Options that must agree: fusion_bytes differs on rank 1.
    let o = world_options(1);
    if rank == 1 {
        o.set_fusion_bytes(1 << 20);
    }
    let mut bad = ptr::null_mut();
    let st = unsafe { dpsync_context_create(o.0, &mut bad) };
    let msg = last_error();
    assert_eq!(st, INCONSISTENT, "{}", tag(&msg));
    assert!(
        msg.contains("fusion_bytes") && msg.contains("rank 1") && msg.contains("rank"),
        "{msg}"
    );
    assert!(bad.is_null());
    // A rank whose own options fail (NCCL for host replicas): its own status there, INCONSISTENT
    // naming it elsewhere, at once (not after the others' timeout).
    let o = world_options(1);
    if rank == 1 {
        o.set_transport(T_NCCL);
    }
    let start = std::time::Instant::now();
    let st = unsafe { dpsync_context_create(o.0, &mut bad) };
    let msg = last_error();
    if rank == 1 {
        assert_eq!(st, INVALID_ARGUMENT, "{}", tag(&msg));
    } else {
        assert_eq!(st, INCONSISTENT, "{}", tag(&msg));
        assert!(
            msg.contains("rank 1") && msg.contains("INVALID_ARGUMENT"),
            "{msg}"
        );
    }
    assert!(start.elapsed().as_secs() < 60, "{}", tag("failed at once"));
    assert!(bad.is_null());
    drop(ctx);
}
