"""Which ``SparseLinear`` layers were deep-copied from which.

A deep copy of a layer (``copy.deepcopy`` of it or of a model holding it, as ``AveragedModel`` and EMA helpers
make) holds per-edge values in the order of the layer's edges at the time of the copy. When a topology update
reorders the layer's edges, such a copy must be remapped with it or refused
(:meth:`torch_sparse_metal.evolve.DynamicSparsity.register_follower`): the registry lets the update find the copies
that are still alive. It holds weak references only, so a copy that is dropped is forgotten.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

from torch import nn

__all__ = ["note_copy", "copies_of", "ancestors"]

_children: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = weakref.WeakKeyDictionary()
_parent: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()


def note_copy(source: nn.Module, copy: nn.Module) -> None:
    """Record that ``copy`` was deep-copied from ``source``."""
    _children.setdefault(source, weakref.WeakSet()).add(copy)
    _parent[copy] = weakref.ref(source)


def copies_of(layer: nn.Module) -> Iterator[nn.Module]:
    """The live deep copies of ``layer``, and copies of those, each once."""
    seen: set[int] = {id(layer)}
    pending = [layer]
    while pending:
        for child in list(_children.get(pending.pop(), ())):
            if id(child) not in seen:
                seen.add(id(child))
                pending.append(child)
                yield child


def ancestors(copy: nn.Module) -> Iterator[nn.Module]:
    """The layer ``copy`` was deep-copied from, the one that was copied from, and so on, while alive."""
    ref = _parent.get(copy)
    while ref is not None and (source := ref()) is not None:
        yield source
        ref = _parent.get(source)
