"""The backend seam: each device type with kernels declares itself here once, and every part of the package that
needs to know about devices (the functional API's dtype checks, index-error checks, synchronisation, the tuner's
machine key and kernel variants, the test axes, the benchmark and the training loop) iterates :data:`BACKENDS`.

A backend's dtypes come from the op contract (``csrc/contract.h``); its kernels are registered with
``torch.library`` (in C++ for the CPU and CUDA, from Python for MPS: :mod:`.backends.mps`).

Example:
    >>> from torch_sparse_metal import devices
    >>> sorted(devices.BACKENDS)
    ['cpu', 'cuda', 'mps']
    >>> devices.get("cpu").dtypes[0]
    torch.float32
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .contract import supported_dtypes

__all__ = ["BACKENDS", "Backend", "available", "cpu_model", "get", "register"]


@dataclass(frozen=True)
class Backend:
    """One device type's kernels, as the rest of the package sees them.

    ``synchronize(device)`` waits for the device's queued work; ``describe(device)`` names the machine a tuning
    decision belongs to; ``variants`` are the kernel variants the tuner times (setting -> values);
    ``tunes_strategy``: ``auto`` times the backward strategies here (only where this backend's measurements show
    them differ beyond the timing noise, docs/strategies.md; otherwise it runs the static rule's);
    ``records_index_errors``: the kernels clamp out-of-range indices and record them in error words, read by
    :func:`torch_sparse_metal.check_index_errors` (the CPU checks index values before its kernels run instead).
    """

    device_type: str
    is_available: Callable[[], bool]
    synchronize: Callable[[torch.device], None]
    describe: Callable[[torch.device], str]
    records_index_errors: bool
    variants: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    tunes_strategy: bool = False

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The value dtypes with kernels here (the op contract)."""
        return supported_dtypes(self.device_type)


#: Every declared backend, by device type.
BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Declare ``backend`` (once per device type)."""
    if backend.device_type in BACKENDS:
        raise ValueError(f"a backend for {backend.device_type!r} is already registered")
    BACKENDS[backend.device_type] = backend
    return backend


def get(device_type: str) -> Backend | None:
    """The backend of ``device_type``, or None where no kernels exist (``meta``, ...)."""
    return BACKENDS.get(device_type)


def available() -> tuple[str, ...]:
    """The device types with kernels that this machine can run."""
    return tuple(name for name, backend in BACKENDS.items() if backend.is_available())


def cpu_model() -> str:
    """The processor's model name: /proc/cpuinfo's on Linux, sysctl's brand string on macOS (e.g. "Apple M2 Pro",
    which names the GPU's chip too), else what :mod:`platform` knows (often just the architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is not None and out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return platform.processor() or platform.machine()
