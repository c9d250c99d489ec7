#!/usr/bin/env bash
# GPU validation: every test (the CUDA ones included), the C examples and the GPU benchmarks,
# written into one report. The GPU machine has CUDA but no Rust toolchain, so this runs in two
# halves:
#
#   bash scripts/gpu-check.sh --bundle        # here: build everything into gpu-bundle/
#   bash scripts/gpu-check.sh --run [DIR [PART...]]   # there: run the bundle, report to
#                                             # $OUT/REPORT.md (else DIR/REPORT.md)
#   bash scripts/gpu-check.sh --run [DIR [PART...]] --nccl PATH   # the same on real NCCL
#                                             # between ranks sharing the GPU (NCCL >= 2.30)
#
# PARTs run in the order given (default: bench examples python tests ranks world repro; with
# --nccl: nccl) — to split the check over several device calls, each under the tool's 10-minute
# limit. --nccl PATH: PATH is a libnccl.so.2 of NCCL 2.30 or later, or a folder holding the pieces
# p0, p1, ... of ../shared/tools/nccl-pieces.sh (put back together there, checked against
# libnccl.so.2.sha256 when the folder has it); every part then runs with DPSYNC_NCCL_LIBRARY=it
# and NCCL_MULTI_RANK_GPU_ENABLE=1, so ranks sharing the one GPU cross over NCCL. Every binary runs under a
# timeout (GPU_CHECK_TIMEOUT, 240 s), cut to what is left of the whole run's budget
# (GPU_CHECK_BUDGET, 560 s); a step the budget no longer allows is reported as NOT RUN.
#
# Without arguments both halves run on this machine (a GPU machine with Rust).
# NCCL and NVRTC from pip wheels are found under /opt and /usr and pointed at with
# DPSYNC_NCCL_LIBRARY / DPSYNC_NVRTC_LIBRARY / LD_LIBRARY_PATH, as docs/API.md tells users.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-bundle

# The executables of cargo's JSON messages on stdin: test binaries ($1 = test) or benchmarks
# ($1 = bench).
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = "bench" if m["target"]["kind"] == ["bench"] else "test" if m["profile"]["test"] else None
    if kind == sys.argv[1]:
        print(m["executable"])' "$1"
}

# A subshell: its `set -e` must not leak into `run` (no-argument mode runs both).
bundle() (
  set -e
  source scripts/common.sh
  ensure_tools
  build_library
  step "test and bench binaries"
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/tests" "$BUNDLE/benches"
  cargo test --release --no-run --message-format=json 2>/dev/null | executables test |
    while read -r exe; do cp "$exe" "$BUNDLE/tests/"; done
  cargo bench --no-run --message-format=json 2>/dev/null | executables bench |
    while read -r exe; do cp "$exe" "$BUNDLE/benches/"; done
  build_examples
  cp target/release/libdpsync.so "$BUNDLE/"
  cp build/examples/{cuda_train,bmuf_train,train_dense,checkpoint_sync} "$BUNDLE/"
  # The benchmarks find these beside them (benches/common/mod.rs `bench_file`).
  cp -r benches/data "$BUNDLE/data"
  cp benches/gloo_allreduce.py "$BUNDLE/"
  # What was built: .git does not travel to the GPU machine.
  { git rev-parse HEAD 2>/dev/null || echo unknown; git status --porcelain 2>/dev/null | grep -q . && echo "(with uncommitted changes)"; } >"$BUNDLE/VERSION"
  cp -r tests/python "$BUNDLE/python"
  # Worlds (--features mpi): the GPU machine's own Open MPI runs them (libmpi.so.40).
  ensure_mpi
  mkdir -p "$BUNDLE/mpi"
  # Named without cargo's hash: the world part calls them by name (the benchmark of
  # reproducible sums as repro_bench: its test is mpi/repro).
  cargo test --release --features mpi --target-dir target/mpi --no-run \
    --message-format=json --test world_cuda --test world_mpi --test world_comm \
    --test world_agreement --test world_random --test world_random_cuda --test world_lost_cuda \
    --test repro --test shard \
    2>/dev/null | executables test |
    while read -r exe; do cp "$exe" "$BUNDLE/mpi/$(basename "${exe%-*}")"; done
  cargo bench --features mpi --target-dir target/mpi --bench world_allreduce --bench repro \
    --no-run --message-format=json 2>/dev/null | executables bench |
    while read -r exe; do
      name=$(basename "${exe%-*}")
      [ "$name" = repro ] && name=repro_bench
      cp "$exe" "$BUNDLE/mpi/$name"
    done
  # Only what the GPU run uses, without debug info: the device tool carries at most 64 MiB.
  rm -f "$BUNDLE"/tests/{checkpoint,concurrency,equivalence,header,host_threads,bmuf,overlap,sequences,sparse,logging,symbols,timeline,world,world_agreement,world_comm,world_cuda,world_mpi,world_random,world_random_cuda}-* "$BUNDLE"/benches/host_allreduce-* "$BUNDLE"/benches/repro-*
  strip "$BUNDLE"/tests/* "$BUNDLE"/benches/* "$BUNDLE"/mpi/* "$BUNDLE"/libdpsync.so "$BUNDLE"/cuda_train \
    "$BUNDLE"/bmuf_train "$BUNDLE"/train_dense "$BUNDLE"/checkpoint_sync
  du -sh "$BUNDLE"; ls -la "$BUNDLE" "$BUNDLE/tests" "$BUNDLE/benches"
)

# Library $1: the copy in python3's own `nvidia` packages first (the NCCL PyTorch uses), else
# the first under the usual roots, CUDA's own first. Not `find / -xdev`: /opt (PyTorch's venv and
# its pip NCCL) may be another mount than / on the device machine.
find_lib() {
  local found
  found=$(python3 - "$1" 2>/dev/null <<'PY'
import glob, importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else []):
    hits = sorted(glob.glob(os.path.join(root, "**", "lib", sys.argv[1]), recursive=True))
    if hits:
        print(hits[0])
        break
PY
)
  if [ -n "$found" ]; then echo "$found"; return; fi
  local roots=() r
  for r in /usr/local/cuda /usr/local /opt /usr /lib /lib64 /root; do [ -d "$r" ] && roots+=("$r"); done
  find -H "${roots[@]}" -name "$1" \( -type f -o -type l \) 2>/dev/null | sort | head -1
}

# Seconds one test binary, example or benchmark may run before it is killed: a hang (a stuck
# NCCL group, a wait that never ends) must not eat the device tool's 10-minute command limit.
STEP_TIMEOUT=${GPU_CHECK_TIMEOUT:-240}
# Seconds for the whole run: the device tool kills a command at 600 s, and a killed run reports
# nothing about the steps it never reached.
BUDGET=${GPU_CHECK_BUDGET:-560}

# The library `--nccl` names: a file, or a folder of nccl-pieces.sh's pieces p0, p1, ... put back
# together into FOLDER/libnccl.so.2 (checked against FOLDER/libnccl.so.2.sha256 when present).
# Prints its path; fails saying why.
nccl_library() {
  local path=$1
  if [ -d "$path" ]; then
    local pieces=("$path"/p[0-9])
    [ -f "${pieces[0]}" ] || { echo "--nccl $path: a folder without pieces p0, p1, ..." >&2; return 1; }
    cat "${pieces[@]}" >"$path/libnccl.so.2" || return 1
    if [ -f "$path/libnccl.so.2.sha256" ] &&
      [ "$(sha256sum "$path/libnccl.so.2" | cut -d' ' -f1)" != "$(cat "$path/libnccl.so.2.sha256")" ]; then
      echo "--nccl $path: ${#pieces[@]} pieces do not give libnccl.so.2.sha256 (a piece missing or cut?)" >&2
      return 1
    fi
    path=$path/libnccl.so.2
  fi
  [ -f "$path" ] || { echo "--nccl $path: no such file" >&2; return 1; }
  (cd "$(dirname "$path")" && echo "$PWD/$(basename "$path")")
}

run() {
  local dir=${1:-$BUNDLE}
  shift || true
  local parts=("$@")
  if [ -n "$NCCL" ]; then
    local lib
    lib=$(nccl_library "$NCCL") || return 2
    export DPSYNC_NCCL_LIBRARY=$lib NCCL_MULTI_RANK_GPU_ENABLE=1
    [ ${#parts[@]} -gt 0 ] || parts=(nccl)
  fi
  [ ${#parts[@]} -gt 0 ] || parts=(bench examples python tests ranks world repro)
  local deadline=$((SECONDS + BUDGET))
  # The report grows in $OUT when the device tool runs this: a command killed at its limit
  # still brings back every section written so far.
  local report="${OUT:-$dir}/REPORT.md"
  local nccl nvrtc
  nccl=$(find_lib libnccl.so.2)
  nvrtc=$(find_lib libnvrtc.so.13)
  # Only when found: an empty path would make dlopen return the program itself.
  [ -n "${DPSYNC_NCCL_LIBRARY:-}" ] || [ -z "$nccl" ] || export DPSYNC_NCCL_LIBRARY="$nccl"
  [ -n "${DPSYNC_NVRTC_LIBRARY:-}" ] || [ -z "$nvrtc" ] || export DPSYNC_NVRTC_LIBRARY="$nvrtc"
  [ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"
  dir=$(cd "$dir" && pwd)
  export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
  # A GPU test or benchmark that cannot make its CUDA context fails here instead of skipping.
  export DPSYNC_REQUIRE_GPU=1
  local failures=0 nccl_code
  nccl_code=$(python3 -c 'import ctypes, os; l = ctypes.CDLL(os.environ["DPSYNC_NCCL_LIBRARY"]); v = ctypes.c_int(); l.ncclGetVersion(ctypes.byref(v)); print(v.value)' 2>/dev/null || true)
  {
    echo "# dpsync GPU check, $(date -u +%Y-%m-%dT%H:%MZ), parts: ${parts[*]}"
    echo
    echo '```'
    echo "bundle built from: $(tr '\n' ' ' <"$dir/VERSION" 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    echo "NCCL library: ${DPSYNC_NCCL_LIBRARY:-none}"
    echo "NVRTC library: ${DPSYNC_NVRTC_LIBRARY:-none}"
    echo "NCCL version code: ${nccl_code:-unknown}"
    [ -z "$NCCL" ] || echo "--nccl $NCCL: NCCL_MULTI_RANK_GPU_ENABLE=1 (ranks share the GPU over NCCL)"
    ldd --version 2>&1 | head -1
    grep -h '^PRETTY_NAME' /etc/os-release 2>/dev/null
    echo '```'
  } >"$report"
  section() { printf '\n## %s\n\n```\n' "$1" >>"$report"; echo "== $1" >&2; }
  endsection() { printf '```\n' >>"$report"; }
  # Runs a command under the step timeout (cut to what is left of the budget, less 15 s for the
  # report), appending its output to the report; says how a non-zero exit ended. Returns the
  # command's status; 125 without running it when the budget is spent.
  timed() {
    local limit=$((deadline - SECONDS - 15))
    [ "$limit" -gt "$STEP_TIMEOUT" ] && limit=$STEP_TIMEOUT
    if [ "$limit" -lt 20 ]; then
      echo "NOT RUN (out of time: GPU_CHECK_BUDGET=${BUDGET} s): $*" >>"$report"
      return 125
    fi
    timeout -k 10 "$limit" "$@" >>"$report" 2>&1
    local rc=$?
    case $rc in
      0) ;;
      124|137) echo "TIMED OUT after ${limit} s (exit $rc)" >>"$report" ;;
      *) [ $rc -gt 128 ] && echo "KILLED by signal $((rc - 128))" >>"$report"; echo "exit $rc" >>"$report" ;;
    esac
    return $rc
  }
  # A test binary, all tests in one process; if it crashed or hung, the tests it never reported
  # run again one per process, so one fault does not hide the rest of the binary's results.
  test_binary() {
    local t=$1; shift
    local before; before=$(wc -l <"$report")
    timed "$t" --test-threads=1 --nocapture "$@"
    local rc=$?
    [ $rc = 0 ] && return 0
    [ $rc = 101 ] && return 1 # ordinary test failures: every test ran and reported
    [ $rc = 125 ] && return 1 # not run: out of time
    # A started test prints "test NAME ... " first; with --nocapture its result may come lines
    # later. Every started test is left out of the rerun; the last one started is the culprit.
    local started; started=$(tail -n +"$((before + 1))" "$report" | sed -n 's/^test \([^ ]*\) \.\.\. .*$/\1/p')
    [ -n "$started" ] && echo "CRASHED or HUNG in: $(tail -1 <<<"$started")" >>"$report"
    echo "-- rerunning the tests that never started, one process each" >>"$report"
    local name
    "$t" --list "$@" 2>/dev/null | sed -n 's/: test$//p' | while read -r name; do
      grep -qxF "$name" <<<"$started" && continue
      timed "$t" --exact "$name" --test-threads=1 --nocapture "$@" </dev/null
    done
    return 1
  }
  # The GPU tests, the library's unit tests and the host collectives (tests that read source
  # files by their build-time path are left to CI). The kernel emulation tests need a C++20
  # compiler and prove nothing more on a GPU: CI runs them.
  part_tests() {
    for t in "$dir"/tests/cuda-* "$dir"/tests/cuda_bmuf-* "$dir"/tests/cuda_sparse-* \
             "$dir"/tests/shard-* "$dir"/tests/dpsync-* "$dir"/tests/collectives-* \
             "$dir"/tests/bad_input-* "$dir"/tests/repro-*; do
      section "test binary $(basename "$t")"
      test_binary "$t" --skip emulate || { failures=$((failures + 1)); echo "FAILED" >>"$report"; }
      endsection
    done
  }
  # Two NCCL ranks on the one GPU: informative (needs NCCL >= 2.30), not counted as a failure.
  part_ranks() {
    section "two NCCL ranks on one GPU (DPSYNC_NCCL_RANK_PER_REPLICA=1 NCCL_MULTI_RANK_GPU_ENABLE=1)"
    if [ "${nccl_code:-0}" -lt 23000 ]; then
      echo "skipped: NCCL ${nccl_code:-not found} is older than 2.30, which refuses two ranks on one GPU" >>"$report"
    else
      for t in "$dir"/tests/cuda-* "$dir"/tests/cuda_bmuf-* "$dir"/tests/cuda_sparse-*; do
        DPSYNC_NCCL_RANK_PER_REPLICA=1 NCCL_MULTI_RANK_GPU_ENABLE=1 \
          timed "$t" two_nccl_ranks --test-threads=1 --nocapture || echo "FAILED (informative)" >>"$report"
      done
    fi
    endsection
  }
  # Real NCCL between ranks sharing the one GPU (--nccl: NCCL >= 2.30 with
  # NCCL_MULTI_RANK_GPU_ENABLE=1): the two_nccl_ranks tests of the three GPU test binaries, a
  # world's CUDA replicas crossing 2 and 3 ranks over NCCL (world_cuda cuda_rank_body, AUTO, which
  # then picks NCCL, and NCCL asked for), and the randomized cross-rank test's NCCL part
  # (world_random_cuda, 2 and 3 ranks). Failures count here.
  part_nccl() {
    local mpi=(mpirun --allow-run-as-root --oversubscribe) spec ranks transport t
    section "real NCCL between ranks: the library"
    if [ "${nccl_code:-0}" -lt 23000 ] || [ -z "${NCCL_MULTI_RANK_GPU_ENABLE:-}" ]; then
      echo "NCCL ${nccl_code:-not found} (${DPSYNC_NCCL_LIBRARY:-none}): needs NCCL >= 2.30 and" \
        "NCCL_MULTI_RANK_GPU_ENABLE=1 (gpu-check.sh --nccl PATH)" >>"$report"
      echo "FAILED" >>"$report"; failures=$((failures + 1)); endsection; return
    fi
    echo "NCCL ${nccl_code}: ${DPSYNC_NCCL_LIBRARY}" >>"$report"
    endsection
    for t in "$dir"/tests/cuda-* "$dir"/tests/cuda_bmuf-* "$dir"/tests/cuda_sparse-*; do
      section "two NCCL ranks on one GPU: $(basename "$t") two_nccl_ranks"
      DPSYNC_NCCL_RANK_PER_REPLICA=1 timed "$t" two_nccl_ranks --test-threads=1 --nocapture ||
        failures=$((failures + 1))
      endsection
    done
    if ! command -v mpirun >/dev/null; then
      section "worlds over NCCL"; echo "FAILED: no mpirun on this machine" >>"$report"
      failures=$((failures + 1)); endsection; return
    fi
    for spec in "2 auto" "3 auto" "2 nccl" "3 nccl"; do
      read -r ranks transport <<<"$spec"
      section "world_cuda cuda_rank_body, $ranks ranks on the one GPU, transport $transport (NCCL across the ranks)"
      DPSYNC_TEST_RANKS=$ranks DPSYNC_TEST_TRANSPORT=$transport timed "${mpi[@]}" -n "$ranks" \
        "$dir/mpi/world_cuda" cuda_rank_body --exact --nocapture --test-threads=1 ||
        failures=$((failures + 1))
      endsection
    done
    # A reproducible world's buckets started early over the clique (its route to the owners
    # queued on the streams): two replicas per rank, then one, every one on the one GPU.
    section "world_cuda repro_overlap_body over NCCL, 2 ranks of 2 replicas, then of 1"
    for route in nccl nccl-one; do
      DPSYNC_TEST_RANKS=2 DPSYNC_TEST_REPRO_ROUTE=$route timed "${mpi[@]}" -n 2 \
        -x DPSYNC_TEST_REPRO_ROUTE "$dir/mpi/world_cuda" repro_overlap::repro_overlap_body \
        --exact --nocapture --test-threads=1 || failures=$((failures + 1))
    done
    endsection
    section "test binary world_random_cuda, NCCL part (DPSYNC_RANDOM_TRANSPORTS=nccl)"
    DPSYNC_RANDOM_TRANSPORTS=nccl timed "$dir/mpi/world_random_cuda" --test-threads=1 --nocapture ||
      failures=$((failures + 1))
    endsection
  }
  part_examples() {
    for run in "cuda_train --gpus 0,0,0,0" "cuda_train --gpus 0,0 --transport peer_copy" \
      "cuda_train --gpus 0 --transport nccl" "bmuf_train --gpus 0,0,0,0" \
      "bmuf_train --gpus 0,0 --transport peer_copy --nesterov"; do
      section "$run"
      # shellcheck disable=SC2086
      timed "$dir"/$run && echo "exit 0" >>"$report" || failures=$((failures + 1))
      endsection
    done
  }
  part_python() {
    section "python smoke test"
    timed python3 "$dir/python/smoke_test.py" "$dir/libdpsync.so" || failures=$((failures + 1))
    endsection
  }
  # Each benchmark section in its own process, so one failure cannot hide the others; the GPU's
  # clocks and throttle reasons before and after (read only). The raw-NCCL baseline asks for two
  # ranks on the one GPU (NCCL >= 2.30); an older NCCL makes that target NOT MEASURED.
  part_bench() {
    section "GPU clocks before the benchmarks"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv >>"$report" 2>&1
    endsection
    for b in "$dir"/benches/cuda_allreduce-*; do
      for what in resnet sum bmuf; do
        section "benchmark $(basename "$b") $what"
        NCCL_MULTI_RANK_GPU_ENABLE=1 timed "$b" "$what" || failures=$((failures + 1))
        endsection
      done
    done
    section "GPU clocks after the benchmarks"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv >>"$report" 2>&1
    endsection
  }
  # Worlds over MPI on this machine's Open MPI: CUDA replicas across ranks (tests/world_cuda.rs
  # bodies; on one GPU every replica is on GPU 0, so NCCL worlds have one rank and AUTO stages
  # across several), the host world tests, the randomized cross-rank test on host and on CUDA
  # replicas (world_random_cuda: on one GPU its NCCL part says it is skipped unless
  # NCCL_MULTI_RANK_GPU_ENABLE=1), and the world benchmark (its overlap also with
  # --bind-to none: mpirun binds each of 2 ranks to one core, which leaves the engine's progress
  # thread off).
  part_world() {
    local m="mpirun --allow-run-as-root --oversubscribe" spec
    if ! command -v mpirun >/dev/null; then
      section "worlds"; echo "skipped: no mpirun on this machine" >>"$report"; endsection; return
    fi
    for spec in "2 peer_copy" "3 peer_copy" "1 nccl" "1 auto" "2 auto" "3 auto"; do
      set -- $spec
      section "world_cuda cuda_rank_body, $1 ranks, transport $2"
      DPSYNC_TEST_RANKS=$1 DPSYNC_TEST_TRANSPORT=$2 timed $m -n "$1" "$dir/mpi/world_cuda" \
        cuda_rank_body --exact --nocapture --test-threads=1 || failures=$((failures + 1))
      endsection
    done
    section "world_cuda nccl_overlap_body, 1 rank"
    DPSYNC_TEST_RANKS=1 timed $m -n 1 "$dir/mpi/world_cuda" nccl_overlap_body --exact \
      --nocapture --test-threads=1 || failures=$((failures + 1))
    endsection
    # Buckets started early on the staged route (page-locked stages): one replica per rank,
    # then 1, 2 and 1 (the middle rank's levels 1-2 sum).
    section "world_cuda staged_overlap_body, 2 ranks"
    DPSYNC_TEST_RANKS=2 timed $m -n 2 "$dir/mpi/world_cuda" staged_overlap::staged_overlap_body \
      --exact --nocapture --test-threads=1 || failures=$((failures + 1))
    endsection
    section "world_cuda staged_overlap_body, 3 ranks of 1, 2 and 1 replicas"
    DPSYNC_TEST_RANKS=3 DPSYNC_TEST_STAGED_MIXED=1 timed $m -n 3 -x DPSYNC_TEST_STAGED_MIXED \
      "$dir/mpi/world_cuda" staged_overlap::staged_overlap_body --exact --nocapture \
      --test-threads=1 || failures=$((failures + 1))
    endsection
    # A reproducible world's buckets started early on the staged route (every replica's raw
    # bucket staged, the engine's reproducible sum): two replicas per rank, then one. Over
    # NCCL: the --nccl part.
    section "world_cuda repro_overlap_body, staged, 2 ranks of 2 replicas, then of 1"
    for route in staged staged-one; do
      DPSYNC_TEST_RANKS=2 DPSYNC_TEST_REPRO_ROUTE=$route timed $m -n 2 -x DPSYNC_TEST_REPRO_ROUTE \
        "$dir/mpi/world_cuda" repro_overlap::repro_overlap_body --exact --nocapture \
        --test-threads=1 || failures=$((failures + 1))
    done
    endsection
    for t in world_mpi world_comm world_agreement world_random world_random_cuda; do
      section "test binary $t"
      timed "$dir/mpi/$t" --test-threads=1 || failures=$((failures + 1))
      endsection
    done
    # An elastic world on CUDA replicas that loses a rank (3 ranks on the one GPU; NCCL's clique
    # shrunk over the survivors), under Open MPI 5 with ULFM: the venv scripts/test.sh makes in
    # target/ulfm, carried to this machine and named by DPSYNC_ULFM (docs/GPU-VALIDATION.md).
    section "test binary world_lost_cuda (elastic worlds, ULFM)"
    if [ -x "${DPSYNC_ULFM:-/nonexistent}/bin/mpirun" ]; then
      NCCL_MULTI_RANK_GPU_ENABLE=1 timed "$dir/mpi/world_lost_cuda" --test-threads=1 --nocapture ||
        failures=$((failures + 1))
    else
      echo "skipped: DPSYNC_ULFM names no Open MPI 5 with ULFM (carry target/ulfm)" >>"$report"
    fi
    endsection
    # Without shared memory between the ranks: the ring's halves for shards (scripts/test.sh
    # runs it so too).
    section "test binary world_random, DPSYNC_MPI_SHM=0"
    DPSYNC_MPI_SHM=0 timed "$dir/mpi/world_random" --test-threads=1 || failures=$((failures + 1))
    endsection
    section "world benchmark"
    # PyTorch's Gloo for comparison: the Python that has torch here.
    (cd "$dir" && DPSYNC_BENCH_PYTHON=$(command -v python3) timed ./mpi/world_allreduce --bench) ||
      failures=$((failures + 1))
    echo "-- overlap, mpirun --bind-to none" >>"$report"
    (cd "$dir" && timed $m --bind-to none -n 2 ./mpi/world_allreduce --part overlap) || failures=$((failures + 1))
    # The ranks share this host, so the above went through shared memory: MPI's ring alongside.
    echo "-- large, shards and overlap over MPI's ring (DPSYNC_MPI_SHM=0)" >>"$report"
    (cd "$dir" && DPSYNC_MPI_SHM=0 timed $m -x DPSYNC_MPI_SHM -n 2 ./mpi/world_allreduce --part large &&
      DPSYNC_MPI_SHM=0 timed $m -x DPSYNC_MPI_SHM -n 2 ./mpi/world_allreduce --part shards &&
      DPSYNC_MPI_SHM=0 timed $m -x DPSYNC_MPI_SHM --bind-to none -n 2 ./mpi/world_allreduce \
        --part overlap) || failures=$((failures + 1))
    endsection
  }
  # Reproducible sums and shards: the world test of reproducible sums (its launcher starts
  # 1-8 ranks; ranks of up to 3 run CUDA replicas too), and the benchmarks of both (host, GPU,
  # and for reproducible sums 2 ranks).
  part_repro() {
    section "test binary repro (worlds)"
    timed "$dir/mpi/repro" --test-threads=1 || failures=$((failures + 1))
    endsection
    # Shards across ranks (tests/shard.rs `world`: its launchers start 1-4 ranks of host
    # replicas, with and without shared memory).
    section "test binary shard (worlds)"
    timed "$dir/mpi/shard" world:: --test-threads=1 || failures=$((failures + 1))
    endsection
    # They find benches/data beside them in the bundle (data/).
    for b in "$dir"/mpi/repro_bench "$dir"/benches/shard-*; do
      section "benchmark $(basename "$b")"
      timed "$b" --bench || failures=$((failures + 1))
      endsection
    done
  }
  local part
  for part in "${parts[@]}"; do
    case $part in
      tests|ranks|examples|python|bench|world|repro|nccl) "part_$part" ;;
      *) echo "unknown part '$part' (tests ranks examples python bench world repro nccl)" >>"$report"; failures=$((failures + 1)) ;;
    esac
  done
  section "targets (the benchmarks' TARGET lines)"
  grep -h '^TARGET ' "$report" >>"$report.targets" 2>/dev/null || true
  if [ -s "$report.targets" ]; then cat "$report.targets" >>"$report"; else echo "none in this run" >>"$report"; fi
  rm -f "$report.targets"
  endsection
  printf '\n%d failing sections\n' "$failures" >>"$report"
  [ "$report" = "$dir/REPORT.md" ] || cp "$report" "$dir/REPORT.md"
  cat "$report"
  [ "$failures" = 0 ]
}

usage() {
  echo "usage: $0 [--bundle | --run [DIR [PART...]]] [--nccl PATH]" \
    "(PART: tests ranks examples python bench world repro nccl)" >&2
  exit 2
}
# --nccl PATH, wherever it stands among the arguments.
NCCL="" args=()
while [ $# -gt 0 ]; do
  case $1 in
    --nccl)
      if [ $# -lt 2 ] || [ -z "$2" ]; then usage; fi
      NCCL=$2
      shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
case "${1:-}" in
  --bundle) [ -z "$NCCL" ] || usage; bundle ;;
  --run) shift; run "${1:-$BUNDLE}" "${@:2}" ;;
  "") bundle && run "$BUNDLE" ;;
  *) usage ;;
esac
