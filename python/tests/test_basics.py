"""Library loading, versions, queries, describe, plan_describe, closing, python -m dpsync."""

import os
import re
import stat

import pytest

import dpsync

from conftest import REPO_ROOT, run_python


def test_version_matches_package_and_crate():
    with open(os.path.join(REPO_ROOT, "Cargo.toml")) as f:
        crate = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    assert dpsync.version() == crate
    assert dpsync.__version__ == crate


def test_library_path_is_a_loaded_file():
    path = dpsync.library_path()
    assert os.path.isfile(path) and path.endswith("libdpsync.so")
    assert dpsync.library().dpsync_version() == dpsync.version().encode()


def test_dpsync_library_selects_the_file():
    path = dpsync.library_path()
    out = run_python("import dpsync; print(dpsync.library_path())", env={"DPSYNC_LIBRARY": path})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.abspath(path)


def test_dpsync_library_missing_file_is_an_error_naming_it():
    out = run_python("import dpsync; dpsync.version()", env={"DPSYNC_LIBRARY": "/nonexistent/libdpsync.so"})
    assert out.returncode != 0
    assert "/nonexistent/libdpsync.so" in out.stderr and "DPSYNC_LIBRARY" in out.stderr


def test_context_queries(ctx4):
    assert ctx4.replica_count == 4
    assert ctx4.loss_scale == 0.25
    assert (ctx4.rank, ctx4.ranks) == (0, 1)
    assert ctx4.world_replicas == (4, 0)
    assert ctx4.handle != 0


def test_describe_is_the_c_json(ctx4):
    d = ctx4.describe()
    assert d["transport"] == "host"
    assert [r["device"] for r in d["replicas"]] == ["host"] * 4
    assert d["fusion_bytes"] == 64
    assert d["loss_scale"] == 0.25


def test_options_reach_the_library():
    with dpsync.Context(host_replicas=3, transport="host", fusion_bytes=1024, timeout_ms=5000, sparse_coalesce=True) as ctx:
        d = ctx.describe()
        assert d["fusion_bytes"] == 1024
        assert d["transport"] == "host"
        assert d["sparse_gather"]["coalesce"] is True
        assert ctx.replica_count == 3


def test_plan_describe_cuda_topology():
    d = dpsync.plan_describe(cuda_replicas=[0, 1, 2], transport="peer_copy", peer_access=[[1, 0, 0], [0, 1, 1], [0, 1, 1]])
    assert d["transport"] == "peer_copy"
    assert [r["device"] for r in d["replicas"]] == ["cuda:0", "cuda:1", "cuda:2"]
    assert d["peer_access"] == [[1, 0, 0], [0, 1, 1], [0, 1, 1]]
    assert d["peer_access_source"] == "override"
    vias = {(s["src"], s["dst"]): s["via"] for s in d["steps"]}
    assert vias[(1, 0)] == "staged"  # replicas 0 and 1 have no access


def test_plan_describe_host_default():
    d = dpsync.plan_describe(host_replicas=2)
    assert d["transport"] == "host" and len(d["replicas"]) == 2


def test_bad_options_are_refused():
    with pytest.raises(dpsync.InvalidArgument, match="not both"):
        dpsync.Context(host_replicas=2, cuda_replicas=[0])
    with pytest.raises(dpsync.InvalidArgument, match="transport"):
        dpsync.Context(host_replicas=2, transport="carrier_pigeon")
    with pytest.raises(dpsync.InvalidArgument, match="square"):
        dpsync.plan_describe(cuda_replicas=[0, 1], peer_access=[[1, 1], [1]])
    with pytest.raises(dpsync.InvalidArgument, match="host_replicas"):
        dpsync.Context(host_replicas=-1)
    with pytest.raises(dpsync.InvalidArgument) as e:
        dpsync.Context(host_replicas=0)
    assert e.value.function == "dpsync_options_set_host_replicas"
    with pytest.raises(dpsync.InvalidArgument) as e:  # the C library's check, at creation
        dpsync.Context(host_replicas=2, transport="nccl")
    assert e.value.function == "dpsync_context_create"


def test_closed_context_refuses_calls():
    ctx = dpsync.Context(host_replicas=2)
    with ctx:
        pass
    assert ctx.closed
    ctx.close()  # idempotent
    for call in (lambda: ctx.allreduce("x"), lambda: ctx.allreduce_grads(), lambda: ctx.describe(), lambda: ctx.loss_scale):
        with pytest.raises(dpsync.InvalidState, match="closed"):
            call()


def test_synchronize_on_host_returns(ctx4):
    ctx4.synchronize()


def test_set_stream_on_host_replicas_is_invalid(ctx4):
    with pytest.raises(dpsync.InvalidArgument) as e:
        ctx4.set_stream(0, None)
    assert e.value.function == "dpsync_set_stream"


def test_python_m_dpsync_without_dpsync_info(tmp_path):
    out = run_python("import runpy; runpy.run_module('dpsync', run_name='__main__')", env={"PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "dpsync " + dpsync.version() in out.stdout
    assert dpsync.library_path() in out.stdout
    assert '"transport": "host"' in out.stdout


def test_python_m_dpsync_runs_dpsync_info(tmp_path):
    tool = tmp_path / "dpsync-info"
    tool.write_text("#!/bin/sh\necho 'summary from dpsync-info'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    out = run_python("import runpy; runpy.run_module('dpsync', run_name='__main__')", env={"PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "summary from dpsync-info" in out.stdout
    assert dpsync.library_path() in out.stdout, "which library Python loads, before dpsync-info's"
    assert '"transport"' not in out.stdout, "dpsync-info's summary replaces the plan"


def test_python_m_dpsync_when_dpsync_info_fails(tmp_path):
    tool = tmp_path / "dpsync-info"
    tool.write_text("#!/bin/sh\necho 'cannot load'\nexit 1\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    out = run_python("import runpy; runpy.run_module('dpsync', run_name='__main__')", env={"PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "failed (exit 1)" in out.stdout and "cannot load" in out.stdout
    assert '"transport": "host"' in out.stdout
