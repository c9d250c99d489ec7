#!/usr/bin/env bash
# Checks scripts/install.sh as a packager and a user would meet it (scripts/test.sh runs it):
# - an install into a temporary prefix: the files, the symbolic links, the soname, the exported
#   symbols, the pkg-config and CMake version answers;
# - tests/install/use_dpsync.c built against it three ways and run: CMake's find_package
#   (dpsync::dpsync, and dpsync::dpsync_static), pkg-config, and pkg-config --static against
#   libdpsync.a alone;
# - staged installs (--destdir, and the DESTDIR variable) with Debian's multiarch --libdir: files
#   only under the stage, the prefix in them, the CMake package still found once moved;
# - the installed dpsync-info: its sections, --json, --check, bad arguments (exit 2), and the GPU
#   sections against the fake CUDA driver and NCCL (tests/fakecuda);
# - the MPI-enabled install (--features mpi): MPI in dpsync.pc and dpsyncConfig.cmake, a static
#   program linked through them, dpsync-info naming the MPI library.
#   bash scripts/check-install.sh
source "$(dirname "$0")/common.sh"
ensure_tools
command -v pkg-config >/dev/null 2>&1 || apt_install pkg-config
# NVRTC from pip (as scripts/test.sh has it): dpsync-info must find it through
# DPSYNC_NVRTC_LIBRARY, and --check on the fake GPUs builds the kernels with it.
cuda_tools

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tmp=$(cd "$tmp" && pwd -P)
fail() {
  echo "check-install: FAILED: $*" >&2
  exit 1
}
ok() { echo "ok: $*"; }
# Runs a program with no LD_LIBRARY_PATH: it must find its libraries itself.
bare() { env -u LD_LIBRARY_PATH "$@"; }
# Runs a test program (tests/install/use_dpsync.c) and fails unless it says its sums were right.
runs_ok() { # WHAT COMMAND...
  local what=$1 out
  shift
  out=$("$@" 2>&1) || fail "$what exited $?: $out"
  [[ $out == *"allreduce of 2 host replicas: ok"* ]] || fail "$what: $out"
}
# Whether the ELF file's DT_NEEDED entries include one matching the pattern (grep -E).
needs() { grep -qE "$2" <<<"$(readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"; }

# The rule docs/API.md states, written out again: soversion MAJOR, or 0.MINOR while MAJOR is 0.
version=$(cargo pkgid)
version=${version##*[#@]}
IFS=. read -r major minor patch <<<"${version%%[-+]*}"
if ((major > 0)); then
  soversion=$major
elif ((minor > 0)); then
  soversion=0.$minor
else
  soversion=0.0.$patch
fi
real=libdpsync.so.$major.$minor.$patch soname=libdpsync.so.$soversion

step "install.sh --prefix $tmp/prefix"
prefix=$tmp/prefix
bash scripts/install.sh --prefix "$prefix" >"$tmp/install.log" 2>&1 || {
  cat "$tmp/install.log"
  fail "install.sh"
}
tail -n 11 "$tmp/install.log"
lib=$prefix/lib
[ -f "$lib/$real" ] && [ ! -L "$lib/$real" ] || fail "$lib/$real is not a file"
[ "$(readlink "$lib/$soname")" = "$real" ] || fail "$soname does not point to $real"
[ "$(readlink "$lib/libdpsync.so")" = "$soname" ] || fail "libdpsync.so does not point to $soname"
ok "lib/$real, $soname -> $real, libdpsync.so -> $soname"
so=$(readelf -d "$lib/$real" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$so" = "$soname" ] || fail "DT_SONAME of $real is '$so', expected $soname"
ok "DT_SONAME $so"
# The development build keeps no soname: examples and tests link target/release/libdpsync.so.
dev=${CARGO_TARGET_DIR:-target}/release/libdpsync.so
if [ -f "$dev" ]; then
  [ -z "$(readelf -d "$dev" | grep SONAME)" ] || fail "$dev has a soname"
  ok "$dev has no soname"
fi
others=$(nm -D --defined-only "$lib/$real" | awk '$3 !~ /^dpsync_/')
[ -z "$others" ] || fail "symbols other than dpsync_* exported: $others"
ok "only dpsync_* symbols exported ($(nm -D --defined-only "$lib/$real" | wc -l))"
for file in lib/libdpsync.a include/dpsync.h bin/dpsync-info lib/pkgconfig/dpsync.pc \
  lib/cmake/dpsync/dpsyncConfig.cmake lib/cmake/dpsync/dpsyncConfigVersion.cmake; do
  [ -f "$prefix/$file" ] || fail "$file is missing"
done
cmp -s include/dpsync.h "$prefix/include/dpsync.h" || fail "the installed header differs"
ok "libdpsync.a, dpsync.h, dpsync-info, dpsync.pc, the CMake package"

export PKG_CONFIG_PATH=$lib/pkgconfig
[ "$(pkg-config --modversion dpsync)" = "$version" ] || fail "pkg-config --modversion dpsync"
[ "$(pkg-config --cflags --libs dpsync | xargs)" = "-I$prefix/include -L$lib -ldpsync" ] ||
  fail "pkg-config --cflags --libs dpsync: $(pkg-config --cflags --libs dpsync)"
static_libs=$(pkg-config --static --libs dpsync)
[[ " $static_libs " == *" -lpthread "* ]] || fail "pkg-config --static lacks the system libraries"
ok "pkg-config: $version, --static: $static_libs"

step "a C program built against the install three ways"
cmake -S tests/install -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
  -DDPSYNC_WANT="$major.$minor" >"$tmp/cmake.log" 2>&1 || {
  cat "$tmp/cmake.log"
  fail "cmake: find_package(dpsync $major.$minor CONFIG)"
}
cmake --build "$tmp/cmake" >"$tmp/cmake-build.log" 2>&1 || {
  cat "$tmp/cmake-build.log"
  fail "cmake --build"
}
runs_ok "use_shared (CMake, dpsync::dpsync)" bare "$tmp/cmake/use_shared"
needs "$tmp/cmake/use_shared" "^$soname\$" || fail "use_shared does not need $soname"
ok "(a) CMake find_package, dpsync::dpsync: runs without LD_LIBRARY_PATH, needs $soname"
runs_ok "use_static (CMake, dpsync::dpsync_static)" bare "$tmp/cmake/use_static"
! needs "$tmp/cmake/use_static" libdpsync || fail "use_static needs libdpsync.so"
ok "(a) CMake find_package, dpsync::dpsync_static: needs no libdpsync.so"
newer=$major.$((minor + 1))
if ((major > 0)); then newer=$((major + 1)).0; fi
if cmake -S tests/install -B "$tmp/cmake-newer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DDPSYNC_WANT="$newer" >"$tmp/cmake-newer.log" 2>&1; then
  fail "find_package(dpsync $newer) accepted version $version"
fi
ok "(a) find_package(dpsync $newer) refuses $version"

cc -std=c11 -Wall -Werror tests/install/use_dpsync.c $(pkg-config --cflags --libs dpsync) \
  -o "$tmp/use_pc"
needs "$tmp/use_pc" "^$soname\$" || fail "use_pc does not need $soname"
runs_ok "use_pc (pkg-config)" env LD_LIBRARY_PATH="$lib" "$tmp/use_pc"
ok "(b) cc \$(pkg-config --cflags --libs dpsync): needs $soname, runs"

# -l:libdpsync.a: the archive, though libdpsync.so is beside it (GNU ld).
cc -std=c11 -Wall -Werror tests/install/use_dpsync.c $(pkg-config --cflags dpsync) \
  ${static_libs/-ldpsync/-l:libdpsync.a} -o "$tmp/use_pc_static"
! needs "$tmp/use_pc_static" libdpsync || fail "use_pc_static needs libdpsync.so"
runs_ok "use_pc_static (pkg-config --static)" bare "$tmp/use_pc_static"
ok "(c) cc ... -l:libdpsync.a \$(pkg-config --static --libs dpsync): needs no libdpsync.so, runs"

step "staged installs: --destdir and DESTDIR, with --libdir lib/x86_64-linux-gnu"
stage=$tmp/stage
bash scripts/install.sh --prefix /opt/dpsync --libdir lib/x86_64-linux-gnu --destdir "$stage" \
  >"$tmp/stage.log" 2>&1 || {
  cat "$tmp/stage.log"
  fail "install.sh --destdir"
}
staged=$stage/opt/dpsync
[ -f "$staged/lib/x86_64-linux-gnu/$real" ] || fail "nothing staged in $staged"
[ "$(find "$stage" -mindepth 1 -maxdepth 1)" = "$stage/opt" ] || fail "files outside $stage/opt"
! grep -rqF "$stage" "$stage" || fail "the staging directory is written into the staged files"
pc=$staged/lib/x86_64-linux-gnu/pkgconfig/dpsync.pc
[ "$(pkg-config --variable=libdir "$pc")" = /opt/dpsync/lib/x86_64-linux-gnu ] ||
  fail "staged dpsync.pc: libdir $(pkg-config --variable=libdir "$pc")"
ok "staged under $stage/opt/dpsync only, dpsync.pc names /opt/dpsync/lib/x86_64-linux-gnu"
cmake -S tests/install -B "$tmp/cmake-staged" -DCMAKE_PREFIX_PATH="$staged" \
  >"$tmp/cmake-staged.log" 2>&1 && cmake --build "$tmp/cmake-staged" >>"$tmp/cmake-staged.log" 2>&1 ||
  {
    cat "$tmp/cmake-staged.log"
    fail "find_package(dpsync) in the staged tree"
  }
runs_ok "use_shared against the staged tree" bare "$tmp/cmake-staged/use_shared"
ok "the CMake package works where the tree lies (lib/x86_64-linux-gnu/cmake/dpsync)"
DESTDIR=$tmp/stage2 bash scripts/install.sh --prefix /usr/local >"$tmp/stage2.log" 2>&1 || {
  cat "$tmp/stage2.log"
  fail "DESTDIR=... install.sh"
}
[ -f "$tmp/stage2/usr/local/lib/$real" ] || fail "DESTDIR was not honoured"
ok "DESTDIR=$tmp/stage2: installed under $tmp/stage2/usr/local"

step "dpsync-info (installed)"
info=$prefix/bin/dpsync-info
bare "$info" >"$tmp/info.txt" || fail "dpsync-info exited $?: $(cat "$tmp/info.txt")"
cat "$tmp/info.txt"
expect() { # FILE PATTERN WHAT
  grep -qE -- "$2" "$1" || fail "dpsync-info: no $3 (/$2/) in: $(cat "$1")"
}
expect "$tmp/info.txt" "^dpsync $version\$" "version"
expect "$tmp/info.txt" "^  library +$lib/$real\$" "library path"
expect "$tmp/info.txt" "^  MPI worlds +not built in" "MPI build"
expect "$tmp/info.txt" "^  MPI +not built in: " "MPI library line"
expect "$tmp/info.txt" "^run-time libraries" "libraries section"
expect "$tmp/info.txt" "^  CUDA driver " "CUDA driver line"
expect "$tmp/info.txt" "^  NVRTC " "NVRTC line"
expect "$tmp/info.txt" "^  NCCL " "NCCL line"
expect "$tmp/info.txt" "^GPUs" "GPU section"
expect "$tmp/info.txt" "^plan for " "plan section"
expect "$tmp/info.txt" "^    round +op +src +dst +via" "steps table"
bare "$info" --json >"$tmp/info.json" || fail "dpsync-info --json"
if python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["gpus"] else 1)' \
  "$tmp/info.json"; then
  echo "(a GPU is present: the no-GPU lines are not checked)"
else
  expect "$tmp/info.txt" "^  no CUDA device: " "no-GPU line"
  expect "$tmp/info.txt" "^plan for --host 2 " "default host plan"
fi
if [ -n "${DPSYNC_NVRTC_LIBRARY:-}" ] && [ -f "$DPSYNC_NVRTC_LIBRARY" ]; then
  expect "$tmp/info.txt" "^  NVRTC +[0-9]+\.[0-9]+ +.*libnvrtc.*\(DPSYNC_NVRTC_LIBRARY\)" "NVRTC found"
  ok "NVRTC found through DPSYNC_NVRTC_LIBRARY"
fi

# The table against the JSON of the same plan, and the --json document's shape.
args=(--cuda 0,0,1 --transport peer_copy --peer-access 1,0,0/0,1,1/0,1,1 --fusion-bytes 1024)
bare "$info" "${args[@]}" >"$tmp/plan.txt" || fail "dpsync-info ${args[*]}"
bare "$info" "${args[@]}" --json >"$tmp/plan.json" || fail "dpsync-info ${args[*]} --json"
python3 - "$tmp/plan.txt" "$tmp/plan.json" "$version" <<'PY' || fail "dpsync-info's plan table"
import json, re, sys
text, doc, version = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), sys.argv[3]
assert doc["version"] == version and doc["header_version"] == version, doc["version"]
assert doc["mpi"] is False
for lib in ("cuda_driver", "nvrtc", "nccl", "mpi"):
    entry = doc["libraries"][lib]
    assert ("path" in entry) if entry["found"] else entry["reason"], (lib, entry)
plan = doc["plan"]
assert plan["transport"] == "peer_copy" and plan["fusion_bytes"] == 1024, plan
assert plan["peer_access_source"] == "override", plan["peer_access_source"]
assert [r["device"] for r in plan["replicas"]] == ["cuda:0", "cuda:0", "cuda:1"]
assert plan["steps"], "no steps"
for s in plan["steps"]:
    row = r"^    %d +%s +%d +%d +%s$" % (s["round"], s["op"], s["src"], s["dst"], s["via"])
    assert re.search(row, text, re.M), "no row for %s in:\n%s" % (s, text)
assert "transport     peer_copy: PEER_COPY requested" in text
print("ok: the plan table shows dpsync_plan_describe's %d steps; --json parses" % len(plan["steps"]))
PY

bare "$info" --host 2 --check >"$tmp/check.txt" || fail "dpsync-info --host 2 --check"
expect "$tmp/check.txt" "^  created +host: " "check result"
ok "--check --host 2: a context was created"
if ! python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["gpus"] else 1)' \
  "$tmp/info.json"; then
  status=0
  bare "$info" --cuda 0 --check >"$tmp/check.txt" || status=$?
  [ $status = 1 ] || fail "--check --cuda 0 without a GPU exited $status, expected 1"
  expect "$tmp/check.txt" "^  failed +dpsync_context_create: DPSYNC_STATUS_UNAVAILABLE: " "failure"
  ok "--check --cuda 0 without a GPU: exit 1, $(sed -n 's/^  failed *//p' "$tmp/check.txt")"
fi
[[ $(bare "$info" --help) == "usage: dpsync-info"* ]] || fail "dpsync-info --help"
for bad in "--transport bogus" "--cuda 0,x" "--peer-access 1,0/0" "--host 0" "--host" \
  "--fusion-bytes -1" "--frobnicate" "--cuda 0 --transport host" "--host 2 --peer-access 1"; do
  status=0
  bare "$info" $bad >"$tmp/out" 2>"$tmp/err" || status=$?
  [ $status = 2 ] || fail "dpsync-info $bad exited $status, expected 2"
  [ ! -s "$tmp/out" ] || fail "dpsync-info $bad wrote to stdout"
  grep -q "^usage: dpsync-info" "$tmp/err" || fail "dpsync-info $bad: no usage on stderr"
done
ok "bad arguments: usage on stderr, exit 2 ($(head -n 1 "$tmp/err"))"

step "dpsync-info on four fake GPUs (tests/fakecuda; only GPU1<->GPU2 have peer access)"
build_fake_cuda
fake=(env LD_LIBRARY_PATH="$PWD/target/fakecuda" FAKE_CUDA_DEVICES=4 FAKE_CUDA_PEER=1-2)
"${fake[@]}" "$info" --transport peer_copy >"$tmp/fake.txt" || fail "dpsync-info on fake GPUs"
"${fake[@]}" "$info" --transport peer_copy --json >"$tmp/fake.json" || fail "--json on fake GPUs"
sed -n '/^run-time/,/^plan/p' "$tmp/fake.txt"
python3 - "$tmp/fake.txt" "$tmp/fake.json" "$PWD/target/fakecuda" <<'PY' || fail "fake GPUs"
import json, sys
text, doc, fake = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), sys.argv[3]
driver, nccl = doc["libraries"]["cuda_driver"], doc["libraries"]["nccl"]
assert driver["found"] and driver["version"] == "13.0", driver
assert driver["path"] == fake + "/libcuda.so.1", driver
assert nccl["found"] and nccl["path"] == fake + "/libnccl.so.2", nccl
gpus = doc["gpus"]
assert [g["name"] for g in gpus] == ["dpsync fake CUDA device %d (CPU)" % i for i in range(4)]
matrix = [g["peer_access"] for g in gpus]
assert matrix == [[1, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1]], matrix
# By default the plan covers every GPU with the access the driver reports.
plan = doc["plan"]
assert doc["options"].startswith("--cuda 0,1,2,3 --transport peer_copy --peer-access "), doc
assert plan["peer_access"] == matrix and plan["peer_access_source"] == "override", plan
for row in ("    0    1   0   0   0", "    1    0   1   1   0", "    2    0   1   1   0"):
    assert row in text, row
assert "  0    dpsync fake CUDA device 0 (CPU)" in text
print("ok: 4 fake GPUs, their peer matrix, the driver's and NCCL's paths and versions")
PY
if [ -n "${DPSYNC_NVRTC_LIBRARY:-}" ]; then
  "${fake[@]}" "$info" --cuda 0,1,1 --check >"$tmp/fake-check.txt" ||
    fail "dpsync-info --check on fake GPUs: $(cat "$tmp/fake-check.txt")"
  expect "$tmp/fake-check.txt" "^  created +nccl: AUTO: NCCL loaded" "NCCL chosen"
  expect "$tmp/fake-check.txt" "kernels: cubin sm_90, NVRTC" "kernels built"
  ok "--check --cuda 0,1,1 on fake GPUs: a context over NCCL, kernels built by NVRTC"
else
  echo "skipped: --check on fake GPUs (no NVRTC; scripts/common.sh cuda_tools fetches it)"
fi

step "the MPI-enabled install (--features mpi)"
ensure_mpi
mpi_prefix=$tmp/mpi
bash scripts/install.sh --prefix "$mpi_prefix" --features mpi >"$tmp/mpi.log" 2>&1 || {
  cat "$tmp/mpi.log"
  fail "install.sh --features mpi"
}
pc=$mpi_prefix/lib/pkgconfig/dpsync.pc
grep -qE '^Requires.private: (ompi-c|mpich|mpi-c)$' "$pc" || fail "dpsync.pc: no MPI: $(cat "$pc")"
mpi_static=$(PKG_CONFIG_PATH=$mpi_prefix/lib/pkgconfig pkg-config --static --libs dpsync)
[[ " $mpi_static " == *" -lmpi "* ]] || fail "pkg-config --static --libs dpsync lacks -lmpi"
config=$mpi_prefix/lib/cmake/dpsync/dpsyncConfig.cmake
grep -q 'find_dependency(MPI COMPONENTS C)' "$config" || fail "dpsyncConfig.cmake: no MPI"
grep -q 'MPI::MPI_C' "$config" || fail "dpsyncConfig.cmake: dpsync_static does not link MPI::MPI_C"
ok "dpsync.pc requires $(sed -n 's/^Requires.private: //p' "$pc"); --static: $mpi_static"
cmake -S tests/install -B "$tmp/cmake-mpi" -DCMAKE_PREFIX_PATH="$mpi_prefix" \
  >"$tmp/cmake-mpi.log" 2>&1 && cmake --build "$tmp/cmake-mpi" >>"$tmp/cmake-mpi.log" 2>&1 || {
  cat "$tmp/cmake-mpi.log"
  fail "CMake against the MPI install"
}
needs "$tmp/cmake-mpi/use_static" '^libmpi' || fail "use_static (MPI) needs no libmpi"
runs_ok "use_static (MPI)" bare "$tmp/cmake-mpi/use_static"
ok "dpsync::dpsync_static with MPI::MPI_C: links libmpi, runs"
bare "$mpi_prefix/bin/dpsync-info" >"$tmp/mpi-info.txt" || fail "dpsync-info (MPI)"
expect "$tmp/mpi-info.txt" "^  MPI worlds +built in" "MPI build"
expect "$tmp/mpi-info.txt" "^  MPI +.*(Open MPI|MPICH).* /.*libmpi" "MPI library"
ok "dpsync-info: $(grep -E '^  MPI ' "$tmp/mpi-info.txt" | tail -n 1 | cut -c1-100)"
