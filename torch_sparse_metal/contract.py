"""The op contract's tables as Python sees them: the value dtypes and the backward strategies.

They are defined once, in ``csrc/contract.h``, and read here from the compiled extension
(``torch_sparse_metal._C.contract()``); the functional API, the checks, the Metal host code and the tests take
them from this module.

Example:
    >>> from torch_sparse_metal.contract import DTYPES, Strategy, supported_dtypes
    >>> DTYPES[torch.bfloat16].accumulate
    torch.float32
    >>> torch.float64 in supported_dtypes("mps")
    False
    >>> Strategy("atomic_free") is Strategy.ATOMIC_FREE
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from . import _C

__all__ = ["DTYPES", "INDEX_ARRAYS", "STRATEGIES", "DtypeSpec", "Strategy", "supported_dtypes"]


@dataclass(frozen=True)
class DtypeSpec:
    """One value dtype: what the kernels sum in, its Metal type (``None``: no Metal kernels), and the device
    types with kernels for it."""

    dtype: torch.dtype
    accumulate: torch.dtype
    metal: str | None
    devices: frozenset[str]


def _load() -> tuple[dict[torch.dtype, DtypeSpec], tuple[str, ...], tuple[str, ...]]:
    table = _C.contract()
    dtypes = {}
    for name, accumulate, metal, devices in table["dtypes"]:
        dtype = getattr(torch, name)
        dtypes[dtype] = DtypeSpec(dtype, getattr(torch, accumulate), metal or None, frozenset(devices.split()))
    return dtypes, tuple(table["strategies"]), tuple(table["index_arrays"])


#: Every value dtype with kernels on some device, in the order of ``csrc/contract.h``; the concrete backward
#: strategies; the topology's index arrays in the order of the device error words (``check_index_errors``).
DTYPES, STRATEGIES, INDEX_ARRAYS = _load()

class _StrEnum(str, enum.Enum):
    """Members are their names' strings (``str()`` and f-strings give the value), as ``enum.StrEnum`` in 3.11+."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


#: The backward strategies (``STRATEGIES``, each member's value its schema name), and ``auto``: resolved by the
#: autograd rule (:mod:`torch_sparse_metal.strategy`) before a kernel runs.
Strategy = _StrEnum("Strategy", [(s.upper(), s) for s in (*STRATEGIES, "auto")])
Strategy.__doc__ = "A backward strategy of the op contract (``csrc/contract.h``), or ``auto``."


def supported_dtypes(device_type: str) -> tuple[torch.dtype, ...]:
    """The value dtypes with kernels on ``device_type`` (``"cpu"``, ``"cuda"``, ``"mps"``)."""
    return tuple(d for d, spec in DTYPES.items() if device_type in spec.devices)
