"""The Metal source of an op family as the hosts compile it (:func:`load_source`): the host's tables as defines
(:func:`shader_defines`), our common header, then the family's shader files.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from torch_sparse_metal.backends.metal_contract import (
    COMMON_HEADER,
    KERNEL_DTYPES,
    METAL_TYPE_VERSIONS,
    SHADER_CONSTANTS,
)

__all__ = ["load_source", "shader_defines"]


def _shader_dir(first: str) -> Path:
    """``torch_sparse_metal/shaders`` when installed, else ``<repo>/shaders`` next to the package (editable)."""
    try:
        found = importlib.resources.files("torch_sparse_metal.shaders").joinpath(first)
        if found.is_file():  # shaders/ is a namespace package: its root is a MultiplexedPath, the file a real one
            return Path(str(found)).parent
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve()
    candidates = (here.parents[1] / "shaders", here.parents[2] / "shaders")  # installed package, source tree
    for d in candidates:
        if (d / first).is_file():
            return d
    raise FileNotFoundError(f"cannot find {first} in the package torch_sparse_metal.shaders nor in "
                            f"{', '.join(map(str, candidates))} (reinstall torch_sparse_metal)")


def shader_defines(constants: Mapping[str, int] | None = None, dtypes: Sequence[torch.dtype] | None = None) -> str:
    """The host's tables as the shaders read them: ``#define TSM_<NAME> <value>`` for :data:`SHADER_CONSTANTS` and a
    host's own ``constants``, so that a kernel's tiles and the host's grids come from one table; and
    ``TSM_FOR_EACH_METAL_TYPE(X)``, ``X(<type>)`` for each Metal type of :data:`KERNEL_DTYPES` (the contract's; only
    ``dtypes``' where given), a type of :data:`METAL_TYPE_VERSIONS` only where the Metal language has it, which the
    shaders instantiate their kernels over.

    Example:
        >>> shader_defines({"TILE_WIDTH": 32}).splitlines()[:3]
        ['#define TSM_SIMD_WIDTH 32', '#define TSM_MAX_ROWS 8', '#define TSM_TILE_WIDTH 32']
        >>> shader_defines().splitlines()[-1]
        '#define TSM_FOR_EACH_METAL_TYPE(X) X(float) X(half) TSM_IF_METAL_310(X(bfloat))'
        >>> shader_defines(dtypes=[torch.float16]).splitlines()[-1]
        '#define TSM_FOR_EACH_METAL_TYPE(X) X(half)'
    """
    table = {**SHADER_CONSTANTS, **(constants or {})}
    return "".join(f"#define TSM_{name} {int(value)}\n" for name, value in table.items()) + _metal_type_defines(dtypes)


def _metal_type_defines(dtypes: Sequence[torch.dtype] | None) -> str:
    """``TSM_IF_METAL_<N>(x)`` (``x`` where ``__METAL_VERSION__ >= N``, else nothing) for each version a type needs,
    and ``TSM_FOR_EACH_METAL_TYPE`` over ``dtypes``' Metal types (every kernel dtype's by default)."""
    versions = sorted({version for version, _ in METAL_TYPE_VERSIONS.values()})
    guards = "".join(f"#if __METAL_VERSION__ >= {v}\n#define TSM_IF_METAL_{v}(x) x\n#else\n"
                     f"#define TSM_IF_METAL_{v}(x)\n#endif\n" for v in versions)
    types = [f"TSM_IF_METAL_{METAL_TYPE_VERSIONS[t][0]}(X({t}))" if t in METAL_TYPE_VERSIONS else f"X({t})"
             for d, t in KERNEL_DTYPES.items() if dtypes is None or d in dtypes]
    return guards + f"#define TSM_FOR_EACH_METAL_TYPE(X) {' '.join(types)}\n"


def load_source(shader_files: Sequence[str], constants: Mapping[str, int] | None = None,
                directory: Path | None = None, dtypes: Sequence[torch.dtype] | None = None) -> str:
    """The complete Metal source of an op family: the host's constants (:func:`shader_defines`, instantiating
    ``dtypes``' kernels only where given), our header, then its shader files (``#line`` keeps error positions); read
    from the package's shaders, or from ``directory`` (an earlier design's copy of them, as tsm_dev.metal_bench
    compares).

    Example:
        >>> "[[kernel]] void vector_spmm" in load_source(("vector_csr_linear.metal",))
        True
    """
    d = _shader_dir(shader_files[0]) if directory is None else Path(directory)
    parts = [shader_defines(constants, dtypes) + f'#line 1 "{COMMON_HEADER}"\n' + (d / COMMON_HEADER).read_text()]
    parts += [f'#line 1 "{name}"\n' + (d / name).read_text() for name in shader_files]
    return "\n".join(parts)
