"""The op contract's tables as Python sees them: the value dtypes, the backward strategies and their properties, the
index arrays, the vector blocks, and the int32 bound of every size and index.

The tables are defined once, in ``csrc/contract.h`` (the topology arguments in the op schemas of
``csrc/csr_linear.cpp``), and read here from the compiled extension; the functional API, the checks, the Metal
host code, the development tools and the tests take them from this module.

Example:
    >>> from torch_sparse_metal.contract import DTYPES, Strategy, supported_dtypes
    >>> DTYPES[torch.bfloat16].accumulate
    torch.float32
    >>> torch.float64 in supported_dtypes("mps")
    False
    >>> Strategy("atomic_free") is Strategy.ATOMIC_FREE
    True
    >>> TOPOLOGY_ARGS
    ('row_ptr', 'dst', 'src', 'col_ptr', 'src_by_dst', 'perm')
    >>> STRATEGY_SPECS[Strategy.FUSED_ATOMIC].accumulates
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from . import _C

__all__ = ["DTYPES", "INDEX_ARRAYS", "INT32_MAX", "LAYOUTS", "STRATEGIES", "STRATEGY_SPECS", "TOPOLOGY_ARGS",
           "VECTOR_BLOCKS", "DtypeSpec", "LayoutSpec", "Strategy", "StrategySpec", "layout_block", "layout_of",
           "supported_dtypes"]

#: Every size and index the kernels handle fits a signed 32-bit integer (the indices are int32; the C++ boundary,
#: csrc/csr_linear_checks.cpp, checks the same bound).
INT32_MAX = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class DtypeSpec:
    """One value dtype: what the kernels sum in, its Metal type (``None``: no Metal kernels) and the Metal language
    version it needs (``__METAL_VERSION__``; 0: every one torch compiles at), and the device types with kernels for
    it."""

    dtype: torch.dtype
    accumulate: torch.dtype
    metal: str | None
    metal_version: int
    devices: frozenset[str]


@dataclass(frozen=True)
class StrategySpec:
    """One concrete backward strategy's properties (the columns of ``TSM_FOR_EACH_STRATEGY``): ``deterministic``,
    every gradient element has one owner, which sums in a fixed order, on every device; ``accumulates``, partial sums
    of the weight gradient meet in atomic adds (into a zero-filled buffer), in an order no one fixes."""

    name: str
    deterministic: bool
    accumulates: bool


@dataclass(frozen=True)
class LayoutSpec:
    """One layout of ``csr_linear``'s weight (a row of ``TSM_FOR_EACH_LAYOUT``): the ops pick it by the weight's
    ``rank``; each connection of the topology feeds ``block`` consecutive outputs (the weight's last dimension, 1
    for a 1-D weight), one of ``blocks``."""

    name: str
    rank: int
    blocks: tuple[int, ...]


def _load() -> tuple[dict[torch.dtype, DtypeSpec], dict[str, StrategySpec], tuple[str, ...],
                     dict[str, LayoutSpec]]:
    table = _C.contract()
    dtypes = {}
    for name, accumulate, metal, metal_version, devices in table["dtypes"]:
        dtype = getattr(torch, name)
        dtypes[dtype] = DtypeSpec(dtype, getattr(torch, accumulate), metal or None, metal_version,
                                  frozenset(devices.split()))
    strategies = {name: StrategySpec(name, deterministic, accumulates)
                  for name, deterministic, accumulates in table["strategies"]}
    layouts = {name: LayoutSpec(name, rank, tuple(blocks)) for name, rank, blocks in table["layouts"]}
    return dtypes, strategies, tuple(table["index_arrays"]), layouts


#: Every value dtype with kernels on some device, in the order of ``csrc/contract.h``; the concrete backward
#: strategies' properties by name; the topology's index arrays in the order of the device error words
#: (``check_index_errors``); the layouts of the weight by name.
DTYPES, _STRATEGY_TABLE, INDEX_ARRAYS, LAYOUTS = _load()
#: The vector lengths V of the vector layout (``SparseLinear(block=V)``, a weight ``[vectors, V]`` given to the
#: ops; block 1 is the unstructured layout, a weight ``[nnz]``).
VECTOR_BLOCKS = LAYOUTS["vector"].blocks
#: The concrete backward strategies' names, in the order of ``csrc/contract.h``.
STRATEGIES = tuple(_STRATEGY_TABLE)


def layout_block(weight: torch.Tensor) -> int:
    """Outputs per connection of a weight given to the ops: its last dimension, 1 for a 1-D weight.

    Example:
        >>> layout_block(torch.zeros(5)), layout_block(torch.zeros(5, 16))
        (1, 16)
    """
    return weight.shape[-1] if weight.dim() > 1 else 1


def layout_of(weight: torch.Tensor) -> LayoutSpec:
    """The layout of a weight given to the ops, by its rank and block; a ``ValueError`` naming every layout for
    any other shape (the C++ boundary's ``layout_of`` in ``csrc/contract.h`` refuses the same shapes).

    Example:
        >>> layout_of(torch.zeros(5)).name, layout_of(torch.zeros(5, 16)).name
        ('unstructured', 'vector')
    """
    block = layout_block(weight)
    for spec in LAYOUTS.values():
        if weight.dim() == spec.rank and block in spec.blocks:
            return spec
    described = " ".join(f"{s.name} ({s.rank}-D, V one of {set(s.blocks)});" for s in LAYOUTS.values())
    raise ValueError(f"weight must be [connections] or [connections, V] (V outputs per connection) in a layout of "
                     f"csr_linear: {described} got shape {tuple(weight.shape)}")


def _topology_args() -> tuple[str, ...]:
    names = [a.name for a in torch.ops.torch_sparse_metal.csr_linear.default._schema.arguments]
    return tuple(names[names.index("weight") + 1 : -1])


#: The topology's index tensors in the order the ops take them (read from ``csr_linear``'s schema in
#: ``csrc/csr_linear.cpp``; ``CSRTopology.kernel_args`` gives them in this order).
#: (``INDEX_ARRAYS`` is the list of the device error words, which have none for ``src``.)
TOPOLOGY_ARGS = _topology_args()


class _StrEnum(str, enum.Enum):
    """Members are their names' strings (``str()`` and f-strings give the value), as ``enum.StrEnum`` in 3.11+."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


#: The backward strategies (``STRATEGIES``, each member's value its schema name), and ``auto``: resolved by the
#: autograd rule (:mod:`torch_sparse_metal.strategy`) before a kernel runs.
Strategy = _StrEnum("Strategy", [(s.upper(), s) for s in (*STRATEGIES, "auto")])
Strategy.__doc__ = "A backward strategy of the op contract (``csrc/contract.h``), or ``auto``."
#: Each concrete strategy's properties (``csrc/contract.h``): every decision that depends on a strategy reads them here.
STRATEGY_SPECS = {Strategy(name): spec for name, spec in _STRATEGY_TABLE.items()}


def supported_dtypes(device_type: str) -> tuple[torch.dtype, ...]:
    """The value dtypes with kernels on ``device_type`` (``"cpu"``, ``"cuda"``, ``"mps"``)."""
    return tuple(d for d, spec in DTYPES.items() if device_type in spec.devices)
