"""Evolving topology: prune and regrow the edges of ``SparseLinear`` layers while they train.

Sparse-training methods change a layer's connectivity every few hundred steps:

- SET (Mocanu et al., 2018): drop the smallest-magnitude weights, regrow as many edges at random.
- RigL (Evci et al., 2020): drop the smallest-magnitude weights, regrow where the dense weight gradient
  ``|grad_out^T @ x|`` is largest among absent edges. The dense gradient is computed only at update steps,
  in chunks of output rows, so memory stays at ``chunk x in_features``.

A layer of ``block`` V > 1 (vectors of V outputs) drops and grows whole vectors: magnitude and the dense gradient
are the L2 norms over a vector's V lanes, and edge counts move in multiples of V.

An update builds a new topology plus an :class:`EdgeMap` (old edge -> new position). Surviving edges keep their
weight and their optimizer state (AdamW moments, SGD momentum: every per-element state tensor); new edges start
at weight 0 with zero state (RigL's choice: the function the layer computes does not jump). The layer's
``weight`` stays the same ``nn.Parameter`` object, only its data is replaced, so the optimizer's references stay
valid; with ``in_place=True`` an update that keeps the edge count is copied into the existing tensors instead, so
that a captured CUDA graph survives it. Everything runs on the layer's device with output sizes known in advance;
the only host wait of an update is one check that random regrowth found enough free slots.

:class:`DynamicSparsity` owns the schedule: call its :meth:`~DynamicSparsity.step` after ``optimizer.step()``;
between updates it costs one integer comparison and no device work. Under ``torch.distributed`` rank 0 decides
every update and broadcasts it (:mod:`torch_sparse_metal.distributed`).

Example:
    >>> _ = torch.manual_seed(0)
    >>> layer = SparseLinear(32, 16, density=0.25)
    >>> opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    >>> evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=10, drop_fraction=0.3)
    >>> for _ in range(4):
    ...     layer(torch.randn(8, 32)).square().mean().backward()
    ...     opt.step(); opt.zero_grad(); _ = evo.step()
    >>> layer.nnz
    128
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._optimizer_state import mark_remapped
from ._resize import replace_data
from .distributed import mark_changed, resolve_sync
from .fan_in import FanInReport, plan_fan_in_update
from .followers import FollowerCopies
from .nn import SparseLinear
from .ops import check_index_errors
from .topology import (
    CSRTopology,
    EdgeMap,
    check_constant_fan_in,
    check_generator,
    check_rigl_grad,
    element_edge_map,
    updated_topology,
)

__all__ = ["EdgeMap", "DynamicSparsity", "plan_update", "apply_update", "dense_grad_topk"]


# --------------------------------------------------------------------------------------------------- planning
def _smallest(weight: torch.Tensor, count: int, block: int = 1) -> torch.Tensor:
    """Indices of the ``count`` smallest-magnitude weights (vectors of ``block`` weights: by L2 norm)."""
    if count == 0:
        return torch.empty(0, dtype=torch.long, device=weight.device)
    magnitude = weight.detach().view(-1, block).norm(dim=1) if block > 1 else weight.detach().abs()
    return torch.topk(magnitude, count, largest=False, sorted=False).indices


def _random_free(topology: CSRTopology, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` distinct keys of absent edges, uniformly at random (rejection sampling on the device)."""
    device, total = topology.device, topology.in_features * topology.out_features
    existing = topology.edge_keys()
    if count == 0:
        return existing[:0]
    draw = 2 * count + 64
    while True:
        cand = torch.randint(0, total, (draw,), generator=generator, device="cpu").to(device)
        cand = torch.sort(cand).values
        fresh = torch.ones_like(cand, dtype=torch.bool)
        fresh[1:] = cand[1:] != cand[:-1]
        pos = torch.searchsorted(existing, cand).clamp(max=max(existing.numel() - 1, 0))
        if existing.numel():
            fresh &= existing[pos] != cand
        priority = fresh.float() + torch.rand(draw, generator=generator).to(device)  # fresh ones rank above 1
        top = torch.topk(priority, count)
        if bool(top.values.min() >= 1.0):  # the update's one host wait: were there enough free candidates?
            return cand[top.indices]
        draw *= 2


def dense_grad_topk(
    x: torch.Tensor, grad_out: torch.Tensor, topology: CSRTopology, count: int, chunk: int = 256,
    grad_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Keys (``src * out + dst``) of the ``count`` absent edges with the largest ``|grad_out^T @ x|``.

    ``x`` is ``[N, in_features]``, ``grad_out`` ``[N, out_features]``. The dense gradient is formed ``chunk`` output
    rows at a time and only the running top ``count`` is kept. ``grad_reduce`` (if given) combines each chunk of the
    gradient before ranking: under torch.distributed, the sum over the ranks' batches.

    For a topology of ``block`` V > 1 it ranks absent vectors by the L2 norm of the dense gradient over their V
    lanes and returns ``count`` keys of the topology over vectors (``src * groups + group``).
    """
    block = topology.block
    units = topology.vectors if block > 1 else topology  # what is ranked: edges, or vectors
    in_f, out_f = units.in_features, units.out_features
    chunk = max(1, chunk // block)
    device = x.device
    dst, src = units.dst.long(), units.src.long()
    best_val = torch.full((0,), -1.0, device=device)
    best_key = torch.empty(0, dtype=torch.long, device=device)
    x, grad_out = x.to(torch.float32), grad_out.to(torch.float32)
    for o0 in range(0, out_f, chunk):
        rows = min(chunk, out_f - o0)
        grad = grad_out[:, o0 * block:(o0 + rows) * block].t() @ x
        if grad_reduce is not None:
            grad = grad_reduce(grad)
        if block > 1:
            grad = grad.view(rows, block, in_f).norm(dim=1)
        score = grad.abs().reshape(-1)  # [rows * in_f], row-major over (dst, src)
        # Existing edges of this chunk may not be regrown: scatter -1 onto them (others go to a spare slot).
        inside = (dst >= o0) & (dst < o0 + rows)
        slot = torch.where(inside, (dst - o0) * in_f + src, torch.full_like(dst, rows * in_f))
        score = torch.cat([score, score.new_zeros(1)]).index_fill_(0, slot, -1.0)[:-1]
        k = min(count, score.numel())
        top = torch.topk(score, k)
        local = top.indices
        keys = (local % in_f) * out_f + (local // in_f + o0)
        best_val, order = torch.topk(torch.cat([best_val, top.values]), min(count, best_val.numel() + k))
        best_key = torch.cat([best_key, keys])[order]
    return best_key


def plan_update(
    layer: SparseLinear,
    drop: int,
    grow: int,
    *,
    mode: str = "set",
    grad: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    chunk: int = 256,
    grad_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[CSRTopology, EdgeMap]:
    """The topology after dropping the ``drop`` smallest-magnitude edges and growing ``grow`` new ones.

    ``mode="set"`` grows at random; ``mode="rigl"`` grows where the dense gradient is largest and needs
    ``grad=(x, grad_out)`` from a recent step. Edges present before the update are never regrown by it.
    Changes nothing; :func:`apply_update` applies the plan. ``grad_reduce``: see :func:`dense_grad_topk`.

    A layer of ``block`` V > 1 drops the vectors of smallest L2 norm and grows whole vectors (RigL: by the norm of
    their dense gradient); ``drop`` and ``grow`` count edges and must be multiples of V.
    """
    _check_layer(layer)
    topology = layer.topology
    block = topology.block
    total = topology.in_features * topology.out_features
    _check_int("drop", drop, 0)
    _check_int("grow", grow, 0)
    _check_int("chunk", chunk, 1)  # a chunk < 1 would rank no rows and grow nothing
    check_generator(generator)
    if not 0 <= drop <= topology.nnz:
        raise ValueError(f"cannot drop {drop} of {topology.nnz} edges")
    if grow < 0 or topology.nnz - drop + grow > total:
        raise ValueError(f"growing {grow} edges after dropping {drop} would exceed the {total} possible "
                         f"connections of a {topology.out_features}x{topology.in_features} layer")
    if grow > total - topology.nnz:
        raise ValueError(f"only {total - topology.nnz} absent connections exist, cannot grow {grow} new ones")
    if drop % block or grow % block:
        raise ValueError(f"the layer has block={block}: it drops and grows whole vectors, so drop ({drop}) and grow "
                         f"({grow}) must be multiples of {block}")
    units = topology.vectors if block > 1 else topology  # what is dropped and grown: edges, or vectors
    if mode == "rigl":
        if grad is None:
            raise RuntimeError("RigL regrowth needs the layer's input and output gradient from a training step; "
                               "run forward and backward with DynamicSparsity attached before the update step")
        check_rigl_grad(grad, topology)
        new_keys = dense_grad_topk(*grad, topology, grow // block, chunk, grad_reduce) if grow \
            else units.edge_keys()[:0]
    elif mode == "set":
        new_keys = _random_free(units, grow // block, generator)
    else:
        raise ValueError(f"mode must be 'set' or 'rigl', got {mode!r}")

    drop //= block
    dropped = torch.zeros(units.nnz, dtype=torch.bool, device=topology.device)
    dropped[_smallest(layer.weight, drop, block)] = True
    kept_idx = torch.argsort(dropped.to(torch.uint8), stable=True)[: units.nnz - drop]  # size known: no sync
    new_units, edge_map = updated_topology(units, kept_idx, new_keys)
    if block == 1:
        return new_units, edge_map
    return CSRTopology.from_vectors(new_units, block), element_edge_map(edge_map, block)


# --------------------------------------------------------------------------------------------------- applying
def _check_plan(layer: SparseLinear, topology: CSRTopology, edge_map: EdgeMap) -> None:
    """A plan fits ``layer``: same shape, and an edge map that sends every kept old edge to its own new edge and
    accounts for every new edge exactly once (kept or grown). Reads the map on the host: updates are rare."""
    _check_layer(layer)
    if not isinstance(topology, CSRTopology) or not isinstance(edge_map, EdgeMap):
        raise TypeError("apply_update takes the (CSRTopology, EdgeMap) pair that plan_update returns")
    if (topology.in_features, topology.out_features) != (layer.in_features, layer.out_features):
        raise ValueError(f"the plan is for a {topology.in_features} -> {topology.out_features} layer, this layer is "
                         f"{layer.in_features} -> {layer.out_features}")
    if topology.block != layer.block:
        raise ValueError(f"the plan's topology has block {topology.block}, the layer block {layer.block}")
    if layer.constant_fan_in:  # the layer keeps the property: a plan that breaks it is refused
        check_constant_fan_in(topology, "the plan's topology for a constant fan-in layer")
    for name in ("old_to_new", "grown"):
        t = getattr(edge_map, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"edge map's {name} must be a 1-D int64 or int32 tensor, got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} "
                            f"{getattr(t, 'dtype', '')}".rstrip())
    topology.validate()  # a topology built by hand (not by plan_update) could hold any index values
    old, new = layer.weight.shape[0], topology.nnz
    old_to_new, grown = edge_map.old_to_new.long().cpu(), edge_map.grown.long().cpu()
    if old_to_new.shape != (old,):
        raise ValueError(f"edge map covers {old_to_new.numel()} edges but the layer has {old}")
    targets = torch.cat([old_to_new[old_to_new >= 0], grown])
    if bool((old_to_new < -1).any()) or bool((targets >= new).any()) or bool((targets < 0).any()):
        raise ValueError(f"edge map has indices outside -1 .. {new - 1} (the new topology has {new} edges)")
    if targets.numel() != new or torch.unique(targets).numel() != new:
        raise ValueError(f"edge map must send kept and grown edges to each of the {new} new edges exactly once "
                         f"(it names {targets.numel()} targets, {torch.unique(targets).numel()} distinct)")


def _remap(values: torch.Tensor, edge_map: EdgeMap, size: int, fill: float = 0.0) -> torch.Tensor:
    out = values.new_full((size,), fill)
    kept = edge_map.kept
    out[edge_map.old_to_new[kept]] = values[kept]
    return out


def apply_update(
    layer: SparseLinear,
    topology: CSRTopology,
    edge_map: EdgeMap,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    *,
    in_place: bool = False,
) -> bool:
    """Give ``layer`` the new topology; carry weights and every per-edge optimizer state tensor across.

    Surviving edges keep their values exactly; grown edges start at 0 with zero state. ``layer.weight`` stays the
    same Parameter, so optimizers keep their references; its ``.grad``, a gradient of the old edges, is dropped.
    Give every optimizer that holds the weight: afterwards a step of any other one that holds per-edge state of it
    (still on the old edge order) raises before it changes anything (:mod:`torch_sparse_metal._optimizer_state`).
    Under ``torch.inference_mode`` the update makes normal tensors all the same: the layer trains on afterwards.

    By default the layer gets new index buffers and new weight and state tensors. With ``in_place=True`` and a plan
    that keeps the edge count, the new index arrays, weights and state are copied into the existing tensors
    instead (``.grad`` is zeroed rather than dropped), so each keeps its storage and a CUDA graph captured with
    them stays valid (docs/training.md, "Graph capture"); the values are bitwise those of the default. A plan that
    changes the edge count cannot be written in place and replaces the tensors either way. Returns True when the
    update was written in place.

    In place, everything holding the layer's index tensors sees the new edges: a ``CSRTopology`` taken from
    ``layer.topology`` before the update, and a layer built from it (``SparseLinear.from_topology(layer.topology)``
    shares the tensors), which is why it is not the default.

    Example:
        >>> layer = SparseLinear(16, 8, density=0.25, generator=torch.Generator().manual_seed(0))
        >>> dst = layer.dst
        >>> plan = plan_update(layer, 4, 4, generator=torch.Generator().manual_seed(1))
        >>> apply_update(layer, *plan, in_place=True), layer.dst is dst
        (True, True)
    """
    optimizers = list(optimizers)
    for opt in optimizers:
        _check_optimizer(opt)
    _check_plan(layer, topology, edge_map)
    _check_state_remappable(layer, optimizers)
    weight = layer.weight
    old = weight.shape[0]
    new = topology.nnz
    states = [opt.state[weight] for opt in optimizers if weight in opt.state]
    in_place = in_place and new == old
    # Outside inference_mode even when called inside it: the weight and optimizer state made here stay the layer's
    # and the optimizer's, and inference tensors could neither be saved for backward nor be updated in place later.
    with torch.inference_mode(False), torch.no_grad():  # in this order: leaving inference_mode enables grad
        remapped = {id(s): {k: _remap(v, edge_map, new) for k, v in s.items()
                            if isinstance(v, torch.Tensor) and v.shape == (old,)} for s in states}
        new_weight = _remap(weight.detach(), edge_map, new)
        if in_place:
            layer._write_topology(topology.to(weight.device))
            weight.copy_(new_weight)  # bumps the version: a backward through a graph of the old edges raises
            if weight.grad is not None:  # a gradient of the old edges; its storage (a graph's, maybe) is kept too
                weight.grad.zero_()
            for s in states:
                for k, v in remapped[id(s)].items():
                    s[k].copy_(v)
        else:
            layer._set_topology(topology.to(weight.device))
            replace_data(weight, new_weight)
            for s in states:
                s.update(remapped[id(s)])
    mark_remapped(weight, optimizers)  # a step of another optimizer holding per-edge state of it is refused
    return in_place


def apply_to_followers(followers: dict[int, list[SparseLinear]], layers: list[SparseLinear], plans: list) -> None:
    """Apply each layer's ``(topology, edge_map)`` plan to its followers (``FollowerCopies.check``), each on its own
    device: their per-edge values are carried as the layer's were."""
    for layer, (topology, edge_map) in zip(layers, plans):
        for copy in followers.get(id(layer), ()):
            device = copy.weight.device
            apply_update(copy, topology, EdgeMap(edge_map.old_to_new.to(device), edge_map.grown.to(device)))


# --------------------------------------------------------------------------------------------------- schedule
class DynamicSparsity:
    """Prune-and-regrow schedule for the ``SparseLinear`` layers of a model, owning the optimizer bookkeeping.

    Every ``prune_every`` steps (until ``stop_fraction * total_steps``) each layer drops
    ``drop_fraction * (1 + cos(pi * t / T)) / 2`` of its edges (the cosine decay of RigL) by magnitude and grows
    edges back (``mode="set"``: at random; ``"rigl"``: by dense-gradient magnitude). With ``grow_to`` (a density
    in (0, 1]) each layer's edge count moves linearly from its starting count toward that density by
    ``grow_until * total_steps``, as the published M1 Pro networks grew from about 22K to 61K edges (docs/metal.md).

    Call :meth:`step` once per training step, after ``optimizer.step()``. The schedule runs on the fraction of
    the run done: ``steps / total_steps``, or, for runs budgeted in time, the ``progress`` passed to :meth:`step`
    (then ``total_steps`` may be None).

    Frozen layers are left alone: only layers whose ``weight.requires_grad`` is True when the schedule is built are
    updated (:attr:`layers`), and one frozen later is skipped at updates. ``optimizer`` is one optimizer or a list
    of them (:attr:`optimizers`): every one that holds a layer's weight, whose per-edge state each update carries
    across; a trainable layer none of them holds is refused. After an update, a step of an optimizer not given that
    holds per-edge state of an updated weight (on the old edge order) raises before it changes anything.

    Refused at construction, before anything changes (ValueError naming the layer):

    - the edge budget: an update regrows only connections absent before it, so each update needs its dropped edges
      plus the edges after it to be at most ``in_features * out_features`` (without ``grow_to``: ``drop_fraction *
      density <= 1 - density`` at the largest drop fraction of the schedule, its first update's; whole vectors when
      block > 1). With ``total_steps`` every update is checked; without it, every progress up to ``stop_fraction``.
    - tied weights: two updated layers sharing one weight Parameter, or (``layers`` a model) an updated layer's
      weight held by another module too; an update reorders the values for one layer's new edges only.
    - a weight wrapped by ``torch.nn.utils.parametrize`` or ``torch.nn.utils.prune``: remove the wrapping first
      (``parametrize.remove_parametrizations(layer, "weight")``, ``prune.remove(layer, "weight")``).

    A constant fan-in layer (``SparseLinear.constant_fan_in``; SRigL, Lasby et al. 2024) is updated per output
    (:mod:`torch_sparse_metal.fan_in`): each output drops ``round(drop fraction * k)`` of its ``k`` edges by
    magnitude and grows as many, so every output keeps its in-degree. ``min_salient`` (an integer >= 1) adds SRigL's
    neuron ablation to those layers: an output with fewer salient weights is left without inputs and its edges go
    to the other outputs; :attr:`fan_in_reports` records each update's outcome. ``grow_to`` does not apply to
    constant fan-in layers, and ablation is not available under torch.distributed (refused at construction).

    RigL takes each layer's input and output gradient from the backward pass of the step before an update (all the
    layer's calls that were back-propagated, so shared layers and gradient accumulation count in full); activation
    checkpointing (``torch.utils.checkpoint``, reentrant or not) recomputes the forward without changing that. With
    ``grad_accumulation`` N > 1 it grows where the dense gradient summed over the N steps before the update is
    largest (SRigL's ``grad_accumulation_n``, Lasby et al. 2024: less noisy growth at small batches); the inputs and
    output gradients of those N steps are held until the update.

    ``in_place=True`` writes each update that keeps a layer's edge count (SET and RigL without ``grow_to``) into the
    layer's existing tensors (:func:`apply_update`), so a CUDA graph captured with them stays valid; after each
    update, :attr:`updated_in_place` says whether every layer's tensors kept their storage (False: re-capture).
    The layers may then not share index tensors (refused at construction). Under CUDA graph replay the Python hooks
    RigL records gradients with do not run: run the step before an update eagerly (:attr:`records_next_step`;
    docs/training.md, "Graph capture").

    With torch.distributed initialised, updates are collective over ``process_group`` (default: the world group;
    ``"local"`` opts out): rank 0 decides, every rank applies the same change, and a DDP wrapper must be rebuilt
    after each update (``if evo.step(): model = torch_sparse_metal.distributed.rewrap(model)``); see
    :mod:`torch_sparse_metal.distributed`. Without torch.distributed nothing changes.
    """

    def __init__(
        self,
        layers: nn.Module | Iterable[SparseLinear],
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        *,
        prune_every: int = 100,
        total_steps: int | None,
        drop_fraction: float = 0.3,
        stop_fraction: float = 0.75,
        grow_to: float | None = None,
        grow_until: float = 0.5,
        mode: str = "set",
        chunk: int = 256,
        generator: torch.Generator | None = None,
        process_group: torch.distributed.ProcessGroup | str | None = None,
        in_place: bool = False,
        followers: Iterable[nn.Module] = (),
        grad_accumulation: int = 1,
        min_salient: int | None = None,
    ) -> None:
        trainable = _trainable_sparse_layers(layers, "DynamicSparsity", "update")
        for name, m in trainable:  # frozen layers are left alone, wrapped or not
            _check_unwrapped(m, name)
        self.layers = [m for _, m in trainable]
        _check_int("prune_every", prune_every, 1)
        if total_steps is not None:
            _check_int("total_steps", total_steps, 1)
        _check_int("chunk", chunk, 1)
        _check_int("grad_accumulation", grad_accumulation, 1)
        _check_fraction("drop_fraction", drop_fraction)
        _check_fraction("stop_fraction", stop_fraction)
        _check_fraction("grow_until", grow_until)
        if mode not in ("set", "rigl"):
            raise ValueError(f"mode must be 'set' or 'rigl', got {mode!r}")
        fan_in_layers = [name for name, layer in trainable if layer.constant_fan_in]
        if min_salient is not None:
            _check_int("min_salient", min_salient, 1)
            if not fan_in_layers:
                raise ValueError("min_salient is SRigL's neuron ablation, for constant fan-in layers, and none of the "
                                 "layers is one (build them with constant_fan_in=True)")
        if grow_to is not None and fan_in_layers:
            raise ValueError(f"grow_to does not apply to constant fan-in layers ({', '.join(fan_in_layers)}): their "
                             "updates keep each output's in-degree")
        if grow_to is not None:
            _check_fraction("grow_to", grow_to)
            for name, layer in trainable:  # compared as the schedule rounds: a resumed, fully grown layer is at it
                if _grown_nnz(layer, grow_to) < layer.nnz:
                    raise ValueError(f"grow_to={grow_to} is below a layer's current density {layer.density:.4g} "
                                     f"({name}: {_grown_nnz(layer, grow_to)} edges against its {layer.nnz}); the "
                                     "schedule only grows")
        _check_untied(trainable, layers if isinstance(layers, nn.Module) else None)
        optimizers = _optimizers(optimizer)
        _check_optimizer_holds(optimizers, trainable)
        check_generator(generator)
        if not isinstance(in_place, bool):
            raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
        if in_place:
            _check_own_indices(trainable)
        sync = resolve_sync(process_group)
        if sync is not None and min_salient is not None:
            raise ValueError("min_salient (neuron ablation) is not available under torch.distributed: the edge counts "
                             "of an ablating update are known only once rank 0 has planned it")
        self.optimizer = optimizer
        #: The optimizers whose per-edge state of the layers' weights every update carries across.
        self.optimizers = optimizers
        self.in_place = in_place
        #: Whether the last update kept the storage of every layer's tensors (False before any update).
        self.updated_in_place = False
        self.prune_every, self.total_steps, self.drop_fraction = prune_every, total_steps, drop_fraction
        self.stop_fraction, self.grow_to, self.grow_until = stop_fraction, grow_to, grow_until
        self.mode, self.chunk, self.generator = mode, chunk, generator
        self.grad_accumulation = grad_accumulation
        self.min_salient = min_salient
        self.start_nnz = [layer.nnz for layer in self.layers]
        for i, (name, layer) in enumerate(trainable):
            if layer.constant_fan_in:
                self._check_fan_in_budget(i, name)
            else:
                self._check_edge_budget(i, name)
        #: ``(step, {layer index: FanInReport})`` for each update that changed a constant fan-in layer.
        self.fan_in_reports: list[tuple[int, dict[int, FanInReport]]] = []
        self.steps = 0
        self.progress = 0.0
        self.history: list[tuple[int, list[int]]] = [(0, list(self.start_nnz))]
        self.regrown: list[int] = [0]  # edges grown by each update of history (all layers), 0 for the start
        # (x, grad_out) of each back-propagated call of a layer on the step before an update (RigL)
        self._captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hooks = [layer.register_forward_hook(self._capture) for layer in self.layers] if mode == "rigl" else []
        self._sync = sync
        if self._sync is not None:
            self._hooks += self._sync.guard(self.layers)
        self._copies = FollowerCopies(self.layers)
        for module in followers:
            self.register_follower(module)

    # -- copies of the layers (AveragedModel, EMA) ---------------------------------------------------------
    def register_follower(self, module: nn.Module) -> None:
        """Remap ``module``'s copies of the layers with every update, as the layers themselves.

        ``module`` holds deep copies of the layers (``torch.optim.swa_utils.AveragedModel(model)``, an EMA or
        teacher model made with ``copy.deepcopy``) whose values are per edge. At each update each copy gets its
        layer's new topology and its own values carried by the same edge map: a surviving connection keeps its
        value, a grown one starts at 0. Without registration an update refuses to run while such a copy is alive
        and still on the layer's topology, since averaging the layer's reordered weight into it position by
        position would mix different connections. A copy kept on its old topology on purpose (a snapshot) is
        registered with :meth:`leave_behind` instead.

        Example:
            >>> from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
            >>> layer = SparseLinear(16, 8, density=0.25, generator=torch.Generator().manual_seed(0))
            >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
            >>> ema = AveragedModel(layer, multi_avg_fn=get_ema_multi_avg_fn(0.99))
            >>> evo = DynamicSparsity([layer], opt, prune_every=1, total_steps=4, followers=[ema])
            >>> _ = evo.step(); ema.update_parameters(layer)
            >>> torch.equal(ema.module.dst, layer.dst)
            True
        """
        self._copies.follow(module)

    def leave_behind(self, module: nn.Module) -> None:
        """Let updates run while ``module`` holds copies of the layers that keep their current topology (a
        snapshot of the model): they are not remapped, and nothing checks them again."""
        self._copies.leave(module)

    # -- schedule ------------------------------------------------------------------------------------------
    def _fraction(self, step: int) -> float:
        """Fraction of the run done at ``step`` (from total_steps, else the last progress given to step())."""
        return step / self.total_steps if self.total_steps is not None else self.progress

    def _due(self, step: int) -> bool:
        return step % self.prune_every == 0 and self._fraction(step) <= self.stop_fraction

    def drop_fraction_at(self, fraction: float) -> float:
        """Cosine-decayed drop fraction when ``fraction`` of the run is done."""
        progress = min(fraction / max(self.stop_fraction, 1e-12), 1.0)
        return self.drop_fraction * 0.5 * (1 + math.cos(math.pi * progress))

    def target_nnz(self, index: int, fraction: float) -> int:
        """Edge count layer ``index`` should have after an update when ``fraction`` of the run is done."""
        start = self.start_nnz[index]
        if self.grow_to is None:
            return start
        layer = self.layers[index]
        final = _grown_nnz(layer, self.grow_to)
        target = start + (final - start) * min(fraction / max(self.grow_until, 1e-12), 1.0)
        return layer.block * round(target / layer.block)  # whole vectors

    def _drop(self, index: int, fraction: float, nnz: int) -> int:
        """Edges layer ``index`` drops at an update when ``fraction`` of the run is done and it has ``nnz`` edges."""
        block = self.layers[index].block
        return block * round(self.drop_fraction_at(fraction) * nnz / block)  # whole vectors

    # -- the edge budget, checked at construction ----------------------------------------------------------
    def _check_edge_budget(self, index: int, name: str) -> None:
        """Raise unless every update of layer ``index`` can regrow what it drops.

        An update grows only connections absent before it, so with ``before`` edges before it and ``after`` after
        (its target count), ``after - (before - drop) <= total - before``: ``after + drop <= total``, where ``total``
        is ``in_features * out_features`` (all counts in whole vectors when block > 1). With ``total_steps`` the
        updates are known (every ``prune_every`` steps up to ``stop_fraction``) and each is checked with its own
        counts; without it they come at whatever progress :meth:`step` is given, so the condition must hold at every
        progress. The updates are searched by bisection on a bound (drop fractions only decay, counts only grow),
        so a long schedule costs a few evaluations per failing neighbourhood, not one per update."""
        layer = self.layers[index]
        total, block = layer.in_features * layer.out_features, layer.block
        points = _UpdatePoints(self, index)
        pending = [(0, len(points))] if len(points) else []
        while pending:
            lo, hi = pending.pop()
            # Over points lo .. hi-1 the drop fraction is at most point lo's and both counts at most point hi-1's.
            top = points[hi - 1][3]
            if top + block * round(self.drop_fraction_at(points[lo][1]) * top / block) <= total:
                continue
            if hi - lo > 1:
                mid = (lo + hi) // 2
                pending += [(mid, hi), (lo, mid)]  # the earlier half first: the first failing update is named
                continue
            step, fraction, before, after = points[lo]
            drop = self._drop(index, fraction, before)
            if after + drop > total:
                raise ValueError(self._budget_message(index, name, step, fraction, before, after, drop))

    def _check_fan_in_budget(self, index: int, name: str) -> None:
        """Raise unless a constant fan-in layer's outputs can regrow what they drop: with ``k`` of ``in_features``
        inputs each, an output drops ``round(rate * k)`` and regrows as many among the ``in_features - k`` absent
        before, at the largest drop rate of the schedule (its first update's)."""
        layer = self.layers[index]
        topo = layer.topology
        # A layer still on the meta device has no indices to count; it was drawn with one fan-in for every output.
        k = topo.nnz // topo.out_features if topo.device.type == "meta" else topo.common_fan_in()
        first = self.prune_every / self.total_steps if self.total_steps is not None else 0.0
        if first > self.stop_fraction:
            return  # no update is ever due
        drop = round(self.drop_fraction_at(first) * k)
        if drop + k > layer.in_features:
            most = (layer.in_features - k) / k if k else 0.0
            raise ValueError(f"DynamicSparsity cannot keep the fan-in of {name} (constant fan-in {k} of "
                             f"{layer.in_features} inputs per output): its first update drops {drop} edges of each "
                             f"output and must regrow as many among the {layer.in_features - k} connections absent "
                             f"before it. Lower drop_fraction (a drop fraction of at most {most:.4g}) or the density")

    def _budget_message(self, index: int, name: str, step: int | None, fraction: float, before: int, after: int,
                        drop: int) -> str:
        layer = self.layers[index]
        total, block = layer.in_features * layer.out_features, layer.block
        rate = self.drop_fraction_at(fraction)
        decay = f"drop fraction {rate:.4g}, decayed from drop_fraction={self.drop_fraction}"
        if step is not None:
            when = f"its update at step {step} ({decay})"
        else:
            when = (f"an update at progress {fraction:.4g} ({decay}; without total_steps updates follow the progress "
                    f"given to step(), so every progress up to stop_fraction={self.stop_fraction} is checked)")
        growth = f" (to reach its grow_to target of {after} edges)" if after != before else ""
        limit = total - after
        most = limit / before if before else 0.0
        formula = " = (1 - density) / density" if after == before else ""
        vectors = f", counted in whole vectors of {block} outputs" if block > 1 else ""
        advice = "the density" if self.grow_to is None else "grow_to or the starting density"
        if rate > 0 and most > 0:  # drop fractions scale with drop_fraction: what would make this one fit
            fitting = math.floor(most / rate * self.drop_fraction * 1000) / 1000
            advice = f"drop_fraction (to at most about {fitting:g}) or {advice}"
        elif limit == 0:
            advice = f"drop_fraction to 0 (every connection is present after the update) or {advice}"
        return (f"DynamicSparsity cannot keep the edge count of {name} ({layer.in_features} -> {layer.out_features}, "
                f"{total} possible connections{vectors}): {when} finds it at {before} edges (density "
                f"{before / total:.4g}), drops {drop} and must grow {after - before + drop} new ones{growth}, but only "
                f"{total - before} connections are absent before it, and an update never regrows one that was present. "
                f"Every update needs its drop plus the edges after it to be at most {total}: here a drop of at most "
                f"{limit} edges, a drop fraction of at most {most:.4g}{formula}. Lower {advice}")

    # -- RigL capture (only on the step before an update) --------------------------------------------------
    @property
    def records_next_step(self) -> bool:
        """Whether the next training step's forward and backward are recorded for a RigL update (through Python
        hooks, which a replayed CUDA graph does not run: run that step eagerly)."""
        if self.mode != "rigl":
            return False
        # One of the grad_accumulation steps before an update. Distributed: by step count alone, as ranks agree on
        # progress only at update steps.
        ahead = range(self.steps + 1, self.steps + 1 + self.grad_accumulation)
        if self._sync is not None:
            return any(step % self.prune_every == 0 for step in ahead)
        return any(self._due(step) for step in ahead)

    def _capture(self, layer: SparseLinear, inputs, output) -> None:
        if not torch.is_grad_enabled() or not self.records_next_step or not output.requires_grad:
            return
        x = inputs[0].detach().reshape(-1, layer.in_features)

        # Recorded when the output's gradient arrives, not at the forward: a forward recomputed by activation
        # checkpointing during backward must not replace the call whose gradient autograd delivers.
        def keep_grad(grad: torch.Tensor) -> None:
            self._captured.setdefault(id(layer), []).append((x, grad.detach().reshape(-1, layer.out_features)))

        output.register_hook(keep_grad)

    # -- the per-step call ---------------------------------------------------------------------------------
    def step(self, progress: float | None = None) -> bool:
        """Advance one training step; update the topology when due. Returns True when it updated.

        ``progress`` (the fraction of the run done, computed on the host) drives the schedule of runs with no
        ``total_steps``.
        """
        if progress is None and self.total_steps is None:
            raise ValueError("this schedule has no total_steps: pass step(progress=fraction_of_run_done)")
        self.steps += 1
        if progress is not None:
            self.progress = float(progress)
            if self._sync is not None and self.steps % self.prune_every == 0:  # rank 0's clock decides
                self.progress = self._sync.broadcast_float(self.progress, self.layers[0].weight.device,
                                                           f"agreeing on progress at step {self.steps}")
        if not self._due(self.steps):
            if self._captured and not self.records_next_step:  # a capture whose update did not come: free it
                self._captured.clear()
            return False
        self.update()
        return True

    def update(self) -> None:
        """Prune and regrow every layer now. All plans are made (and checked) before any layer changes.

        Distributed: every rank sums RigL's gradient; rank 0 plans, and its plans are applied everywhere.

        An update waits for the device anyway, so it first raises any index error a GPU kernel recorded
        (:func:`~torch_sparse_metal.check_index_errors`): the gradients it would rank are then meaningless.
        """
        for device in {layer.weight.device for layer in self.layers}:
            check_index_errors(device)
        plans, changes = [], []
        fraction = self._fraction(self.steps)
        grown = 0
        sync = self._sync
        active = [(i, layer) for i, layer in enumerate(self.layers) if layer.weight.requires_grad]  # frozen: left alone
        reports: dict[int, FanInReport] = {}
        for i, layer in active:
            if layer.constant_fan_in:
                plan, change, report = self._plan_fan_in(i, layer, fraction)
                plans.append(plan)
                changes.append(change)
                grown += change[1]
                if report is not None:
                    reports[i] = report
                continue
            drop = self._drop(i, fraction, layer.nnz)
            grow = self.target_nnz(i, fraction) - (layer.nnz - drop)
            grown += grow
            changes.append((drop, grow))
            if sync is not None and not sync.is_root and self.mode == "set":
                continue  # SET needs no collective to plan: only rank 0 draws
            grad = self._gathered_grad(i, layer) if self.mode == "rigl" else None
            plans.append(plan_update(layer, drop, grow, mode=self.mode, grad=grad, generator=self.generator,
                                     chunk=self.chunk, grad_reduce=sync.all_reduce_sum if sync is not None else None))
        layers = [layer for _, layer in active]
        if sync is not None:
            plans = sync.share_plans(layers, plans if sync.is_root else None, changes,
                                     f"topology update at step {self.steps}")
        for layer in layers:  # checked before any layer changes
            _check_state_remappable(layer, self.optimizers)
        followers = self._copies.check(layers, f"the topology update at step {self.steps}")
        kept = [apply_update(layer, topology, edge_map, self.optimizers, in_place=self.in_place)
                for layer, (topology, edge_map) in zip(layers, plans)]
        apply_to_followers(followers, layers, plans)
        self.updated_in_place = all(kept)
        if sync is not None:
            mark_changed(layers)
        self._captured.clear()
        self.history.append((self.steps, [layer.nnz for layer in self.layers]))
        self.regrown.append(grown)
        if reports:
            self.fan_in_reports.append((self.steps, reports))

    def _plan_fan_in(self, index: int, layer: SparseLinear, fraction: float):
        """A constant fan-in layer's plan (None on a rank that does not plan), its ``(drop, grow)`` and report."""
        topology = layer.topology
        k = topology.common_fan_in()
        drop = round(self.drop_fraction_at(fraction) * k)
        active = int((topology.fan_in() > 0).sum()) if k else layer.out_features
        sync = self._sync
        if sync is not None and not sync.is_root and self.mode == "set":
            return None, (drop * active, drop * active), None
        grad = self._gathered_grad(index, layer) if self.mode == "rigl" else None
        new, edge_map, report = plan_fan_in_update(
            layer, drop, mode=self.mode, grad=grad, generator=self.generator, chunk=self.chunk,
            grad_reduce=sync.all_reduce_sum if sync is not None else None, min_salient=self.min_salient,
            total=self.start_nnz[index] if self.min_salient is not None else None)
        grown = int(edge_map.grown.numel()) if sync is None else drop * active  # no ablation under sync
        return (new, edge_map), (layer.nnz - int(edge_map.kept.sum()) if sync is None else drop * active, grown), \
            report

    def _gathered_grad(self, index: int, layer: SparseLinear) -> tuple[torch.Tensor, torch.Tensor]:
        captured = self._captured.get(id(layer))
        if not captured:
            raise RuntimeError(f"RigL update at step {self.steps}: no gradient was captured for layer {index}; "
                               "run a forward and backward pass through the model before this step")
        return tuple(torch.cat(parts) for parts in zip(*captured))

    def remove(self) -> None:
        """Detach the capture hooks (and, under torch.distributed, the checks that the DDP wrapper was rebuilt)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"steps": self.steps, "progress": self.progress, "start_nnz": list(self.start_nnz),
                 "history": list(self.history), "regrown": list(self.regrown)}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the schedule; every field is read and checked first, so a malformed state raises (naming the
        field) and leaves the schedule as it was."""
        if not isinstance(state, dict):
            raise ValueError(f"not a DynamicSparsity state: expected a dict, got {type(state).__name__}")
        try:
            steps = _count(state["steps"], "steps")
            start_nnz = [_count(n, "start_nnz") for n in state["start_nnz"]]
            progress = _progress(state.get("progress", 0.0))
            history = [(_count(s, "history step"), [_count(v, "history edge count") for v in n])
                       for s, n in state["history"]]
            regrown = [_count(g, "regrown") for g in state.get("regrown", [0] * len(history))]  # older ones lack it
            generator_state = state.get("generator")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a DynamicSparsity state: {type(exc).__name__}: {exc}") from None
        if len(start_nnz) != len(self.layers):
            raise ValueError(f"state has {len(start_nnz)} layers, this schedule has {len(self.layers)}")
        if len(regrown) != len(history):
            raise ValueError(f"state has {len(history)} history entries but {len(regrown)} regrown counts")
        if generator_state is not None:
            if not (isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8):
                raise ValueError("state['generator'] must be a generator state (a uint8 tensor)")
            if self.generator is not None:  # tried on a scratch generator first: set_state checks the size late
                try:
                    torch.Generator(device=self.generator.device).set_state(generator_state)
                except RuntimeError as exc:
                    raise ValueError(f"state['generator'] is not a state of this generator: {exc}") from None
        self.steps, self.start_nnz, self.progress = steps, start_nnz, progress
        self.history, self.regrown = history, regrown
        if self.generator is not None and generator_state is not None:
            self.generator.set_state(generator_state)


class _UpdatePoints:
    """The updates a schedule can make to one layer, in order of progress, as ``(step or None, fraction, edges
    before, edges after)``, for :meth:`DynamicSparsity._check_edge_budget`; computed when indexed (a long run has
    many updates).

    With ``total_steps``: update ``k`` at step ``k * prune_every`` while that is due; before it the layer has the
    previous update's target count (the starting count before the first). Without ``total_steps`` the progress at
    the updates is not known: point 0 is progress 0 at the starting count, and point ``m`` the first progress at
    which the target count (``grow_to``) reaches ``start + m * block``, where an update may find the layer at that
    count already (after an update just before): the worst case of each stretch of one target count."""

    def __init__(self, schedule: DynamicSparsity, index: int) -> None:
        self.schedule, self.index = schedule, index
        layer = schedule.layers[index]
        self.start, self.block = schedule.start_nnz[index], layer.block
        if schedule.total_steps is not None:
            count = int(schedule.stop_fraction * schedule.total_steps) // schedule.prune_every + 2
            while count > 0 and not schedule._due(count * schedule.prune_every):  # _due's own float test
                count -= 1
            self.count = count
            return
        self.span, count = 0, 0
        if schedule.grow_to is not None:
            final = _grown_nnz(layer, schedule.grow_to)
            self.span = final - self.start
            count = max(round(final / self.block) - self.start // self.block, 0)  # the counts it grows through
            if count and schedule.grow_until > 0:  # those reached by stop_fraction (the estimate, then the exact test)
                count = min(count, int(schedule.stop_fraction / schedule.grow_until * self.span / self.block) + 2)
                while count > 0 and self._progress(count) > schedule.stop_fraction:
                    count -= 1
        self.count = count + 1

    def _progress(self, m: int) -> float:
        """The progress at which the target count first reaches ``start + m * block`` (target_nnz rounds the
        linear count to whole vectors: it gets there from ``start + (m - 1/2) * block`` on)."""
        return self.schedule.grow_until * (m - 0.5) * self.block / self.span

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, j: int) -> tuple[int | None, float, int, int]:
        schedule, index = self.schedule, self.index
        if schedule.total_steps is None:
            count = self.start + j * self.block
            return None, (self._progress(j) if j else 0.0), count, count
        every = schedule.prune_every
        before = self.start if j == 0 else schedule.target_nnz(index, schedule._fraction(j * every))
        step = (j + 1) * every
        fraction = schedule._fraction(step)
        return step, fraction, before, schedule.target_nnz(index, fraction)


def _grown_nnz(layer: SparseLinear, grow_to: float) -> int:
    """The edge count a ``grow_to`` schedule grows ``layer`` to: ``grow_to * in * out`` in whole vectors, the count
    its last growth update reaches (it can lie a little above ``grow_to`` of the layer's connections)."""
    return layer.block * round(grow_to * layer.in_features * layer.out_features / layer.block)


def _named_sparse_layers(layers: nn.Module | Iterable[SparseLinear]) -> list[tuple[str, SparseLinear]]:
    """The distinct SparseLinear layers of a module (by name) or of an iterable (by position)."""
    named = layers.named_modules() if isinstance(layers, nn.Module) else ((f"layers[{i}]", m)
                                                                           for i, m in enumerate(layers))
    seen: dict[int, tuple[str, SparseLinear]] = {}
    for name, module in named:
        if isinstance(module, SparseLinear):
            seen.setdefault(id(module), (name or type(module).__name__, module))  # a layer listed twice updates once
    return list(seen.values())


def _trainable_sparse_layers(layers: nn.Module | Iterable[SparseLinear], schedule: str, verb: str
                             ) -> list[tuple[str, SparseLinear]]:
    """The SparseLinear layers a schedule acts on (:func:`_named_sparse_layers` whose weight trains); refused where
    there are none, or all are frozen."""
    named = _named_sparse_layers(layers)
    if not named:
        raise ValueError(f"{schedule} found no SparseLinear layers to {verb}")
    trainable = [(name, m) for name, m in named if _trains_weight(m)]
    if not trainable:
        raise ValueError(f"every SparseLinear layer found ({', '.join(n for n, _ in named)}) is frozen "
                         f"(weight.requires_grad is False); {schedule} leaves frozen layers alone")
    return trainable


def _optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    """A schedule's ``optimizer`` argument as a list, each checked: one optimizer, or a non-empty list or tuple of
    distinct optimizers."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError("optimizer is an empty list; give the optimizer (or every optimizer) that trains the layers")
    for opt in optimizers:
        _check_optimizer(opt)
    if len({id(opt) for opt in optimizers}) != len(optimizers):
        raise ValueError("optimizer lists one optimizer twice; an update would remap its state twice")
    return optimizers


def _check_optimizer_holds(optimizers: list[torch.optim.Optimizer], layers: list[tuple[str, SparseLinear]]) -> None:
    """Every trainable layer's weight is a parameter of one of the optimizers (an update carries its state)."""
    if any(getattr(opt, "param_groups", None) is None for opt in optimizers):
        return  # a wrapper with a state mapping only: nothing to check against
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    missing = [name for name, layer in layers if id(layer.weight) not in held]
    if missing:
        raise ValueError(f"the weight of {', '.join(missing)} is trainable but not in the optimizer given to "
                         "DynamicSparsity, so its optimizer state could not be carried across topology updates: pass "
                         "the optimizer that trains it, or freeze it (weight.requires_grad_(False)) to leave it alone")


def _trains_weight(layer: SparseLinear) -> bool:
    """Whether the layer's weight is trained: the Parameter(s) it is computed from when torch.nn.utils.prune or
    parametrize wrap it (a pruned layer's ``weight`` keeps the requires_grad of its last computation)."""
    if parametrize.is_parametrized(layer, "weight"):
        return any(p.requires_grad for p in layer.parametrizations["weight"].parameters(recurse=False))
    if "weight_orig" in layer._parameters:
        return layer._parameters["weight_orig"].requires_grad
    return layer.weight.requires_grad


def _check_unwrapped(layer: SparseLinear, name: str) -> None:
    """The layer's weight is its own Parameter, not a shard of one (FSDP2) nor a tensor that torch.nn.utils.parametrize
    or prune computes from another one at every forward (an update replaces the weight's values in edge order; it
    cannot do so through the wrapping, nor for what the wrapping keeps per edge, such as a pruning mask)."""
    kind = type(layer.weight.data)
    if kind is not torch.Tensor:
        raise ValueError(f"the weight of {name} is a {kind.__name__} (sharded by FSDP2's fully_shard or tensor "
                         "parallelism, say): a topology update reorders the whole weight and its optimizer state, "
                         "of which each rank holds a shard only. Topology updates run under plain "
                         "DistributedDataParallel (docs/distributed.md); under FSDP2 train a fixed topology")
    if parametrize.is_parametrized(layer, "weight"):
        what, call = "parametrized (torch.nn.utils.parametrize)", "parametrize.remove_parametrizations(layer, 'weight')"
        held = ", ".join(f"{name}.parametrizations.weight.{key}"
                         for key, _ in layer.parametrizations["weight"].named_parameters(recurse=False)) or "none"
    elif "weight_orig" in layer._parameters and "weight_mask" in layer._buffers:
        what, call, held = "pruned (torch.nn.utils.prune)", "prune.remove(layer, 'weight')", f"{name}.weight_orig"
    else:
        return
    raise ValueError(f"the weight of {name} is {what}: its Parameter is {held}, from which the layer's weight is "
                     "computed at every forward, so a topology update could not carry the values and optimizer state "
                     "to the new edges through the wrapping. Remove the wrapping from that layer first with "
                     f"torch.nn.utils.{call}, which keeps its current values; then build the schedule")


def _check_untied(layers: list[tuple[str, SparseLinear]], model: nn.Module | None) -> None:
    """No two updated layers share a weight Parameter, and (when the model is given) no other module of it holds an
    updated layer's weight: an update reorders the weight's values for its layer's new edges, and whatever else
    uses the Parameter would compute with values on the wrong connections."""
    owner: dict[int, tuple[str, SparseLinear]] = {}
    for name, layer in layers:
        other, _ = owner.setdefault(id(layer.weight), (name, layer))
        if other != name:
            raise ValueError(f"{other} and {name} share one weight Parameter (tied weights), which DynamicSparsity "
                             "cannot update: an update reorders the values for one layer's new edges while the other "
                             "keeps its old edges, so it would compute with values on the wrong connections. Give "
                             "each layer its own weight Parameter (and build the optimizer after), or freeze the tied "
                             "layers (weight.requires_grad_(False)) to leave them out of the schedule")
    if model is None:
        return
    for module_name, module in model.named_modules(remove_duplicate=False):
        for key, p in module._parameters.items():
            if p is None or id(p) not in owner:
                continue
            name, layer = owner[id(p)]
            if module is not layer or key != "weight":
                where = f"{module_name}.{key}" if module_name else key
                raise ValueError(f"the weight of {name} is also {where} (a {type(module).__name__}), which "
                                 "DynamicSparsity cannot update with it: an update reorders the values for the "
                                 f"layer's new edges, so {where} would hold values on the wrong connections. Give "
                                 f"{name} its own weight Parameter (and build the optimizer after), or freeze it "
                                 "(weight.requires_grad_(False)) to leave it out of the schedule")


def _check_own_indices(layers: list[tuple[str, SparseLinear]]) -> None:
    """No two layers share an index tensor's storage (an in-place update of one would change the other's edges)."""
    owner: dict[int, str] = {}
    for name, layer in layers:
        for buffer in layer._index_buffers():
            t = getattr(layer, buffer)
            if t.numel() == 0:
                continue
            other = owner.setdefault(t.untyped_storage().data_ptr(), name)
            if other != name:
                raise ValueError(f"{other} and {name} share their index tensors (one was built from the other's "
                                 "topology), so an in-place update of one would change the edges of both: give each "
                                 "its own copy, or use in_place=False")


def _check_layer(layer: SparseLinear) -> None:
    if not isinstance(layer, SparseLinear):
        raise TypeError(f"layer must be a SparseLinear, got {type(layer).__name__}")
    _check_unwrapped(layer, "layer")


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Anything with an optimizer's per-parameter ``state`` mapping (wrappers that are not subclasses included),
    except an optimizer whose state is not per element of each parameter, which an update could not remap."""
    if not isinstance(getattr(optimizer, "state", None), dict):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("torch.optim.LBFGS keeps its curvature history as vectors over all its parameters "
                         "flattened together, not per element of each parameter, so a topology update cannot carry "
                         "it to the new edges: its history would pair values with the wrong connections (or, when the "
                         "edge count changes, fail inside torch). Use an optimizer with per-parameter state (AdamW, "
                         "SGD), or keep the topology fixed")


def _check_state_remappable(layer: SparseLinear, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Every tensor the optimizers keep for ``layer.weight`` is per edge (remapped) or a scalar (kept): a tensor of
    another shape is state an update could not carry across, refused before anything changes."""
    weight = layer.weight
    for opt in optimizers:
        for key, value in opt.state.get(weight, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != weight.shape:
                raise ValueError(f"{type(opt).__name__} keeps state {key!r} of shape {tuple(value.shape)} for a "
                                 f"SparseLinear weight of {weight.shape[0]} edges: it is not per edge, so a topology "
                                 "update cannot carry it to the new edges. Nothing was changed")


def _count(value: object, name: str) -> int:
    """An integer entry of a saved state (Python or 0-d integer tensor), never a float, bool or string."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _progress(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"progress must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
