"""The benchmark command on the CPU: rows, keys and the variant environment helper (timings are not checked)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torch_sparse_metal import bench
from torch_sparse_metal.testing.msl import compile_shader

REPO = Path(__file__).resolve().parents[1]


def test_run_cases_times_every_method_on_the_cpu():
    rows = bench.run_cases([bench.Case(70, 33, 0.1, 5)], device="cpu", reps=2)
    methods = {r["method"] for r in rows}
    assert methods == {"fused_atomic", "atomic_free", "dense_fp32", "torch_sparse"}
    for row in rows:
        assert {"in_features", "out_features", "density", "batch", "method", "fwd_ms", "bwd_ms", "device",
                "torch"} <= row.keys()
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0


def test_main_writes_json(tmp_path, capsys):
    bench.main(["--device", "cpu", "--cases", "seed", "--reps", "1", "--out", str(tmp_path), "--name", "t"])
    rows = json.loads((tmp_path / "t.json").read_text())
    assert len({(r["density"], r["method"]) for r in rows}) == len(rows) == 5 * 4
    assert "best bwd=" in capsys.readouterr().out


def test_with_env_sets_and_restores(monkeypatch):
    monkeypatch.delenv("TORCH_SPARSE_METAL_CUDA_SDDMM", raising=False)
    seen = bench._with_env({"TORCH_SPARSE_METAL_CUDA_SDDMM": "edge"},
                           lambda: os.environ.get("TORCH_SPARSE_METAL_CUDA_SDDMM"))()
    assert seen == "edge" and "TORCH_SPARSE_METAL_CUDA_SDDMM" not in os.environ


def test_metal_designs_time_beside_ours(tmp_path):
    """--metal-designs' path, on the executor: the shipped design and a baseline folder (here a copy of the
    shipped files, loaded the way an earlier commit's would be) are timed in the same round-robin."""
    for name in ("csr_linear_common.h", "csr_linear.metal"):
        shutil.copy(REPO / "shaders" / name, tmp_path / name)
    shutil.copy(REPO / "torch_sparse_metal" / "backends" / "mps.py", tmp_path / "mps.py")
    designs = bench.metal_designs(tmp_path, compile_fn=compile_shader, device_type="cpu")
    rows = bench.run_cases([bench.Case(70, 33, 0.1, 5)], device="cpu", reps=2, metal=designs)
    methods = {r["method"] for r in rows}
    assert {"fused_atomic/metal", "atomic_free/metal", "fused_atomic/metal_base", "atomic_free/metal_base"} <= methods
    table = bench.metal_table([rows, rows])
    assert len(table.splitlines()) == 2 + 3 and "70², 10%, B5 | atomic_free bwd" in table


def test_metal_table_takes_ratios_within_runs():
    def run(cuda_ms: float, metal_ms: float) -> list[dict]:
        case = {"in_features": 64, "density": 0.05, "batch": 8}
        return [{**case, "method": m, "fwd_ms": t, "bwd_ms": 2 * t}
                for m, t in (("fused_atomic", cuda_ms), ("atomic_free", cuda_ms), ("fused_atomic/metal", metal_ms),
                             ("atomic_free/metal", metal_ms))]

    table = bench.metal_table([run(1.0, 1.5), run(2.0, 2.2), run(4.0, 4.0)])
    forward = next(line for line in table.splitlines() if "| forward |" in line)
    assert forward == "| 64², 5%, B8 | forward | 2.0000 | 2.2000 | 1.10 (1.00-1.50) |"
