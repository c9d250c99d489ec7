//! A world over the caller's own communicator (built with `--features mpi` only): the program
//! initialises MPI itself (so it also finalises it), splits MPI_COMM_WORLD into two halves with
//! `MPI_Comm_split`, and gives each half's communicator to dpsync. Each half is a world of its
//! own: ranks and replica counts of that half, sums over that half only, and the caller's own MPI
//! calls on the same communicator before and after dpsync's still match (dpsync duplicates it).
//! `three_ranks_split_in_two` starts this binary under `mpirun -n 3`, once over shared memory and
//! once with `--mca btl tcp,self` (TCP over loopback, and `DPSYNC_MPI_SHM=0`: no shared memory
//! between the ranks either).
#![cfg(feature = "mpi")]

mod common {
    pub mod abi;
    pub mod context;
    pub mod mpi;
    pub mod skip;
}

use std::ffi::c_void;
use std::process::Command;

use common::mpi::under_mpirun;
use common::{abi::*, context::*};
use dpsync::*;
use mpi::collective::SystemOperation;
use mpi::raw::AsRaw;
use mpi::topology::Color;
use mpi::traits::*;

#[test]
fn three_ranks_split_in_two() {
    if under_mpirun() {
        return; // a rank runs split_body only
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for btl in [None, Some("tcp,self")] {
        let mut cmd = Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "3"]);
        if let Some(btl) = btl {
            // TCP carries every transfer: no shared memory between the ranks either.
            cmd.args(["--mca", "btl", btl]).env("DPSYNC_MPI_SHM", "0");
        }
        let status = cmd
            .arg(&exe)
            .args(["split_body", "--exact", "--nocapture", "--test-threads=1"])
            .status()
            .expect("mpirun (Open MPI) must be installed: scripts/common.sh ensure_mpi");
        assert!(status.success(), "btl {btl:?}: {status}");
    }
}

#[test]
fn split_body() {
    if !under_mpirun() {
        common::skip::skip(format_args!(
            "split_body: skipped: runs only as an MPI rank (three_ranks_split_in_two starts it)"
        ));
        return;
    }
    let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .expect("the program initialises MPI");
    let world = universe.world();
    let rank = world.rank() as usize;
    // Ranks 0 and 2 form one half, rank 1 the other; key: world rank.
    let half = world
        .split_by_color(Color::with_value((rank % 2) as i32))
        .expect("every rank has a color");
    let (half_rank, half_size) = (half.rank() as usize, half.size() as usize);
    assert_eq!(half_size, if rank % 2 == 0 { 2 } else { 1 });

    // The caller's own collective on the communicator before dpsync uses it.
    let mut before = 0i32;
    half.all_reduce_into(&1i32, &mut before, SystemOperation::sum());
    assert_eq!(before as usize, half_size);

    // Replica counts differ within a half: world rank r has r + 1 replicas.
    let replicas = rank + 1;
    let o = Options::host(replicas);
    o.set_timeout_ms(120_000);
    let raw = half.as_raw();
    // SAFETY: valid options; `raw` is an MPI_Comm the callee copies.
    let st = unsafe { dpsync_options_set_world_mpi(o.0, &raw as *const _ as *const c_void) };
    check(st, "set_world_mpi (the half's communicator)");
    let ctx = Context::new(&o);

    let (mut r, mut n, mut total, mut offset) = (9, 9, 0, 9);
    // SAFETY: a live context and valid outputs.
    unsafe {
        check(dpsync_rank(ctx.0, &mut r, &mut n), "rank");
        check(
            dpsync_world_replicas(ctx.0, &mut total, &mut offset),
            "world_replicas",
        );
    }
    assert_eq!(
        (r, n),
        (half_rank, half_size),
        "rank {rank}: the half, not MPI_COMM_WORLD"
    );
    // Half {0, 2}: 1 + 3 replicas; half {1}: 2.
    let counts: Vec<usize> = if rank % 2 == 0 { vec![1, 3] } else { vec![2] };
    assert_eq!(total, counts.iter().sum::<usize>());
    assert_eq!(offset, counts[..half_rank].iter().sum::<usize>());

    // Exact sums over the half: world replica w holds w + 1 in every element.
    let mut grads: Vec<Vec<i64>> = (0..replicas)
        .map(|l| vec![(offset + l + 1) as i64; 1000])
        .collect();
    for (l, g) in grads.iter_mut().enumerate() {
        ctx.reg("g", GRAD, l, g, I64);
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    let want = (total * (total + 1) / 2) as i64;
    for (l, g) in grads.iter().enumerate() {
        assert!(
            g.iter().all(|&x| x == want),
            "rank {rank} replica {l}: {} != {want}",
            g[0]
        );
    }
    drop(ctx);

    // The caller's own collective after dpsync's: still matched, nothing of dpsync's mixed in.
    let mut after = 0i32;
    half.all_reduce_into(&(half_rank as i32), &mut after, SystemOperation::sum());
    assert_eq!(after as usize, half_size * (half_size - 1) / 2);
    println!("rank {rank}: half rank {half_rank} of {half_size}, sum {want}: ok");
}
