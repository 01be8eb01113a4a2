"""Which optimizers' state of a weight follows its current edge order; a step of any other is refused.

A topology update (:func:`torch_sparse_metal.evolve.apply_update`) reorders a layer's edges and remaps the per-edge
state of the optimizers it is given. An optimizer it was not given that also holds the weight (a second optimizer
over the same parameters, one of a model's copies) keeps its moments on the old edge order: at its next step it
would pair them with other connections silently (or, when the edge count changed, fail inside torch). torch keeps no
list of optimizers, so the update cannot find that one; instead the update records, per weight, the optimizers
whose state it remapped (:func:`mark_remapped`), and a global optimizer step pre-hook (installed on the first
update) refuses a step of an optimizer that holds per-edge state of such a weight without being one of them, before
the step changes anything. An optimizer with no per-edge state of the weight yet (its state starts at the step, on
the new edges) joins the weight's optimizers. Weights and optimizers are held weakly.

Example:
    >>> weight = torch.nn.Parameter(torch.randn(6))
    >>> given, other = torch.optim.Adam([weight]), torch.optim.Adam([weight])
    >>> weight.grad = torch.randn(6); given.step(); other.step()
    >>> mark_remapped(weight, [given])  # what an update does once it has remapped given's state
    >>> given.step()
    >>> other.step()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: Adam holds per-edge state ('exp_avg', 'exp_avg_sq') of a SparseLinear weight whose edges a ...
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["mark_remapped"]

#: id(weight) -> (a weak reference to the weight, the optimizers whose state of it is on its current edge order);
#: keyed by id, as tensors compare elementwise.
_current: dict[int, tuple[weakref.ref, weakref.WeakSet]] = {}
_hook: object = None


def mark_remapped(weight: torch.Tensor, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Record that ``weight``'s edges were reordered and the state of ``optimizers`` (only) remapped with them."""
    global _hook
    key = id(weight)

    def forget(ref: weakref.ref) -> None:  # the weight is gone; its id may be another tensor's by now
        if _current.get(key, (None,))[0] is ref:
            del _current[key]

    _current[key] = (weakref.ref(weight, forget), weakref.WeakSet(optimizers))
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)


def _per_edge(state: dict) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() > 1]


def _check_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """The global step pre-hook: refuse a step of an optimizer holding stale per-edge state (module docstring)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return
    for ref, current in list(_current.values()):
        weight = ref()
        if weight is None or optimizer in current:
            continue
        stale = _per_edge(state[weight]) if weight in state else []
        if not stale:  # no per-edge state yet: what it keeps from now on is on the new edges
            current.add(optimizer)
            continue
        raise RuntimeError(
            f"{type(optimizer).__name__} holds per-edge state ({', '.join(map(repr, stale))}) of a SparseLinear "
            f"weight whose edges a topology update reordered, but the update was not given this optimizer, so that "
            "state is still on the old edge order and this step would pair it with other connections. Give the "
            "update every optimizer that holds the layer's weight: DynamicSparsity(model, [optimizer, other], ...), "
            "GradualPruning(model, [optimizer, other], ...) or apply_update(layer, topology, edge_map, [optimizer, "
            "other]); or drop this optimizer's state of it (optimizer.state.pop(weight)). The step did not run")
