"""The tuner's switch, and all of the tuner that an op touches.

Tuning is opt-in, as ``torch.backends.cudnn.benchmark`` is: off unless ``TORCH_SPARSE_METAL_TUNE=1`` is set when
the package is imported or :func:`torch_sparse_metal.tuning.enable` is called. While it is off, an op reads
:data:`enabled` and nothing else of the tuner: no cache file, lock or context variable, and neither
:mod:`torch_sparse_metal.tuning` nor :mod:`torch_sparse_metal.timing` is imported. Once it is on, the hooks below
load the tuner at their first call.

Example:
    >>> enabled  # the tests' environment leaves TORCH_SPARSE_METAL_TUNE unset
    False
    >>> variant(torch.device("cpu"), (torch.float32, 64, 32, 200, 8, "forward"), "values_per_lane") is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import settings

__all__ = ["VARIANTS", "VARIANT_OPS", "enabled", "forward", "from_environment", "register_variants", "strategy",
           "variant"]

#: The environment setting read at import (:mod:`.settings`).
TUNE_ENV = "TORCH_SPARSE_METAL_TUNE"


def from_environment() -> bool:
    """``TORCH_SPARSE_METAL_TUNE`` as a boolean, off when unset; a value that is no boolean raises ValueError."""
    return settings.flag(TUNE_ENV, False)


#: Whether ``auto`` is tuned on this machine: ``TORCH_SPARSE_METAL_TUNE`` at import (default off), then
#: :func:`torch_sparse_metal.tuning.enable`.
enabled: bool = from_environment()
#: Kernel variants per device type, as their backends declare them (:func:`register_variants`): setting -> values.
VARIANTS: dict[str, dict[str, tuple[Any, ...]]] = {}
#: Per device type, the ops a variant setting changes (``"forward"`` and strategy names); a setting not named
#: changes every op.
VARIANT_OPS: dict[str, dict[str, tuple[str, ...]]] = {}


def register_variants(device_type: str, variants: Mapping[str, Sequence[Any]],
                      ops: Mapping[str, Sequence[str]] | None = None) -> None:
    """Declare the kernel variants a backend runs on ``device_type`` (setting -> the values the tuner times) and, in
    ``ops``, the ops a setting changes where that is not every op (``"forward"``, strategy names)."""
    VARIANTS[device_type] = {name: tuple(values) for name, values in variants.items()}
    VARIANT_OPS[device_type] = {name: tuple(names) for name, names in (ops or {}).items()}


def forward(x: torch.Tensor, topology: Any, run: Callable[[], object]) -> None:
    """With tuning on, the forward's kernel variants for this size on ``x``'s device: cached, or timed now by
    calling ``run()`` (one forward on real tensors) with each candidate in force. Nothing without tuning."""
    if enabled:
        from . import tuning

        tuning.tune_forward(x.device, x.dtype, topology.in_features, topology.out_features, topology.nnz, x.shape[0],
                            run)


def strategy(device: torch.device, sizes: tuple[int, int, int, int], dtype: torch.dtype,
             measure: Callable[[str], object] | None) -> str | None:
    """With tuning on, the tuned strategy of a backward of ``sizes`` (in, out, nnz, batch) on ``device``, tuned
    now through ``measure`` (a backward with the given strategy) where the machine has no decision yet; None where
    nothing is tuned (tuning off, one candidate, symbolic sizes) and the static rule applies."""
    if not enabled:
        return None
    from . import tuning

    return tuning.tuned_strategy(device, sizes, dtype, measure)


def variant(device: torch.device, key: tuple[Any, ...], setting: str, strategy: str | None = None) -> Any:
    """The tuned value of kernel variant ``setting`` for a call on ``device`` whose size is ``key`` (the arguments
    of :func:`torch_sparse_metal.tuning.bucket_key`), for the backward only where ``strategy`` is the one tuned;
    None (the backend's static rule) without a decision, and always with tuning off. Never waits on the device."""
    if not enabled:
        return None
    from . import tuning

    return tuning.variant(device, tuning.bucket_key(*key), setting, strategy)
