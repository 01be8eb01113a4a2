"""The CPU backend's declaration and its one setting: which compiled kernel set runs (the C++ kernels live in
csrc/cpu), and which one does.

Example:
    >>> from torch_sparse_metal.backends import cpu
    >>> cpu.active_kernels()[torch.float32] in ("avx2", "neon", "generic")  # "neon" on AArch64
    True
    >>> with cpu.use_kernels("generic"):
    ...     cpu.active_kernels()[torch.float32]  # ops here run the baseline kernels
    'generic'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import _C, contract, settings
from ..devices import Backend, cpu_model, register

__all__ = ["BACKEND", "KERNEL_SETS", "active_kernels", "use_kernels"]

#: ``native``: the widest set this CPU runs (AVX2 + FMA on x86-64 where available, NEON on every AArch64 CPU);
#: ``generic``: the baseline set, any CPU.
KERNEL_SETS = ("native", "generic")
_current = settings.choice("TORCH_SPARSE_METAL_CPU_KERNELS", KERNEL_SETS, "native")
_C.force_generic_cpu_kernels(_current == "generic")  # this module owns the setting; the kernels only read it
# The C++ backends' (CPU and CUDA) NaN poisoning of outputs, read here through the one settings parser.
_C.set_poison(settings.flag("TORCH_SPARSE_METAL_POISON", False))


@contextlib.contextmanager
def use_kernels(name: str) -> Iterator[None]:
    """Run the CPU ops with kernel set ``name`` inside the block (process-wide, restored on exit).
    ``TORCH_SPARSE_METAL_CPU_KERNELS=generic`` in the environment picks the baseline set from the start."""
    global _current
    if name not in KERNEL_SETS:
        raise ValueError(f"CPU kernel set must be one of {KERNEL_SETS}, got {name!r}")
    previous, _current = _current, name
    _C.force_generic_cpu_kernels(name == "generic")
    try:
        yield
    finally:
        _current = previous
        _C.force_generic_cpu_kernels(previous == "generic")


def active_kernels() -> dict[torch.dtype, str]:
    """The compiled kernel set each CPU value dtype runs now: ``"avx2"`` (x86-64 with AVX2 + FMA, a GCC build),
    ``"neon"`` (AArch64, Linux and macOS) or ``"generic"`` (the baseline templates, as ``use_kernels("generic")``
    forces). Read from the kernel tables the ops call; float16 and bfloat16 run float32's (widened at the boundary).
    """
    f32, f64 = _C.cpu_kernel_sets()
    by_kernel_type = {torch.float32: f32, torch.float64: f64}
    return {dtype: by_kernel_type[spec.accumulate] for dtype, spec in contract.DTYPES.items() if "cpu" in spec.devices}


BACKEND = register(Backend(
    "cpu",
    is_available=lambda: True,
    synchronize=lambda device: None,
    describe=lambda device: f"cpu {cpu_model()} x{torch.get_num_threads()}, {active_kernels()[torch.float32]} kernels",
    records_index_errors=False,
))
