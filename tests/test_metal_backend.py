"""The real MPS host code (torch_sparse_metal/backends/mps.py) driving the real shaders/*.metal kernels, with
the MSL-on-CPU executor standing in for ``torch.mps.compile_shader`` on CPU tensors, and (on a machine with an
NVIDIA GPU and nvcc) the same kernels compiled as CUDA (``tsm_dev.msl.cuda``) on CUDA tensors.

Outputs the host allocates uninitialised are poisoned with NaN, so an element no kernel writes shows. The
last test fails if any kernel defined in the family's shaders never ran in this session."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from _helpers import max_terms

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.backends import mps
from torch_sparse_metal.backends.metal import strategy_methods
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.backends.mps_vector_csr_linear import MetalVectorCsrLinear
from torch_sparse_metal.contract import TOPOLOGY_ARGS, Strategy
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import dense_weight, reference_backward
from tsm_dev.msl import EXECUTED, MAX_THREADS_PER_THREADGROUP, compile_shader, kernel_names
from tsm_dev.msl import cuda as cuda_translation
from tsm_dev.msl.source import METAL_LANGUAGE_VERSIONS

STRATEGIES = axes.STRATEGIES


def make_topology(n_in: int, n_out: int, density: float, seed: int, device: str = "cpu") -> dict[str, Any]:
    """Index tensors of the op contract (docs/architecture.md) for a random mask, plus random weights and the
    topology itself."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_out, n_in, generator=g) < density
    if n_in > 2 and density > 0:
        mask[:, 1] = False  # an input row with no edges
        mask[0, :] = False  # an output with no edges
    topo = CSRTopology.from_mask(mask)
    tensors = {"weight": torch.randn(topo.nnz, generator=g), **dict(zip(TOPOLOGY_ARGS, topo.kernel_args()))}
    return {**{k: v.to(device) for k, v in tensors.items()}, "topology": topo}


def dense(t: dict[str, Any]) -> torch.Tensor:
    """The float64 dense weight [out, in], on the CPU."""
    return dense_weight(t["weight"], t["topology"])


def topo_args(t: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return tuple(t[name] for name in TOPOLOGY_ARGS)


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
    (70, 90, 0.3, 33),
    (64, 64, 0.5, 32),
    (0, 5, 0.0, 4),
    (6, 0, 0.0, 4),
]
IDS = [f"in{a}-out{b}-d{c}-N{d}" for a, b, c, d in CASES]


def _cuda_translation() -> MetalCsrLinear:
    if not torch.cuda.is_available() or cuda_translation.nvcc_path() is None:
        pytest.skip("the CUDA translation needs an NVIDIA GPU and nvcc")
    return MetalCsrLinear(cuda_translation.compile_shader, device_type="cuda", poison=True)


@pytest.fixture(scope="module")
def executor() -> MetalCsrLinear:
    return MetalCsrLinear(compile_shader, device_type="cpu", poison=True)


@pytest.fixture(scope="module", params=["executor", "cuda"])
def metal(request) -> MetalCsrLinear:
    """The host code over the executor (CPU tensors) or over the CUDA translation (CUDA tensors)."""
    if request.param == "cuda":
        return _cuda_translation()
    return MetalCsrLinear(compile_shader, device_type="cpu", poison=True)


@pytest.fixture(scope="module")
def cpu_ops():
    """The CPU ops of the C++ extension, when built."""
    try:
        import torch_sparse_metal  # noqa: F401  (loads _C: schemas and CPU kernels)

        return torch.ops.torch_sparse_metal
    except (ImportError, OSError, RuntimeError) as e:
        pytest.skip(f"torch_sparse_metal._C is not built ({e}); run `pip install -e . --no-build-isolation`")


def _in_dtype(t: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {**t, "weight": t["weight"].to(dtype)}


@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_dense_reference(metal, case, dtype):
    """Within the dtype's error bound (testing.axes.error_bound: float accumulation, one rounding)."""
    n_in, n_out, density, batch = case
    dev = metal.device_type
    t = _in_dtype(make_topology(n_in, n_out, density, seed=sum(case[:2]) + batch, device=dev), dtype)
    x = torch.randn(batch, n_in, device=dev).to(dtype)
    y = metal.forward(x, t["weight"], *topo_args(t))
    assert y.shape == (batch, n_out) and y.dtype == dtype
    w, x64 = dense(t), x.double().cpu()
    axes.assert_within_bound("forward", y, x64 @ w.T, x64.abs() @ w.abs().T, max_terms(t["col_ptr"].cpu()), dtype)


@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_dense_reference(metal, case, strategy, dtype):
    n_in, n_out, density, batch = case
    dev = metal.device_type
    t = _in_dtype(make_topology(n_in, n_out, density, seed=sum(case[:2]) + batch, device=dev), dtype)
    x, grad_out = torch.randn(batch, n_in, device=dev).to(dtype), torch.randn(batch, n_out, device=dev).to(dtype)
    grad_x, grad_w = metal.backward(grad_out, x, t["weight"], *topo_args(t), strategy)
    assert grad_x.shape == x.shape and grad_w.shape == t["weight"].shape and grad_x.dtype == grad_w.dtype == dtype
    topo, w = t["topology"], t["weight"]
    (exact_x, exact_w), (terms_x, terms_w) = (reference_backward(grad_out, x, w, topo),
                                              reference_backward(grad_out.abs(), x.abs(), w.abs(), topo))
    axes.assert_within_bound("grad_x", grad_x, exact_x, terms_x, max_terms(t["row_ptr"].cpu()), dtype)
    axes.assert_within_bound("grad_w", grad_w, exact_w, terms_w, batch, dtype)


@pytest.mark.parametrize("p", mps.VALUES_PER_LANE)
@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]], ids=[IDS[1], IDS[4], IDS[6]])
def test_window_spmm_matches_dense_reference(case, dtype, p):
    """The SpMM's tuned variant (spmm_window) in the forward and in atomic_free's pass 2; its own edge cases are
    tests/test_metal_window.py's."""
    n_in, n_out, density, batch = case
    metal = MetalCsrLinear(compile_shader, device_type="cpu", poison=True, values_per_lane=p, spmm="window")
    t = _in_dtype(make_topology(n_in, n_out, density, seed=sum(case[:2]) + batch), dtype)
    x, grad_out = torch.randn(batch, n_in).to(dtype), torch.randn(batch, n_out).to(dtype)
    y = metal.forward(x, t["weight"], *topo_args(t))
    w, x64 = dense(t), x.double()
    axes.assert_within_bound("forward", y, x64 @ w.T, x64.abs() @ w.abs().T, max_terms(t["col_ptr"]), dtype)
    grad_x, _ = metal.backward(grad_out, x, t["weight"], *topo_args(t), "atomic_free")
    exact_x, _ = reference_backward(grad_out, x, t["weight"], t["topology"])
    terms_x, _ = reference_backward(grad_out.abs(), x.abs(), t["weight"].abs(), t["topology"])
    axes.assert_within_bound("grad_x", grad_x, exact_x, terms_x, max_terms(t["row_ptr"]), dtype)


@pytest.mark.parametrize("seed", range(4))
def test_strategies_agree(metal, seed):
    """Within float32 summation-order error, never bitwise: the strategies add the same products in different
    orders (reductions across a SIMD-group, and atomics across batch chunks in whatever order the GPU runs them).
    Each result is within (n - 1) * eps * sum|terms| of the exact sum (n terms, any order), so the two are within
    twice that; a product missing or counted twice would be off by about sum|terms| / n, far outside."""
    dev = metal.device_type
    t = make_topology(300, 280, 0.04, seed=seed, device=dev)
    batch = 265
    x, grad_out = torch.randn(batch, 300, device=dev), torch.randn(batch, 280, device=dev)
    gx_a, gw_a = metal.backward(grad_out, x, t["weight"], *topo_args(t), "fused_atomic")
    gx_b, gw_b = metal.backward(grad_out, x, t["weight"], *topo_args(t), "atomic_free")
    eps = torch.finfo(torch.float32).eps
    gw_terms = (grad_out.abs().T @ x.abs())[t["dst"].long(), t["src"].long()]
    gx_terms = grad_out.abs() @ dense(t).abs().float().to(dev)
    row_len = int((t["row_ptr"][1:] - t["row_ptr"][:-1]).max())
    assert ((gw_a - gw_b).abs() <= 2 * (batch - 1) * eps * gw_terms).all()
    assert ((gx_a - gx_b).abs() <= 2 * max(row_len - 1, 1) * eps * gx_terms).all()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_cpu_ops(metal, cpu_ops, case):
    n_in, n_out, density, batch = case
    dev = metal.device_type
    t = make_topology(n_in, n_out, density, seed=7 + batch)
    td = make_topology(n_in, n_out, density, seed=7 + batch, device=dev)
    x, grad_out = torch.randn(batch, n_in), torch.randn(batch, n_out)
    xd, god = x.to(dev), grad_out.to(dev)
    y_cpu = cpu_ops.csr_linear(x, t["weight"], *topo_args(t), "auto")
    torch.testing.assert_close(metal.forward(xd, td["weight"], *topo_args(td)).cpu(), y_cpu, rtol=1e-5, atol=1e-5)
    for strategy in STRATEGIES:
        ref = cpu_ops.csr_linear_backward(grad_out, x, t["weight"], *topo_args(t), strategy)
        got = metal.backward(god, xd, td["weight"], *topo_args(td), strategy)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.cpu(), r, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ the operands kernels
# (cols, second cols, batch, P, edges): batch 0 (only padding), 1 and odd; cols and edges that are not multiples of
# a tile (32) or of a block (1024 elements); no edges, no columns.
OPERAND_CASES = [
    (1, 1, 1, 1, 1),
    (45, 37, 5, 1, 1023),
    (70, 33, 33, 4, 1025),
    (33, 64, 0, 1, 2049),
    (64, 1, 32, 1, 300),
    (100, 130, 257, 4, 0),
    (0, 3, 7, 1, 5),
]
OPERAND_IDS = [f"cols{a}-{b}-N{c}-p{d}-E{e}" for a, b, c, d, e in OPERAND_CASES]


def _padded_copy(t: torch.Tensor, ldb: int) -> torch.Tensor:
    """The float64 feature-major, zero-padded [cols, ldb] copy of a batch-major [batch, cols] tensor."""
    out = torch.zeros(t.shape[1], ldb, dtype=torch.float64)
    out[:, :t.shape[0]] = t.cpu().double().T
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """A copy: every element equal (NaN from the poisoned allocation shows as a mismatch)."""
    assert got.shape == want.shape and torch.equal(got.cpu().double(), want.cpu().double()), (got, want)


def _operand_inputs(case: tuple, dtype: torch.dtype, dev: str) -> tuple[Any, ...]:
    """Two batch-major operands, edge values, the padded batch (ldb) and the edge count of an OPERAND_CASES case."""
    cols, cols2, batch, p, edges = case
    g = torch.Generator().manual_seed(sum(case))
    ldb = -(-max(batch, 1) // (32 * p)) * 32 * p
    a, b = torch.randn(batch, cols, generator=g), torch.randn(batch, cols2, generator=g)
    return a.to(dev, dtype), b.to(dev, dtype), torch.randn(edges, generator=g).to(dev, dtype), ldb, edges


@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
@pytest.mark.parametrize("case", OPERAND_CASES, ids=OPERAND_IDS)
def test_forward_operands_copy_x_and_gather_the_weights(metal, case, dtype):
    """One dispatch: x feature-major with zeros past the batch, and weight[perm], into poisoned outputs."""
    x, _, weight, ldb, edges = _operand_inputs(case, dtype, metal.device_type)
    perm = torch.randperm(edges, generator=torch.Generator().manual_seed(edges)).to(x.device, torch.int32)
    xt, tiles = metal._feature_major(x, ldb)
    w_by_dst = metal._empty((edges,), weight)
    errors = torch.zeros(1, dtype=torch.int32, device=x.device)
    metal._operands("forward_operands", dtype, (xt, w_by_dst), (x, weight, perm, errors),
                    (x.shape[0], x.shape[1], ldb, edges), tiles + -(-edges // mps.BLOCK_ELEMS))
    _same(xt, _padded_copy(x, ldb))
    _same(w_by_dst, weight.cpu().double()[perm.cpu().long()])
    assert errors.item() == 0


@pytest.mark.parametrize("bad", [2049, -1, -(2**31)])
def test_forward_operands_clamp_and_record_a_bad_perm(metal, bad):
    """A perm entry outside [0, nnz) reads the last weight instead and sets perm's error word; the others, and x's
    copy, are unaffected."""
    x, _, weight, ldb, edges = _operand_inputs(OPERAND_CASES[3], torch.float32, metal.device_type)
    perm = torch.randperm(edges, generator=torch.Generator().manual_seed(0)).to(x.device, torch.int32)
    perm[1500] = bad
    xt, tiles = metal._feature_major(x, ldb)
    w_by_dst = metal._empty((edges,), weight)
    errors = torch.zeros(1, dtype=torch.int32, device=x.device)
    metal._operands("forward_operands", torch.float32, (xt, w_by_dst), (x, weight, perm, errors),
                    (x.shape[0], x.shape[1], ldb, edges), tiles + -(-edges // mps.BLOCK_ELEMS))
    want = weight.cpu()[perm.cpu().clamp(0, edges - 1).long()]
    want[1500] = weight[-1].cpu()
    _same(w_by_dst, want)
    _same(xt, _padded_copy(x, ldb))
    assert errors.item() == 1


@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
@pytest.mark.parametrize("case", OPERAND_CASES, ids=OPERAND_IDS)
def test_fused_atomic_operands_copy_grad_out_and_zero_grad_w(metal, case, dtype):
    """One dispatch: grad_out feature-major, and the float32 grad_w (poisoned) zero-filled."""
    grad_out, _, weight, ldb, edges = _operand_inputs(case, dtype, metal.device_type)
    gt, tiles = metal._feature_major(grad_out, ldb)
    grad_w = metal._empty((edges,), weight, torch.float32)
    metal._operands("fused_atomic_operands", dtype, (gt, grad_w), (grad_out,),
                    (grad_out.shape[0], grad_out.shape[1], ldb, edges), tiles + -(-edges // mps.BLOCK_ELEMS))
    _same(gt, _padded_copy(grad_out, ldb))
    assert grad_w.dtype == torch.float32 and torch.equal(grad_w.cpu(), torch.zeros(edges))


@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
@pytest.mark.parametrize("case", OPERAND_CASES, ids=OPERAND_IDS)
def test_atomic_free_operands_copy_grad_out_and_x(metal, case, dtype):
    """One dispatch: grad_out and x feature-major with the same ldb (one of them may have no columns)."""
    grad_out, x, _, ldb, _ = _operand_inputs(case, dtype, metal.device_type)
    (gt, out_tiles), (xt, in_tiles) = metal._feature_major(grad_out, ldb), metal._feature_major(x, ldb)
    metal._operands("atomic_free_operands", dtype, (gt, xt), (grad_out, x),
                    (x.shape[0], grad_out.shape[1], x.shape[1], ldb), out_tiles + in_tiles)
    _same(gt, _padded_copy(grad_out, ldb))
    _same(xt, _padded_copy(x, ldb))


class _RecordingLibrary:
    """Wraps a library: records every dispatch, and can pretend to be a GPU with other pipeline limits."""

    def __init__(self, lib: Any, max_threads: int | None = None, width: int | None = None,
                 tile_bytes: int | None = None):
        self._lib, self.calls = lib, []
        self._max_threads, self._width, self._tile_bytes = max_threads, width, tile_bytes

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        outer = self

        class Kernel:
            max_threads_per_threadgroup = outer._max_threads or fn.max_threads_per_threadgroup
            thread_execution_width = outer._width or fn.thread_execution_width
            static_thread_group_memory_length = (fn.static_thread_group_memory_length if outer._tile_bytes is None
                                                 else outer._tile_bytes)

            def __call__(self, *args, **kwargs):
                outer.calls.append((name, kwargs.get("threads"), kwargs.get("group_size")))
                return fn(*args, **kwargs)

        return Kernel()


def _recording(max_threads: int | None = None, **limits: int) -> tuple[MetalCsrLinear, dict[str, _RecordingLibrary]]:
    """The host over a recording library; ``max_threads`` is the executor's own pipeline limit (it refuses larger
    groups, as torch does), the other limits are only reported."""
    recorder: dict[str, _RecordingLibrary] = {}

    def compile_fn(src: str) -> _RecordingLibrary:
        lib = compile_shader(src, max_threads_per_threadgroup=max_threads or MAX_THREADS_PER_THREADGROUP)
        recorder["lib"] = _RecordingLibrary(lib, **limits)
        return recorder["lib"]

    return MetalCsrLinear(compile_fn, device_type="cpu", poison=True), recorder


@pytest.mark.parametrize("batch,p", [(11, 1), (32, 1), (33, 4), (300, 4)])
def test_group_sizes_come_from_the_pipeline(batch, p):
    """A pipeline that allows only 64 threads per group gets 2 SIMD-groups per group, and the results hold."""
    metal, recorder = _recording(max_threads=64)
    t = make_topology(40, 50, 0.2, seed=batch)
    x, grad_out = torch.randn(batch, 40), torch.randn(batch, 50)
    y = metal.forward(x, t["weight"], *topo_args(t))
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)
    for s in STRATEGIES:
        gx, _ = metal.backward(grad_out, x, t["weight"], *topo_args(t), s)
        torch.testing.assert_close(gx.double(), grad_out.double() @ dense(t), rtol=1e-4, atol=1e-4)
    calls = recorder["lib"].calls
    assert [c[0] for c in calls] == [
        "forward_operands_float", f"spmm_float_p{p}",
        "fused_atomic_operands_float", f"spmm_sddmm_atomic_float_p{p}",
        "atomic_free_operands_float", f"sddmm_float_p{p}", f"spmm_float_p{p}"]
    ldb = -(-batch // (32 * p)) * 32 * p
    for name, threads, group in calls:
        group = (group,) if isinstance(group, int) else group
        assert torch.Size(group).numel() <= 64, (name, group)
        if name.startswith(("spmm_float", "spmm_sddmm_atomic")):  # whole threadgroups of two SIMD-groups (barriers)
            assert group == (64, 1) and threads[0] % 64 == 0, (name, threads, group)
        if "_operands_" in name:  # a row of (32, 2) groups: one per 32 x 32 tile or block of 1024 elements
            assert group == (32, 2) and threads[1] == 2, (name, threads, group)
    tiles = lambda cols: -(-cols // 32) * (ldb // 32)  # noqa: E731
    blocks = -(-t["weight"].numel() // 1024)
    assert [c[1][0] // 32 for c in calls if "_operands_" in c[0]] == [tiles(40) + blocks, tiles(50) + blocks,
                                                                     tiles(50) + tiles(40)]
    assert calls[1][1] == (64 * 25, ldb // (32 * p))  # 50 outputs, 2 per group; one group row per chunk
    assert calls[5][1:] == (40 * 32, 64)  # atomic_free pass 1: a SIMD-group per source row, whole batch


def test_pipeline_without_a_threadgroup_memory_length_gets_full_groups():
    metal, recorder = _recording(tile_bytes=0)
    t = make_topology(40, 50, 0.2, seed=2)
    x = torch.randn(9, 40)
    y = metal.forward(x, t["weight"], *topo_args(t))
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)
    assert recorder["lib"].calls[-1][2] == (256, 1)


def test_simd_width_other_than_32_is_refused():
    metal, _ = _recording(width=16)
    t = make_topology(40, 50, 0.2, seed=1)
    with pytest.raises(RuntimeError, match="32-wide SIMD-groups"):
        metal.forward(torch.randn(3, 40), t["weight"], *topo_args(t))


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
    good = {"x": x, "weight": t["weight"], **{k: t[k] for k in TOPOLOGY_ARGS}}
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
    """Every bad input for every op (both take the whole topology)."""
    return [pytest.param(op, *case, id=f"{op}-{case[0]}") for op in ("forward", *STRATEGIES) for case in _bad_inputs()]


@pytest.mark.parametrize("op,name,args,exc,match", _bad_input_cases())
def test_bad_inputs_raise_before_any_kernel(op, name, args, exc, match):
    recorder: dict[str, _RecordingLibrary] = {}

    def compile_fn(src: str) -> _RecordingLibrary:
        recorder["lib"] = _RecordingLibrary(compile_shader(src))
        return recorder["lib"]

    metal = MetalCsrLinear(compile_fn, device_type="cpu")
    with pytest.raises(exc, match=match):
        if op == "forward":
            metal.forward(args["x"], args["weight"], *topo_args(args))
        else:
            grad_out = torch.randn(args["x"].shape[0] if args["x"].dim() == 2 else 4, 10)
            metal.backward(grad_out, args["x"], args["weight"], *topo_args(args), op)
    assert "lib" not in recorder or not recorder["lib"].calls


def test_backward_rejects_bad_grad_out_and_strategy(executor):
    metal = executor
    t = make_topology(20, 10, 0.3, seed=5)
    x = torch.randn(4, 20)
    args = (x, t["weight"], *topo_args(t))
    with pytest.raises(ValueError, match="rows"):
        metal.backward(torch.randn(3, 10), *args, "fused_atomic")
    with pytest.raises(TypeError, match="dtype"):
        metal.backward(torch.randn(4, 10).double(), *args, "fused_atomic")
    with pytest.raises(ValueError, match="strategy"):
        metal.backward(torch.randn(4, 10), *args, "atomics")
    with pytest.raises(ValueError, match="expected one of 'fused_atomic', 'atomic_free', lower case \\('auto' is "
                                         "resolved by the autograd rule before"):  # as the CPU and CUDA kernels
        metal.backward(torch.randn(4, 10), *args, "auto")


def test_registered_wrappers_follow_the_schema(executor, monkeypatch):
    """The functions registered for the MPS key pass the op's arguments through in schema order."""
    monkeypatch.setattr(mps, "_default", executor)
    t = make_topology(30, 20, 0.2, seed=11)
    x, grad_out = torch.randn(6, 30), torch.randn(6, 20)
    y = mps._csr_linear_mps(x, t["weight"], *topo_args(t), "auto")
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)
    gx, gw = mps._csr_linear_backward_mps(grad_out, x, t["weight"], *topo_args(t), "fused_atomic")
    for got, ref in zip((gx, gw), reference_backward(grad_out, x, t["weight"], t["topology"])):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backward", ["sideways", "Auto", "fused-atomic", ""])
def test_registered_forward_refuses_a_backward_no_strategy_has(executor, monkeypatch, backward):
    """The MPS forward checks ``backward`` as the CPU and CUDA forwards do, before any kernel runs, although the
    forward kernels do not read it (the allowed values are the contract's)."""
    monkeypatch.setattr(mps, "_default", executor)
    t = make_topology(30, 20, 0.2, seed=11)
    allowed = ", ".join(repr(s.value) for s in Strategy if s is not Strategy.AUTO)
    with pytest.raises(ValueError, match=re.escape(f"unknown backward strategy {backward!r}; expected 'auto' or one "
                                                   f"of {allowed}, lower case")):
        mps._csr_linear_mps(torch.randn(6, 30), t["weight"], *topo_args(t), backward)


# --------------------------------------------------------------------------- platform and missing kernels
BFLOAT_GUARD = "#if __METAL_VERSION__ >= 310"


def test_missing_kernel_reached_with_torchs_exception():
    """Where Metal built no bfloat kernels, torch's library answers the host's lookup with RuntimeError("Failed to
    create function state object for: ...") (MetalShaderLibrary::getLibraryPipelineState, called from the
    library's __getattr__ in torch/csrc/mps/Module.cpp); the executor raises the same, and the host turns it into
    its own message, the original chained."""
    assert BFLOAT_GUARD in mps.load_source()
    metal = MetalCsrLinear(lambda src: compile_shader(src.replace(BFLOAT_GUARD, "#if 0")), device_type="cpu")
    t = _in_dtype(make_topology(10, 12, 0.3, seed=3), torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"built no torch.bfloat16 kernels \(they need Metal 3.1, macOS 14 or "
                                           r"newer\); use float32 or float16") as info:
        metal.forward(torch.randn(4, 10).bfloat16(), t["weight"], *topo_args(t))
    assert str(info.value.__cause__) == "Failed to create function state object for: forward_operands_bfloat"
    y = metal.forward(torch.randn(4, 10), t["weight"].float(), *topo_args(t))  # the other dtypes still run
    assert y.shape == (4, 12)


def test_a_failed_pipeline_is_not_a_missing_kernel(monkeypatch):
    """Only torch's missing-function error is a missing kernel; any other error of the lookup (a pipeline that
    failed to build) makes the dtype's kernels unavailable: the call runs the reference path, with the original
    error in the one warning (tests/test_mps_reference.py covers the fall-back itself)."""
    from torch_sparse_metal.backends import metal as metal_module
    from torch_sparse_metal.backends import mps_reference

    monkeypatch.setattr(metal_module, "_force_reference", False)
    monkeypatch.setattr(mps_reference, "_warned", set())

    class Broken:
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            raise RuntimeError("Failed to created pipeline state object, error: out of registers")

    metal = MetalCsrLinear(lambda src: Broken(), device_type="cpu")
    t = make_topology(10, 12, 0.3, seed=3)
    x = torch.randn(4, 10)
    with pytest.warns(mps_reference.MetalFallbackWarning, match="(?s)forward_operands_float could not be created.*"
                                                                "out of registers"):
        y = metal.forward(x, t["weight"], *topo_args(t))
    torch.testing.assert_close(y.double(), x.double() @ dense(t).T, rtol=1e-4, atol=1e-4)
    assert "missing" not in str(metal.failures[torch.float32]) and "built no" not in str(metal.failures[torch.float32])


@pytest.mark.parametrize("torch_version,mac,match", [
    ("2.6.0", "15.0", r"need torch >= 2.7 \(torch.mps.compile_shader\); this is torch 2.6.0"),
    ("2.7.0", "13.6.1", r"need macOS >= 14.0 \(Metal 3.1\); this is macOS 13.6.1"),
    ("2.13.0", "13.0", r"need macOS >= 14.0"),
    ("2.15.0", "14.7", r"torch 2.15.0 runs MPS on macOS >= 15.0 only; this is macOS 14.7: update macOS, or install "
                       r"torch < 2.15"),
    ("2.16.0.dev20270101", "14.2", r"runs MPS on macOS >= 15.0 only"),
])
def test_platform_refused_clearly(torch_version, mac, match):
    with pytest.raises(RuntimeError, match=match):
        mps.check_mps_support(torch_version, mac)


@pytest.mark.parametrize("torch_version,mac", [("2.7.0", "14.0"), ("2.14.1", "14.5"), ("2.15.0", "15.0"),
                                               ("2.15.0", "26.1")])
def test_supported_platforms_reach_the_mps_check(torch_version, mac):
    """Past the version checks only torch's own MPS availability is asked (False on this machine)."""
    if torch.backends.mps.is_available():
        mps.check_mps_support(torch_version, mac)
    else:
        with pytest.raises(RuntimeError, match="MPS is not available"):
            mps.check_mps_support(torch_version, mac)


@pytest.mark.parametrize("metal_version", METAL_LANGUAGE_VERSIONS,
                         ids=[f"metal{v // 100}.{v % 100 // 10}" for v in METAL_LANGUAGE_VERSIONS])
@pytest.mark.parametrize("dtype", list(mps.KERNEL_DTYPES), ids=str)
def test_every_metal_version_runs_every_dtype(metal_version, dtype):
    """The shaders compiled at each ``__METAL_VERSION__`` the supported torch releases use on a supported macOS
    (source.METAL_LANGUAGE_RULES): forward and both strategies, within the dtype's bound."""
    metal = MetalCsrLinear(lambda src: compile_shader(src, metal_version=metal_version), "cpu", poison=True)
    t = _in_dtype(make_topology(37, 45, 0.3, seed=metal_version), dtype)
    x, grad_out = torch.randn(33, 37).to(dtype), torch.randn(33, 45).to(dtype)
    w, x64 = dense(t), x.double()
    axes.assert_within_bound("forward", metal.forward(x, t["weight"], *topo_args(t)), x64 @ w.T,
                             x64.abs() @ w.abs().T, max_terms(t["col_ptr"]), dtype)
    topo = t["topology"]
    (exact_x, exact_w), (terms_x, terms_w) = (reference_backward(grad_out, x, t["weight"], topo),
                                              reference_backward(grad_out.abs(), x.abs(), t["weight"].abs(), topo))
    for strategy in STRATEGIES:
        grad_x, grad_w = metal.backward(grad_out, x, t["weight"], *topo_args(t), strategy)
        axes.assert_within_bound("grad_x", grad_x, exact_x, terms_x, max_terms(t["row_ptr"]), dtype)
        axes.assert_within_bound("grad_w", grad_w, exact_w, terms_w, 33, dtype)


def test_mps_kernels_registered(cpu_ops):
    assert mps.register()
    for op in ("csr_linear", "csr_linear_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_sparse_metal::{op}", "MPS")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the message on machines without MPS")
def test_default_instance_explains_missing_mps():
    fresh = MetalCsrLinear(lambda src: torch.mps.compile_shader(src), "mps", check_platform=mps.check_mps_support)
    with pytest.raises(RuntimeError, match="MPS is not available|torch >= 2.7"):
        fresh.library  # noqa: B018


@pytest.mark.skipif(cuda_translation.nvcc_path() is None, reason="nvcc not installed (a CUDA toolkit)")
def test_shaders_translate_to_cuda():
    """The CUDA translation of the shipped shaders compiles (no GPU needed), so the H200 proxy cannot rot."""
    cuda_src = cuda_translation.translate(mps.load_source(), "csr_linear_library.metal")
    assert cuda_translation.compile_cubin(cuda_src, "sm_90")


def test_source_found_and_complete():
    """The shaders instantiate exactly the kernels the host code dispatches."""
    assert sorted(kernel_names(mps.load_source())) == sorted(mps.kernel_names())


def test_every_shader_kernel_executed(request):
    """Runs last in this module: every kernel defined in the csr_linear family's shaders (mps.SHADER_FILES) must have
    run in this session; each other family's test module checks its own (tests/test_metal_vector.py)."""
    # doctest items of the package have no .module
    mine = [i for i in request.session.items if getattr(getattr(i, "module", None), "__name__", None) == __name__]
    if any(i.name.startswith("test_backward_matches") for i in mine) is False:
        pytest.skip("the kernel-driving tests of this module were deselected")
    defined = set(kernel_names(mps.load_source(), "csr_linear_library.metal"))
    assert defined, "no kernels found in shaders/"
    missing = sorted(defined - EXECUTED)
    assert not missing, f"kernels defined in shaders/ that no test executed: {missing}"


@pytest.mark.parametrize("host", [mps.MetalCsrLinear, MetalVectorCsrLinear])
def test_a_strategy_without_metal_kernels_fails_at_registration(host):
    """Each host has a method per strategy of the contract (strategy_methods), for both layouts."""
    assert set(strategy_methods(host)) == set(STRATEGIES)  # axes.STRATEGIES: the contract's

    class Lacking(host):
        atomic_free = None

    with pytest.raises(ImportError, match="atomic_free"):
        strategy_methods(Lacking)
