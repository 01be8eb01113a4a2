"""Why ``csr_linear``'s autograd rule has three entries: the host cost of a training step through each entry, and
what each entry supports when it is the only one (docs/architecture.md, "Why the autograd rule has three entries").

    python benchmarks/autograd_entries.py --out benchmarks/results/autograd_entries_cpu_2026-12-07

The entries, each made the only one ``sparse_linear`` calls (the three names it calls are replaced for the run):

- ``shipped``: ``sparse_linear`` as it is (eager: ``CSRLinearFunction``; torch.compile and jit.trace: the op;
  torch.func and dual levels: ``FuncCSRLinear``).
- ``op_rule``: the op with the kernel ``torch.library.register_autograd`` makes (``make_autograd_impl``), alone:
  without the op kernel's routing of dual tensors to ``FuncCSRLinear`` and its refusal of torch.func's
  differentiating transforms.
- ``op_lean``: the op with the lightest Python Autograd kernel there can be: a Function with a ``ctx`` forward that
  runs the op below the Autograd key (what ``CSRLinearFunction`` does, entered through the dispatcher).
- ``func``: ``FuncCSRLinear`` (``setup_context`` and ``jvp``, as torch.func needs).
- ``nn.Linear``: the dense layer of the same shape, for reference.

Timing: a step is ``layer(x).backward(grad)`` of a tiny layer (64 -> 32, density 0.25, bias, batch 8, float32) on
one thread, where the kernels take a few microseconds and the rest is host work: Python, the dispatcher, autograd;
and the same step through ``sparse_linear`` alone (``/ sparse_linear`` cases: no module, no topology lookup), where
the entry is a larger part of the step. Every round runs ``--steps`` steps of each case, the cases interleaved in a
rotating order so that they share the machine's load; per case the median, quartiles and minimum of the per-round
microseconds per step, and the median and quartiles of the per-round ratios to ``shipped`` at the same level. The
replaced entries are called through a stand-in (one Python call and the topology's index arrays, under a
microsecond).

Capabilities: with each entry as the only one, ``torch.func.grad``, ``torch.func.vmap``, ``torch.func.jvp``,
``torch.autograd.forward_ad`` dual tensors, ``torch.compile(fullgraph=True)`` (aot_eager) forward and backward, and
a double backward, each compared with the same function of float64 dense math.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.autograd.forward_ad as fwad

import torch_sparse_metal
from torch_sparse_metal import functional
from torch_sparse_metal.ops import _csr_linear
from torch_sparse_metal.topology import CSRTopology

ENTRIES = ("shipped", "op_rule", "op_lean", "func")
_FORWARD = torch.ops.torch_sparse_metal.csr_linear.default


class _LeanFunction(torch.autograd.Function):
    """The rule behind the op's Autograd kernel, entered as ``CSRLinearFunction`` enters it (``ctx`` forward, the op
    below the Autograd key), for ``op_lean``."""

    @staticmethod
    def forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
            output = _FORWARD(*inputs)
        _csr_linear._setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        return _csr_linear._backward(ctx, grad_out)


def _lean_kernel(keyset, *inputs):
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*inputs):
        return _LeanFunction.apply(*inputs)
    with torch._C._AutoDispatchBelowAutograd():
        return _FORWARD(*inputs)


class _Only:
    """Stands in for each name ``sparse_linear`` calls an entry by (``CSRLinearFunction``, ``FuncCSRLinear``, the
    op), sending every call to ``call(x, weight, *index, strategy)``."""

    def __init__(self, call: Callable[..., torch.Tensor]):
        self.call = call

    def apply(self, x, weight, *rest):
        if isinstance(rest[0], CSRTopology):  # CSRLinearFunction's arguments: (topology, Strategy)
            rest = (*rest[0].kernel_args(), rest[1].value)
        return self.call(x, weight, *rest)

    __call__ = apply


@contextlib.contextmanager
def only(entry: str) -> Iterator[None]:
    """``sparse_linear`` with ``entry`` as its one entry to the rule, for the duration."""
    saved_functional = {n: getattr(functional, n) for n in ("CSRLinearFunction", "FuncCSRLinear", "_CSR_LINEAR")}
    saved_ops = {
        n: getattr(_csr_linear, n) for n in ("_refuse_differentiating_transforms", "_eager_tangents", "_library_rule")
    }
    try:
        if entry != "shipped":
            call = _csr_linear.FuncCSRLinear.apply if entry == "func" else _FORWARD
            for name in saved_functional:
                setattr(functional, name, _Only(call))
            _csr_linear._refuse_differentiating_transforms = lambda args: None
            _csr_linear._eager_tangents = lambda: False
            if entry == "op_lean":
                _csr_linear._library_rule = _lean_kernel
        torch.compiler.reset()
        yield
    finally:
        for name, value in saved_functional.items():
            setattr(functional, name, value)
        for name, value in saved_ops.items():
            setattr(_csr_linear, name, value)
        torch.compiler.reset()


# ------------------------------------------------------------------------------------------------ timing
def _steps(entry: str, step: Callable[[], None], n: int) -> float:
    """Microseconds per step of ``n`` steps."""
    with only(entry) if entry else contextlib.nullcontext():
        for _ in range(20):  # warm-up after the switch
            step()
        start = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - start) / n * 1e6


def timing(rounds: int, steps: int, seed: int) -> dict[str, dict[str, float]]:
    """Per case (``entry`` through the layer, ``entry / sparse_linear`` through the function alone, and the dense
    references): statistics of the per-round microseconds per step and of the per-round ratios to ``shipped`` (the
    layer's cases) or ``shipped / sparse_linear`` (the function's)."""
    g = torch.Generator().manual_seed(seed)
    sparse = torch_sparse_metal.SparseLinear(64, 32, density=0.25, generator=g)
    dense = torch.nn.Linear(64, 32)
    x, grad = torch.randn(8, 64, generator=g), torch.randn(8, 32, generator=g)
    weight, topology, bias = sparse.weight, sparse.topology, sparse.bias
    cases: dict[str, tuple[str, Callable[[], None]]] = {}
    for e in ENTRIES:
        cases[e] = e, lambda: sparse(x).backward(grad)
    cases["nn.Linear"] = "", lambda: dense(x).backward(grad)
    for e in ENTRIES:
        cases[f"{e} / sparse_linear"] = (
            e,
            lambda: torch_sparse_metal.sparse_linear(x, weight, topology, bias).backward(grad),
        )
    cases["F.linear"] = "", lambda: torch.nn.functional.linear(x, dense.weight, dense.bias).backward(grad)
    per_round: dict[str, list[float]] = {c: [] for c in cases}
    names = list(cases)
    for r in range(rounds):
        for c in names[r % len(names) :] + names[: r % len(names)]:
            per_round[c].append(_steps(*cases[c], n=steps))
    out = {}
    for c, us in per_round.items():
        base = per_round["shipped / sparse_linear" if "sparse_linear" in c or c == "F.linear" else "shipped"]
        ratios = [a / b for a, b in zip(us, base)]
        q, rq = statistics.quantiles(us, n=4), statistics.quantiles(ratios, n=4)
        out[c] = {
            "median_us": statistics.median(us),
            "p25_us": q[0],
            "p75_us": q[2],
            "min_us": min(us),
            "ratio": statistics.median(ratios),
            "ratio_p25": rq[0],
            "ratio_p75": rq[2],
        }
    return out


# ------------------------------------------------------------------------------------------ capabilities
def _check(fn: Callable[[], bool]) -> str:
    try:
        return "ok" if fn() else "wrong result"
    except Exception as e:  # a failure is a result here: which entry cannot serve which caller
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def capabilities(seed: int) -> dict[str, str]:
    """Each caller of the rule, through ``sparse_linear`` as it is now, against float64 dense math."""
    g = torch.Generator().manual_seed(seed)
    topo = CSRTopology.random(12, 7, 0.4, generator=g)
    f64 = dict(dtype=torch.float64)
    w, t = torch.randn(topo.nnz, generator=g, **f64), torch.randn(topo.nnz, generator=g, **f64)
    x, xs = torch.randn(5, 12, generator=g, **f64), torch.randn(3, 5, 12, generator=g, **f64)

    def dense(w):
        return torch.zeros(7, 12, dtype=w.dtype).index_put((topo.dst.long(), topo.src.long()), w)

    def ours(w, x):
        return torch_sparse_metal.sparse_linear(x, w, topo)

    def ref(w, x):
        return x @ dense(w).T

    def close(a, b):
        return a is not None and torch.allclose(a, b, rtol=1e-10, atol=1e-10)

    def grad():
        return close(
            torch.func.grad(lambda w: ours(w, x).pow(2).sum())(w), torch.func.grad(lambda w: ref(w, x).pow(2).sum())(w)
        )

    def jvp():
        return close(torch.func.jvp(lambda w: ours(w, x), (w,), (t,))[1], ref(t, x))

    def dual():
        with fwad.dual_level():
            return close(fwad.unpack_dual(ours(fwad.make_dual(w, t), x)).tangent, ref(t, x))

    def compiled():
        def loss(f):
            return lambda w: f(w, x).pow(2).sum()

        wc, wr = w.clone().requires_grad_(), w.clone().requires_grad_()
        torch.compile(loss(ours), fullgraph=True, backend="aot_eager")(wc).backward()
        loss(ref)(wr).backward()
        return close(wc.grad, wr.grad)

    def double():
        def second(f):
            wc, xc = w.clone().requires_grad_(), x.clone().requires_grad_()
            (gx,) = torch.autograd.grad(f(wc, xc).pow(2).sum(), xc, create_graph=True)
            return torch.autograd.grad(gx.pow(2).sum(), wc)[0]

        return close(second(ours), second(ref))

    return {
        "torch.func.grad": _check(grad),
        "torch.func.vmap": _check(lambda: close(torch.func.vmap(lambda x: ours(w, x))(xs), ref(w, xs))),
        "torch.func.jvp": _check(jvp),
        "forward_ad dual tensors": _check(dual),
        "torch.compile fullgraph (aot_eager) fwd+bwd": _check(compiled),
        "double backward": _check(double),
    }


# ------------------------------------------------------------------------------------------------ report
def markdown(result: dict) -> str:
    lines = [
        f"# The autograd rule's entries: host cost and capabilities ({result['cpu']}, torch {result['torch']}, "
        f"{result['threads']} thread)",
        "",
        f"`{result['command']}`",
        "",
        f"Host microseconds per step ({result['layer']}); {result['rounds']} rounds of {result['steps']} steps, "
        "cases interleaved.",
        "",
        "| case | median µs | p25-p75 µs | min µs | × shipped (median of the rounds' ratios, p25-p75) |",
        "|---|---|---|---|---|",
    ]
    for c, s in result["timing"].items():
        lines.append(
            f"| {c} | {s['median_us']:.1f} | {s['p25_us']:.1f}-{s['p75_us']:.1f} | {s['min_us']:.1f} | "
            f"{s['ratio']:.2f} ({s['ratio_p25']:.2f}-{s['ratio_p75']:.2f}) |"
        )
    checks = list(next(iter(result["capabilities"].values())))
    lines += [
        "",
        "Each entry as the only one, against float64 dense math:",
        "",
        "| entry | " + " | ".join(checks) + " |",
        "|---" * (len(checks) + 1) + "|",
    ]
    for e, caps in result["capabilities"].items():
        lines.append(f"| {e} | " + " | ".join(caps[c].replace("|", "/") for c in checks) + " |")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="a folder for autograd_entries.json (the printed tables are made from it)")
    args = p.parse_args()
    torch.set_num_threads(1)
    caps = {}
    for entry in ENTRIES:
        with only(entry):
            caps[entry] = capabilities(args.seed)
    result = {
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "threads": 1,
        "command": "python benchmarks/autograd_entries.py " + " ".join(sys.argv[1:]),
        "layer": "SparseLinear(64, 32, density=0.25, bias) and its sparse_linear call; nn.Linear(64, 32) and "
        "F.linear; batch 8, float32, forward + backward",
        "rounds": args.rounds,
        "steps": args.steps,
        "timing": timing(args.rounds, args.steps, args.seed),
        "capabilities": caps,
    }
    text = markdown(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "autograd_entries.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
