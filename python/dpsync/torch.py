"""dpsync.torch: registers the PyTorch modules (and optimizer state) of every replica.

Names: a parameter is registered as its ``named_parameters()`` name (``"conv1.weight"``), its
gradient as ``"conv1.weight:grad"``, a buffer as its ``named_buffers()`` name, optimizer state
as ``"conv1.weight:momentum_buffer"`` (``prefix`` goes in front of each).

Roles: parameters PARAM; gradients GRAD; floating-point buffers (batch-norm running statistics)
COMPUTED; integer buffers (``num_batches_tracked``) STATE, like the optimizer state: a counter
that every replica advances alike, which a broadcast sets and which an integer average would
truncate.

Gradients and ``zero_grad``: dpsync reduces the gradient tensors it registered. PyTorch >= 2.0's
``zero_grad()`` sets ``p.grad = None``, and backward then allocates a new tensor. The
registration keeps the registered tensors alive (the library never sees freed memory) and puts
them back: before every ``ctx.allreduce_grads`` (and, with ``overlap=True``, as each gradient is
accumulated) a gradient that is None is replaced by the registered tensor zeroed, and a new
gradient tensor is copied into the registered one, which becomes ``p.grad`` again.
``zero_grad(set_to_none=False)`` avoids that copy. See python/README.md, "dpsync.torch".

Sharded optimizer state (ZeRO stage 1): ``ShardedOptimizer`` gives each replica's optimizer
only the pieces of the parameters that the replica owns (``ctx.shard``), so that its state
(Adam's moments, SGD's momentum) takes about 1 / (replicas in the world) of the memory; its
``step()`` is ``ctx.reduce_scatter_grads``, each replica's optimizer step on its pieces, then
``ctx.allgather("param")``.

Ranks that are lost or leave (``Context(..., world_mpi=..., elastic=min_ranks)``, docs/API.md,
"Elastic worlds"): in an elastic world, the collective that a lost rank interrupts raises
``dpsync.RankLost`` on every survivor (``e.ranks``: the lost ranks, by their numbers before the
loss). The world goes on without them, renumbered and recounted (``ctx.rank``, ``ctx.ranks``,
``ctx.loss_scale``, ``ctx.world_epoch``); the gradients of that call hold unspecified values,
and parameters, buffers and optimizer state keep their bytes. So a step that raised it is
done again: zero the gradients, compute them again, and call again::

    for batch in batches:
        while True:
            opt.zero_grad()
            try:
                # With overlap=True, backward's grad_ready calls may raise it too.
                loss_fn(model(batch)).backward()
                ctx.allreduce_grads("avg")
                break
            except dpsync.RankLost as e:
                print("lost ranks %s; now %d ranks" % (e.ranks, ctx.ranks))
        opt.step()

With ``ShardedOptimizer`` the pieces are cut anew for the new number of replicas: make the
optimizer again (its state for pieces a replica did not own before is yours to restore or
restart). Below ``min_ranks`` the context is failed instead (InvalidState afterwards).

Uneven inputs: a rank whose data ran out calls ``ctx.leave()`` where it would have made its
next collective (instead of ``allreduce_grads``), and stops training; the other ranks' next
collective completes over the remaining replicas, and they go on renumbered. This works in
every world, elastic or not::

    for step in range(max_steps):
        batch = next(my_batches, None)
        if batch is None:
            ctx.leave()  # this rank's data ran out
            break
        opt.zero_grad()
        loss_fn(model(batch)).backward()
        ctx.allreduce_grads("avg")
        opt.step()
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._context import Context, HookHandle, _op
from ._errors import Error, InvalidArgument, InvalidState, NotFound

# torch >= 2.1 calls this hook after the gradient is accumulated into p.grad; older versions
# get the same moment from a hook on the parameter's AccumulateGrad node (as DDP did). A hook
# on the parameter itself (Tensor.register_hook) runs before accumulation, too early.
HAS_POST_ACCUMULATE_GRAD_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")

_SYNCED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


class ModuleRegistration:
    """What register_modules registered: ``names`` by role, ``skipped`` (buffers and state
    of dtypes dpsync has no type for, left out), and the hooks. ``remove()`` undoes it."""

    def __init__(self, ctx: Context, modules: List[torch.nn.Module], optimizers: Optional[List[Any]], prefix: str) -> None:
        self.ctx = ctx
        self.modules = modules
        self.optimizers = optimizers
        self.prefix = prefix
        self.names: Dict[str, List[str]] = {"param": [], "grad": [], "computed": [], "state": []}
        self.skipped: List[str] = []
        self._grads: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, registered gradient)
        self._param_names: List[Dict[int, str]] = []  # per replica: id(parameter) -> name
        self._state: Dict[str, List[torch.Tensor]] = {}  # optimizer state name -> per replica tensor
        self._hooks: List[Any] = []
        self._grad_accs: List[Any] = []  # AccumulateGrad nodes whose hooks must stay alive
        self._pre_step: Optional[HookHandle] = None

    def restore_grads(self) -> None:
        """Make every registered gradient ``p.grad`` again (module docstring). Runs before
        each ``ctx.allreduce_grads``; call it yourself before calling the C library directly."""
        for p, owned in self._grads:
            if p.grad is not owned:
                _put_back(p, owned)

    def register_optimizer_state(self) -> List[str]:
        """Register the optimizers' state tensors that exist now as STATE (optimizers create
        theirs at the first step: call this after it, and after ``load_state_dict``, which
        replaces them). Returns the names registered by this call."""
        if not self.optimizers:
            return []
        per_replica = [self._optimizer_state(r, opt) for r, opt in enumerate(self.optimizers)]
        names = [name for name, _ in per_replica[0]]
        for r, entries in enumerate(per_replica[1:], 1):
            other = [name for name, _ in entries]
            if other != names:
                missing = sorted(set(names) ^ set(other))
                raise InvalidArgument(
                    "optimizer state differs between replica 0 and replica %d (%s): step every "
                    "replica's optimizer before registering its state" % (r, ", ".join(missing[:5]))
                )
        new: List[str] = []
        for i, name in enumerate(names):
            tensors = [entries[i][1] for entries in per_replica]
            old = self._state.get(name)
            if old is not None and all(a is b for a, b in zip(old, tensors)):
                continue
            if old is not None:  # replaced (load_state_dict): register the new tensors instead
                self.ctx.unregister(name)
                del self._state[name]
            _register_all(self.ctx, [(name, tensors, "state")])
            self._state[name] = tensors
            if name not in self.names["state"]:
                self.names["state"].append(name)
            new.append(name)
        return new

    def _optimizer_state(self, replica: int, optimizer: Any) -> List[Tuple[str, torch.Tensor]]:
        out = []
        names = self._param_names[replica]
        for group in optimizer.param_groups:
            for p in group["params"]:
                pname = names.get(id(p))
                state = optimizer.state.get(p)
                if pname is None or not state:
                    continue
                for key in sorted(state):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        continue
                    name = "%s%s:%s" % (self.prefix, pname, key)
                    if value.dtype not in _SYNCED_DTYPES or value.numel() == 0:
                        if replica == 0 and name not in self.skipped:
                            self.skipped.append(name)
                        continue
                    out.append((name, value))
        return out

    def remove(self) -> None:
        """Remove the hooks and unregister every name registered here."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._grad_accs.clear()
        if self._pre_step is not None:
            self._pre_step.remove()
            self._pre_step = None
        if not self.ctx.closed:
            for names in self.names.values():
                for name in names:
                    try:
                        self.ctx.unregister(name)
                    except NotFound:
                        pass
        self._grads.clear()
        self._state.clear()


def _put_back(p: torch.Tensor, owned: torch.Tensor) -> None:
    """p.grad := the registered tensor, holding p.grad's values (zeros if there is none)."""
    g = p.grad
    with torch.no_grad():
        if g is None:
            owned.zero_()
        elif g.data_ptr() != owned.data_ptr():
            owned.copy_(g)
    p.grad = owned


def _register_all(ctx: Context, entries: Sequence[Tuple[str, Sequence[torch.Tensor], str]]) -> None:
    """Register (name, per-replica tensors, role) entries; every tensor is checked before the
    first registration, and a failure unregisters the names this call added."""
    for name, tensors, _ in entries:
        for r, t in enumerate(tensors):
            ctx._array(t, "tensor %r on replica %d" % (name, r), writable=True)
    before = set(ctx._dense)
    try:
        for name, tensors, role in entries:
            for r, t in enumerate(tensors):
                ctx.register(name, t, role, r)
    except Error:
        for name, _, _ in entries:
            if name not in before and name in ctx._dense:
                ctx.unregister(name)
        raise


def register_modules(
    ctx: Context,
    modules: Sequence[torch.nn.Module],
    *,
    optimizers: Optional[Sequence[Any]] = None,
    overlap: bool = False,
    prefix: str = "",
) -> ModuleRegistration:
    """Register one module per replica (same architecture, e.g. ``copy.deepcopy``): parameters,
    their gradients (allocated as zeros where ``p.grad`` is None), buffers and, with
    ``optimizers`` (one per replica), the optimizer state that exists now, in the modules'
    parameter order (their forward order for sequential models: gradients are reduced last
    first). ``overlap=True`` calls ``ctx.grad_ready`` as each parameter's gradient is
    accumulated during backward (one backward per replica per step). Nothing is registered or
    changed if any tensor is refused.
    """
    modules = list(modules)
    n = ctx.replica_count
    if len(modules) != n:
        raise InvalidArgument("%d modules for %d replicas: pass one module per replica" % (len(modules), n))
    if optimizers is not None:
        optimizers = list(optimizers)
        if len(optimizers) != n:
            raise InvalidArgument("%d optimizers for %d replicas: pass one optimizer per replica" % (len(optimizers), n))
    reg = ModuleRegistration(ctx, modules, optimizers, prefix)
    params = [list(m.named_parameters()) for m in modules]
    buffers = [list(m.named_buffers()) for m in modules]
    for r in range(1, n):
        _same_layout(params[0], params[r], r, "parameters")
        _same_layout(buffers[0], buffers[r], r, "buffers")
    reg._param_names = [{id(p): name for name, p in replica} for replica in params]

    entries: List[Tuple[str, Sequence[torch.Tensor], str]] = []
    new_grads: List[Tuple[torch.Tensor, torch.Tensor]] = []
    grads: List[Tuple[str, List[Tuple[torch.Tensor, torch.Tensor]]]] = []
    for i, (name, _) in enumerate(params[0]):
        ps = [params[r][i][1] for r in range(n)]
        entries.append((prefix + name, ps, "param"))
        if not ps[0].requires_grad:
            continue
        pairs = []
        for p in ps:
            owned = p.grad
            if owned is None:
                owned = torch.zeros_like(p, memory_format=torch.contiguous_format)
                new_grads.append((p, owned))
            pairs.append((p, owned))
        gname = "%s%s:grad" % (prefix, name)
        entries.append((gname, [g for _, g in pairs], "grad"))
        grads.append((gname, pairs))
    for i, (name, b) in enumerate(buffers[0]):
        if b.dtype not in _SYNCED_DTYPES or b.numel() == 0:
            reg.skipped.append(prefix + name)
            continue
        role = "computed" if b.is_floating_point() else "state"
        entries.append((prefix + name, [buffers[r][i][1] for r in range(n)], role))

    _register_all(ctx, entries)
    for name, _, role in entries:
        reg.names[role].append(name)
    for p, owned in new_grads:
        p.grad = owned
    reg._grads = [pair for _, pairs in grads for pair in pairs]
    reg._pre_step = ctx.add_pre_allreduce_grads_hook(reg.restore_grads)
    if overlap:
        for gname, pairs in grads:
            for r, (p, owned) in enumerate(pairs):
                _add_ready_hook(reg, p, owned, gname, r)
    if optimizers is not None:
        try:
            reg.register_optimizer_state()
        except Error:
            reg.remove()
            raise
    return reg


def _same_layout(first: List[Tuple[str, torch.Tensor]], other: List[Tuple[str, torch.Tensor]], r: int, what: str) -> None:
    a = [(name, tuple(t.shape), t.dtype) for name, t in first]
    b = [(name, tuple(t.shape), t.dtype) for name, t in other]
    if a != b:
        diff = next(((x, y) for x, y in zip(a, b) if x != y), None) or ("%d %s" % (len(a), what), "%d %s" % (len(b), what))
        raise InvalidArgument(
            "replica %d's module differs from replica 0's in its %s: %s on replica 0, %s on replica %d"
            % (r, what, diff[0], diff[1], r)
        )


def _add_ready_hook(reg: ModuleRegistration, p: torch.Tensor, owned: torch.Tensor, gname: str, replica: int) -> None:
    ctx = reg.ctx

    def ready(*_: Any) -> None:
        if p.grad is not owned:
            _put_back(p, owned)
        ctx.grad_ready(gname, replica)

    if HAS_POST_ACCUMULATE_GRAD_HOOK:
        reg._hooks.append(p.register_post_accumulate_grad_hook(ready))
    else:
        with torch.enable_grad():
            acc = p.expand_as(p).grad_fn.next_functions[0][0]  # the parameter's AccumulateGrad node
        reg._grad_accs.append(acc)
        reg._hooks.append(acc.register_hook(ready))


def optimizer_state_bytes(optimizer: Any) -> int:
    """The bytes held by the tensors of ``optimizer.state`` (moments, momentum buffers, step
    counters) of a ``torch.optim`` optimizer; a ShardedOptimizer has ``state_bytes()``."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


# torch.optim.Optimizer.zero_grad's own default: set_to_none=True from PyTorch 2.0, False before.
_SET_TO_NONE_DEFAULT = bool(inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default)


class ShardedOptimizer:
    """ZeRO stage 1 (as ``torch.distributed.optim.ZeroRedundancyOptimizer``) over dpsync: one
    ``optimizer_class(pieces, **defaults)`` per replica, given only the pieces of the parameters
    that the replica owns (``ctx.shard``), so that the optimizer state of each replica covers
    about 1 / (replicas in the world) of the elements.

    ``params`` has one entry per replica: a module (its ``parameters()``), an iterable of
    parameters, or an iterable of param group dicts (``{"params": [...], "lr": ...}``), alike on
    every replica. Every parameter must be registered with ``ctx`` on its replica as a PARAM
    (``register_modules``, or ``ctx.register``), and its gradient as a GRAD that is ``p.grad``
    when ``step()`` runs (``register_modules`` sees to that). Register the modules without
    ``optimizers=``: the sharded state differs from replica to replica.

    A piece is a flat view of the owned elements, ``p.detach().view(-1)[offset:offset + count]``
    wrapped as a leaf ``torch.nn.Parameter`` that shares the parameter's storage, and its
    gradient the same view of ``p.grad``: the optimizer updates the parameter's memory in place.
    Empty pieces (a tensor with fewer elements than there are replicas) are left out. Param
    groups keep their order and options on every replica (a group may hold no piece), so
    ``optimizers[r].param_groups[i]`` is group i and learning-rate schedulers work on each.

    ``step()`` is ``ctx.reduce_scatter_grads(op)``, then each replica's optimizer step on its
    pieces, then ``ctx.allgather("param")`` (every PARAM registered with ``ctx``): every replica
    ends with the parameters that ``ctx.allreduce_grads(op)`` and the whole optimizer give, byte
    for byte in one process, as long as the optimizer's update is elementwise (SGD, Adam,
    AdamW, RMSprop, ...; not LAMB-like per-tensor norms, nor an optimizer that needs a
    closure). With ``register_modules(..., overlap=True)`` the buckets backward finishes are
    reduce-scattered while it runs, from the second step on (they follow the previous step's
    call: dpsync_reduce_scatter_grads in include/dpsync.h).
    """

    def __init__(
        self, ctx: Context, params: Sequence[Any], optimizer_class: Any, *, op: str = "avg", **defaults: Any
    ) -> None:
        n = ctx.replica_count
        per_replica = list(params)
        if len(per_replica) != n:
            raise InvalidArgument(
                "%d parameter lists for %d replicas: pass one per replica (a module, its parameters() or "
                "param groups)" % (len(per_replica), n)
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise InvalidArgument("optimizer_class is %r: pass a torch.optim.Optimizer subclass, such as "
                                  "torch.optim.Adam" % (optimizer_class,))
        _op(op)
        self.ctx = ctx
        self.op = op
        groups = [_param_groups(p, r) for r, p in enumerate(per_replica)]
        registered = ctx.registered()
        names_by_id: List[Dict[int, str]] = [{} for _ in range(n)]
        for name, by_replica in registered.items():
            for r, kept in by_replica.items():
                if r < n:
                    names_by_id[r][id(kept)] = name
        names = [[[_registered_name(names_by_id[r], p, r, g, i) for i, p in enumerate(group["params"])]
                  for g, group in enumerate(groups[r])] for r in range(n)]
        for r in range(1, n):
            if names[r] != names[0]:
                a, b = _flat(names[0]), _flat(names[r])
                diff = next(((x, y) for x, y in zip(a, b) if x != y), None)
                if diff is None:
                    diff = ("%d parameters in %d groups" % (len(a), len(names[0])),
                            "%d parameters in %d groups" % (len(b), len(names[r])))
                raise InvalidArgument("replica %d's parameters differ from replica 0's: %s on replica 0, %s on "
                                      "replica %d (pass the same parameters in the same groups on every replica)"
                                      % (r, diff[0], diff[1], r))
        # Per replica: (parameter, piece, offset, count, storage address) of each non-empty piece.
        self._pieces: List[List[Tuple[torch.Tensor, torch.Tensor, int, int, int]]] = []
        self._params: List[List[torch.Tensor]] = []
        self.pieces: List[List[Tuple[str, int, int]]] = []
        self.optimizers: List[Any] = []
        for r in range(n):
            owned: List[Tuple[torch.Tensor, torch.Tensor, int, int, int]] = []
            shards: List[Tuple[str, int, int]] = []
            opt_groups = []
            for g, group in enumerate(groups[r]):
                pieces = []
                for i, p in enumerate(group["params"]):
                    name = names[r][g][i]
                    offset, count = ctx.shard(name, r)
                    shards.append((name, offset, count))
                    if count == 0:
                        continue
                    view = p.detach().view(-1)[offset:offset + count]
                    piece = torch.nn.Parameter(view, requires_grad=p.requires_grad)
                    owned.append((p, piece, offset, count, p.data_ptr()))
                    pieces.append(piece)
                opt_groups.append(dict(group, params=pieces))
            self._pieces.append(owned)
            self._params.append([p for group in groups[r] for p in group["params"]])
            self.pieces.append(shards)
            self.optimizers.append(optimizer_class(opt_groups, **defaults))

    def step(self) -> None:
        """``ctx.reduce_scatter_grads(op)``, every replica's optimizer step on the pieces it
        owns, ``ctx.allgather("param")``."""
        for r, owned in enumerate(self._pieces):
            for p, _, _, _, address in owned:
                if p.data_ptr() != address:
                    raise InvalidState(
                        "a parameter of replica %d has new memory (p.data was replaced, or the module moved): "
                        "its registration and the optimizer's views no longer see it; build the registration "
                        "and the ShardedOptimizer again" % r
                    )
        self.ctx.reduce_scatter_grads(self.op)
        for optimizer, owned in zip(self.optimizers, self._pieces):
            for p, piece, offset, count, _ in owned:
                g = p.grad
                piece.grad = None if g is None else g.reshape(-1)[offset:offset + count]
            try:
                optimizer.step()
            finally:
                for _, piece, _, _, _ in owned:
                    piece.grad = None
        self.ctx.allgather("param")

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """The whole gradients of every replica's parameters, as torch.optim.Optimizer.zero_grad
        (``set_to_none`` defaults as there: True from PyTorch 2.0)."""
        if set_to_none is None:
            set_to_none = _SET_TO_NONE_DEFAULT
        for params in self._params:
            for p in params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_bytes(self) -> List[int]:
        """The bytes of optimizer state held for each replica (optimizer_state_bytes)."""
        return [optimizer_state_bytes(o) for o in self.optimizers]

    def state_dict(self) -> List[Dict[str, Any]]:
        """Each replica's optimizer state_dict (of its own pieces)."""
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, state_dicts: Sequence[Dict[str, Any]]) -> None:
        """Load what state_dict returned, one per replica (the same replicas and world)."""
        state_dicts = list(state_dicts)
        if len(state_dicts) != len(self.optimizers):
            raise InvalidArgument("%d state dicts for %d replicas" % (len(state_dicts), len(self.optimizers)))
        for o, sd in zip(self.optimizers, state_dicts):
            o.load_state_dict(sd)


def _param_groups(params: Any, replica: int) -> List[Dict[str, Any]]:
    """`params` of one replica as param group dicts whose "params" are lists of tensors."""
    if isinstance(params, torch.nn.Module):
        return [{"params": list(params.parameters())}]
    if isinstance(params, torch.Tensor):
        raise InvalidArgument("replica %d's parameters are one tensor: pass an iterable of parameters" % replica)
    items = list(params)
    if items and all(isinstance(g, dict) for g in items):
        groups = []
        for g in items:
            if "params" not in g:
                raise InvalidArgument("a param group of replica %d has no \"params\"" % replica)
            ps = g["params"]
            groups.append(dict(g, params=[ps] if isinstance(ps, torch.Tensor) else list(ps)))
        return groups
    if any(not isinstance(p, torch.Tensor) for p in items):
        raise InvalidArgument("replica %d: pass a module, parameters, or param group dicts, not a mix" % replica)
    return [{"params": items}]


def _registered_name(names: Dict[int, str], p: torch.Tensor, replica: int, group: int, index: int) -> str:
    name = names.get(id(p))
    if name is None:
        raise InvalidArgument(
            "parameter %d of group %d on replica %d (shape %s) is not registered with this context on that "
            "replica: register the modules first (register_modules)" % (index, group, replica, tuple(p.shape))
        )
    return name


def _flat(names: List[List[str]]) -> List[str]:
    return [name for group in names for name in group]


__all__ = [
    "HAS_POST_ACCUMULATE_GRAD_HOOK",
    "ModuleRegistration",
    "ShardedOptimizer",
    "optimizer_state_bytes",
    "register_modules",
]
