#!/usr/bin/env bash
# The GPU tests on a CPU: builds tests/fakecuda/fake_cuda.cpp (a libcuda.so.1 stand-in that runs
# dpsync's kernels and the tests' own on CPU threads) and tests/fakecuda/fake_nccl.cpp (a
# libnccl.so.2 stand-in that matches every rank's calls and checks them) into target/fakecuda,
# and runs tests/cuda*.rs against them: on one fake GPU; on four under three peer-access patterns
# (all pairs, none, Caffe2's seed topology GPU1<->GPU2 only); with two NCCL ranks on one GPU; with
# a slow NCCL setup; with NCCL unusable; and with NCCL faults injected. All of it twice: with
# synchronous streams, and with asynchronous ones (FAKE_CUDA_ASYNC=1, see fake_cuda.cpp's header),
# except the four-GPU runs with synchronous streams, which take the mixed peer pattern only.
# With asynchronous streams the mixed pattern runs every multi-GPU test (its device sets take
# peer and staged copies both); all pairs and none run the tests whose values cross GPUs by each
# collective's route (PEER_TESTS below), not the stream-order, overlap, refusal and NCCL-only ones,
# which do not depend on the pattern beyond what the mixed one takes. --full runs every
# multi-GPU test under every pattern (about 3 minutes more on 2 cores).
# This exercises the whole CUDA backend's
# host side (contexts, streams, events, memory, pointer attributes, tables, launches, peer and
# staged copies, NCCL groups, sends and receives, timeouts and aborts) and its stream ordering by
# events, without a GPU. It proves nothing about real NCCL transports, speed or the hardware
# (docs/GPU-VALIDATION.md).
#   bash scripts/fake-cuda.sh [--full] [extra cargo test arguments]
# scripts/test.sh runs it; it also runs examples_c/cuda_train and bmuf_train --gpus against the
# fake driver.
source "$(dirname "$0")/common.sh"

full=""
if [ "${1:-}" = --full ]; then full=1; shift; fi

ensure_tools
cuda_tools
step "fake CUDA driver: target/fakecuda/libcuda.so.1"
build_fake_cuda
# DPSYNC_REQUIRE_GPU: with the fake driver and NCCL here, an UNAVAILABLE context is a failure.
export DPSYNC_FAKE_CUDA=1 DPSYNC_REQUIRE_GPU=1 LD_LIBRARY_PATH="$PWD/target/fakecuda:${LD_LIBRARY_PATH:-}"
unset FAKE_CUDA_DEVICES FAKE_CUDA_PEER FAKE_NCCL_FAULT FAKE_NCCL_INIT_FAULT DPSYNC_NCCL_LIBRARY
TESTS=(--test cuda --test cuda_bmuf --test cuda_sparse --test shard --test repro)
# The multi-GPU tests that check values after each collective family's route across GPUs
# (allreduce over every device set, the plan describe shows, BMUF, sparse gathers, reproducible
# sums): the ones the all-pairs and no-pairs patterns run without --full.
PEER_TESTS=(allreduce_across_gpus_every_dtype_and_transport
  describe_across_gpus_shows_the_detected_peer_matrix_and_its_plan
  bmuf_across_gpus_follows_the_host_run gathers_across_gpus_match_the_host_byte_for_byte
  cuda_replicas_across_gpus_give_the_hosts_bytes)
# Twice: with synchronous streams (every launch and copy done when the call returns), then with
# FAKE_CUDA_ASYNC=1 (streams as worker threads with random pauses, events and waits as on a GPU),
# where a missing event wait gives wrong values and the stream-order and timeout tests run.
for streams in synchronous asynchronous; do
  if [ $streams = asynchronous ]; then export FAKE_CUDA_ASYNC=1; else unset FAKE_CUDA_ASYNC; fi
  step "GPU tests on one fake GPU, $streams streams"
  cargo test --release "${TESTS[@]}" "$@" -- --test-threads=1
  # Every peer pattern with asynchronous streams (the stricter mode); with synchronous ones the
  # mixed pattern only, which takes peer and staged copies in one run (the suite's time limit).
  peers=("" 0 1-2)
  if [ $streams = synchronous ]; then peers=(1-2); fi
  for peer in "${peers[@]}"; do
    case $peer in
      "") pattern="every pair has peer access" ;;
      0) pattern="no pair has peer access: staged copies" ;;
      *) pattern="only GPU1<->GPU2, Caffe2's seed topology" ;;
    esac
    filters=(across) which="every multi-GPU test"
    if [ -z "$full" ] && [ "$peer" != 1-2 ]; then
      filters=("${PEER_TESTS[@]}") which="the routes' value tests"
    fi
    step "GPU tests across four fake GPUs, $streams streams, FAKE_CUDA_PEER='$peer' ($pattern): $which"
    FAKE_CUDA_DEVICES=4 FAKE_CUDA_PEER=$peer cargo test --release "${TESTS[@]}" "$@" -- \
      --test-threads=1 "${filters[@]}"
  done
  step "the caller's current context and set_stream's special handles on two fake GPUs, $streams streams"
  FAKE_CUDA_DEVICES=2 cargo test --release --test cuda "$@" -- --test-threads=1 \
    the_callers_current_context set_stream_takes a_device_fault
  step "a peer limit (FAKE_CUDA_PEER_LIMIT=1) across four fake GPUs, $streams streams"
  FAKE_CUDA_DEVICES=4 FAKE_CUDA_PEER_LIMIT=1 \
    cargo test --release --test cuda "$@" -- --test-threads=1 a_peer_limit
  step "two NCCL ranks on one fake GPU (DPSYNC_NCCL_RANK_PER_REPLICA=1), $streams streams"
  DPSYNC_NCCL_RANK_PER_REPLICA=1 NCCL_MULTI_RANK_GPU_ENABLE=1 \
    cargo test --release "${TESTS[@]}" "$@" -- --test-threads=1 two_nccl_ranks
  step "slow NCCL setup (FAKE_NCCL_SETUP_MS=800) under a 200 ms timeout, $streams streams"
  FAKE_CUDA_DEVICES=2 FAKE_NCCL_SETUP_MS=800 \
    cargo test --release --test cuda "$@" -- --test-threads=1 slow_nccl_setup
  step "NCCL unusable (DPSYNC_NCCL_LIBRARY names a missing file; FAKE_NCCL_INIT_FAULT=1), $streams streams"
  FAKE_CUDA_DEVICES=2 DPSYNC_NCCL_LIBRARY=/nonexistent/libnccl.so.2 \
    cargo test --release --test cuda "$@" -- --test-threads=1 unusable_nccl
  FAKE_CUDA_DEVICES=2 FAKE_NCCL_INIT_FAULT=1 \
    cargo test --release --test cuda "$@" -- --test-threads=1 unusable_nccl
  for fault in hang error; do
    step "NCCL fault injected: FAKE_NCCL_FAULT=$fault, $streams streams"
    FAKE_CUDA_DEVICES=2 FAKE_NCCL_FAULT=$fault DPSYNC_NCCL_SETUP_TIMEOUT_MS=1000 \
      cargo test --release --test cuda "$@" -- --test-threads=1 a_failing_nccl
  done
done
unset FAKE_CUDA_ASYNC
step "timeline: device spans of CUDA collectives (tests/timeline.rs), synchronous and asynchronous streams"
cargo test --release --test timeline "$@"
FAKE_CUDA_ASYNC=1 cargo test --release --test timeline "$@"
step "examples_c/cuda_train on the fake CUDA driver"
build_library
build_examples
build/examples/cuda_train --gpus 0,0,0,0
build/examples/cuda_train --gpus 0,0 --transport peer_copy
FAKE_CUDA_DEVICES=4 build/examples/cuda_train --gpus 0,1,2,3 --transport nccl
FAKE_CUDA_DEVICES=4 FAKE_CUDA_PEER=1-2 build/examples/cuda_train --gpus 2,0,1,1 --transport peer_copy
step "examples_c/bmuf_train with CUDA replicas on the fake CUDA driver"
build/examples/bmuf_train --gpus 0,0,0,0 | tail -1
FAKE_CUDA_DEVICES=4 build/examples/bmuf_train --gpus 0,1,2,3 --transport nccl | tail -1
FAKE_CUDA_DEVICES=4 FAKE_CUDA_PEER=1-2 build/examples/bmuf_train --gpus 2,0,1,1 \
  --transport peer_copy --nesterov | tail -1
step "examples_c/cuda_train and bmuf_train on asynchronous fake streams (FAKE_CUDA_ASYNC=1)"
FAKE_CUDA_ASYNC=1 FAKE_CUDA_DEVICES=4 build/examples/cuda_train --gpus 0,1,2,3 --transport nccl
FAKE_CUDA_ASYNC=1 FAKE_CUDA_DEVICES=4 FAKE_CUDA_PEER=1-2 build/examples/cuda_train --gpus 2,0,1,1 \
  --transport peer_copy
FAKE_CUDA_ASYNC=1 FAKE_CUDA_DEVICES=4 build/examples/bmuf_train --gpus 0,0,3,3 --transport nccl | tail -1
