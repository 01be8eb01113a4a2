"""The benchmark command on the CPU: rows, keys and the variant environment helper (timings are not checked)."""

from __future__ import annotations

import json
import os

from torch_sparse_metal import bench


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
