#!/usr/bin/env bash
# GPU validation: every test (the CUDA ones included), the C examples and the GPU benchmarks,
# written into one report. The GPU machine has CUDA but no Rust toolchain, so this runs in two
# halves:
#
#   bash scripts/gpu-check.sh --bundle        # here: build everything into gpu-bundle/
#   bash scripts/gpu-check.sh --run [DIR [PART...]]   # there: run the bundle, report to
#                                             # $OUT/REPORT.md (else DIR/REPORT.md)
#
# PARTs (default all): tests ranks examples python bench — to split the check over several
# device calls, each under the tool's 10-minute limit. Every binary runs under a timeout
# (GPU_CHECK_TIMEOUT, 240 s).
#
# Without arguments both halves run on this machine (a GPU machine with Rust).
# NCCL and NVRTC from pip wheels are found under /opt and /usr and pointed at with
# DPSYNC_NCCL_LIBRARY / DPSYNC_NVRTC_LIBRARY / LD_LIBRARY_PATH, as the README tells users.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=gpu-bundle

bundle() {
  set -e
  source scripts/common.sh
  ensure_tools
  build_library
  step "test and bench binaries"
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/tests" "$BUNDLE/benches"
  cargo test --release --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" "$BUNDLE/tests/"; done
  cargo bench --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" "$BUNDLE/benches/"; done
  build_examples
  cp target/release/libdpsync.so "$BUNDLE/"
  cp build/examples/{cuda_train,bmuf_train,train_dense,checkpoint_sync} "$BUNDLE/"
  cp -r benches/data "$BUNDLE/data"
  cp -r tests/python "$BUNDLE/python"
  # Only what the GPU run uses, without debug info: the device tool carries at most 64 MiB.
  rm -f "$BUNDLE"/tests/{checkpoint,concurrency,equivalence,header,host_threads,bmuf,overlap,sequences,sparse}-* "$BUNDLE"/benches/host_allreduce-*
  strip "$BUNDLE"/tests/* "$BUNDLE"/benches/* "$BUNDLE"/libdpsync.so "$BUNDLE"/cuda_train \
    "$BUNDLE"/bmuf_train "$BUNDLE"/train_dense "$BUNDLE"/checkpoint_sync
  du -sh "$BUNDLE"; ls -la "$BUNDLE" "$BUNDLE/tests" "$BUNDLE/benches"
}

# The first copy of library $1 under the usual roots, CUDA's own first. Not `find / -xdev`:
# /opt (PyTorch's venv and its pip NCCL) may be another mount than / on the device machine.
find_lib() {
  local roots=() r
  for r in /usr/local/cuda /usr/local /opt /usr /lib /lib64 /root; do [ -d "$r" ] && roots+=("$r"); done
  find -H "${roots[@]}" \( -name "$1" -o -name "$1.*" \) \( -type f -o -type l \) 2>/dev/null | head -1
}

# Seconds one test binary, example or benchmark may run before it is killed: a hang (a stuck
# NCCL group, a wait that never ends) must not eat the device tool's 10-minute command limit.
STEP_TIMEOUT=${GPU_CHECK_TIMEOUT:-240}

run() {
  local dir=${1:-$BUNDLE}
  shift || true
  local parts=" ${*:-tests ranks examples python bench} "
  # The report grows in $OUT when the device tool runs this: a command killed at its limit
  # still brings back every section written so far.
  local report="${OUT:-$dir}/REPORT.md"
  local nccl nvrtc
  nccl=$(find_lib libnccl.so.2)
  nvrtc=$(find_lib libnvrtc.so.13)
  [ -n "${DPSYNC_NCCL_LIBRARY:-}" ] || export DPSYNC_NCCL_LIBRARY="$nccl"
  [ -n "${DPSYNC_NVRTC_LIBRARY:-}" ] || export DPSYNC_NVRTC_LIBRARY="$nvrtc"
  [ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
  # A GPU test or benchmark that cannot make its CUDA context fails here instead of skipping.
  export DPSYNC_REQUIRE_GPU=1
  local failures=0
  {
    echo "# dpsync GPU check, $(date -u +%Y-%m-%dT%H:%MZ), parts:$parts"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    echo "NCCL library: ${DPSYNC_NCCL_LIBRARY:-none}"
    echo "NVRTC library: ${DPSYNC_NVRTC_LIBRARY:-none}"
    python3 -c 'import ctypes, os; l = ctypes.CDLL(os.environ["DPSYNC_NCCL_LIBRARY"]); v = ctypes.c_int(); l.ncclGetVersion(ctypes.byref(v)); print("NCCL version code:", v.value)' 2>&1 || true
    ldd --version 2>&1 | head -1
    grep -h '^PRETTY_NAME' /etc/os-release 2>/dev/null
    echo '```'
  } >"$report"
  section() { printf '\n## %s\n\n```\n' "$1" >>"$report"; echo "== $1" >&2; }
  endsection() { printf '```\n' >>"$report"; }
  # Runs a command under the step timeout, appending its output to the report; says how a
  # non-zero exit ended. Returns the command's status.
  timed() {
    timeout -k 10 "$STEP_TIMEOUT" "$@" >>"$report" 2>&1
    local rc=$?
    case $rc in
      0) ;;
      124|137) echo "TIMED OUT after ${STEP_TIMEOUT} s (exit $rc)" >>"$report" ;;
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
    echo "-- rerunning the tests that did not report, one process each" >>"$report"
    local done_tests; done_tests=$(tail -n +"$((before + 1))" "$report" | sed -n 's/^test \(.*\) \.\.\. \(ok\|FAILED\|ignored\)$/\1/p')
    local name
    "$t" --list "$@" 2>/dev/null | sed -n 's/: test$//p' | while read -r name; do
      grep -qxF "$name" <<<"$done_tests" && continue
      timed "$t" --exact "$name" --test-threads=1 --nocapture "$@"
    done
    return 1
  }
  # The GPU tests, the library's unit tests and the host collectives (tests that read source
  # files by their build-time path are left to CI). The kernel emulation tests need a C++20
  # compiler and prove nothing more on a GPU: CI runs them.
  if [[ $parts == *" tests "* ]]; then
    for t in "$dir"/tests/cuda-* "$dir"/tests/cuda_bmuf-* "$dir"/tests/cuda_sparse-* \
             "$dir"/tests/dpsync-* "$dir"/tests/collectives-* "$dir"/tests/bad_input-*; do
      section "test binary $(basename "$t")"
      test_binary "$t" --skip emulate || { failures=$((failures + 1)); echo "FAILED" >>"$report"; }
      endsection
    done
  fi
  # Two NCCL ranks on the one GPU: informative (needs NCCL >= 2.30), not counted as a failure.
  if [[ $parts == *" ranks "* ]]; then
    section "two NCCL ranks on one GPU (DPSYNC_NCCL_RANK_PER_REPLICA=1 NCCL_MULTI_RANK_GPU_ENABLE=1)"
    for t in "$dir"/tests/cuda-* "$dir"/tests/cuda_bmuf-* "$dir"/tests/cuda_sparse-*; do
      DPSYNC_NCCL_RANK_PER_REPLICA=1 NCCL_MULTI_RANK_GPU_ENABLE=1 \
        timed "$t" two_nccl_ranks --test-threads=1 --nocapture || echo "FAILED (informative)" >>"$report"
    done
    endsection
  fi
  if [[ $parts == *" examples "* ]]; then
    for run in "cuda_train --gpus 0,0,0,0" "cuda_train --gpus 0,0 --transport peer_copy" \
      "cuda_train --gpus 0 --transport nccl" "bmuf_train --gpus 0,0,0,0" \
      "bmuf_train --gpus 0,0 --transport peer_copy --nesterov"; do
      section "$run"
      # shellcheck disable=SC2086
      timed "$dir"/$run && echo "exit 0" >>"$report" || failures=$((failures + 1))
      endsection
    done
  fi
  if [[ $parts == *" python "* ]]; then
    section "python smoke test"
    timed python3 "$dir/python/smoke_test.py" "$dir/libdpsync.so" || failures=$((failures + 1))
    endsection
  fi
  if [[ $parts == *" bench "* ]]; then
    for b in "$dir"/benches/cuda_allreduce-*; do
      section "benchmark $(basename "$b")"
      timed "$b" || failures=$((failures + 1))
      endsection
      section "benchmark $(basename "$b"), raw NCCL baseline with two ranks on one GPU"
      NCCL_MULTI_RANK_GPU_ENABLE=1 timed "$b" || echo "FAILED (informative)" >>"$report"
      endsection
    done
  fi
  printf '\n%d failing sections\n' "$failures" >>"$report"
  [ "$report" = "$dir/REPORT.md" ] || cp "$report" "$dir/REPORT.md"
  cat "$report"
  [ "$failures" = 0 ]
}

case "${1:-}" in
  --bundle) bundle ;;
  --run) shift; run "${1:-$BUNDLE}" "${@:2}" ;;
  "") bundle && run "$BUNDLE" ;;
  *) echo "usage: $0 [--bundle | --run [DIR [PART...]]]  (PART: tests ranks examples python bench)" >&2; exit 2 ;;
esac
