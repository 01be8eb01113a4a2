"""Helpers shared by the test modules, which import it as ``_helpers`` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from torch_sparse_metal.topology import CSRTopology


def max_terms(ptr: torch.Tensor) -> int:
    """The most terms of one sum: the longest segment of the offsets ``ptr``."""
    return int((ptr[1:] - ptr[:-1]).max()) if ptr.numel() > 1 else 0


# ------------------------------------------------------------------------------------------------ CUDA kernels
def random_topology_with_empty_lines(in_features: int, out_features: int, density: float, seed: int) -> CSRTopology:
    """``CSRTopology.random`` seeded with ``seed``; from 3 inputs and 3 outputs up, at a density strictly between 0
    and 1, source 1 and output 2 are left without edges on purpose (an empty row and column)."""
    topo = CSRTopology.random(in_features, out_features, density, generator=torch.Generator().manual_seed(seed))
    if in_features > 2 and out_features > 2 and 0 < density < 1:
        mask = torch.zeros(out_features, in_features, dtype=torch.bool)
        mask[topo.dst.long(), topo.src.long()] = True
        mask[:, 1] = False
        mask[2, :] = False
        topo = CSRTopology.from_mask(mask)
    return topo


def poison_cuda_allocator(dtype: torch.dtype) -> None:
    """Fill freed blocks of the caching allocator with NaN, so that an unwritten output or scratch element shows."""
    blocks = [torch.full((n,), float("nan"), dtype=dtype, device="cuda") for n in (1 << 10, 1 << 14, 1 << 17, 1 << 20)
              for _ in range(4)]
    del blocks


# ------------------------------------------------------------------------------------------------ Metal hosts
def metal_compiler(target: str, log: list | None = None, **compile_kwargs) -> tuple[Callable, str]:
    """``(compile_shader, device type)`` for a Metal host on ``target``: ``"executor"``, the MSL-on-CPU executor
    (compiling with ``compile_kwargs``; with ``log``, its libraries record their kernel calls there), or ``"cuda"``,
    the CUDA translation (the test is skipped without an NVIDIA GPU and nvcc)."""
    from tsm_dev.msl import compile_shader
    from tsm_dev.msl import cuda as cuda_translation
    from tsm_dev.msl.logged import LoggedLibrary

    if target == "cuda":
        if not torch.cuda.is_available() or cuda_translation.nvcc_path() is None:
            pytest.skip("the CUDA translation needs an NVIDIA GPU and nvcc")
        return cuda_translation.compile_shader, "cuda"

    def compile_fn(src: str):
        lib = compile_shader(src, **compile_kwargs)
        return lib if log is None else LoggedLibrary(lib, log)

    return compile_fn, "cpu"
