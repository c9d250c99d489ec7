#!/usr/bin/env bash
# Builds dpsync for installation and installs it under a prefix, in the layout packagers expect:
#
#   bash scripts/install.sh [--prefix DIR] [--libdir DIR] [--destdir DIR] [--features mpi]
#
#   PREFIX/lib/libdpsync.so.X.Y.Z           the shared library, DT_SONAME libdpsync.so.SOVERSION
#   PREFIX/lib/libdpsync.so.SOVERSION       -> libdpsync.so.X.Y.Z (what programs load)
#   PREFIX/lib/libdpsync.so                 -> libdpsync.so.SOVERSION (what -ldpsync finds)
#   PREFIX/lib/libdpsync.a                  the static library
#   PREFIX/include/dpsync.h
#   PREFIX/lib/pkgconfig/dpsync.pc
#   PREFIX/lib/cmake/dpsync/dpsyncConfig.cmake, dpsyncConfigVersion.cmake
#   PREFIX/bin/dpsync-info
#
# SOVERSION is MAJOR; 0.MINOR while MAJOR is 0 (0.0.PATCH for 0.0.x): docs/API.md, "Install and
# find". --prefix defaults to /usr/local and must be absolute; --libdir is relative to it
# (default lib; Debian's multiarch directory is lib/x86_64-linux-gnu). --destdir (or the DESTDIR
# variable) stages the files under another root without changing the paths written into them.
# CC, CFLAGS and LDFLAGS apply to dpsync-info. The build goes to $CARGO_TARGET_DIR/install
# (install-mpi with MPI), apart from target/release, whose library has no soname for the
# examples and tests that link it. scripts/check-install.sh tests all of this.
caller=$PWD
source "$(dirname "$0")/common.sh"

usage() {
  echo "usage: bash scripts/install.sh [--prefix DIR] [--libdir DIR] [--destdir DIR] [--features mpi]"
  echo "(the comment at the top of scripts/install.sh says what goes where)"
}

prefix=/usr/local libdir=lib destdir=${DESTDIR:-} features=""
while (($#)); do
  case $1 in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --libdir) libdir=${2:?--libdir needs a directory}; shift 2 ;;
    --destdir) destdir=${2:?--destdir needs a directory}; shift 2 ;;
    --features) features=${2:?--features needs a value}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
case $prefix in /?*) ;; *) echo "install.sh: --prefix must be an absolute directory: $prefix" >&2; exit 2 ;; esac
case $libdir in /* | *..*) echo "install.sh: --libdir must be relative to the prefix: $libdir" >&2; exit 2 ;; esac
case $features in "" | mpi) ;; *) echo "install.sh: --features takes only 'mpi'" >&2; exit 2 ;; esac
case $destdir in "" | /*) ;; *) destdir=$caller/$destdir ;; esac
prefix=${prefix%/} libdir=${libdir%/}

# Version from Cargo.toml ("path+file:///src#dpsync@0.1.0" or ".../dpsync#0.1.0").
version=$(cargo pkgid)
version=${version##*[#@]}
numbers=${version%%[-+]*}
IFS=. read -r major minor patch <<<"$numbers"
if ((major > 0)); then
  soversion=$major
elif ((minor > 0)); then
  soversion=0.$minor
else
  soversion=0.0.$patch
fi
soname=libdpsync.so.$soversion
realname=libdpsync.so.$numbers
description=$(sed -n 's/^description = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)

mpi_module=""
if [ "$features" = mpi ]; then
  # rustc lists -lmpi without its directory; the MPI's own pkg-config module and CMake target
  # carry both.
  for module in ompi-c mpich mpi-c; do
    if pkg-config --exists "$module" 2>/dev/null; then mpi_module=$module; break; fi
  done
  [ -n "$mpi_module" ] || {
    echo "install.sh: no pkg-config module for MPI (ompi-c, mpich, mpi-c) was found: install" \
      "libopenmpi-dev (scripts/common.sh ensure_mpi)" >&2
    exit 1
  }
fi

target=${CARGO_TARGET_DIR:-target}/install${features:+-$features}
cargo_features=()
[ -z "$features" ] || cargo_features=(--features "$features")
step "cargo rustc: libdpsync.so ($soname) and libdpsync.a ${features:+with $features }-> $target"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# cargo rustc passes the arguments after -- to the library alone: the soname reaches only the
# cdylib's link, and rustc prints the static library's system libraries (cargo repeats the note
# when the build is already fresh).
cargo rustc --release --lib --crate-type cdylib,staticlib "${cargo_features[@]}" \
  --target-dir "$target" -- -C "link-arg=-Wl,-soname,$soname" --print native-static-libs \
  2>&1 | tee "$log"
native=$(sed -n 's/^note: native-static-libs: //p' "$log" | tail -n 1)
[ -n "$native" ] || { echo "install.sh: rustc printed no native-static-libs" >&2; exit 1; }
built=$target/release

# The system libraries as CMake link items: "-lm" -> "m"; MPI comes from MPI::MPI_C.
cmake_libs=()
for flag in $native; do
  case $flag in
    -lmpi) ;;
    -l*) cmake_libs+=("${flag#-l}") ;;
    *) cmake_libs+=("$flag") ;;
  esac
done
[ -z "$mpi_module" ] || cmake_libs+=(MPI::MPI_C)

step "dpsync-info (tools/*.c)"
# The tool finds the library beside it, wherever the prefix is moved to.
${CC:-cc} -std=c11 ${CFLAGS:--O2 -g} -Wall -Wextra -Iinclude tools/dpsync_info.c tools/info_args.c \
  tools/info_json.c tools/info_probe.c \
  -o "$built/dpsync-info" ${LDFLAGS:-} -L"$built" -ldpsync -ldl \
  "-Wl,-rpath,\$ORIGIN/../$libdir"

root=${destdir%/}$prefix
step "installing into ${destdir:+$destdir (staged) for }$prefix"
install -d "$root/bin" "$root/include" "$root/$libdir/pkgconfig" "$root/$libdir/cmake/dpsync"
install -m 0755 "$built/libdpsync.so" "$root/$libdir/$realname"
ln -sfn "$realname" "$root/$libdir/$soname"
ln -sfn "$soname" "$root/$libdir/libdpsync.so"
install -m 0644 "$built/libdpsync.a" "$root/$libdir/libdpsync.a"
install -m 0644 include/dpsync.h "$root/include/dpsync.h"
install -m 0755 "$built/dpsync-info" "$root/bin/dpsync-info"

{
  echo "prefix=$prefix"
  echo "exec_prefix=\${prefix}"
  echo "libdir=\${prefix}/$libdir"
  echo "includedir=\${prefix}/include"
  echo
  echo "Name: dpsync"
  echo "Description: $description"
  echo "Version: $version"
  [ -z "$mpi_module" ] || echo "Requires.private: $mpi_module"
  echo "Libs: -L\${libdir} -ldpsync"
  echo "Libs.private: $native"
  echo "Cflags: -I\${includedir}"
} >"$root/$libdir/pkgconfig/dpsync.pc"

# From lib/cmake/dpsync back to the prefix: one ".." per component of libdir, plus two.
up=../..
IFS=/ read -ra parts <<<"$libdir"
for _ in "${parts[@]}"; do up+=/..; done
{
  cat <<EOF
# dpsync's CMake package (written by scripts/install.sh). find_package(dpsync CONFIG) defines
#   dpsync::dpsync         the shared library, $soname
#   dpsync::dpsync_static  the static library, with the system libraries it needs
# Paths are found from this file's place, so the installed tree may be moved.
get_filename_component(_dpsync_prefix "\${CMAKE_CURRENT_LIST_DIR}/$up" ABSOLUTE)
EOF
  if [ -n "$mpi_module" ]; then
    cat <<'EOF'
# Built with MPI (worlds of processes): the static library needs the MPI library at link time.
include(CMakeFindDependencyMacro)
find_dependency(MPI COMPONENTS C)
EOF
  fi
  cat <<EOF
if(NOT TARGET dpsync::dpsync)
  add_library(dpsync::dpsync SHARED IMPORTED)
  set_target_properties(dpsync::dpsync PROPERTIES
    IMPORTED_LOCATION "\${_dpsync_prefix}/$libdir/$realname"
    IMPORTED_SONAME "$soname"
    INTERFACE_INCLUDE_DIRECTORIES "\${_dpsync_prefix}/include")
  add_library(dpsync::dpsync_static STATIC IMPORTED)
  set_target_properties(dpsync::dpsync_static PROPERTIES
    IMPORTED_LOCATION "\${_dpsync_prefix}/$libdir/libdpsync.a"
    IMPORTED_LINK_INTERFACE_LANGUAGES C
    INTERFACE_INCLUDE_DIRECTORIES "\${_dpsync_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$(IFS=';'; echo "${cmake_libs[*]}")")
endif()
set(dpsync_FEATURES "$features")
unset(_dpsync_prefix)
EOF
} >"$root/$libdir/cmake/dpsync/dpsyncConfig.cmake"

# Compatible: the same soversion (the same ABI), and no older than the version asked for.
compatible="PACKAGE_FIND_VERSION_MAJOR EQUAL $major"
((major > 0)) || compatible+=" AND PACKAGE_FIND_VERSION_MINOR EQUAL $minor"
((major > 0 || minor > 0)) || compatible+=" AND PACKAGE_FIND_VERSION_PATCH EQUAL $patch"
cat >"$root/$libdir/cmake/dpsync/dpsyncConfigVersion.cmake" <<EOF
# find_package(dpsync VERSION) accepts this install when the version asked for has the same
# soversion ($soversion: the ABI) and is not newer than $version (written by scripts/install.sh).
set(PACKAGE_VERSION "$version")
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif($compatible
       AND NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
else()
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
endif()
# A 64-bit library: no use to a 32-bit build.
if(CMAKE_SIZEOF_VOID_P AND NOT CMAKE_SIZEOF_VOID_P EQUAL 8)
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
EOF

step "installed dpsync $version${features:+ ($features)} into $root"
for file in bin/dpsync-info include/dpsync.h "$libdir"/{"$realname","$soname",libdpsync.so,libdpsync.a} \
  "$libdir"/pkgconfig/dpsync.pc "$libdir"/cmake/dpsync/dpsyncConfig{,Version}.cmake; do
  echo "  $file"
done
