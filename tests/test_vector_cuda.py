"""The CUDA kernels of the vector_csr_linear ops (csrc/cuda/vector_csr_linear_cuda.cu) against the float64 reference.

Every dtype x strategy x block V, on shapes that are not multiples of the kernels' tiles (the tensor-core tiles
are 128 batch rows, 32 or 64 sources, 16 lanes), with empty groups and sources, batches 0, 1, 7 and 129 (the
batch tile plus one), NaN poisoning of the outputs and of freed allocator blocks; atomic_free bitwise the same
across two runs; torch.library.opcheck; and the index attacks of tests/test_index_safety.py, for the arrays the
vector kernels read (clamped and reported in the device error words). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import poison_cuda_allocator, random_topology_with_empty_lines

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import CSRTopology, check_index_errors
from torch_sparse_metal.contract import INDEX_ARRAYS, INT32_MAX, TOPOLOGY_ARGS, VECTOR_BLOCKS
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import reference_vector_outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

OPS = torch.ops.torch_sparse_metal
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
STRATEGIES = axes.STRATEGIES
# (in_features, groups, density): one source and one group; tiles plus one; many groups of few sources; a group
# fan-in over the tensor-core kernels' 64-source chunks (300 x 0.6 = 180 sources a group).
# Widths that are whole 16-byte rows with groups of at most 32 sources on average (64, 264) take the staged forward,
# which copies batch tiles of x as they are.
SHAPES = ((1, 1, 1.0), (37, 5, 0.3), (129, 40, 0.1), (300, 3, 0.6), (257, 13, 0.25), (64, 40, 0.1), (264, 13, 0.1))
BATCHES = (0, 1, 7, 129)


def _inputs(in_features: int, groups: int, v: int, batch: int, topo: CSRTopology, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, in_features, generator=gen).to(dtype)
    w = torch.randn(topo.nnz, v, generator=gen).to(dtype)
    go = torch.randn(batch, groups * v, generator=gen).to(dtype)
    return x, w, go


def _one_wide_group(in_features: int, groups: int, wide: int, seed: int) -> CSRTopology:
    """Group 0 reads `wide` random sources, every other group 10."""
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randperm(in_features, generator=gen)[: wide if g == 0 else 10] for g in range(groups)]
    dst = [torch.full_like(s, g) for g, s in enumerate(src)]
    return CSRTopology.from_edges(torch.cat(src), torch.cat(dst), in_features, groups)


def _check_against_reference(topo: CSRTopology, x: torch.Tensor, w: torch.Tensor, go: torch.Tensor,
                             dtype: torch.dtype, poison: bool) -> None:
    """The forward and both strategies' gradients on CUDA within the dtype's bound of the float64 reference (each
    sum's terms: fan-in, a source's V lanes times the groups, the batch); ``poison``: the allocator's freed blocks
    are NaN before every call."""
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    terms = (topo.in_features, go.shape[1], x.shape[0])
    cuda = topo.to("cuda")
    xc, wc, gc = x.cuda(), w.cuda(), go.cuda()
    if poison:
        poison_cuda_allocator(dtype)
    y = OPS.csr_linear(xc, wc, *cuda.kernel_args(), "auto")
    axes.assert_within_bound("y", y, exact[0], magnitude[0], terms[0], dtype)
    for strategy in STRATEGIES:
        if poison:
            poison_cuda_allocator(dtype)
        gx, gw = OPS.csr_linear_backward(gc, xc, wc, *cuda.kernel_args(), strategy)
        axes.assert_within_bound(f"{strategy} grad_x", gx, exact[1], magnitude[1], terms[1], dtype)
        axes.assert_within_bound(f"{strategy} grad_w", gw, exact[2], magnitude[2], terms[2], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}@{s[2]}")
def test_matches_float64_reference(shape, v, batch, dtype):
    in_features, groups, density = shape
    topo = random_topology_with_empty_lines(in_features, groups, density, seed=in_features * 31 + groups + batch)
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=batch * 7 + v)
    _check_against_reference(topo, x, w, go, dtype, poison=True)
    check_index_errors("cuda")  # a valid topology leaves the error words clear


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
def test_large_layer_matches_reference(v, dtype):
    """A layer whose groups have a few hundred sources and whose batch spans several splits and tiles (the
    tensor-core kernels' pipelines run many stages; atomic_free's grad_w sums several partials)."""
    in_features, groups, batch = 1000, 24, 600
    topo = CSRTopology.random(in_features, groups, 0.3, generator=torch.Generator().manual_seed(v))
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=v)
    _check_against_reference(topo, x, w, go, dtype, poison=False)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize("batch", (9000, 17000))
def test_staged_forward_tiles_and_unread_non_finite_inputs(batch, v, dtype):
    """The staged forward at batches whose tiles are 32 and 64 rows on a GPU of up to 132 SMs (smaller ones take
    16), against the reference; the inputs no edge reads are infinite, which a kernel that multiplies a padding
    slot's zero weight by a staged value would turn into NaN."""
    in_features, groups = 64, 8
    topo = CSRTopology.random(in_features, groups, 0.1, generator=torch.Generator().manual_seed(batch + v))
    unread = torch.ones(in_features, dtype=torch.bool)
    unread[topo.src.long()] = False
    assert unread.any(), "the seeded topology reads every input"
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=v)
    exact = reference_vector_outputs(go, x, w, topo)  # with the unread inputs finite: a dense reference multiplies
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)  # them by zero
    x[:, unread] = float("inf")
    cuda = topo.to("cuda")
    poison_cuda_allocator(dtype)
    y = OPS.csr_linear(x.cuda(), w.cuda(), *cuda.kernel_args(), "auto")
    assert torch.isfinite(y).all()
    axes.assert_within_bound("y", y, exact[0], magnitude[0], in_features, dtype)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
def test_staged_forward_with_one_wide_group(v, dtype):
    """Groups of 10 sources and one of 100 (21 on average: the staged forward), so that one group's sources span
    several of the kernel's chunks of 32 and a chunk's last step is part-filled."""
    in_features, groups, batch = 128, 8, 300
    topo = _one_wide_group(in_features, groups, wide=100, seed=v)
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=v)
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    poison_cuda_allocator(dtype)
    y = OPS.csr_linear(x.cuda(), w.cuda(), *topo.to("cuda").kernel_args(), "auto")
    axes.assert_within_bound("y", y, exact[0], magnitude[0], in_features, dtype)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"{s[0]}x{s[1]}@{s[2]}")
def test_cuda_core_path_of_16_bit_values(shape, v, dtype, monkeypatch):
    """The kernels a GPU before sm_80 runs for 16-bit values (forced here by the switch), against the reference."""
    monkeypatch.setenv("TORCH_SPARSE_METAL_VECTOR_CUDA_CORES", "1")
    in_features, groups, density = shape
    batch = 129
    topo = random_topology_with_empty_lines(in_features, groups, density, seed=in_features + v)
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=v)
    _check_against_reference(topo, x, w, go, dtype, poison=True)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize("in_features", (1100, 2500, 4600))
def test_wide_layers_at_a_batch_of_no_whole_tile(in_features, v, dtype):
    """Wide layers of few groups (fan-in 22-92 a group) at a batch that is not a whole tile of 16 or 128 rows."""
    topo = random_topology_with_empty_lines(in_features, 7, 0.02, seed=in_features + v)
    x, w, go = _inputs(in_features, 7, v, 37, topo, dtype, seed=v)
    _check_against_reference(topo, x, w, go, dtype, poison=True)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize("vectors", (1000, 1800, 3000))
def test_tensor_core_grad_x_at_every_tile_of_contributions(vectors, v, dtype):
    """The tensor-core grad_x of both strategies keeps every vector's contribution to a batch tile in shared memory:
    tiles of 16 rows (1000 vectors), of 8 rows (1800), and the strategies' other kernels where two blocks of even
    that do not fit an SM (3000), at a batch that is no whole tile, with empty groups and sources."""
    in_features, groups = 1500, 40
    topo = random_topology_with_empty_lines(in_features, groups, vectors / (in_features * groups), seed=vectors + v)
    x, w, go = _inputs(in_features, groups, v, 45, topo, dtype, seed=v)
    _check_against_reference(topo, x, w, go, dtype, poison=True)


# (in_features, groups, density, batch) for the grad_w that reads batch tiles of x as they are (16-bit values,
# in_features a multiple of 8, groups of at most 32 sources on average, slots in at most two sets): tiles of 32 rows
# (64, 512, 1024 inputs) and of 16 (2048); one range or many (a batch of 5001 over an SM's share each); one set of
# groups or two (1024 x 40 at 3% and 512 x 64 at 5.8%, V = 16), and the other kernel where the slots take more
# sets (the same at V = 32) or two tiles of 16 rows do not fit in shared memory (4096).
TILES_SHAPES = ((64, 40, 0.1, 7), (1024, 40, 0.03, 5001), (2048, 24, 0.012, 300), (4096, 12, 0.006, 45),
                (512, 64, 0.058, 129))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize("shape", TILES_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}@{s[2]}n{s[3]}")
def test_grad_w_from_tiles_of_x(shape, v, dtype):
    """Both strategies' grad_w from batch tiles of x, with empty groups and sources; the inputs no vector reads are
    infinite, which a padding row of a slot (a vector past its group's end) reads and must not pass on."""
    in_features, groups, density, batch = shape
    topo = random_topology_with_empty_lines(in_features, groups, density, seed=in_features + groups + v)
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=v + batch)
    unread = torch.ones(in_features, dtype=torch.bool)
    unread[topo.src.long()] = False
    assert unread.any()
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    x[:, unread] = float("inf")
    cuda = topo.to("cuda")
    for strategy in STRATEGIES:
        poison_cuda_allocator(dtype)
        gx, gw = OPS.csr_linear_backward(go.cuda(), x.cuda(), w.cuda(), *cuda.kernel_args(), strategy)
        axes.assert_within_bound(f"{strategy} grad_x", gx, exact[1], magnitude[1], groups * v, dtype)
        axes.assert_within_bound(f"{strategy} grad_w", gw, exact[2], magnitude[2], batch, dtype)
    check_index_errors("cuda")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
def test_grad_w_from_tiles_of_x_with_one_wide_group(v, dtype):
    """One group of 300 sources beside groups of 10: its warp holds more slots than fit its registers, so the block
    walks its batch range again for them."""
    in_features, groups, batch = 512, 16, 200
    topo = _one_wide_group(in_features, groups, wide=300, seed=v)
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=v)
    _check_against_reference(topo, x, w, go, dtype, poison=True)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", VECTOR_BLOCKS)
@pytest.mark.parametrize(("in_features", "density"), ((700, 0.4), (704, 0.04)))  # 704: grad_w from tiles of x
def test_atomic_free_is_bitwise_deterministic(in_features, density, v, dtype):
    topo = CSRTopology.random(in_features, 9, density, generator=torch.Generator().manual_seed(3)).to("cuda")
    x, w, go = (t.cuda() for t in _inputs(in_features, 9, v, 300, topo, dtype, seed=11))
    first = OPS.csr_linear_backward(go, x, w, *topo.kernel_args(), "atomic_free")
    second = OPS.csr_linear_backward(go, x, w, *topo.kernel_args(), "atomic_free")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_unaligned_weight_and_grad_out(dtype):
    """Views whose data does not start on 16 bytes (the tensor-core kernels copy such operands first, and the
    staged forward leaves such an input to the other kernels)."""
    v, in_features, groups, batch = 16, 48, 6, 9
    topo = CSRTopology.random(in_features, groups, 0.5, generator=torch.Generator().manual_seed(5))
    x, w, go = _inputs(in_features, groups, v, batch, topo, dtype, seed=5)
    wbig = torch.zeros(topo.nnz * v + 1, dtype=dtype)
    wbig[1:] = w.flatten()
    gbig = torch.zeros(batch * groups * v + 1, dtype=dtype)
    gbig[1:] = go.flatten()
    xbig = torch.zeros(batch * in_features + 1, dtype=dtype)
    xbig[1:] = x.flatten()
    wv = wbig.cuda()[1:].view(topo.nnz, v)
    gv = gbig.cuda()[1:].view(batch, groups * v)
    xv = xbig.cuda()[1:].view(batch, in_features)
    exact = reference_vector_outputs(go, x, w, topo)
    magnitude = reference_vector_outputs(go.abs(), x.abs(), w.abs(), topo)
    cuda = topo.to("cuda")
    for xin in (x.cuda(), xv):
        y = OPS.csr_linear(xin, wv, *cuda.kernel_args(), "auto")
        axes.assert_within_bound("y", y, exact[0], magnitude[0], in_features, dtype)
    for strategy in STRATEGIES:
        gx, gw = OPS.csr_linear_backward(gv, xv, wv, *cuda.kernel_args(), strategy)
        axes.assert_within_bound(f"{strategy} grad_x", gx, exact[1], magnitude[1], groups * v, dtype)
        axes.assert_within_bound(f"{strategy} grad_w", gw, exact[2], magnitude[2], batch, dtype)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_opcheck(strategy):
    topo = CSRTopology.random(37, 5, 0.3, generator=torch.Generator().manual_seed(1)).to("cuda")
    x = torch.randn(11, 37, device="cuda")
    w = torch.randn(topo.nnz, 16, device="cuda")
    go = torch.randn(11, 5 * 16, device="cuda")
    torch.library.opcheck(OPS.csr_linear.default, (x, w, *topo.kernel_args(), strategy))
    torch.library.opcheck(OPS.csr_linear_backward.default, (go, x, w, *topo.kernel_args(), strategy))


# ------------------------------------------------------------------------------------------- index safety
def _args(v: int, dtype: torch.dtype, batch: int, in_features: int = 9) -> dict:
    gen = torch.Generator().manual_seed(0)
    topo = CSRTopology.random(in_features, 6, 0.4, generator=gen)
    a = {"x": torch.randn(batch, in_features, generator=gen).to(dtype),
         "w": torch.randn(topo.nnz, v, generator=gen).to(dtype),
         "go": torch.randn(batch, 6 * v, generator=gen).to(dtype),
         **{n: t.clone() for n, t in zip(TOPOLOGY_ARGS, topo.kernel_args())}}
    return {k: t.cuda() for k, t in a.items()}


def _set(name: str, index: int, value: int | str):
    """Sets a[name][index] to value; "in_features" names the layer's input count (the first source past it)."""
    def corrupt(a: dict) -> None:
        a[name][index] = a["x"].shape[1] if value == "in_features" else value
    return corrupt


# (id, corruption, the array whose error word it sets): the arrays each op reads (forward: col_ptr, src_by_dst,
# perm; backward: those, and row_ptr / dst in atomic_free's grad_x pass).
FORWARD = [
    ("col_ptr does not start at 0", _set("col_ptr", 0, 1), "col_ptr"),
    ("col_ptr decreases", _set("col_ptr", 2, -1), "col_ptr"),
    ("col_ptr ends past nnz", _set("col_ptr", -1, 10_000), "col_ptr"),
    ("col_ptr ends before nnz", _set("col_ptr", -1, 1), "col_ptr"),
    ("src_by_dst past in_features", _set("src_by_dst", 3, "in_features"), "src_by_dst"),
    ("src_by_dst negative", _set("src_by_dst", 0, -1), "src_by_dst"),
    ("src_by_dst far past", _set("src_by_dst", -1, INT32_MAX), "src_by_dst"),
    ("perm past nnz", _set("perm", 1, 1 << 20), "perm"),
    ("perm negative", _set("perm", -1, -INT32_MAX - 1), "perm"),
]
BACKWARD_BY_SOURCE = [
    ("row_ptr ends past nnz", _set("row_ptr", -1, 10_000), "row_ptr"),
    ("row_ptr decreases", _set("row_ptr", 3, -5), "row_ptr"),
    ("row_ptr does not start at 0", _set("row_ptr", 0, 2), "row_ptr"),
    ("dst past groups", _set("dst", 2, 6), "dst"),
    ("dst negative", _set("dst", 0, -3), "dst"),
]


def _flagged() -> set[str]:
    words = OPS.take_index_errors(torch.empty(0, device="cuda"))
    return {name for name, w in zip(INDEX_ARRAYS, words) if w}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("v", (8, 32))
@pytest.mark.parametrize(("name", "corrupt", "array"), FORWARD, ids=[c[0] for c in FORWARD])
def test_forward_guards_and_reports_bad_indices(name, corrupt, array, v, dtype):
    a = _args(v, dtype, batch=5)
    corrupt(a)
    _flagged()
    y = OPS.csr_linear(a["x"], a["w"], *(a[n] for n in TOPOLOGY_ARGS), "auto")
    assert torch.isfinite(y).all(), "every output element is written (poisoned outputs would show NaN)"
    assert _flagged() == {array}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("in_features", (9, 16))  # 16: 16-bit grad_w from batch tiles of x as they are
@pytest.mark.parametrize(("name", "corrupt", "array"), FORWARD + BACKWARD_BY_SOURCE,
                         ids=[c[0] for c in FORWARD + BACKWARD_BY_SOURCE])
def test_backward_guards_and_reports_bad_indices(name, corrupt, array, in_features, dtype, strategy):
    a = _args(16, dtype, batch=5, in_features=in_features)
    corrupt(a)
    _flagged()
    gx, _ = OPS.csr_linear_backward(a["go"], a["x"], a["w"], *(a[n] for n in TOPOLOGY_ARGS), strategy)
    assert torch.isfinite(gx).all()
    flagged = _flagged()
    # On CUDA cores (float32) fused_atomic reads the by-group arrays only, atomic_free both views; on tensor cores
    # (16-bit values) both strategies' grad_x finds a source's vectors by row_ptr alone and never reads dst.
    if dtype == torch.bfloat16:
        unread = {"fused_atomic": ("dst",), "atomic_free": ("dst",)}
    else:
        unread = {"fused_atomic": ("row_ptr", "dst"), "atomic_free": ()}
    if array in unread[strategy]:
        assert flagged == set()
    else:
        assert flagged == {array}


def test_check_index_errors_names_the_vector_array():
    a = _args(16, torch.float32, batch=3)
    check_index_errors("cuda")
    a["src_by_dst"][0] = 100
    OPS.csr_linear(a["x"], a["w"], *(a[n] for n in TOPOLOGY_ARGS), "auto")
    with pytest.raises(RuntimeError, match="out-of-range values of src_by_dst"):
        check_index_errors("cuda")
    check_index_errors("cuda")
