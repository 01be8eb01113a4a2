"""Helpers shared by the test modules, which import it as ``_helpers`` (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_sparse_metal.topology import CSRTopology

ROOT = Path(__file__).resolve().parents[1]


def run_python_json(code: str, timeout: float = 300) -> Any:
    """Runs ``code`` in a fresh interpreter from the checkout (this package on its path) and returns the JSON its
    last line of output prints."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


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
