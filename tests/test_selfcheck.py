"""The self-check a Mac user runs, exercised through the MSL-on-CPU executor (no Mac here), which
``python -m tsm_dev.selfcheck`` hands in: it must pass on the shipped kernels, fail on wrong or unwritten outputs,
say which path computed each result and fail its claims that the kernels ran where the reference path did, say when
nothing was checked (the installed command alone, without MPS), and write a JSON report."""

from __future__ import annotations

import json

import pytest
import torch

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.backends import metal, mps_reference
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.backends.mps_vector_csr_linear import MetalVectorCsrLinear
from torch_sparse_metal.contract import VECTOR_BLOCKS
from torch_sparse_metal.strategy import CONCRETE as STRATEGIES
from torch_sparse_metal_tools import selfcheck
from tsm_dev import selfcheck as dev_selfcheck
from tsm_dev.msl import MslError, compile_shader
from tsm_dev.msl.faults import FailingPipelines

SMALL_CASES = [(37, 45, 0.3, 1), (70, 50, 0.2, 33), (20, 10, 0.0, 3)]


@pytest.fixture(scope="module")
def executor() -> MetalCsrLinear:
    return MetalCsrLinear(compile_shader, device_type="cpu", poison=True)


def test_main_passes_and_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    assert dev_selfcheck.main(["--no-bench", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["verdict"] == "PASS" and report["target"] == "msl-executor"
    names = [c["check"] for c in report["checks"]]
    assert all(c["ok"] for c in report["checks"]) and len(names) >= 60
    assert any("vs float64" in n for n in names) and any("repeats" in n for n in names)
    vector = [n for n in names if n.startswith("vector ")]  # the vector layout's kernels, every block and strategy
    assert all(any(f"vector {s:<12} grad_w vs float64 V={v} " in n for n in vector)
               for s in STRATEGIES for v in VECTOR_BLOCKS)
    assert {p["thread_execution_width"] for p in report["pipelines"]} == {32}
    # auto's configuration per timing-table layer: without MPS, the static rule (nothing tuned), P shown
    assert [row["edges"] for row in report["tuning"]] == [e for e, _, _ in selfcheck.PUBLISHED_M1_PRO]
    assert all(row["forward"] == {"values_per_lane": 4} and row["backward_from"] == "static"
               for row in report["tuning"])
    out = capsys.readouterr().out
    assert "MPS is not available" in out
    assert "auto's configuration on cpu" in out and "fused_atomic values_per_lane=4" in out
    # torch's own sparse API through the MPS registrations (standing in for torch's CPU kernels), every dtype
    sparse = [n for n in names if n.startswith("torch.sparse ")]
    for dtype in ("float32", "float16", "bfloat16"):
        for case in selfcheck.sparse_api_cases():
            whats = ("out",) if "(forward)" in case else ("out", "grad dense", "grad values", "ran the kernels")
            assert all(f"torch.sparse {dtype:<8} {case} {what}" in sparse for what in whats), (dtype, case)
    assert len(report["torch_sparse"]["registered"]) >= 30 and report["torch_sparse"]["skipped"] == {}
    assert "torch.sparse on MPS (torch's own API through these kernels)" in out


def _bfloat_pipelines_fail(name: str) -> bool:
    return "bfloat" in name.split("_")


def test_main_under_a_failing_pipeline_says_the_reference_path_ran(tmp_path, capsys, monkeypatch):
    """bfloat16 pipelines that cannot be created (simulated over the executor): the results still match (the
    reference path), but the report names the reference path for bfloat16, in paths and in what ran, and each claim
    that bfloat16 kernels ran fails; float32 and float16 keep theirs."""
    monkeypatch.setattr(metal, "_force_reference", False)
    monkeypatch.setattr(mps_reference, "_warned", set())
    monkeypatch.setattr("tsm_dev.msl.compile_shader", FailingPipelines(compile_shader, _bfloat_pipelines_fail))
    path = tmp_path / "report.json"
    assert dev_selfcheck.main(["--no-bench", "--json", str(path)]) == 1
    report = json.loads(path.read_text())
    assert report["verdict"] == "FAIL"
    failed = [c for c in report["checks"] if not c["ok"]]
    cases = [case for case in selfcheck.sparse_api_cases() if "to_sparse" not in case]
    assert sorted(c["check"] for c in failed) == sorted(f"torch.sparse bfloat16 {case} ran the kernels"
                                                        for case in cases)
    assert all(row["path"] == "reference" and row["dtype"] == "bfloat16" for c in failed for row in c["ran"])
    for layout in ("unstructured", "vector"):
        assert report["paths"][layout]["float32"] == "metal"
        assert report["paths"][layout]["bfloat16"].startswith("reference (") and "pipeline" in \
            report["paths"][layout]["bfloat16"]
    ran = {(r["family"], r["dtype"], r["path"]) for r in report["ran"]}
    assert ("csr_linear.metal", "bfloat16", "reference") in ran and ("csr_linear.metal", "float32", "metal") in ran
    assert not any(dtype == "bfloat16" and p == "metal" for _, dtype, p in ran)
    assert "REFERENCE PATH, not the Metal kernels" in capsys.readouterr().out


@pytest.mark.parametrize("checks", ["run_checks", "run_vector_checks"])
def test_forced_reference_path_fails_the_kernel_claims(monkeypatch, checks):
    """With the reference path asked for, the results still match float64 and the CPU backend, and only the claims
    that the Metal kernels ran fail, naming the reference path."""
    monkeypatch.setattr(metal, "_force_reference", True)
    report = selfcheck.Report()
    cases = SMALL_CASES[:2] if checks == "run_checks" else selfcheck.VECTOR_CHECK_CASES[:1]
    getattr(selfcheck, checks)("cpu", MetalCsrLinear(compile_shader, device_type="cpu", poison=True), report, cases)
    failed = [c for c in report.checks if not c["ok"]]
    assert failed and all("ran the Metal kernels" in c["check"] and c["ran"] for c in failed)
    assert len(failed) == (len(cases) if checks == "run_checks" else len(cases) * len(VECTOR_BLOCKS))
    assert all(row["path"] == "reference" for c in failed for row in c["ran"])


def test_kernel_claims_hold_on_the_metal_kernels(executor, monkeypatch):
    """On the kernels, each case's claim passes and names the family and dtype that ran."""
    monkeypatch.setattr(metal, "_force_reference", False)
    report = selfcheck.Report()
    selfcheck.run_checks("cpu", executor, report, SMALL_CASES[:1])
    (claim,) = [c for c in report.checks if "ran the Metal kernels" in c["check"]]
    assert claim["ok"] and claim["ran"] == [{"family": "csr_linear.metal", "dtype": "float32", "path": "metal",
                                             "calls": 2 + 2 * len(STRATEGIES)}]


@pytest.mark.parametrize(("main", "prog", "other"), [
    (dev_selfcheck.main, "python -m tsm_dev.selfcheck", "torch_sparse_metal_tools.selfcheck"),
    (selfcheck.main, "python -m torch_sparse_metal_tools.selfcheck", "tsm_dev.selfcheck"),
])
def test_each_command_names_itself_in_its_help(capsys, main, prog, other):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} [-h]") and other not in out.split("options:")[0].splitlines()[0]


class _Broken:
    """A Metal backend that gets one thing wrong: its forward leaves the last output column unwritten (NaN)."""

    def __init__(self, inner: MetalCsrLinear):
        self.inner = inner

    def forward(self, *args):
        y = self.inner.forward(*args)
        if y.numel():
            y[:, -1] = float("nan")
        return y

    def backward(self, *args):
        return self.inner.backward(*args)


class _Scaled(_Broken):
    """grad_w off by one part in a thousand: within what a careless tolerance would accept."""

    def forward(self, *args):
        return self.inner.forward(*args)

    def backward(self, *args):
        gx, gw = self.inner.backward(*args)
        return gx, gw * 1.001


@pytest.mark.parametrize("broken,failing", [(_Broken, "forward"), (_Scaled, "grad_w vs")])
def test_checks_catch_a_wrong_backend(executor, broken, failing):
    report = selfcheck.Report()
    selfcheck.run_checks("cpu", broken(executor), report, SMALL_CASES[:2])
    failed = [c["check"] for c in report.checks if not c["ok"]]
    assert failed and all(failing in name for name in failed), failed


@pytest.mark.parametrize("broken,failing", [(_Broken, "forward"), (_Scaled, "grad_w vs")])
def test_vector_checks_catch_a_wrong_backend(broken, failing):
    report = selfcheck.Report()
    host = MetalVectorCsrLinear(compile_shader, device_type="cpu", poison=True)
    selfcheck.run_vector_checks("cpu", broken(host), report, selfcheck.VECTOR_CHECK_CASES[:1])
    failed = [c["check"] for c in report.checks if not c["ok"]]
    assert failed and all(failing in name for name in failed), failed


@pytest.mark.parametrize("broken,must_fail,may_fail", [
    (_Broken, ["torch.mm(csr, D) out", "D @ csr out", "F.linear(x, W_csr) out"], ("out", "grad dense")),
    (_Scaled, ["torch.sparse.mm(csr, D) grad values", "torch.sparse.sampled_addmm(csr, U, V) out",
               "torch.sparse.sampled_addmm batched (forward) out"], ("grad values", "sampled_addmm")),
])
def test_sparse_api_checks_catch_a_wrong_backend(executor, broken, must_fail, may_fail):
    """torch.sparse through wrong kernels: an unwritten (NaN) output column fails the results it reaches; a weight
    gradient (the sampled product) off by 0.1% fails the sparse gradients and the sampled products in float32."""
    report = selfcheck.Report()
    selfcheck.run_sparse_api_checks("cpu", report, broken(executor), dtypes=(torch.float32,))
    failed = [c["check"] for c in report.checks if not c["ok"]]
    assert all(f"torch.sparse float32  {name}" in failed for name in must_fail), failed
    assert all(any(f in name for f in may_fail) for name in failed), failed


def test_sparse_api_checks_catch_a_wrong_conversion(executor, monkeypatch):
    """A CSC conversion that drops the last stored entry fails that check only; the others stay bitwise equal."""
    from torch_sparse_metal import sparse_mps

    real = sparse_mps.dense_to_csc

    def dropping(dense, dense_dim=None):
        t = real(dense, dense_dim)
        values = t.values().clone()
        values[-1] = 0
        return torch.sparse_csc_tensor(t.ccol_indices(), t.row_indices(), values, t.shape)

    monkeypatch.setattr(sparse_mps, "dense_to_csc", dropping)
    report = selfcheck.Report()
    selfcheck.run_sparse_api_checks("cpu", report, executor, dtypes=(torch.float32,))
    assert [c["check"] for c in report.checks if not c["ok"]] == [
        "torch.sparse float32  dense.to_sparse_csc() (forward) out"]


def test_sparse_api_references_are_torchs_own_cpu_kernels(executor):
    """The references are computed before our kernels stand in for torch's CPU ones, and torch's come back after."""
    a = torch.eye(3).to_sparse_csr()
    report = selfcheck.Report()
    selfcheck.run_sparse_api_checks("cpu", report, _Broken(executor), dtypes=(torch.float32,))
    assert report.failures and torch.equal(torch.mm(a, torch.ones(3, 2)), torch.ones(3, 2))


def test_nothing_checked_exits_2(monkeypatch, tmp_path):
    def no_compiler(*_args, **_kwargs):
        raise MslError("no C++ compiler")

    monkeypatch.setattr("tsm_dev.msl.compile_shader", no_compiler)
    path = tmp_path / "r.json"
    assert dev_selfcheck.main(["--no-bench", "--json", str(path)]) == 2
    assert json.loads(path.read_text())["verdict"] == "NOTHING CHECKED"


@pytest.mark.parametrize(("argv", "verdict", "command"), [
    (["--no-bench"], "NOTHING CHECKED", "python -m tsm_dev.selfcheck`"),
    (["--model"], "NOTHING MODELLED", "python -m tsm_dev.selfcheck --model`"),
])
def test_the_installed_command_without_mps_points_to_the_checkout(tmp_path, capsys, argv, verdict, command):
    """Without MPS and without the development tools (which the installed package never imports), nothing is
    checked or modelled: exit status 2, and the command that runs the executor from a checkout."""
    path = tmp_path / "r.json"
    assert selfcheck.main([*argv, "--json", str(path)]) == 2
    assert json.loads(path.read_text())["verdict"] == verdict
    out = capsys.readouterr().out
    assert command in out and "not installed" in out


def test_inputs_are_views_at_an_offset():
    t = torch.arange(6.0).view(2, 3)
    v = selfcheck.at_offset(t, "cpu")
    assert v.storage_offset() == selfcheck.INPUT_OFFSET and v.is_contiguous() and torch.equal(v, t)


def test_bench_rows_on_the_executor(executor):
    """The timing table's code path (on a Mac it times MPS); here only its rows' shape is checked."""
    rows = selfcheck.bench(executor, "cpu", reps=1, features=64, batch=5, seed_cases=[(200, 1.0, 2.0)])
    (row,) = rows
    assert row["edges"] == 200 and len(row["ours_fwd"]) == 2 and row["ours_fwd"][1] > 0
    assert row["reference_fwd"][0] > 0 and row["reference_bwd"][0] > 0  # the fall-back path, timed beside ours
    assert row["torch_sparse_fwd"] is not None and row["torch_sparse"].startswith("forward: torch.sparse.mm (CSR)")


def test_torch_sparse_probe_says_what_is_missing(monkeypatch):
    """A torch without a sparse path on the device is reported in the note, not raised (MPS varies by version)."""
    def refuse(*_args, **_kwargs):
        raise NotImplementedError("Could not run 'aten::_sparse_mm' with arguments from the 'SparseMPS' backend")

    monkeypatch.setattr(torch.sparse, "sampled_addmm", refuse)
    topo = CSRTopology.random(8, 6, 0.5, generator=torch.Generator().manual_seed(0))
    fwd, bwd, note = selfcheck.torch_sparse_ops(topo, torch.randn(topo.nnz), torch.randn(3, 8), torch.randn(3, 6))
    assert fwd is not None and bwd is None
    assert note.startswith("forward: torch.sparse.mm (CSR); no backward (Could not run")


# ------------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(("argv", "message"), [
    (["--json", "{tmp}/no/such/folder/r.json"], "--json {tmp}/no/such/folder/r.json: no folder {tmp}/no/such/folder "
                                                 "to write it in"),
    (["--json", "{tmp}"], "--json {tmp}: a folder; give a file name"),
    (["--model", "--json", "{tmp}/no/r.json"], "--json {tmp}/no/r.json: no folder {tmp}/no to write it in"),
    (["--model", "--model-edges", "-5"], "argument --model-edges: must be an edge count from 1 to 1,048,576 (a "
                                         "1024x1024 layer), got -5"),
    (["--model", "--model-edges", "100", "2000000"], "argument --model-edges: must be an edge count from 1 to"),
    (["--model", "--model-edges", "1e3"], "argument --model-edges: expected a positive integer, got '1e3'"),
    (["--reps", "0"], "argument --reps: must be a positive integer, got 0"),
])
def test_bad_arguments_are_usage_errors_before_any_check(argv, message, tmp_path, capsys, monkeypatch):
    for name in ("run_checks", "run_vector_checks", "traffic_model"):
        monkeypatch.setattr(selfcheck, name, lambda *a, **k: pytest.fail("checked before refusing"))
    with pytest.raises(SystemExit) as exc:
        selfcheck.main([a.format(tmp=tmp_path) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message.format(tmp=tmp_path) in err.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # nothing written

