//! The world calls in one process, through the C ABI: without MPI setting a world is
//! UNAVAILABLE and changes nothing (with MPI, a communicator needs MPI initialised), and a
//! context is a world of one rank (rank 0 of 1, its replicas the whole world).

use std::ffi::{c_void, CStr};
use std::ptr;

use dpsync::*;

use dpsync_status::*;

/// A query with two outputs.
type Query<'a> = dyn Fn(&mut usize, &mut usize) -> dpsync_status + 'a;

fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated per-thread string.
    unsafe { CStr::from_ptr(dpsync_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn host_options(replicas: usize) -> *mut dpsync_options {
    let mut o = ptr::null_mut();
    unsafe {
        assert_eq!(dpsync_options_new(&mut o), DPSYNC_STATUS_OK);
        assert_eq!(
            dpsync_options_set_host_replicas(o, replicas),
            DPSYNC_STATUS_OK
        );
    }
    o
}

#[cfg(not(feature = "mpi"))]
#[test]
fn a_world_without_mpi_is_unavailable_and_changes_nothing() {
    let o = host_options(3);
    let comm = 0usize;
    for mpi_comm in [ptr::null(), &comm as *const usize as *const c_void] {
        let st = unsafe { dpsync_options_set_world_mpi(o, mpi_comm) };
        assert_eq!(st, DPSYNC_STATUS_UNAVAILABLE);
        let msg = last_error();
        assert!(
            msg.contains("MPI") && msg.contains("dpsync_options_set_world_mpi"),
            "{msg}"
        );
    }
    let st = unsafe { dpsync_options_set_world_mpi(ptr::null_mut(), ptr::null()) };
    assert_eq!(st, DPSYNC_STATUS_INVALID_ARGUMENT);
    assert!(last_error().contains("options"), "{}", last_error());
    // The options still make the single-process context they made before.
    let mut ctx = ptr::null_mut();
    unsafe {
        assert_eq!(dpsync_context_create(o, &mut ctx), DPSYNC_STATUS_OK);
        let mut n = 0;
        assert_eq!(dpsync_replica_count(ctx, &mut n), DPSYNC_STATUS_OK);
        assert_eq!(n, 3);
        let (mut rank, mut ranks) = (9, 9);
        assert_eq!(dpsync_rank(ctx, &mut rank, &mut ranks), DPSYNC_STATUS_OK);
        assert_eq!((rank, ranks), (0, 1));
        dpsync_context_destroy(ctx);
        dpsync_options_free(o);
    }
}

/// With the MPI engine, a communicator needs MPI initialised by the caller (nothing here does),
/// and NULL (MPI_COMM_WORLD) is taken; worlds themselves are tested by tests/world_mpi.rs.
#[cfg(feature = "mpi")]
#[test]
fn a_communicator_needs_mpi_initialised() {
    let o = host_options(2);
    let comm = 0usize;
    let st = unsafe { dpsync_options_set_world_mpi(o, &comm as *const usize as *const c_void) };
    assert_eq!(st, DPSYNC_STATUS_INVALID_STATE);
    assert!(last_error().contains("mpi_comm"), "{}", last_error());
    let st = unsafe { dpsync_options_set_world_mpi(o, ptr::null()) };
    assert_eq!(st, DPSYNC_STATUS_OK, "{}", last_error());
    unsafe { dpsync_options_free(o) };
}

#[test]
fn one_process_is_a_world_of_one_rank_holding_every_replica() {
    let o = host_options(4);
    let mut ctx = ptr::null_mut();
    unsafe {
        assert_eq!(dpsync_context_create(o, &mut ctx), DPSYNC_STATUS_OK);
        let (mut total, mut offset) = (0, 9);
        assert_eq!(
            dpsync_world_replicas(ctx, &mut total, &mut offset),
            DPSYNC_STATUS_OK
        );
        assert_eq!((total, offset), (4, 0));
        let mut scale = 0.0;
        assert_eq!(dpsync_loss_scale(ctx, &mut scale), DPSYNC_STATUS_OK);
        assert_eq!(scale, 1.0 / total as f64);

        // NULL outputs and contexts name the argument; the outputs are not written.
        let (mut x, mut y) = (7, 7);
        let calls: [(&str, &Query<'_>); 6] = [
            ("rank", &|_, y| dpsync_rank(ctx, ptr::null_mut(), y)),
            ("ranks", &|x, _| dpsync_rank(ctx, x, ptr::null_mut())),
            ("total", &|_, y| {
                dpsync_world_replicas(ctx, ptr::null_mut(), y)
            }),
            ("offset", &|x, _| {
                dpsync_world_replicas(ctx, x, ptr::null_mut())
            }),
            ("context", &|x, y| dpsync_rank(ptr::null(), x, y)),
            ("context", &|x, y| dpsync_world_replicas(ptr::null(), x, y)),
        ];
        for (arg, call) in calls {
            assert_eq!(
                call(&mut x, &mut y),
                DPSYNC_STATUS_INVALID_ARGUMENT,
                "{arg}"
            );
            assert!(last_error().starts_with(arg), "{arg}: {}", last_error());
        }
        assert_eq!((x, y), (7, 7), "nothing written on failure");
        dpsync_context_destroy(ctx);
        dpsync_options_free(o);
    }
}
