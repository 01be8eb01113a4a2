"""benchmarks/constant_fan_in.py on the CPU: the two topologies it compares, and a tiny run's rows. Timings are not
checked (they are this machine's)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("constant_fan_in", REPO / "benchmarks" / "constant_fan_in.py")
bench = sys.modules.setdefault("constant_fan_in", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("block", (1, 8))
def test_the_topologies_share_their_edge_count_and_differ_in_fan_in(block):
    topos = bench.topologies(64, 96, 0.1, block, seed=3)
    random, constant = topos["random"], topos["constant"]
    assert random.nnz == constant.nnz > 0 and random.block == constant.block == 1
    assert constant.common_fan_in() == round(0.1 * 96)
    assert random.common_fan_in() is None  # uneven in-degrees, as a uniform draw gives
    assert (random.in_features, random.out_features) == (96, 64 // block)


def test_a_tiny_run_reports_every_op_of_every_case(tmp_path):
    out = tmp_path / "cfi.json"
    assert bench.main(["--shapes", "32x48", "--densities", "0.1", "--blocks", "1,8", "--batch", "5", "--reps", "2",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["torch"] == torch.__version__ and result["meta"]["command"].endswith(str(out))
    assert [r["block"] for r in result["rows"]] == [1, 8]
    for row in result["rows"]:
        assert set(row["ops"]) == {"forward", "fused_atomic", "atomic_free"}
        for t in row["ops"].values():
            assert t["random_ms"] > 0 and t["constant_ms"] > 0
            assert t["random_over_constant"] == pytest.approx(t["random_ms"] / t["constant_ms"])
