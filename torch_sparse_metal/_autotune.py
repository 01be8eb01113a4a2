"""The tuner's switch and the kernel variants the backends declare: the state that the ops, the backends and the
tuner (:mod:`torch_sparse_metal.tuning`) share, below all three.

Tuning is opt-in, as ``torch.backends.cudnn.benchmark`` is: off unless ``TORCH_SPARSE_METAL_TUNE=1`` is set when
the package is imported or :func:`torch_sparse_metal.tuning.enable` is called. While it is off, an op reads
:data:`enabled` and nothing else of the tuner: no cache file, lock or context variable.

Example:
    >>> enabled  # the tests' environment leaves TORCH_SPARSE_METAL_TUNE unset
    False
    >>> sorted(VARIANTS["mps"])  # the MPS backend declares its kernel variants at import
    ['spmm', 'values_per_lane']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import settings

__all__ = ["VARIANTS", "VARIANT_OPS", "enabled", "from_environment", "register_variants"]

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
