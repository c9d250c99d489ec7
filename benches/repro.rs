//! Reproducible sums (`dpsync_options_set_reproducible`) against the plain ones, side by side
//! (alternating) in one run. Run: `cargo bench --bench repro` (host, and CUDA where a GPU is
//! found), `cargo bench --features mpi --bench repro` adds the worlds (it starts itself under
//! `mpirun -n 2`); `-- --quick` for a short smoke run. Figures go to docs/PERFORMANCE.md.
//!
//! 1. Host, 4 replicas x 64 MiB f32: `dpsync_allreduce_grads` reproducible vs plain (target
//!    <= 1.5x).
//! 2. CUDA, 2 replicas on GPU 0 x 64 MiB f32: the same (target <= 2.5x).
//! 3. World, 2 ranks x 1 and 2 replicas and of 1 and 2 (uneven), 64 MiB f32, the same
//!    elements as bf16 (1 replica), and the ResNet-50 gradient set fused (1 replica): the same
//!    (target <= 2.0x); `DPSYNC_MPI_SHM=0` runs the ranks as if on several hosts.
//!
//! For scale: ReproBLAS's reproducible sums cost 4-7x a plain sum (Demmel, Ahrens, Nguyen,
//! "Efficient reproducible floating point summation and BLAS", 2016).

#[path = "common/mod.rs"]
mod common;

use std::ffi::c_void;
use std::time::Duration;

use common::*;
use dpsync::*;

/// Options of the compared contexts: reproducible or not.
fn set_reproducible(o: &Options, on: bool) {
    // SAFETY: valid options.
    check(unsafe { dpsync_options_set_reproducible(o.0, on) });
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

fn host(quick: bool) {
    let replicas = 4;
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let make = |on: bool| {
        let o = Options::host(replicas);
        set_reproducible(&o, on);
        Context::new(&o)
    };
    let (plain, repro) = (make(false), make(true));
    let mut a: Vec<Vec<f32>> = (0..replicas).map(|r| filled(n, r, -0.5)).collect();
    let mut b = a.clone();
    for r in 0..replicas {
        plain.reg("g", GRAD, r, &mut a[r], F32);
        repro.reg("g", GRAD, r, &mut b[r], F32);
    }
    let avg = dpsync_reduce_op::DPSYNC_REDUCE_AVG as u32;
    let (t_repro, t_plain) = side_by_side(
        reps,
        || check(repro.allreduce_grads(avg)),
        || check(plain.allreduce_grads(avg)),
    );
    println!(
        "host, {replicas} replicas x {} MiB f32, allreduce_grads: reproducible {:.2} ms | plain {:.2} ms | ratio {:.2} (target <= 1.5)",
        (n * 4) >> 20,
        ms(t_repro),
        ms(t_plain),
        ratio(t_repro, t_plain)
    );
}

fn cuda(quick: bool) {
    use cudarc::driver::{CudaContext, DevicePtr};
    let n = if quick { 1 << 20 } else { 16 << 20 };
    let reps = if quick { 3 } else { 9 };
    let make = |on: bool| {
        cuda_context(|o| {
            o.set_cuda_replicas(&[0, 0]);
            set_reproducible(o, on);
        })
    };
    let (Some(plain), Some(repro)) = (make(false), make(true)) else {
        println!("cuda: skipped: no CUDA device");
        return;
    };
    let gpu = CudaContext::new(0).expect("GPU 0");
    let stream = gpu.default_stream();
    let bufs: Vec<_> = (0..4)
        .map(|k| stream.clone_htod(&filled(n, k, -0.5)).unwrap())
        .collect();
    for (k, buf) in bufs.iter().enumerate() {
        let (ptr, _sync) = buf.device_ptr(&stream);
        let ctx = if k < 2 { &plain } else { &repro };
        register(ctx, "g", GRAD, k % 2, ptr as *mut c_void, n, F32);
    }
    let step = |ctx: &Context| {
        check(ctx.allreduce_grads(SUM));
        // SAFETY: a live context.
        check(unsafe { dpsync_synchronize(ctx.0) });
    };
    let (t_repro, t_plain) = side_by_side(reps, || step(&repro), || step(&plain));
    println!(
        "cuda, 2 replicas on GPU 0 x {} MiB f32, allreduce_grads: reproducible {:.2} ms | plain {:.2} ms | ratio {:.2} (target <= 2.5)",
        (n * 4) >> 20,
        ms(t_repro),
        ms(t_plain),
        ratio(t_repro, t_plain)
    );
}

#[cfg(feature = "mpi")]
mod world {
    use super::*;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::*;

    pub fn under_mpirun() -> bool {
        std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
    }

    pub fn launch(quick: bool) {
        let exe = std::env::current_exe().expect("the benchmark's path");
        let mut cmd = std::process::Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "2"])
            .arg(&exe)
            .arg("--world");
        if std::env::var_os("DPSYNC_MPI_SHM").is_some() {
            // Every rank as if on its own host (`DPSYNC_MPI_SHM=0`): MPI's messages alone.
            cmd.args(["-x", "DPSYNC_MPI_SHM"]);
        }
        if quick {
            cmd.arg("--quick");
        }
        let status = cmd
            .status()
            .expect("mpirun (Open MPI): scripts/common.sh ensure_mpi");
        assert!(status.success(), "2 ranks: {status}");
    }

    fn context(on: bool, replicas: usize) -> Context {
        let o = Options::host(replicas);
        set_reproducible(&o, on);
        // SAFETY: valid options; NULL is MPI_COMM_WORLD (initialised by this program already).
        check(unsafe { dpsync_options_set_world_mpi(o.0, std::ptr::null()) });
        Context::new(&o)
    }

    /// `tensors` (name, elements) of `dtype` (F32 or BF16) registered on a plain and a
    /// reproducible context of `replicas` on this rank (`layout` says every rank's), timed
    /// alternately; rank 0 prints `what`.
    fn compare(
        world: &SimpleCommunicator,
        (what, replicas, layout): (&str, usize, &str),
        (tensors, dtype): (&[(String, usize)], u32),
        reps: usize,
    ) {
        let (plain, repro) = (context(false, replicas), context(true, replicas));
        // Every value as bits of the dtype's width, in words of 4 bytes.
        let words = |n: usize, seed: usize| -> Vec<u32> {
            let values = filled(n, seed, -0.5);
            match dtype {
                F32 => values.iter().map(|v| v.to_bits()).collect(),
                _ => (values.chunks(2))
                    .map(|p| {
                        let bits = |v: &f32| u32::from(half::bf16::from_f32(*v).to_bits());
                        p.iter().rev().fold(0, |w, v| w << 16 | bits(v))
                    })
                    .collect(),
            }
        };
        let mut a: Vec<Vec<u32>> = (0..replicas)
            .flat_map(|r| tensors.iter().map(move |(_, n)| (*n, 3 + r)))
            .map(|(n, seed)| words(n, seed))
            .collect();
        let mut b = a.clone();
        for r in 0..replicas {
            for (k, (name, n)) in tensors.iter().enumerate() {
                let i = r * tensors.len() + k;
                let (pa, pb) = (a[i].as_mut_ptr().cast(), b[i].as_mut_ptr().cast());
                register(&plain, name, GRAD, r, pa, *n, dtype);
                register(&repro, name, GRAD, r, pb, *n, dtype);
            }
        }
        let (t_repro, t_plain) = side_by_side(
            reps,
            || {
                world.barrier();
                check(repro.allreduce_grads(SUM))
            },
            || {
                world.barrier();
                check(plain.allreduce_grads(SUM))
            },
        );
        if world.rank() == 0 {
            let shm = match std::env::var("DPSYNC_MPI_SHM").as_deref() {
                Ok("0") => "no shared memory",
                _ => "shared memory",
            };
            println!(
                "world ({shm}), 2 ranks x {layout} replica(s), {what}: reproducible {:.2} ms | plain {:.2} ms | ratio {:.2} (target <= 2.0)",
                ms(t_repro),
                ms(t_plain),
                ratio(t_repro, t_plain)
            );
        }
    }

    pub fn rank(quick: bool) {
        let (universe, _) =
            mpi::initialize_with_threading(mpi::Threading::Multiple).expect("MPI initialises once");
        let world = universe.world();
        let reps = if quick { 3 } else { 9 };
        let n = if quick { 1 << 20 } else { 16 << 20 };
        let what = format!("one {} MiB f32 GRAD", (n * 4) >> 20);
        let one = [("g".to_string(), n)];
        for replicas in [1, 2] {
            let layout = replicas.to_string();
            compare(&world, (&what, replicas, &layout), (&one, F32), reps);
        }
        // Rank 0 one replica, rank 1 two: the owners' exchange with other counts per rank.
        let uneven = 1 + world.rank() as usize % 2;
        compare(&world, (&what, uneven, "(1, 2)"), (&one, F32), reps);
        // The same elements as bf16 (half the bytes), one replica per rank.
        let what = format!("one {} MiB bf16 GRAD", (n * 2) >> 20);
        compare(&world, (&what, 1, "1"), (&one, BF16), reps);
        let resnet = load_param_set("resnet50_params.tsv");
        let total: usize = resnet.iter().map(|(_, n)| n).sum();
        let what = format!(
            "ResNet-50 ({} tensors, {:.1} M f32) fused",
            resnet.len(),
            total as f64 / 1e6
        );
        compare(&world, (&what, 1, "1"), (&resnet, F32), reps);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    #[cfg(feature = "mpi")]
    if world::under_mpirun() {
        return world::rank(quick);
    }
    println!(
        "dpsync {} reproducible sums, {} hardware threads",
        env!("CARGO_PKG_VERSION"),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    host(quick);
    cuda(quick);
    #[cfg(feature = "mpi")]
    world::launch(quick);
    #[cfg(not(feature = "mpi"))]
    println!(
        "world: skipped: built without --features mpi (cargo bench --features mpi --bench repro)"
    );
}
