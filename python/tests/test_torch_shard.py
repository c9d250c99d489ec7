"""dpsync.torch.ShardedOptimizer (ZeRO stage 1) on a 4-replica CNN: the parameters of the whole
optimizer after allreduce_grads, byte for byte, with about 1/4 of its state on each replica."""

import copy

import pytest

import dpsync

torch = pytest.importorskip("torch", reason="torch is not installed: dpsync.torch is not tested")
import dpsync.torch as dt  # noqa: E402
import torch.nn.functional as F  # noqa: E402

N = 4
ROWS = 4  # samples per replica per step


class SmallCNN(torch.nn.Module):
    """Convolutions with batch norm; fc.bias has 3 elements, so replica 0's piece of it is empty."""

    def __init__(self, classes=3):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@pytest.fixture(autouse=True)
def one_thread():
    """The same kernels, and so the same rounding, in both runs of a comparison."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replicas(seed=0):
    torch.manual_seed(seed)
    model = SmallCNN()
    return [copy.deepcopy(model) for _ in range(N)]


def batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, N * ROWS, 3, 8, 8, generator=g), torch.randint(0, 3, (steps, N * ROWS), generator=g)


def train(models, zero_grad, step, data, op):
    x, y = data
    for s in range(len(x)):
        zero_grad()
        for r, m in enumerate(models):
            rows = slice(r * ROWS, (r + 1) * ROWS)
            loss = F.cross_entropy(m(x[s, rows]), y[s, rows])
            (loss if op == "avg" else loss / N).backward()
        step()


def run_whole(optimizer_class, defaults, data, op, set_to_none, groups=None):
    """The unsharded reference: allreduce_grads, then every replica's whole optimizer."""
    models = replicas()
    params = [groups(m) if groups else m.parameters() for m in models]
    opts = [optimizer_class(p, **defaults) for p in params]
    with dpsync.Context(host_replicas=N, fusion_bytes=1024) as ctx:
        dt.register_modules(ctx, models)

        def step():
            ctx.allreduce_grads(op)
            for o in opts:
                o.step()

        def zero_grad():
            for o in opts:
                o.zero_grad(set_to_none=set_to_none)

        train(models, zero_grad, step, data, op)
    return models, [dt.optimizer_state_bytes(o) for o in opts], opts


def run_sharded(optimizer_class, defaults, data, op, set_to_none, groups=None):
    models = replicas()
    with dpsync.Context(host_replicas=N, fusion_bytes=1024) as ctx:
        dt.register_modules(ctx, models)
        params = [groups(m) if groups else m for m in models]
        sharded = dt.ShardedOptimizer(ctx, params, optimizer_class, op=op, **defaults)
        train(models, lambda: sharded.zero_grad(set_to_none=set_to_none), sharded.step, data, op)
    return models, sharded


def differences(whole, sharded):
    """Every (replica, parameter, first differing element, whole value, sharded value)."""
    out = []
    for r in range(N):
        for (name, a), (_, b) in zip(whole[r].named_parameters(), sharded[r].named_parameters()):
            if a.detach().numpy().tobytes() != b.detach().numpy().tobytes():
                flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
                i = int((flat_a != flat_b).nonzero()[0])
                out.append((r, name, i, float(flat_a[i]), float(flat_b[i])))
    return out


OPTIMIZERS = [
    pytest.param(torch.optim.Adam, {"lr": 0.01}, id="Adam"),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, id="SGD-momentum"),
    pytest.param(torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, id="AdamW"),
]


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zero_grad", "zero_grad_set_to_none"])
@pytest.mark.parametrize("op", ["avg", "sum"])
@pytest.mark.parametrize("optimizer_class, defaults", OPTIMIZERS)
def test_sharded_matches_the_whole_optimizer(optimizer_class, defaults, op, set_to_none):
    data = batches(steps=5)
    whole, whole_bytes, _ = run_whole(optimizer_class, defaults, data, op, set_to_none)
    models, sharded = run_sharded(optimizer_class, defaults, data, op, set_to_none)
    assert differences(whole, models) == [], "byte for byte the parameters of the whole optimizer"
    for r in range(1, N):
        for a, b in zip(models[0].parameters(), models[r].parameters()):
            assert torch.equal(a, b), "every replica equal after allgather"
    for r in range(N):  # batch-norm statistics: each replica's own, alike in both runs
        for (name, a), (_, b) in zip(whole[r].named_buffers(), models[r].named_buffers()):
            assert torch.equal(a, b), (r, name)
    shard_bytes = sharded.state_bytes()
    print("\n%s optimizer state bytes per replica: unsharded %s, sharded %s (%s)" % (
        optimizer_class.__name__, whole_bytes, shard_bytes,
        ", ".join("%.3f" % (b / whole_bytes[0]) for b in shard_bytes)))
    assert len(set(whole_bytes)) == 1
    for b in shard_bytes:
        assert abs(b / whole_bytes[0] - 1 / N) < 0.02, (shard_bytes, whole_bytes)


def test_overlap_registration():
    """grad_ready hooks run, buckets are reduce-scattered early after the first step, the result is the same."""
    data = batches(steps=3)
    whole, _, _ = run_whole(torch.optim.Adam, {"lr": 0.01}, data, "avg", True)
    models = replicas()
    with dpsync.Context(host_replicas=N, fusion_bytes=1024) as ctx:
        dt.register_modules(ctx, models, overlap=True)
        sharded = dt.ShardedOptimizer(ctx, models, torch.optim.Adam, lr=0.01)
        train(models, sharded.zero_grad, sharded.step, data, "avg")
        assert ctx.describe()["overlap"]["buckets_reduced_early_last_step"] > 0
    assert differences(whole, models) == []


def test_pieces_are_views_of_the_owned_elements():
    models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        reg = dt.register_modules(ctx, models)
        sharded = dt.ShardedOptimizer(ctx, models, torch.optim.Adam, lr=0.01)
        names = reg.names["param"]
        for r, m in enumerate(models):
            params = dict(m.named_parameters())
            assert [name for name, _, _ in sharded.pieces[r]] == names
            pieces = [p for group in sharded.optimizers[r].param_groups for p in group["params"]]
            owned = [(name, offset, count) for name, offset, count in sharded.pieces[r] if count]
            assert len(pieces) == len(owned), "empty pieces are left out"
            for piece, (name, offset, count) in zip(pieces, owned):
                assert (offset, count) == ctx.shard(name, r)
                p = params[name]
                assert piece.is_leaf and piece.shape == (count,)
                assert piece.data_ptr() == p.data_ptr() + offset * p.element_size(), "shares the storage"
        assert ("fc.bias", 0, 0) in sharded.pieces[0] and len(sharded.optimizers[0].param_groups[0]["params"]) == 9
        assert ("fc.bias", 2, 1) in sharded.pieces[3]
        # The optimizer writes the parameter in place.
        x = torch.randn(ROWS, 3, 8, 8)
        for m in models:
            F.cross_entropy(m(x), torch.zeros(ROWS, dtype=torch.long)).backward()
        before = models[1].conv1.weight.detach().clone()
        sharded.step()
        assert not torch.equal(before, models[1].conv1.weight)
        assert all(piece.grad is None for piece in sharded.optimizers[1].param_groups[0]["params"]), \
            "the gradient views are dropped after the step"
        for r in range(N):  # state for the pieces alone: per element, or a scalar step count
            assert len(sharded.optimizers[r].state) == (9 if r == 0 else 10)
            for piece, state in sharded.optimizers[r].state.items():
                for key, value in state.items():
                    if value.dim():
                        assert value.shape == piece.shape, (r, key)


def test_param_groups_keep_their_options():
    def groups(m):
        return [{"params": [m.conv1.weight, m.conv2.weight, m.fc.weight]},
                {"params": [m.conv1.bias, m.conv2.bias, m.fc.bias], "lr": 0.02, "momentum": 0.5},
                {"params": list(m.bn1.parameters()) + list(m.bn2.parameters()), "weight_decay": 0.01}]

    data = batches(steps=4)
    defaults = {"lr": 0.1, "momentum": 0.9}
    whole, _, _ = run_whole(torch.optim.SGD, defaults, data, "avg", True, groups)
    models, sharded = run_sharded(torch.optim.SGD, defaults, data, "avg", True, groups)
    assert differences(whole, models) == []
    for r in range(N):
        g = sharded.optimizers[r].param_groups
        assert [x["lr"] for x in g] == [0.1, 0.02, 0.1] and g[1]["momentum"] == 0.5 and g[2]["weight_decay"] == 0.01
    assert len(sharded.optimizers[0].param_groups[1]["params"]) == 2, "fc.bias: empty on replica 0"


def test_state_dict_round_trip():
    data = batches(steps=2)
    models, sharded = run_sharded(torch.optim.Adam, {"lr": 0.01}, data, "avg", True)
    saved = copy.deepcopy(sharded.state_dict())
    assert len(saved) == N
    with dpsync.Context(host_replicas=N) as ctx:
        dt.register_modules(ctx, models)
        again = dt.ShardedOptimizer(ctx, models, torch.optim.Adam, lr=0.01)
        again.load_state_dict(saved)
        assert again.state_bytes() == sharded.state_bytes()
        with pytest.raises(dpsync.InvalidArgument, match="3 state dicts for 4 replicas"):
            again.load_state_dict(saved[:3])


def test_bad_arguments():
    models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        with pytest.raises(dpsync.InvalidArgument, match="is not registered with this context"):
            dt.ShardedOptimizer(ctx, models, torch.optim.SGD, lr=0.1)
        dt.register_modules(ctx, models)
        with pytest.raises(dpsync.InvalidArgument, match="3 parameter lists for 4 replicas"):
            dt.ShardedOptimizer(ctx, models[:3], torch.optim.SGD, lr=0.1)
        with pytest.raises(dpsync.InvalidArgument, match="torch.optim.Optimizer subclass"):
            dt.ShardedOptimizer(ctx, models, "adam", lr=0.1)
        with pytest.raises(dpsync.InvalidArgument, match="op is 'mean'"):
            dt.ShardedOptimizer(ctx, models, torch.optim.SGD, op="mean", lr=0.1)
        params = [list(m.parameters()) for m in models]
        params[2] = params[2][::-1]
        with pytest.raises(dpsync.InvalidArgument, match="replica 2's parameters differ"):
            dt.ShardedOptimizer(ctx, params, torch.optim.SGD, lr=0.1)
        other = SmallCNN()
        with pytest.raises(dpsync.InvalidArgument, match="on replica 1"):
            dt.ShardedOptimizer(ctx, [models[0], other, models[2], models[3]], torch.optim.SGD, lr=0.1)


def test_replaced_parameter_memory_is_refused():
    models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        dt.register_modules(ctx, models)
        sharded = dt.ShardedOptimizer(ctx, models, torch.optim.SGD, lr=0.1)
        models[2].fc.weight.data = models[2].fc.weight.data.clone()
        for r, m in enumerate(models):
            for p in m.parameters():
                p.grad.fill_(r + 1.0)
        grads = [p.grad.clone() for m in models for p in m.parameters()]
        with pytest.raises(dpsync.InvalidState, match="replica 2"):
            sharded.step()
        after = [p.grad for m in models for p in m.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(grads, after)), "refused before the reduce-scatter"
