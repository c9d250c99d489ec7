//! Long random sequences of C calls on host replicas, every call checked against a model the
//! test keeps: which names are registered (role, dtype, count, memory per replica), the sparse
//! gradients and their slices, the `dpsync_grad_ready` marks of the step, the BMUF filter, and
//! the contents of every registered buffer.
//!
//! After every call:
//! 1. the status is never `DPSYNC_STATUS_PANIC` and is one the model allows (a set, where the
//!    documentation names several errors for one input and leaves their order open);
//! 2. a failing call changed no byte of any registered tensor, left a non-empty message, and
//!    (seen later) no registration: the model, which did not change either, keeps predicting the
//!    library's answers;
//! 3. a successful call left exactly the bytes the model predicts (docs/API.md "Exact
//!    arithmetic", "Overlap", "BMUF", "Sparse gradients"), did not touch memory the library
//!    does not own as a registered tensor (unregistered tensors, sparse slices), and did not
//!    change `dpsync_last_error()`.
//!
//! A failure prints the seed, the context's options and the last calls; `DPSYNC_SEQ_SEED=<n>`
//! runs only that seed (in the test that owns it) and `DPSYNC_SEQ_TRACE=1` prints every call
//! (`cargo test --release --test sequences -- --nocapture`).

#[path = "../common"]
mod common {
    pub mod abi;
    pub mod buf;
    pub mod context;
    pub mod errors;
    pub mod float16;
    pub mod lcg;
    pub mod reference;
}

mod bmuf;
mod buffers;
mod check;
mod collectives;
mod describe;
mod generate;
mod misc;
mod model;
mod registration;
mod sparse;

use model::Sim;

/// Sequences per #[test] (four tests: 100 sequences in all, run in parallel by the harness).
const SEQUENCES_PER_TEST: u64 = 25;
/// C calls per sequence (a compound operation may run a few past it).
const CALLS: usize = 1000;

/// One sequence: a context with random options, CALLS checked calls, a final describe check.
fn run_sequence(seed: u64) {
    let mut sim = Sim::new(seed);
    sim.note(format!(
        "-- context: {} host replicas, fusion_bytes {:?}, coalesce {}",
        sim.n, sim.fusion_set, sim.coalesce
    ));
    while sim.calls < CALLS {
        sim.random_op();
    }
    sim.op_describe();
    // Nothing registered is freed before the context: `sim.ctx` is dropped first.
    drop(sim);
}

fn run_seeds(first: u64) {
    let only: Option<u64> = std::env::var("DPSYNC_SEQ_SEED")
        .ok()
        .map(|s| s.parse().expect("DPSYNC_SEQ_SEED is a number"));
    for seed in first..first + SEQUENCES_PER_TEST {
        if only.is_none_or(|o| o == seed) {
            run_sequence(seed);
        }
    }
}

#[test]
fn random_call_sequences_seeds_0_to_24() {
    run_seeds(0);
}

#[test]
fn random_call_sequences_seeds_25_to_49() {
    run_seeds(25);
}

#[test]
fn random_call_sequences_seeds_50_to_74() {
    run_seeds(50);
}

#[test]
fn random_call_sequences_seeds_75_to_99() {
    run_seeds(75);
}
