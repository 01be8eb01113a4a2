"""Topology updates that keep a constant fan-in: drop and regrow per output, and SRigL's neuron ablation.

A constant fan-in layer (``SparseLinear(..., constant_fan_in=True)``; SRigL, Lasby et al. 2024, "Dynamic Sparse
Training with Structured Sparsity", ICLR 2024) has one in-degree ``k`` for every output. An update here drops the
``drop`` smallest-magnitude edges *of each output* and grows as many per output, at random (SET) or where the dense
gradient ``|grad_out^T @ x|`` is largest among that output's absent connections (RigL), so every output ends with
``k`` edges again. Edges present before the update are never regrown by it, as in :func:`~.evolve.plan_update`.

Neuron ablation (``min_salient``, SRigL's ``min_salient_weights_per_neuron``): an output's salient weights are
those an unstructured update of the layer would keep or grow there: its edges among the layer's ``nnz - D``
largest magnitudes (``D`` the update's total drop) and, for RigL, its absent connections among the layer's ``D``
largest dense-gradient scores. An output with fewer than ``min_salient`` is ablated (left without inputs) and its
edges go to the others: the fan-in becomes ``total // active`` (SRigL's rule, ``total`` the layer's edge count
when the schedule was built, so the count never drifts below it by more than ``active - 1``). No output can hold
more than ``in_features - drop`` edges (it must regrow its drop among connections absent before), so at least
``ceil(total / (in_features - drop))`` outputs stay active: the ones with the most salient weights when too few
reach ``min_salient``. An ablated output comes back when it has enough salient weights again (RigL only: SET has
no gradient to find them).

A layer of ``block`` V (vectors of V consecutive outputs) is constant fan-in when every group of V outputs has the
same number ``k`` of vectors, which gives each output ``k`` inputs. Its updates are the same, over vectors: each
group drops its ``drop`` vectors of smallest L2 norm and grows as many, at random or by the L2 norm over the V lanes
of the dense gradient (as :func:`~.evolve.plan_update` ranks vectors); a group's salient weights are counted in
vectors, and ablation removes a whole group.

Example:
    >>> layer = SparseLinear(32, 8, density=0.25, constant_fan_in=True, generator=torch.Generator().manual_seed(0))
    >>> topology, edge_map, report = plan_fan_in_update(layer, 2, generator=torch.Generator().manual_seed(1))
    >>> topology.fan_in().tolist(), report.fan_in, int(edge_map.grown.numel())
    ([8, 8, 8, 8, 8, 8, 8, 8], 8, 16)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .nn import SparseLinear
from .topology import (
    CSRTopology,
    EdgeMap,
    check_constant_fan_in,
    check_generator,
    check_rigl_grad,
    element_edge_map,
    updated_topology,
)

__all__ = ["FanInReport", "plan_fan_in_update"]


@dataclass(frozen=True)
class FanInReport:
    """What a constant fan-in update does to the layer's outputs: the in-degree of the active ones after it
    (``fan_in``), how many are active, and which outputs it ablates (``ablated``) or brings back (``revived``)."""

    fan_in: int
    active: int
    ablated: list[int]
    revived: list[int]


def plan_fan_in_update(
    layer: SparseLinear,
    drop: int,
    *,
    mode: str = "set",
    grad: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    chunk: int = 256,
    grad_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    min_salient: int | None = None,
    total: int | None = None,
    fan_in: int | None = None,
) -> tuple[CSRTopology, EdgeMap, FanInReport]:
    """The topology after each active output of the constant fan-in ``layer`` drops its ``drop`` smallest-magnitude
    edges and grows new ones up to the common fan-in (module docstring), with its edge map and a
    :class:`FanInReport`. Changes nothing; :func:`~.evolve.apply_update` applies it.

    ``mode``, ``grad``, ``generator``, ``chunk`` and ``grad_reduce`` are those of :func:`~.evolve.plan_update`.
    ``min_salient`` (an integer >= 1, or None for no ablation) turns on neuron ablation; ``total`` is the edge count
    it shares among the active outputs (default: the layer's). ``fan_in`` (without ablation) is the in-degree the
    outputs end with (default: the one they have; gradual pruning passes a smaller one and ``drop = k - fan_in``,
    so that nothing grows).

    A layer of ``block`` V is updated per group of V outputs, over vectors (module docstring): ``drop``, ``fan_in``
    and ``min_salient`` count vectors of a group (inputs of each of its outputs), ``total`` counts edges (a
    multiple of V), and the report names outputs (an ablated group's V outputs).
    """
    _check_arguments(layer, drop, mode, grad, generator, chunk, min_salient, total)
    if fan_in is not None and (isinstance(fan_in, bool) or not isinstance(fan_in, int)
                               or not 0 <= fan_in <= layer.in_features):
        raise ValueError(f"fan_in must be an integer in [0, in_features={layer.in_features}] or None, got {fan_in!r}")
    if fan_in is not None and min_salient is not None:
        raise ValueError("fan_in and min_salient exclude each other: with ablation the fan-in is total // active")
    block = layer.block
    units = layer.topology.vectors if block > 1 else layer.topology  # what is dropped and grown: edges, or vectors
    in_f, out_f = units.in_features, units.out_features  # out_f: outputs, or groups of V outputs
    device = units.device
    fan = units.fan_in()
    k = units.common_fan_in()
    was_active = fan > 0 if k else torch.ones(out_f, dtype=torch.bool, device=device)
    if drop > k:
        raise ValueError(f"cannot drop {drop} edges of each output: the outputs have {k}")
    total = (layer.nnz if total is None else total) // block
    weight = layer.weight.detach().float()
    magnitude = weight.view(-1, block).norm(dim=1) if block > 1 else weight.abs()
    if min_salient is None:
        active, fan_after = was_active, k if fan_in is None else fan_in
        if fan_after - min(k - drop, fan_after) > in_f - k:
            raise ValueError(f"each output has {k} of {in_f} inputs: dropping {drop} and growing back to {fan_after} "
                             f"needs {fan_after - (k - drop)} of the {in_f - k} connections absent before the update "
                             "(an update never regrows one that was present)")
    else:
        dropped = drop * int(was_active.sum())
        salient = _salient_counts(units, magnitude, dropped, mode, grad, chunk, grad_reduce, block)
        active = _choose_active(salient, was_active, min_salient, total, in_f - drop)
        fan_after = total // int(active.sum())
    # Each output keeps its largest edges: min(k - drop, fan_after) of an output active before and after, none of
    # one ablated or revived; and grows up to fan_after among the connections absent before the update.
    keep_each = min(k - drop, fan_after)
    rows = torch.nonzero(was_active).flatten()
    by_row = units.perm.long().view(rows.numel(), k)  # by-destination order: each active output's k edges
    keep_rows = active[rows]
    top = torch.topk(magnitude[by_row], keep_each, dim=1, sorted=False).indices if keep_each else by_row[:, :0]
    kept = torch.gather(by_row, 1, top)[keep_rows].reshape(-1)
    grow = torch.where(was_active, fan_after - keep_each, fan_after) * active
    new_keys = _grow_per_output(units, grow, mode, grad, generator, chunk, grad_reduce, block)
    new_topology, edge_map = updated_topology(units, kept, new_keys)
    if block > 1:
        new_topology, edge_map = CSRTopology.from_vectors(new_topology, block), element_edge_map(edge_map, block)
        was_active, active = was_active.repeat_interleave(block), active.repeat_interleave(block)  # per output
    report = FanInReport(fan_after, int(active.sum()), torch.nonzero(was_active & ~active).flatten().tolist(),
                         torch.nonzero(active & ~was_active).flatten().tolist())
    return new_topology, edge_map, report


def _check_arguments(layer, drop, mode, grad, generator, chunk, min_salient, total) -> None:
    if not isinstance(layer, SparseLinear):
        raise TypeError(f"layer must be a SparseLinear, got {type(layer).__name__}")
    if not layer.constant_fan_in:
        raise ValueError("plan_fan_in_update keeps a constant fan-in: the layer is not a constant fan-in layer "
                         "(build it with constant_fan_in=True); evolve.plan_update updates any layer")
    check_constant_fan_in(layer.topology, "the layer's topology")
    for name, value, low in (("drop", drop, 0), ("chunk", chunk, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if min_salient is not None and (isinstance(min_salient, bool) or not isinstance(min_salient, int)
                                    or min_salient < 1):
        raise ValueError(f"min_salient must be an integer >= 1 or None, got {min_salient!r}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"total must be an integer >= 0 or None, got {total!r}")
    if total is not None and total > layer.in_features * layer.out_features:
        raise ValueError(f"total={total} exceeds the {layer.in_features * layer.out_features} connections")
    if total is not None and total % layer.block:
        raise ValueError(f"total={total} is not a whole number of vectors: the layer has block={layer.block}")
    check_generator(generator)
    if mode not in ("set", "rigl"):
        raise ValueError(f"mode must be 'set' or 'rigl', got {mode!r}")
    if mode == "rigl":
        if grad is None:
            raise RuntimeError("RigL regrowth needs the layer's input and output gradient from a training step")
        check_rigl_grad(grad, layer.topology)


def _salient_counts(topology: CSRTopology, magnitude: torch.Tensor, dropped: int, mode: str, grad, chunk: int,
                    grad_reduce, block: int) -> torch.Tensor:
    """Per output (``topology`` over vectors, for ``block`` > 1: per group): its edges among the ``nnz - dropped``
    largest magnitudes, plus (RigL) its absent connections among the ``dropped`` largest dense-gradient scores."""
    out_f = topology.out_features
    survivors = torch.topk(magnitude, topology.nnz - dropped, sorted=False).indices
    counts = torch.bincount(topology.dst.long()[survivors], minlength=out_f)
    if mode == "rigl" and dropped:  # the layer's `dropped` best absent connections, a running top over chunks
        best = torch.empty(0, device=magnitude.device)
        owner = torch.empty(0, dtype=torch.long, device=magnitude.device)
        for o0, score in _scores(topology, "rigl", grad, None, chunk, grad_reduce, block):
            top = torch.topk(score.reshape(-1), min(dropped, score.numel()))
            best, order = torch.topk(torch.cat([best, top.values]), min(dropped, best.numel() + top.values.numel()))
            owner = torch.cat([owner, top.indices // topology.in_features + o0])[order]
        counts += torch.bincount(owner, minlength=out_f)
    return counts


def _choose_active(salient: torch.Tensor, was_active: torch.Tensor, min_salient: int, total: int,
                   most: int) -> torch.Tensor:
    """The outputs that stay (or become) active: those with at least ``min_salient`` salient weights, topped up to
    ``ceil(total / most)`` (no output may hold more than ``most`` edges) by salient count, then by having been
    active, then by index."""
    out_f = salient.numel()
    need = math.ceil(total / most) if most > 0 else out_f
    if need > out_f or (total and most <= 0):
        raise ValueError(f"the layer's {total} edges do not fit {out_f} outputs of at most {most} new inputs each")
    active = salient >= min_salient
    short = need - int(active.sum())
    if short > 0:
        rank = salient.double() * 2 + was_active.double() - torch.arange(out_f, device=salient.device) / (2 * out_f)
        rank[active] = -math.inf
        active[torch.topk(rank, short).indices] = True
    if not bool(active.any()):  # no edges to share: every output stays as it was
        active = was_active.clone()
    return active


def _grow_per_output(topology: CSRTopology, grow: torch.Tensor, mode: str, grad, generator, chunk: int,
                     grad_reduce, block: int) -> torch.Tensor:
    """Keys (``src * out + dst`` of ``topology``, over vectors for ``block`` > 1) of ``grow[o]`` new connections of
    each output ``o``, among those absent before the update: at random (SET) or by the largest dense gradient
    (RigL), ``chunk`` outputs at a time."""
    out_f, device = topology.out_features, topology.device
    most = int(grow.max()) if grow.numel() else 0
    keys = []
    for o0, score in _scores(topology, mode, grad, generator, chunk, grad_reduce, block):
        if not most:
            continue
        rows = score.shape[0]
        top = torch.topk(score, most, dim=1).indices  # sorted: the first grow[o] of row o are its best
        take = torch.arange(most, device=device)[None, :] < grow[o0:o0 + rows, None]
        row = torch.arange(o0, o0 + rows, device=device)[:, None].expand(-1, most)
        keys.append((top * out_f + row)[take])
    return torch.cat(keys) if keys else torch.empty(0, dtype=torch.long, device=device)


def _scores(topology: CSRTopology, mode: str, grad, generator, chunk: int, grad_reduce, block: int):
    """``(o0, score)`` for each chunk of about ``chunk`` outputs from ``o0``: ``[rows, in_features]`` growth scores,
    -1 at the connections present (never regrown), else uniform in [0, 1) (SET) or ``|grad_out^T @ x|`` (RigL,
    every chunk on every rank: ``grad_reduce`` may be a collective). With ``block`` > 1 the rows are groups
    (``topology`` is over vectors) and RigL's score is the L2 norm of the dense gradient over a group's V lanes."""
    in_f, out_f, device = topology.in_features, topology.out_features, topology.device
    src, dst = topology.src.long(), topology.dst.long()
    chunk = max(1, chunk // block)
    if mode == "rigl":
        x, grad_out = (t.to(torch.float32) for t in grad)
    for o0 in range(0, out_f, chunk):
        rows = min(chunk, out_f - o0)
        if mode == "rigl":
            score = grad_out[:, o0 * block:(o0 + rows) * block].t() @ x
            if grad_reduce is not None:
                score = grad_reduce(score)
            score = score.view(rows, block, in_f).norm(dim=1) if block > 1 else score.abs()
        else:
            score = torch.rand(rows, in_f, generator=generator).to(device)
        inside = (dst >= o0) & (dst < o0 + rows)
        score[dst[inside] - o0, src[inside]] = -1.0
        yield o0, score
