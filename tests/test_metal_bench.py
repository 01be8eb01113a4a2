"""The development benchmark of the Metal designs (tsm_dev.metal_bench), on the executor: the shipped design and a
baseline folder are timed beside ours, the table takes its ratios within runs, and its usage errors."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from torch_sparse_metal.backends.metal import CALLS_BY_PATH
from torch_sparse_metal_tools import bench
from tsm_dev import metal_bench
from tsm_dev.msl import compile_shader

REPO = Path(__file__).resolve().parents[1]


def test_metal_designs_time_beside_ours(tmp_path):
    """The shipped design and a baseline folder (here a copy of the shipped files, loaded the way an earlier
    commit's would be) are timed in the same round-robin, both on their Metal kernels (never the reference path)."""
    for name in ("csr_linear_common.h", "csr_linear.metal"):
        shutil.copy(REPO / "shaders" / name, tmp_path / name)
    shutil.copy(REPO / "torch_sparse_metal" / "backends" / "mps.py", tmp_path / "mps.py")
    designs = metal_bench.metal_designs(tmp_path, compile_fn=compile_shader, device_type="cpu")
    before = Counter(CALLS_BY_PATH)
    rows = bench.run_cases([bench.Case(70, 33, 0.1, 5)], device="cpu", reps=2, designs=designs)
    ran = Counter(CALLS_BY_PATH) - before
    assert ran[("csr_linear.metal", torch.float32, "metal")] > 0 and not [k for k in ran if k[2] == "reference"]
    methods = {r["method"] for r in rows}
    assert {"fused_atomic/metal", "atomic_free/metal", "fused_atomic/metal_base", "atomic_free/metal_base"} <= methods
    table = metal_bench.metal_table([rows, rows])
    assert len(table.splitlines()) == 2 + 3 and "70², 10%, B5 | atomic_free bwd" in table


def test_metal_table_takes_ratios_within_runs():
    def run(cuda_ms: float, metal_ms: float) -> list[dict]:
        case = {"in_features": 64, "density": 0.05, "batch": 8}
        return [{**case, "method": m, "fwd_ms": t, "bwd_ms": 2 * t}
                for m, t in (("fused_atomic", cuda_ms), ("atomic_free", cuda_ms), ("fused_atomic/metal", metal_ms),
                             ("atomic_free/metal", metal_ms))]

    table = metal_bench.metal_table([run(1.0, 1.5), run(2.0, 2.2), run(4.0, 4.0)])
    forward = next(line for line in table.splitlines() if "| forward |" in line)
    assert forward == "| 64², 5%, B8 | forward | 2.0000 | 2.2000 | 1.10 (1.00-1.50) |"


@pytest.mark.parametrize(("argv", "message"), [
    (["--baseline", "/no/such/dir"], "argument --baseline: no such file or directory"),
    (["--device", "cpu"], "the Metal kernels run through their CUDA translation here: use --device cuda"),
])
def test_bad_values_are_usage_errors(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: pytest.fail("timed before refusing"))
    with pytest.raises(SystemExit) as exc:
        metal_bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
