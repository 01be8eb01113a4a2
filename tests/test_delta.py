"""SparseDelta: y = base(x) + x @ delta^T against float64 dense math, its gradients (one per connection, none for a
frozen base), the choice of connections, merge and unmerge, autocast, torch.compile, and the DynamicSparsity
schedules dropping and regrowing the delta's connections."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseDelta
from torch_sparse_metal.delta import top_connections
from torch_sparse_metal.evolve import DynamicSparsity

BLOCKS = [1, 8]


def _seed() -> int:
    return int(torch.randint(2**31, (1,)))


def _wrapper(block: int, *, seed: int, freeze_base: bool = True, density: float = 0.2) -> SparseDelta:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = nn.Linear(24, 16)
    layer = SparseDelta(base, density=density, block=block, freeze_base=freeze_base, generator=g)
    with torch.no_grad():
        layer.delta.weight.copy_(torch.randn(layer.delta.nnz, generator=g))
    return layer


def _dense_delta64(layer: SparseDelta) -> torch.Tensor:
    rows, cols = layer.delta.indices()
    d = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64)
    d[rows, cols] = layer.delta.weight.detach().double()
    return d


def _fused(y: torch.Tensor) -> bool:
    """Whether ``y`` came from the fused product (one dense product over the weight with the delta scattered in)
    rather than from the two products ``base(x) + delta(x)``."""
    node = y.grad_fn
    if type(node).__name__ == "ViewBackward0":  # the rows taken back to the input's leading dimensions
        node = node.next_functions[0][0]
    return type(node).__name__ == "FusedDeltaLinearBackward"


# (rows): 15 rows of a 24x16 layer at density 0.2 take the fused product (rows * nnz >= out * in), 1 row the two
@pytest.mark.parametrize("shape", [(3, 5, 24), (1, 24)])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("freeze_base", [True, False])
def test_forward_and_gradients_match_float64_dense_math(block, freeze_base, shape):
    seed = _seed()
    layer = _wrapper(block, seed=seed, freeze_base=freeze_base)
    base_weight = layer.base.weight.detach().clone()
    x = torch.randn(*shape, requires_grad=True)
    y = layer(x)
    assert _fused(y) == (shape[0] > 1)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(layer.base.weight.detach(), base_weight)  # the fused product adds into a copy

    w64 = layer.base.weight.detach().double()
    x64 = x.detach().double().reshape(-1, 24)
    g64 = g.double().reshape(-1, 16)
    ref = x64 @ (w64 + _dense_delta64(layer)).t() + layer.base.bias.detach().double()
    torch.testing.assert_close(y.double().reshape(-1, 16), ref, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    rows, cols = layer.delta.indices()
    dense_grad = g64.t() @ x64
    torch.testing.assert_close(layer.delta.weight.grad.double(), dense_grad[rows, cols], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double().reshape(-1, 24), g64 @ (w64 + _dense_delta64(layer)),
                               rtol=1e-5, atol=1e-5)
    assert layer.delta.weight.grad.shape == (layer.delta.nnz,)
    if freeze_base:
        assert layer.base.weight.grad is None and layer.base.bias.grad is None
        assert not layer.base.weight.requires_grad
    else:
        torch.testing.assert_close(layer.base.weight.grad.double(), dense_grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.base.bias.grad.double(), g64.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", BLOCKS)
def test_second_order_gradients_of_the_fused_product_match_float64(block):
    """A gradient penalty through the fused product: create_graph=True, then the gradient of the gradients' norm,
    against the same in float64 dense math (the delta scattered by a differentiable index_put)."""
    seed = _seed()
    layer = _wrapper(block, seed=seed, freeze_base=False)
    x = torch.randn(20, 24, requires_grad=True)
    params = [x, layer.delta.weight, layer.base.weight, layer.base.bias]
    y = layer(x)
    assert _fused(y)
    grads = torch.autograd.grad(y.tanh().sum(), params, create_graph=True)
    penalty = sum(gr.square().sum() for gr in grads)
    second = torch.autograd.grad(penalty, params)

    leaves = [p.detach().double().requires_grad_() for p in params]
    x64, v64, w64, b64 = leaves
    rows, cols = layer.delta.indices()
    dense = torch.zeros(16, 24, dtype=torch.float64).index_put((rows, cols), v64)
    y64 = x64 @ (w64 + dense).t() + b64
    grads64 = torch.autograd.grad(y64.tanh().sum(), leaves, create_graph=True)
    second64 = torch.autograd.grad(sum(gr.square().sum() for gr in grads64), leaves)
    for got, want in zip(second, second64):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")


@pytest.mark.parametrize("block", BLOCKS)
def test_the_fused_product_is_the_merged_layer_bit_for_bit(block):
    """The fused product adds the delta into a copy of the weight as merge() adds it into the weight: the same
    outputs to the bit, and the base weight untouched until the merge."""
    layer = _wrapper(block, seed=_seed())
    x = torch.randn(2, 30, 24)
    before = layer.base.weight.detach().clone()
    y = layer(x)
    assert _fused(y) and torch.equal(layer.base.weight, before)
    layer.merge()
    assert torch.equal(layer(x), y)


def test_the_fused_product_gives_way_to_hooks():
    """Hooks on either module, or global module hooks, see the two module calls: the wrapper then runs them."""
    layer = _wrapper(1, seed=_seed())
    x = torch.randn(40, 24)
    assert _fused(layer(x))
    seen = []
    handle = layer.delta.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    y = layer(x)
    assert not _fused(y) and seen == [(40, 16)]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append(module))
    try:
        y = layer(x)
    finally:
        handle.remove()
    assert not _fused(y) and layer.base in seen and layer.delta in seen
    assert _fused(layer(x))


@pytest.mark.parametrize("block", BLOCKS)
def test_a_fresh_delta_is_zero_and_optimizer_state_is_per_connection(block):
    torch.manual_seed(_seed())
    base = nn.Linear(24, 16)
    layer = SparseDelta(base, density=0.1, block=block)
    x = torch.randn(4, 24)
    assert torch.equal(layer(x), base(x))
    trainable = [p for p in layer.parameters() if p.requires_grad]
    assert trainable == [layer.delta.weight]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    layer(x).square().mean().backward()
    opt.step()
    state = opt.state[layer.delta.weight]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (layer.delta.nnz,)
    assert layer.delta.nnz == CSRTopology.random_edge_count(24, 16, 0.1, block=block)


def test_connections_given_scored_or_random():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(24, 16)
    given = CSRTopology.random(24, 16, 0.3, generator=g)
    assert SparseDelta(base, topology=given).delta.topology.same_as(given)

    scores = torch.rand(16, 24, generator=g)
    layer = SparseDelta(base, density=0.1, scores=scores)
    count = round(0.1 * 16 * 24)
    expected = torch.zeros(16 * 24, dtype=torch.bool)
    expected[scores.double().reshape(-1).argsort(descending=True)[:count]] = True
    assert torch.equal(layer.delta.topology.to_sparse_csr(torch.ones(count)).to_dense().bool().reshape(-1), expected)

    vector = SparseDelta(base, density=0.25, scores=scores, block=8)  # vectors ranked by the L2 norm of 8 scores
    norms = scores.double().view(2, 8, 24).norm(dim=1).reshape(-1)
    top = set(norms.argsort(descending=True)[:vector.delta.nnz // 8].tolist())
    rows, cols = vector.delta.indices()
    assert {int(r // 8) * 24 + int(c) for r, c in zip(rows, cols)} == top

    a = SparseDelta(base, density=0.1, generator=torch.Generator().manual_seed(seed))
    b = SparseDelta(base, density=0.1, generator=torch.Generator().manual_seed(seed))
    assert a.delta.topology.same_as(b.delta.topology) and a.delta.nnz == count


@pytest.mark.parametrize("make, error, match", [
    (lambda base: SparseDelta(nn.Conv1d(2, 2, 1)), TypeError, "nn.Linear"),
    (lambda base: SparseDelta(base), ValueError, "give density"),
    (lambda base: SparseDelta(base, 0.1, topology=CSRTopology.random(24, 16, 0.1)), ValueError, "not both"),
    (lambda base: SparseDelta(base, topology=CSRTopology.random(16, 24, 0.1)), ValueError, "16x24"),
    (lambda base: SparseDelta(base, 0.1, scores=torch.rand(24, 16)), ValueError, "shape"),
    (lambda base: SparseDelta(base, 0.1, scores=torch.full((16, 24), float("nan"))), ValueError, "NaN"),
    (lambda base: SparseDelta(base, 0.1, block=32), ValueError, "multiple"),
    (lambda base: SparseDelta(base, 1.5), ValueError, "density"),
])
def test_bad_arguments_are_refused_and_leave_the_base_alone(make, error, match):
    base = nn.Linear(24, 16)
    before = [p.detach().clone() for p in base.parameters()]
    with pytest.raises(error, match=match):
        make(base)
    assert all(p.requires_grad for p in base.parameters())
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), before))


def test_top_connections_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError, match="floating-point"):
        top_connections(torch.ones(4, 4, dtype=torch.long), 0.5)


@pytest.mark.parametrize("block", BLOCKS)
def test_merge_then_unmerge_restores_the_base_weight_bit_for_bit(block):
    seed = _seed()
    layer = _wrapper(block, seed=seed)
    before = layer.base.weight.detach().clone()
    x = torch.randn(6, 24)
    y = layer(x)
    layer.merge()
    assert layer.merged
    ref = x.double() @ (before.double() + _dense_delta64(layer)).t() + layer.base.bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-5)
    # the merged weight is the float32 sum, element by element
    rows, cols = layer.delta.indices()
    assert torch.equal(layer.base.weight[rows, cols], before[rows, cols] + layer.delta.weight.detach())
    untouched = torch.ones_like(before, dtype=torch.bool)
    untouched[rows, cols] = False
    assert torch.equal(layer.base.weight[untouched], before[untouched])
    layer.unmerge()
    assert torch.equal(layer.base.weight, before) and not layer.merged
    assert torch.equal(layer(x), y)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()
    layer.merge()
    with pytest.raises(RuntimeError, match="merged already"):
        layer.merge()


def test_unmerge_after_the_base_changed_subtracts_the_merged_delta():
    layer = _wrapper(1, seed=_seed(), freeze_base=False)
    before = layer.base.weight.detach().clone()
    layer.merge()
    step = torch.randn_like(before)
    with torch.no_grad():
        layer.base.weight.add_(step)  # the base trained while merged
    layer.unmerge()
    torch.testing.assert_close(layer.base.weight, before + step, rtol=0, atol=1e-5)


def test_a_merged_checkpoint_loads_merged_with_the_same_outputs():
    seed = _seed()
    layer = _wrapper(1, seed=seed)
    before = layer.base.weight.detach().clone()
    layer.merge()
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert int(state["_extra_state"][0]) == 1
    fresh = _wrapper(1, seed=seed)
    fresh.load_state_dict(state)
    x = torch.randn(5, 24)
    assert fresh.merged and torch.equal(fresh(x), layer(x))
    fresh.unmerge()
    torch.testing.assert_close(fresh.base.weight, before, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="merge state"):
        fresh.load_state_dict({**state, "_extra_state": torch.tensor([7])})


@pytest.mark.parametrize("rows", [4, 40])  # the two products, the fused one
def test_autocast_bfloat16_follows_the_dense_layer(rows):
    layer = _wrapper(1, seed=_seed())
    x = torch.randn(rows, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and _fused(y) == (rows == 40)
    ref = x.double() @ (layer.base.weight.double() + _dense_delta64(layer)).t() + layer.base.bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=3e-2, atol=3e-2)
    y.float().sum().backward()
    assert layer.delta.weight.grad.dtype == torch.float32 and layer.delta.weight.grad.shape == (layer.delta.nnz,)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_and_backward_match_eager(backend):
    torch._dynamo.reset()
    layer = _wrapper(1, seed=_seed())
    x = torch.randn(3, 7, 24)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    y = compiled(x)
    y.square().sum().backward()
    grad = layer.delta.weight.grad.clone()
    layer.zero_grad()
    y_eager = layer(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    torch.testing.assert_close(grad, layer.delta.weight.grad)
    assert layer.base.weight.grad is None


@pytest.mark.parametrize("mode", ["set", "rigl"])
@pytest.mark.parametrize("block", BLOCKS)
def test_dynamic_sparsity_drops_and_regrows_the_deltas_connections(mode, block):
    seed = _seed()
    model = nn.Sequential(_wrapper(block, seed=seed, density=0.25), nn.ReLU(), nn.Linear(16, 3))
    layer = model[0]
    for p in model[2].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([layer.delta.weight], lr=1e-2)
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=10, drop_fraction=0.5, mode=mode,
                          generator=torch.Generator().manual_seed(seed))
    assert evo.layers == [layer.delta]
    x = torch.randn(8, 24)
    old = dict(zip(map(tuple, layer.delta.indices().t().tolist()), layer.delta.weight.detach().tolist()))
    y = model[0](x)
    y.square().sum().backward()
    x_in, g_out = x.double(), 2 * y.detach().double()
    opt.step()
    stepped = dict(zip(map(tuple, layer.delta.indices().t().tolist()), layer.delta.weight.detach().tolist()))
    assert evo.step()
    nnz = layer.delta.nnz
    assert nnz == len(old)
    new = dict(zip(map(tuple, layer.delta.indices().t().tolist()), layer.delta.weight.detach().tolist()))
    kept = set(new) & set(old)
    grown = set(new) - set(old)
    assert grown and all(new[e] == stepped[e] for e in kept) and all(new[e] == 0.0 for e in grown)
    dropped = set(old) - set(new)
    if block == 1:  # dropped by magnitude (a vector layout drops whole vectors, ranked by their norm)
        assert max(abs(stepped[e]) for e in dropped) <= min(abs(stepped[e]) for e in kept)
    assert opt.state[layer.delta.weight]["exp_avg"].shape == (nnz,)
    if mode == "rigl" and block == 1:  # grown where the dense gradient of the (frozen) base weight is largest
        dense = (g_out.t() @ x_in).abs()
        absent = torch.ones_like(dense, dtype=torch.bool)
        for r, c in old:
            absent[r, c] = False
        threshold = dense[absent].sort(descending=True).values[len(grown) - 1]
        assert all(dense[r, c] >= threshold * (1 - 1e-5) for r, c in grown)
    ref = x.double() @ (layer.base.weight.double() + _dense_delta64(layer)).t() + layer.base.bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_the_merge_record_follows_the_layer_to_another_dtype():
    layer = _wrapper(1, seed=_seed())
    before = layer.base.weight.detach().half()
    layer.merge()
    layer.half()  # rounds the merged values: the float32 record would no longer match them
    layer.unmerge()
    assert layer.base.weight.dtype == torch.float16 and torch.equal(layer.base.weight, before)
