"""The backend seam (torch_sparse_metal.backends): every device type of the op contract is declared once, and the
package's device lists come from the declarations."""

from __future__ import annotations

import pytest
import torch

from torch_sparse_metal import backends, check_index_errors
from torch_sparse_metal.backends import cpu
from torch_sparse_metal.contract import DTYPES, supported_dtypes
from torch_sparse_metal_tools.testing import axes


def test_every_contract_device_has_one_backend():
    contract_devices = set().union(*(spec.devices for spec in DTYPES.values()))
    assert contract_devices == set(backends.BACKENDS)
    for name, backend in backends.BACKENDS.items():
        assert backend.device_type == name
        assert backend.dtypes == supported_dtypes(name) and backend.dtypes


def test_test_axes_are_the_available_backends():
    assert axes.DEVICES == backends.available()
    assert "cpu" in axes.DEVICES
    assert ("cuda" in axes.DEVICES) == torch.cuda.is_available()
    assert ("mps" in axes.DEVICES) == torch.backends.mps.is_available()


def test_a_device_type_is_declared_once():
    with pytest.raises(ValueError, match="already registered"):
        backends.register(backends.get("cpu"))


def test_no_backend_for_meta_and_index_errors_there_are_a_no_op():
    assert backends.get("meta") is None
    check_index_errors("meta")  # nothing runs on meta, so nothing was recorded


def test_cpu_describes_the_machine_its_threads_and_kernel_set():
    describe = backends.get("cpu").describe
    name = describe(torch.device("cpu"))
    assert name.startswith(f"cpu {backends.cpu_model()} x{torch.get_num_threads()}, ")
    assert name.endswith(f"{cpu.active_kernels()[torch.float32]} kernels")
    with cpu.use_kernels("generic"):
        assert describe(torch.device("cpu")).endswith(", generic kernels")


def test_cpu_model_reads_sysctl_on_macos(monkeypatch):
    import subprocess

    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="Apple M2 Pro\n", stderr="")

    monkeypatch.setattr(backends.Path, "read_text", lambda self: (_ for _ in ()).throw(OSError("no procfs")))
    monkeypatch.setattr(backends.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(backends.subprocess, "run", run)
    assert backends.cpu_model() == "Apple M2 Pro"
    assert calls == [["sysctl", "-n", "machdep.cpu.brand_string"]]
    monkeypatch.setattr(backends.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no sysctl")))
    monkeypatch.setattr(backends.platform, "processor", lambda: "arm")
    assert backends.cpu_model() == "arm"  # what platform knows, when sysctl cannot answer
