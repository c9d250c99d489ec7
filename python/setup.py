"""Build step of the dpsync wheel: `cargo build --release` of the repository's crate, and
libdpsync.so copied into the package (metadata: pyproject.toml; why: docs/ARCHITECTURE.md,
"Python package").

Everything is built outside the source tree, so that `pip install ./python` leaves the checkout
as it was: cargo's output goes to $CARGO_TARGET_DIR when set, else to a cache directory
($XDG_CACHE_HOME/dpsync/target, by default ~/.cache/dpsync/target, kept so that a reinstall
compiles nothing), and setuptools' build and egg-info directories go under it too."""

import json
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(os.path.dirname(HERE), "Cargo.toml")


def target_dir():
    """Cargo's target directory: the caller's CARGO_TARGET_DIR, else a per-user cache."""
    given = os.environ.get("CARGO_TARGET_DIR")
    if given:
        return os.path.abspath(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dpsync", "target")


TARGET = target_dir()
# setuptools' own scratch (build/, dpsync.egg-info) beside cargo's, not in python/.
BUILD = os.path.join(TARGET, "python-build")


def build_library():
    """Runs cargo and returns the path of the cdylib it built (cargo's own report, so that
    CARGO_TARGET_DIR and other cargo settings are respected)."""
    if not os.path.isfile(MANIFEST):
        sys.exit("dpsync: %s not found: build the package from the repository (pip install ./python)" % MANIFEST)
    cargo = os.environ.get("CARGO", "cargo")
    if shutil.which(cargo) is None:
        sys.exit("dpsync: cargo not found: install a Rust toolchain (https://rustup.rs) to build libdpsync.so")
    cmd = [cargo, "build", "--release", "--lib", "--manifest-path", MANIFEST, "--message-format=json-render-diagnostics"]
    # pip shows this (and cargo's progress) only with -v; a first build takes minutes.
    print("dpsync: CARGO_TARGET_DIR=%s %s" % (TARGET, " ".join(cmd)), flush=True)
    env = dict(os.environ, CARGO_TARGET_DIR=TARGET)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, universal_newlines=True, env=env)
    if proc.returncode != 0:
        sys.exit("dpsync: cargo build failed (exit %d)" % proc.returncode)
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and "cdylib" in msg.get("target", {}).get("kind", []):
            for path in msg.get("filenames", []):
                if path.endswith(".so"):
                    return path
    sys.exit("dpsync: cargo did not report libdpsync.so")


class BuildPy(build_py):
    def run(self):
        super().run()
        library = build_library()
        target = os.path.join(self.build_lib, "dpsync", "libdpsync.so")
        self.mkpath(os.path.dirname(target))
        shutil.copyfile(library, target)
        os.chmod(target, 0o755)


class BdistWheel(bdist_wheel):
    """A platform wheel (it carries a native library) for any Python 3: ctypes needs no ABI."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


os.makedirs(BUILD, exist_ok=True)
setup(
    cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel},
    options={"build": {"build_base": BUILD}, "egg_info": {"egg_base": BUILD}},
)
