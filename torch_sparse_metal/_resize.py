"""Give a ``Parameter`` data of another size while autograd graphs that used it may still be alive.

Two things of autograd's outlive a plain ``param.data = new`` of another shape:

- the parameter's gradient accumulator, shared by every graph that uses the parameter while one of them is alive,
  records the shape it was created for; a new graph built while an old one is still referenced (the previous
  step's ``loss``) would route a gradient of the new size into it, and autograd rejects that ("returned an invalid
  gradient"). ``set_data`` drops the accumulator when the dtype changes, so passing through another dtype first
  gives the new graph a fresh one;
- a graph built before the change saved the parameter itself (leaves are saved without a copy); unpacked after
  ``.data`` was replaced it would compute with the new values against the old topology. Bumping the version
  counter turns a backward through such a stale graph into torch's "modified by an inplace operation" error.

The parameter stays the same object, so optimizers, hooks registered on it and ``named_parameters`` keep working.
Its ``.grad`` belonged to the old data (another size, or the same size with other meanings) and is dropped.
"""

from __future__ import annotations

import torch

__all__ = ["replace_data"]


def replace_data(param: torch.Tensor, new: torch.Tensor) -> None:
    """Make ``new`` (same dtype and device) the data of ``param``; graphs built before cannot be back-propagated,
    and ``param.grad`` is set to None.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> stale = (p * p).sum()
        >>> replace_data(p, torch.ones(5))
        >>> (p * p).sum().backward(); p.grad.shape
        torch.Size([5])
    """
    with torch.no_grad():
        scratch = torch.float32 if param.dtype != torch.float32 else torch.float64
        param.data = torch.empty(0, dtype=scratch, device=param.device)  # drops the gradient accumulator
        param.data = new
        param.grad = None  # a gradient of the old data: accumulating into it, or stepping with it, would be wrong
    torch.autograd.graph.increment_version(param)  # saved copies of the old parameter fail in a stale backward
