"""Adversarial table for the raw ops: every malformed index array, grad_out, weight and x, run crash-isolated.

Each case (tsm_dev/op_attacks.py) must end in a clear exception naming the array and the
problem, or, for layouts the op must accept (strided, expanded, transposed operands), in the float64 reference.
A segfault or abort fails its own case: all cases run in one child process that is restarted after a crash.
"""

from __future__ import annotations

import re

import pytest

from tsm_dev import op_attacks
from tsm_dev.isolated import run_isolated


@pytest.fixture(scope="module")
def outcomes():
    return run_isolated(f"{op_attacks.__name__}:run", list(op_attacks.CASES),
                        env={"TORCH_SPARSE_METAL_POISON": "1", "TORCH_SPARSE_METAL_TUNE": "0"})


@pytest.mark.parametrize("name", list(op_attacks.CASES))
def test_raw_op_attack(outcomes, name):
    expected, pattern = op_attacks.CASES[name]
    outcome = outcomes[name]
    assert outcome.status != "crashed", f"the process died: {outcome.detail}"
    if expected == "raise":
        assert outcome.status == "raised", f"returned instead of raising (max error {outcome.detail})"
        assert outcome.error in ("RuntimeError", "ValueError", "TypeError"), outcome
        assert re.search(pattern, outcome.detail), f"message {outcome.detail!r} does not match {pattern!r}"
    else:
        assert outcome.status == "returned", outcome
        assert outcome.detail < 1e-4, f"result differs from the float64 reference by {outcome.detail}"


def test_the_runner_survives_a_crash():
    """The isolation itself: a segfaulting case is reported as a crash and the cases after it still run."""
    results = run_isolated("tsm_dev.isolated:demo", ["ok", "segfault", "ok2"])
    assert results["ok"].status == "returned" and results["ok2"].status == "returned"
    assert results["segfault"].status == "crashed" and "signal 11" in results["segfault"].detail
