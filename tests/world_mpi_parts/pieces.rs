//! Large buckets that cross the world engine's pieces (`pieces_body`).

use super::*;

#[test]
fn large_buckets_cross_the_engines_pieces() {
    if under_mpirun() {
        return;
    }
    for n in [2, 3] {
        // Through shared memory (every rank on this host), over MPI's ring as across hosts,
        // and with only the last rank refusing shared memory (all then agree on MPI).
        for shm in ["1", "0", "last"] {
            let env = Some(("DPSYNC_MPI_SHM", std::path::Path::new(shm)));
            launch("pieces::pieces_body", n, 300, env);
        }
    }
}

/// Fused buckets and a broadcast of several MB whose tensor boundaries fall inside the engine's
/// pieces (it stages them piece by piece): every element of every tensor, in f32, f64, f16 and
/// bf16 (summed in f32: the f32 pieces' element counts), rank r with r + 1 replicas.
#[test]
fn pieces_body() {
    let Some((rank, ranks)) = as_rank("pieces_body") else {
        return;
    };
    let local = rank + 1;
    let total: usize = (1..=ranks).sum();
    let offset: usize = (1..=rank).sum();
    let shm = std::env::var("DPSYNC_MPI_SHM").unwrap_or_default();
    if shm == "last" && rank + 1 == ranks {
        std::env::set_var("DPSYNC_MPI_SHM", "0");
    }
    let ctx = Context::new(&world_options(local));
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    // The path the large pieces take: shared memory unless a rank turned it off.
    let shared = ctx.describe_json()["world"]["shared_memory"].clone();
    let expected = match shm == "0" || shm == "last" {
        true => "off: DPSYNC_MPI_SHM=0 on a rank".to_owned(),
        false => format!("on: all {ranks} ranks on this host"),
    };
    assert_eq!(shared, expected.as_str(), "{}", tag("shared memory"));
    // Small integers (sums exact in every dtype): world replica w's element i of tensor t.
    let v = |w: usize, t: usize, i: usize, m: usize| ((w + 1) * ((i + t) % m + 1)) as f32;
    // Σ over the world's replicas.
    let sum = |t: usize, i: usize, m: usize| (total * (total + 1) / 2 * ((i + t) % m + 1)) as f32;
    let sizes32 = [100_003usize, 3, 250_001, 70_000];
    let sizes64 = [40_000usize, 90_001];
    let sizes16 = [200_001usize, 77_777];
    let mut g32: Vec<Vec<Vec<f32>>> = (sizes32.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| v(offset + k, t, i, 1000)).collect())
                .collect()
        })
        .collect();
    let mut g64: Vec<Vec<Vec<f64>>> = (sizes64.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| v(offset + k, t, i, 1000) as f64).collect())
                .collect()
        })
        .collect();
    // f16: integers up to 2048 are exact; bf16: up to 256.
    let mut h16: Vec<Vec<Vec<u16>>> = (sizes16.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| f32_to_f16(v(offset + k, t, i, 7))).collect())
                .collect()
        })
        .collect();
    let mut b16: Vec<Vec<Vec<u16>>> = (sizes16.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| {
                    (0..n)
                        .map(|i| f32_to_bf16(v(offset + k, t, i, 3)))
                        .collect()
                })
                .collect()
        })
        .collect();
    for k in 0..local {
        for t in 0..sizes32.len() {
            ctx.reg(&format!("f32_{t}"), GRAD, k, &mut g32[t][k], F32);
        }
        for t in 0..sizes64.len() {
            ctx.reg(&format!("f64_{t}"), GRAD, k, &mut g64[t][k], F64);
        }
        for t in 0..sizes16.len() {
            ctx.reg(&format!("f16_{t}"), GRAD, k, &mut h16[t][k], F16);
            ctx.reg(&format!("bf16_{t}"), GRAD, k, &mut b16[t][k], BF16);
        }
    }
    check(ctx.allreduce_grads(SUM), &tag("allreduce_grads"));
    for k in 0..local {
        for t in 0..sizes32.len() {
            for i in 0..sizes32[t] {
                assert_eq!(
                    g32[t][k][i],
                    sum(t, i, 1000),
                    "{}",
                    tag(&format!("f32_{t}[{i}]"))
                );
            }
        }
        for t in 0..sizes64.len() {
            for i in 0..sizes64[t] {
                let want = sum(t, i, 1000) as f64;
                assert_eq!(g64[t][k][i], want, "{}", tag(&format!("f64_{t}[{i}]")));
            }
        }
        for t in 0..sizes16.len() {
            for i in 0..sizes16[t] {
                let (h, b) = (f16_to_f32(h16[t][k][i]), bf16_to_f32(b16[t][k][i]));
                assert_eq!(h, sum(t, i, 7), "{}", tag(&format!("f16_{t}[{i}]")));
                assert_eq!(b, sum(t, i, 3), "{}", tag(&format!("bf16_{t}[{i}]")));
            }
        }
    }

    // A broadcast of several MB from the last world replica, spans crossing the pieces.
    let sizes = [300_001usize, 5, 200_000];
    let mut p: Vec<Vec<Vec<f32>>> = (sizes.iter().enumerate())
        .map(|(t, &n)| {
            (0..local)
                .map(|k| (0..n).map(|i| v(offset + k, t, i, 1000)).collect())
                .collect()
        })
        .collect();
    for k in 0..local {
        for t in 0..sizes.len() {
            ctx.reg(&format!("p_{t}"), PARAM, k, &mut p[t][k], F32);
        }
    }
    let root = total - 1;
    check(ctx.broadcast(PARAM, root), &tag("broadcast"));
    for k in 0..local {
        for t in 0..sizes.len() {
            for i in 0..sizes[t] {
                let want = v(root, t, i, 1000);
                assert_eq!(p[t][k][i], want, "{}", tag(&format!("p_{t}[{i}]")));
            }
        }
    }
}
