"""Graph capture of models with SparseLinear, as for nn.Linear: torch.jit.trace, torch.fx.symbolic_trace,
torch.export with dynamic leading dimensions, and torch.compile with dynamic shapes. Each captured program runs on
new inputs (other batch sizes too) and is compared with the same model made of the dense nn.Linear layers
(``to_linear()``) in float64, outputs and gradients."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, sparse_linear
from torch_sparse_metal_tools.testing.reference import dense_weight

Dim = torch.export.Dim


def _models(seed: int, bias: bool = True) -> tuple[nn.Module, nn.Module]:
    """A sparse model and its dense float64 equivalent (one layer without bias, one with another strategy)."""
    g = torch.Generator().manual_seed(seed)
    sparse = nn.Sequential(SparseLinear(9, 7, density=0.4, bias=bias, generator=g), nn.Tanh(),
                           SparseLinear(7, 5, density=0.6, bias=False, backward="atomic_free", generator=g)).double()
    dense = nn.Sequential(sparse[0].to_linear(), nn.Tanh(), sparse[2].to_linear())
    return sparse, dense


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _assert_same_function(program, sparse: nn.Module, dense: nn.Module, x: torch.Tensor) -> None:
    """``program`` (a capture of ``sparse``) and ``dense`` agree in output and in the input's gradient; the
    captured program's gradients reach ``sparse``'s parameters and equal the dense layers' (densified)."""
    xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, ref = program(xs), dense(xd)
    torch.testing.assert_close(y, ref)
    cotangent = torch.randn_like(ref)
    (y * cotangent).sum().backward()
    (ref * cotangent).sum().backward()
    torch.testing.assert_close(xs.grad, xd.grad)
    for s_layer, d_layer in ((sparse[0], dense[0]), (sparse[2], dense[2])):
        rows, cols = s_layer.dst.long(), s_layer.src.long()
        torch.testing.assert_close(s_layer.weight.grad, d_layer.weight.grad[rows, cols])
        if s_layer.bias is not None:
            torch.testing.assert_close(s_layer.bias.grad, d_layer.bias.grad)
    sparse.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------ torch.jit.trace
def _jit_trace(model: nn.Module, example: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace itself is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("error", torch.jit.TracerWarning)  # nothing of ours may make the trace doubtful
        return torch.jit.trace(model, example)


@pytest.mark.parametrize("seed", range(2))
def test_jit_trace_runs_other_batch_sizes_with_gradients(seed):
    sparse, dense = _models(seed, bias=bool(seed))
    traced = _jit_trace(sparse, _x(4, 9, seed=seed))
    assert "torch_sparse_metal::csr_linear" in str(traced.inlined_graph)  # the op, not an opaque Python call
    for batch in (1, 4, 13, 0):
        _assert_same_function(traced, sparse, dense, _x(batch, 9, seed=seed + batch))


def test_jit_trace_of_leading_dims_and_save_load():
    sparse, dense = _models(3)
    traced = _jit_trace(sparse, _x(2, 3, 9))
    _assert_same_function(traced, sparse, dense, _x(5, 2, 9, seed=1))
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    x = _x(4, 6, 9, seed=2)
    torch.testing.assert_close(loaded(x), dense(x))


def test_jit_trace_follows_later_weight_updates():
    """The traced module holds the layer's parameters, as for nn.Linear: an optimizer step shows in it."""
    sparse, dense = _models(4)
    traced = _jit_trace(sparse, _x(3, 9))
    with torch.no_grad():
        sparse[0].weight.mul_(-2.0)
    dense = nn.Sequential(sparse[0].to_linear(), nn.Tanh(), sparse[2].to_linear())
    x = _x(6, 9, seed=5)
    torch.testing.assert_close(traced(x), dense(x))


# ------------------------------------------------------------------------------------------ torch.fx.symbolic_trace
@pytest.mark.parametrize("seed", range(2))
def test_fx_symbolic_trace_matches_dense(seed):
    sparse, dense = _models(seed, bias=bool(seed))
    graph_module = torch.fx.symbolic_trace(sparse)
    calls = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    assert len(calls) == 2 and all("sparse_linear" in n.name for n in calls)
    assert "Strategy" not in graph_module.code  # plain strings: the code runs without our enum in its globals
    for shape in ((5, 9), (1, 9), (2, 3, 9), (0, 9), (9,)):
        _assert_same_function(graph_module, sparse, dense, _x(*shape, seed=seed + sum(shape)))


def test_fx_symbolic_trace_of_the_functional_form():
    topo = CSRTopology.random(8, 5, 0.5, generator=torch.Generator().manual_seed(0))
    weight, bias = _x(topo.nnz, seed=1), _x(5, seed=2)
    dense = dense_weight(weight, topo)

    class Model(nn.Module):
        def forward(self, x, w):
            return sparse_linear(x, w, topo, bias).relu()

    graph_module = torch.fx.symbolic_trace(Model())
    x = _x(4, 8, seed=3)
    torch.testing.assert_close(graph_module(x, weight), (x @ dense.T + bias).relu())
    with pytest.raises(TypeError, match="topology must be a CSRTopology"):
        torch.fx.symbolic_trace(lambda x, w: sparse_linear(x, w, "not a topology"))


def test_fx_graph_module_deepcopies():
    sparse, dense = _models(6)
    graph_module = copy.deepcopy(torch.fx.symbolic_trace(sparse))
    x = _x(3, 9, seed=7)
    torch.testing.assert_close(graph_module(x), dense(x))


# ---------------------------------------------------------------------------------------------------- torch.export
def test_export_with_a_dynamic_batch_runs_every_batch_size():
    sparse, dense = _models(0)
    program = torch.export.export(sparse, (_x(5, 9),), dynamic_shapes=({0: Dim("batch")},))
    module = program.module()
    for batch in (1, 2, 5, 64, 0):
        x = _x(batch, 9, seed=batch)
        torch.testing.assert_close(module(x), dense(x))


def test_export_with_several_dynamic_leading_dims():
    sparse, dense = _models(1)
    program = torch.export.export(sparse, (_x(2, 3, 9),), dynamic_shapes=({0: Dim("a"), 1: Dim("b")},))
    module = program.module()
    for shape in ((2, 3, 9), (4, 1, 9), (1, 7, 9), (3, 0, 9)):
        x = _x(*shape, seed=sum(shape))
        torch.testing.assert_close(module(x), dense(x))
    with pytest.raises(Exception, match="9"):  # the layer's in_features stays a constant of the program
        module(_x(2, 3, 8))


def test_exported_program_saves_loads_and_trains():
    sparse, dense = _models(2)
    program = torch.export.export(sparse, (_x(4, 9),), dynamic_shapes=({0: Dim("batch")},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    x = _x(11, 9, seed=3)
    torch.testing.assert_close(loaded(x), dense(x))
    # the program's own module carries gradients to its parameters (a copy of the model's, as for nn.Linear)
    module = program.module()
    module(x).square().sum().backward()
    dense(x).square().sum().backward()
    rows, cols = sparse[0].dst.long(), sparse[0].src.long()
    torch.testing.assert_close(dict(module.named_parameters())["0.weight"].grad, dense[0].weight.grad[rows, cols])


# --------------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize(("backend", "options"), [("inductor", {}), ("inductor", {"fullgraph": True, "dynamic": True}),
                                                  ("aot_eager", {"dynamic": True})])
def test_compile_matches_dense(backend, options):
    torch._dynamo.reset()
    sparse, dense = _models(3)
    compiled = torch.compile(sparse, backend=backend, **options)
    for batch in (3, 8, 17):
        _assert_same_function(compiled, sparse, dense, _x(batch, 9, seed=batch))


def test_compile_dynamic_does_not_recompile_for_new_batch_sizes():
    torch._dynamo.reset()
    sparse, dense = _models(4)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(sparse, fullgraph=True, dynamic=True, backend=counter)
    for batch in (3, 8, 17, 100):
        x = _x(batch, 9, seed=batch)
        torch.testing.assert_close(compiled(x), dense(x))
    assert counter.frame_count == 1

