"""The CPU kernels' one setting: which compiled kernel set runs (the C++ kernels live in csrc/cpu).

Example:
    >>> from torch_sparse_metal.backends import cpu
    >>> with cpu.use_kernels("generic"):
    ...     pass  # ops here run the baseline kernels
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .. import _C

__all__ = ["KERNEL_SETS", "use_kernels"]

#: ``native``: the widest set this CPU runs (AVX2 + FMA where available); ``generic``: the baseline set, any CPU.
KERNEL_SETS = ("native", "generic")
_current = "generic" if os.environ.get("TORCH_SPARSE_METAL_CPU_KERNELS") == "generic" else "native"
_C.force_generic_cpu_kernels(_current == "generic")  # this module owns the setting; the kernels only read it


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
