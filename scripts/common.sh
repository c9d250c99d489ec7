# Sourced by the scripts: installs what a fresh Debian machine with a Rust toolchain lacks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { printf '\n==> %s\n' "$*"; }

ensure_tools() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v cc >/dev/null 2>&1 || missing+=(gcc)
  command -v c++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v python3 >/dev/null 2>&1 || missing+=(python3)
  command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
  if ((${#missing[@]})); then
    step "installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install a Rust toolchain (rustup)" >&2; exit 1; }
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
