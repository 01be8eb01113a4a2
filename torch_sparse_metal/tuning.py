"""``auto`` tuned on the user's own machine: the backward strategy and the backend's kernel variants.

A decision is a *configuration*: for the backward a strategy, for the forward nothing, each combined with every
setting of the kernel variants the device's backend declares (:func:`register_variants`; on MPS
``values_per_lane`` P of the Metal kernels, ``backends/mps.py``; CPU and CUDA declare none, so there the
backward chooses a strategy only and the forward is not tuned). :func:`candidates` builds that table.

The first backward of a problem-size bucket on a device times each backward configuration on the real tensors,
and on MPS the first eager forward times each forward configuration (a few calls each, with a device
synchronisation: once per bucket, at the first call, never in the steady state); the fastest is used from then
on. While a candidate is timed its variants are in force (:func:`variant` returns them); otherwise a backend
reads the bucket's decision with :func:`variant`, a dictionary lookup that never waits on the device.
Decisions are cached on disk per device name, torch version and package version
(``~/.cache/torch_sparse_metal/tuning.json``; ``$TORCH_SPARSE_METAL_CACHE_DIR`` moves it), so a machine tunes
each bucket once. Buckets round every size up to a power of two, so a topology that grows or shrinks a little
keeps its decision; the backward's and the forward's decisions of a size are separate buckets. An entry is
``{"strategy": ..., "values_per_lane": ..., "ms": {candidate: ms}}`` (the keys its candidates have); an entry
that does not name exactly one of today's candidates (one written before a device had variants, which has a
strategy but no ``values_per_lane``) counts as no decision: the bucket is tuned again at its next first use.

``TORCH_SPARSE_METAL_TUNE=0`` turns tuning off and ignores the cache: ``auto`` then follows the static rules
(deterministic, no timing): :func:`torch_sparse_metal.strategy.static_strategy` for the strategy and
:func:`torch_sparse_metal.backends.mps.values_per_lane` for P. Tuning is skipped where tensors are not real
(``torch.compile`` tracing, ``torch.func`` transforms, meta tensors), inside a CUDA graph capture, and under
``create_graph=True``; a decision made before is still used there.
``python -m torch_sparse_metal.tune`` tunes given sizes ahead of a run, and shows or clears the cache.

Example:
    >>> bucket_key(torch.float32, 1000, 1000, 50_000, 100)
    'float32/in1024/out1024/nnz65536/batch128'
    >>> [label(c) for c in candidates("cpu", ("fused_atomic", "atomic_free"))]
    ['fused_atomic', 'atomic_free']
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import platform
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from .timing import median_ms

__all__ = ["REPS", "VARIANTS", "Config", "bucket_key", "cache_path", "cached", "candidates", "choose", "device_key",
           "enabled", "forget", "label", "register_variants", "tune_forward", "variant"]

#: Timed calls per candidate (after one warm-up call).
REPS = 3
_TUNE_ENV = "TORCH_SPARSE_METAL_TUNE"
_CACHE_ENV = "TORCH_SPARSE_METAL_CACHE_DIR"
_lock = threading.Lock()
_memory: dict[str, dict[str, dict]] | None = None  # device key -> bucket -> {**configuration, "ms": {...}}
#: A configuration: ``{"strategy": ...}`` (backward only) and one value per kernel variant, e.g.
#: ``{"strategy": "fused_atomic", "values_per_lane": 4}``.
Config = dict[str, Any]
#: Kernel variants per device type, as their backends declare them (:func:`register_variants`): setting -> values.
VARIANTS: dict[str, dict[str, tuple[int, ...]]] = {}
_timing: ContextVar[Config | None] = ContextVar("torch_sparse_metal_tuning_candidate", default=None)


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
def bucket_key(dtype: torch.dtype, in_features: int, out_features: int, nnz: int, batch: int,
               op: str = "backward") -> str:
    """The problem-size bucket of ``op`` (``"backward"`` or ``"forward"``): each size rounded up to a power of two;
    the forward's buckets start with ``forward/``."""
    name = str(dtype).removeprefix("torch.")
    prefix = "forward/" if op == "forward" else ""
    return f"{prefix}{name}/in{_pow2(in_features)}/out{_pow2(out_features)}/nnz{_pow2(nnz)}/batch{_pow2(batch)}"


def register_variants(device_type: str, variants: Mapping[str, Sequence[int]]) -> None:
    """Declare the kernel variants a backend runs on ``device_type`` (setting -> the values to time)."""
    VARIANTS[device_type] = {name: tuple(values) for name, values in variants.items()}


def candidates(device_type: str, strategies: Sequence[str] = ()) -> tuple[Config, ...]:
    """Every configuration ``auto`` chooses between on ``device_type``: each of ``strategies`` (the backward's;
    none for the forward) with each combination of the device's kernel variants. ``({},)`` when there is
    nothing to choose.

    Example:
        >>> [label(c) for c in candidates("mps", ("fused_atomic",))]  # backends/mps.py declares values_per_lane
        ['fused_atomic values_per_lane=1', 'fused_atomic values_per_lane=4']
    """
    return _candidates(tuple(strategies), tuple(VARIANTS.get(device_type, {}).items()))


@functools.lru_cache(maxsize=64)
def _candidates(strategies: tuple[str, ...], variants: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[Config, ...]:
    """:func:`candidates` for one table: built once, as ``auto`` asks for it in every backward (callers must not
    modify the returned configurations)."""
    axes = ({"strategy": strategies} if strategies else {}) | dict(variants)
    return tuple(dict(zip(axes, values)) for values in itertools.product(*axes.values()))


def label(config: Config) -> str:
    """A configuration in words, as the cache's timings name it: ``"fused_atomic values_per_lane=4"``."""
    return " ".join(str(v) if k == "strategy" else f"{k}={v}" for k, v in config.items())


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


def _entry(device: torch.device, bucket: str) -> dict | None:
    """The cache's entry for ``bucket`` on ``device``, if it is a dictionary (the file is not trusted)."""
    with _lock:
        known = _load().get(device_key(device), {}).get(bucket)
    return known if isinstance(known, dict) else None


def cached(device: torch.device, bucket: str, candidates: Sequence[Config]) -> Config | None:
    """The decision cached for ``bucket`` on ``device`` if it is one of ``candidates`` (see the module's notes on
    older entries), else None."""
    known = _entry(device, bucket)
    if known is None:
        return None
    config = {k: known.get(k) for k in candidates[0]}
    return config if config in candidates else None


def choose(device: torch.device, bucket: str, candidates: Sequence[Config],
           run: Callable[[Config], object] | None = None) -> Config | None:
    """The decision for ``bucket`` on ``device`` among ``candidates`` (from :func:`candidates`): the cached one;
    else, given ``run``, ``run(candidate)`` is timed for each candidate with its variants in force, and the
    fastest is cached and returned; else None. The only candidate when there is one; None when tuning is off."""
    if not enabled():
        return None
    if len(candidates) == 1:
        return candidates[0]
    known = cached(device, bucket, candidates)
    if known is not None or run is None:
        return known
    ms = {}
    for c in candidates:
        token = _timing.set(c)  # the candidate's variants are in force while it is timed
        try:
            ms[label(c)] = _time_ms(functools.partial(run, c), device)
        finally:
            _timing.reset(token)
    best = min(candidates, key=lambda c: ms[label(c)])
    with _lock:
        _load().setdefault(device_key(device), {})[bucket] = {**best, "ms": {k: round(v, 4) for k, v in ms.items()}}
        _save()
    return best


def tune_forward(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int, nnz: int,
                 batch: int, run: Callable[[], object]) -> Config | None:
    """The forward's decision for this size on ``device``: cached, or tuned now by timing ``run()`` (one forward)
    with each of the device's kernel variants in force. Nothing is timed where the device has no variants."""
    bucket = bucket_key(dtype, in_features, out_features, nnz, batch, "forward")
    return choose(device, bucket, candidates(device.type), lambda _config: run())


def variant(device: torch.device, bucket: str, setting: str, strategy: str | None = None) -> Any:
    """The value of kernel variant ``setting`` a backend should run for ``bucket``: the candidate's while one is
    being timed, else the bucket's decision (for a backward, only when the decision was made for ``strategy``,
    the strategy running), else None (the backend's static rule). A dictionary lookup: it never waits on the
    device. The backend checks the value: the cache file is not trusted to hold a valid one."""
    timed = _timing.get()
    if timed is not None:
        return timed.get(setting)
    if not enabled():
        return None
    known = _entry(device, bucket)
    if known is None or (strategy is not None and known.get("strategy") != strategy):
        return None
    return known.get(setting)


def forget() -> None:
    """Drop every cached decision (the file and this process's copy)."""
    global _memory
    with _lock:
        _memory = {}
        cache_path().unlink(missing_ok=True)
