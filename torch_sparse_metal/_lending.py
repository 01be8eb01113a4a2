"""Whether a ``SparseLinear``'s ``row_ptr`` and ``dst`` may have been written by code holding them outside the layer.

``state_dict()`` hands out the live index buffers (detached aliases of their storage, as for every module), and so
does ``load_state_dict(assign=True)``, which makes the checkpoint's tensors the layer's. Whoever holds them can write
them in place: ``torch.distributed.checkpoint``'s ``dcp.load`` does exactly that. The eager layer notices through the
buffers' version counters, but a model compiled with ``torch.compile`` runs no Python per call and Dynamo does not
guard on version counters. It does guard on plain Python attributes that the traced code reads: :class:`Lending`
holds two of them, so a compiled layer takes another graph (one that derives its index arrays again from ``row_ptr``
and ``dst``, on the device) exactly while a lent tensor may still be written, and its steady-state graph otherwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["Lending"]


class Lending:
    """The lending state of one layer's ``row_ptr`` and ``dst``.

    ``pending``: the derived index arrays must be derived again before the next call (set when the sources are lent,
    cleared by a call once no lent tensor is alive). ``alive``: a lent tensor object is still referenced, so a write
    may come after any call. Tensors lent under their own identity (``state_dict(keep_vars=True)`` returns the
    buffers themselves, alive as long as the layer) make ``pending`` only: the next call derives once.

    Example:
        >>> lending = Lending()
        >>> view = torch.zeros(3)
        >>> lending.lend([view], tracked=True)
        >>> lending.pending, lending.alive
        (True, True)
        >>> del view
        >>> lending.alive
        False
        >>> lending.settle(); lending.pending
        False
    """

    def __init__(self) -> None:
        self.pending = False
        self.alive = False
        self._count = 0

    def lend(self, tensors: Iterable[torch.Tensor], *, tracked: bool) -> None:
        """Note ``tensors`` as held outside the layer; ``tracked``: follow each until it is garbage collected."""
        self.pending = True
        if not tracked:
            return
        for tensor in tensors:
            self._count += 1
            weakref.finalize(tensor, self._returned)
        self.alive = self._count > 0

    def _returned(self) -> None:
        self._count -= 1
        self.alive = self._count > 0

    def settle(self) -> None:
        """After the derived arrays were made from the current sources: nothing more is pending unless a lent tensor
        is still alive (it may be written before a later call)."""
        if not self.alive:
            self.pending = False
