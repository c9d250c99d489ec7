//! The passes of the reproducible sum over several devices (kernels/dense.cu `repro_stage`),
//! run by the emulator on replicas split over pretend devices, with the two NCCL allreduces
//! done here (the max of the fields, the wrapping sum of the integers): the host's bytes.

use half::f16;

use super::*;
use crate::backend::ReproStage;

/// Field bytes per element as the kernel writes them (F64's as a half's bits).
fn field_bytes(dtype: DType) -> usize {
    if dtype == DType::F64 {
        2
    } else {
        1
    }
}

#[test]
fn reproducible_stages_over_devices_give_the_host_bytes() {
    let k = emulator_or_skip!("reproducible_stages_over_devices");
    let total: usize = SEGMENTS.iter().sum();
    let nseg = SEGMENTS.len();
    let null = std::ptr::null_mut();
    for dtype in [DType::F32, DType::F64] {
        // Replicas per device; spread_out puts its NaN and infinities on replicas 0 and 1.
        for (split, op) in [
            (&[1usize, 4][..], ReduceOp::Sum),
            (&[3, 3, 2][..], ReduceOp::Avg),
            (&[4, 4][..], ReduceOp::Sum),
            (&[2, 5][..], ReduceOp::Avg),
        ] {
            let replicas: usize = split.iter().sum();
            let mut dev = bucket_buffers(dtype, replicas);
            spread_out(dtype, &mut dev);
            let mut host = dev.clone();
            let avg = (op == ReduceOp::Avg).then_some(replicas);
            let ptrs = pointers(&mut host);
            let bucket = view_of(dtype, &ptrs);
            let members: Vec<usize> = (0..replicas).collect();
            // SAFETY: every pointer holds its segment's elements.
            unsafe { HostBackend::new().reduce_reproducible(&members, &bucket, avg) }.unwrap();

            // Each device's table over its replicas, sums and fields.
            let mut tables = Vec::new();
            let mut at = 0;
            for &r in split {
                tables.push((walk_table(&mut dev[at..at + r]), r));
                at += r;
            }
            let fb = field_bytes(dtype);
            let mut sums = vec![vec![0u64; total]; split.len()];
            let mut fields = vec![vec![0u64; (total * fb).div_ceil(8)]; split.len()];
            let pass = |stage: ReproStage,
                        avg: Option<usize>,
                        sums: &mut [Vec<u64>],
                        fields: &mut [Vec<u64>]| {
                for (d, (table, r)) in tables.iter().enumerate() {
                    let buffers = (sums[d].as_mut_ptr() as u64, fields[d].as_mut_ptr() as u64);
                    let dims = (nseg, *r, total);
                    let table = table.as_ptr() as u64;
                    k.repro_stage(null, dtype, table, dims, buffers, stage, avg)
                        .unwrap();
                }
            };
            pass(ReproStage::Fields, None, &mut sums, &mut fields);
            // ncclMax: of bytes for F32; of halves for F64, whose order is their bits'.
            let bytes = |d: usize| bytes_of(&fields[d], total * fb);
            let mut top = bytes(0);
            for d in 1..split.len() {
                let other = bytes(d);
                for e in 0..total {
                    let (a, b) = (&top[e * fb..(e + 1) * fb], &other[e * fb..(e + 1) * fb]);
                    let wider = if fb == 2 {
                        let half = |x: &[u8]| f16::from_bits(u16::from_ne_bytes([x[0], x[1]]));
                        half(b) > half(a)
                    } else {
                        b[0] > a[0]
                    };
                    if wider {
                        let b = b.to_vec();
                        top[e * fb..(e + 1) * fb].copy_from_slice(&b);
                    }
                }
            }
            for f in fields.iter_mut() {
                // SAFETY: the words hold the field bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(top.as_ptr(), f.as_mut_ptr().cast(), top.len())
                };
            }
            pass(ReproStage::Cut, None, &mut sums, &mut fields);
            let all: Vec<u64> = (0..total)
                .map(|e| sums.iter().fold(0u64, |s, d| s.wrapping_add(d[e])))
                .collect();
            sums.iter_mut().for_each(|s| s.copy_from_slice(&all));
            pass(ReproStage::Uncut, avg, &mut sums, &mut fields);
            assert!(
                snapshot(dtype, &dev) == snapshot(dtype, &host),
                "{dtype} {op:?} over devices of {split:?} replicas differs from the host's \
                 reproducible sum"
            );
        }
    }
}

/// F64's fields travel as halves `0x400 + field`: every one a positive normal half, in the
/// fields' order, so NCCL's max of halves is the max of the fields.
#[test]
fn f64_fields_as_halves_order_as_the_fields() {
    let halves: Vec<f16> = (1u16..=2047).map(|f| f16::from_bits(0x400 + f)).collect();
    assert!(halves.iter().all(|h| h.is_normal() && h.is_sign_positive()));
    assert!(halves.windows(2).all(|w| w[0] < w[1]));
}
