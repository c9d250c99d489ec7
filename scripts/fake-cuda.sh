#!/usr/bin/env bash
# The GPU tests on a CPU: builds tests/fakecuda/fake_cuda.cpp (a libcuda.so.1 stand-in that runs
# dpsync's kernels and the tests' own on CPU threads, synchronously) into target/fakecuda, and
# runs tests/cuda*.rs against it. This exercises the whole CUDA backend's host side — contexts,
# streams, events, memory, pointer attributes, tables, launches — without a GPU; it proves
# nothing about asynchrony, NCCL or the hardware (docs/GPU-VALIDATION.md).
#   bash scripts/fake-cuda.sh [extra cargo test arguments]
# scripts/test.sh runs it; it also runs examples_c/cuda_train against the fake driver.
source "$(dirname "$0")/common.sh"

build_fake_cuda() {
  local out=target/fakecuda
  mkdir -p "$out"
  local items
  items=$(grep -oP 'pub\(crate\) const ITEMS: u32 = \K[0-9]+' src/backend/cuda/kernels.rs)
  {
    cat src/backend/cuda/kernels/emulate.hpp
    cat src/backend/cuda/kernels/{prelude,dense,bmuf,sparse}.cu
    # The tests' own kernels (tests/common/gpu.rs SPIN), with a clock that runs fast.
    echo 'inline long long clock64() { static thread_local long long t = 0; return t += 100000000; }'
    python3 - <<'PY'
import re
src = open("tests/common/gpu.rs").read()
print(re.search(r'pub const SPIN: &str = r#"(.*?)"#;', src, re.S).group(1))
for name in re.findall(r'__global__ void (\w+)\(', src):
    print(f"DPSYNC_KERNEL({name})")
PY
    cat tests/fakecuda/fake_cuda.cpp
  } >"$out/fake_cuda_all.cpp"
  c++ -std=c++20 -O2 -ffp-contract=off -fPIC -shared -pthread -DITEMS_PER_THREAD="$items" \
    -o "$out/libcuda.so.1" "$out/fake_cuda_all.cpp"
  ln -sf libcuda.so.1 "$out/libcuda.so"
}

ensure_tools
cuda_tools
step "fake CUDA driver: target/fakecuda/libcuda.so.1"
build_fake_cuda
step "GPU tests on the fake CUDA driver (DPSYNC_FAKE_CUDA=1)"
# Not DPSYNC_REQUIRE_GPU: NCCL is not here, so the NCCL cases skip (the others must run).
export DPSYNC_FAKE_CUDA=1 LD_LIBRARY_PATH="$PWD/target/fakecuda:${LD_LIBRARY_PATH:-}"
cargo test --release --test cuda --test cuda_bmuf --test cuda_sparse "$@" -- --test-threads=1
step "examples_c/cuda_train on the fake CUDA driver"
build_library
build_examples
for args in "--gpus 0,0,0,0" "--gpus 0,0 --transport peer_copy"; do
  # shellcheck disable=SC2086
  build/examples/cuda_train $args
done
