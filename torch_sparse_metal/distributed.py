"""``torch.distributed`` support: topology updates that agree on every rank, and a DDP wrapper that follows them.

The rule: **rank 0 of the process group decides every topology change and broadcasts it.** Under
``DistributedDataParallel`` the weights are the same on every rank, but SET draws random edges and RigL ranks
the dense gradient of each rank's own batch, so an update decided per rank would split the model. With
torch.distributed initialised, :class:`~torch_sparse_metal.evolve.DynamicSparsity` therefore

- sums RigL's dense gradient over the ranks (chunk by chunk, as it is formed) before ranking it,
- lets rank 0 plan the update (its generator draws SET's edges; its weights rank the magnitudes),
- broadcasts rank 0's plan (the new edge keys and the edge map, int64 on the layers' device) and applies it on
  every rank, carrying weights and optimizer state as in one process,
- takes rank 0's ``progress`` at update steps of runs budgeted in time (clocks differ between ranks).

DDP registers its gradient hooks and buckets on the parameters it saw at construction, with their sizes; an
update that changes a layer's edge count breaks them. :func:`rewrap` builds a new DDP wrapper after an update
(call it whenever ``DynamicSparsity.step()`` returns True); a forward through a layer whose topology changed
since the last :func:`rewrap` raises instead of failing inside autograd.

Example (the same code runs in one process, with torch.distributed uninitialised):
    >>> import torch
    >>> from torch_sparse_metal import SparseLinear
    >>> from torch_sparse_metal.evolve import DynamicSparsity
    >>> net = SparseLinear(16, 8, density=0.25)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> model = wrap(net)  # DistributedDataParallel(net) when torch.distributed is initialised
    >>> evo = DynamicSparsity(net, opt, prune_every=2, total_steps=4)
    >>> for _ in range(2):
    ...     model(torch.randn(4, 16)).square().mean().backward()
    ...     opt.step(); opt.zero_grad()
    ...     if evo.step():
    ...         model = rewrap(model)
    >>> is_main_process()
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .nn import SparseLinear
from .topology import EdgeMap

__all__ = ["LOCAL", "TopologySync", "is_main_process", "resolve_sync", "rewrap", "wrap"]

#: ``DynamicSparsity(..., process_group=LOCAL)``: update this process's layers alone, even under torch.distributed.
LOCAL = "local"

_KWARGS = "_tsm_ddp_kwargs"  # the DDP constructor arguments wrap() used, kept on the wrapper for rewrap()
_STALE = "_tsm_topology_changed"  # set on a layer by an update, cleared by rewrap()


def _initialised() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main_process(process_group=None) -> bool:
    """True on rank 0 of ``process_group`` (default: the world), and in a process without torch.distributed.

    Save checkpoints where this is True: every rank holds the same weights, topology and optimizer state.

    Example:
        >>> is_main_process()
        True
    """
    return not _initialised() or torch.distributed.get_rank(process_group) == 0


class TopologySync:
    """The collectives a topology update needs, over one process group of two or more ranks.

    Failures (a rank that died, a timeout of the process group) are re-raised as ``RuntimeError`` naming the
    update and this rank; the process group's ``timeout`` bounds every wait.
    """

    def __init__(self, group) -> None:
        dist = torch.distributed
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process_group given to DynamicSparsity")
        self.world = dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0)  # broadcast() takes the source as a global rank

    @property
    def is_root(self) -> bool:
        """True on the rank that decides (rank 0 of the group)."""
        return self.rank == 0

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo's and NCCL's failures (DistBackendError included) are RuntimeErrors
            raise RuntimeError(
                f"torch_sparse_metal: {what} failed on rank {self.rank} of {self.world}: another rank died or "
                f"stopped answering within the process group's timeout ({type(exc).__name__}: {exc})") from exc

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (RigL's dense gradient, one chunk at a time)."""
        with self.collective("summing RigL's dense gradient"):
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast_float(self, value: float, device: torch.device, what: str) -> float:
        """Rank 0's ``value``."""
        t = torch.tensor([value], dtype=torch.float64, device=device)
        with self.collective(what):
            torch.distributed.broadcast(t, src=self.root, group=self.group)
        return float(t.item())

    def share_plans(self, layers: list[SparseLinear], plans: list | None, changes: list[tuple[int, int]],
                    what: str) -> list:
        """Rank 0's ``(CSRTopology, EdgeMap)`` plans on every rank.

        ``plans`` is rank 0's list (None elsewhere); ``changes`` the ``(drop, grow)`` of each layer, the same on
        every rank (from the schedule), which fixes every message size. Each rank also checks that its layers
        held rank 0's topology before the update: a plan applied to other edges would scramble the weights.
        """

        device = layers[0].weight.device
        olds = [layer.topology.edge_keys() for layer in layers]
        sizes = [(layer.nnz, layer.nnz - drop + grow, grow) for layer, (drop, grow) in zip(layers, changes)]
        if plans is not None:
            parts = [t for old, (planned, edge_map) in zip(olds, plans)
                     for t in (old, planned.edge_keys(), edge_map.old_to_new.long(), edge_map.grown.long())]
            packet = torch.cat([t.to(device) for t in parts])
        else:
            packet = torch.empty(sum(2 * old + new + grow for old, new, grow in sizes), dtype=torch.int64,
                                 device=device)
        with self.collective(what):
            torch.distributed.broadcast(packet, src=self.root, group=self.group)
        mismatch = torch.zeros(1, dtype=torch.int64, device=device)
        shared = []
        pieces = packet.split([n for old, new, grow in sizes for n in (old, new, old, grow)])
        for i, (layer, mine) in enumerate(zip(layers, olds)):
            old_keys, new_keys, old_to_new, grown = pieces[4 * i:4 * i + 4]
            mismatch += int(not torch.equal(old_keys, mine))
            if plans is not None:
                shared.append(plans[i])
                continue
            topo = layer.topology
            out_f = max(topo.out_features, 1)
            planned = type(topo)._derive(topo.in_features, topo.out_features, new_keys // out_f, new_keys % out_f,
                                         topo.block)
            shared.append((planned, EdgeMap(old_to_new.clone(), grown.clone())))
        with self.collective(what):
            torch.distributed.all_reduce(mismatch, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if int(mismatch.item()):
            raise RuntimeError(
                f"torch_sparse_metal: {what}: the ranks' layers did not hold the same topology before the update. "
                "Build the model with the same topology on every rank, or let DistributedDataParallel broadcast "
                "rank 0's buffers at construction (its default; not with broadcast_buffers=False)")
        return shared

    def guard(self, layers: Iterable[SparseLinear]) -> list:
        """Forward pre-hooks that stop a training forward through a layer changed since the last :func:`rewrap`."""
        return [layer.register_forward_pre_hook(_check_not_stale) for layer in layers]


def mark_changed(layers: Iterable[SparseLinear]) -> None:
    """Flag ``layers`` as changed by an update, until :func:`rewrap` builds the DDP wrapper again."""
    for layer in layers:
        layer.__dict__[_STALE] = True


def _check_not_stale(layer: SparseLinear, args) -> None:
    if layer.__dict__.get(_STALE) and torch.is_grad_enabled():
        raise RuntimeError(
            "this SparseLinear's topology changed in a distributed DynamicSparsity update, and the "
            "DistributedDataParallel wrapper still holds its old parameter sizes: after every update that "
            "DynamicSparsity.step() reports (it returns True), rebuild it with "
            "model = torch_sparse_metal.distributed.rewrap(model)")


def resolve_sync(process_group=None) -> TopologySync | None:
    """The collectives for ``process_group`` (None: the world group when torch.distributed is initialised); None
    when there is nothing to agree on (not initialised, a single rank, or :data:`LOCAL`)."""
    if isinstance(process_group, str):
        if process_group != LOCAL:
            raise ValueError(f"process_group must be a ProcessGroup, None or {LOCAL!r}, got {process_group!r}")
        return None
    if not _initialised():
        if process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        return None
    group = process_group if process_group is not None else torch.distributed.group.WORLD
    if torch.distributed.get_world_size(group) == 1:
        return None
    return TopologySync(group)


def wrap(module: nn.Module, **ddp_kwargs) -> nn.Module:
    """``DistributedDataParallel(module, **ddp_kwargs)`` when torch.distributed is initialised, else ``module``.

    The wrapper remembers ``ddp_kwargs``, so :func:`rewrap` rebuilds it the same way after a topology update.

    Example:
        >>> wrap(SparseLinear(8, 4)).__class__.__name__  # torch.distributed not initialised here
        'SparseLinear'
    """
    if not _initialised():
        return module
    ddp = nn.parallel.DistributedDataParallel(module, **ddp_kwargs)
    ddp.__dict__[_KWARGS] = dict(ddp_kwargs)
    return ddp


def rewrap(model: nn.Module, **ddp_kwargs) -> nn.Module:
    """A new ``DistributedDataParallel`` over ``model.module`` after a topology update; ``model`` otherwise.

    DDP cannot follow a parameter whose size changed: its reducer keeps each parameter's gradient accumulator
    (with the old shape) and buckets sized at construction. This releases the old reducer, then builds a new
    wrapper with the arguments :func:`wrap` was given (``ddp_kwargs`` override them; a wrapper built directly
    with ``DistributedDataParallel(...)`` needs its arguments here). Construction broadcasts rank 0's
    parameters and buffers and checks their shapes across ranks. The old wrapper must not be used again.

    Example:
        >>> layer = SparseLinear(8, 4)
        >>> rewrap(layer) is layer  # not a DDP wrapper: nothing to rebuild
        True
    """
    ddp_cls = nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp_cls):
        _clear_stale(model)
        return model
    kwargs = model.__dict__.get(_KWARGS)
    if kwargs is None and not ddp_kwargs:
        raise TypeError("rewrap cannot recover the arguments of a DistributedDataParallel built directly: build it "
                        "with torch_sparse_metal.distributed.wrap(module, **kwargs), or pass them: "
                        "rewrap(model, device_ids=[...], ...)")
    kwargs = {**(kwargs or {}), **ddp_kwargs}
    module = model.module
    # The reducer (and the logger, which holds it) keep the old gradient accumulators alive; a new wrapper built
    # while they live would pick them up, stale shapes included.
    for name in ("logger", "reducer"):
        if name in model.__dict__:
            delattr(model, name)
    model.register_forward_pre_hook(_replaced)
    _clear_stale(module)
    ddp = ddp_cls(module, **kwargs)
    ddp.__dict__[_KWARGS] = kwargs
    return ddp


def _clear_stale(module: nn.Module) -> None:
    for m in module.modules():
        m.__dict__.pop(_STALE, None)


def _replaced(module: nn.Module, args) -> None:
    raise RuntimeError("this DistributedDataParallel wrapper was replaced by rewrap(); use the one it returned")
