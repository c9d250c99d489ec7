"""dpsync.torch: modules of every replica registered, trained in sync, and the zero_grad rule."""

import copy

import pytest

import dpsync

torch = pytest.importorskip("torch", reason="torch is not installed: dpsync.torch is not tested")
import dpsync.torch as dt  # noqa: E402

N = 4


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(2, 2)  # never in forward: its gradient stays None
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool))  # no dpsync dtype: skipped
        self.to(dtype)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.mask


def replicas(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = Net(dtype)
    return model, [copy.deepcopy(model) for _ in range(N)]


def test_register_modules_names_and_roles():
    _, models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        reg = dt.register_modules(ctx, models)
        assert reg.names["param"] == ["fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight", "fc2.bias",
                                      "unused.weight", "unused.bias"]
        assert reg.names["grad"] == [n + ":grad" for n in reg.names["param"]]
        assert reg.names["computed"] == ["bn.running_mean", "bn.running_var"]
        assert reg.names["state"] == ["bn.num_batches_tracked"]
        assert reg.skipped == ["mask"]
        for m in models:
            for p in m.parameters():
                assert p.grad is not None and not p.grad.any()
        kept = ctx.registered()
        assert kept["fc1.weight:grad"][2] is models[2].fc1.weight.grad
        # Gradients are bucketed last registered first (backward order).
        d = ctx.describe()
        assert d["buckets"][0]["tensors"][0] == "unused.bias:grad"


def train(models, opts, ctx, data, steps, set_to_none):
    x, y = data
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad(set_to_none=set_to_none)
            chunk = slice(r * 4, (r + 1) * 4)
            loss = torch.nn.functional.mse_loss(m(x[step, chunk]), y[step, chunk])
            (loss * ctx.loss_scale).backward()
        ctx.allreduce_grads("sum")
        for o in opts:
            o.step()


def reference(model, data, steps):
    """One model on every step's whole batch, batch norm over each replica's chunk (so the
    arithmetic is the replicas')."""
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for r in range(N):
            chunk = slice(r * 4, (r + 1) * 4)
            loss = torch.nn.functional.mse_loss(model(x[step, chunk]), y[step, chunk])
            (loss / N).backward()
        opt.step()


@pytest.mark.parametrize("set_to_none", [False, True], ids=["zero_grad", "zero_grad_set_to_none"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_training_matches_one_model(overlap, set_to_none):
    model, models = replicas()
    torch.manual_seed(1)
    steps = 6
    data = (torch.randn(steps, 4 * N, 6), torch.randn(steps, 4 * N, 3))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    with dpsync.Context(host_replicas=N, fusion_bytes=128) as ctx:
        reg = dt.register_modules(ctx, models, optimizers=opts, overlap=overlap)
        ctx.broadcast(("param", "computed", "state"))
        train(models, opts, ctx, data, steps, set_to_none)
        if overlap:
            assert ctx.describe()["overlap"]["buckets_reduced_early_last_step"] > 0
        owned = ctx.registered()
        for r, m in enumerate(models):
            for name, p in m.named_parameters():
                assert p.grad is owned[name + ":grad"][r], "the registered gradient is p.grad again"
        reg.register_optimizer_state()
        ctx.average("computed")
    reference(model, data, steps)
    for name, p in model.named_parameters():
        for r in range(N):
            q = dict(models[r].named_parameters())[name]
            assert torch.allclose(q, p, rtol=1e-5, atol=1e-6), (name, r, (q - p).abs().max())
            assert torch.equal(q, dict(models[0].named_parameters())[name]), "replicas bytewise equal"
    for name, b in models[0].named_buffers():
        for r in range(1, N):
            assert torch.equal(b, dict(models[r].named_buffers())[name]), name


def test_zero_grad_set_to_none_is_restored_before_the_step():
    _, models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        dt.register_modules(ctx, models)
        owned = [m.fc1.weight.grad for m in models]
        x = torch.randn(4, 6)
        for r, m in enumerate(models):
            m.zero_grad(set_to_none=True)  # frees nothing dpsync holds: the context keeps it
            assert m.fc1.weight.grad is None
            if r != 1:  # replica 1 runs no backward this step
                m(x * (r + 1)).sum().backward()
        new = models[0].fc1.weight.grad.clone()
        assert models[0].fc1.weight.grad is not owned[0]
        ctx.allreduce_grads("sum")
        for r, m in enumerate(models):
            assert m.fc1.weight.grad is owned[r]
            assert m.unused.weight.grad is not None and not m.unused.weight.grad.any()
        expected = sum(torch.autograd.grad(models[0](x * (r + 1)).sum(), models[0].fc1.weight)[0] for r in (0, 2, 3))
        assert torch.allclose(owned[0], expected, rtol=1e-5, atol=1e-5)
        assert not torch.equal(owned[0], new), "the other replicas' gradients were added"


def test_mismatched_modules_register_nothing():
    _, models = replicas()
    models[2] = torch.nn.Linear(6, 8)
    with dpsync.Context(host_replicas=N) as ctx:
        with pytest.raises(dpsync.InvalidArgument, match="replica 2"):
            dt.register_modules(ctx, models)
        assert ctx.registered() == {} and ctx.describe()["tensors"] == 0
        assert all(p.grad is None for m in models for p in m.parameters())
        with pytest.raises(dpsync.InvalidArgument, match="3 modules for 4 replicas"):
            dt.register_modules(ctx, models[:3])


def test_a_refused_tensor_registers_nothing():
    _, models = replicas()
    models[3].fc2.weight.data = models[3].fc2.weight.data.t().contiguous().t()  # same shape, not contiguous
    with dpsync.Context(host_replicas=N) as ctx:
        with pytest.raises(dpsync.InvalidArgument, match="'fc2.weight' on replica 3 is not contiguous"):
            dt.register_modules(ctx, models)
        assert ctx.describe()["tensors"] == 0 and ctx.registered() == {}


def test_a_library_failure_rolls_back():
    _, models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        other = torch.zeros(3)
        ctx.register("bn.running_mean", other, "computed", 0)  # taken: CONFLICT on replica 0
        with pytest.raises(dpsync.Conflict):
            dt.register_modules(ctx, models)
        assert list(ctx.registered()) == ["bn.running_mean"], "only the caller's own registration is left"


def test_optimizer_state_registration_and_reload():
    _, models = replicas()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    with dpsync.Context(host_replicas=N) as ctx:
        reg = dt.register_modules(ctx, models, optimizers=opts)
        assert reg.names["state"] == ["bn.num_batches_tracked"], "no optimizer state before the first step"
        x = torch.randn(4, 6)
        for m in models:
            m(x).sum().backward()
        ctx.allreduce_grads()
        for o in opts:
            o.step()
        new = reg.register_optimizer_state()
        assert "fc1.weight:momentum_buffer" in new and "unused.weight:momentum_buffer" in new
        assert reg.register_optimizer_state() == [], "already registered"
        with torch.no_grad():
            opts[1].state[models[1].fc1.weight]["momentum_buffer"].add_(1.0)
        ctx.broadcast("state", root=0)
        assert torch.equal(opts[1].state[models[1].fc1.weight]["momentum_buffer"],
                           opts[0].state[models[0].fc1.weight]["momentum_buffer"])
        # load_state_dict replaces the state tensors: registering again follows them.
        for o in opts:
            o.load_state_dict(copy.deepcopy(opts[0].state_dict()))
        assert "fc1.weight:momentum_buffer" in reg.register_optimizer_state()
        buf = opts[2].state[models[2].fc1.weight]["momentum_buffer"]
        assert ctx.registered()["fc1.weight:momentum_buffer"][2] is buf


def test_remove_unregisters_and_unhooks():
    _, models = replicas()
    with dpsync.Context(host_replicas=N) as ctx:
        reg = dt.register_modules(ctx, models, overlap=True)
        reg.remove()
        assert ctx.registered() == {} and ctx.describe()["tensors"] == 0
        for m in models:  # no hook calls grad_ready on a name that is gone (that would raise)
            m(torch.randn(4, 6)).sum().backward()
        ctx.allreduce_grads()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes(dtype):
    _, models = replicas(dtype)
    with dpsync.Context(host_replicas=N) as ctx:
        dt.register_modules(ctx, models)
        for r, m in enumerate(models):
            m.fc2.bias.grad.fill_(r + 1)
        ctx.allreduce_grads("avg")
        assert ctx.describe()["buckets"][0]["dtype"] == {torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
        for m in models:
            assert (m.fc2.bias.grad == 2.5).all()


def test_grad_hook_kind_matches_the_torch_version():
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert dt.HAS_POST_ACCUMULATE_GRAD_HOOK == ((major, minor) >= (2, 1))
