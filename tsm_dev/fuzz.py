"""Fuzz target: random corruptions of valid topologies, modules and checkpoints against the public entry points.

``python -m tsm_dev.fuzz --iterations N --seed S`` (docs/architecture.md, "Index safety").
Iteration ``i`` draws everything from ``(S, i)``, so a failure is replayed with ``--start i --iterations 1``.
Each iteration picks one target, draws a small valid problem, applies random corruptions and checks:

- ``ops``: the raw forward/backward ops on corrupted index arrays either raise a clear error or, when the arrays
  they read are still valid, return the float64 reference of the formula over those arrays.
- ``topology``: ``CSRTopology.from_csr`` on corrupted arrays raises or returns a topology that validates and
  holds exactly the given edges.
- ``load`` / ``file``: ``SparseLinear.load_state_dict`` of a corrupted checkpoint (``file``: random bytes of a
  saved file, read with ``torch.load(weights_only=True)``) raises and changes nothing, or loads exactly it.
- ``evolve``: ``DynamicSparsity.load_state_dict`` likewise; ``update``: ``apply_update`` of a corrupted plan
  raises and changes nothing (layer and AdamW state), or carries every kept weight and moment.
- ``values``: NaN/Inf in inputs, weights, bias and grad_out reach exactly the outputs and gradients that a
  float64 reference reaches, and no others.

Iterations run in a child process (:mod:`.isolated`): a crash is reported with its iteration and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import math
import random
import sys
import time

import torch

from torch_sparse_metal.contract import INT32_MAX, TOPOLOGY_ARGS
from torch_sparse_metal.evolve import DynamicSparsity, EdgeMap, apply_update, plan_update
from torch_sparse_metal.nn import SparseLinear
from torch_sparse_metal.topology import CSRTopology

from .isolated import run_isolated
from .snapshot import changes, snapshot

__all__ = ["TARGETS", "assert_matches", "edge_backward", "edge_forward", "iteration", "main"]

CLEAR = (ValueError, TypeError, RuntimeError, KeyError, IndexError)  # what a public entry may raise
OPS = torch.ops.torch_sparse_metal


class Bug(AssertionError):
    """An invariant broke: a silent wrong result, a changed state after a failure, an unclear exception."""


# ------------------------------------------------------------------------------------------------ drawing
def _topology(rng: random.Random) -> CSRTopology:
    """Unstructured, or a third of the time a vector layout of block 8 (SparseLinear(block=8))."""
    block = rng.choice([1, 1, 8])
    n_in, n_out = rng.randint(1, 10), (rng.randint(1, 10) if block == 1 else 8 * rng.randint(1, 2))
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    return CSRTopology.random(n_in, n_out, rng.choice([0.0, 0.1, 0.4, 1.0]), generator=g, block=block)


def _layer(rng: random.Random, bias: bool | None = None) -> SparseLinear:
    t = _topology(rng)
    return SparseLinear.from_topology(t, bias=rng.random() < 0.7 if bias is None else bias,
                                      generator=torch.Generator().manual_seed(rng.getrandbits(32)))


def _corrupt_index(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """One random corruption of an index array (values, length, dtype or layout)."""
    t = t.clone()
    kind = rng.choice(["set", "set", "shift", "swap", "truncate", "extend", "dtype", "strided", "reverse"])
    if kind in ("set", "shift", "swap") and t.numel():
        i = rng.randrange(t.numel())
        if kind == "set":
            t[i] = rng.choice([-1, 0, 1, int(t.max()) + 1, t.numel(), INT32_MAX, -INT32_MAX - 1,
                               rng.randint(-50, 50)])
        elif kind == "shift":
            t[i:] += rng.choice([-1, 1])
        else:
            j = rng.randrange(t.numel())
            t[i], t[j] = int(t[j]), int(t[i])
    elif kind == "truncate":
        t = t[: rng.randrange(t.numel() + 1)].clone()
    elif kind == "extend":
        t = torch.cat([t, torch.tensor([rng.randint(-3, 20)], dtype=t.dtype)])
    elif kind == "dtype":
        t = t.to(rng.choice([torch.int64, torch.int16, torch.float32, torch.uint8]))
    elif kind == "strided":
        t = torch.stack([t, t], 1)[:, 0]
    elif kind == "reverse":
        t = t.flip(0).contiguous()
    return t


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape:
        raise Bug(f"{what}: shape {tuple(got.shape)}, reference {tuple(want.shape)}")
    got = got.detach().double()
    if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.isinf(), want.isinf()):
        raise Bug(f"{what}: non-finite values in other places than the float64 reference")
    finite = want.isfinite()
    if finite.any() and not torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4):
        raise Bug(f"{what}: differs from the float64 reference by {float((got - want)[finite].abs().max())}")
    if (want.isinf() & (torch.sign(got) != torch.sign(want))).any():
        raise Bug(f"{what}: an infinity of the wrong sign")


# ---------------------------------------------------------------------------------------------- references
def _valid_pointers(p: torch.Tensor, nnz: int) -> bool:
    return p.numel() >= 1 and int(p[0]) == 0 and int(p[-1]) == nnz and bool((p[1:] >= p[:-1]).all())


def _op_ready(t: torch.Tensor, numel: int) -> bool:
    return t.dtype == torch.int32 and t.dim() == 1 and t.numel() == numel and t.is_contiguous()


def edge_forward(x, w, col_ptr, src_by_dst, perm) -> torch.Tensor:
    """``y[n, o] = sum_{k in col_ptr[o]..} w[perm[k]] * x[n, src_by_dst[k]]`` in float64, edge by edge (so a NaN
    reaches only the outputs it is connected to, as in the kernels)."""
    n_out = col_ptr.numel() - 1
    dst_of = torch.repeat_interleave(torch.arange(n_out), (col_ptr[1:] - col_ptr[:-1]).long())
    y = torch.zeros(x.shape[0], n_out, dtype=torch.float64)
    terms = x.double()[:, src_by_dst.long()] * w.double()[perm.long()]
    return y.index_add_(1, dst_of, terms)


def edge_backward(go, x, w, row_ptr, dst) -> tuple[torch.Tensor, torch.Tensor]:
    src_of = torch.repeat_interleave(torch.arange(row_ptr.numel() - 1), (row_ptr[1:] - row_ptr[:-1]).long())
    go_e = go.double()[:, dst.long()]
    grad_x = torch.zeros(x.shape, dtype=torch.float64).index_add_(1, src_of, go_e * w.double())
    return grad_x, (go_e * x.double()[:, src_of]).sum(0)


# --------------------------------------------------------------------------------------------------- targets
def fuzz_ops(rng: random.Random) -> str:
    topo = _topology(rng)
    batch = rng.randint(0, 5)
    x, w = torch.randn(batch, topo.in_features), torch.randn(topo.nnz)
    go = torch.randn(batch, topo.out_features)
    args = dict(zip(TOPOLOGY_ARGS, (a.clone() for a in topo.kernel_args())))
    for name in rng.sample(TOPOLOGY_ARGS, rng.randint(1, 2)):
        args[name] = _corrupt_index(rng, args[name])
    forward = rng.random() < 0.5
    strategy = rng.choice(["fused_atomic", "atomic_free"])
    try:
        if forward:
            out = (OPS.csr_linear(x, w, *(args[n] for n in TOPOLOGY_ARGS), "auto"),)
        else:
            out = OPS.csr_linear_backward(go, x, w, *(args[n] for n in TOPOLOGY_ARGS), strategy)
    except RuntimeError as exc:
        if "torch_sparse_metal" not in str(exc):
            raise Bug(f"unclear error from the op: {exc}") from exc
        return "raised"
    nnz = topo.nnz
    shapes_ok = all(_op_ready(args[n], m) for n, m in (("row_ptr", topo.in_features + 1), ("dst", nnz),
                                                         ("src", nnz), ("src_by_dst", nnz), ("perm", nnz)))
    shapes_ok &= args["col_ptr"].dtype == torch.int32 and args["col_ptr"].dim() == 1 and args["col_ptr"].is_contiguous()
    if not shapes_ok:
        raise Bug("the op accepted an index array of the wrong dtype, shape or layout")
    if forward:
        cp, sb, pm = args["col_ptr"], args["src_by_dst"], args["perm"]
        if not (_valid_pointers(cp, nnz) and bool(((sb >= 0) & (sb < topo.in_features)).all())
                and bool(((pm >= 0) & (pm < nnz)).all())):
            raise Bug("the forward op returned on index arrays it should have refused")
        assert_matches(out[0], edge_forward(x, w, cp, sb, pm), "forward")
    else:
        rp, dst = args["row_ptr"], args["dst"]
        n_out = args["col_ptr"].numel() - 1
        if not (_valid_pointers(rp, nnz) and bool(((dst >= 0) & (dst < n_out)).all())):
            raise Bug("the backward op returned on index arrays it should have refused")
        rx, rw = edge_backward(go, x, w, rp, dst)
        assert_matches(out[0], rx, f"grad_x ({strategy})")
        assert_matches(out[1], rw, f"grad_w ({strategy})")
    return "returned"


def fuzz_topology(rng: random.Random) -> str:
    topo = _topology(rng)
    row_ptr, dst = topo.row_ptr.clone(), topo.dst.clone()
    if rng.random() < 0.5:
        row_ptr = _corrupt_index(rng, row_ptr)
    else:
        dst = _corrupt_index(rng, dst)
    n_in, n_out = topo.in_features, topo.out_features
    if rng.random() < 0.2:
        n_in, n_out = rng.choice([(n_in + 1, n_out), (n_in, max(n_out - 1, 0)), (-1, n_out),
                                  (n_in, INT32_MAX + 1)])
    try:
        built = CSRTopology.from_csr(row_ptr, dst, n_in, n_out)
    except (ValueError, TypeError):
        return "raised"
    built.validate()
    src = torch.repeat_interleave(torch.arange(n_in), (row_ptr[1:] - row_ptr[:-1]).long())
    if not (torch.equal(built.src.long(), src) and torch.equal(built.dst.long(), dst.long())):
        raise Bug("from_csr returned other edges than it was given")
    return "returned"


def _corrupt_state(rng: random.Random, state: dict) -> None:
    """One random corruption of a SparseLinear state dict, in place."""
    keys = list(state)
    key = rng.choice(keys)
    kind = rng.choice(["index", "index", "none", "meta", "sparse", "dtype", "shape", "list", "drop", "extra",
                       "stray", "nan", "extra_state"])
    value = state[key]
    plain = isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type != "meta"
    if not plain and kind not in ("none", "drop", "stray", "extra_state"):
        kind = "none"  # an entry already replaced by an earlier corruption is replaced again
    if kind == "index" and key in ("row_ptr", "dst"):
        state[key] = _corrupt_index(rng, value)
    elif kind == "none":
        state[key] = None
    elif kind == "meta":
        state[key] = value.to("meta")
    elif kind == "sparse":
        state[key] = value.to_sparse()
    elif kind == "dtype":
        state[key] = value.to(rng.choice([torch.int32, torch.int64, torch.float64, torch.float16, torch.bool]))
    elif kind == "shape" and value.numel():
        state[key] = rng.choice([value[None], value[:-1], torch.cat([value, value[:1]])]).clone()
    elif kind == "list":
        state[key] = value.tolist()
    elif kind == "drop":
        del state[key]
    elif kind == "stray":
        state[rng.choice(["stray", "weight.x", "src", "perm"])] = torch.zeros(2)
    elif kind == "nan" and key in ("weight", "bias") and value.is_floating_point() and value.numel():
        value[rng.randrange(value.numel())] = rng.choice([math.nan, math.inf, -math.inf])
    elif kind == "extra_state":
        extra = dict(state["_extra_state"]) if isinstance(state.get("_extra_state"), dict) else {}
        extra[rng.choice(["in_features", "out_features", "format"])] = rng.choice([-1, 0, 1, 3, 2**40, "5", None])
        state["_extra_state"] = extra


def _load_and_check(rng: random.Random, layer: SparseLinear, state: object, opts=()) -> str:
    strict = rng.random() < 0.5
    before = snapshot(layer, opts)
    try:
        result = layer.load_state_dict(state, strict=strict)
    except (RuntimeError, TypeError, ValueError) as exc:
        if not str(exc):
            raise Bug(f"an exception without a message: {type(exc).__name__}") from exc
        changed = changes(before, layer, opts)
        if changed:
            raise Bug(f"a failed load changed {changed}: {exc}") from exc
        return "raised"
    missing = set(result.missing_keys)  # non-strict: what the checkpoint lacks stays, the rest is loaded
    kept = [key for key in changes(before, layer, opts) if key.removeprefix("module.") in missing]
    if kept:
        raise Bug(f"a load with missing keys {sorted(missing)} changed {kept}")
    layer.topology.validate()
    for key in ("weight", "bias", "row_ptr", "dst"):
        if key in missing:
            continue
        mine = getattr(layer, key)
        if mine is not None and not torch.equal(mine.detach().double(), state[key].double()):
            if not (key in ("weight", "bias") and torch.allclose(mine.detach().double(), state[key].double(),
                                                                 rtol=1e-3, equal_nan=True)):
                raise Bug(f"the load returned but {key} is not the checkpoint's")
    _check_forward(layer, rng)
    return "partial" if missing else "loaded"


def _check_forward(layer: SparseLinear, rng: random.Random) -> None:
    x = torch.randn(rng.randint(0, 3), layer.in_features)
    t = layer.topology
    want = edge_forward(x, layer.weight.detach(), t.col_ptr, t.src_by_dst, t.perm)
    if layer.bias is not None:
        want = want + layer.bias.detach().double()
    assert_matches(layer(x), want, "forward of the loaded layer")


def fuzz_load(rng: random.Random) -> str:
    layer = _layer(rng)
    state = copy.deepcopy((_layer(rng, bias=layer.bias is not None) if rng.random() < 0.7 else layer).state_dict())
    for _ in range(rng.randint(0, 2)):
        _corrupt_state(rng, state)
    return _load_and_check(rng, layer, state)


def fuzz_file(rng: random.Random) -> str:
    layer = _layer(rng)
    buffer = io.BytesIO()
    torch.save(_layer(rng, bias=layer.bias is not None).state_dict(), buffer)
    data = bytearray(buffer.getvalue())
    kind = rng.choice(["flip", "flip", "truncate", "append", "zero"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "append":
        data += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
    else:
        start = rng.randrange(len(data))
        data[start:start + rng.randint(1, 256)] = bytes(min(256, len(data) - start))
    try:
        state = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    except Exception:  # noqa: BLE001 - any exception from the reader is a clean refusal of a corrupt file
        return "unreadable"
    return _load_and_check(rng, layer, state)


def fuzz_evolve(rng: random.Random) -> str:
    model = torch.nn.Sequential(*(_layer(rng) for _ in range(rng.randint(1, 2))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # drop_fraction 0: a random topology may be too dense for any other (refused at construction); only the
    # loading of states is fuzzed here
    evo = DynamicSparsity(model, opt, prune_every=3, total_steps=50, drop_fraction=0.0,
                          generator=torch.Generator().manual_seed(1))
    good = evo.state_dict()
    state = copy.deepcopy(good)
    state.update(steps=rng.randint(0, 40), progress=rng.random())
    field = rng.choice(["steps", "progress", "start_nnz", "history", "regrown", "generator", "drop", "whole"])
    bad = rng.choice([None, -1, 2.5, "3", True, math.nan, [], [-1], [(0, [1.5])], torch.zeros(3, dtype=torch.uint8),
                      torch.tensor([1, 2]), {"a": 1}])
    if field == "drop":
        state.pop(rng.choice(list(state)))
    elif field == "whole":
        state = bad
    else:
        state[field] = bad
    generator_state = evo.generator.get_state().clone()
    try:
        evo.load_state_dict(state)
    except ValueError:
        after = evo.state_dict()
        if any(after[k] != good[k] for k in good if k != "generator") or not torch.equal(
                evo.generator.get_state(), generator_state):
            raise Bug("a failed DynamicSparsity load changed the schedule") from None
        return "raised"
    loaded = evo.state_dict()
    for key in ("steps", "start_nnz"):
        given = state[key].tolist() if isinstance(state[key], torch.Tensor) else state[key]
        if loaded[key] != given or isinstance(given, bool):
            raise Bug(f"DynamicSparsity loaded {key}={state[key]!r} as {loaded[key]!r}")
    return "loaded"


def fuzz_update(rng: random.Random) -> str:
    layer = _layer(rng)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01)
    layer(torch.randn(3, layer.in_features)).square().sum().backward()
    opt.step()
    block = layer.block  # a vector layer drops and grows whole vectors
    nnz, total = layer.nnz // block, layer.in_features * layer.out_features // block
    drop = rng.randint(0, nnz) * block
    topology, edge_map = plan_update(layer, drop, rng.randint(0, total - nnz) * block,  # dropped ones not regrown
                                     generator=torch.Generator().manual_seed(rng.getrandbits(32)))
    kind = rng.choice(["none", "old_to_new", "grown", "topology", "both"] + (["vectors"] if block > 1 else []))
    if kind in ("old_to_new", "both"):
        edge_map = EdgeMap(_corrupt_index(rng, edge_map.old_to_new), edge_map.grown)
    if kind == "grown":
        edge_map = EdgeMap(edge_map.old_to_new, _corrupt_index(rng, edge_map.grown))
    if kind in ("topology", "both"):
        name = rng.choice(TOPOLOGY_ARGS)
        topology = dataclasses.replace(topology, **{name: _corrupt_index(rng, getattr(topology, name))})
    if kind == "vectors":  # the topology over vectors disagrees with the edges
        name = rng.choice(TOPOLOGY_ARGS)
        vectors = dataclasses.replace(topology.vectors, **{name: _corrupt_index(rng, getattr(topology.vectors, name))})
        topology = dataclasses.replace(topology, vectors=vectors)
    before = snapshot(layer, (opt,))
    old_weight, old_state = layer.weight.detach().clone(), {k: v.clone() for k, v in opt.state[layer.weight].items()}
    try:
        apply_update(layer, topology, edge_map, [opt])
    except (ValueError, TypeError) as exc:
        if changes(before, layer, (opt,)):
            raise Bug(f"a refused update changed the layer or the optimizer: {exc}") from exc
        return "raised"
    layer.topology.validate()
    kept = edge_map.old_to_new.long() >= 0
    targets = edge_map.old_to_new.long()[kept]
    if not torch.equal(layer.weight.detach()[targets], old_weight[kept]):
        raise Bug("apply_update did not carry the kept weights")
    for key in ("exp_avg", "exp_avg_sq"):
        if not torch.equal(opt.state[layer.weight][key][targets], old_state[key][kept]):
            raise Bug(f"apply_update did not carry {key}")
    grown = edge_map.grown.long()
    if bool(layer.weight.detach()[grown].any()):
        raise Bug("grown edges do not start at 0")
    _check_forward(layer, rng)
    return "applied"


def fuzz_values(rng: random.Random) -> str:
    topo = _topology(rng)
    batch = rng.randint(1, 4)
    dtype = rng.choice([torch.float32, torch.float64])
    x = torch.randn(batch, topo.in_features, dtype=dtype)
    w = torch.randn(topo.nnz, dtype=dtype)
    bias = torch.randn(topo.out_features, dtype=dtype) if rng.random() < 0.5 else None
    go = torch.randn(batch, topo.out_features, dtype=dtype)
    for t in rng.sample([x, w, go] + ([bias] if bias is not None else []), rng.randint(1, 2)):
        if t.numel():
            t.view(-1)[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf])
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    from torch_sparse_metal.functional import sparse_linear

    y = sparse_linear(xg, wg, topo, bias, backward=rng.choice(["fused_atomic", "atomic_free"]))
    y.backward(go)
    want = edge_forward(x, w, topo.col_ptr, topo.src_by_dst, topo.perm)
    assert_matches(y, want if bias is None else want + bias.double(), "forward with non-finite values")
    rx, rw = edge_backward(go, x, w, topo.row_ptr, topo.dst)
    assert_matches(xg.grad, rx, "grad_x with non-finite values")
    assert_matches(wg.grad, rw, "grad_w with non-finite values")
    return "returned"


TARGETS = {"ops": fuzz_ops, "topology": fuzz_topology, "load": fuzz_load, "file": fuzz_file, "evolve": fuzz_evolve,
           "update": fuzz_update, "values": fuzz_values}


def iteration(case: str) -> str:
    """Run iteration ``"seed:i[:target]"``; returns the target and how it ended. Raises :class:`Bug` on a broken
    invariant (and lets an unexpected exception type through, which the driver reports)."""
    seed, i, *target = case.split(":")
    rng = random.Random(f"{seed}:{i}")
    name = target[0] if target else rng.choice(list(TARGETS))
    torch.manual_seed(rng.getrandbits(32))
    return f"{name}:{TARGETS[name](rng)}"


def run(iterations: int, seed: int, start: int = 0, targets: list[str] | None = None, batch: int = 2000
        ) -> tuple[dict[str, int], list[str]]:
    """Run iterations ``start .. start + iterations`` crash-isolated; returns (outcome counts, failure lines)."""
    counts: dict[str, int] = {}
    failures: list[str] = []
    names = [f"{seed}:{i}" + (f":{targets[i % len(targets)]}" if targets else "")
             for i in range(start, start + iterations)]
    env = {"TORCH_SPARSE_METAL_POISON": "1", "TORCH_SPARSE_METAL_TUNE": "0"}
    for lo in range(0, len(names), batch):
        for case, outcome in run_isolated("tsm_dev.fuzz:iteration", names[lo:lo + batch], env=env,
                                          timeout=3600).items():
            if outcome.status == "returned":
                counts[outcome.detail] = counts.get(outcome.detail, 0) + 1
            else:
                failures.append(f"iteration {case}: {outcome.status} {outcome.error}: {outcome.detail}")
    return counts, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tsm_dev.fuzz",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first iteration (to replay one: --iterations 1)")
    parser.add_argument("--target", action="append", choices=list(TARGETS), help="only these targets (repeatable)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    counts, failures = run(args.iterations, args.seed, args.start, args.target)
    elapsed = time.perf_counter() - began
    for line in failures:
        print(line, file=sys.stderr)
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"fuzz: {args.iterations} iterations (seed {args.seed}, from {args.start}) in {elapsed:.1f} s: "
          f"{len(failures)} failures; {summary}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
