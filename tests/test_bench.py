"""The benchmark command on the CPU: rows, keys, the dtype axis and its same-run ratios (timings are not checked)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch_sparse_metal import timing
from torch_sparse_metal_tools import bench

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
    """Every dtype of a case is timed in one ``Timer.samples`` call, and our rows' speedups are the ratios of that
    run's rounds: the median of the per-round ratios against torch.sparse fp32, dense fp32 and dense in the row's
    dtype."""
    calls, timed = [], {}
    samples = bench.Timer.samples

    def recorded(self, fns):
        calls.append(list(fns))
        timed.update(samples(self, fns))
        return timed

    monkeypatch.setattr(bench.Timer, "samples", recorded)
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
    mine = {"fwd": timed["ours/fwd@torch.bfloat16"], "bwd": timed["atomic_free/bwd@torch.bfloat16"]}
    for label, base in (("torch_sparse_fp32", "torch_sparse/{}@torch.float32"),
                        ("dense_fp32", "dense/{}@torch.float32"), ("dense_bf16", "dense/{}@torch.bfloat16")):
        for k in ("fwd", "bwd"):
            ratios = [b / m for (b, _), (m, _) in zip(timed[base.format(k)], mine[k], strict=True)]
            assert ours["speedup"][label][k] == pytest.approx(statistics.median(ratios))


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


def test_the_shipped_commands_import_no_development_tools():
    code = ("import sys, torch_sparse_metal_tools.bench, torch_sparse_metal_tools.selfcheck, "
            "torch_sparse_metal_tools.tune; "
            "print([m for m in sys.modules if m.startswith('tsm_dev')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_designs_are_timed_beside_ours_in_the_same_round_robin():
    """Another implementation of the two ops (here the CPU ops under another name) is timed in the same run and
    recorded per strategy as ``<strategy>/<label>``."""
    class Design:
        def forward(self, x, w, *topology):
            return bench.OPS.csr_linear(x, w, *topology, "auto")

        def backward(self, go, x, w, *rest):
            return bench.OPS.csr_linear_backward(go, x, w, *rest)

    rows = bench.run_cases([bench.Case(70, 33, 0.1, 5)], device="cpu", reps=2, designs={"mine": Design()})
    methods = {r["method"] for r in rows}
    assert {"fused_atomic/mine", "atomic_free/mine", "fused_atomic", "atomic_free"} <= methods
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows if "/mine" in r["method"])


def test_torch_sparse_baseline_is_the_csr_weight():
    topo = bench.CSRTopology.random(8, 6, 0.5, generator=torch.Generator().manual_seed(0))
    w, x, go = torch.randn(topo.nnz), torch.randn(3, 8), torch.randn(3, 6)
    fwd, bwd, note = bench.torch_sparse_ops(topo, w, x, go)
    dense = topo.to_sparse_csr(w).to_dense()
    torch.testing.assert_close(fwd().t(), x @ dense.t())
    grad_w, grad_x = bwd()
    torch.testing.assert_close(grad_x.t(), go @ dense)
    torch.testing.assert_close(grad_w.to_dense(), (go.t() @ x) * (dense != 0))
    assert "COO" not in note


def test_timer_warms_up_then_alternates_rounds_and_takes_medians(monkeypatch):
    """The one timer on the CPU: one untimed warm-up call each, then rounds in alternating order, each call timed
    from an idle device (synchronised wall clock); the median and the spread of each callable's samples."""
    calls, samples = [], {"a": [3.0, 1.0, 2.0], "b": [5.0, 5.0, 6.0]}

    def synchronised_call(fn, device):
        fn()
        calls[-1] = calls[-1].upper()  # timed
        return samples[calls[-1].lower()].pop(0), 0.5

    monkeypatch.setattr(timing, "synchronised_call", synchronised_call)
    timer = timing.Timer(torch.device("cpu"), reps=3)
    t = timer.many({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    assert calls == ["a", "b", "A", "B", "B", "A", "A", "B"]
    assert t == {"a": timing.Timing(2.0, 0.5, 2.0), "b": timing.Timing(5.0, 0.5, 1.0)}
    assert timer.mode == "synchronised wall"


def test_timer_synchronises_through_the_backend_seam(monkeypatch):
    from torch_sparse_metal import devices

    waited = []
    cpu = devices.get("cpu")
    monkeypatch.setitem(devices.BACKENDS, "cpu", dataclasses.replace(cpu, synchronize=waited.append))
    timing.Timer(torch.device("cpu"), reps=2).many({"f": lambda: None})
    assert len(waited) == 1 + 2 * 2 and set(waited) == {torch.device("cpu")}  # warm-up, then before and after each


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
    t = timing.Timer(torch.device("cuda"), reps=5).many({"host": host_bound, "matmul": lambda: a @ b})
    assert t["host"].host_ms >= 5 and t["host"].ms < 0.5, t
    assert t["matmul"].ms == pytest.approx(statistics.median(reference), rel=0.15), (t, reference)


# ------------------------------------------------------------------------------------------------- the command line
TINY = [bench.Case(70, 33, 0.1, 5, "tiny"), bench.Case(70, 33, 0.3, 5, "tiny")]


@pytest.fixture
def tiny_cases(monkeypatch):
    """Whatever --cases says, the run times two small cases of one group, which sweeps the density."""
    monkeypatch.setattr(bench, "cases", lambda names: list(TINY))


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_unknown_case_group_is_refused_before_anything_runs_or_is_written(tmp_path, capsys, monkeypatch):
    (tmp_path / "t.json").write_text("earlier results")
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: pytest.fail("ran with an unknown case group"))
    line = _usage_error(["--device", "cpu", "--cases", "cpu", "tpyo", "--out", str(tmp_path), "--name", "t"], capsys)
    assert "argument --cases: invalid choice: 'tpyo'" in line
    assert all(f"'{group}'" in line for group in bench.CASE_GROUPS)
    assert (tmp_path / "t.json").read_text() == "earlier results"
    with pytest.raises(ValueError, match="unknown case group.*tpyo.*choose from seed, design"):
        bench.cases(["seed", "tpyo"])


def test_unknown_case_group_through_the_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch_sparse_metal_tools.bench", "--device", "cpu", "--cases", "tpyo"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "invalid choice: 'tpyo'" in out.stderr
    assert list(tmp_path.iterdir()) == []  # no folder made, nothing written


def test_default_out_is_a_new_folder_in_the_current_directory(tmp_path, monkeypatch, capsys, tiny_cases):
    committed = {p: p.read_bytes() for p in (REPO / "benchmarks" / "results").glob("*.*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    bench.main(["--device", "cpu", "--reps", "1"])
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("bench-cpu-") and time.strftime("%Y%m%d") in folder.name
    assert sorted(p.name for p in folder.iterdir()) == ["cpu.json", "cpu_tiny.png"]
    assert {p: p.read_bytes() for p in committed} == committed
    # run from the repository's root, the default is a new folder there too, never benchmarks/results
    monkeypatch.chdir(REPO)
    args = bench.build_parser().parse_args(["--device", "cpu"])
    out, files = bench._outputs(bench.build_parser(), args, torch.device("cpu"), TINY)
    assert out.parent == Path(".") and out.name.startswith("bench-cpu-") and not out.exists()
    assert all(f.parent == out for f in files)


def test_earlier_results_are_replaced_only_with_overwrite(tmp_path, capsys, monkeypatch, tiny_cases):
    argv = ["--device", "cpu", "--reps", "1", "--out", str(tmp_path), "--name", "t"]
    bench.main(argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t_tiny.png"]
    (tmp_path / "t.json").write_text("earlier results")
    capsys.readouterr()
    run_cases = bench.run_cases
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: pytest.fail("timed before refusing"))
    line = _usage_error(argv, capsys)
    assert f"--out {tmp_path} already holds t.json, t_tiny.png" in line and "--overwrite" in line
    assert (tmp_path / "t.json").read_text() == "earlier results"
    monkeypatch.setattr(bench, "run_cases", run_cases)
    bench.main([*argv, "--overwrite"])
    assert len(json.loads((tmp_path / "t.json").read_text())) == 2 * 4


def test_cpu_table_shows_no_nan_and_plots_are_written(tmp_path, capsys, monkeypatch, tiny_cases):
    """On the CPU no peak rates are known: no roofline columns. A stage a method did not run (here torch.sparse's
    forward, as on devices whose torch lacks it) shows '-'. The plot is written on the CPU too, and named."""
    sparse_ops = bench.torch_sparse_ops
    monkeypatch.setattr(bench, "torch_sparse_ops", lambda *a: (None, *sparse_ops(*a)[1:]))
    bench.main(["--device", "cpu", "--reps", "1", "--out", str(tmp_path), "--name", "t"])
    out = capsys.readouterr().out
    table = out[out.index("fwd ms"):out.index("wrote ")]
    assert "nan" not in table.lower() and "floor" not in table
    sparse = [line.split() for line in table.splitlines() if "torch_sparse " in line]
    assert len(sparse) == 2 and all(cells[5] == "-" and float(cells[6]) > 0 for cells in sparse)
    assert "vs torch_sparse_fp32: fwd - bwd" in out
    png = tmp_path / "t_tiny.png"
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 't.json'}" in out


def test_plots_sweep_the_axis_their_group_varies():
    def rows(group: str) -> list[dict]:
        return [{"in_features": c.in_features, "out_features": c.out_features, "density": c.density,
                 "batch": c.batch} for c in bench.cases([group])]

    assert bench._sweep_axis(rows("seed")) == "density" and bench._sweep_axis(rows("density")) == "density"
    assert bench._sweep_axis(rows("batch")) == "batch"
    assert bench._sweep_axis(rows("cpu")) is None and bench._sweep_axis(rows("design")) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--reps", "0"], "argument --reps: must be a positive integer, got 0"),
    (["--reps", "-3"], "argument --reps: must be a positive integer, got -3"),
    (["--name", "../elsewhere"], "argument --name: expected a file name without folders"),
    (["--device", "cpu", "--out", "/proc/no/such"], "--out /proc/no/such: cannot write there"),
])
def test_bad_values_are_usage_errors(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: pytest.fail("timed before refusing"))
    assert message in _usage_error(argv, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_missing_device_is_a_usage_error(capsys):
    line = _usage_error(["--device", "cuda"], capsys)
    assert "argument --device: cuda: this torch has no usable CUDA device; this machine has: cpu" in line


def test_graphs_without_cuda_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: pytest.fail("timed before refusing"))
    line = _usage_error(["--device", "cpu", "--graphs", "--out", str(tmp_path / "out")], capsys)
    assert "--graphs: CUDA graphs replay CUDA work; this run is on cpu" in line
    assert not (tmp_path / "out").exists()


def _rounds(values: dict[str, list[float]]):
    """A Timer.samples that gives each callable the rounds of the first name in ``values`` its key starts with."""
    def samples(self, fns):
        return {k: [(t, 0.01) for t in next(v for prefix, v in values.items() if k.startswith(prefix))]
                for k in fns}
    return samples


def test_ratios_carry_their_spread_and_a_spread_across_1_is_inconclusive(tmp_path, capsys, monkeypatch):
    """Each ratio comes with the interquartile range of its per-round ratios, in the JSON and the table; where that
    range holds 1 the ratio is marked inconclusive (here the backward against dense: 0.6x to 1.4x by round)."""
    monkeypatch.setattr(bench, "cases", lambda names: [bench.Case(70, 33, 0.1, 5, "tiny")])
    monkeypatch.setattr(bench.Timer, "samples", _rounds({
        "ours/fwd": [1.0] * 5, "fused_atomic/bwd": [1.0] * 5, "atomic_free/bwd": [2.0] * 5,
        "dense/fwd": [3.0] * 5, "dense/bwd": [0.6, 0.8, 1.0, 1.2, 1.4], "torch_sparse": [5.0] * 5}))
    bench.main(["--device", "cpu", "--out", str(tmp_path), "--name", "t"])
    rows = {r["method"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    dense = rows["fused_atomic"]["speedup"]["dense_fp32"]
    assert dense == {"inconclusive": ["bwd"], "noisy": [], "fwd": 3.0, "fwd_iqr": [3.0, 3.0], "bwd": 1.0,
                     "bwd_iqr": [pytest.approx(0.8), pytest.approx(1.2)]}
    sparse = rows["atomic_free"]["speedup"]["torch_sparse_fp32"]
    assert sparse["inconclusive"] == [] and sparse["bwd"] == sparse["bwd_iqr"][0] == 2.5
    out = capsys.readouterr().out
    assert "vs dense_fp32: fwd 3.00x (IQR 3.00-3.00) bwd 1.00x (IQR 0.80-1.20, inconclusive)" in out
    assert "vs torch_sparse_fp32: fwd 5.00x (IQR 5.00-5.00) bwd 5.00x (IQR 5.00-5.00)" in out
    assert "1 of 8 ratios could not be read" in out and "too noisy to conclude" in out


def _noisy_rounds(seed: int, n: int) -> tuple[list[float], list[float]]:
    """Two methods' times over ``n`` shared rounds: a fixed true ratio of 2 under a load that slows whole rounds
    (both methods alike, by up to 20x) and each call a little (up to 1.3x), the way a shared machine does."""
    g = torch.Generator().manual_seed(seed)
    phase = torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * math.log(20.0))
    jitter = 1.0 + 0.3 * torch.rand(2, n, generator=g, dtype=torch.float64)
    base, mine = 2.0 * phase * jitter[0], 1.0 * phase * jitter[1]
    return base.tolist(), mine.tolist()


@pytest.mark.parametrize("seed", range(5))
def test_a_ratio_lies_inside_its_own_range_and_follows_the_paired_rounds(seed):
    """The printed ratio is the median of the per-round ratios, so it lies inside their interquartile range; the
    ratio of the two medians need not (a slow phase that hits one method's median round but not the other's)."""
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(5, 40, (1,), generator=g))
    base, mine = _noisy_rounds(seed, n)
    ratio, (low, high), verdicts = bench.paired_ratio(base, mine)
    per_round = sorted(b / m for b, m in zip(base, mine))
    assert low <= ratio <= high
    assert ratio == pytest.approx(float(torch.tensor(per_round, dtype=torch.float64).median())
                                  if n % 2 else (per_round[n // 2 - 1] + per_round[n // 2]) / 2)
    assert 2.0 / 1.3 <= low <= high <= 2.0 * 1.3  # the load hit both methods of a round alike: it cancels
    assert "inconclusive" not in verdicts


def test_a_ratio_whose_rounds_disagree_is_too_noisy_or_inconclusive():
    clear = bench.paired_ratio([2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert clear[2] == [] and clear[0] == pytest.approx(2.0)
    wide = bench.paired_ratio([2.0, 6.0, 2.0, 6.0, 4.0], [1.0] * 5)  # 2x to 6x by round: above 1, but unreadable
    assert wide[2] == ["noisy"] and wide[1] == [2.0, 6.0]
    across = bench.paired_ratio([0.9, 1.1, 1.0, 1.05], [1.0] * 4)  # faster in some rounds, slower in others
    assert across[2] == ["inconclusive"]
    with pytest.raises(ValueError, match="paired rounds"):
        bench.paired_ratio([1.0, 2.0], [1.0])


def test_cases_print_in_words(tmp_path, capsys, monkeypatch, tiny_cases):
    bench.main(["--device", "cpu", "--reps", "1", "--out", str(tmp_path), "--name", "t"])
    out = capsys.readouterr().out
    assert "case 70x33, density 0.1, batch 5 (group tiny)\n" in out and "Case(" not in out


def test_plots_have_a_legend_and_tell_every_line_apart(tmp_path, monkeypatch, tiny_cases):
    """Both panels carry a legend; our forward is one line (the strategies share it), and no two lines of a panel
    share both marker and line style, so one line on top of another still shows."""
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    rows = bench.run_cases(list(TINY), device="cpu", reps=1)
    bench.plot(rows, tmp_path, "t")
    (fig,) = figures
    forward, backward = fig.axes
    for ax in (forward, backward):
        labels = [text.get_text() for text in ax.get_legend().get_texts()]
        assert labels == [line.get_label() for line in ax.lines]
        styles = [(line.get_marker(), line.get_linestyle()) for line in ax.lines]
        assert len(set(styles)) == len(styles)
    assert sorted(line.get_label() for line in forward.lines) == ["dense_fp32", "ours", "torch_sparse"]
    assert {"fused_atomic", "atomic_free"} <= {line.get_label() for line in backward.lines}


def test_a_dtype_without_kernels_on_the_device_is_refused(tmp_path, capsys, monkeypatch):
    """As on MPS, which has no float64 kernels: refused before anything is timed or written."""
    monkeypatch.setattr(bench, "supported_dtypes", lambda device_type: (torch.float32, torch.float16))
    monkeypatch.setattr(bench, "run_cases", lambda *a, **k: pytest.fail("timed before refusing"))
    line = _usage_error(["--device", "cpu", "--dtypes", "float32,float64", "--out", str(tmp_path / "out")], capsys)
    assert "--dtypes float64: no csr_linear kernels for it on cpu; there: float32, float16" in line
    assert not (tmp_path / "out").exists()


def test_the_plot_follows_the_tables_order_with_one_colour_per_series(tmp_path, monkeypatch):
    """The plot's series come in the order the table prints its rows, and a series has the same colour in the
    forward and the backward panel."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    monkeypatch.setattr(bench, "cases", lambda names: [bench.Case(70, 33, 0.1, 5, "tiny")])
    monkeypatch.setattr(bench.Timer, "samples", _rounds({
        "ours/fwd": [1.0] * 5, "fused_atomic/bwd": [1.0] * 5, "atomic_free/bwd": [2.0] * 5,
        "dense/fwd": [3.0] * 5, "dense/bwd": [3.0] * 5, "torch_sparse": [5.0] * 5}))
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    rows = bench.main(["--device", "cpu", "--out", str(tmp_path), "--name", "t"]) or json.loads(
        (tmp_path / "t.json").read_text())
    (fig,) = figures
    fwd, bwd = ({line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()} for ax in fig.axes[:2])
    table = list(dict.fromkeys(r["method"] for r in rows))  # the table prints the rows in this order
    assert list(bwd) == [m for m in table if m in bwd] and list(fwd)[0] == "ours" and len(bwd) == 4
    for label in set(fwd) & set(bwd):
        assert fwd[label] == bwd[label]
    assert len(set(fwd.values()) | set(bwd.values())) == len(set(fwd) | set(bwd))  # a colour per series
