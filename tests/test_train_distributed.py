"""The training example under torchrun: 2 gloo processes on the CPU running the real command.

Each launch is ``python -m torch.distributed.run --standalone --nproc-per-node 2`` (a free port is picked by
the rendezvous) over a driver that wraps ``examples/train_wikitext103.py`` with test-only hooks: it logs every
``torch.save`` and report each rank makes, dumps each rank's final weights and step, and can start rank 1's
training clock late.
The launch runs in its own session and is killed as a group past a deadline, so nothing hangs the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from char_lm.cli import main
from char_lm.launch import Launch, process_device, rank_seed, torchrun_launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_wikitext103.py"
DEADLINE_S = 120.0  # per launch: start-up of 3 Python processes on a loaded 2-core machine included

DRIVER = """
import os, runpy, sys, time
import torch
from char_lm import loop, report

rank = int(os.environ["RANK"])
dump = os.environ["TORCH_SPARSE_METAL_TEST_DUMP"]
save, write_report, finish, fit = torch.save, report.write_report, loop.Trainer._finish, loop.Trainer.fit

def log(line):
    with open(os.path.join(dump, f"writes{rank}.log"), "a") as f:
        f.write(line + "\\n")

def logged_save(obj, path, *args, **kwargs):
    log(f"save {path}")
    return save(obj, path, *args, **kwargs)

def logged_report(out_dir, summary):
    log(f"report {out_dir}")
    return write_report(out_dir, summary)

def dumping_finish(self, *args, **kwargs):
    summary = finish(self, *args, **kwargs)
    save({"model": self.model.state_dict(), "step": self.step}, os.path.join(dump, f"final{rank}.pt"))
    return summary

def late_fit(self, *args, **kwargs):
    if rank == 1:  # rank 0's first step waits for rank 1: its training clock runs ahead all the run
        time.sleep(float(os.environ.get("TORCH_SPARSE_METAL_TEST_DELAY_S", "0")))
    return fit(self, *args, **kwargs)

torch.save, report.write_report = logged_save, logged_report
loop.Trainer._finish, loop.Trainer.fit = dumping_finish, late_fit
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tiny(out: Path) -> list[str]:
    """A model and a budget that train in well under a second a process on two CPU cores."""
    return ["--device", "cpu", "--offline", "--no-progress", "--d-model", "16", "--layers", "1", "--heads", "2",
            "--context", "16", "--batch-size", "2", "--eval-chars", "64", "--log-every", "2", "--out", str(out)]


def torchrun(tmp_path: Path, *args: str, delay_s: float = 0.0) -> str:
    """Run the example on 2 processes; returns their joint output. Fails the test past the deadline."""
    driver, dump = tmp_path / "driver.py", tmp_path / "dump"
    driver.write_text(DRIVER)
    dump.mkdir(exist_ok=True)
    path = os.pathsep.join(filter(None, [str(ROOT), str(EXAMPLE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TORCH_SPARSE_METAL_TEST_DUMP": str(dump),
           "TORCH_SPARSE_METAL_TEST_DELAY_S": str(delay_s), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(driver),
           str(EXAMPLE), "--dist-timeout", "0.5", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {DEADLINE_S:g} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def finals(tmp_path: Path) -> list[dict]:
    return [torch.load(tmp_path / "dump" / f"final{rank}.pt", weights_only=True) for rank in (0, 1)]


def assert_same_weights(a: dict, b: dict) -> None:
    """Bitwise equal state dicts (a sparse layer's extra state is a dict of its topology's tensors)."""
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], dict):
            assert_same_weights(a[name], b[name])
        else:
            assert torch.equal(a[name], b[name]) if isinstance(a[name], torch.Tensor) else a[name] == b[name], name


# ------------------------------------------------------------------------------------------------- launches
def test_two_processes_train_rank0_writes_and_one_process_resumes(tmp_path):
    run = tmp_path / "run"
    out = torchrun(tmp_path, "--steps", "4", "--eval-every", "4", *tiny(run))
    assert out.count("| Steps completed | 4 |") == 1 and out.count("model: sparse") == 1  # rank 0 alone prints
    assert "batch 2 per process x 2 processes (torchrun) = 4 windows a step" in out
    assert not (tmp_path / "dump" / "writes1.log").exists()  # rank 1 saved and reported nothing
    writes = (tmp_path / "dump" / "writes0.log").read_text().splitlines()
    assert writes[-1] == f"report {run}" and all(line.startswith("save") for line in writes[:-1])
    assert sorted(p.name for p in run.iterdir()) == ["bpc.png", "checkpoint.pt", "log.json"]
    log = json.loads((run / "log.json").read_text())
    assert (log["steps"], log["processes"], log["tokens_per_step"]) == (4, 2, 2 * 2 * 16)
    rank0, rank1 = finals(tmp_path)
    assert rank0["step"] == rank1["step"] == 4
    assert_same_weights(rank0["model"], rank1["model"])
    assert_same_weights(rank0["model"], torch.load(run / "checkpoint.pt", weights_only=True)["model"])

    # the 2-process checkpoint resumes in one process (this one) and trains on
    assert main(["--resume", str(run), "--steps", "6", "--offline", "--no-progress"]) == 0
    log = json.loads((run / "log.json").read_text())
    assert (log["steps"], log["processes"]) == (6, None)
    assert [row[1] for row in log["history"]["train"]] == [2, 4, 6]


def test_evolving_topology_stays_identical_across_ranks(tmp_path):
    run = tmp_path / "run"
    torchrun(tmp_path, "--steps", "6", "--eval-every", "6", "--prune-every", "2", "--grow", "0.5",
             "--regrow", "rigl", *tiny(run))
    rank0, rank1 = finals(tmp_path)
    assert rank0["step"] == rank1["step"] == 6
    assert_same_weights(rank0["model"], rank1["model"])  # topology buffers included
    edges = [row[1] for row in json.loads((run / "log.json").read_text())["edges_history"]]
    assert len(edges) == 3 and edges[0] < edges[1] < edges[2]  # updates at steps 2 and 4 grew the layers


def test_time_budget_resumed_on_two_processes_stops_both_at_one_step(tmp_path):
    run = tmp_path / "run"
    assert main(["--steps", "2", "--warmup-steps", "0", *tiny(run)]) == 0  # one process; lr follows the clock
    # The ranks' clocks differ by half a second of a 1.8 s budget; the agreed progress must not differ.
    # --device is not taken from the checkpoint (a run may resume on another device): on a host with one GPU,
    # "auto" would pick it, and two processes cannot share it
    torchrun(tmp_path, "--resume", str(run), "--minutes", "0.03", "--device", "cpu", "--offline", "--no-progress",
             delay_s=0.5)
    rank0, rank1 = finals(tmp_path)
    assert rank0["step"] == rank1["step"] > 2
    assert_same_weights(rank0["model"], rank1["model"])  # the same learning rate at every step
    log = json.loads((run / "log.json").read_text())
    assert log["steps"] == rank0["step"] and log["processes"] == 2


# ------------------------------------------------------------------------------------------------- in process
def test_launch_is_read_from_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert torchrun_launch(env) == Launch(3, 4, 1, 2)
    assert torchrun_launch({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None  # one process: plain run
    with pytest.raises(ValueError, match="not a place"):
        torchrun_launch({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_process_device_refuses_what_processes_cannot_share():
    launch = Launch(1, 2, 1, 2)
    assert process_device(torch.device("cpu"), launch) == torch.device("cpu")
    with pytest.raises(ValueError, match="no backend for MPS"):
        process_device(torch.device("mps"), launch)
    with pytest.raises(ValueError, match="all would use one GPU"):
        process_device(torch.device("cuda", 0), launch)


def test_rank_seeds_differ_by_rank_stream_and_step():
    seeds = {rank_seed(0, r, s, k) for r in range(3) for s in (0, 10) for k in ("windows", "dropout")}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)


def test_decoupled_under_torchrun_is_a_usage_error(monkeypatch, capsys, tmp_path):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        main(["--steps", "2", "--decoupled", "1:2", *tiny(tmp_path)])
    assert exc.value.code == 2 and "without torchrun" in capsys.readouterr().err
