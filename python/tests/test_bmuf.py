"""BMUF through the package (docs/API.md, "BMUF")."""

import pytest

import dpsync

from conftest import np


def test_bmuf_averaging_and_momentum():
    with dpsync.Context(host_replicas=2) as ctx:
        p = [np.array([1.0, 2.0], np.float64), np.array([9.0, 9.0], np.float64)]
        for r in range(2):
            ctx.register("w", p[r], "param", r)
        ctx.bmuf_init(block_lr=1.0, block_momentum=0.5, nesterov=False)
        assert (p[1] == [1.0, 2.0]).all(), "init broadcasts replica 0"
        bmuf = ctx.describe()["bmuf"]
        assert bmuf["block_momentum"] == 0.5 and bmuf["nesterov"] is False
        # One block: replica 0 moved by +2, replica 1 by +4: A - W = 3; D = 3; W = W + 3.
        p[0] += 2
        p[1] += 4
        ctx.bmuf_step()
        assert p[0].tolist() == [4.0, 5.0] and p[1].tolist() == [4.0, 5.0]
        # Next block without local progress: G = 0, D = 0.5 * 3, W moves by 1.5.
        ctx.bmuf_step()
        assert p[0].tolist() == [5.5, 6.5] and p[1].tolist() == [5.5, 6.5]


def test_bmuf_default_momentum_and_bad_arguments():
    with dpsync.Context(host_replicas=4) as ctx:
        p = [np.zeros(3, np.float32) for _ in range(4)]
        for r in range(4):
            ctx.register("w", p[r], "param", r)
        ctx.bmuf_init()
        assert ctx.describe()["bmuf"]["block_momentum"] == 0.75  # 1 - 1/N
        with pytest.raises(dpsync.InvalidArgument, match="block_lr"):
            ctx.bmuf_init(block_lr=0.0)
        with pytest.raises(dpsync.InvalidArgument, match="block_momentum"):
            ctx.bmuf_init(block_momentum=1.0)
        assert ctx.describe()["bmuf"]["block_momentum"] == 0.75, "a refused init keeps the filter"
