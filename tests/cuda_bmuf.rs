//! BMUF on CUDA replicas: the same program run on host replicas and on CUDA replicas gives the
//! same params. Without a GPU every test prints "skipped: no CUDA device" and returns.
//!
//! With two replicas the averaging is exact in every backend (one addition, a division by 2),
//! and the filter is specified operation by operation without fused multiply-adds, so host
//! and device must agree to the byte. With four replicas the order of the additions may differ
//! between backends; there the params agree to within a few units in the last place.

mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod cuda_context;
    pub mod float16;
    pub mod gpu;
    pub mod lcg;
    pub mod place;
    pub mod skip;
}

use common::gpu::{for_each_transport, in_stream_order, rank_per_replica, ACROSS_GPUS};
use common::place::{decode, encode, synchronize, Mem, Place};
use common::{abi::*, buf::*, context::*, cuda_context::*, lcg::*, skip::*};

/// Tensor sizes: one that spans several kernel chunks and starts the bucket, one small.
const SIZES: [usize; 2] = [5000, 37];
const BLOCKS: usize = 3;

/// Registers two PARAMs on `replicas` replicas in `place`, runs bmuf_init and `BLOCKS` blocks
/// of local drift + bmuf_step, and returns every replica's final params (bytes). `None` when the
/// CUDA context cannot be made (no GPU).
fn run(
    place: &Place,
    ordinals: &[i32],
    transport: u32,
    dtype: DType,
    nesterov: bool,
    momentum: f64,
) -> Option<Vec<Vec<u8>>> {
    let replicas = ordinals.len();
    let ctx = match place {
        Place::Host => Context::host(replicas, None),
        Place::Gpu(_) => cuda_context("bmuf run", ordinals, |o| o.set_transport(transport))?,
    };
    let mut mems: Vec<Vec<Mem>> = Vec::new();
    for (r, &ordinal) in ordinals.iter().enumerate() {
        let mut row = Vec::new();
        for (t, &n) in SIZES.iter().enumerate() {
            // Moderate values: no overflow to inf, whose differences (NaN) differ in bits
            // between the GPU and the CPU.
            let mut g = Lcg::new(100 + 10 * r as u64 + t as u64);
            let start = encode(dtype, &(0..n).map(|_| g.spread() * 4.0).collect::<Vec<_>>());
            let mem = place.mem_on(ordinal, &start);
            let name = format!("p{t}");
            let st = register_raw(
                ctx.0,
                &name,
                PARAM,
                r,
                mem.ptr() as *mut std::ffi::c_void,
                n,
                dtype.code(),
            );
            check(st, &format!("register {name} on replica {r}"));
            row.push(mem);
        }
        mems.push(row);
    }
    check(ctx.bmuf_init(1.0, momentum, nesterov), "bmuf_init");
    let mut g = Lcg::new(7);
    for block in 0..BLOCKS {
        check(synchronize(&ctx), "synchronize before local training");
        // Local training: each replica drifts by its own amount.
        for row in mems.iter_mut() {
            for mem in row.iter_mut() {
                let mut v = decode(dtype, &mem.read());
                v.iter_mut().for_each(|x| *x += g.spread() * 0.25);
                mem.write(&encode(dtype, &v));
            }
        }
        check(ctx.bmuf_step(), &format!("bmuf_step block {block}"));
    }
    check(synchronize(&ctx), "synchronize");
    Some(
        mems.iter()
            .map(|row| row.iter().flat_map(|m| m.read()).collect())
            .collect(),
    )
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Two replicas over `transport` on `ordinals` give the host run's bytes for every float dtype,
/// both momentum variants and default and explicit momentum. False when the transport is
/// missing here.
fn two_replicas_give_the_host_bytes(gpu: &Place, ordinals: &[i32], transport: u32) -> bool {
    for dtype in FLOATS {
        for nesterov in [false, true] {
            for momentum in [-1.0, 0.75] {
                let Some(device) = run(gpu, ordinals, transport, dtype, nesterov, momentum) else {
                    return false;
                };
                let host = run(&Place::Host, ordinals, transport, dtype, nesterov, momentum);
                let host = host.unwrap();
                for r in 0..2 {
                    assert!(
                        device[r] == host[r],
                        "GPUs {ordinals:?} {dtype:?} nesterov {nesterov} momentum {momentum}: \
                         replica {r} differs from the host run (first element {:?} vs {:?})",
                        &decode(dtype, &device[r])[..4],
                        &decode(dtype, &host[r])[..4]
                    );
                }
                assert_eq!(device[0], device[1], "replicas end identical");
            }
        }
    }
    true
}

/// Several replicas over `transport` on `ordinals` follow the host run to within the rounding
/// of another summation order, and end identical. False when the transport is missing here.
fn follows_the_host_run(gpu: &Place, ordinals: &[i32], transport: u32, dtypes: &[DType]) -> bool {
    let replicas = ordinals.len();
    for &dtype in dtypes {
        for nesterov in [false, true] {
            let Some(device) = run(gpu, ordinals, transport, dtype, nesterov, -1.0) else {
                return false;
            };
            let host = run(&Place::Host, ordinals, transport, dtype, nesterov, -1.0).unwrap();
            let (d, h) = (decode(dtype, &device[0]), decode(dtype, &host[0]));
            // Sums of four in another order: a few ulps of the state type, amplified by the
            // momentum over the blocks, and one rounding step of a half type. Between GPUs the
            // partial sums (up to about 16 here) set the size of an ulp, not the mean.
            let floor = if ordinals.iter().all(|&o| o == ordinals[0]) {
                1.0
            } else {
                16.0
            };
            let rel = match dtype {
                DType::F64 => 1e-12,
                DType::F32 => 1e-5,
                DType::F16 => 2e-3,
                _ => 1.6e-2,
            };
            for (i, (a, b)) in d.iter().zip(&h).enumerate() {
                assert!(
                    (a - b).abs() <= rel * b.abs().max(floor),
                    "GPUs {ordinals:?} {dtype:?} nesterov {nesterov}: element {i}: device {a} \
                     vs host {b}"
                );
            }
            for r in 1..replicas {
                assert_eq!(device[r], device[0], "replica {r} ends like replica 0");
            }
            if replicas == 1 {
                assert_eq!(device[0], host[0], "one replica: no averaging, same bytes");
            }
        }
    }
    true
}

#[test]
fn two_cuda_replicas_give_the_host_backends_bytes() {
    let Some(gpu) = Place::gpu("two_cuda_replicas_give_the_host_backends_bytes") else {
        return;
    };
    assert!(two_replicas_give_the_host_bytes(&gpu, &[0, 0], T_AUTO));
}

#[test]
fn one_three_and_four_cuda_replicas_follow_the_host_run() {
    let Some(gpu) = Place::gpu("one_three_and_four_cuda_replicas_follow_the_host_run") else {
        return;
    };
    for ordinals in [&[0][..], &[0, 0, 0], &[0, 0, 0, 0]] {
        assert!(follows_the_host_run(&gpu, ordinals, T_AUTO, &FLOATS));
    }
}

/// Several GPUs (scripts/fake-cuda.sh: four fake ones, under each peer-access pattern): the
/// averaging crosses devices by NCCL or by peer sums and copies.
#[test]
fn bmuf_across_gpus_follows_the_host_run() {
    let Some(gpu) = Place::gpus("bmuf_across_gpus_follows_the_host_run", 4) else {
        return;
    };
    for transport in [T_NCCL, T_PEER_COPY] {
        if !two_replicas_give_the_host_bytes(&gpu, &[1, 0], transport) {
            skip(format_args!(
                "transport {transport} skipped: not available here"
            ));
            continue;
        }
        // Not the half types here: between GPUs their partial sums are rounded to the half type
        // (as NCCL's are), and with these widely spread values that differs from the host's f32
        // accumulation by more than a bound worth asserting. allreduce_across_gpus covers
        // half-type sums between GPUs exactly.
        for ordinals in [&[0, 1, 2, 3][..], &[0, 0, 3, 3], &[2, 0, 1]] {
            assert!(follows_the_host_run(
                &gpu,
                ordinals,
                transport,
                &FLOATS[..2]
            ));
        }
    }
}

/// One NCCL rank per replica on one GPU ([`rank_per_replica`]): the averaging is a 2-rank NCCL
/// allreduce on one GPU.
#[test]
fn bmuf_over_two_nccl_ranks_on_one_gpu_when_enabled() {
    let test = "bmuf_over_two_nccl_ranks_on_one_gpu_when_enabled";
    let Some(gpu) = Place::gpu(test).filter(|_| rank_per_replica(test)) else {
        return;
    };
    assert!(two_replicas_give_the_host_bytes(&gpu, &[0, 0], T_NCCL));
}

/// The update runs in stream order, each replica with its own caller stream
/// ([`in_stream_order`]): the params are 0 at `bmuf_init` (W = 0, D = 0), replica r's become
/// r + 1 (mean A = (reps + 1) / 2); classical momentum 0.5, block_lr 1 give D = A, W = A and
/// params = A on every replica. False if `transport` is unavailable.
fn bmuf_step_in_stream_order(test: &str, ordinals: &[i32], transport: u32) -> bool {
    let init = |ctx: &Context| check(ctx.bmuf_init(1.0, 0.5, false), "bmuf_init");
    let want = (ordinals.len() + 1) as f32 / 2.0;
    in_stream_order(
        test,
        "bmuf_step",
        ordinals,
        transport,
        PARAM,
        init,
        |ctx| ctx.bmuf_step(),
        want,
    )
}

#[test]
fn bmuf_step_is_ordered_by_each_replicas_stream() {
    let test = "bmuf_step_is_ordered_by_each_replicas_stream";
    for_each_transport(&[&[0, 0]], |ordinals, transport| {
        bmuf_step_in_stream_order(test, ordinals, transport)
    });
}

#[test]
fn bmuf_step_across_gpus_is_ordered_by_each_replicas_stream() {
    let test = "bmuf_step_across_gpus_is_ordered_by_each_replicas_stream";
    if Place::gpus(test, 4).is_none() {
        return;
    }
    for_each_transport(&ACROSS_GPUS, |ordinals, transport| {
        bmuf_step_in_stream_order(test, ordinals, transport)
    });
}
