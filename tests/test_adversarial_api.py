"""Adversarial tables for the constructors and the functional entry: bad arguments raise a clear exception naming
the argument; NaN and Inf reach exactly the outputs and gradients a float64 edge-by-edge reference reaches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from torch_sparse_metal import CSRTopology, SparseLinear, sparse_linear
from torch_sparse_metal.contract import INT32_MAX
from torch_sparse_metal.evolve import DynamicSparsity
from tsm_dev.fuzz import assert_matches, edge_backward, edge_forward

TOPO = CSRTopology.random(12, 7, 0.4, generator=torch.Generator().manual_seed(0))
I = torch.tensor  # noqa: E741

CONSTRUCTORS = {
    "in_features negative": (lambda: SparseLinear(-1, 3), ValueError, "in_features must be >= 0"),
    "in_features float": (lambda: SparseLinear(3.0, 3), TypeError, "in_features must be an int"),
    "out_features bool": (lambda: SparseLinear(3, True), TypeError, "out_features must be an int"),
    "in_features past int32": (lambda: SparseLinear(INT32_MAX + 1, 1), ValueError, "int32"),
    "density NaN": (lambda: SparseLinear(4, 4, density=math.nan), ValueError, "density must be in"),
    "density inf": (lambda: SparseLinear(4, 4, density=math.inf), ValueError, "density must be in"),
    "density negative": (lambda: SparseLinear(4, 4, density=-0.1), ValueError, "density must be in"),
    "density above 1": (lambda: SparseLinear(4, 4, density=1.5), ValueError, "density must be in"),
    "density str": (lambda: SparseLinear(4, 4, density="0.1"), TypeError, "density must be a float"),
    "backward unknown": (lambda: SparseLinear(4, 4, backward="fast"), ValueError, "backward must be one of"),
    "dtype int32": (lambda: SparseLinear(4, 4, dtype=torch.int32), TypeError, "dtype torch.int32 is not supported"),
    "dtype complex": (lambda: SparseLinear(4, 4, dtype=torch.complex64), TypeError, "not supported"),
    "dtype float8": (lambda: SparseLinear(4, 4, dtype=torch.float8_e4m3fn), TypeError, "not supported"),
    "generator a seed": (lambda: SparseLinear(4, 4, generator=0), TypeError, "generator must be a torch.Generator"),
    "meta generator a str": (lambda: SparseLinear(4, 4, device="meta", generator="g"), TypeError, "generator"),
    "from_topology None": (lambda: SparseLinear.from_topology(None), TypeError, "topology must be a CSRTopology"),
    "from_dense not a Linear": (lambda: SparseLinear.from_dense(torch.nn.Conv1d(2, 2, 1)), TypeError, "nn.Linear"),
    "from_dense wrong mask": (lambda: SparseLinear.from_dense(torch.nn.Linear(4, 3), torch.ones(4, 3, dtype=bool)),
                              ValueError, "mask must have the weight's shape"),
    "from_sparse dense": (lambda: SparseLinear.from_sparse(torch.eye(3)), TypeError, "torch sparse tensor"),
    "from_sparse 3-D": (lambda: SparseLinear.from_sparse(torch.zeros(2, 2, 2).to_sparse()), ValueError, "2-D"),
    "from_sparse bias short": (lambda: SparseLinear.from_sparse(torch.eye(3).to_sparse(), torch.zeros(2)),
                               ValueError, "bias must have shape"),
    "from_edges duplicate": (lambda: CSRTopology.from_edges(I([0, 0]), I([1, 1]), 2, 2), ValueError, "duplicate"),
    "from_edges out of range": (lambda: CSRTopology.from_edges(I([0]), I([5]), 2, 2), ValueError, "out of range"),
    "from_edges float": (lambda: CSRTopology.from_edges(I([0.0]), I([1]), 2, 2), TypeError, "must hold integers"),
    "from_edges lengths": (lambda: CSRTopology.from_edges(I([0, 1]), I([1]), 2, 2), ValueError, "same length"),
    "from_edges too many": (lambda: CSRTopology.from_edges(I([0] * 5), I([0] * 5), 2, 2), ValueError, "cannot fit"),
    "from_csr decreasing": (lambda: CSRTopology.from_csr(I([0, 2, 1]), I([0]), 2, 2), ValueError, "row_ptr"),
    "from_csr list": (lambda: CSRTopology.from_csr([0, 1], I([0]), 1, 1), TypeError, "row_ptr must be a torch"),
    "from_indices 1-D": (lambda: CSRTopology.from_indices(I([0, 1]), 2, 2), ValueError, "must be a \\[2, E\\]"),
    "from_mask float": (lambda: CSRTopology.from_mask(torch.ones(2, 2)), TypeError, "bool"),
    "from_mask 3-D": (lambda: CSRTopology.from_mask(torch.ones(2, 2, 2, dtype=bool)), ValueError, "2-D"),
    "random generator": (lambda: CSRTopology.random(3, 3, 0.5, generator=1), TypeError, "generator must be"),
}


@pytest.mark.parametrize("case", list(CONSTRUCTORS))
def test_constructor_refuses(case):
    build, error, message = CONSTRUCTORS[case]
    with pytest.raises(error, match=message):
        build()


def _model():
    return torch.nn.Sequential(SparseLinear(8, 6, density=0.5))


SCHEDULES = {
    "no SparseLinear": (lambda m, o: DynamicSparsity(torch.nn.Linear(2, 2), o, total_steps=9), "no SparseLinear"),
    "optimizer None": (lambda m, o: DynamicSparsity(m, None, total_steps=9), "optimizer must be"),
    "optimizer a list holding a string": (lambda m, o: DynamicSparsity(m, [o, "sgd"], total_steps=9),
                                          "optimizer must be"),
    "optimizer an empty list": (lambda m, o: DynamicSparsity(m, [], total_steps=9), "empty list"),
    "prune_every 0": (lambda m, o: DynamicSparsity(m, o, prune_every=0, total_steps=9), "prune_every"),
    "prune_every float": (lambda m, o: DynamicSparsity(m, o, prune_every=1.5, total_steps=9), "prune_every"),
    "total_steps 0": (lambda m, o: DynamicSparsity(m, o, total_steps=0), "total_steps"),
    "drop_fraction NaN": (lambda m, o: DynamicSparsity(m, o, total_steps=9, drop_fraction=math.nan), "drop_fraction"),
    "stop_fraction 2": (lambda m, o: DynamicSparsity(m, o, total_steps=9, stop_fraction=2.0), "stop_fraction"),
    "grow_to below density": (lambda m, o: DynamicSparsity(m, o, total_steps=9, grow_to=0.1), "below"),
    "mode unknown": (lambda m, o: DynamicSparsity(m, o, total_steps=9, mode="prune"), "mode must be"),
    "chunk 0": (lambda m, o: DynamicSparsity(m, o, total_steps=9, chunk=0), "chunk"),
    "generator a seed": (lambda m, o: DynamicSparsity(m, o, total_steps=9, generator=3), "generator must be"),
    "process_group unknown": (lambda m, o: DynamicSparsity(m, o, total_steps=9, process_group="all"),
                              "process_group"),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_dynamic_sparsity_constructor_refuses(case):
    model = _model()
    build, message = SCHEDULES[case]
    with pytest.raises((ValueError, TypeError), match=message):
        build(model, torch.optim.SGD(model.parameters(), lr=0.1))


W = torch.randn(TOPO.nnz)
X = torch.randn(3, 12)
FUNCTIONAL = {
    "input a list": (lambda: sparse_linear([[0.0] * 12], W, TOPO), TypeError, "input must be a torch.Tensor"),
    "input 0-d": (lambda: sparse_linear(torch.tensor(1.0), W, TOPO), ValueError, "at least 1 dimension"),
    "input too wide": (lambda: sparse_linear(torch.randn(3, 13), W, TOPO), ValueError, "in_features=12"),
    "input int": (lambda: sparse_linear(X.long(), W.long(), TOPO), TypeError, "not supported"),
    "input float64, weight float32": (lambda: sparse_linear(X.double(), W, TOPO), TypeError, "dtype"),
    "input meta": (lambda: sparse_linear(X.to("meta"), W, TOPO), RuntimeError, "on meta"),
    "weight a list": (lambda: sparse_linear(X, W.tolist(), TOPO), TypeError, "weight must be a torch.Tensor"),
    "weight short": (lambda: sparse_linear(X, W[:-1], TOPO), ValueError, "weight must be 1-D with nnz"),
    "weight 2-D": (lambda: sparse_linear(X, W[None], TOPO), ValueError, "weight must be 1-D"),
    "bias short": (lambda: sparse_linear(X, W, TOPO, torch.zeros(3)), ValueError, "bias must have shape"),
    "bias a list": (lambda: sparse_linear(X, W, TOPO, [0.0] * 7), TypeError, "bias must be a torch.Tensor"),
    "bias float64": (lambda: sparse_linear(X, W, TOPO, torch.zeros(7, dtype=torch.float64)), RuntimeError, "bias"),
    "topology None": (lambda: sparse_linear(X, W, None), TypeError, "topology must be a CSRTopology"),
    "topology with a false out_features": (lambda: sparse_linear(X, W, dataclasses.replace(TOPO, out_features=3)),
                                           ValueError, "do not fit"),
    "topology with a false in_features": (lambda: sparse_linear(torch.randn(3, 13), W,
                                                                dataclasses.replace(TOPO, in_features=13)),
                                          ValueError, "do not fit"),
    "backward unknown": (lambda: sparse_linear(X, W, TOPO, backward="fast"), ValueError, "backward must be one of"),
    "layer on another dtype": (lambda: SparseLinear(12, 7)(X.half()), TypeError, "dtype"),
}


@pytest.mark.parametrize("case", list(FUNCTIONAL))
def test_sparse_linear_refuses(case):
    call, error, message = FUNCTIONAL[case]
    with pytest.raises(error, match=message):
        call()


# -------------------------------------------------------------------------------------------- NaN and Inf
POISON = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}


@pytest.mark.parametrize("strategy", ["fused_atomic", "atomic_free"])
@pytest.mark.parametrize("where", ["x", "weight", "bias", "grad_out"])
@pytest.mark.parametrize("value", list(POISON))
def test_non_finite_values_reach_exactly_the_connected_outputs(value, where, strategy):
    g = torch.Generator().manual_seed(1)
    x, w, bias, go = (torch.randn(3, 12, generator=g, dtype=torch.float64), torch.randn(TOPO.nnz, generator=g,
                      dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64),
                      torch.randn(3, 7, generator=g, dtype=torch.float64))
    target = {"x": x, "weight": w, "bias": bias, "grad_out": go}[where]
    target.view(-1)[1] = POISON[value]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = sparse_linear(xg, wg, TOPO, bias, backward=strategy)
    y.backward(go)
    assert_matches(y, edge_forward(x, w, TOPO.col_ptr, TOPO.src_by_dst, TOPO.perm) + bias, "y")
    rx, rw = edge_backward(go, x, w, TOPO.row_ptr, TOPO.dst)
    assert_matches(xg.grad, rx, "grad_x")
    assert_matches(wg.grad, rw, "grad_w")
    assert y.isfinite().any(), "a single poisoned value must not reach every output"


_SPARSE_LAYOUTS = {"COO": (torch.Tensor.to_sparse, "sparse COO"), "CSR": (torch.Tensor.to_sparse_csr, "sparse CSR"),
                   "CSC": (torch.Tensor.to_sparse_csc, "sparse CSC")}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("block", [1, 8])
@pytest.mark.parametrize("layout", list(_SPARSE_LAYOUTS))
def test_a_sparse_input_is_refused_naming_its_layout_and_to_dense(layout, block):
    """The layer, the functional form and the raw ops refuse a non-strided x before any work, naming the layout and
    ``to_dense()``; the dense input then gives nn.Linear's result."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    layer = SparseLinear(12, 16, density=0.4, block=block, generator=g)
    dense = torch.randn(5, 12, generator=g) * (torch.rand(5, 12, generator=g) < 0.3)
    convert, kind = _SPARSE_LAYOUTS[layout]
    x = convert(dense)
    for name, call in (("input", lambda: layer(x)), ("input", lambda: sparse_linear(x, layer.weight, layer.topology)),
                       ("x", lambda: _raw_op(x, layer))):
        with pytest.raises(TypeError, match=rf"^{name} is a {kind} tensor \(layout torch\.sparse_\w+\); .*pass "
                                            rf"{name}\.to_dense\(\)$"):
            call()
    reference = torch.nn.Linear(12, 16)
    with torch.no_grad():
        reference.weight.copy_(layer.to_dense())
        reference.bias.copy_(layer.bias)
    torch.testing.assert_close(layer(x.to_dense()), reference(dense))


def _raw_op(x, layer):
    if layer.block > 1:
        return torch.ops.torch_sparse_metal.csr_linear(x, layer.weight.view(-1, layer.block),
                                                              *layer.topology.vectors.kernel_args(), "auto")
    return torch.ops.torch_sparse_metal.csr_linear(x, layer.weight, *layer.topology.kernel_args(), "auto")


def test_a_sparse_weight_or_bias_is_refused_by_sparse_linear():
    x, w, bias = torch.randn(3, 12), torch.randn(TOPO.nnz), torch.randn(7)
    with pytest.raises(TypeError, match=r"^weight is a sparse COO tensor .*pass weight\.to_dense\(\)$"):
        sparse_linear(x, w.to_sparse(), TOPO, bias)
    with pytest.raises(TypeError, match=r"^bias is a sparse COO tensor .*pass bias\.to_dense\(\)$"):
        sparse_linear(x, w, TOPO, bias.to_sparse())
    torch.testing.assert_close(sparse_linear(x, w, TOPO, bias),
                               torch.nn.functional.linear(x, TOPO.to_sparse_csr(w).to_dense(), bias))
    # the Python-boundary check the Metal host and the fake kernels run
    from torch_sparse_metal.ops._csr_linear import check_forward
    with pytest.raises(TypeError, match=r"^x is a sparse COO tensor .*pass x\.to_dense\(\)$"):
        check_forward(x.to_sparse(), w, *TOPO.kernel_args())
    with pytest.raises(TypeError, match=r"^weight is a sparse COO tensor"):
        check_forward(x, w.to_sparse(), *TOPO.kernel_args())
