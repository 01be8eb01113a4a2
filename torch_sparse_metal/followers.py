"""The deep copies of evolving layers that a topology update must remap with them, or refuse to leave behind.

``torch.optim.swa_utils.AveragedModel`` (and any EMA or teacher model made with ``copy.deepcopy``) holds a copy of
each ``SparseLinear`` whose weight is per edge, in the layer's edge order. An update reorders the layer's edges; a
copy left on the old order would, at its next average, combine the values of different connections position by
position (and, with ``use_buffers=False``, take the layer's new index buffers, so nothing looks wrong). So a
:class:`~torch_sparse_metal.evolve.DynamicSparsity` update remaps each registered copy with the layer's edge map, and
refuses to run while an unregistered copy is alive and still on the layer's topology.

``AveragedModel(model, use_buffers=True)`` averages every buffer too, the layers' int32 index buffers included:
torch's averages compute them in floating point and write them back truncated (an EMA of equal indices gives some
index minus one; above 2**24 float32 rounds them), or fail on the device's integer ``addcdiv_``. So an
``AveragedModel`` that holds a copy of a ``SparseLinear`` gets an ``update_parameters`` of its own (an instance
attribute, set when the copy is registered in it) that averages everything else as torch does and copies the index
buffers from the model exactly, as torch copies every buffer with ``use_buffers=False``.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ._copies import ancestors, copies_of
from .layer_buffers import structure_buffers
from .nn import SparseLinear

__all__ = ["FollowerCopies", "update_averaged_model"]

#: Layers some schedule updates: a copy that is one evolves on its own (a twin run), not as a follower.
_scheduled: weakref.WeakSet[SparseLinear] = weakref.WeakSet()


def _same_edges(a: SparseLinear, b: SparseLinear) -> bool:
    """Whether two layers have the same connections in the same order (their saved index buffers are equal)."""
    if (a.in_features, a.out_features, a.block) != (b.in_features, b.out_features, b.block):
        return False
    return all(x.shape == y.shape and torch.equal(x, y.to(x.device)) for x, y in ((a.row_ptr, b.row_ptr),
                                                                                (a.dst, b.dst)))


class FollowerCopies:
    """The copies of ``layers`` to remap at each update (followers) and those to leave alone (left behind)."""

    def __init__(self, layers: list[SparseLinear]) -> None:
        self._layers = {id(layer): layer for layer in layers}
        _scheduled.update(layers)
        self._follow: dict[int, tuple[SparseLinear, list[SparseLinear]]] = {}  # layer id -> (layer, its copies)
        self._left: set[int] = set()  # ids of copies left behind; kept alive by the module holding them
        self._held: list[nn.Module] = []  # the registered modules: their copies' ids stay valid

    def _copies_in(self, module: nn.Module, what: str) -> list[tuple[SparseLinear, SparseLinear]]:
        """``(layer, copy)`` for every copy of one of the layers that ``module`` holds."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"{what} must be an nn.Module holding copies of the layers (such as an AveragedModel), "
                            f"got {type(module).__name__}")
        found = []
        for copy in module.modules():
            if not isinstance(copy, SparseLinear) or id(copy) in self._layers:
                continue
            layer = next((a for a in ancestors(copy) if id(a) in self._layers), None)
            if layer is not None:
                found.append((layer, copy))
        if not found:
            raise ValueError(f"the {type(module).__name__} given as {what} holds no deep copy of the schedule's "
                             "layers (a copy made with copy.deepcopy of them or of their model, as AveragedModel "
                             "makes)")
        return found

    def follow(self, module: nn.Module) -> None:
        found = self._copies_in(module, "follower")
        for layer, copy in found:  # every copy checked before any is registered
            if not _same_edges(layer, copy):
                raise ValueError(f"the {type(module).__name__} holds a copy of a layer whose connections differ from "
                                 "the layer's (it was made before an update, or changed since): its values are in "
                                 "another edge order, which no update's edge map describes. Make it again from the "
                                 "model, then register it")
        for layer, copy in found:
            copies = self._follow.setdefault(id(layer), (layer, []))[1]
            if all(c is not copy for c in copies):
                copies.append(copy)
            self._left.discard(id(copy))
        self._held.append(module)

    def leave(self, module: nn.Module) -> None:
        found = self._copies_in(module, "module to leave behind")
        for layer, copy in found:
            if id(layer) in self._follow:
                self._follow[id(layer)][1][:] = [c for c in self._follow[id(layer)][1] if c is not copy]
            self._left.add(id(copy))
        self._held.append(module)

    def check(self, layers: list[SparseLinear], update: str) -> dict[int, list[SparseLinear]]:
        """The followers of each of ``layers`` (by layer id), after checking that each is still on its layer's
        topology and that no other live copy is: raises before anything changes."""
        followers: dict[int, list[SparseLinear]] = {}
        for layer in layers:
            mine = self._follow.get(id(layer), (layer, []))[1]
            for copy in mine:
                if not _same_edges(layer, copy):
                    raise ValueError(f"{update}: a registered follower's copy of a {layer.in_features} -> "
                                     f"{layer.out_features} layer no longer has the layer's connections (its "
                                     "topology was changed outside the schedule), so the update's edge map does not "
                                     "describe its values. Nothing was changed")
            registered = {id(c) for c in mine} | self._left
            stray = [c for c in copies_of(layer) if id(c) not in registered and c not in _scheduled
                     and _same_edges(layer, c)]
            if stray:
                raise ValueError(
                    f"{update}: a deep copy of a {layer.in_features} -> {layer.out_features} SparseLinear being "
                    "updated is alive (an AveragedModel / EMA or another copy of the model). The update reorders the "
                    "layer's edges; averaging its weight into that copy position by position would mix different "
                    "connections. Register the copy's module with DynamicSparsity(..., followers=[ema]) or "
                    "evo.register_follower(ema) to remap it with every update, or, for a snapshot that keeps its "
                    "topology, evo.leave_behind(snapshot); or delete it. Nothing was changed")
            followers[id(layer)] = mine
        return followers


def update_averaged_model(averaged: AveragedModel, model: nn.Module) -> None:
    """``averaged.update_parameters(model)`` (the class's), with every ``SparseLinear`` index buffer and shape record
    copied from ``model`` exactly instead of averaged when ``averaged.use_buffers`` is True (module docstring). The
    layers are paired in module order, as torch pairs their tensors; a pair whose index buffers differ in shape
    (copies on another topology) is refused before anything changes. ``AveragedModel``'s holding a ``SparseLinear``
    call this from their own ``update_parameters``.

    Example:
        >>> from torch.optim.swa_utils import get_ema_multi_avg_fn
        >>> from torch_sparse_metal import SparseLinear
        >>> model = nn.Sequential(SparseLinear(16, 8, density=0.5))
        >>> ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        >>> ema.update_parameters(model); ema.update_parameters(model)  # calls update_averaged_model
        >>> torch.equal(ema.module[0].perm, model[0].perm)
        True
    """
    update = functools.partial(type(averaged).update_parameters, averaged, model)
    if not averaged.use_buffers:
        return update()
    pairs = [(mine, theirs) for mine, theirs in zip(averaged.module.modules(), model.modules())
             if isinstance(mine, SparseLinear) and isinstance(theirs, SparseLinear)]
    for mine, theirs in pairs:
        for name in structure_buffers(mine):
            a, b = mine._buffers[name], theirs._buffers.get(name)
            if b is None or a.shape != b.shape:
                raise ValueError(f"AveragedModel(use_buffers=True) pairs a SparseLinear copy with a layer of another "
                                 f"topology ({name}: {tuple(a.shape)} against "
                                 f"{None if b is None else tuple(b.shape)}); its values would be averaged across "
                                 "different connections. Nothing was changed")
    held = [(layer, layer._buffers) for pair in pairs for layer in pair]
    try:  # the index buffers out of sight of torch's averaging, every other buffer in its place
        for layer, buffers in held:
            index = set(structure_buffers(layer))
            layer.__dict__["_buffers"] = {k: v for k, v in buffers.items() if k not in index}
        update()
    finally:
        for layer, buffers in held:
            layer.__dict__["_buffers"] = buffers
    with torch.no_grad():
        for mine, theirs in pairs:
            for name in structure_buffers(mine):
                mine._buffers[name].copy_(theirs._buffers[name].to(mine._buffers[name].device))


def _route_averaged_model(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """A module registration hook: an ``AveragedModel`` given a copy that holds a ``SparseLinear`` updates through
    :func:`update_averaged_model`."""
    if not isinstance(module, AveragedModel) or not isinstance(submodule, nn.Module):
        return
    if "update_parameters" not in module.__dict__ and any(isinstance(m, SparseLinear) for m in submodule.modules()):
        module.__dict__["update_parameters"] = functools.partial(update_averaged_model, module)


torch.nn.modules.module.register_module_module_registration_hook(_route_averaged_model)
