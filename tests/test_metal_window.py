"""The row-window SpMM (``spmm_window_<T>_p<P>``, shaders/csr_linear.metal), run by the real MPS host code under
the MSL-on-CPU executor (and on the CUDA translation where an NVIDIA GPU and nvcc exist), against float64
references: every instantiation (float, half, bfloat; P = 1 and 4), windows and panels cut by the sizes (rows and
features not multiples of either), empty rows, zero edges, batch 1 and odd batches, rows whose columns do not
ascend, bad indices (the error words as the direct kernel sets them), NaN-poisoned outputs; and the variant's
place in the tuner (``spmm``: forced, tuned for the forward, never timed for fused_atomic)."""

from __future__ import annotations

import pytest
import torch
from _helpers import max_terms, metal_compiler

from torch_sparse_metal import CSRTopology, _autotune, tuning
from torch_sparse_metal.backends import mps
from torch_sparse_metal.backends.mps import SPMM_KERNELS, VALUES_PER_LANE, WINDOW_ROWS, MetalCsrLinear
from torch_sparse_metal.contract import INDEX_ARRAYS
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import dense_weight, reference_backward
from tsm_dev.msl import compile_shader

DTYPES = list(mps.KERNEL_DTYPES)
#: (in_features, out_features, density, batch). Windows hold 8 * WINDOW_ROWS[P] rows (128 or 64) and panels
#: 16 KiB / (32 P sizeof(T)) features (128/256 at P = 1, 32/64 at P = 4): these cut both at odd places, and hold
#: empty rows (make_topology empties an output and an input), zero edges, batch 1 and odd batches.
CASES = [
    (1, 1, 1.0, 1),
    (300, 130, 0.08, 33),   # 3 panels of 128 (P = 1, float), a window and 2 rows
    (513, 70, 0.05, 1),     # 5 float panels at P = 1, the last of one feature; 17 at P = 4
    (40, 300, 0.2, 5),      # 3 windows at P = 1, 5 at P = 4, the last partial
    (257, 129, 0.0, 7),     # zero edges
    (90, 65, 0.5, 257),     # 9 batch chunks at P = 1, 3 at P = 4 (the last partial)
    (33, 200, 1.0, 2),      # dense rows
]
IDS = [f"in{a}-out{b}-d{c}-N{d}" for a, b, c, d in CASES]


def make_topology(n_in: int, n_out: int, density: float, seed: int) -> CSRTopology:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_out, n_in, generator=g) < density
    if n_in > 2 and density > 0:
        mask[:, 1] = False  # an input with no edges
        mask[0, :] = False  # an output with no edges
    return CSRTopology.from_mask(mask)


def _host(p: int, spmm: str = "window", target: str = "executor", log: list | None = None,
          **compile_kwargs) -> MetalCsrLinear:
    compile_fn, device_type = metal_compiler(target, log, **compile_kwargs)
    return MetalCsrLinear(compile_fn, device_type=device_type, poison=True, values_per_lane=p, spmm=spmm)


@pytest.fixture(scope="module", params=["executor", "cuda"])
def target(request) -> str:
    return request.param


@pytest.mark.parametrize("p", VALUES_PER_LANE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_float64(target, case, dtype, p):
    n_in, n_out, density, batch = case
    log: list = []
    metal = _host(p, target=target, log=log if target == "executor" else None)
    dev = metal.device_type
    topo = make_topology(n_in, n_out, density, seed=n_in + n_out + batch)
    g = torch.Generator().manual_seed(batch)
    w = torch.randn(topo.nnz, generator=g).to(dev, dtype)
    x = torch.randn(batch, n_in, generator=g).to(dev, dtype)
    y = metal.forward(x, w, *topo.to(dev).kernel_args())
    assert y.shape == (batch, n_out) and y.dtype == dtype
    w64, x64 = dense_weight(w.cpu(), topo), x.double().cpu()
    axes.assert_within_bound("forward", y, x64 @ w64.T, x64.abs() @ w64.abs().T, max_terms(topo.col_ptr), dtype)
    if target == "executor" and topo.nnz:
        assert f"spmm_window_{mps.KERNEL_DTYPES[dtype]}_p{p}" in [c[0] for c in log]


@pytest.mark.parametrize("p", VALUES_PER_LANE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_atomic_free_grad_x_matches_float64(target, dtype, p):
    """atomic_free's pass 2 (rows = sources, grad_out gathered) through the window kernel."""
    metal = _host(p, target=target)
    dev = metal.device_type
    topo = make_topology(300, 140, 0.07, seed=3)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(topo.nnz, generator=g).to(dev, dtype)
    x, go = torch.randn(37, 300, generator=g).to(dev, dtype), torch.randn(37, 140, generator=g).to(dev, dtype)
    grad_x, grad_w = metal.backward(go, x, w, *topo.to(dev).kernel_args(), "atomic_free")
    (ex, ew), (tx, tw) = (reference_backward(go.cpu(), x.cpu(), w.cpu(), topo),
                          reference_backward(go.cpu().abs(), x.cpu().abs(), w.cpu().abs(), topo))
    axes.assert_within_bound("grad_x", grad_x, ex, tx, max_terms(topo.row_ptr), dtype)
    axes.assert_within_bound("grad_w", grad_w, ew, tw, 37, dtype)


@pytest.mark.parametrize("p", VALUES_PER_LANE)
def test_same_sums_as_the_direct_kernel(p):
    """Each row's edges are added in the same order as spmm adds them: on the executor (IEEE float, no
    contraction) both kernels give the same bits, forward and grad_x."""
    topo = make_topology(700, 150, 0.06, seed=p)
    g = torch.Generator().manual_seed(p)
    x, w, go = torch.randn(45, 700, generator=g), torch.randn(topo.nnz, generator=g), torch.randn(45, 150, generator=g)
    window, direct = _host(p, "window"), _host(p, "direct")
    assert torch.equal(window.forward(x, w, *topo.kernel_args()), direct.forward(x, w, *topo.kernel_args()))
    gw, gd = (m.backward(go, x, w, *topo.kernel_args(), "atomic_free")[0] for m in (window, direct))
    assert torch.equal(gw, gd)


# ------------------------------------------------------------------------------ the kernel, dispatched directly
def _library():
    return compile_shader(mps.load_source())


def _dispatch(lib, stage: str, dtype: torch.dtype, p: int, val, bt, ptr, col, batch: int, nrows: int, ncols: int,
              rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """One SpMM dispatch as the host makes it, into a NaN-filled output; returns (out, error words)."""
    fn = getattr(lib, f"{stage}_{mps.KERNEL_DTYPES[dtype]}_p{p}")
    out = torch.full((batch, nrows), float("nan"), dtype=dtype)
    errors = torch.zeros(2, dtype=torch.int32)
    window = rows * (WINDOW_ROWS[p] if stage == "spmm_window" else 1)
    ldb = bt.shape[1]
    fn(out, val, bt, ptr, col, errors, batch, nrows, ncols, col.numel(), ldb,
       threads=(-(-nrows // window) * 32 * rows, ldb // (32 * p)), group_size=(32 * rows, 1))
    return out, errors


def _feature_major(x: torch.Tensor, p: int) -> torch.Tensor:
    batch, cols = x.shape
    ldb = -(-batch // (32 * p)) * 32 * p
    bt = torch.zeros(cols, ldb, dtype=x.dtype)
    bt[:, :batch] = x.T
    return bt


def _reference(val, x, ptr, col, nrows) -> torch.Tensor:
    out = torch.zeros(x.shape[0], nrows, dtype=torch.float64)
    for r in range(nrows):
        for k in range(int(ptr[r]), int(ptr[r + 1])):
            out[:, r] += float(val[k]) * x[:, int(col[k])].double()
    return out


@pytest.mark.parametrize("p", VALUES_PER_LANE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_columns_out_of_order_still_sum_right(dtype, p):
    """A row whose columns descend, or jump back across panels: the edges below the panel are read from device
    memory, so the sum is still every edge's (the direct kernel's, bit for bit, and float64's within bound)."""
    g = torch.Generator().manual_seed(7)
    ncols, nrows, batch = 600, 20, 9
    lengths = torch.randint(0, 60, (nrows,), generator=g)
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    col = torch.randint(0, ncols, (int(ptr[-1]),), generator=g, dtype=torch.int32)  # any order, repeats too
    col[int(ptr[3]):int(ptr[4])] = torch.arange(ncols - 1, ncols - 1 - int(lengths[3]), -1)  # descending
    val = torch.randn(col.numel(), generator=g).to(dtype)
    x = torch.randn(batch, ncols, generator=g).to(dtype)
    lib = _library()
    bt = _feature_major(x, p)
    got, errors = _dispatch(lib, "spmm_window", dtype, p, val, bt, ptr, col, batch, nrows, ncols)
    want, _ = _dispatch(lib, "spmm", dtype, p, val, bt, ptr, col, batch, nrows, ncols)
    assert errors.tolist() == [0, 0] and torch.equal(got, want)
    ref = _reference(val, x, ptr, col, nrows)
    terms = _reference(val.abs(), x.abs(), ptr, col, nrows)
    axes.assert_within_bound("forward", got, ref, terms, int(lengths.max()), dtype)


@pytest.mark.parametrize("p", VALUES_PER_LANE)
@pytest.mark.parametrize("bad", ["col_high", "col_negative", "ptr_decreasing", "ptr_past_nnz", "ptr_not_zero"])
def test_bad_indices_set_the_error_words_as_the_direct_kernel(bad, p):
    """Out-of-range columns and malformed row pointers: no access leaves a tensor (the executor's bounds checks
    would raise), every output element is written (no NaN left), and the error words are the direct kernel's."""
    g = torch.Generator().manual_seed(11)
    ncols, nrows, batch = 300, 150, 5
    topo = make_topology(ncols, nrows, 0.05, seed=12)
    ptr, col = topo.col_ptr.clone(), topo.src_by_dst.clone()
    k = int(ptr[nrows // 2])
    if bad == "col_high":
        col[k] = ncols + 5
    elif bad == "col_negative":
        col[k] = -3
    elif bad == "ptr_decreasing":
        ptr[nrows // 2] = ptr[nrows // 2 + 1] + 4
    elif bad == "ptr_past_nnz":
        ptr[-1] = col.numel() + 40
    else:
        ptr[0] = 2
    val = torch.randn(col.numel(), generator=g)
    x = torch.randn(batch, ncols, generator=g)
    lib = _library()
    bt = _feature_major(x, p)
    got, errors = _dispatch(lib, "spmm_window", torch.float32, p, val, bt, ptr, col, batch, nrows, ncols)
    want, want_errors = _dispatch(lib, "spmm", torch.float32, p, val, bt, ptr, col, batch, nrows, ncols)
    word = 0 if bad.startswith("ptr") else 1
    assert errors.tolist() == want_errors.tolist() == [int(word == 0), int(word == 1)]
    assert not got.isnan().any() and torch.equal(got, want)


def test_error_words_reach_check_index_errors():
    """Through the host: the forward's window kernel reports into the words of col_ptr and src_by_dst."""
    metal = _host(1)
    topo = make_topology(50, 40, 0.2, seed=1)
    args = list(topo.kernel_args())
    src_by_dst = args[4].clone()
    src_by_dst[3] = 10_000
    args[4] = src_by_dst
    metal.forward(torch.randn(3, 50), torch.randn(topo.nnz), *args)
    words = metal.take_index_errors(torch.device("cpu"))
    assert words[INDEX_ARRAYS.index("src_by_dst")] == 1 and words[INDEX_ARRAYS.index("col_ptr")] == 0


# ---------------------------------------------------------------------------------------- host: launch sizes
@pytest.mark.parametrize("p", VALUES_PER_LANE)
def test_grid_covers_windows_of_the_pipelines_rows(p):
    """A pipeline allowing 64 threads: 2 SIMD-groups a threadgroup, windows of 2 * WINDOW_ROWS[P] rows."""
    log: list = []
    metal = _host(p, log=log, max_threads_per_threadgroup=64)
    topo = make_topology(60, 100, 0.2, seed=5)
    x = torch.randn(40, 60)
    y = metal.forward(x, torch.randn(topo.nnz), *topo.kernel_args())
    assert not y.isnan().any()
    (name, threads, group), = [c for c in log if c[0].startswith("spmm")]
    ldb = -(-40 // (32 * p)) * 32 * p
    assert name == f"spmm_window_float_p{p}" and group == (64, 1)
    assert threads == (-(-100 // (2 * WINDOW_ROWS[p])) * 64, ldb // (32 * p))


def test_threadgroup_memory_is_the_panel():
    """16 KiB, the panel (store_block's tile reuses it): two threadgroups fit in Metal's 32 KiB."""
    lib = _library()
    for dtype in DTYPES:
        for p in VALUES_PER_LANE:
            fn = getattr(lib, f"spmm_window_{mps.KERNEL_DTYPES[dtype]}_p{p}")
            assert fn.static_thread_group_memory_length == 16384


# ----------------------------------------------------------------------------------------------- the variant
def test_knob_is_checked():
    with pytest.raises(ValueError, match="spmm must be one of"):
        MetalCsrLinear(compile_shader, device_type="cpu", spmm="tiled")


def test_static_rule_is_the_direct_kernel():
    """Without a forced kernel or a decision: spmm (no Apple timing supports another rule)."""
    log: list = []
    metal = _host(4, spmm=None, log=log)
    topo = make_topology(40, 30, 0.3, seed=2)
    with tuning_off():
        metal.forward(torch.randn(70, 40), torch.randn(topo.nnz), *topo.kernel_args())
    assert [c[0] for c in log if c[0].startswith("spmm")] == ["spmm_float_p4"]


class tuning_off:
    """Tuning off for the block (the default, whatever the test before left)."""

    def __enter__(self):
        self._mp = pytest.MonkeyPatch()
        self._mp.setattr(_autotune, "enabled", False)

    def __exit__(self, *exc):
        self._mp.undo()


def test_mps_candidates():
    """The forward is tuned over P and the SpMM kernel; fused_atomic (its own kernel) over P only; atomic_free,
    whose pass 2 is the SpMM, over both."""
    assert [tuning.label(c) for c in tuning.candidates("mps")] == [
        "values_per_lane=1 spmm=direct", "values_per_lane=1 spmm=window",
        "values_per_lane=4 spmm=direct", "values_per_lane=4 spmm=window"]
    assert [tuning.label(c) for c in tuning.candidates("mps", ("fused_atomic",))] == [
        "fused_atomic values_per_lane=1", "fused_atomic values_per_lane=4"]
    assert len(tuning.candidates("mps", ("atomic_free",))) == 4
    assert tuple(SPMM_KERNELS) == mps.VARIANTS["spmm"] == ("direct", "window")


def test_forward_tunes_the_window_and_dispatches_it(monkeypatch, tmp_path):
    """A fake timer that prefers the window kernel: the forward's first eager call of a bucket times the four
    candidates, each dispatching its own kernel, and later calls of the bucket dispatch the winner; a bad cached
    value falls back to the direct kernel."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_session", {})
    monkeypatch.setitem(tuning.VARIANTS, "cpu", mps.VARIANTS)
    monkeypatch.setitem(tuning.VARIANT_OPS, "cpu", mps.VARIANT_OPS)
    log: list = []
    metal = _host(None, spmm=None, log=log)  # type: ignore[arg-type]
    topo = make_topology(70, 50, 0.2, seed=0)
    x, w = torch.randn(40, 70), torch.randn(topo.nnz)

    def spmm_kernels(start: int) -> list[str]:
        return [c[0] for c in log[start:] if c[0].startswith("spmm")]

    timed: list[list[str]] = []

    def measure(device, candidates, run):
        ms = {}
        for c in candidates:
            start = len(log)
            tuning._run_candidate(c, run)
            timed.append(spmm_kernels(start))
            ms[tuning.label(c)] = 1.0 if c["spmm"] == "window" and c["values_per_lane"] == 4 else 2.0
        best = min(candidates, key=lambda c: ms[tuning.label(c)])
        return {**best, "ms": ms, "spread_ms": {k: 0.0 for k in ms}}

    monkeypatch.setattr(tuning, "_measure", measure)
    decision = tuning.tune_forward(torch.device("cpu"), x.dtype, 70, 50, topo.nnz, 40,
                                   lambda: metal.forward(x, w, *topo.kernel_args()))
    assert decision == {"values_per_lane": 4, "spmm": "window"}
    assert timed == [["spmm_float_p1"], ["spmm_window_float_p1"], ["spmm_float_p4"], ["spmm_window_float_p4"]]
    start = len(log)
    y = metal.forward(x, w, *topo.kernel_args())
    assert spmm_kernels(start) == ["spmm_window_float_p4"]
    torch.testing.assert_close(y.double(), x.double() @ dense_weight(w, topo).T, rtol=1e-5, atol=1e-5)
    start = len(log)  # the backward's strategy was not tuned with the window: atomic_free runs spmm
    metal.backward(torch.randn(40, 50), x, w, *topo.kernel_args(), "atomic_free")
    assert spmm_kernels(start) == ["spmm_float_p4"]
    bucket = tuning.bucket_key(x.dtype, 70, 50, topo.nnz, 40, "forward")
    monkeypatch.setattr(tuning, "_session", {(tuning.device_key(torch.device("cpu")), bucket):
                                             {"values_per_lane": 4, "spmm": "panel"}})
    start = len(log)
    metal.forward(x, w, *topo.kernel_args())
    assert spmm_kernels(start) == ["spmm_float_p4"]
