"""Density-aware hyperparameters: SµPar's Adam learning rate and initialisation for sparse hidden layers.

"Sparse maximal update parameterization: A holistic approach to sparse training dynamics" (Dey et al., Cerebras,
2024, arXiv:2405.15743) extends µP to density: with a width multiplier ``m_d = width / base_width`` and a density
multiplier ``m_rho = density / base_density``, a hidden weight's initial variance is ``sigma_base**2 / (m_d *
m_rho)`` and its Adam learning rate ``eta_base / (m_d * m_rho)``, so that hyperparameters tuned on the base model
(``base_density``, usually dense: 1) carry over to other densities. The intuition: an output sums ``density *
in_features`` terms, the effective fan-in, and both rules follow it.

``SparseLinear.reset_parameters`` already draws each output's weights with its actual fan-in (uniform in
``±1/sqrt(fan_in(o))``), which matches SµPar's init scaling in expectation; :func:`sparse_init_std` gives the rule
for a custom initialiser. Only the layers whose density differs from the base are scaled: embeddings and output
layers, which SµPar leaves to µP, are not touched here.

Example:
    >>> sparse_lr_scale(0.25)  # a quarter as many connections: four times the Adam learning rate
    4.0
    >>> round(sparse_init_std(0.02, 0.25), 6)
    0.04
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from .nn import SparseLinear

__all__ = ["density_param_groups", "sparse_init_std", "sparse_lr_scale"]


def _positive(name: str, value: object, most: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= most:
        bound = f"in (0, {most:g}]" if math.isfinite(most) else "> 0 and finite"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")
    return float(value)


def sparse_lr_scale(density: float, *, base_density: float = 1.0, width_multiplier: float = 1.0) -> float:
    """SµPar's Adam learning-rate multiplier for a hidden layer of ``density``: ``1 / (m_d * m_rho)`` with
    ``m_rho = density / base_density`` and ``m_d = width_multiplier``.

    Example:
        >>> sparse_lr_scale(0.1, base_density=0.5, width_multiplier=2.0)  # 1 / (2 * 0.2)
        2.5
    """
    rho = _positive("density", density, 1.0) / _positive("base_density", base_density, 1.0)
    return 1.0 / (_positive("width_multiplier", width_multiplier) * rho)


def sparse_init_std(base_std: float, density: float, *, base_density: float = 1.0,
                    width_multiplier: float = 1.0) -> float:
    """SµPar's initial standard deviation of a hidden layer's weights: ``base_std / sqrt(m_d * m_rho)`` (the
    variance ``base_std**2 / (m_d * m_rho)``).

    Example:
        >>> sparse_init_std(0.02, 1.0)  # the base model itself
        0.02
    """
    _positive("base_std", base_std)
    return base_std * math.sqrt(sparse_lr_scale(density, base_density=base_density,
                                                width_multiplier=width_multiplier))


def density_param_groups(model: nn.Module | Iterable[nn.Parameter], lr: float, *, base_density: float = 1.0,
                         width_multiplier: float = 1.0) -> list[dict]:
    """Optimizer parameter groups giving each ``SparseLinear`` weight of ``model`` SµPar's Adam learning rate
    ``lr * sparse_lr_scale(layer.density, ...)`` (one group per layer, ``"name"`` naming it) and every other
    parameter (biases, dense layers) ``lr``, for ``torch.optim.Adam(density_param_groups(model, lr))``.

    The scale is taken from each layer's density when called: a schedule that changes densities (``grow_to``,
    gradual pruning) leaves the groups at the densities they were built with.

    Example:
        >>> model = nn.Sequential(SparseLinear(64, 64, density=0.25), nn.ReLU(), nn.Linear(64, 10))
        >>> [(g.get("name", "rest"), g["lr"]) for g in density_param_groups(model, 1e-3)]
        [('0', 0.004), ('rest', 0.001)]
    """
    _positive("lr", lr)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    groups, seen = [], set()
    for name, module in model.named_modules():
        if isinstance(module, SparseLinear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            scale = sparse_lr_scale(module.density, base_density=base_density, width_multiplier=width_multiplier)
            groups.append({"params": [module.weight], "lr": lr * scale, "name": name or type(module).__name__})
    rest = [p for p in model.parameters() if id(p) not in seen]
    if rest:
        groups.append({"params": rest, "lr": lr})
    return groups
