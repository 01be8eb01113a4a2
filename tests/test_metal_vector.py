"""The vector layout's Metal kernels (shaders/vector_csr_linear.metal), run by the real MPS host code
(backends/mps_vector_csr_linear.py, and through backends/mps.py's host, which sends it the vector layout) under the
MSL-on-CPU executor (and on the CUDA translation where an NVIDIA GPU and nvcc exist), against the float64 reference:
every instantiation (float, half, bfloat; V = 8, 16, 32; the forward and both strategies), sizes that are no multiple of
any tile (8 vectors, 8 or 32 batch rows, R sources), empty groups and sources, zero vectors, batch 0, 1, 7, 33 and 65,
NaN-poisoned outputs, bad index values (the error words of the array read), determinism; and the executor's emulation of
SIMD-group matrices itself, against torch's matmul, with the checks it makes (full SIMD-group, uniform arguments, races,
bounds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _helpers import max_terms, metal_compiler

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import CSRTopology
from torch_sparse_metal.backends import mps
from torch_sparse_metal.backends import mps_vector_csr_linear as host_module
from torch_sparse_metal.backends.metal_contract import KERNEL_DTYPES
from torch_sparse_metal.backends.metal_source import load_source
from torch_sparse_metal.backends.mps_vector_csr_linear import SHADER_FILES, MetalVectorCsrLinear
from torch_sparse_metal.contract import INDEX_ARRAYS, TOPOLOGY_ARGS, VECTOR_BLOCKS
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import reference_vector_outputs
from tsm_dev.msl import EXECUTED, MslError, compile_shader, kernel_names
from tsm_dev.msl import cuda as cuda_translation
from tsm_dev.msl.clang_check import check_source, clang_path
from tsm_dev.msl.source import METAL_LANGUAGE_VERSIONS

SHADERS = Path(__file__).resolve().parents[1] / "shaders"
DTYPES = list(KERNEL_DTYPES)
STRATEGIES = axes.STRATEGIES
#: (in_features, groups, density, batch). The forward's threadgroup holds 8R batch rows (R <= 8 SIMD-groups, fewer
#: for a small batch), the by-source kernels 32 rows and R sources, grad_w's steps 32 rows and tiles of 8 vectors:
#: none of these sizes is a multiple of them; make_topology empties a group and a source.
CASES = [
    (1, 1, 1.0, 1),        # one vector
    (37, 5, 0.3, 33),      # two batch chunks of 32 (the second of one row), partial tiles of vectors
    (100, 12, 0.2, 7),     # 13 R-source threadgroups, 7 rows: one SIMD-group in the forward
    (23, 9, 0.6, 65),      # two forward threadgroups along the batch, three chunks of 32, grad_w's steps cut
    (40, 3, 0.9, 1),       # groups of 30+ vectors: several rounds of grad_w tiles
    (64, 7, 0.0, 7),       # zero vectors
    (19, 4, 0.5, 0),       # batch 0
]
IDS = [f"in{a}-g{b}-d{c}-N{d}" for a, b, c, d in CASES]


def make_topology(n_in: int, groups: int, density: float, seed: int) -> CSRTopology:
    """A random topology over vectors with an empty source (input 1) and an empty group (group 0)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(groups, n_in, generator=g) < density
    if n_in > 2 and groups > 1 and density > 0:
        mask[:, 1] = False
        mask[0, :] = False
    return CSRTopology.from_mask(mask)


def _host(target: str = "executor", log: list | None = None, **compile_kwargs) -> MetalVectorCsrLinear:
    compile_fn, device_type = metal_compiler(target, log, **compile_kwargs)
    return MetalVectorCsrLinear(compile_fn, device_type=device_type, poison=True)


@pytest.fixture(scope="module", params=["executor", "cuda"])
def target(request) -> str:
    return request.param


def _inputs(topo: CSRTopology, block: int, batch: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, topo.in_features, generator=g).to(device, dtype)
    w = torch.randn(topo.nnz, block, generator=g).to(device, dtype)
    go = torch.randn(batch, topo.out_features * block, generator=g).to(device, dtype)
    return x, w, go


def _references(go, x, w, topo):
    """(exact, magnitude) pairs of (y, grad_x, grad_w): the float64 results and those of the absolute values."""
    exact = reference_vector_outputs(go.cpu(), x.cpu(), w.cpu(), topo)
    magnitude = reference_vector_outputs(go.cpu().abs(), x.cpu().abs(), w.cpu().abs(), topo)
    return list(zip(exact, magnitude))


# ------------------------------------------------------------------------------------------ the ops vs float64
@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_float64(target, case, dtype, block):
    n_in, groups, density, batch = case
    log: list = []
    metal = _host(target, log=log if target == "executor" else None)
    dev = metal.device_type
    topo = make_topology(n_in, groups, density, seed=n_in + groups + batch)
    x, w, _ = _inputs(topo, block, batch, dtype, dev, seed=batch + block)
    y = metal.forward(x, w, *topo.to(dev).kernel_args())
    assert y.shape == (batch, groups * block) and y.dtype == dtype
    (ey, my), _, _ = _references(torch.zeros(batch, groups * block, dtype=dtype), x, w, topo)
    axes.assert_within_bound("forward", y, ey, my, max_terms(topo.col_ptr), dtype)
    if target == "executor" and batch and topo.nnz:
        assert [c[0] for c in log] == [f"vector_spmm_v{block}_{KERNEL_DTYPES[dtype]}"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_float64(target, case, dtype, block, strategy):
    n_in, groups, density, batch = case
    log: list = []
    metal = _host(target, log=log if target == "executor" else None)
    dev = metal.device_type
    topo = make_topology(n_in, groups, density, seed=n_in * groups + batch)
    x, w, go = _inputs(topo, block, batch, dtype, dev, seed=batch * block)
    grad_x, grad_w = metal.backward(go, x, w, *topo.to(dev).kernel_args(), strategy)
    assert grad_x.shape == x.shape and grad_w.shape == w.shape and grad_x.dtype == grad_w.dtype == dtype
    _, (ex, mx), (ew, mw) = _references(go, x, w, topo)
    axes.assert_within_bound("grad_x", grad_x, ex, mx, max_terms(topo.row_ptr) * block, dtype)
    axes.assert_within_bound("grad_w", grad_w, ew, mw, batch, dtype)
    if target == "executor" and batch and topo.nnz:
        suffix = f"v{block}_{KERNEL_DTYPES[dtype]}"
        want = [f"vector_spmm_sddmm_atomic_{suffix}"] if strategy == "fused_atomic" else \
            [f"vector_sddmm_{suffix}", f"vector_spmm_t_{suffix}"]
        assert [c[0] for c in log] == want


def test_larger_layer_matches_float64(target):
    """More than one round of everything at once: 200 inputs, 20 groups of 16, batch 100, float32."""
    metal = _host(target)
    dev = metal.device_type
    topo = make_topology(200, 20, 0.15, seed=9)
    x, w, go = _inputs(topo, 16, 100, torch.float32, dev, seed=9)
    y = metal.forward(x, w, *topo.to(dev).kernel_args())
    (ey, my), (ex, mx), (ew, mw) = _references(go, x, w, topo)
    axes.assert_within_bound("forward", y, ey, my, max_terms(topo.col_ptr), torch.float32)
    for strategy in STRATEGIES:
        grad_x, grad_w = metal.backward(go, x, w, *topo.to(dev).kernel_args(), strategy)
        axes.assert_within_bound("grad_x", grad_x, ex, mx, max_terms(topo.row_ptr) * 16, torch.float32)
        axes.assert_within_bound("grad_w", grad_w, ew, mw, 100, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_agrees_with_the_cpu_kernels(dtype):
    """A second backend: the CPU op's results (csrc/cpu) and the Metal kernels' are both within the contract's bound
    of float64, so they differ by at most the two bounds."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("torch_sparse_metal::csr_linear", "CPU"):
        pytest.skip("the extension was built without the vector CPU kernels")
    metal, ops = _host(), torch.ops.torch_sparse_metal
    topo = make_topology(70, 6, 0.3, seed=6)
    x, w, go = _inputs(topo, 16, 41, dtype, "cpu", seed=6)
    args = topo.kernel_args()
    (ey, my), (ex, mx), (ew, mw) = _references(go, x, w, topo)
    terms = {"y": max_terms(topo.col_ptr), "grad_x": max_terms(topo.row_ptr) * 16, "grad_w": 41}
    got = {"y": (metal.forward(x, w, *args), ops.csr_linear(x, w, *args, "auto"), ey, my)}
    for strategy in STRATEGIES:
        (gx, gw), (cx, cw) = metal.backward(go, x, w, *args, strategy), ops.csr_linear_backward(
            go, x, w, *args, strategy)
        got[f"grad_x {strategy}"] = (gx, cx, ex, mx)
        got[f"grad_w {strategy}"] = (gw, cw, ew, mw)
    for what, (mine, cpu, exact, magnitude) in got.items():
        bound = 2 * axes.error_bound(dtype, terms[what.split()[0]], magnitude, exact)
        assert ((mine.double() - cpu.double()).abs() <= bound).all(), what


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_deterministic_paths_repeat_bit_for_bit(block):
    """The forward, every grad_x and atomic_free's grad_w sum in a fixed order: two runs (lanes and threadgroups in
    another shuffled order each dispatch) give the same bits; so does fused_atomic's grad_w for a batch of one
    32-row chunk (one atomic per element onto zero)."""
    metal = _host()
    topo = make_topology(45, 6, 0.4, seed=block)
    x, w, go = _inputs(topo, block, 50, torch.float32, "cpu", seed=1)
    args = topo.kernel_args()
    assert torch.equal(metal.forward(x, w, *args), metal.forward(x, w, *args))
    a1, a2 = (metal.backward(go, x, w, *args, "atomic_free") for _ in range(2))
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])
    f1, f2 = (metal.backward(go, x, w, *args, "fused_atomic") for _ in range(2))
    assert torch.equal(f1[0], f2[0]) and torch.equal(f1[0], a1[0])  # grad_x: the same walk in both strategies
    s1, s2 = (metal.backward(go[:30], x[:30], w, *args, "fused_atomic") for _ in range(2))
    assert torch.equal(s1[1], s2[1])


def test_inputs_at_a_storage_offset():
    """Tensors bind their data pointer (storage offset included), as compile_shader binds them."""
    metal = _host()
    topo = make_topology(30, 5, 0.4, seed=3)
    x0, w0, go0 = _inputs(topo, 8, 11, torch.float32, "cpu", seed=3)
    x, w, go = (torch.cat([torch.zeros(3, t.shape[1]), t])[3:] for t in (x0, w0, go0))
    assert x.storage_offset() and w.storage_offset() and go.storage_offset()
    assert torch.equal(metal.forward(x, w, *topo.kernel_args()), metal.forward(x0, w0, *topo.kernel_args()))
    for strategy in STRATEGIES:
        got, want = metal.backward(go, x, w, *topo.kernel_args(), strategy), \
            metal.backward(go0, x0, w0, *topo.kernel_args(), strategy)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- index safety
def _corrupt(args: list[torch.Tensor], name: str, index: int, value: int) -> list[torch.Tensor]:
    i = TOPOLOGY_ARGS.index(name)
    t = args[i].clone()
    t[index] = value
    return args[:i] + [t] + args[i + 1:]


# (id, array, position, value): corruptions that leave every by-group (by-source) range disjoint, so that each
# output element keeps at most one writer; an overlapping range would give a grad_w row two writers (meaningless
# values, the error word set, and on the executor a reported race)
BAD_FORWARD = [
    ("col_ptr-not-zero", "col_ptr", 0, 1),
    ("col_ptr-decreases", "col_ptr", 2, -1),
    ("col_ptr-past-nv", "col_ptr", -1, 10_000),
    ("col_ptr-before-nv", "col_ptr", -1, 1),
    ("src_by_dst-high", "src_by_dst", 3, 40),
    ("src_by_dst-negative", "src_by_dst", 0, -1),
    ("perm-high", "perm", 1, 1 << 20),
    ("perm-negative", "perm", -1, -(2**31)),
]
BAD_BACKWARD = [
    ("row_ptr-past-nv", "row_ptr", -1, 10_000),
    ("row_ptr-decreases", "row_ptr", 3, -5),
    ("row_ptr-not-zero", "row_ptr", 0, 2),
    ("dst-high", "dst", 2, 6),
    ("dst-negative", "dst", 0, -3),
]
_BAD_TOPOLOGY = (40, 6, 0.4, 21)


@pytest.mark.parametrize("block", [8, 32])
@pytest.mark.parametrize(("name", "array", "index", "value"), BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_forward_bad_index_sets_its_word(name, array, index, value, block):
    """No access leaves a tensor (the executor's bounds checks would raise), every element of y is written, and
    the word of the corrupted array, and only it, is set."""
    metal = _host()
    topo = make_topology(*_BAD_TOPOLOGY)
    x, w, _ = _inputs(topo, block, 9, torch.float32, "cpu", seed=2)
    y = metal.forward(x, w, *_corrupt(list(topo.kernel_args()), array, index, value))
    assert not y.isnan().any()
    words = metal.take_index_errors(torch.device("cpu"))
    assert words == [int(a == array) for a in INDEX_ARRAYS]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "array", "index", "value"), BAD_BACKWARD + BAD_FORWARD,
                         ids=[c[0] for c in BAD_BACKWARD + BAD_FORWARD])
def test_backward_bad_index_sets_its_word(name, array, index, value, strategy):
    """The backward reads the by-source arrays (both strategies) and the by-group ones (atomic_free's grad_w):
    the word of the corrupted array is set where a kernel of the strategy reads it, no other; grad_x is always
    fully written (a vector id out of range is never written to, so grad_w may keep NaN there)."""
    metal = _host()
    topo = make_topology(*_BAD_TOPOLOGY)
    x, w, go = _inputs(topo, 16, 35, torch.float32, "cpu", seed=4)
    grad_x, _ = metal.backward(go, x, w, *_corrupt(list(topo.kernel_args()), array, index, value), strategy)
    assert not grad_x.isnan().any()
    read = {"row_ptr", "dst"} | ({"col_ptr", "src_by_dst", "perm"} if strategy == "atomic_free" else set())
    words = metal.take_index_errors(torch.device("cpu"))
    assert words == [int(a == array and a in read) for a in INDEX_ARRAYS]


def test_valid_topologies_leave_the_words_clear():
    metal = _host()
    for case in CASES:
        topo = make_topology(*case[:3], seed=1)
        x, w, go = _inputs(topo, 8, case[3], torch.float32, "cpu", seed=1)
        metal.forward(x, w, *topo.kernel_args())
        for strategy in STRATEGIES:
            metal.backward(go, x, w, *topo.kernel_args(), strategy)
    assert metal.take_index_errors(torch.device("cpu")) == [0] * len(INDEX_ARRAYS)


# ------------------------------------------------------------------------------------------------- the host
def test_bad_inputs_raise_before_any_kernel():
    log: list = []
    metal = _host(log=log)
    topo = make_topology(10, 2, 0.5, seed=0)
    x, w, go = _inputs(topo, 8, 3, torch.float32, "cpu", seed=0)
    args = topo.kernel_args()
    with pytest.raises(TypeError, match="float64"):
        metal.forward(x.double(), w.double(), *args)
    with pytest.raises(ValueError, match=r"in a layout of csr_linear: .*vector \(2-D, V one of"):
        metal.forward(x, torch.randn(topo.nnz, 4), *args)
    with pytest.raises(ValueError, match="takes a weight \\[vectors, V\\]"):
        metal.forward(x, torch.randn(topo.nnz), *args)
    with pytest.raises(ValueError, match="grad_out"):
        metal.backward(go[:, 1:], x, w, *args, "atomic_free")
    with pytest.raises(ValueError, match="strategy"):
        metal.backward(go, x, w, *args, "auto")
    with pytest.raises(RuntimeError, match="run on cpu tensors"):
        MetalVectorCsrLinear(compile_shader, device_type="cpu").forward(x.to("meta"), w, *args)
    assert log == []


def test_grid_follows_the_pipeline_and_the_batch():
    """A pipeline allowing 64 threads: 2 SIMD-groups a threadgroup; the forward takes fewer for a small batch."""
    log: list = []
    metal = _host(log=log, max_threads_per_threadgroup=64)
    topo = make_topology(30, 5, 0.4, seed=5)
    x, w, go = _inputs(topo, 16, 40, torch.float32, "cpu", seed=5)
    y = metal.forward(x, w, *topo.kernel_args())
    gx, gw = metal.backward(go, x, w, *topo.kernel_args(), "atomic_free")
    assert not (y.isnan().any() or gx.isnan().any() or gw.isnan().any())
    rows = min(2, -(-topo.nnz // (5 * 8)))  # grad_w: about one tile of eight vectors per SIMD-group
    assert log == [("vector_spmm_v16_float", (5 * 64, 3), (64, 1)),
                   ("vector_sddmm_v16_float", 5 * 32 * rows, 32 * rows),
                   ("vector_spmm_t_v16_float", (15 * 64, 2), (64, 1))]
    log.clear()
    _host(log=log).forward(x[:9], w, *topo.kernel_args())
    assert log == [("vector_spmm_v16_float", (5 * 64, 1), (64, 1))]  # 9 rows: 2 SIMD-groups of 8


def test_threadgroup_memory_fits():
    lib = compile_shader(host_module.MetalVectorCsrLinear(compile_shader, "cpu").source())
    for name in host_module.kernel_names():
        assert 0 < getattr(lib, name).static_thread_group_memory_length <= 32 * 1024, name


def test_mps_kernels_registered():
    """One registration serves both layouts: the MPS host sends a weight [vectors, V] to this host."""
    assert mps.register()
    for op in ("csr_linear", "csr_linear_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_sparse_metal::{op}", "MPS"), op
    assert isinstance(mps.MetalCsrLinear(compile_shader, "cpu").vector, MetalVectorCsrLinear)


@pytest.mark.parametrize("metal_version", METAL_LANGUAGE_VERSIONS)
def test_source_instantiates_what_the_host_dispatches(metal_version):
    names = kernel_names(MetalVectorCsrLinear(compile_shader, "cpu").source())
    assert sorted(names) == sorted(host_module.kernel_names())
    if metal_version >= 310:
        compile_shader(MetalVectorCsrLinear(compile_shader, "cpu").source(), metal_version=metal_version)


def test_shader_translates_to_cuda():
    """The CUDA translation of the shader compiles (no GPU needed), so the proxy cannot rot."""
    if cuda_translation.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    src = cuda_translation.translate(MetalVectorCsrLinear(compile_shader, "cpu").source(), "vector_csr_linear.metal")
    assert cuda_translation.compile_cubin(src, "sm_90")


# --------------------------------------------------------------------------- the simdgroup_matrix emulation
_MATRIX_SOURCE = r"""
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;
// d = op(a) . b + c, a from threadgroup memory (after a barrier), b and c from device memory, both at an origin
// inside a wider matrix; d stored to device memory, optionally transposed, at an origin. ld = 16 elements a row.
template <typename T>
kernel void mad(device float* d [[buffer(0)]], device const T* a [[buffer(1)]], device const T* b [[buffer(2)]],
                device const float* c [[buffer(3)]], constant long& flags [[buffer(4)]],
                uint tid [[thread_index_in_threadgroup]], uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup T as[16 * 16];
  for (uint i = tid; i < 16 * 16; i += 64) as[i] = a[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> ma, mb;
  simdgroup_float8x8 mc, md;
  simdgroup_load(ma, as, 16, ulong2(8 * simd, 3), (flags & 1) != 0);
  simdgroup_load(mb, b, 16, ulong2(5, 8));
  simdgroup_load(mc, c + 8 * simd, 16);
  if ((flags & 4) != 0) {
    simdgroup_multiply(md, ma, mb);
  } else {
    simdgroup_multiply_accumulate(md, ma, mb, mc);
  }
  simdgroup_store(md, d + 8 * simd, 16, ulong2(0, 2), (flags & 2) != 0);
}
template [[host_name("mad_float")]] [[kernel]] decltype(mad<float>) mad<float>;
template [[host_name("mad_half")]] [[kernel]] decltype(mad<half>) mad<half>;
template [[host_name("mad_bfloat")]] [[kernel]] decltype(mad<bfloat>) mad<bfloat>;

kernel void filled(device float* d [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 i = simdgroup_float8x8(2.0f), f = make_filled_simdgroup_matrix<float, 8, 8>(0.5f), r;
  simdgroup_multiply_accumulate(r, i, f, f);  // 2 I . F + F = 1.5 everywhere
  simdgroup_store(r, d);
}
kernel void lane_returned(device float* d [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  if (lane == 5) return;
  simdgroup_float8x8 m;
  simdgroup_load(m, d);
}
kernel void lanes_disagree(device float* d [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, d + (lane == 3 ? 8 : 0));
}
kernel void per_lane_fill(device float* d [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(float(lane)), r;
  simdgroup_multiply(r, m, m);
}
kernel void out_of_bounds(device float* d [[buffer(0)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, d, 8);
}
kernel void read_without_barrier(device float* d [[buffer(0)]], uint simd [[simdgroup_index_in_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float t[64];
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  if (simd == 0) simdgroup_store(m, t);
  if (simd == 1) d[lane] = t[lane];
}
"""


def _matrix_library():
    return compile_shader(_MATRIX_SOURCE, "matrix_test.metal")


def _quadrant(t: torch.Tensor, row: int, col: int) -> torch.Tensor:
    return t[row:row + 8, col:col + 8].double()


@pytest.mark.parametrize("flags", range(8), ids=lambda f: f"{'aT' if f & 1 else 'a'}-{'dT' if f & 2 else 'd'}-"
                         f"{'mul' if f & 4 else 'mad'}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_simdgroup_matrix_emulation_matches_matmul(dtype, flags):
    """Two SIMD-groups each compute d = op(a) . b (+ c) of 8 x 8 tiles cut from 16 x 16 matrices (elements_per_row
    16, origins (x = column, y = row), a transposed load, a transposed store), the operands of `dtype` and the
    accumulators float: against torch's float64 matmul of the same (rounded) values."""
    g = torch.Generator().manual_seed(flags)
    a, b = (torch.randn(16, 16, generator=g).to(dtype) for _ in range(2))
    c = torch.randn(16, 16, generator=g)
    d = torch.full((16, 16), float("nan"))
    getattr(_matrix_library(), f"mad_{KERNEL_DTYPES[dtype]}")(d, a, b, c, flags, threads=64, group_size=64)
    for simd in range(2):
        tile_a = _quadrant(a, 3, 8 * simd)
        want = (tile_a.T if flags & 1 else tile_a) @ _quadrant(b, 8, 5)
        if not flags & 4:
            want = want + _quadrant(c, 0, 8 * simd)
        got = _quadrant(d, 2, 8 * simd)
        got = got.T if flags & 2 else got
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(16, 16, dtype=torch.bool)
    untouched[2:10, :] = False
    assert d[untouched].isnan().all()  # nothing outside the stored tiles is written


def test_simdgroup_matrix_diagonal_and_filled():
    d = torch.full((64,), float("nan"))
    _matrix_library().filled(d, threads=32, group_size=32)
    assert torch.equal(d, torch.full((64,), 1.5))


@pytest.mark.parametrize(("kernel", "threads", "message"), [
    ("lane_returned", 32, "without every lane of a full SIMD-group"),
    ("filled", 16, "without every lane of a full SIMD-group"),
    ("lanes_disagree", 32, "lanes of a SIMD-group pass different arguments"),
    ("per_lane_fill", 32, "hold different operands"),
    ("out_of_bounds", 32, "out of bounds|outside"),
    # the reader runs before or after the store (the lanes' order is shuffled): unwritten, or a race
    ("read_without_barrier", 64, "race|no thread of this threadgroup has stored"),
])
def test_simdgroup_matrix_misuse_is_reported(kernel, threads, message):
    """What a GPU leaves undefined fails the dispatch: a matrix operation without every lane of a full SIMD-group,
    lanes passing different arguments or operands, a load past a buffer, and another SIMD-group reading a stored
    matrix without a barrier."""
    with pytest.raises(MslError, match=message):
        getattr(_matrix_library(), kernel)(torch.zeros(60), threads=threads, group_size=threads)


def test_bench_checks_and_tables_under_the_executor(tmp_path, capsys):
    """benchmarks/metal_vector_bench.py (the Mac command of docs/metal.md) runs its checks and writes its rows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("metal_vector_bench",
                                                  SHADERS.parent / "benchmarks" / "metal_vector_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    rows = bench.main(["--device", "cpu", "--executor", "--cases", "40,0.1,8,9", "--dtypes", "float32", "--reps", "1",
                       "--json", str(out)])
    assert {(r["stage"], r["method"]) for r in rows} == {
        (s, m) for s in ("forward", "fused_atomic bwd", "atomic_free bwd") for m in ("vector", "element", "dense")}
    assert all(r["rel_error"] < 1e-5 for r in rows) and out.exists()
    assert "| 40², 10%, V8, B9 | float32 | forward | vector |" in capsys.readouterr().out


_WRONG_MATRIX_CALLS = [
    ("half-matrix-from-float-memory", "device float* d [[buffer(0)]]", "simdgroup_half8x8 m; simdgroup_load(m, d);"),
    ("load-from-constant-memory", "constant float* d [[buffer(0)]]", "simdgroup_float8x8 m; simdgroup_load(m, d);"),
    ("store-to-constant-memory", "constant float* d [[buffer(0)]]",
     "simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(0.0f); simdgroup_store(m, d);"),
]


def test_matrix_calls_type_check_against_metals_declarations():
    """The strict clang pass checks SIMD-group matrix calls against Metal's declarations (the element type of the
    matrix and of the memory agree; device and threadgroup memory only): the shader's calls pass
    (tests/test_metal_syntax.py), these misuses fail. (The emulation's test kernels are not checked here: the pass's
    clang vectors take no multi-argument constructor such as ulong2(5, 8), which Metal accepts.)"""
    if clang_path() is None:
        pytest.skip("clang++ not installed")
    for name, param, body in _WRONG_MATRIX_CALLS:
        with pytest.raises(MslError, match="no matching function"):
            check_source(f"using namespace metal;\nkernel void k({param}) {{ {body} }}", f"{name}.metal")


# ------------------------------------------------------------------------------------------------ coverage
def test_every_vector_kernel_executed(request):
    """Runs last: every kernel defined in this family's shaders ran in this session."""
    mine = [i for i in request.session.items if getattr(getattr(i, "module", None), "__name__", None) == __name__]
    if not any(i.name.startswith("test_backward_matches") for i in mine):
        pytest.skip("the kernel-driving tests of this module were deselected")
    defined = set(kernel_names(load_source(SHADER_FILES), "vector_library.metal"))
    assert defined == set(host_module.kernel_names())
    missing = sorted(defined - EXECUTED)
    assert not missing, f"vector kernels no test executed: {missing}"
