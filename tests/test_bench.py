"""The benchmark command on the CPU: rows, keys, the dtype axis and its same-run ratios (timings are not checked)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch

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
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["dtype"] == "float32"


def test_dtypes_are_timed_in_one_round_robin_with_same_run_ratios(monkeypatch):
    """Every dtype of a case is timed in one ``Timer.many`` call, and our rows' speedups are the ratios of that
    run's rows: torch.sparse fp32, dense fp32 and dense in the row's dtype."""
    calls = []
    many = bench.Timer.many
    monkeypatch.setattr(bench.Timer, "many", lambda self, fns: calls.append(list(fns)) or many(self, fns))
    rows = bench.run_cases([bench.Case(70, 33, 0.1, 5)], device="cpu", reps=2,
                           dtypes=(torch.float32, torch.bfloat16))
    assert len(calls) == 1 and any(k.endswith("@torch.bfloat16") for k in calls[0])
    by = {(r["method"], r["dtype"]): r for r in rows}
    for dtype, dense in (("float32", "dense_fp32"), ("bfloat16", "dense_bf16")):
        for method in ("fused_atomic", "atomic_free", dense):
            row = by[(method, dtype)]
            assert math.isfinite(row["fwd_ms"]) and math.isfinite(row["bwd_ms"]) and row["bwd_ms"] > 0
    assert ("torch_sparse", "float32") in by
    ours = by[("atomic_free", "bfloat16")]
    assert set(ours["speedup"]) == {"torch_sparse_fp32", "dense_fp32", "dense_bf16"}
    for label, base in (("torch_sparse_fp32", ("torch_sparse", "float32")), ("dense_fp32", ("dense_fp32", "float32")),
                        ("dense_bf16", ("dense_bf16", "bfloat16"))):
        for k in ("fwd", "bwd"):
            assert ours["speedup"][label][k] == by[base][f"{k}_ms"] / ours[f"{k}_ms"]


def test_float32_baselines_are_timed_whatever_the_dtypes():
    rows = bench.run_cases([bench.Case(40, 20, 0.2, 3)], device="cpu", reps=2, dtypes=(torch.float16,))
    pairs = {(r["method"], r["dtype"]) for r in rows}
    assert {("dense_fp32", "float32"), ("torch_sparse", "float32"), ("fused_atomic", "float16"),
            ("dense_fp16", "float16")} <= pairs
    assert ("fused_atomic", "float32") not in pairs


def test_main_dtypes_json_and_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "cases", lambda names: [bench.Case(70, 33, 0.1, 5, "tiny")])
    bench.main(["--device", "cpu", "--reps", "1", "--out", str(tmp_path), "--name", "t",
                "--dtypes", "float32,bfloat16"])
    rows = json.loads((tmp_path / "t.json").read_text())
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    ours = [r for r in rows if r["method"] in {s.value for s in bench.CONCRETE}]
    assert len(ours) == 2 * 2 and all(math.isfinite(r["fwd_ms"] + r["bwd_ms"]) for r in ours)
    assert all("dense_bf16" in r["speedup"] for r in ours if r["dtype"] == "bfloat16")
    out = capsys.readouterr().out
    assert "bfloat16: ours fwd" in out and "vs dense_bf16" in out and "vs torch_sparse_fp32" in out
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--dtypes", "float8"])


def test_main_writes_json(tmp_path, capsys):
    bench.main(["--device", "cpu", "--cases", "seed", "--reps", "1", "--out", str(tmp_path), "--name", "t"])
    rows = json.loads((tmp_path / "t.json").read_text())
    assert len({(r["density"], r["method"]) for r in rows}) == len(rows) == 5 * 4
    assert {r["dtype"] for r in rows} == {"float32"}
    assert "best bwd=" in capsys.readouterr().out


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_timer_times_device_work_while_the_host_runs_ahead():
    """A call that spends 5 ms on the host before a short kernel reads as the kernel, with 5 ms of host time;
    a matmul reads as its time from an idle device (events around it, the host's share negligible there)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(4096, 4096, device="cuda", generator=g) for _ in range(2))
    x = torch.randn(1 << 16, device="cuda", generator=g)

    def host_bound() -> None:
        time.sleep(0.005)
        x.mul_(1.0)

    for _ in range(3):  # the GPU's clocks up, as in the Timer's warm-up
        a @ b
    reference = []
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        reference.append(start.elapsed_time(end))
    t = bench.Timer(torch.device("cuda"), reps=5).many({"host": host_bound, "matmul": lambda: a @ b})
    assert t["host"].host_ms >= 5 and t["host"].ms < 0.5, t
    assert t["matmul"].ms == pytest.approx(statistics.median(reference), rel=0.15), (t, reference)
