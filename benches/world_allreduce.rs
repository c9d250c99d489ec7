//! Worlds over MPI: dpsync's collectives across ranks against raw MPI on buffers of the same
//! size, measured side by side (alternating) in one run; rank 0 prints. Run:
//! `cargo bench --features mpi --bench world_allreduce` (`-- --quick` for a short smoke run): it
//! starts itself under `mpirun --allow-run-as-root --oversubscribe`, with 2 ranks, then with 4.
//! Figures go to docs/PERFORMANCE.md.
//!
//! 1. 2 ranks x 1 host replica, one 64 MiB f32 GRAD: `dpsync_allreduce_grads` vs one raw
//!    `MPI_Allreduce` (rsmpi's `all_reduce_into`, send and receive buffers: rsmpi has no
//!    `MPI_IN_PLACE`).
//! 2. The ResNet-50 gradient set (161 tensors) on 2 ranks: fused `dpsync_allreduce_grads` vs one
//!    raw allreduce of the total size vs 161 raw allreduces.
//! 3. `dpsync_allreduce` of 1 float across 2 ranks vs a raw allreduce of 1 float (the agreement
//!    before mutation is in dpsync's figure).
//! 4. 2 ranks x 2 host replicas (4 in all, 64 MiB f32 each) with dpsync, and raw MPI over 4 ranks
//!    x 1 buffer (the second mpirun).
//! 5. Shards, 2 ranks x 1 host replica, one 64 MiB f32 GRAD and its PARAM:
//!    `dpsync_reduce_scatter_grads` + `dpsync_allgather(PARAM)` vs `dpsync_allreduce_grads`, and
//!    vs raw `MPI_Reduce_scatter_block` of the gradient + `MPI_Allgather` of the parameter's
//!    pieces (rsmpi's `reduce_scatter_block_into` and `all_gather_into`, separate send and
//!    receive buffers). Alone: `--part shards`.
//! 6. Overlap: a ResNet-50 step whose backward sleeps 250 µs per tensor (a GPU's backward
//!    leaves the CPU free), 2 ranks x 1 and x 2 replicas: backward alone, allreduce alone, the
//!    step without and with `dpsync_grad_ready`. Alone: `--part overlap` (also ranks of 1 and 2
//!    replicas); `DPSYNC_OVERLAP_US`
//!    sets the sleep per tensor (0: every mark at once, the buckets' own pace);
//!    `DPSYNC_BENCH_REPRODUCIBLE=1` makes the context reproducible.
//! 7. Elastic worlds (only alone, under an MPI with ULFM: `--part elastic`): 2 ranks x 1
//!    replica, one 64 MiB f32 GRAD, `dpsync_allreduce_grads` of a plain world against an
//!    elastic one.

#[path = "common/mod.rs"]
mod common;

use std::process::Command;
use std::ptr;
use std::time::{Duration, Instant};

use common::*;
use dpsync::*;
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

const SUM: u32 = dpsync_reduce_op::DPSYNC_REDUCE_SUM as u32;
const AVG: u32 = dpsync_reduce_op::DPSYNC_REDUCE_AVG as u32;
const GRAD: u32 = dpsync_role::DPSYNC_ROLE_GRAD as u32;
const F32: u32 = dpsync_dtype::DPSYNC_DTYPE_F32 as u32;

fn under_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// A context over MPI_COMM_WORLD with `replicas` host replicas on this rank.
fn world_context(replicas: usize) -> Context {
    Context::new(&world_options(replicas))
}

fn world_options(replicas: usize) -> Options {
    let o = Options::host(replicas);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD (initialised by this program already).
    check(unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) });
    o
}

/// Median times of `a` and `b` run alternately, every rank starting each together.
fn timed(
    world: &SimpleCommunicator,
    reps: usize,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> (Duration, Duration) {
    side_by_side(
        reps,
        || {
            world.barrier();
            a()
        },
        || {
            world.barrier();
            b()
        },
    )
}

/// One raw allreduce (sum) of `send` into `recv`.
fn raw(world: &SimpleCommunicator, send: &[f32], recv: &mut [f32]) {
    world.all_reduce_into(send, recv, SystemOperation::sum());
}

fn big_gradient(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let ctx = world_context(1);
    let mut grad = filled(n, 1, 0.0);
    ctx.reg("g", GRAD, 0, &mut grad, F32);
    let send = filled(n, 2, 0.0);
    let mut recv = vec![0f32; n];
    let (t_dpsync, t_raw) = timed(
        world,
        reps,
        || check(ctx.allreduce_grads(SUM)),
        || raw(world, &send, &mut recv),
    );
    if rank0 {
        println!(
            "2 ranks x 1 replica, one {} MiB f32 GRAD: dpsync_allreduce_grads {:.2} ms | raw MPI_Allreduce {:.2} ms | ratio {:.2} (target <= 1.05)",
            (n * 4) >> 20,
            ms(t_dpsync),
            ms(t_raw),
            t_dpsync.as_secs_f64() / t_raw.as_secs_f64()
        );
    }
}

/// An elastic world's cost when it loses nothing (run under an MPI with ULFM, `mpirun --with-ft
/// ulfm`: docs/PERFORMANCE.md): 2 ranks x 1 replica, one 64 MiB f32 GRAD, `allreduce_grads` of
/// a plain world against an elastic one (MPI messages only, a vote after every call).
fn elastic(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let plain = world_context(1);
    let o = Options::host(1);
    // SAFETY: valid options; NULL is MPI_COMM_WORLD.
    unsafe {
        check(dpsync_options_set_world_mpi(o.0, ptr::null()));
        check(dpsync_options_set_elastic(o.0, 1));
    }
    let elastic = Context::new(&o);
    let mut a = filled(n, 1, 0.0);
    let mut b = filled(n, 1, 0.0);
    plain.reg("g", GRAD, 0, &mut a, F32);
    elastic.reg("g", GRAD, 0, &mut b, F32);
    let (t_plain, t_elastic) = timed(
        world,
        reps,
        || check(plain.allreduce_grads(SUM)),
        || check(elastic.allreduce_grads(SUM)),
    );
    if rank0 {
        println!(
            "2 ranks x 1 replica, one {} MiB f32 GRAD{}: plain world {:.2} ms | elastic world {:.2} ms | elastic/plain {:.2} (target <= 1.1)",
            (n * 4) >> 20,
            if std::env::var_os("DPSYNC_MPI_SHM").is_some_and(|v| v == "0") { ", no shared memory" } else { "" },
            ms(t_plain),
            ms(t_elastic),
            t_elastic.as_secs_f64() / t_plain.as_secs_f64()
        );
    }
}

fn resnet(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let reps = if quick { 3 } else { 9 };
    let params = load_param_set("resnet50_params.tsv");
    let total: usize = params.iter().map(|(_, n)| n).sum();
    let ctx = world_context(1);
    let mut grads: Vec<Vec<f32>> = params.iter().map(|(_, n)| filled(*n, 3, 0.0)).collect();
    for ((name, _), g) in params.iter().zip(grads.iter_mut()) {
        ctx.reg(name, GRAD, 0, g, F32);
    }
    let send = filled(total, 4, 0.0);
    let mut recv = vec![0f32; total];
    let per_tensor: Vec<Vec<f32>> = params.iter().map(|(_, n)| filled(*n, 5, 0.0)).collect();
    let mut per_tensor_out: Vec<Vec<f32>> = params.iter().map(|(_, n)| vec![0f32; *n]).collect();
    let (t_fused, t_single) = timed(
        world,
        reps,
        || check(ctx.allreduce_grads(SUM)),
        || raw(world, &send, &mut recv),
    );
    let (t_unfused, t_single2) = timed(
        world,
        reps,
        || {
            for (s, r) in per_tensor.iter().zip(per_tensor_out.iter_mut()) {
                raw(world, s, r);
            }
        },
        || raw(world, &send, &mut recv),
    );
    if rank0 {
        println!(
            "ResNet-50 ({} tensors, {:.1} M f32), 2 ranks: dpsync fused {:.2} ms | one raw MPI_Allreduce of the total {:.2} ms | {} raw calls {:.2} ms (vs the single one then: {:.2} ms) | fused/single {:.2} (target <= 1.15)",
            params.len(),
            total as f64 / 1e6,
            ms(t_fused),
            ms(t_single),
            params.len(),
            ms(t_unfused),
            ms(t_single2),
            t_fused.as_secs_f64() / t_single.as_secs_f64()
        );
    }
}

/// Part 6: overlap. A ResNet-50 step whose backward leaves the CPU free, as a GPU's does (a
/// 250 µs sleep per tensor, in reverse order), on 2 ranks × `replicas` replicas (0: rank r
/// holds 1 + r % 2, ranks of different counts): the backward
/// alone, `dpsync_allreduce_grads` alone, the step without marks (backward, then
/// `allreduce_grads`) and with `dpsync_grad_ready` on every replica as each tensor is final
/// (buckets then cross the ranks during backward); the four alternate, every one started by a
/// barrier. Target: marked <= 1.25x the longer of backward and allreduce alone, and <= unmarked.
fn overlap(world: &SimpleCommunicator, rank0: bool, quick: bool, replicas: usize) {
    let (replicas, layout) = match replicas {
        0 => (1 + world.rank() as usize % 2, "1 and 2".to_owned()),
        n => (n, n.to_string()),
    };
    let reps = if quick { 2 } else { 7 };
    // DPSYNC_OVERLAP_US: another backward per tensor (0: every mark at once, the buckets'
    // own pace through the steps queue).
    let us = std::env::var("DPSYNC_OVERLAP_US")
        .ok()
        .and_then(|v| v.parse().ok());
    let per_tensor = Duration::from_micros(us.unwrap_or(if quick { 20 } else { 250 }));
    let params = load_param_set("resnet50_params.tsv");
    let reproducible = std::env::var_os("DPSYNC_BENCH_REPRODUCIBLE").is_some_and(|v| v == "1");
    let o = world_options(replicas);
    // SAFETY: valid options.
    check(unsafe { dpsync_options_set_reproducible(o.0, reproducible) });
    let ctx = Context::new(&o);
    let mut grads: Vec<Vec<Vec<f32>>> = (0..replicas)
        .map(|r| params.iter().map(|(_, n)| filled(*n, 3 + r, 0.0)).collect())
        .collect();
    for (r, set) in grads.iter_mut().enumerate() {
        for ((name, _), g) in params.iter().zip(set.iter_mut()) {
            ctx.reg(name, GRAD, r, g, F32);
        }
    }
    let backward = |marks: bool| {
        for (name, _) in params.iter().rev() {
            std::thread::sleep(per_tensor);
            if marks {
                (0..replicas).for_each(|r| check(ctx.grad_ready(name, r)));
            }
        }
    };
    // AVG keeps the values bounded however many steps run; the first step agrees on the
    // registrations (buckets start early from the second on).
    let step = || check(ctx.allreduce_grads(AVG));
    step();
    // The marked step's backward (its marks' cost to the caller).
    let marked_backward = std::cell::RefCell::new(Vec::new());
    // In the order printed: backward alone, allreduce alone, the step without marks, with.
    let runs: [&dyn Fn(); 4] = [
        &|| backward(false),
        &step,
        &|| {
            backward(false);
            step();
        },
        &|| {
            let t = Instant::now();
            backward(true);
            marked_backward.borrow_mut().push(t.elapsed());
            step();
        },
    ];
    let mut times = vec![Vec::new(); runs.len()];
    for rep in 0..=reps {
        for (i, run) in runs.iter().enumerate() {
            world.barrier();
            let t = Instant::now();
            run();
            if rep > 0 {
                times[i].push(t.elapsed());
            }
        }
    }
    let t: Vec<f64> = times.into_iter().map(|v| ms(median(v))).collect();
    let mut marked = marked_backward.into_inner();
    marked.remove(0); // the warm-up's
    if rank0 {
        let longer = t[0].max(t[1]);
        println!(
            "overlap, ResNet-50 step ({} tensors x {} us sleep), 2 ranks x {layout} replica(s){}{}: backward alone {:.2} ms | allreduce_grads alone {:.2} ms | step without marks {:.2} ms | step with marks {:.2} ms (its backward {:.2} ms) | marked/unmarked {:.2} (target <= 1) | marked/longer {:.2} (target <= 1.25) | unmarked/longer {:.2}",
            params.len(),
            per_tensor.as_micros(),
            if std::env::var_os("DPSYNC_MPI_SHM").is_some_and(|v| v == "0") { ", no shared memory" } else { "" },
            if reproducible { ", reproducible" } else { "" },
            t[0],
            t[1],
            t[2],
            t[3],
            ms(median(marked)),
            t[3] / t[2],
            t[3] / longer,
            t[2] / longer,
        );
    }
}

fn one_float(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let calls = if quick { 200 } else { 5000 };
    let reps = if quick { 3 } else { 9 };
    let ctx = world_context(1);
    let mut one = [1.0f32];
    ctx.reg("one", GRAD, 0, &mut one, F32);
    let send = [1.0f32];
    let mut recv = [0f32];
    let (t_dpsync, t_raw) = timed(
        world,
        reps,
        || (0..calls).for_each(|_| check(ctx.allreduce("one", SUM))),
        || (0..calls).for_each(|_| raw(world, &send, &mut recv)),
    );
    if rank0 {
        let us = |d: Duration| d.as_secs_f64() * 1e6 / calls as f64;
        println!(
            "1 float across 2 ranks ({calls} calls): dpsync_allreduce {:.2} us per call | raw MPI_Allreduce {:.2} us | ratio {:.2} (target <= 3)",
            us(t_dpsync),
            us(t_raw),
            t_dpsync.as_secs_f64() / t_raw.as_secs_f64()
        );
    }
}

/// Part 5: shards (ZeRO-1) across the ranks, 1 replica per rank. The three are timed in two
/// alternating pairs, (a) against (b) and (a) against (c); (a)'s figure is the first pair's.
fn shards(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let ranks = world.size() as usize;
    let ctx = world_context(1);
    let mut grad = filled(n, 9, -0.5);
    let mut param = filled(n, 10, 0.0);
    ctx.reg("w_grad", GRAD, 0, &mut grad, F32);
    ctx.reg("w", PARAM, 0, &mut param, F32);
    // SAFETY (both): a live context over registered memory, every rank making the same calls.
    let scatter_gather = || {
        check(unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) });
        check(unsafe { dpsync_allgather(ctx.0, PARAM) });
    };
    let allreduce = || check(ctx.allreduce_grads(SUM));
    // SAFETY (both): as above.
    let scatter = || check(unsafe { dpsync_reduce_scatter_grads(ctx.0, SUM) });
    let gather = || check(unsafe { dpsync_allgather(ctx.0, PARAM) });
    // Raw MPI: this rank's n / ranks of the summed gradient, then every rank's piece of the
    // parameter gathered whole.
    let piece = n / ranks;
    let send = filled(n, 11, -0.5);
    let mut reduced = vec![0f32; piece];
    let own = filled(piece, 12, 0.0);
    let mut gathered = vec![0f32; piece * ranks];
    let mut raw_pair = || {
        world.reduce_scatter_block_into(
            &send[..piece * ranks],
            &mut reduced[..],
            SystemOperation::sum(),
        );
        world.all_gather_into(&own[..], &mut gathered[..]);
    };
    let (t_dpsync, t_allreduce) = timed(world, reps, scatter_gather, allreduce);
    let (t_dpsync2, t_raw) = timed(world, reps, scatter_gather, &mut raw_pair);
    let (t_scatter, t_gather) = timed(world, reps, scatter, gather);
    if rank0 {
        println!(
            "shards, {ranks} ranks x 1 replica, {} MiB f32: reduce_scatter + allgather {:.2} ms | allreduce_grads {:.2} ms | raw MPI_Reduce_scatter_block + MPI_Allgather {:.2} ms (dpsync beside it: {:.2} ms) | ratios {:.2} to allreduce_grads (target <= 1.1), {:.2} to raw MPI (target <= 1.1)",
            (n * 4) >> 20,
            ms(t_dpsync),
            ms(t_allreduce),
            ms(t_raw),
            ms(t_dpsync2),
            t_dpsync.as_secs_f64() / t_allreduce.as_secs_f64(),
            t_dpsync2.as_secs_f64() / t_raw.as_secs_f64()
        );
        println!(
            "shards, the pair's halves: reduce_scatter_grads {:.2} ms | allgather(PARAM) {:.2} ms",
            ms(t_scatter),
            ms(t_gather)
        );
    }
}

/// Part 4, dpsync's side: 2 local replicas per rank.
fn two_by_two(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let ctx = world_context(2);
    let mut grads = [filled(n, 6, 0.0), filled(n, 7, 0.0)];
    for (r, g) in grads.iter_mut().enumerate() {
        ctx.reg("g", GRAD, r, g, F32);
    }
    let mut times = Vec::new();
    check(ctx.allreduce_grads(SUM));
    for _ in 0..reps {
        world.barrier();
        let t = Instant::now();
        check(ctx.allreduce_grads(SUM));
        times.push(t.elapsed());
    }
    if rank0 {
        println!(
            "2 ranks x 2 replicas ({} MiB f32 each, 4 in all): dpsync_allreduce_grads {:.2} ms (raw MPI over 4 ranks x 1 buffer: the next line)",
            (n * 4) >> 20,
            ms(median(times))
        );
    }
}

/// Part 4, raw MPI's side: 4 ranks x 1 buffer.
fn four_ranks_raw(world: &SimpleCommunicator, rank0: bool, quick: bool) {
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let send = filled(n, 8, 0.0);
    let mut recv = vec![0f32; n];
    raw(world, &send, &mut recv);
    let mut times = Vec::new();
    for _ in 0..reps {
        world.barrier();
        let t = Instant::now();
        raw(world, &send, &mut recv);
        times.push(t.elapsed());
    }
    if rank0 {
        println!(
            "4 ranks x 1 buffer ({} MiB f32 each): raw MPI_Allreduce {:.2} ms",
            (n * 4) >> 20,
            ms(median(times))
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if !under_mpirun() {
        println!(
            "dpsync {} world benchmarks (MPI), {} hardware threads",
            env!("CARGO_PKG_VERSION"),
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
        let exe = std::env::current_exe().expect("the benchmark's path");
        for (ranks, part) in [(2, "two"), (4, "four")] {
            let mut cmd = Command::new("mpirun");
            cmd.args([
                "--allow-run-as-root",
                "--oversubscribe",
                "-n",
                &ranks.to_string(),
            ])
            .arg(&exe)
            .args(["--part", part]);
            if quick {
                cmd.arg("--quick");
            }
            let status = cmd
                .status()
                .expect("mpirun (Open MPI): scripts/common.sh ensure_mpi");
            assert!(status.success(), "{ranks} ranks: {status}");
        }
        gloo(quick);
        return;
    }
    let part = args
        .iter()
        .position(|a| a == "--part")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_default();
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Multiple).expect("MPI initialises once");
    let world = universe.world();
    let rank0 = world.rank() == 0;
    match part.as_str() {
        "two" => {
            big_gradient(&world, rank0, quick);
            resnet(&world, rank0, quick);
            overlap(&world, rank0, quick, 1);
            overlap(&world, rank0, quick, 2);
            one_float(&world, rank0, quick);
            two_by_two(&world, rank0, quick);
            shards(&world, rank0, quick);
        }
        "four" => four_ranks_raw(&world, rank0, quick),
        // Alone, for A/B runs of the call overhead: mpirun -n 2 <bench binary> --part one
        "one" => one_float(&world, rank0, quick),
        // The large transfers alone (parts 1 and 2), for A/B runs of the engine's pieces.
        "large" => {
            big_gradient(&world, rank0, quick);
            resnet(&world, rank0, quick);
        }
        // Part 6 alone, 1 then 2 replicas per rank, then 1 and 2 (DPSYNC_MPI_SHM=0: over
        // MPI's messages).
        "overlap" => {
            overlap(&world, rank0, quick, 1);
            overlap(&world, rank0, quick, 2);
            overlap(&world, rank0, quick, 0);
        }
        // Shards alone (part 5): mpirun -n 2 <bench binary> --part shards
        "shards" => shards(&world, rank0, quick),
        // Under ULFM only: LD_LIBRARY_PATH=V/lib V/bin/mpirun --with-ft ulfm -n 2 <bench
        // binary> --part elastic
        "elastic" => elastic(&world, rank0, quick),
        other => panic!("unknown part {other:?}"),
    }
}

/// torch.distributed's Gloo on the same sizes, when Debian's PyTorch is installed (or the Python
/// named by DPSYNC_BENCH_PYTHON has torch): the figure a user would otherwise get
/// (benches/gloo_allreduce.py, 2 ranks).
fn gloo(quick: bool) {
    let python = std::env::var("DPSYNC_BENCH_PYTHON").unwrap_or("/usr/bin/python3".into());
    let python = python.as_str();
    let has_torch = Command::new(python)
        .args(["-c", "import torch.distributed"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        println!(
            "Gloo: skipped: PyTorch is not installed for {python} (apt-get install python3-torch)"
        );
        return;
    }
    let script = common::bench_file("gloo_allreduce.py");
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        "2",
        python,
        &script,
    ]);
    if quick {
        cmd.arg("--quick");
    }
    let status = cmd.status().expect("mpirun (Open MPI)");
    assert!(status.success(), "Gloo benchmark: {status}");
}
