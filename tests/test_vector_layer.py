"""SparseLinear(block=V), the vector layout, as a module: everything that holds for block 1 holds for every V.

References are independent of the vector kernels: float64 dense math on the element-level edges
(testing.reference), and the unstructured csr_linear kernels on the same edges."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, sparse_linear, sparsify
from torch_sparse_metal.contract import TOPOLOGY_ARGS, VECTOR_BLOCKS
from torch_sparse_metal.evolve import DynamicSparsity, apply_update, dense_grad_topk, plan_update
from torch_sparse_metal_tools.testing.reference import reference_outputs
from tsm_dev.snapshot import changes, snapshot

STRATEGIES = ("fused_atomic", "atomic_free")


def _devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
            "torch_sparse_metal::csr_linear", "CUDA"):
        found.append("cuda")
    return found


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bound(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b).abs().max().item() if a.numel() else 0.0


def _check_layer(layer: SparseLinear, x: torch.Tensor, strategy: str) -> None:
    """Forward and both gradients of ``layer`` against float64 dense math on its element-level edges."""
    layer.backward = layer.backward.__class__(strategy)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    flat_x = x.detach().reshape(-1, layer.in_features)
    ref_y, ref_gx, ref_gw = reference_outputs(grad_out.reshape(-1, layer.out_features), flat_x, layer.weight,
                                              layer.topology.to("cpu"))
    bias = layer.bias.detach().double().cpu() if layer.bias is not None else 0.0
    scale = max(1.0, ref_y.abs().max().item()) if ref_y.numel() else 1.0
    bound = _bound(x.dtype) * scale
    assert _err(y.detach().reshape(ref_y.shape), ref_y + bias) <= bound
    assert _err(x.grad.reshape(ref_gx.shape), ref_gx) <= bound * 4
    assert _err(layer.weight.grad, ref_gw) <= bound * 4 * max(1, flat_x.shape[0] ** 0.5)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("block", VECTOR_BLOCKS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(37, 2, (5, 3)), (1, 1, (1,)), (64, 3, (0,)), (130, 5, (2, 1, 33))],
                         ids=["37x2g-15rows", "1x1g-1row", "batch0", "130x5g-66rows"])
def test_matches_float64_reference(device, block, strategy, shape):
    n_in, groups, lead = shape
    layer = SparseLinear(n_in, groups * block, density=0.3, block=block, generator=_gen(n_in + block),
                         device=device, dtype=torch.float64 if device == "cpu" else torch.float32)
    x = torch.randn(*lead, n_in, dtype=layer.weight.dtype, generator=_gen(1)).to(device)
    _check_layer(layer, x, strategy)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_dtypes_and_empty_rows(block):
    """float32/bfloat16/float16 against float64, on a topology with empty inputs and empty groups."""
    mask = torch.rand(4, 50, generator=_gen(2)) < 0.4
    mask[1] = False  # an empty group
    mask[:, ::3] = False  # empty inputs
    vectors = CSRTopology.from_mask(mask)
    topology = CSRTopology.from_vectors(vectors, block)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        layer = SparseLinear.from_topology(topology, dtype=dtype, generator=_gen(3))
        assert layer.fan_in()[block:2 * block].eq(0).all()
        _check_layer(layer, torch.randn(9, 50, generator=_gen(4)).to(dtype), "atomic_free")


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_same_edges_as_unstructured_layer(block):
    """The vector kernels and csr_linear's on the same element-level edges and values: the same function."""
    layer = SparseLinear(70, 2 * block, density=0.2, block=block, generator=_gen(5))
    flat = CSRTopology.from_csr(layer.row_ptr, layer.dst, 70, 2 * block)
    twin = SparseLinear.from_topology(flat)
    with torch.no_grad():
        twin.weight.copy_(layer.weight)
        twin.bias.copy_(layer.bias)
    x = torch.randn(11, 70, generator=_gen(6))
    torch.testing.assert_close(layer(x), twin(x), rtol=1e-5, atol=1e-5)
    g = torch.randn(11, 2 * block, generator=_gen(7))
    for m in (layer, twin):
        m.backward = m.backward.__class__("atomic_free")
        m(x).backward(g)
    torch.testing.assert_close(layer.weight.grad, twin.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_element_level_views(block):
    layer = SparseLinear(20, 2 * block, density=0.4, block=block, generator=_gen(8))
    assert layer.block == block and layer.nnz % block == 0
    idx = layer.indices()
    # a vector's lanes are consecutive edges of one input and outputs g*V .. g*V+V-1
    out = idx[0].view(-1, block)
    assert (out[:, 0] % block == 0).all() and (out - out[:, :1] == torch.arange(block)).all()
    assert (idx[1].view(-1, block) == idx[1].view(-1, block)[:, :1]).all()
    dense = layer.to_dense()
    assert torch.equal(dense[idx[0], idx[1]], layer.weight.detach())
    assert torch.equal(layer.to_sparse_csr().to_dense(), dense.detach())
    assert (dense != 0).sum() == layer.nnz
    assert "block=" + str(block) in repr(layer)


def test_block_errors():
    with pytest.raises(ValueError, match="not a multiple of block=16"):
        SparseLinear(8, 40, block=16)
    for bad in (7, 0, True, "16", 64):
        with pytest.raises(ValueError, match="block must be one of"):
            SparseLinear(8, 64, block=bad)
    with pytest.raises(ValueError, match="not whole vectors of block=8"):
        CSRTopology.from_mask(torch.eye(8, dtype=torch.bool), block=8)
    with pytest.raises(ValueError, match="input 0 connects to outputs"):
        CSRTopology.from_edges(torch.zeros(8, dtype=torch.long), torch.arange(1, 9), 1, 16, block=8)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_one_set_of_index_buffers(block):
    """A vector layer keeps its saved edges (row_ptr, dst: element-level, the checkpoint's) and the topology over
    vectors the kernels take; the element-level src, col_ptr, src_by_dst and perm are derived when read, equal to
    those of the same edges as an unstructured topology."""
    import pickle

    layer = SparseLinear(30, 2 * block, density=0.3, block=block, generator=_gen(27))
    # _extra_state: the shape record as a (non-persistent) buffer too, for accelerate's one-at-a-time loading
    assert [n for n, _ in layer.named_buffers()] == ["row_ptr", "dst", *(f"vector_{n}" for n in TOPOLOGY_ARGS),
                                                     "_extra_state"]
    assert list(layer.state_dict()) == ["weight", "bias", "row_ptr", "dst", "_extra_state"]
    edges = CSRTopology.from_csr(layer.row_ptr, layer.dst, 30, 2 * block)
    for name in TOPOLOGY_ARGS:
        assert torch.equal(getattr(layer, name), getattr(edges, name)), name
        assert torch.equal(getattr(layer.topology, name), getattr(edges, name)), name
    assert torch.equal(layer.fan_in(), edges.fan_in())
    # a layer pickled when vector layers kept the element-level arrays as buffers too loses them when unpickled
    state = layer.__getstate__()
    element = {n: getattr(edges, n) for n in ("src", "col_ptr", "src_by_dst", "perm")}
    state["_buffers"] = {**state["_buffers"], **element}
    old = SparseLinear.__new__(SparseLinear)
    old.__setstate__(state)
    again = pickle.loads(pickle.dumps(old))
    assert [n for n, _ in again.named_buffers()] == [n for n, _ in layer.named_buffers()]
    x = torch.randn(3, 30, generator=_gen(28))
    assert torch.equal(again(x), layer(x))


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_state_dict_copy_and_moves(block):
    layer = SparseLinear(30, 2 * block, density=0.3, block=block, generator=_gen(9))
    x = torch.randn(4, 30, generator=_gen(10))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    other = SparseLinear(30, 2 * block, density=0.6, block=block)
    other.load_state_dict(torch.load(buffer))
    assert torch.equal(other(x), layer(x)) and torch.equal(other.vector_perm, layer.vector_perm)
    twin = copy.deepcopy(layer)
    assert torch.equal(twin(x), layer(x)) and twin.vector_dst.data_ptr() != layer.vector_dst.data_ptr()
    wide = copy.deepcopy(layer).to(torch.float64)
    assert wide.vector_row_ptr.dtype == torch.int32
    torch.testing.assert_close(wide(x.double()).float(), layer(x))
    # a checkpoint without a block is read with the layer's: whole vectors load, other edges are refused
    plain = {k: v for k, v in layer.state_dict().items() if k != "_extra_state"}
    other.load_state_dict(plain, strict=False)
    assert torch.equal(other(x), layer(x))
    unstructured = SparseLinear(30, 2 * block, density=0.3, generator=_gen(23)).state_dict()
    before = snapshot(other)
    with pytest.raises(RuntimeError, match="not whole vectors"):
        other.load_state_dict({k: v for k, v in unstructured.items() if k != "_extra_state"}, strict=False)
    assert changes(before, other) == []
    # a checkpoint of another block is refused and nothing changes
    flat = SparseLinear(30, 2 * block, density=0.3)
    before = snapshot(flat)
    with pytest.raises(RuntimeError, match=f"block={block}"):
        flat.load_state_dict(layer.state_dict())
    assert changes(before, flat) == []


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_meta_init(block):
    with torch.device("meta"):
        layer = SparseLinear(24, 2 * block, density=0.25, block=block, generator=_gen(11))
    assert layer.weight.is_meta and layer.vector_dst.is_meta and layer.nnz % block == 0
    real = layer.to_empty(device="cpu")
    real.reset_parameters()
    real.topology.validate()
    again = copy.deepcopy(layer).to_empty(device="cpu")
    again.reset_parameters()
    assert torch.equal(real.dst, again.dst)  # reproducible from the construction seed
    assert real(torch.randn(3, 24)).shape == (3, 2 * block)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_from_dense_and_sparse_cover_the_mask(block):
    linear = nn.Linear(40, 2 * block)
    mask = torch.rand(2 * block, 40, generator=_gen(12)) < 0.05
    layer = SparseLinear.from_dense(linear, mask, block=block)
    covered = CSRTopology.covering(mask, block)
    assert torch.equal(layer.to_dense() != 0, covered & (linear.weight != 0))
    assert torch.equal(layer.to_dense().detach(), (linear.weight * covered).detach())
    sparse = SparseLinear.from_sparse((linear.weight * mask).detach().to_sparse_csr(), linear.bias.detach(),
                                      block=block)
    assert torch.equal(sparse.to_dense().detach(), (linear.weight * mask).detach())
    assert sparse.nnz == covered.sum()


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_sparsify_keeps_largest_vectors(block):
    model = nn.Sequential(nn.Linear(16, 2 * block), nn.ReLU(), nn.Linear(2 * block, block))
    dense_w = model[0].weight.detach().clone()
    model = sparsify(model, 0.25, block=block)
    layer = model[0]
    assert layer.block == block
    norms = dense_w.view(2, block, 16).norm(dim=1).flatten()
    want = norms.topk(round(0.25 * 16 * 2)).indices.sort().values
    got = (layer.vector_dst.long() * 16 + layer.vector_src.long()).sort().values  # keys over (group, input)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="not a multiple of block"):
        sparsify(nn.Sequential(nn.Linear(8, block + 1)), 0.5, block=block)


def test_autocast_bfloat16():
    layer = SparseLinear(48, 32, density=0.3, block=16, generator=_gen(13))
    x = torch.randn(6, 48, generator=_gen(14))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    ref = reference_outputs(torch.ones(6, 32), x, layer.weight, layer.topology)[0] + layer.bias.detach().double()
    assert (y.double() - ref).abs().max() < 5e-2


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_second_order_and_func(block):
    layer = SparseLinear(9, block, density=0.5, block=block, generator=_gen(15), dtype=torch.float64)
    x = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(layer, {"weight": w}, (x,)),
                                    (x, layer.weight.detach().clone().requires_grad_(True)))
    assert torch.autograd.gradgradcheck(lambda x, w: torch.func.functional_call(layer, {"weight": w}, (x,)),
                                        (x, layer.weight.detach().clone().requires_grad_(True)))
    params = dict(layer.named_parameters())
    grads = torch.func.grad(lambda p, x: torch.func.functional_call(layer, p, (x,)).square().sum())(params, x)
    layer(x).square().sum().backward()
    torch.testing.assert_close(grads["weight"], layer.weight.grad)
    per_sample = torch.func.vmap(lambda xi: layer(xi[None]).sum())(x.detach())
    torch.testing.assert_close(per_sample, layer(x).sum(dim=1).detach())


def test_compile_matches_eager():
    layer = SparseLinear(40, 32, density=0.3, block=16, generator=_gen(16))
    x = torch.randn(5, 40, generator=_gen(17))
    compiled = torch.compile(layer, fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, layer(x))
    y.sum().backward()
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(grad, layer.weight.grad)


@pytest.mark.parametrize("mode", ["set", "rigl"])
@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_evolution_keeps_whole_vectors_and_carries_state(mode, block):
    torch.manual_seed(18)
    layer = SparseLinear(24, 4 * block, density=0.25, block=block)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=10, drop_fraction=0.5, mode=mode,
                          grow_to=0.4 if mode == "set" else None, in_place=mode == "rigl")
    dst = layer.vector_dst
    for _ in range(4):
        layer(torch.randn(8, 24)).square().mean().backward()
        opt.step()
        before = layer.to_dense().detach().clone()
        moments = torch.zeros_like(before).index_put_((layer.dst.long(), layer.src.long()),
                                                      opt.state[layer.weight]["exp_avg"])
        opt.zero_grad()
        if evo.step():
            layer.topology.validate()  # whole vectors, every derived array consistent
            after = layer.to_dense().detach()
            now = torch.zeros_like(after).index_put_((layer.dst.long(), layer.src.long()),
                                                     opt.state[layer.weight]["exp_avg"])
            kept = (before != 0) & (after != 0)
            assert torch.equal(before[kept], after[kept]) and torch.equal(moments[kept], now[kept])
            grown = (after == 0) & (before == 0) & (now == 0)
            assert layer.nnz % block == 0 and grown.any()
    assert (layer.vector_dst is dst) == (mode == "rigl")  # in place: the captured buffers were kept


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_rigl_grows_largest_gradient_vectors(block):
    layer = SparseLinear(12, 3 * block, density=0.2, block=block, generator=_gen(19))
    x, g = torch.randn(7, 12, generator=_gen(20)), torch.randn(7, 3 * block, generator=_gen(21))
    keys = dense_grad_topk(x, g, layer.topology, 3, chunk=block)
    norms = (g.t() @ x).view(3, block, 12).norm(dim=1)  # [groups, in]
    norms[layer.vector_dst.long(), layer.vector_src.long()] = -1
    want = norms.t().flatten().topk(3).indices  # keys src * groups + group
    assert torch.equal(keys.sort().values, want.sort().values)
    with pytest.raises(ValueError, match="multiples of"):
        plan_update(layer, 1, 1)
    topology, edge_map = plan_update(layer, block, block, mode="rigl", grad=(x, g))
    assert apply_update(layer, topology, edge_map, in_place=True)


@pytest.mark.parametrize("block", VECTOR_BLOCKS)
def test_arrays_have_unit_strides_even_when_empty(block):
    """The vectors' per-vector sources are every V-th edge's: an empty view of that keeps its strides through a
    plain dtype cast, and a buffer of stride V cannot be viewed as bytes (checkpoint tools, snapshots)."""
    for density in (0.0, 0.5):
        drawn = CSRTopology.random(5, 2 * block, density, block=block, generator=_gen(22))
        topology = CSRTopology.from_csr(drawn.row_ptr, drawn.dst, 5, 2 * block, block=block)  # a checkpoint's way in
        for t in (*topology.kernel_args(), *topology.vectors.kernel_args()):
            assert t.stride() == (1,) and t.view(torch.uint8).numel() == 4 * t.numel()


def test_tracers_record_the_vector_layer():
    """torch.jit.trace and torch.export record the op with the vector layout's weight; torch.fx's symbolic trace
    records the layer's leaf, which runs the same op."""
    import warnings

    layer = SparseLinear(40, 32, density=0.3, block=16, generator=_gen(24))
    x = torch.randn(4, 40, generator=_gen(25))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(layer, x)
    assert "torch_sparse_metal::csr_linear" in str(traced.inlined_graph)
    torch.testing.assert_close(traced(x), layer(x))
    exported = torch.export.export(layer, (x,))
    assert "torch_sparse_metal.csr_linear" in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), layer(x))
    torch.testing.assert_close(torch.fx.symbolic_trace(layer)(x), layer(x), rtol=1e-5, atol=1e-5)


def test_raw_op_under_forward_mode_and_func_transforms():
    """The raw vector op never drops a tangent: dual tensors get the element-level forward rule (the op is linear in
    its weight, so the tangent is the op of the weight's tangent), and torch.func's differentiating transforms,
    which its rule cannot serve, are refused with the entry that serves them."""
    import torch.autograd.forward_ad as fwAD

    groups = CSRTopology.random(6, 2, 0.5, generator=_gen(26))
    x, w, t = torch.randn(3, 6), torch.randn(groups.nnz, 8), torch.randn(groups.nnz, 8)
    op = torch.ops.torch_sparse_metal.csr_linear

    def f(weight):
        return op(x, weight, *groups.kernel_args(), "auto")

    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(f(fwAD.make_dual(w, t))).tangent
    torch.testing.assert_close(tangent, f(t))
    for transform in (lambda: torch.func.jvp(f, (w,), (t,)), lambda: torch.func.grad(lambda v: f(v).sum())(w)):
        with pytest.raises(NotImplementedError, match="sparse_linear or SparseLinear"):
            transform()


@pytest.mark.parametrize("block", [2, 4, 12, 64])
def test_a_hand_built_topology_of_an_unsupported_block_is_refused_by_name(block):
    """CSRTopology's constructor trusts its arguments: a topology of a block no kernel has (built by hand over valid
    vectors) is refused by from_topology and sparse_linear before any work, naming the supported blocks (the
    contract's), instead of failing inside torch or the kernels."""
    vectors = CSRTopology.random(10, 3, 0.5, generator=_gen(int(torch.randint(2**31, (1,)))))
    topology = CSRTopology(10, 3 * block, block=block, vectors=vectors)
    supported = re.escape(str((1, *VECTOR_BLOCKS)))
    with pytest.raises(ValueError, match=f"the topology has block={block}: block must be one of {supported}"):
        SparseLinear.from_topology(topology)
    with pytest.raises(ValueError, match=f"the topology has block={block}: block must be one of {supported}"):
        sparse_linear(torch.randn(2, 10), torch.randn(vectors.nnz * block), topology)
