"""The fuzz target (tsm_dev/fuzz.py) with a fixed seed: 140 iterations (20 per target) across every
target, in a crash-surviving child process, must end without a broken invariant or a crash. Longer runs on
demand: ``python -m tsm_dev.fuzz --iterations 10000 --seed S`` (docs/architecture.md)."""

from __future__ import annotations

from tsm_dev import fuzz


def test_fixed_seed_fuzz_run_finds_nothing():
    counts, failures = fuzz.run(iterations=140, seed=0, targets=list(fuzz.TARGETS))
    assert failures == []
    for target in fuzz.TARGETS:  # every target ran, and both ways out (refused, accepted) were taken overall
        assert sum(n for k, n in counts.items() if k.startswith(f"{target}:")) == 20, counts
    assert any(k.endswith("raised") for k in counts) and any(k.endswith(("returned", "loaded")) for k in counts)


def test_a_fuzz_iteration_replays_from_its_name():
    assert fuzz.iteration("0:5:ops") == fuzz.iteration("0:5:ops")
