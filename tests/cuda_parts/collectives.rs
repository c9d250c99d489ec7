//! Dense collectives on CUDA replicas: every dtype, size and transport, fused gradients, broadcasts
//! while the table cache empties.

use super::*;

#[test]
fn allreduce_every_dtype_size_and_transport_on_shared_gpus() {
    // A transport that is not available here (NCCL missing) is skipped, not the others.
    'transports: for transport in [T_NCCL, T_PEER_COPY, T_AUTO] {
        for ordinals in [&[0][..], &[0, 0], &[0, 0, 0, 0]] {
            for n in [1usize, 7, 1000, 65_537] {
                if !allreduce_every_dtype(ordinals, transport, n) {
                    continue 'transports;
                }
            }
        }
    }
    // 4 MiB + 1 element and 64 MiB per replica, every dtype (minutes on the fake driver's CPU
    // threads: real GPUs only).
    if std::env::var("DPSYNC_FAKE_CUDA").as_deref() == Ok("1") {
        skip(format_args!(
            "allreduce of 4 and 64 MiB: skipped on the fake CUDA driver (minutes of emulation)"
        ));
        return;
    }
    for transport in [T_NCCL, T_PEER_COPY] {
        for ordinals in [&[0][..], &[0, 0], &[0, 0, 0, 0]] {
            let ok = allreduce_every_dtype_sized(ordinals, transport, |size| (4 << 20) / size + 1)
                && allreduce_every_dtype_sized(ordinals, transport, |size| (64 << 20) / size);
            if !ok {
                skip(format_args!(
                    "allreduce of 4 and 64 MiB over transport {transport}: skipped: not available here"
                ));
                break;
            }
        }
    }
}

/// Several GPUs (scripts/fake-cuda.sh: four fake ones, under each peer-access pattern; a
/// machine with one GPU skips): Caffe2's device sets and more, every dtype, NCCL and PEER_COPY.
#[test]
fn allreduce_across_gpus_every_dtype_and_transport() {
    if Place::gpus("allreduce_across_gpus_every_dtype_and_transport", 4).is_none() {
        return;
    }
    let sets: [&[i32]; 7] = [
        &[0, 1],
        &[0, 2],
        &[1, 2],
        &[0, 1, 2],
        &[0, 1, 2, 3],
        &[3, 3, 1, 0],
        &[2, 0, 2],
    ];
    'transports: for transport in [T_NCCL, T_PEER_COPY] {
        for ordinals in sets {
            for n in [1usize, 1000, 65_537] {
                if !allreduce_every_dtype(ordinals, transport, n) {
                    skip(format_args!(
                        "transport {transport} skipped: not available here"
                    ));
                    continue 'transports;
                }
            }
        }
        fused_gradients_broadcast_and_average_on(&[2, 0, 1], transport);
    }
}

#[test]
fn fused_gradients_broadcast_and_average() {
    fused_gradients_broadcast_and_average_on(&[0, 0, 0], T_AUTO);
}

/// The segment-table cache (one device table per tensor layout, 4096 at most per GPU) is
/// emptied when full, while the collective being issued may already use one of its tables: a
/// broadcast looks up the replicas' table, then uploads the root's, and that upload can be the
/// one that empties the cache. Here every step has a new layout (the tensor re-registered one
/// element further on), and one allreduce first makes the count odd, so that some broadcast's
/// second upload finds the cache full. Every step must still copy the root's values (on the
/// fake driver a freed table is poisoned, so a walk through it crashes or writes garbage).
#[test]
fn broadcasts_stay_right_when_the_table_cache_empties() {
    let test = "broadcasts_stay_right_when_the_table_cache_empties";
    let Some(ctx) = cuda_context(test, &[0, 0], |o| o.set_transport(T_PEER_COPY)) else {
        return;
    };
    let stream = default_stream(0);
    let (n, steps) = (16usize, 4200usize);
    let root: Vec<f32> = (0..n + steps).map(|i| i as f32 + 0.5).collect();
    let src = stream.clone_htod(&root).unwrap();
    let dst = stream.clone_htod(&vec![0.0f32; n + steps]).unwrap();
    let g = stream.clone_htod(&[1.0f32, 2.0]).unwrap();
    let g1 = stream.clone_htod(&[3.0f32, 4.0]).unwrap();
    stream.synchronize().unwrap();
    let (src_p, dst_p) = (dptr(&stream, &src), dptr(&stream, &dst));
    register_device(&ctx, "g", GRAD, 0, dptr(&stream, &g), 2, F32);
    register_device(&ctx, "g", GRAD, 1, dptr(&stream, &g1), 2, F32);
    check(
        ctx.allreduce_grads(SUM),
        "allreduce_grads (one table first)",
    );
    for step in 0..steps {
        let at = 4 * step;
        register_device(&ctx, "p", PARAM, 0, src_p + at, n, F32);
        register_device(&ctx, "p", PARAM, 1, dst_p + at, n, F32);
        check(ctx.broadcast(PARAM, 0), "broadcast");
        check(ctx.unregister("p"), "unregister");
    }
    check(synchronize(&ctx), "synchronize");
    // Step s wrote dst[s..s + n]; each later step overwrote all but its first element with the
    // same values, so every element ends as the root's.
    let got = stream.clone_dtoh(&dst).unwrap();
    assert_eq!(&got[..n + steps - 1], &root[..n + steps - 1]);
}
