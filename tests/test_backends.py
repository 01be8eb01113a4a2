"""The backend seam (torch_sparse_metal.devices): every device type of the op contract is declared once, and the
package's device lists come from the declarations."""

from __future__ import annotations

import pytest
import torch

from torch_sparse_metal import check_index_errors, devices
from torch_sparse_metal.backends import cpu
from torch_sparse_metal.contract import DTYPES, supported_dtypes
from torch_sparse_metal_tools.testing import axes


def test_every_contract_device_has_one_backend():
    contract_devices = set().union(*(spec.devices for spec in DTYPES.values()))
    assert contract_devices == set(devices.BACKENDS)
    for name, backend in devices.BACKENDS.items():
        assert backend.device_type == name
        assert backend.dtypes == supported_dtypes(name) and backend.dtypes


def test_test_axes_are_the_available_backends():
    assert axes.DEVICES == devices.available()
    assert "cpu" in axes.DEVICES
    assert ("cuda" in axes.DEVICES) == torch.cuda.is_available()
    assert ("mps" in axes.DEVICES) == torch.backends.mps.is_available()


def test_a_device_type_is_declared_once():
    with pytest.raises(ValueError, match="already registered"):
        devices.register(devices.get("cpu"))


def test_no_backend_for_meta_and_index_errors_there_are_a_no_op():
    assert devices.get("meta") is None
    check_index_errors("meta")  # nothing runs on meta, so nothing was recorded


def test_cpu_describes_the_machine_its_threads_and_kernel_set():
    describe = devices.get("cpu").describe
    name = describe(torch.device("cpu"))
    assert name.startswith(f"cpu {devices.cpu_model()} x{torch.get_num_threads()}, ")
    assert name.endswith(f"{cpu.active_kernels()[torch.float32]} kernels")
    with cpu.use_kernels("generic"):
        assert describe(torch.device("cpu")).endswith(", generic kernels")


def test_cpu_model_reads_sysctl_on_macos(monkeypatch):
    import subprocess

    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="Apple M2 Pro\n", stderr="")

    monkeypatch.setattr(devices.Path, "read_text", lambda self: (_ for _ in ()).throw(OSError("no procfs")))
    monkeypatch.setattr(devices.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(devices.subprocess, "run", run)
    assert devices.cpu_model() == "Apple M2 Pro"
    assert calls == [["sysctl", "-n", "machdep.cpu.brand_string"]]
    monkeypatch.setattr(devices.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no sysctl")))
    monkeypatch.setattr(devices.platform, "processor", lambda: "arm")
    assert devices.cpu_model() == "arm"  # what platform knows, when sysctl cannot answer
