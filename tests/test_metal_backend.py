"""The real MPS host code (torch_sparse_metal/backends/mps.py) driving the real shaders/*.metal kernels, with
the MSL-on-CPU executor standing in for ``torch.mps.compile_shader`` on CPU tensors.

Outputs the host allocates uninitialised are poisoned with NaN, so an element no kernel writes shows. The
last test fails if any kernel defined in shaders/ never ran in this session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.backends import mps
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.testing.msl import EXECUTED, compile_shader, kernel_names

STRATEGIES = ("fused_atomic", "atomic_free")
SHADERS = Path(__file__).resolve().parents[1] / "shaders"


def make_topology(n_in: int, n_out: int, density: float, seed: int) -> dict[str, Any]:
    """Index tensors of the op contract (docs/architecture.md) for a random mask, plus random weights."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_out, n_in, generator=g) < density
    if n_in > 2 and density > 0:
        mask[:, 1] = False  # an input row with no edges
        mask[0, :] = False  # an output with no edges
    topo = CSRTopology.from_mask(mask)
    names = ("row_ptr", "dst", "src", "col_ptr", "src_by_dst", "perm")
    return {"weight": torch.randn(topo.nnz, generator=g), **dict(zip(names, topo.kernel_args())),
            "n_in": n_in, "n_out": n_out}


def dense(t: dict[str, Any]) -> torch.Tensor:
    w = torch.zeros(t["n_out"], t["n_in"], dtype=torch.float64)
    w[t["dst"].long(), t["src"].long()] = t["weight"].double()
    return w


def topo_args(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return t["row_ptr"], t["dst"], t["src"], t["col_ptr"], t["src_by_dst"], t["perm"]


# (in_features, out_features, density, batch): densities 0..1, batch 0, 1 and sizes that are not multiples of the
# threadgroup (256 threads = 32 x 8) or of the SIMD width.
CASES = [
    (1, 1, 1.0, 1),
    (37, 45, 0.3, 5),
    (64, 33, 0.0, 3),
    (50, 70, 1.0, 0),
    (100, 61, 0.05, 257),
    (33, 97, 0.5, 1),
    (200, 130, 0.02, 9),
    (129, 31, 0.9, 17),
    (0, 5, 0.0, 4),
    (6, 0, 0.0, 4),
]
IDS = [f"in{a}-out{b}-d{c}-N{d}" for a, b, c, d in CASES]


@pytest.fixture(scope="module")
def metal() -> MetalCsrLinear:
    return MetalCsrLinear(compile_shader, device_type="cpu", poison=True)


@pytest.fixture(scope="module")
def cpu_ops():
    """The CPU ops of the C++ extension, when built."""
    try:
        import torch_sparse_metal  # noqa: F401  (loads _C: schemas and CPU kernels)

        return torch.ops.torch_sparse_metal
    except (ImportError, OSError, RuntimeError) as e:
        pytest.skip(f"torch_sparse_metal._C is not built ({e}); run `pip install -e . --no-build-isolation`")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_dense_reference(metal, case):
    n_in, n_out, density, batch = case
    t = make_topology(n_in, n_out, density, seed=sum(case[:2]) + batch)
    x = torch.randn(batch, n_in)
    y = metal.forward(x, t["weight"], *topo_args(t))
    assert y.shape == (batch, n_out) and y.dtype == torch.float32
    assert not torch.isnan(y).any(), "an output element was never written"
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_dense_reference(metal, case, strategy):
    n_in, n_out, density, batch = case
    t = make_topology(n_in, n_out, density, seed=sum(case[:2]) + batch)
    x, grad_out = torch.randn(batch, n_in), torch.randn(batch, n_out)
    grad_x, grad_w = metal.backward(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], strategy)
    assert grad_x.shape == x.shape and grad_w.shape == t["weight"].shape
    assert not torch.isnan(grad_x).any() and not torch.isnan(grad_w).any(), "an output element was never written"
    w = dense(t)
    ref_gw = (grad_out.double().T @ x.double())[t["dst"].long(), t["src"].long()]
    torch.testing.assert_close(grad_x.double(), grad_out.double() @ w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_w.double(), ref_gw, rtol=1e-4, atol=1e-4)


def test_strategies_agree(metal):
    t = make_topology(300, 280, 0.04, seed=3)
    x, grad_out = torch.randn(65, 300), torch.randn(65, 280)
    a = metal.backward(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], "fused_atomic")
    b = metal.backward(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], "atomic_free")
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_cpu_ops(metal, cpu_ops, case):
    n_in, n_out, density, batch = case
    t = make_topology(n_in, n_out, density, seed=7 + batch)
    x, grad_out = torch.randn(batch, n_in), torch.randn(batch, n_out)
    y_cpu = cpu_ops.csr_linear(x, t["weight"], *topo_args(t), "auto")
    torch.testing.assert_close(metal.forward(x, t["weight"], *topo_args(t)), y_cpu, rtol=1e-5, atol=1e-5)
    for strategy in STRATEGIES:
        ref = cpu_ops.csr_linear_backward(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], strategy)
        got = metal.backward(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], strategy)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


class _RecordingLibrary:
    """Wraps a library: records every dispatch, and can pretend to be a GPU with other pipeline limits."""

    def __init__(self, lib: Any, max_threads: int | None = None, width: int | None = None):
        self._lib, self.calls = lib, []
        self._max_threads, self._width = max_threads, width

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        outer = self

        class Kernel:
            max_threads_per_threadgroup = outer._max_threads or fn.max_threads_per_threadgroup
            thread_execution_width = outer._width or fn.thread_execution_width

            def __call__(self, *args, **kwargs):
                outer.calls.append((name, kwargs.get("threads"), kwargs.get("group_size")))
                return fn(*args, **kwargs)

        return Kernel()


def test_group_sizes_come_from_the_pipeline():
    recorder: dict[str, _RecordingLibrary] = {}

    def compile_fn(src: str) -> _RecordingLibrary:
        recorder["lib"] = _RecordingLibrary(compile_shader(src), max_threads=64, width=16)
        return recorder["lib"]

    metal = MetalCsrLinear(compile_fn, device_type="cpu", poison=True)
    t = make_topology(40, 50, 0.2, seed=1)
    x, grad_out = torch.randn(11, 40), torch.randn(11, 50)
    y = metal.forward(x, t["weight"], *topo_args(t))
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)
    for s in STRATEGIES:
        metal.backward(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], s)
    calls = recorder["lib"].calls
    assert [c[0] for c in calls] == ["csr_linear_forward_float", "csr_linear_backward_fused_atomic_float",
                                     "csr_linear_grad_w_float", "csr_linear_grad_x_float"]
    for name, _threads, group in calls:
        group = (group,) if isinstance(group, int) else group
        assert group[0] % 16 == 0 and torch.Size(group).numel() <= 64, (name, group)
    assert calls[0][1] == (50, 11) and calls[2][1] == t["weight"].numel()


def test_compiles_once_per_instance():
    count = []

    def compile_fn(src: str) -> Any:
        count.append(1)
        return compile_shader(src)

    metal = MetalCsrLinear(compile_fn, device_type="cpu")
    t = make_topology(8, 8, 0.5, seed=0)
    for _ in range(3):
        metal.forward(torch.randn(2, 8), t["weight"], *topo_args(t))
    assert len(count) == 1


def _bad_inputs() -> list[tuple[str, dict[str, Any], type, str]]:
    t = make_topology(20, 10, 0.3, seed=5)
    x = torch.randn(4, 20)
    good = {"x": x, "weight": t["weight"], **{k: t[k] for k in ("row_ptr", "dst", "src", "col_ptr", "src_by_dst",
                                                                   "perm")}}
    meta = torch.empty(4, 20, device="meta")
    return [
        ("x float64", {**good, "x": x.double()}, TypeError, "dtype"),
        ("weight float64", {**good, "weight": t["weight"].double()}, TypeError, "dtype"),
        ("dst int64", {**good, "dst": t["dst"].long()}, TypeError, "int32"),
        ("col_ptr int64", {**good, "col_ptr": t["col_ptr"].long()}, TypeError, "int32"),
        ("perm int64", {**good, "perm": t["perm"].long()}, TypeError, "int32"),
        ("x non-contiguous", {**good, "x": torch.randn(20, 4).T}, ValueError, "contiguous"),
        ("row_ptr non-contiguous", {**good, "row_ptr": torch.zeros(42, dtype=torch.int32)[::2]}, ValueError,
         "contiguous"),
        ("x wrong device", {**good, "x": meta}, RuntimeError, "run on cpu"),
        ("src wrong device", {**good, "src": t["src"].to("meta")}, RuntimeError, "is on meta"),
        ("row_ptr wrong length", {**good, "row_ptr": t["row_ptr"][:-1].clone()}, ValueError, "row_ptr"),
        ("x 1-D", {**good, "x": x[0].clone()}, ValueError, "2-D"),
    ]


def _bad_input_cases() -> list:
    """Every bad input for every op that takes that argument (the backward op has no col_ptr/perm)."""
    return [
        pytest.param(op, *case, id=f"{op}-{case[0]}")
        for op in ("forward", "fused_atomic", "atomic_free")
        for case in _bad_inputs()
        if op == "forward" or case[0].split()[0] not in ("col_ptr", "perm")
    ]


@pytest.mark.parametrize("op,name,args,exc,match", _bad_input_cases())
def test_bad_inputs_raise_before_any_kernel(op, name, args, exc, match):
    recorder: dict[str, _RecordingLibrary] = {}

    def compile_fn(src: str) -> _RecordingLibrary:
        recorder["lib"] = _RecordingLibrary(compile_shader(src))
        return recorder["lib"]

    metal = MetalCsrLinear(compile_fn, device_type="cpu")
    with pytest.raises(exc, match=match):
        if op == "forward":
            metal.forward(args["x"], args["weight"], args["row_ptr"], args["dst"], args["src"], args["col_ptr"],
                          args["src_by_dst"], args["perm"])
        else:
            grad_out = torch.randn(args["x"].shape[0] if args["x"].dim() == 2 else 4, 10)
            metal.backward(grad_out, args["x"], args["weight"], args["row_ptr"], args["dst"], args["src"], op)
    assert "lib" not in recorder or not recorder["lib"].calls


def test_backward_rejects_bad_grad_out_and_strategy(metal):
    t = make_topology(20, 10, 0.3, seed=5)
    x = torch.randn(4, 20)
    args = (x, t["weight"], t["row_ptr"], t["dst"], t["src"])
    with pytest.raises(ValueError, match="rows"):
        metal.backward(torch.randn(3, 10), *args, "fused_atomic")
    with pytest.raises(TypeError, match="dtype"):
        metal.backward(torch.randn(4, 10).double(), *args, "fused_atomic")
    with pytest.raises(ValueError, match="strategy"):
        metal.backward(torch.randn(4, 10), *args, "atomics")
    with pytest.raises(ValueError, match="'auto' is resolved before"):  # as the CPU and CUDA kernels
        metal.backward(torch.randn(4, 10), *args, "auto")


def test_registered_wrappers_follow_the_schema(metal, monkeypatch):
    """The functions registered for the MPS key pass the op's arguments through in schema order."""
    monkeypatch.setattr(mps, "_default", metal)
    t = make_topology(30, 20, 0.2, seed=11)
    x, grad_out = torch.randn(6, 30), torch.randn(6, 20)
    y = mps._csr_linear_mps(x, t["weight"], *topo_args(t), "auto")
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)
    gx, gw = mps._csr_linear_backward_mps(grad_out, x, t["weight"], t["row_ptr"], t["dst"], t["src"], "fused_atomic")
    torch.testing.assert_close(gx.double(), grad_out.double() @ dense(t), rtol=1e-4, atol=1e-4)
    ref_gw = (grad_out.double().T @ x.double())[t["dst"].long(), t["src"].long()]
    torch.testing.assert_close(gw.double(), ref_gw, rtol=1e-4, atol=1e-4)


def test_mps_kernels_registered(cpu_ops):
    assert mps.register()
    for op in ("csr_linear", "csr_linear_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_sparse_metal::{op}", "MPS")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the message on machines without MPS")
def test_default_instance_explains_missing_mps():
    fresh = MetalCsrLinear(lambda src: torch.mps.compile_shader(src), "mps", check_platform=mps.check_mps_support)
    with pytest.raises(RuntimeError, match="MPS is not available|torch >= 2.7"):
        fresh.library  # noqa: B018


def test_source_found_and_complete():
    src = mps.load_source()
    assert set(kernel_names(src)) == {f"{stage}_float" for stage in (
        "csr_linear_forward", "csr_linear_backward_fused_atomic", "csr_linear_grad_w", "csr_linear_grad_x")}


def test_every_shader_kernel_executed(request):
    """Runs last in this module: every kernel defined in shaders/*.metal must have run in this session."""
    # doctest items of the package have no .module
    mine = [i for i in request.session.items if getattr(getattr(i, "module", None), "__name__", None) == __name__]
    if any(i.name.startswith("test_backward_matches") for i in mine) is False:
        pytest.skip("the kernel-driving tests of this module were deselected")
    header = (SHADERS / mps.COMMON_HEADER).read_text()
    defined = set()
    for path in sorted(SHADERS.glob("*.metal")):
        defined |= set(kernel_names(header + "\n" + path.read_text(), path.name))
    assert defined, "no kernels found in shaders/"
    missing = sorted(defined - EXECUTED)
    assert not missing, f"kernels defined in shaders/ that no test executed: {missing}"
