"""The csr_linear ops in the vector layout (a weight [vectors, V]) on every device with kernels for them (the CPU with
each of its kernel sets; CUDA and MPS where present and registered), against the float64 reference
``reference_vector_outputs`` within each dtype's error bound (``testing.axes.error_bound``). Outputs start as NaN
(TORCH_SPARSE_METAL_POISON=1, tests/conftest.py), so an element a kernel never writes fails. Also: opcheck, gradcheck
and gradgradcheck through the registered autograd rule, bitwise determinism, and the errors bad arguments raise before
any kernel runs."""

from __future__ import annotations

import contextlib

import pytest
import torch

import torch_sparse_metal  # noqa: F401  (registers the ops)
from torch_sparse_metal.backends import cpu
from torch_sparse_metal.contract import DTYPES, VECTOR_BLOCKS
from torch_sparse_metal.strategy import deterministic
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import reference_vector_outputs

OPS = torch.ops.torch_sparse_metal
FORWARD = "torch_sparse_metal::csr_linear"
STRATEGIES = axes.STRATEGIES


def _has_kernels(device: str) -> bool:
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, device.upper())
               for op in (FORWARD, "torch_sparse_metal::csr_linear_backward"))


# (device, CPU kernel set): the CPU runs each of its sets; a device without kernels for the ops yet is skipped.
TARGETS = [("cpu", k) for k in cpu.KERNEL_SETS] + [(d, None) for d in axes.DEVICES if d != "cpu"]
TARGET_IDS = [d if k is None else f"{d}-{k}" for d, k in TARGETS]


@pytest.fixture(params=TARGETS, ids=TARGET_IDS)
def device(request):
    """The device a test runs on, under its CPU kernel set."""
    name, kernels = request.param
    if not _has_kernels(name):
        pytest.skip(f"no csr_linear kernels registered for {name}")
    with cpu.use_kernels(kernels) if kernels else contextlib.nullcontext():
        yield name


# (in_features, groups, density, batch, empty): sizes that are multiples of no tile or register block, batch 0,
# 1, 7 and 129, full and zero density, and (empty=True) a third of the sources and of the groups with no vector.
SHAPES = [(1, 1, 1.0, 1, False), (7, 3, 0.0, 7, False), (37, 5, 0.4, 0, True), (64, 1, 1.0, 7, False),
          (129, 40, 0.1, 129, True), (300, 17, 0.05, 33, True), (250, 9, 0.5, 1, True)]
SHAPE_IDS = [f"{i}x{g}-d{d}-b{b}{'-empty' if e else ''}" for i, g, d, b, e in SHAPES]


def _groups(in_features: int, groups: int, density: float, seed: int, empty: bool = False) -> CSRTopology:
    """A topology over vectors (in_features -> groups) from a random [groups, in_features] mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(groups, in_features, generator=g) < density
    if empty:
        mask[:, torch.randperm(in_features, generator=g)[: in_features // 3]] = False
        mask[torch.randperm(groups, generator=g)[: groups // 3]] = False
    return CSRTopology.from_mask(mask)


def _case(in_features, groups, density, batch, block, dtype, seed, empty=False):
    topo = _groups(in_features, groups, density, seed, empty)
    g = torch.Generator().manual_seed(seed + 1)
    x, w, go = (torch.randn(*s, generator=g).to(dtype)
                for s in ((batch, in_features), (topo.nnz, block), (batch, groups * block)))
    return topo, x, w, go


def _fan(ptr: torch.Tensor) -> int:
    return int((ptr[1:] - ptr[:-1]).max()) if ptr.numel() > 1 else 0


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("dtype", tuple(DTYPES), ids=lambda t: str(t).removeprefix("torch."))
def test_ops_within_bound(device, dtype, block, shape):
    """y, and grad_x and grad_w of each strategy, within the dtype's bound of the float64 reference."""
    if dtype not in axes.dtypes(device):
        pytest.skip(f"{dtype} has no kernels on {device}")
    in_features, groups, density, batch, empty = shape
    topo, x, w, go = _case(in_features, groups, density, batch, block, dtype, seed=in_features + block + batch,
                           empty=empty)
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    args = topo.to(device).kernel_args()
    xd, wd, god = x.to(device), w.to(device), go.to(device)
    y = OPS.csr_linear(xd, wd, *args, "auto")
    assert y.dtype == dtype and y.device.type == device
    axes.assert_within_bound("y", y, exact[0], magnitude[0], _fan(topo.col_ptr), dtype)
    for strategy in STRATEGIES:
        grad_x, grad_w = OPS.csr_linear_backward(god, xd, wd, *args, strategy)
        assert grad_x.dtype == grad_w.dtype == dtype
        axes.assert_within_bound(f"grad_x {strategy}", grad_x, exact[1], magnitude[1], _fan(topo.row_ptr) * block,
                                 dtype)
        axes.assert_within_bound(f"grad_w {strategy}", grad_w, exact[2], magnitude[2], batch, dtype)


def _by_source_fan_out(in_features: int, groups: int, seed: int) -> CSRTopology:
    """Source s has s % 11 vectors, so every remainder of the register blocks (8 vectors or rows and fewer) shows
    in the by-source walks, and a group's fan-in varies as much."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(groups, in_features, dtype=torch.bool)
    for s in range(in_features):
        mask[torch.randperm(groups, generator=g)[: s % 11], s] = True
    return CSRTopology.from_mask(mask)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("batch", [1, 9, 17, 70])
def test_every_fan_out_and_batch_remainder(device, block, batch):
    topo = _by_source_fan_out(23, 12, seed=batch + block)
    g = torch.Generator().manual_seed(batch)
    x, w, go = (torch.randn(*s, generator=g, dtype=torch.float32)
                for s in ((batch, 23), (topo.nnz, block), (batch, 12 * block)))
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    args = topo.to(device).kernel_args()
    xd, wd, god = x.to(device), w.to(device), go.to(device)
    axes.assert_within_bound("y", OPS.csr_linear(xd, wd, *args, "auto"), exact[0], magnitude[0],
                             _fan(topo.col_ptr), torch.float32)
    for strategy in STRATEGIES:
        grad_x, grad_w = OPS.csr_linear_backward(god, xd, wd, *args, strategy)
        axes.assert_within_bound("grad_x", grad_x, exact[1], magnitude[1], _fan(topo.row_ptr) * block,
                                 torch.float32)
        axes.assert_within_bound("grad_w", grad_w, exact[2], magnitude[2], batch, torch.float32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_backward_is_bitwise_deterministic_where_declared(device, strategy):
    """atomic_free always; fused_atomic where strategy.deterministic says so (the CPU with <= 2 threads)."""
    topo, x, w, go = _case(200, 30, 0.2, 300, 16, torch.float32, seed=4)
    args = topo.to(device).kernel_args()
    xd, wd, god = x.to(device), w.to(device), go.to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    try:
        if not deterministic(strategy, torch.device(device)):
            pytest.skip(f"{strategy} is not declared deterministic on {device}")
        first = OPS.csr_linear_backward(god, xd, wd, *args, strategy)
        for _ in range(3):
            again = OPS.csr_linear_backward(god, xd, wd, *args, strategy)
            assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_any_thread_count(device, threads):
    """fused_atomic splits the batch into one chunk per thread, whose weight-gradient shares meet in atomic adds;
    more chunks than cores (and one) must give the same sums."""
    topo, x, w, go = _case(90, 11, 0.3, 131, 8, torch.float32, seed=threads)
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    args = topo.to(device).kernel_args()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for strategy in STRATEGIES:
            grad_x, grad_w = OPS.csr_linear_backward(go.to(device), x.to(device), w.to(device), *args, strategy)
            axes.assert_within_bound("grad_x", grad_x, exact[1], magnitude[1], _fan(topo.row_ptr) * 8, torch.float32)
            axes.assert_within_bound("grad_w", grad_w, exact[2], magnitude[2], 131, torch.float32)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("shape", [(20, 3, 0.3, 5), (9, 2, 1.0, 1), (10, 4, 0.0, 3), (12, 2, 0.5, 0)])
def test_opcheck(device, shape, block):
    if torch.float32 not in axes.dtypes(device):
        pytest.skip("float32 only")
    topo, x, w, go = _case(*shape, block, torch.float32, seed=6)
    args = topo.to(device).kernel_args()
    x, w, go = x.to(device), w.to(device), go.to(device)
    for strategy in ["auto", *STRATEGIES]:
        torch.library.opcheck(OPS.csr_linear.default,
                              (x.clone().requires_grad_(True), w.clone().requires_grad_(True), *args, strategy))
    for strategy in STRATEGIES:
        torch.library.opcheck(OPS.csr_linear_backward.default, (go, x, w, *args, strategy))


def _float64_inputs(device, block, shape, seed):
    if torch.float64 not in axes.dtypes(device):
        pytest.skip(f"no float64 kernels on {device}")
    topo, x, w, _ = _case(*shape, block, torch.float64, seed=seed)
    args = topo.to(device).kernel_args()
    return args, x.to(device).requires_grad_(True), w.to(device).requires_grad_(True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("shape", [(6, 2, 0.5, 3), (11, 3, 0.3, 1), (5, 1, 1.0, 0)])
def test_gradcheck_through_the_registered_rule(device, shape, block, strategy):
    args, x, w = _float64_inputs(device, block, shape, seed=5)
    assert torch.autograd.gradcheck(lambda a, b: OPS.csr_linear(a, b, *args, strategy), (x, w))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("block", [8, 32])
def test_gradgradcheck_create_graph(device, block, strategy):
    """Second derivatives: under create_graph the rule builds the gradients from differentiable ops."""
    args, x, w = _float64_inputs(device, block, (7, 2, 0.5, 3), seed=8)
    assert torch.autograd.gradgradcheck(lambda a, b: OPS.csr_linear(a, b, *args, strategy), (x, w))


# ------------------------------------------------------------------------------------------------- bad input
def _small(device):
    topo, x, w, go = _case(10, 3, 0.5, 4, 8, torch.float32, seed=7)
    return topo.to(device).kernel_args(), x.to(device), w.to(device), go.to(device)


def test_bad_shapes_and_dtypes_raise_before_any_kernel(device):
    args, x, w, go = _small(device)
    fwd, bwd = OPS.csr_linear, OPS.csr_linear_backward
    n, values = w.shape[0], w.numel()
    with pytest.raises((RuntimeError, ValueError),  # the unstructured layout: one edge a value
                       match=f"weight has shape .{values}.*, {values} values, but the topology has {n} "):
        fwd(x, w.reshape(-1), *args, "auto")
    with pytest.raises((RuntimeError, ValueError), match="V one of"):
        fwd(x, torch.zeros(w.shape[0], 7, device=device), *args, "auto")
    with pytest.raises((RuntimeError, ValueError), match=f"weight has shape .{n - 1}, .*{n - 1} vectors, but the "
                                                         f"topology has {n} vectors"):
        fwd(x, w[:-1], *args, "auto")  # one vector fewer than the index arrays hold
    with pytest.raises((RuntimeError, TypeError), match="int32"):
        fwd(x, w, args[0].long(), *args[1:], "auto")
    with pytest.raises((RuntimeError, TypeError), match="dtype"):
        fwd(x, w.double(), *args, "auto")
    with pytest.raises((RuntimeError, ValueError), match="row_ptr"):
        fwd(x[:, :5].contiguous(), w, *args, "auto")
    with pytest.raises((RuntimeError, ValueError), match="grad_out"):
        bwd(go[:, :-1].contiguous(), x, w, *args, "atomic_free")
    with pytest.raises((RuntimeError, ValueError), match="grad_out"):
        bwd(go[:2], x, w, *args, "fused_atomic")
    with pytest.raises((RuntimeError, ValueError), match="sideways"):
        bwd(go, x, w, *args, "sideways")


@pytest.mark.parametrize(("array", "position", "value", "message"), [
    (5, 0, 1000, r"perm\[0\] = 1000 is outside \[0, nnz"),
    (4, 1, 10, r"src_by_dst\[1\] = 10 is outside \[0, in_features = 10\)"),
    (4, 0, -1, r"src_by_dst\[0\] = -1"),
    (3, -1, 0, r"col_ptr is not a CSR pointer array"),
    (1, 0, 3, r"dst\[0\] = 3 is outside \[0, out_features = 3\)"),
    (0, -1, 1, r"row_ptr is not a CSR pointer array"),
])
def test_out_of_range_index_values_raise_on_the_cpu(array, position, value, message):
    """The CPU reads the index values before any kernel (check_topology_values_cpu over the vectors' arrays)."""
    args, x, w, go = _small("cpu")
    bad = list(args)
    bad[array] = args[array].clone()
    bad[array][position] = value
    op = "backward" if array in (0, 1) else "forward"
    with pytest.raises(RuntimeError, match=message):
        if op == "forward":
            OPS.csr_linear(x, w, *bad, "auto")
        else:
            OPS.csr_linear_backward(go, x, w, *bad, "fused_atomic")
    if array in (3, 4, 5):  # atomic_free's weight gradient walks the groups: it checks the by-group arrays too
        with pytest.raises(RuntimeError, match=message):
            OPS.csr_linear_backward(go, x, w, *bad, "atomic_free")
