#!/usr/bin/env bash
# The Python package (python/) on a fresh Debian machine as root: installs it with pip into two
# virtual environments, runs its pytest suite, the examples and the call benchmark's smoke run.
#   - target/python/venv: the machine's python3 (pyenv's CPython here) with numpy, pytest,
#     ml_dtypes and mypy from PyPI; torch is not installed there (PyPI's torch wheel pulls about 2 GB of
#     CUDA libraries), so its torch tests print "skipped".
#   - target/python/venv-debian: Debian's /usr/bin/python3 with --system-site-packages, for
#     Debian's python3-torch (1.13), python3-numpy, python3-pytest and python3-mpi4py; the MPI
#     test runs there against the MPI build in target/mpi.
# Idempotent: the environments are kept and the package is reinstalled each run.
source "$(dirname "$0")/common.sh"

debs=()
for pkg in python3-venv python3-torch python3-numpy python3-pytest python3-mpi4py; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || debs+=("$pkg")
done
apt_install "${debs[@]}"
ensure_mpi
unset DPSYNC_LIBRARY  # the tests load the library the package carries

step "cargo build --release --features mpi --target-dir target/mpi (the library for the world test)"
cargo build --release --features mpi --target-dir target/mpi

# venv DIR PYTHON [venv options]: creates the environment unless it is there already.
venv() {
  local dir=$1 python=$2
  shift 2
  if ! "$dir/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$dir"
    "$python" -m venv "$@" "$dir"
  fi
}

# run_suite DIR: the package from ./python, its tests, the examples.
run_suite() {
  local py=$1/bin/python
  step "$($py --version): pip install ./python (cargo build --release inside)"
  # The library scripts/test.sh built already (the default would compile again in ~/.cache).
  CARGO_TARGET_DIR="$PWD/target" $py -m pip install -q --force-reinstall --no-deps ./python
  $py -m dpsync | sed -n '1,2p'  # sed reads everything: no broken pipe
  step "$($py --version): pytest python/tests"
  $py -m pytest -q python/tests
  step "$($py --version): examples/python/train_numpy.py, train_torch.py"
  $py examples/python/train_numpy.py
  $py examples/python/train_torch.py
}

venv target/python/venv python3
step "PyPI packages for target/python/venv: numpy, pytest, ml_dtypes, mypy"
target/python/venv/bin/python -m pip install -q numpy pytest ml_dtypes mypy
run_suite target/python/venv
step "mypy python/dpsync (the package's type hints)"
(cd python && ../target/python/venv/bin/python -m mypy --ignore-missing-imports dpsync)
step "call benchmark smoke run (figures: python3 python/benchmarks/bench_call.py)"
target/python/venv/bin/python python/benchmarks/bench_call.py --calls 2000 --repeats 1

venv target/python/venv-debian /usr/bin/python3 --system-site-packages
run_suite target/python/venv-debian
target/python/venv-debian/bin/python examples/python/train_torch.py --no-overlap
