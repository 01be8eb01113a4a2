"""CPU kernels of the csr_linear ops against float64 dense math and torch.sparse; opcheck; gradcheck."""

import platform
import re
import sys
from pathlib import Path

import pytest
import torch

import torch_sparse_metal  # noqa: F401  (registers the ops)
from torch_sparse_metal.backends import cpu
from torch_sparse_metal.ops import csr_linear, csr_linear_backward
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import (
    random_topology,
    reference_backward,
    reference_forward,
    torch_sparse_forward,
)

STRATEGIES = axes.STRATEGIES
DTYPES = [torch.float32, torch.float64]  # the kernels' own types; 16-bit values are widened to float32 first
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10)}

# (in_features, out_features, density, batch): zero edges, full density, batch 0 and 1, sizes that are not
# multiples of the batch tile (16 floats, 8 doubles) or of any block, more tiles than threads, sources with
# edge counts that are not multiples of the 4-edge groups of the AVX2 kernels.
SHAPES = [
    (1, 1, 1.0, 1),
    (7, 5, 0.0, 3),
    (33, 17, 1.0, 0),
    (33, 17, 0.5, 1),
    (64, 48, 0.1, 31),
    (100, 61, 0.05, 33),
    (129, 257, 0.02, 70),
    (300, 200, 0.3, 97),
    (0, 9, 0.5, 4),
    (9, 0, 0.5, 4),
]


def _widest_kernel_set() -> str:
    """The set "native" must run on this machine, told from the machine rather than the extension: NEON on every
    AArch64 CPU; AVX2 on x86-64 Linux (where GCC, which the AVX2 file needs, builds the extension) when the CPU
    has AVX2 and FMA; the baseline set elsewhere."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    if sys.platform.startswith("linux") and machine in ("x86_64", "amd64"):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
        if {"avx2", "fma"} <= set(flags):
            return "avx2"
    return "generic"


@pytest.fixture(params=cpu.KERNEL_SETS, autouse=True)
def cpu_kernels(request):
    """Every test runs with the kernels this CPU picks (AVX2 + FMA where available, NEON on AArch64) and with the
    baseline ones, after checking that the kernel tables the ops call are that set."""
    with cpu.use_kernels(request.param):
        expected = _widest_kernel_set() if request.param == "native" else "generic"
        assert set(cpu.active_kernels().values()) == {expected}, cpu.active_kernels()
        yield request.param


def test_native_is_the_widest_kernel_set_of_this_machine(cpu_kernels):
    """On AArch64 the NEON kernels run, for every CPU dtype (16-bit ones through float32's), unless forced off."""
    expected = _widest_kernel_set() if cpu_kernels == "native" else "generic"
    assert cpu.active_kernels() == {dtype: expected for dtype in (torch.float32, torch.float64, torch.float16,
                                                                 torch.bfloat16)}


def _case(shape, dtype, seed, empty_rows=False):
    in_features, out_features, density, batch = shape
    topo = random_topology(in_features, out_features, density, seed, empty_rows=empty_rows)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, in_features, generator=g, dtype=dtype)
    w = torch.randn(topo.nnz, generator=g, dtype=dtype)
    grad_out = torch.randn(batch, out_features, generator=g, dtype=dtype)
    return topo, x, w, grad_out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("empty_rows", [False, True])
def test_forward_matches_dense_and_torch_sparse(shape, dtype, empty_rows):
    topo, x, w, _ = _case(shape, dtype, seed=sum(shape[:2]) + shape[3] + empty_rows, empty_rows=empty_rows)
    y = csr_linear(x, w, topo)
    assert y.shape == (shape[3], shape[1]) and y.dtype == dtype
    torch.testing.assert_close(y.double(), reference_forward(x, w, topo), **TOL[dtype])
    torch.testing.assert_close(y.double(), torch_sparse_forward(x, w, topo), **TOL[dtype])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("empty_rows", [False, True])
def test_backward_matches_dense(shape, dtype, strategy, empty_rows):
    seed = 7 * sum(shape[:2]) + shape[3] + len(strategy)
    topo, x, w, grad_out = _case(shape, dtype, seed=seed, empty_rows=empty_rows)
    grad_x, grad_w = csr_linear_backward(grad_out, x, w, topo, strategy)
    ref_x, ref_w = reference_backward(grad_out, x, w, topo)
    assert grad_x.shape == x.shape and grad_w.shape == w.shape
    torch.testing.assert_close(grad_x.double(), ref_x, **TOL[dtype])
    torch.testing.assert_close(grad_w.double(), ref_w, **TOL[dtype])


def _rows_of_every_length(rows: int, columns: int, seed: int) -> torch.Tensor:
    """A [rows, columns] mask whose row r has r % 12 entries at random columns (columns >= 11)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, columns, dtype=torch.bool)
    for r in range(rows):
        mask[r, torch.randperm(columns, generator=g)[: r % 12]] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("by", ["source", "destination"])
@pytest.mark.parametrize("batch", [1, 9, 17, 40])
def test_rows_of_every_edge_count(by, dtype, batch):
    """Rows with 0 to 11 edges: every remainder of the kernels' edge groups (the SpMM's and the weight-gradient
    dot products' pairs, the AVX2 kernels' 4-edge groups) in the backward's source rows ("source") or the forward's
    destination rows ("destination"), and batches on either side of a tile (8 doubles, 16 floats)."""
    seed = batch + len(by)
    if by == "source":
        topo = CSRTopology.from_mask(_rows_of_every_length(26, 13, seed).t().contiguous())
    else:
        topo = CSRTopology.from_mask(_rows_of_every_length(26, 13, seed))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, topo.in_features, generator=g, dtype=dtype)
    w = torch.randn(topo.nnz, generator=g, dtype=dtype)
    grad_out = torch.randn(batch, topo.out_features, generator=g, dtype=dtype)
    torch.testing.assert_close(csr_linear(x, w, topo).double(), reference_forward(x, w, topo), **TOL[dtype])
    ref_x, ref_w = reference_backward(grad_out, x, w, topo)
    for strategy in STRATEGIES:
        grad_x, grad_w = csr_linear_backward(grad_out, x, w, topo, strategy)
        torch.testing.assert_close(grad_x.double(), ref_x, **TOL[dtype])
        torch.testing.assert_close(grad_w.double(), ref_w, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_strategies_agree(dtype):
    topo, x, w, grad_out = _case((257, 129, 0.1, 130), dtype, seed=3)
    fused = csr_linear_backward(grad_out, x, w, topo, "fused_atomic")
    free = csr_linear_backward(grad_out, x, w, topo, "atomic_free")
    torch.testing.assert_close(fused[0], free[0], **TOL[dtype])
    torch.testing.assert_close(fused[1], free[1], **TOL[dtype])


def test_atomic_free_is_deterministic():
    topo, x, w, grad_out = _case((200, 150, 0.2, 300), torch.float32, seed=4)
    first = csr_linear_backward(grad_out, x, w, topo, "atomic_free")
    for _ in range(3):
        again = csr_linear_backward(grad_out, x, w, topo, "atomic_free")
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(6, 5, 0.5, 3), (11, 7, 0.3, 1), (8, 4, 1.0, 0), (5, 5, 0.0, 2)])
def test_gradcheck_float64(shape, strategy):
    topo, x, w, _ = _case(shape, torch.float64, seed=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: csr_linear(a, b, topo, strategy), (x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(20, 13, 0.3, 5), (33, 40, 0.1, 1), (10, 10, 0.0, 4), (12, 8, 0.5, 0)])
def test_opcheck(shape, dtype):
    topo, x, w, grad_out = _case(shape, dtype, seed=6)
    for strategy in ["auto", *STRATEGIES]:
        args = (x.clone().requires_grad_(True), w.clone().requires_grad_(True), *topo.kernel_args(), strategy)
        torch.library.opcheck(torch.ops.torch_sparse_metal.csr_linear.default, args)
    for strategy in STRATEGIES:
        args = (grad_out, x, w, *topo.kernel_args(), strategy)
        torch.library.opcheck(torch.ops.torch_sparse_metal.csr_linear_backward.default, args)


def test_op_rejects_bad_arguments():
    topo, x, w, grad_out = _case((10, 6, 0.5, 3), torch.float32, seed=7)
    op = torch.ops.torch_sparse_metal.csr_linear
    bwd = torch.ops.torch_sparse_metal.csr_linear_backward
    with pytest.raises(RuntimeError, match="int32"):
        op(x, w, topo.row_ptr.long(), *topo.kernel_args()[1:], "auto")
    with pytest.raises(RuntimeError, match="dtype"):
        op(x, w.double(), *topo.kernel_args(), "auto")
    with pytest.raises(RuntimeError, match="must be one of"):
        op(x.to(torch.float8_e5m2), w.to(torch.float8_e5m2), *topo.kernel_args(), "auto")
    # Formats integers: a build that links its own libstdc++ segfaulted here (docs/cuda.md, "Building").
    with pytest.raises(RuntimeError, match="row_ptr has 11 elements but x has in_features=5"):
        op(x[:, :5], w, *topo.kernel_args(), "auto")
    with pytest.raises(RuntimeError, match="2-D"):
        op(x[0], w, *topo.kernel_args(), "auto")
    with pytest.raises(RuntimeError, match="unknown backward strategy 'sideways'"):
        bwd(grad_out, x, w, *topo.kernel_args(), "sideways")
    with pytest.raises(RuntimeError, match=r"grad_out must be \[batch, out_features\] with batch=3"):
        bwd(grad_out[:2], x, w, *topo.kernel_args(), "atomic_free")


@pytest.mark.parametrize("device", ["cpu", "meta"])  # the C++ checks; the Python ones (fake kernels, Metal host)
@pytest.mark.parametrize("block", [1, 8])
@pytest.mark.parametrize("extra", [1, -1, 5])
def test_a_weight_of_another_length_than_the_topology_is_blamed(extra, block, device):
    """A topology whose arrays agree with each other and a weight with more or fewer connections: the message
    blames the weight and gives both sizes, for either layout, forward and backward."""
    topo = random_topology(12, 5, 0.5, seed=int(torch.randint(2**31, (1,))))
    args = [a.to(device) for a in topo.kernel_args()]
    n = topo.nnz + extra
    w = torch.randn(n, *((block,) if block > 1 else ()), device=device)
    x, grad_out = torch.randn(3, 12, device=device), torch.randn(3, 5 * block, device=device)
    held = "vectors" if block > 1 else "values"
    unit = "vectors" if block > 1 else "edges"
    shape = r"\[" + ", ".join(map(str, w.shape)) + r"\]" if device == "cpu" else re.escape(str(tuple(w.shape)))
    message = (f"weight has shape {shape}, {n} {held}, but the topology has {topo.nnz} {unit} "
               rf"\(dst, src, src_by_dst and perm have {topo.nnz} elements\)")
    with pytest.raises((RuntimeError, ValueError), match=message):
        torch.ops.torch_sparse_metal.csr_linear(x, w, *args, "auto")
    with pytest.raises((RuntimeError, ValueError), match=message):
        torch.ops.torch_sparse_metal.csr_linear_backward(grad_out, x, w, *args, "fused_atomic")


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("strategy", ["auto", "Fused_Atomic", "ATOMIC_FREE", "fused-atomic", ""])
def test_the_backward_op_refuses_a_strategy_listing_the_allowed_ones(strategy, device):
    topo = random_topology(8, 4, 0.5, seed=3)
    x, w, grad_out = torch.randn(2, 8), torch.randn(topo.nnz), torch.randn(2, 4)
    args = [t.to(device) for t in (grad_out, x, w, *topo.kernel_args())]
    allowed = ", ".join(repr(s) for s in STRATEGIES)
    with pytest.raises((RuntimeError, ValueError), match=re.escape(
            f"unknown backward strategy {strategy!r}; expected one of {allowed}, lower case")):
        torch.ops.torch_sparse_metal.csr_linear_backward(*args, strategy)


@pytest.mark.parametrize("device", ["cpu", "meta"])  # the C++ forward's check; the Python one (fake kernel, Metal)
@pytest.mark.parametrize("grad", ["none", "weight", "inference_mode"])
@pytest.mark.parametrize("backward", ["sideways", "Auto", "FUSED_ATOMIC", "fused-atomic", ""])
def test_the_forward_op_refuses_a_backward_no_strategy_has_with_or_without_gradients(backward, grad, device):
    """The forward kernels do not read ``backward``; a value that names no strategy is refused all the same,
    before anything runs, whether or not a gradient (and so the autograd rule, which reads it) is ever involved."""
    topo = random_topology(8, 4, 0.5, seed=int(torch.randint(2**31, (1,))))
    x, w = torch.randn(2, 8, device=device), torch.randn(topo.nnz, device=device, requires_grad=grad == "weight")
    args = [t.to(device) for t in topo.kernel_args()]
    allowed = ", ".join(repr(s) for s in STRATEGIES)
    message = re.escape(f"unknown backward strategy {backward!r}; expected 'auto' or one of {allowed}, lower case")
    with pytest.raises((RuntimeError, ValueError), match=message):
        if grad == "inference_mode":  # no autograd key at all: the kernel itself refuses
            with torch.inference_mode():
                torch.ops.torch_sparse_metal.csr_linear(x, w, *args, backward)
        else:
            torch.ops.torch_sparse_metal.csr_linear(x, w, *args, backward)


@pytest.mark.parametrize("backward", ["auto", *STRATEGIES])
def test_the_forward_op_takes_every_strategy_and_auto_without_gradients(backward):
    """Every value the check allows runs, and gives the float64 dense product (the kernels ignore it)."""
    topo = random_topology(8, 4, 0.5, seed=int(torch.randint(2**31, (1,))))
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(topo.nnz, dtype=torch.float64)
    dense = torch.zeros(4, 8, dtype=torch.float64).index_put_((topo.dst.long(), topo.src.long()), w)
    y = torch.ops.torch_sparse_metal.csr_linear(x, w, *topo.kernel_args(), backward)
    torch.testing.assert_close(y, x @ dense.T)


# --------------------------------------------------------------------- the two orders of a topology agree
# The forward walks outputs (col_ptr, src_by_dst, perm), the backward sources (row_ptr, dst): the CPU ops refuse
# arrays whose two orders describe different edges (csr_linear_checks.cpp, check_topology_cpu), which would make
# the gradients silently not those of the forward. Each case corrupts a valid random topology so that every
# index stays in range; the expected message is computed from the corruption itself.
def _corrupt(kind: str, args: list, g: torch.Generator) -> str:
    row_ptr, dst, src, col_ptr, src_by_dst, perm = args
    nnz, n_out = perm.numel(), col_ptr.numel() - 1
    pick = lambda n: int(torch.randint(n, (), generator=g))  # noqa: E731
    if kind == "perm repeats an edge":
        a, b = sorted(torch.randperm(nnz, generator=g)[:2].tolist())
        if pick(2):
            perm[b] = perm[a]
        else:
            perm[a] = perm[b]
        return rf"perm is not a permutation of the {nnz} edges: perm\[{a}\] and perm\[{b}\] are both {int(perm[a])}"
    fan_in = (col_ptr[1:] - col_ptr[:-1]).tolist()
    if kind == "perm swaps edges of two outputs":  # a permutation still, but the edges go to other outputs
        o1, o2 = sorted(o for o in torch.randperm(n_out, generator=g).tolist() if fan_in[o])[:2]
        k1, k2 = int(col_ptr[o1]) + pick(fan_in[o1]), int(col_ptr[o2]) + pick(fan_in[o2])
        perm[k1], perm[k2] = perm[k2].clone(), perm[k1].clone()
        return rf"perm\[{k1}\] = {int(perm[k1])} puts edge {int(perm[k1])} among the edges into output {o1} " \
               rf"\(col_ptr\), but dst\[{int(perm[k1])}\] = {o2}"
    if kind == "src_by_dst names another input":
        k = pick(nnz)
        n_in = row_ptr.numel() - 1
        q = (int(src_by_dst[k]) + 1 + pick(n_in - 1)) % n_in
        src_by_dst[k] = q
        e = int(perm[k])
        return rf"src_by_dst\[{k}\] = {q} says edge perm\[{k}\] = {e} comes from input {q}, but row_ptr puts edges " \
               rf"{int(row_ptr[q])} \.\. {int(row_ptr[q + 1]) - 1} there"
    # an output lists two of its edges in the other order (perm and src_by_dst together: the same edges)
    o = next(o for o in torch.randperm(n_out, generator=g).tolist() if fan_in[o] > 1)
    k = int(col_ptr[o]) + pick(fan_in[o] - 1)
    for t in (perm, src_by_dst):
        t[k], t[k + 1] = t[k + 1].clone(), t[k].clone()
    return rf"output {o} lists source {int(src_by_dst[k + 1])} \(src_by_dst\[{k + 1}\]\) after source " \
           rf"{int(src_by_dst[k])}; each output lists its edges by increasing source"


AGREEMENT = ["perm repeats an edge", "perm swaps edges of two outputs", "src_by_dst names another input",
             "an output lists its sources out of order"]


@pytest.mark.parametrize("kind", AGREEMENT)
def test_every_cpu_op_refuses_orders_that_disagree(kind):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    topo = CSRTopology.random(int(torch.randint(6, 40, (), generator=g)), int(torch.randint(3, 20, (), generator=g)),
                              0.4, generator=g)
    args = [t.clone() for t in topo.kernel_args()]
    message = _corrupt(kind, args, g)
    x, w, grad_out = (torch.randn(5, topo.in_features, generator=g), torch.randn(topo.nnz, generator=g),
                      torch.randn(5, topo.out_features, generator=g))
    inputs = [t.clone() for t in (x, w, grad_out, *args)]
    ops = torch.ops.torch_sparse_metal
    calls = [lambda: ops.csr_linear(x, w, *args, "auto")]
    calls += [lambda s=s: ops.csr_linear_backward(grad_out, x, w, *args, s) for s in STRATEGIES]
    for call in calls:
        with pytest.raises(RuntimeError, match=message):
            call()
    assert all(torch.equal(a, b) for a, b in zip(inputs, (x, w, grad_out, *args)))  # nothing was written
    ops.csr_linear(x, w, *topo.kernel_args(), "auto")  # the valid arrays pass


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("kind", AGREEMENT)
def test_the_vector_ops_refuse_orders_that_disagree_through_the_same_check(kind, block):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    topo = CSRTopology.random(int(torch.randint(6, 30, (), generator=g)), block * int(torch.randint(3, 9, (),
                              generator=g)), 0.4, block=block, generator=g)
    args = [t.clone() for t in topo.vectors.kernel_args()]  # the arrays over vectors: edges = vectors
    message = _corrupt(kind, args, g)
    x, w = torch.randn(3, topo.in_features, generator=g), torch.randn(topo.vectors.nnz, block, generator=g)
    grad_out = torch.randn(3, topo.out_features, generator=g)
    ops = torch.ops.torch_sparse_metal
    with pytest.raises(RuntimeError, match=message):
        ops.csr_linear(x, w, *args, "auto")
    for strategy in STRATEGIES:
        with pytest.raises(RuntimeError, match=message):
            ops.csr_linear_backward(grad_out, x, w, *args, strategy)


def test_a_consistent_hand_built_topology_still_runs_and_matches_the_reference():
    """The check costs valid arrays nothing but time: every builder's arrays pass, empty rows and outputs too."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    mask = torch.rand(13, 21, generator=g) < 0.3
    mask[3] = False
    mask[:, 5] = False
    topo = CSRTopology.from_mask(mask)
    x, w, grad_out = torch.randn(4, 21, generator=g), torch.randn(topo.nnz, generator=g), torch.randn(4, 13)
    dense = torch.zeros(13, 21)
    dense[mask] = w[topo.perm.long()]  # perm lists the edges by (output, input): the mask's order
    torch.testing.assert_close(csr_linear(x, w, topo), x @ dense.t())
    for strategy in STRATEGIES:
        gx, gw = csr_linear_backward(grad_out, x, w, topo, strategy)
        torch.testing.assert_close(gx, grad_out @ dense, **TOL[torch.float32])
        torch.testing.assert_close(gw, (grad_out.t() @ x)[topo.dst.long(), topo.src.long()], **TOL[torch.float32])
