"""``backward="auto"`` tuned on the user's own machine.

The first backward of a problem-size bucket on a device times both strategies on the real tensors (a few calls
each, with a device synchronisation: this happens once per bucket, in the first training step, never in the
steady state), and the faster one is used from then on. Decisions are cached on disk per device name, torch
version and package version (``~/.cache/torch_sparse_metal/tuning.json``; ``$TORCH_SPARSE_METAL_CACHE_DIR``
moves it), so a machine tunes each bucket once. Buckets round every size up to a power of two, so a topology
that grows or shrinks a little keeps its decision.

``TORCH_SPARSE_METAL_TUNE=0`` turns tuning off: ``auto`` then follows the static rule of
:mod:`torch_sparse_metal.strategy` (deterministic, no timing). Tuning is skipped where tensors are not real
(``torch.compile`` tracing, ``torch.func`` transforms, meta tensors), inside a CUDA graph capture, and under
``create_graph=True``.
``python -m torch_sparse_metal.tune`` tunes given sizes ahead of a run, and shows or clears the cache.

Example:
    >>> bucket_key(torch.float32, 1000, 1000, 50_000, 100)
    'float32/in1024/out1024/nnz65536/batch128'
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from .timing import median_ms

__all__ = ["REPS", "bucket_key", "cache_path", "choose", "device_key", "enabled", "forget"]

#: Timed calls per candidate (after one warm-up call).
REPS = 3
_TUNE_ENV = "TORCH_SPARSE_METAL_TUNE"
_CACHE_ENV = "TORCH_SPARSE_METAL_CACHE_DIR"
_lock = threading.Lock()
_memory: dict[str, dict[str, dict]] | None = None  # device key -> bucket -> {"strategy": ..., "ms": {...}}


def enabled() -> bool:
    """False when ``TORCH_SPARSE_METAL_TUNE=0``."""
    return os.environ.get(_TUNE_ENV, "1") != "0"


def cache_path() -> Path:
    """Where decisions are kept: ``$TORCH_SPARSE_METAL_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    root = os.environ.get(_CACHE_ENV)
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_sparse_metal"
    return Path(root) / "tuning.json"


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@functools.lru_cache(maxsize=1024)
def bucket_key(dtype: torch.dtype, in_features: int, out_features: int, nnz: int, batch: int) -> str:
    """The problem-size bucket: each size rounded up to a power of two."""
    name = str(dtype).removeprefix("torch.")
    return f"{name}/in{_pow2(in_features)}/out{_pow2(out_features)}/nnz{_pow2(nnz)}/batch{_pow2(batch)}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_key(device: torch.device) -> str:
    """The machine a decision belongs to: the device's name, its thread count on the CPU, torch's version."""
    return _device_key(device, torch.get_num_threads())


@functools.lru_cache(maxsize=64)
def _device_key(device: torch.device, threads: int) -> str:
    """Computed once per device (it reads /proc/cpuinfo or asks the driver): ``auto`` looks it up every backward."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = f"mps {platform.machine()} macOS {platform.mac_ver()[0]}"
    else:
        name = f"cpu {_cpu_model()} x{threads}"
    from . import __version__

    return f"{name} | torch {torch.__version__} | torch_sparse_metal {__version__}"


def _load() -> dict[str, dict[str, dict]]:
    global _memory
    if _memory is None:
        try:
            _memory = json.loads(cache_path().read_text())
            if not isinstance(_memory, dict):
                _memory = {}
        except (OSError, ValueError):
            _memory = {}
    return _memory


def _save() -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_memory, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home still tunes, in memory for this process
        warnings.warn(f"torch_sparse_metal: cannot write the tuning cache {path} ({exc}); decisions are kept in "
                      f"memory only (set {_CACHE_ENV} to a writable folder)", stacklevel=3)


def _time_ms(run: Callable[[], object], device: torch.device) -> float:
    return median_ms(run, device, REPS)


def choose(device: torch.device, bucket: str, candidates: tuple[str, ...],
           run: Callable[[str], object] | None = None) -> str | None:
    """The cached decision for ``bucket`` on ``device``; else, given ``run``, time ``run(candidate)`` for each
    candidate, keep the fastest and cache it; else None."""
    key = device_key(device)
    with _lock:
        known = _load().get(key, {}).get(bucket)
    if known is not None and known.get("strategy") in candidates:
        return known["strategy"]
    if run is None:
        return None
    ms = {c: _time_ms(lambda c=c: run(c), device) for c in candidates}
    best = min(ms, key=ms.get)
    with _lock:
        _load().setdefault(key, {})[bucket] = {"strategy": best, "ms": {c: round(v, 4) for c, v in ms.items()}}
        _save()
    return best


def forget() -> None:
    """Drop every cached decision (the file and this process's copy)."""
    global _memory
    with _lock:
        _memory = {}
        cache_path().unlink(missing_ok=True)
