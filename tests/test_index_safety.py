"""Malformed index tensors given straight to the ops never reach memory outside their tensors, and are reported.

Each case corrupts one index array of a valid topology. The CPU ops raise before any kernel runs, naming the
array and the position. The GPU kernels (CUDA; Metal under the MSL-on-CPU executor and through its CUDA
translation) clamp every index they read and record the array in the device error words, which
``check_index_errors`` / ``take_index_errors`` read: docs/architecture.md, "Index safety". Valid topologies,
including empty rows and batches of 0 and 1, must leave the words clear.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import CSRTopology, check_index_errors
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.contract import INDEX_ARRAYS, INT32_MAX, TOPOLOGY_ARGS
from torch_sparse_metal_tools.testing import axes
from tsm_dev.msl import compile_shader
from tsm_dev.msl import cuda as cuda_translation

OPS = torch.ops.torch_sparse_metal


def _args(seed: int = 0, n_in: int = 9, n_out: int = 6, batch: int = 4, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    topo = CSRTopology.random(n_in, n_out, 0.4, generator=g)
    a = {"x": torch.randn(batch, n_in, generator=g), "w": torch.randn(topo.nnz, generator=g),
         "go": torch.randn(batch, n_out, generator=g),
         **{n: t.clone() for n, t in zip(TOPOLOGY_ARGS, topo.kernel_args())}}
    return {k: v.to(device) for k, v in a.items()}


def _set(name: str, index: int, value: int) -> Callable[[dict], None]:
    def corrupt(a: dict) -> None:
        a[name][index] = value
    return corrupt


# (id, corruption, the array it corrupts, the CPU op's message)
FORWARD = [
    ("col_ptr does not start at 0", _set("col_ptr", 0, 1), "col_ptr", "col_ptr is not a CSR pointer array"),
    ("col_ptr decreases", _set("col_ptr", 2, -1), "col_ptr", "col_ptr is not a CSR pointer array"),
    ("col_ptr ends past nnz", _set("col_ptr", -1, 10_000), "col_ptr", "col_ptr is not a CSR pointer array"),
    ("col_ptr ends before nnz", _set("col_ptr", -1, 1), "col_ptr", "col_ptr is not a CSR pointer array"),
    ("src_by_dst past in_features", _set("src_by_dst", 3, 9), "src_by_dst",
     r"src_by_dst\[3\] = 9 is outside \[0, in_features"),
    ("src_by_dst negative", _set("src_by_dst", 0, -1), "src_by_dst", r"src_by_dst\[0\] = -1 is outside"),
    ("src_by_dst far past", _set("src_by_dst", -1, INT32_MAX), "src_by_dst", "src_by_dst.* is outside"),
    ("perm past nnz", _set("perm", 1, 1 << 20), "perm", r"perm\[1\] = 1048576 is outside \[0, nnz"),
    ("perm negative", _set("perm", -1, -INT32_MAX - 1), "perm", "perm.* is outside"),
]
BACKWARD = [
    ("row_ptr ends past nnz", _set("row_ptr", -1, 10_000), "row_ptr", "row_ptr is not a CSR pointer array"),
    ("row_ptr decreases", _set("row_ptr", 3, -5), "row_ptr", "row_ptr is not a CSR pointer array"),
    ("row_ptr does not start at 0", _set("row_ptr", 0, 2), "row_ptr", "row_ptr is not a CSR pointer array"),
    ("dst past out_features", _set("dst", 2, 6), "dst", r"dst\[2\] = 6 is outside \[0, out_features = 6\)"),
    ("dst negative", _set("dst", 0, -3), "dst", r"dst\[0\] = -3 is outside"),
]
STRATEGIES = ["fused_atomic", "atomic_free"]


def _forward(op, a: dict) -> torch.Tensor:
    return op(a["x"], a["w"], *(a[n] for n in TOPOLOGY_ARGS))


def _op_forward(*args: torch.Tensor) -> torch.Tensor:
    return OPS.csr_linear(*args, "auto")


def _backward(op, a: dict, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    return op(a["go"], a["x"], a["w"], *(a[n] for n in TOPOLOGY_ARGS), strategy)


# ----------------------------------------------------------------------------------------------- CPU ops
@pytest.mark.parametrize(("name", "corrupt", "array", "message"), FORWARD, ids=[c[0] for c in FORWARD])
def test_op_forward_refuses_bad_indices(name, corrupt, array, message):
    a = _args()
    corrupt(a)
    with pytest.raises(RuntimeError, match=message):
        _forward(_op_forward, a)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "corrupt", "array", "message"), BACKWARD, ids=[c[0] for c in BACKWARD])
def test_cpu_backward_refuses_bad_indices(name, corrupt, array, message, strategy):
    a = _args()
    corrupt(a)
    with pytest.raises(RuntimeError, match=message):
        _backward(OPS.csr_linear_backward, a, strategy)


def test_grad_out_narrower_than_the_topology_is_refused():
    a = _args()
    a["go"] = a["go"][:, :3].contiguous()
    with pytest.raises(RuntimeError, match="3 columns but the topology has out_features=6"):
        _backward(OPS.csr_linear_backward, a, "fused_atomic")


@pytest.mark.parametrize("shape", [(0, 6), (9, 0)], ids=["no inputs", "no outputs"])
def test_edges_without_inputs_or_outputs_are_refused(shape):
    """Checked from shapes alone: the GPU guards clamp into [0, in_features) and [0, out_features)."""
    n_in, n_out = shape
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    row_ptr = i32(*([0] * n_in), 1) if n_in else i32(1)
    col_ptr = i32(*([0] * n_out), 1) if n_out else i32(1)
    with pytest.raises(RuntimeError, match="1 edges but in_features"):
        OPS.csr_linear(torch.randn(2, n_in), torch.randn(1), row_ptr, i32(0), i32(0), col_ptr, i32(0), i32(0),
                       "auto")


def test_cpu_has_no_error_words():
    check_index_errors("cpu")
    assert OPS.take_index_errors(torch.empty(0)) == [0] * len(INDEX_ARRAYS)


# ------------------------------------------------------------------------------------------ GPU kernels
def _metal_executor() -> tuple[Callable, Callable, Callable, str]:
    metal = MetalCsrLinear(compile_shader, device_type="cpu", poison=True)
    return metal.forward, metal.backward, lambda: metal.take_index_errors(torch.device("cpu")), "cpu"


def _metal_on_cuda() -> tuple[Callable, Callable, Callable, str]:
    if not torch.cuda.is_available() or cuda_translation.nvcc_path() is None:
        pytest.skip("the CUDA translation needs an NVIDIA GPU and nvcc")
    metal = MetalCsrLinear(cuda_translation.compile_shader, device_type="cuda", poison=True)
    return metal.forward, metal.backward, lambda: metal.take_index_errors(torch.device("cuda", 0)), "cuda"


def _cuda_ops() -> tuple[Callable, Callable, Callable, str]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return (_op_forward, OPS.csr_linear_backward,
            lambda: OPS.take_index_errors(torch.empty(0, device="cuda")), "cuda")


GPU_KERNELS = {"metal-executor": _metal_executor, "metal-on-cuda": _metal_on_cuda, "cuda": _cuda_ops}


@pytest.fixture(scope="module", params=list(GPU_KERNELS))
def gpu(request):
    forward, backward, take, device = GPU_KERNELS[request.param]()
    take()  # start clear
    return forward, backward, take, device


def _flagged(take: Callable) -> set[str]:
    return {name for name, word in zip(INDEX_ARRAYS, take()) if word}


@pytest.mark.parametrize("batch", [4, 300])  # one chunk of batch columns, and several
@pytest.mark.parametrize(("name", "corrupt", "array", "message"), FORWARD, ids=[c[0] for c in FORWARD])
def test_gpu_forward_guards_and_reports_bad_indices(gpu, name, corrupt, array, message, batch):
    forward, _, take, device = gpu
    a = _args(batch=batch, device=device)
    corrupt(a)
    y = _forward(forward, a)
    assert torch.isfinite(y).all(), "every output element is written (poisoned outputs would show NaN)"
    assert _flagged(take) == {array}


@pytest.mark.parametrize("batch", [4, 300])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "corrupt", "array", "message"), BACKWARD, ids=[c[0] for c in BACKWARD])
def test_gpu_backward_guards_and_reports_bad_indices(gpu, name, corrupt, array, message, strategy, batch):
    _, backward, take, device = gpu
    a = _args(batch=batch, device=device)
    corrupt(a)
    gx, gw = _backward(backward, a, strategy)
    assert torch.isfinite(gx).all()
    assert _flagged(take) == {array}


@pytest.mark.parametrize("shape", [(9, 6, 4), (1, 1, 1), (40, 70, 33), (37, 5, 0), (130, 3, 129), (40, 70, 300)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", [1, 2])
def test_gpu_valid_topologies_leave_the_words_clear(gpu, shape, seed):
    forward, backward, take, device = gpu
    a = _args(seed, *shape, device=device)
    _forward(forward, a)
    for strategy in STRATEGIES:
        _backward(backward, a, strategy)
    assert _flagged(take) == set()


def test_check_index_errors_names_the_array_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_index_errors("cuda")
    a = _args(device="cuda")
    a["dst"][0] = 1 << 30
    _backward(OPS.csr_linear_backward, a, "fused_atomic")
    with pytest.raises(RuntimeError, match="out-of-range values of dst"):
        check_index_errors("cuda")
    check_index_errors("cuda")  # cleared by the read


# ----------------------------------------------------------------------------------------------- strides
@pytest.mark.parametrize("device", axes.DEVICES)
@pytest.mark.parametrize("layout", ["strided", "expanded", "offset view"])
def test_strided_and_expanded_weights_give_exact_gradients(device, layout):
    """The kernels read raw memory: a weight that is a view must reach them as its values, not its storage."""
    g = torch.Generator().manual_seed(7)
    topo = CSRTopology.random(11, 7, 0.5, generator=g).to(device)
    x = torch.randn(5, 11, dtype=torch.float64 if device != "mps" else torch.float32, generator=g).to(device)
    base = {"strided": torch.randn(2 * topo.nnz, generator=g), "expanded": torch.randn(1, generator=g),
            "offset view": torch.randn(topo.nnz + 3, generator=g)}[layout].to(x).requires_grad_()
    view = {"strided": lambda b: b[::2], "expanded": lambda b: b.expand(topo.nnz),
            "offset view": lambda b: b[3:]}[layout]
    weight = view(base)
    torch_sparse_metal.sparse_linear(x, weight, topo).pow(2).sum().backward()

    ref_base = base.detach().cpu().double().requires_grad_()
    w_ref = torch.zeros(7, 11, dtype=torch.float64).index_put(
        (topo.dst.long().cpu(), topo.src.long().cpu()), view(ref_base))
    (x.detach().cpu().double() @ w_ref.T).pow(2).sum().backward()
    tol = 1e-10 if x.dtype == torch.float64 else 1e-4
    torch.testing.assert_close(base.grad.cpu().double(), ref_base.grad, rtol=tol, atol=tol)
