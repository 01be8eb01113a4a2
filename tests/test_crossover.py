"""benchmarks/crossover.py on the CPU at tiny sizes: its rows, ratios, refusals and the crossover interpolation
(timings are not checked: the CPU has no CUDA graphs, and the timer's synchronised wall clock is used)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from torch_sparse_metal.strategy import CONCRETE

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("crossover", REPO / "benchmarks" / "crossover.py")
crossover = sys.modules.setdefault("crossover", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(crossover)

OURS = {s.value for s in CONCRETE}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of the script's command line: two tiny shapes, two densities, float32 and bfloat16, with the BSR
    builder failing for 32-blocks (a method that fails must give a row with its reason)."""
    out = tmp_path_factory.mktemp("crossover")
    real = crossover.bsr_method

    def bsr(shape, density, block, *args):
        if block == 32:
            raise RuntimeError("no 32-blocks in this test")
        return real(shape, density, block, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(crossover, "bsr_method", bsr)
        rows = crossover.main(["--device", "cpu", "--shape", "64x32x8", "--shape", "40x48x5", "--densities",
                               "0.25,0.05", "--reps", "2", "--out", str(out), "--name", "t"])
    return rows, out


def test_rows_carry_the_bench_fields_and_same_run_ratios(run):
    rows, out = run
    assert json.loads((out / "t.json").read_text(), parse_constant=float) is not None
    saved = json.loads((out / "t.json").read_text())
    assert len(saved) == len(rows) and [r["method"] for r in saved] == [r["method"] for r in rows]
    keys = {"in_features", "out_features", "density", "batch", "nnz", "group", "dtype", "method", "fwd_ms", "bwd_ms",
            "fwd_host_ms", "bwd_host_ms", "step_ms", "vs_dense_bf16", "device", "torch", "timing"}
    for row in rows:
        assert keys <= row.keys(), keys - row.keys()
    groups = {r["group"] for r in rows}
    assert groups == {"64x32 B8", "40x48 B5"}
    for group in groups:
        for density in (0.05, 0.25):
            case = [r for r in rows if r["group"] == group and r["density"] == density and not r.get("structured")]
            by = {(r["method"], r["dtype"]): r for r in case}
            assert {("dense_fp32", "float32"), ("dense_bf16", "bfloat16"), ("ours_best", "float32"),
                    ("ours_best", "bfloat16"), ("torch_sparse", "float32")} <= by.keys()
            base = by[("dense_bf16", "bfloat16")]
            for r in case:
                assert r["timing"] in ("synchronised wall", "not timed")  # no graphs on the CPU
                for s in ("fwd", "bwd", "step"):
                    if math.isfinite(r[f"{s}_ms"]):
                        assert r["vs_dense_bf16"][s] == pytest.approx(base[f"{s}_ms"] / r[f"{s}_ms"])
                if math.isfinite(r["fwd_ms"]) and math.isfinite(r["bwd_ms"]):
                    assert r["step_ms"] == pytest.approx(r["fwd_ms"] + r["bwd_ms"])
            for dtype in ("float32", "bfloat16"):
                ours = [by[(s, dtype)] for s in OURS]
                best = by[("ours_best", dtype)]
                assert best["bwd_ms"] == min(r["bwd_ms"] for r in ours)
                assert len({r["fwd_ms"] for r in ours}) == 1  # one forward, timed once, shared
                assert all(r["nnz"] == round(density * r["in_features"] * r["out_features"]) for r in ours)


def test_every_untimed_row_says_why(run):
    rows, _ = run
    untimed = [r for r in rows if not (math.isfinite(r["fwd_ms"]) and math.isfinite(r["bwd_ms"]))]
    assert untimed
    for r in untimed:
        assert r.get("note"), r
    bsr32 = [r for r in rows if r["method"] == "bsr32"]
    assert bsr32 and all("no 32-blocks in this test" in r["note"] and math.isnan(r["fwd_ms"]) for r in bsr32)
    # torch refuses 2:4 off CUDA: its one case per shape is a row with torch's reason, beside timed dense rows
    semi = [r for r in rows if r["method"] == "semi_structured_2:4"]
    assert {r["group"] for r in semi} == {"64x32 B8", "40x48 B5"} and all(r["density"] == 0.5 for r in semi)
    assert all(r["structured"] and "to_sparse_semi_structured" in r["note"] for r in semi)
    # 40x48 is not a multiple of 16x16 blocks: refused before torch is asked
    unblockable = [r for r in rows if r["method"] == "bsr16" and r["group"] == "40x48 B5"]
    assert len(unblockable) == 4 and all("not a multiple" in r["note"] for r in unblockable)


def test_errors_against_float64_on_one_density_per_shape(run):
    rows, _ = run
    checked = [r for r in rows if "rel_err" in r and r["method"] in OURS]
    assert {(r["group"], r["density"]) for r in checked} == {("64x32 B8", 0.05), ("40x48 B5", 0.05)}
    for r in checked:
        limit = 1e-5 if r["dtype"] == "float32" else 1e-2
        assert set(r["rel_err"]) == {"fwd", "grad_x", "grad_w"}
        assert all(0 <= v < limit for v in r["rel_err"].values()), r["rel_err"]


def test_the_report_has_the_crossover_table(run):
    _, out = run
    text = (out / "t.md").read_text()
    assert "| shape | ours bf16 fwd |" in text
    assert sum(line.startswith("| 64x32 B8 |") for line in text.splitlines()) >= 2


@pytest.mark.parametrize(("points", "expected"), [
    ([(0.01, 1.5), (0.04, 0.5)], (0.02, "2%")),  # halfway in the speedup: the geometric mean of the densities
    ([(0.04, 0.5), (0.01, 1.5), (0.1, 0.2)], (0.02, "2%")),  # any order
    ([(0.005, 0.9), (0.25, 0.1)], (None, "< 0.5%")),  # already slower at the sparsest
    ([(0.005, 3.0), (0.01, 2.0), (0.25, 1.1)], (None, "> 25%")),  # faster everywhere
    ([(0.01, 2.0), (0.02, 1.0), (0.05, 1.2)], (0.02, "2%")),  # the first fall through 1 counts
    ([(0.01, float("nan")), (0.02, 2.0), (0.05, 0.5)], (0.02 * 2.5 ** (2 / 3), "3.7%")),  # NaN points skipped
    ([(0.01, float("nan"))], (None, "-")),
])
def test_crossover_interpolates_log_linearly(points, expected):
    density, text = crossover.crossover(points)
    assert text == expected[1]
    assert density == pytest.approx(expected[0]) if expected[0] is not None else density is None


def test_a_slow_or_failing_callable_is_not_timed():
    cpu = torch.device("cpu")
    predicted = crossover.prepare(lambda: None, cpu, False, cap_s=0.1, predicted_s=2.0, predicted_from="a guess")
    assert predicted.fn is None and "predicted 2.00 s" in predicted.note and predicted.seconds == 2.0
    slow = crossover.prepare(lambda: time.sleep(0.02), cpu, False, cap_s=0.005, predicted_s=None, predicted_from="")
    assert slow.fn is None and "one call took" in slow.note and slow.seconds >= 0.02

    def boom():
        raise ValueError("refused here")

    failing = crossover.prepare(boom, cpu, False, cap_s=1.0, predicted_s=None, predicted_from="")
    assert failing.fn is None and failing.note == "refused: refused here"
    ok = crossover.prepare(lambda: None, cpu, False, cap_s=1.0, predicted_s=0.1, predicted_from="")
    assert ok.fn is not None and ok.timing == "synchronised wall"


def test_topologies_and_block_matrices_match_their_dense_forms():
    topo = crossover.random_topology(40, 24, 0.3, torch.device("cpu"), seed=5)
    assert topo.nnz == round(0.3 * 40 * 24) and topo.edge_keys().unique().numel() == topo.nnz
    brow, bcol = crossover.block_pattern(32, 48, 16, 0.5, torch.device("cpu"), seed=2)
    assert brow.numel() == 3 and len(set(zip(brow.tolist(), bcol.tolist()))) == 3
    values = torch.randn(brow.numel(), 16, 16)
    w, wt = crossover.bsr_pair(brow, bcol, values, (32, 48))
    dense = torch.zeros(32, 48)
    for k, (r, c) in enumerate(zip(brow.tolist(), bcol.tolist())):
        dense[16 * r:16 * r + 16, 16 * c:16 * c + 16] = values[k]
    assert torch.equal(w.to_dense(), dense) and torch.equal(wt.to_dense(), dense.t())
    assert crossover.block_pattern(32, 32, 16, 0.001, torch.device("cpu"), seed=2)[0].numel() == 1  # one at least


def test_runs_merge_case_by_case_and_report_without_timing(run, tmp_path):
    rows, out = run
    again = [dict(r, fwd_ms=123.0) for r in rows if r["group"] == "40x48 B5" and r["density"] == 0.25]
    (tmp_path / "later.json").write_text(json.dumps(again))
    merged = crossover.main(["--device", "cpu", "--from-json", str(out / "t.json"), str(tmp_path / "later.json"),
                             "--out", str(tmp_path), "--name", "merged"])
    assert len(merged) == len(rows)
    replaced = [r for r in merged if r["group"] == "40x48 B5" and r["density"] == 0.25]
    assert replaced and all(r["fwd_ms"] == 123.0 for r in replaced)
    def ident(r: dict) -> tuple:
        return r["group"], r["density"], r["method"], r["dtype"], r["fwd_ms"] if math.isfinite(r["fwd_ms"]) else None

    assert [ident(r) for r in merged if r not in replaced] == [ident(r) for r in rows if r["group"] != "40x48 B5"
                                                                or r["density"] != 0.25]
    assert "| 40x48 B5 |" in (tmp_path / "merged.md").read_text()


@pytest.mark.parametrize("vector", [1, 4, 8])
def test_vector_topology_shares_each_input_across_its_group(vector):
    topo = crossover.vector_topology(24, 32, 0.2, vector, torch.device("cpu"), seed=int(time.time_ns() % 1000))
    dense = topo.to_sparse_csr(torch.ones(topo.nnz)).to_dense().bool()  # [out, in]
    groups = dense.reshape(32 // vector, vector, 24)
    assert bool((groups == groups[:, :1]).all())  # the V outputs of a group have the same inputs
    assert groups[:, 0].sum() == max(1, round(0.2 * 24 * 32 / vector))


def test_vector_topology_refuses_a_length_that_does_not_divide_the_outputs():
    with pytest.raises(ValueError, match="multiple of the vector length"):
        crossover.vector_topology(8, 12, 0.5, 8, torch.device("cpu"), seed=0)


def test_vector_cases_are_their_own_groups(tmp_path):
    rows = crossover.main(["--device", "cpu", "--shape", "32x32x6", "--densities", "0.25", "--vectors", "1,4",
                           "--no-structured", "--reps", "2", "--out", str(tmp_path), "--name", "v"])
    assert {r["group"] for r in rows} == {"32x32 B6", "32x32 B6 V4"}
    vec = [r for r in rows if r["group"].endswith("V4")]
    assert all(r["vector"] == 4 for r in vec) and not any(r["method"].startswith("bsr") for r in vec)
    assert {r["method"] for r in vec} >= {"dense_bf16", "ours_best", *OURS}
    ours = [r for r in vec if r["method"] in OURS and "rel_err" in r]
    assert ours and all(max(r["rel_err"].values()) < 1e-2 for r in ours)


def test_block_cases_time_the_vector_ops_beside_dense_and_bsr(tmp_path):
    rows = crossover.main(["--device", "cpu", "--shape", "32x32x6", "--densities", "0.25", "--blocks", "8",
                           "--no-structured", "--reps", "2", "--out", str(tmp_path), "--name", "b"])
    assert {r["group"] for r in rows} == {"32x32 B6 block8"}  # block 1 not asked for: no csr_linear case
    ours = [r for r in rows if r["method"] in OURS]
    assert {r["dtype"] for r in ours} == {"float32", "bfloat16"}
    assert all(r["block"] == 8 and r["nnz"] == round(0.25 * 32 * 32 / 8) * 8 for r in ours)
    assert {r["method"] for r in rows} >= {"dense_bf16", "dense_fp32", "bsr16", "bsr32", "ours_best", *OURS}
    assert all(r["block"] in (16, 32) for r in rows if r["method"].startswith("bsr"))  # BSR keeps its own block
    checked = [r for r in ours if "rel_err" in r]
    assert checked and all(max(r["rel_err"].values()) < 1e-2 for r in checked)
    if any(r["dtype"] == "float32" for r in checked):
        assert all(max(r["rel_err"].values()) < 1e-5 for r in checked if r["dtype"] == "float32")


def test_blocks_outside_the_contract_are_refused():
    with pytest.raises(SystemExit):
        crossover.main(["--device", "cpu", "--shape", "8x8x2", "--blocks", "4"])


def test_the_plot_shows_the_tables_series_in_its_order_and_one_colour_each(run, tmp_path, monkeypatch):
    """The speedup table's (method, dtype) rows and the plot's legend come in one order, and each series has one
    colour in every panel, the colour of its place in that order."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    from torch_sparse_metal_tools import bench

    rows, _ = run
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    assert crossover.plot(rows, tmp_path / "p.png")
    order = crossover.series_order(rows)
    table = list(dict.fromkeys(tuple(cell.strip() for cell in line.split("|")[2:4])
                               for line in crossover.speedup_table(rows)[2:]))
    assert table == [key for key in order if key in table] and len(table) >= 3  # the table's order is the order
    (fig,) = figures
    short = {f"{method} ({bench.SHORT[getattr(torch, dtype)]})": (method, dtype) for method, dtype in order}
    legend = [short[text.get_text()] for text in fig.legends[0].get_texts()]
    assert legend == [key for key in order if key in legend] and set(table) <= set(legend)  # and the legend's
    colors = bench.series_colors(order)
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label() in short:
                assert to_hex(line.get_color()) == colors[short[line.get_label()]]
