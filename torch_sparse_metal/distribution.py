"""How a global density is shared among a model's layers: uniform, Erdős–Rényi (ER/ERK) or global magnitude.

``density`` is the fraction of all the layers' connections to keep; a distribution decides each layer's share:

- ``"uniform"``: every layer gets ``density`` (each rounds its own edge count); layers kept dense take their full
  share and the others get one lower density that keeps the total at the target.
- ``"er"`` / ``"erk"``: a layer of ``out x in`` connections gets a density proportional to ``(in + out) / (in * out)``
  (Erdős–Rényi, Mocanu et al. 2018; ERK, Evci et al. 2020, "Rigging the Lottery", which adds a convolution's kernel
  dimensions to the sum: for linear layers the two are the same). The scale ``eps`` is chosen so that the kept
  connections add up to the target. A layer whose density ``eps * (in + out) / (in * out)`` would exceed 1 becomes
  dense and ``eps`` is solved again for the rest, until none exceeds 1 (RigL's ``get_sparsities``).
- ``"global"``: one magnitude threshold across the layers: the target count of largest-magnitude weights of all
  layers together (vectors of ``block`` outputs: by L2 norm). Needs the weights.

Layers named in ``keep_dense`` keep every connection and count toward the target. Except for plain uniform, the
layers' edge counts (whole vectors) are apportioned so that they add up to exactly ``round(density * total)``
(largest remainders), and the returned densities are those counts over each layer's size.

Example:
    >>> shapes = {"a": (256, 64), "b": (64, 256), "c": (10, 64)}  # (out, in), as a weight
    >>> d = layer_densities(shapes, 0.1, "erk")
    >>> {k: round(v, 4) for k, v in d.items()}
    {'a': 0.0914, 'b': 0.0914, 'c': 0.5406}
    >>> sum(round(d[k] * o * i) for k, (o, i) in shapes.items()), round(0.1 * sum(o * i for o, i in shapes.values()))
    (3341, 3341)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

__all__ = ["DISTRIBUTIONS", "layer_densities"]

DISTRIBUTIONS = ("uniform", "er", "erk", "global")


def layer_densities(
    shapes: Mapping[str, tuple[int, int]],
    density: float,
    distribution: str = "uniform",
    *,
    keep_dense: Iterable[str] = (),
    weights: Mapping[str, torch.Tensor] | None = None,
    block: int = 1,
) -> dict[str, float]:
    """Each layer's density (``name -> density``) for a global ``density`` over layers of ``shapes`` (``name ->
    (out_features, in_features)``); see the module docstring. ``weights`` (``name -> [out, in]`` tensor) is needed
    for ``"global"``. ``block`` V counts connections in vectors of V outputs (every ``out`` a multiple of V)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be a number in [0, 1], got {density!r}")
    dense = set(keep_dense)
    unknown = sorted(dense - set(shapes))
    if unknown:
        raise ValueError(f"keep_dense names {unknown}, which are not among the layers {sorted(shapes)}")
    for name, (out_f, _) in shapes.items():
        if out_f % block:
            raise ValueError(f"layer {name!r} has {out_f} outputs, not a multiple of block={block}")
    if distribution == "uniform" and not dense:
        return {name: float(density) for name in shapes}
    units = {name: out_f // block * in_f for name, (out_f, in_f) in shapes.items()}  # connections, in vectors
    target = round(density * sum(units.values()))
    held = sum(units[name] for name in dense)
    if held > target:
        raise ValueError(f"the layers kept dense ({sorted(dense)}) hold {held * block} connections, more than the "
                         f"{target * block} that density={density} allows over all {sum(units.values()) * block}: "
                         "raise density or keep fewer layers dense")
    if distribution == "global":
        counts = _global_counts(shapes, units, dense, target - held, weights, block)
    else:
        share = _erdos_renyi_shares if distribution in ("er", "erk") else _uniform_shares
        counts = _apportion(share(shapes, units, dense, target - held), units, target - held)
    counts.update({name: units[name] for name in dense})
    return {name: counts[name] / units[name] if units[name] else 1.0 for name in shapes}


def _uniform_shares(shapes, units, dense, budget) -> dict[str, float]:
    rest = sum(u for name, u in units.items() if name not in dense)
    return {name: budget * u / rest if rest else 0.0 for name, u in units.items() if name not in dense}


def _erdos_renyi_shares(shapes, units, dense, budget) -> dict[str, float]:
    """RigL's iteration: solve ``eps`` for the layers still sparse; any layer it would fill past 1 becomes dense
    (those of the largest raw density first), and ``eps`` is solved again."""
    sparse = [name for name in shapes if name not in dense]
    raw = {name: (shapes[name][0] + shapes[name][1]) / (shapes[name][0] * shapes[name][1]) for name in sparse}
    full: set[str] = set()
    while True:
        live = [name for name in sparse if name not in full]
        left = budget - sum(units[name] for name in full)
        if not live:
            return {name: float(units[name]) for name in full}
        eps = left / sum(raw[name] * units[name] for name in live)
        top = max(raw[name] for name in live)
        if eps * top <= 1.0:
            shares = {name: eps * raw[name] * units[name] for name in live}
            shares.update({name: float(units[name]) for name in full})
            return shares
        full.update(name for name in live if raw[name] == top)


def _apportion(shares: dict[str, float], units: dict[str, int], budget: int) -> dict[str, int]:
    """Whole counts from real ``shares`` adding up to ``budget``: floors, then one more to the largest remainders
    (never past a layer's size)."""
    counts = {name: min(math.floor(share), units[name]) for name, share in shares.items()}
    order = sorted(shares, key=lambda n: (-(shares[n] - counts[n]), n))
    missing = budget - sum(counts.values())
    for name in order:
        if missing <= 0:
            break
        if counts[name] < units[name]:
            counts[name] += 1
            missing -= 1
    return counts


def _global_counts(shapes, units, dense, budget, weights, block) -> dict[str, int]:
    """How many of each sparse layer's vectors are among the ``budget`` largest (L2 norm) of all sparse layers."""
    sparse = [name for name in shapes if name not in dense]
    if weights is None or any(name not in weights for name in sparse):
        raise ValueError("distribution='global' ranks the weights of all layers together: pass weights= with each "
                         "layer's [out, in] weight")
    scores = []
    for name in sparse:
        w = weights[name].detach()
        if tuple(w.shape) != tuple(shapes[name]):
            raise ValueError(f"weights[{name!r}] has shape {tuple(w.shape)}, the layer is {tuple(shapes[name])}")
        if w.device.type == "meta":
            raise ValueError(f"distribution='global' needs the values of {name!r}, which is on the meta device")
        out_f, in_f = w.shape
        scores.append(w.float().reshape(out_f // block, block, in_f).norm(dim=1).flatten().cpu())
    counts = dict.fromkeys(sparse, 0)
    if budget and scores:
        owner = torch.cat([torch.full((s.numel(),), i) for i, s in enumerate(scores)])
        picked = owner[torch.topk(torch.cat(scores), budget).indices]
        for i, n in enumerate(torch.bincount(picked, minlength=len(sparse)).tolist()):
            counts[sparse[i]] = n
    return counts
