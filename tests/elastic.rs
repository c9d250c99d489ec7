//! The elastic addendum's calls on a context without a world (every build): `dpsync_leave` is
//! INVALID_STATE, `dpsync_world_epoch` answers 0 and 0, NULL arguments are INVALID_ARGUMENT,
//! and `dpsync_options_set_elastic` changes nothing a world-less context does.

mod common {
    pub mod abi;
    pub mod context;
}

use std::ptr;

use common::{abi::*, context::*};
use dpsync::*;

#[test]
fn elastic_calls_without_a_world() {
    let o = Options::host(2);
    // SAFETY: NULL options are refused; valid ones are changed.
    unsafe {
        assert_eq!(
            dpsync_options_set_elastic(ptr::null_mut(), 2),
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("options"), "{}", last_error());
        check(dpsync_options_set_elastic(o.0, 2), "set_elastic");
    }
    let ctx = Context::new(&o);
    let (mut epoch, mut first) = (7u64, 7usize);
    // SAFETY: a live context; NULL outputs are refused.
    unsafe {
        assert_eq!(dpsync_leave(ctx.0), INVALID_STATE);
        assert!(last_error().contains("no world"), "{}", last_error());
        check(dpsync_world_epoch(ctx.0, &mut epoch, &mut first), "epoch");
        assert_eq!((epoch, first), (0, 0));
        assert_eq!(
            dpsync_world_epoch(ctx.0, ptr::null_mut(), &mut first),
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("epoch"), "{}", last_error());
        assert_eq!(
            dpsync_world_epoch(ctx.0, &mut epoch, ptr::null_mut()),
            INVALID_ARGUMENT
        );
        assert!(last_error().contains("first_rank"), "{}", last_error());
        assert_eq!(dpsync_leave(ptr::null_mut()), INVALID_ARGUMENT);
        assert_eq!(
            dpsync_world_epoch(ptr::null(), &mut epoch, &mut first),
            INVALID_ARGUMENT
        );
        let name = std::ffi::CStr::from_ptr(dpsync_status_name(10));
        assert_eq!(name.to_str(), Ok("DPSYNC_STATUS_RANK_LOST"));
    }
    // The context works as ever: a leave refused changes nothing.
    let mut g = [vec![1.0f32; 4], vec![2.0f32; 4]];
    for (k, g) in g.iter_mut().enumerate() {
        ctx.reg("g", GRAD, k, g, F32);
    }
    assert_eq!(ctx.allreduce_grads(SUM), OK, "{}", last_error());
    assert!(g.iter().all(|g| g.iter().all(|&x| x == 3.0)));
}
