//! DPSYNC_HOST_THREADS is read when a context is created. Its own test binary: the variable is
//! process-wide, so no other test may run beside it.

mod common {
    pub mod abi;
    pub mod context;
}

use common::{abi::*, context::*};

#[test]
fn host_threads_follow_the_environment_and_give_the_same_bytes() {
    let run = |threads: Option<&str>| -> (u64, Vec<f32>) {
        match threads {
            Some(v) => std::env::set_var("DPSYNC_HOST_THREADS", v),
            None => std::env::remove_var("DPSYNC_HOST_THREADS"),
        }
        let ctx = Context::host(3, None);
        std::env::remove_var("DPSYNC_HOST_THREADS");
        let n = 1 << 20; // large enough for the threaded path
        let mut bufs: Vec<Vec<f32>> = (0..3)
            .map(|r| {
                (0..n)
                    .map(|i| ((i * 31 + r * 7) % 97) as f32 * 0.013)
                    .collect()
            })
            .collect();
        for (r, b) in bufs.iter_mut().enumerate() {
            ctx.reg("g", GRAD, r, b, F32);
        }
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        let json: serde_json::Value = serde_json::from_str(&ctx.describe()).unwrap();
        (
            json["backend"]["threads"].as_u64().unwrap(),
            bufs.swap_remove(2),
        )
    };
    let (one, a) = run(Some("1"));
    assert_eq!(one, 1);
    let (three, b) = run(Some("3"));
    assert_eq!(three, 3);
    let (default, c) = run(None);
    let hw = std::thread::available_parallelism().unwrap().get() as u64;
    assert_eq!(default, hw);
    let (ignored, _) = run(Some("zero"));
    assert_eq!(
        ignored, hw,
        "an unparsable value falls back to every hardware thread"
    );
    assert!(
        a == b && b == c,
        "the thread count must not change a single byte"
    );
}
