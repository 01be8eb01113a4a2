"""Gradual magnitude pruning: from dense (or denser) to a final density on a cubic schedule (Zhu & Gupta, 2017).

"To prune, or not to prune" (Zhu & Gupta, 2017) prunes each layer from its initial density ``d_i`` to a final
density ``d_f`` over ``n`` pruning steps ``Δt`` apart from step ``t0``, removing the smallest-magnitude weights:

    d(t) = d_f + (d_i - d_f) * (1 - (t - t0) / (n Δt)) ** 3        for t = t0, t0 + Δt, ..., t0 + n Δt

(torch.ao.pruning's and Cerebras' schedules are the same polynomial; sparsimony's GMP too). Here it is counted in
edges: a layer that starts with ``N_i`` edges and ends with ``N_f = round(d_f * in * out)`` (whole vectors when
``block > 1``) has ``round(N_f + (N_i - N_f) * (1 - p) ** power)`` edges after the update at progress ``p``, the
smallest-magnitude edges (vectors: by L2 norm) removed. A layer starts dense as a ``SparseLinear`` of density 1
(``sparsify(model, density=1.0)``) or at any density above its final one.

A constant fan-in layer (``SparseLinear.constant_fan_in``) is pruned per output: every output with inputs keeps its
largest weights, one in-degree for all, so its counts move in whole rows of the connected outputs.

Each update is a topology update of :mod:`torch_sparse_metal.evolve` that grows nothing: surviving edges keep their
weights and every per-edge optimizer state tensor exactly, registered copies (``AveragedModel``) follow it, and
under torch.distributed rank 0 decides and every rank applies the same plan (rebuild the DDP wrapper after an update
with :func:`torch_sparse_metal.distributed.rewrap`). Each update changes the edge count, so a captured CUDA graph must
be captured again after it (``updated_in_place`` is always False).

Example:
    >>> from torch_sparse_metal import sparsify
    >>> model = sparsify(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)), density=1.0)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> gmp = GradualPruning(model, opt, final_density=0.1, start_step=2, end_step=8, prune_every=2)
    >>> for step in range(10):
    ...     model(torch.randn(4, 32)).square().mean().backward(); opt.step(); opt.zero_grad(); _ = gmp.step()
    >>> gmp.history  # (step, edges of each layer); step 2 is the start: nothing to remove yet
    [(0, [1024, 256]), (4, [375, 94]), (6, [136, 35]), (8, [102, 26])]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .distributed import mark_changed, resolve_sync
from .evolve import (
    _check_int,
    _check_optimizer_holds,
    _check_state_remappable,
    _check_untied,
    _check_unwrapped,
    _count,
    _optimizers,
    _trainable_sparse_layers,
    apply_to_followers,
    apply_update,
    plan_update,
)
from .fan_in import plan_fan_in_update
from .followers import FollowerCopies
from .nn import SparseLinear
from .ops import check_index_errors

__all__ = ["GradualPruning"]


class GradualPruning:
    """Prune the ``SparseLinear`` layers of a model from their current density to ``final_density`` by magnitude,
    on Zhu & Gupta's polynomial schedule (module docstring).

    Updates come at steps ``start_step``, ``start_step + prune_every``, ... and at ``end_step`` (the step count is
    that of :meth:`step` calls, one after each ``optimizer.step()``); after ``end_step`` every layer is at its final
    density and nothing more happens. ``final_density`` is one density for every layer, or a mapping from layer name
    (as ``model.named_modules()`` names it; ``"layers[i]"`` for a list) to density, such as
    :func:`~torch_sparse_metal.convert.sparsify_densities` or
    :func:`~torch_sparse_metal.distribution.layer_densities` give (ERK). ``power`` is the polynomial's degree (3:
    cubic, Zhu & Gupta's; 1: linear).

    Refused at construction, before anything changes (as :class:`~torch_sparse_metal.evolve.DynamicSparsity`): a
    final density above a layer's current one, tied or wrapped weights, a trainable layer whose weight is not in
    ``optimizer`` (one optimizer or a list of them, :attr:`optimizers`), an optimizer whose state is not per edge
    (L-BFGS). Frozen layers are left alone. ``followers``:
    modules holding copies of the layers to remap with each update
    (:meth:`~torch_sparse_metal.evolve.DynamicSparsity.register_follower`).
    """

    #: Each update changes the edge count: a captured CUDA graph must be captured again.
    updated_in_place = False
    #: No update needs a recorded training step (the graph-capture loop's question to RigL).
    records_next_step = False

    def __init__(
        self,
        layers: nn.Module | Iterable[SparseLinear],
        optimizer: torch.optim.Optimizer,
        *,
        final_density: float | Mapping[str, float],
        end_step: int,
        start_step: int = 0,
        prune_every: int = 100,
        power: float = 3.0,
        process_group: torch.distributed.ProcessGroup | str | None = None,
        followers: Iterable[nn.Module] = (),
    ) -> None:
        trainable = _trainable_sparse_layers(layers, "GradualPruning", "prune")
        for name, m in trainable:
            _check_unwrapped(m, name)
        _check_int("start_step", start_step, 0)
        _check_int("end_step", end_step, start_step)
        _check_int("prune_every", prune_every, 1)
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not power > 0:
            raise ValueError(f"power must be a number > 0, got {power!r}")
        finals = _final_densities(final_density, [name for name, _ in trainable])
        self.final_nnz = []
        for (name, layer), density in zip(trainable, finals):
            final = layer.block * round(density * layer.in_features * layer.out_features / layer.block)
            if layer.constant_fan_in:  # whole rows of the connected outputs: each keeps one in-degree
                rows = _fan_in_rows(layer)
                final = rows * round(final / rows) if rows else 0
            if final > layer.nnz:
                raise ValueError(f"final_density {density:g} of {name} ({final} edges) is above its current density "
                                 f"{layer.density:.4g} ({layer.nnz} edges): gradual pruning only removes edges")
            self.final_nnz.append(final)
        _check_untied(trainable, layers if isinstance(layers, nn.Module) else None)
        optimizers = _optimizers(optimizer)
        _check_optimizer_holds(optimizers, trainable)
        self.layers = [m for _, m in trainable]
        self.optimizer = optimizer
        #: The optimizers whose per-edge state of the layers' weights every update carries across.
        self.optimizers = optimizers
        self.start_step, self.end_step, self.prune_every, self.power = start_step, end_step, prune_every, power
        self.start_nnz = [layer.nnz for layer in self.layers]
        self.steps = 0
        #: ``(step, [edges of each layer])`` at the start and after each update.
        self.history: list[tuple[int, list[int]]] = [(0, list(self.start_nnz))]
        #: Edges grown by each update of history: always 0 (as DynamicSparsity.regrown, for reports).
        self.regrown: list[int] = [0]
        self._sync = resolve_sync(process_group)
        self._hooks = self._sync.guard(self.layers) if self._sync is not None else []
        self._copies = FollowerCopies(self.layers)
        for module in followers:
            self.register_follower(module)

    def register_follower(self, module: nn.Module) -> None:
        """Remap ``module``'s copies of the layers with every update
        (:meth:`torch_sparse_metal.evolve.DynamicSparsity.register_follower`)."""
        self._copies.follow(module)

    def leave_behind(self, module: nn.Module) -> None:
        """Let updates run while ``module`` holds copies of the layers on their current topology (a snapshot)."""
        self._copies.leave(module)

    # -- schedule ------------------------------------------------------------------------------------------
    def progress_at(self, step: int) -> float:
        """The schedule's progress ``(step - start_step) / (end_step - start_step)``, clamped to [0, 1]."""
        if step >= self.end_step:
            return 1.0
        return max(step - self.start_step, 0) / (self.end_step - self.start_step)

    def target_nnz(self, index: int, step: int) -> int:
        """The edge count of layer ``index`` after an update at ``step``: ``N_f + (N_i - N_f) * (1 - p) ** power``
        rounded to whole vectors (``N_i``: its count when the schedule was built; ``N_f``: the final one)."""
        start, final, layer = self.start_nnz[index], self.final_nnz[index], self.layers[index]
        remaining = (1.0 - self.progress_at(step)) ** self.power
        unit = _fan_in_rows(layer) if layer.constant_fan_in else layer.block  # constant fan-in: whole rows
        return unit * round((final + (start - final) * remaining) / unit) if unit else 0

    def due(self, step: int) -> bool:
        """Whether ``step`` is an update step."""
        inside = self.start_step <= step <= self.end_step
        return inside and ((step - self.start_step) % self.prune_every == 0 or step == self.end_step)

    # -- the per-step call ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Advance one training step (call it after ``optimizer.step()``); prune when due. Returns True when it
        pruned (under torch.distributed: rebuild the DDP wrapper then)."""
        self.steps += 1
        if not self.due(self.steps):
            return False
        return self.update()

    def update(self) -> bool:
        """Prune every layer to its target count for the current step now (all plans made and checked before any
        layer changes). Returns False when no layer had anything to remove."""
        active = [(i, layer) for i, layer in enumerate(self.layers) if layer.weight.requires_grad]
        drops = [max(layer.nnz - self.target_nnz(i, self.steps), 0) for i, layer in active]
        if not any(drops):
            return False
        for device in {layer.weight.device for layer in self.layers}:
            check_index_errors(device)
        layers = [layer for _, layer in active]
        sync = self._sync
        plans = None
        if sync is None or sync.is_root:
            plans = [_plan_prune(layer, drop) for layer, drop in zip(layers, drops)]
        if sync is not None:
            plans = sync.share_plans(layers, plans, [(drop, 0) for drop in drops],
                                     f"gradual pruning at step {self.steps}")
        for layer in layers:
            _check_state_remappable(layer, self.optimizers)
        followers = self._copies.check(layers, f"the pruning update at step {self.steps}")
        for layer, (topology, edge_map) in zip(layers, plans):
            apply_update(layer, topology, edge_map, self.optimizers)
        apply_to_followers(followers, layers, plans)
        if sync is not None:
            mark_changed(layers)
        self.history.append((self.steps, [layer.nnz for layer in self.layers]))
        self.regrown.append(0)
        return True

    def remove(self) -> None:
        """Detach the distributed checks' hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"steps": self.steps, "start_nnz": list(self.start_nnz), "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the schedule; a malformed state raises (naming the field) and leaves it as it was."""
        if not isinstance(state, dict):
            raise ValueError(f"not a GradualPruning state: expected a dict, got {type(state).__name__}")
        try:
            steps = _count(state["steps"], "steps")
            start_nnz = [_count(n, "start_nnz") for n in state["start_nnz"]]
            history = [(_count(s, "history step"), [_count(v, "history edge count") for v in n])
                       for s, n in state["history"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a GradualPruning state: {type(exc).__name__}: {exc}") from None
        if len(start_nnz) != len(self.layers):
            raise ValueError(f"state has {len(start_nnz)} layers, this schedule has {len(self.layers)}")
        bad = [n for n, final in zip(start_nnz, self.final_nnz) if n < final]
        if bad:
            raise ValueError(f"state's starting edge counts {start_nnz} lie below the final counts {self.final_nnz}")
        self.steps, self.start_nnz, self.history = steps, start_nnz, history
        self.regrown = [0] * len(history)


def _fan_in_rows(layer: SparseLinear) -> int:
    """The outputs of a constant fan-in layer that have inputs (all of them when none has)."""
    fan = layer.fan_in()
    return int((fan > 0).sum()) if bool((fan > 0).any()) else layer.out_features


def _plan_prune(layer: SparseLinear, drop: int) -> tuple:
    """The plan removing ``drop`` edges: the smallest-magnitude ones of the layer, or, for a constant fan-in layer,
    of each output (``drop`` is then a whole number of rows)."""
    if not layer.constant_fan_in:
        return plan_update(layer, drop, 0)
    k = layer.topology.common_fan_in()
    per_output = drop // _fan_in_rows(layer)
    topology, edge_map, _ = plan_fan_in_update(layer, per_output, fan_in=k - per_output)
    return topology, edge_map


def _final_densities(final_density: float | Mapping[str, float], names: list[str]) -> list[float]:
    """One final density per trainable layer, from a number or a ``name -> density`` mapping, checked."""
    if isinstance(final_density, Mapping):
        missing = [name for name in names if name not in final_density]
        if missing:
            raise ValueError(f"final_density has no entry for {missing} (it names {sorted(final_density)})")
        values = [final_density[name] for name in names]
    else:
        values = [final_density] * len(names)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"final_density must be in [0, 1], got {value!r}")
    return [float(v) for v in values]
