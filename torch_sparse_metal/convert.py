"""Turn an existing model's ``nn.Linear`` layers into ``SparseLinear`` ones, in one call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .nn import SparseLinear
from .topology import CSRTopology

__all__ = ["sparsify"]

METHODS = ("magnitude", "random")


def sparsify(
    model: nn.Module,
    density: float | None = None,
    *,
    method: str = "magnitude",
    filter: Callable[[str, nn.Linear], bool] | None = None,  # noqa: A002 - the name users expect
    masks: dict[str, torch.Tensor] | None = None,
    backward: str = "auto",
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (those ``filter(name, module)`` accepts) by a ``SparseLinear``
    that keeps the dense weights on the connections it keeps, and the bias; returns ``model``, changed in place.

    Which connections: ``masks[name]`` (a bool ``[out, in]`` mask) where given, else ``round(density * in * out)``
    of them per layer, the largest in magnitude (``method="magnitude"``) or drawn uniformly (``"random"``, from
    ``generator``). Every layer to replace is checked before any is replaced.

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> model = sparsify(model, density=0.25, filter=lambda name, m: m.out_features > 2)
        >>> [type(m).__name__ for m in model]
        ['SparseLinear', 'ReLU', 'Linear']
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    masks = dict(masks or {})
    chosen = [(name, m) for name, m in model.named_modules()
              if type(m) is nn.Linear and (filter is None or filter(name, m))]
    unknown = set(masks) - {name for name, _ in chosen}
    if unknown:
        raise ValueError(f"masks given for {sorted(unknown)}, which are not nn.Linear layers chosen for sparsify")
    if density is None and any(name not in masks for name, _ in chosen):
        raise ValueError("pass density (the fraction of connections to keep) or a mask for every layer")
    plans = []
    for name, linear in chosen:
        mask = masks.get(name)
        if mask is None:
            mask = _mask(linear.weight.detach(), density, method, generator)
        elif mask.shape != linear.weight.shape or mask.dtype != torch.bool:
            raise ValueError(f"mask for {name!r} must be a bool tensor of shape {tuple(linear.weight.shape)}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        plans.append((name, SparseLinear.from_dense(linear, mask, backward=backward)))
    for name, sparse in plans:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, sparse)
    return model


def _mask(weight: torch.Tensor, density: float, method: str, generator: torch.Generator | None) -> torch.Tensor:
    out_features, in_features = weight.shape
    k = CSRTopology.random_edge_count(in_features, out_features, density)
    mask = torch.zeros(weight.numel(), dtype=torch.bool, device=weight.device)
    if method == "magnitude":
        mask[weight.abs().flatten().topk(k).indices] = True
    else:
        mask[torch.randperm(weight.numel(), generator=generator)[:k].to(weight.device)] = True
    return mask.view(out_features, in_features)
