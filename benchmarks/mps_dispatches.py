"""Metal dispatches per training step, counted without a Mac: the MPS host code (``MetalCsrLinear`` of
torch_sparse_metal/backends/mps.py, which sends the vector layout to ``MetalVectorCsrLinear`` of
backends/mps_vector_csr_linear.py) runs on CPU tensors under the MSL-on-CPU executor (tsm_dev.msl), with the ops' CPU
kernels replaced by it for the run, and every kernel it launches is counted by wrapping the library's kernel objects.
Torch's own ops are counted beside them (a TorchDispatchMode; views and allocations launch nothing on MPS, so they are
left out): those inside our host code (e.g. the vector layout's transposed copy of x, the cast of a 16-bit fused_atomic
grad_w) and the rest of the step.

Counts do not depend on the batch or the layer sizes (each call launches a fixed set of kernels), so the model runs
with a small batch; they depend on the strategy and on whether the input needs a gradient.

Example:
    python benchmarks/mps_dispatches.py            # one SparseLinear layer, and the README's model (d_model 256)
    python benchmarks/mps_dispatches.py --block 8  # the same in the vector layout (SparseLinear(block=8))
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from char_lm.model import CharTransformer, ModelConfig
from torch.utils._python_dispatch import TorchDispatchMode

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.contract import VECTOR_BLOCKS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tsm_dev lives in the checkout, not installed
from tsm_dev.msl import compile_shader  # noqa: E402

#: Torch ops that launch no Metal work (metadata, allocation); everything else counts as one dispatch or more.
_NO_WORK = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "view",
            "_unsafe_view", "reshape", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze",
            "select", "slice", "split", "split_with_sizes", "unbind", "lift_fresh", "_to_copy_noop")


class Tally:
    """Dispatch counts by stage: our kernels by name, torch ops inside our host code, torch ops elsewhere."""

    def __init__(self) -> None:
        self.stage = "setup"
        self.ours: Counter[tuple[str, str]] = Counter()
        self.torch_in_ours: Counter[tuple[str, str]] = Counter()
        self.torch: Counter[tuple[str, str]] = Counter()
        self.in_kernel = False  # the executor's own tensor work is no Metal dispatch

    @contextlib.contextmanager
    def at(self, stage: str):
        self.stage = stage
        yield
        self.stage = "setup"

    def totals(self, stage: str) -> tuple[int, int, int]:
        return tuple(sum(n for (s, _), n in c.items() if s == stage) for c in (self.ours, self.torch_in_ours,
                                                                                 self.torch))


class _CountedKernel:
    def __init__(self, fn, name: str, tally: Tally) -> None:
        self._fn, self._name, self._tally = fn, name, tally

    def __getattr__(self, attr):  # the pipeline's limits, which the host code reads
        return getattr(self._fn, attr)

    def __call__(self, *args, **kwargs):
        self._tally.ours[(self._tally.stage, self._name)] += 1
        self._tally.in_kernel = True
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._tally.in_kernel = False


class _CountedLibrary:
    def __init__(self, library, tally: Tally) -> None:
        self._library, self._tally = library, tally

    def __getattr__(self, name):
        fn = getattr(self._library, name, None)
        return None if fn is None else _CountedKernel(fn, name, self._tally)


class _TorchOps(TorchDispatchMode):
    """Counts torch's ops that launch work into ``counter`` (by stage). A mode is inactive inside its own handler,
    so the ops our kernels' host code runs are counted by another instance entered there."""

    def __init__(self, tally: Tally, counter: Counter) -> None:
        super().__init__()
        self.tally, self.counter = tally, counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        copies = name != "to" or out is not args[0]  # a cast to the tensor's own dtype returns it
        if func.namespace == "aten" and name not in _NO_WORK and copies and not self.tally.in_kernel:
            self.counter[(self.tally.stage, name)] += 1
        return out


@contextlib.contextmanager
def metal_on_cpu(tally: Tally):
    """The ops' CPU kernels replaced by their Metal host code (both layouts) under the executor, counting every
    kernel launch."""
    lib = torch.library.Library("torch_sparse_metal", "IMPL")
    with contextlib.ExitStack() as stack:
        stack.callback(lib._destroy)
        with warnings.catch_warnings():  # "overriding a previously registered kernel": for this run only
            warnings.simplefilter("ignore")
            forward, backward = _counted_ops(MetalCsrLinear, tally)
            lib.impl("csr_linear", forward, "CPU")
            lib.impl("csr_linear_backward", backward, "CPU")
        stack.enter_context(_TorchOps(tally, tally.torch))
        yield


def _counted_ops(host: type, tally: Tally):
    """The forward and backward op kernels, through ``host`` over a counted executor library."""
    metal = host(lambda source: _CountedLibrary(compile_shader(source), tally), device_type="cpu", poison=False)

    def forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
        with _TorchOps(tally, tally.torch_in_ours):
            return metal.forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)

    def backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
        with _TorchOps(tally, tally.torch_in_ours):
            return metal.backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)

    return forward, backward


def count_step(build, batch, strategy: str, dtype: torch.dtype) -> Tally:
    """A steady-state training step of ``build(strategy)`` on ``batch()`` as the training loop runs it (forward
    under autocast to ``dtype`` unless float32, backward, gradient clipping, fused AdamW), counted by stage. A first
    step runs uncounted: it creates what later steps reuse (the optimizer's state, the kernels' error words)."""
    tally = Tally()
    torch.manual_seed(0)
    model = build(strategy)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    inputs = batch()
    with metal_on_cpu(tally):
        for stages in (("setup",) * 3, ("forward", "backward", "optimizer")):
            autocast = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast("cpu", dtype=dtype)
            with tally.at(stages[0]), autocast:
                loss = model(*inputs)
            with tally.at(stages[1]):
                opt.zero_grad(set_to_none=True)
                loss.backward()
            with tally.at(stages[2]):
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                opt.step()
    return tally


def _layer(in_grad: bool, block: int):
    def build(strategy):
        return _LayerLoss(SparseLinear(256, 1024, density=0.25, block=block, backward=strategy), in_grad)
    return build


class _LayerLoss(torch.nn.Module):
    def __init__(self, layer: SparseLinear, in_grad: bool) -> None:
        super().__init__()
        self.layer, self.in_grad = layer, in_grad

    def forward(self, x):
        return self.layer(x.requires_grad_(self.in_grad)).square().mean()


def _readme_model(context: int, block: int):
    def build(strategy):
        cfg = ModelConfig(vocab_size=96, context=context, d_model=256, n_layers=4, n_heads=4, density=0.25,
                          block=block, backward=strategy)
        return _ModelLoss(CharTransformer(cfg, generator=torch.Generator().manual_seed(0)))
    return build


class _ModelLoss(torch.nn.Module):
    def __init__(self, model: CharTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return self.model.loss(idx, targets)


def report(title: str, tally: Tally, sparse_calls: int) -> None:
    print(f"\n{title}")
    print(f"  {'stage':<10} {'ours':>5} {'per layer call':>15} {'torch in ours':>14} {'torch elsewhere':>16}"
          "   (ours: Metal kernels; torch: ops that launch work, as dispatched here)")
    for stage in ("forward", "backward", "optimizer"):
        ours, inside, other = tally.totals(stage)
        print(f"  {stage:<10} {ours:>5} {ours / sparse_calls:>15.1f} {inside:>14} {other:>16}")
    kernels = Counter()
    for (stage, name), n in tally.ours.items():
        if stage != "setup":
            kernels[f"{stage}: {name}"] += n
    print("  kernels: " + ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32, help="the model's context (counts do not depend on it)")
    parser.add_argument("--batch", type=int, default=2, help="windows per step (counts do not depend on it)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="float32, or the forward under autocast to a 16-bit dtype (as --dtype of the training)")
    parser.add_argument("--block", type=int, choices=(1, *VECTOR_BLOCKS), default=1,
                        help="the layers' layout: 1 (unstructured), or the vector length V")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    layout = "" if args.block == 1 else f", block={args.block}"
    g = torch.Generator().manual_seed(1)
    for strategy in ("fused_atomic", "atomic_free"):
        for in_grad in (False, True):
            tally = count_step(_layer(in_grad, args.block), lambda: (torch.randn(64, 256, generator=g),), strategy,
                               dtype)
            report(f"one SparseLinear 256 -> 1024{layout}, backward={strategy}, input {'needs' if in_grad else 'no'} "
                   "gradient", tally, 1)
        tokens = lambda: (torch.randint(0, 96, (args.batch, args.context), generator=g),) * 2  # noqa: E731
        tally = count_step(_readme_model(args.context, args.block), tokens, strategy, dtype)
        report(f"README model (d_model 256, 4 layers, 16 SparseLinear{layout}), backward={strategy}, {args.dtype}",
               tally, 16)


if __name__ == "__main__":
    main()
