#!/usr/bin/env bash
# Every test, on a fresh machine (Debian, Rust toolchain, root, no GPU). CI runs exactly this.
#   bash scripts/test.sh [--full]
# --full (or DPSYNC_TEST_FULL=1) adds the long soaks that CI leaves out, each route, transport
# and stream mode being run without it too: every multi-GPU test under every fake peer pattern
# (scripts/fake-cuda.sh --full), and tests/world_random_cuda.rs's whole default seed set in
# both stream modes (CI splits it: seeds 0-4 synchronous, 5-9 asynchronous).
source "$(dirname "$0")/common.sh"
full=""
if [ "${1:-}" = --full ] || [ "${DPSYNC_TEST_FULL:-}" = 1 ]; then full=--full; fi
ensure_tools

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --release --all-targets -- -D warnings

build_library

cuda_tools
step "cargo test (unit, FFI integration, header freshness, offline CUDA kernel compile)"
cargo test --release

step "Python ctypes smoke test"
python3 tests/python/smoke_test.py target/release/libdpsync.so

step "README.md's quickstart compiled and run exactly as printed (scripts/quickstart-check.sh)"
bash scripts/quickstart-check.sh

step "Python package: pip install ./python into two venvs, pytest, examples (scripts/python-test.sh)"
bash scripts/python-test.sh

step "contract check: include/dpsync.h against ../shared/api/dpsync.h"
python3 tests/contract/check_contract.py

step "benchmark smoke runs (figures: cargo bench --bench host_allreduce / bmuf / sparse_gather)"
cargo bench --bench host_allreduce -- --quick
cargo bench --bench bmuf -- --quick
cargo bench --bench sparse_gather -- --quick
step "GPU benchmark smoke run (prints 'skipped: no CUDA device' without a GPU)"
cargo bench --bench cuda_allreduce -- --quick

build_examples
step "ctest: C examples"
(cd build/examples && ctest --output-on-failure)

step "timeline: the demo's steps traced (DPSYNC_TIMELINE) and rendered to a PNG (scripts/timeline-png.py)"
python3 -c "import matplotlib" 2>/dev/null || python3 -m pip install -q matplotlib
trace_dir=$(mktemp -d)
DPSYNC_TIMELINE="$trace_dir/trace.json" build/examples/train_dense --steps 20 | tail -1
python3 scripts/timeline-png.py "$trace_dir/trace.json" "$trace_dir/trace.png" --last-ms 0.5
test -s "$trace_dir/trace.png"
rm -rf "$trace_dir"

step "install into a temporary prefix; a C program built against it three ways (scripts/check-install.sh)"
bash scripts/check-install.sh

step "GPU tests and cuda_train on the fake CUDA driver (CPU emulation; scripts/fake-cuda.sh)"
bash scripts/fake-cuda.sh ${full:+--full}

step "worlds over MPI (--features mpi, own target dir): clippy, tests/world_mpi.rs (mpirun -n 2, 3, 4), world_agreement.rs (bad input on one rank, shards), world_comm.rs (a split communicator, shared memory and TCP), world_leave.rs (ranks that leave, elastic creation), repro.rs and shard.rs (worlds of 1-8 ranks)"
ensure_mpi
# A separate target directory: target/release keeps the default library, which links no MPI.
cargo clippy --release --all-targets --features mpi --target-dir target/mpi -- -D warnings
cargo test --release --features mpi --target-dir target/mpi --lib --test world --test world_mpi --test world_comm --test world_agreement --test world_leave --test repro --test shard
step "elastic worlds that lose a rank, under Open MPI 5 with ULFM (mpirun --with-ft ulfm; the same test binaries): tests/world_lost.rs (3 ranks, two killed in turn; one killed mid-broadcast/average/bmuf_step, every survivor all new or all kept; one killed in a step with sparse gradients, every survivor's sparse_get as before; 2 ranks, a dpsync_grad_ready learning of the loss; each with and without DPSYNC_MPI_SHM=0), tests/world_lost_cuda.rs (CUDA replicas on the fake driver, asynchronous streams, staged through host memory then over an NCCL clique shrunk over the survivors (ncclCommShrink): one of 3 ranks killed mid-call; again with the fake NCCL quiet about the dead rank, which dies inside a collective: the survivors' device waits watch its process; again with the dead rank dying just after its part of a collective, before the survivors' vote; a device fault on one of 2 ranks after the agreement: the world fails alike on both), tests/world_leave.rs's elastic creation"
ensure_ulfm
cargo test --release --features mpi --target-dir target/mpi --test world_lost
DPSYNC_FAKE_CUDA=1 DPSYNC_REQUIRE_GPU=1 FAKE_CUDA_DEVICES=2 FAKE_CUDA_ASYNC=1 \
  LD_LIBRARY_PATH="$PWD/target/fakecuda:${LD_LIBRARY_PATH:-}" \
  cargo test --release --features mpi --target-dir target/mpi --test world_lost_cuda
if [ -n "${DPSYNC_ULFM:-}" ]; then
  exe=$(ls -t target/mpi/release/deps/world_leave-* | grep -v '\.d$' | head -1)
  DPSYNC_TEST_RANKS=2 LD_LIBRARY_PATH="$DPSYNC_ULFM/lib" timeout 300 "$DPSYNC_ULFM/bin/mpirun" --allow-run-as-root \
    --oversubscribe --with-ft ulfm -n 2 "$exe" leave_body --exact --test-threads=1
fi
step "randomized cross-rank test: tests/world_random.rs (mpirun -n 2 and -n 3, default seeds, and -n 2 with two replicas on each rank; under Open MPI 5 with ULFM, also its kill variant: 3 seeds of an elastic world on 3 ranks where one rank SIGKILLs itself at a random call; more: scripts/world-random.sh, --kills for the kill variant)"
cargo test --release --features mpi --target-dir target/mpi --test world_random
step "the same without shared memory between the ranks (DPSYNC_MPI_SHM=0: every piece over MPI messages, the ring's halves for reduce-scatter and allgather)"
DPSYNC_MPI_SHM=0 cargo test --release --features mpi --target-dir target/mpi --test world_random
step "CUDA replicas across ranks on the fake CUDA driver and NCCL (two fake GPUs per rank; tests/world_cuda.rs: NCCL across the ranks and the staged path; tests/world_random_cuda.rs: the randomized cross-rank test on CUDA replicas, seeds 0-9 x 150 calls per layout and transport, 0-4 synchronous and 5-9 asynchronous (--full: all ten in both), and with asynchronous streams under Open MPI 5 its kill variant, seed 0 per transport (--full: seeds 0 and 1); tests/world_leave.rs: a rank leaves, the others' clique is made again): synchronous, then asynchronous streams"
for async in "" 1; do
  seeds="" kill_seeds=""  # the test's defaults: 10 and 2
  if [ -z "$full" ]; then seeds=$([ -z "$async" ] && echo 0..4 || echo 5..9) kill_seeds=1; fi
  DPSYNC_FAKE_CUDA=1 DPSYNC_REQUIRE_GPU=1 FAKE_CUDA_DEVICES=2 FAKE_CUDA_ASYNC=$async \
    LD_LIBRARY_PATH="$PWD/target/fakecuda:${LD_LIBRARY_PATH:-}" DPSYNC_RANDOM_SEEDS=$seeds \
    DPSYNC_RANDOM_KILL_SEEDS=$kill_seeds \
    cargo test --release --features mpi --target-dir target/mpi --test world_cuda --test world_random_cuda --test repro
  DPSYNC_FAKE_CUDA=1 DPSYNC_REQUIRE_GPU=1 FAKE_CUDA_DEVICES=2 FAKE_CUDA_ASYNC=$async \
    LD_LIBRARY_PATH="$PWD/target/fakecuda:${LD_LIBRARY_PATH:-}" \
    cargo test --release --features mpi --target-dir target/mpi --test world_leave cuda_ranks_leave
done
step "world benchmark smoke run (figures: cargo bench --features mpi --bench world_allreduce)"
cargo bench --features mpi --target-dir target/mpi --bench world_allreduce -- --quick

step "examples_c/world_train on the MPI-enabled library: one rank, mpirun -n 2 (3,1) and -n 3 (2,1,1); --reproducible: 4, 2,2, 1,1,1,1 and 2,1,1 byte-identical, plain runs not; 4 ranks with one killed in step 20 (Open MPI 5 with ULFM) end byte-identical to a run where it left"
cargo build --release --features mpi --target-dir target/mpi
cmake -S examples_c -B build/world -DCMAKE_BUILD_TYPE=Release -DDPSYNC_WORLD_TESTS=ON \
  -DDPSYNC_LIB_DIR="$PWD/target/mpi/release" -DDPSYNC_ULFM_PREFIX="${DPSYNC_ULFM:-}" >/dev/null
cmake --build build/world -j "$(nproc)" --target train_dense world_train uneven_inputs
(cd build/world && ctest --output-on-failure -R "^(train_dense_4|world_train_.*|uneven_inputs_.*)$")

step "two simulated hosts: MPI across two network namespaces joined by a veth pair (scripts/two-hosts.sh)"
bash scripts/two-hosts.sh --self-test
# world_train with one rank on each simulated host, against train_dense's weights (build/world).
# Ranks on two hosts share no memory: describe says so (unless namespaces cannot be made here).
bash scripts/two-hosts.sh -- "$PWD/build/world/world_train" --replicas-per-rank 3,1 --steps 60 \
  --batch 48 --expect "$PWD/build/world/train_dense_ref.bin" --tol 1e-4 --describe |
  tee target/two-hosts.log
grep -q "two simulated hosts: skipped" target/two-hosts.log ||
  grep -q '"shared_memory":"off: the ranks run on several hosts"' target/two-hosts.log
