"""Shared helpers. Tests that need numpy, torch, ml_dtypes or MPI skip with the reason."""

import os
import sys

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed: the tests build their arrays with it")

import dpsync  # noqa: E402

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def bf16_backends():
    """The ways this Python can make bfloat16 arrays: ml_dtypes (numpy) and torch."""
    out = []
    try:
        import ml_dtypes  # noqa: F401

        out.append("ml_dtypes")
    except ImportError:
        pass
    try:
        import torch  # noqa: F401

        out.append("torch")
    except ImportError:
        pass
    return out


@pytest.fixture
def ctx4():
    with dpsync.Context(host_replicas=4, fusion_bytes=64) as ctx:
        yield ctx


def rng(seed=0):
    return np.random.default_rng(seed)


def run_python(code, env=None, args=()):
    """Runs `code` in a fresh interpreter (this one), returning the CompletedProcess."""
    import subprocess

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env, timeout=120)


def pytest_report_header(config):
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return "dpsync %s from %s (library %s); numpy %s; torch %s" % (
        dpsync.__version__,
        os.path.dirname(dpsync.__file__),
        dpsync.library_path(),
        np.__version__,
        torch_version,
    )
