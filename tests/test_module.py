"""SparseLinear behaves like nn.Linear: shapes, dtype/device rules, state, copies, errors, training."""

import copy
import io
import re

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, sparse_linear
from torch_sparse_metal_tools.testing.reference import reference_forward


def _layer(in_f=24, out_f=16, density=0.3, seed=0, **kw):
    return SparseLinear(in_f, out_f, density=density, generator=torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize("lead", [(), (5,), (3, 4), (2, 1, 3)])
@pytest.mark.parametrize("backward", ["auto", "fused_atomic", "atomic_free"])
def test_any_leading_dims_forward_and_backward(lead, backward):
    layer = _layer(backward=backward, dtype=torch.float64)
    x = torch.randn(*lead, 24, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape == (*lead, 16)
    dense = nn.Linear(24, 16, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        dense.bias.copy_(layer.bias)
    torch.testing.assert_close(y, dense(x))
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, layer.weight, layer.bias), g)
    dx, dW, db = torch.autograd.grad(dense(x), (x, dense.weight, dense.bias), g)
    torch.testing.assert_close(gx, dx)
    torch.testing.assert_close(gw, dW[layer.dst.long(), layer.src.long()])
    torch.testing.assert_close(gb, db)


def test_non_contiguous_input():
    layer = _layer()
    base = torch.randn(24, 10)
    x = base.t()  # [10, 24], not contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()))
    strided = torch.randn(10, 48)[:, ::2]
    torch.testing.assert_close(layer(strided), layer(strided.contiguous()))


def test_batch_zero_and_one():
    layer = _layer()
    assert layer(torch.randn(0, 24)).shape == (0, 16)
    assert layer(torch.randn(1, 24)).shape == (1, 16)
    x = torch.randn(0, 24, requires_grad=True)
    layer(x).sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))


def test_init_matches_linear_output_scale():
    torch.manual_seed(0)
    x = torch.randn(4096, 512)
    sparse = SparseLinear(512, 256, density=0.05, bias=False, generator=torch.Generator().manual_seed(0))
    dense = nn.Linear(512, 256, bias=False)
    ratio = sparse(x).std() / dense(x).std()
    assert 0.9 < ratio.item() < 1.1
    fan_in = sparse.fan_in()[sparse.dst.long()].double()
    assert torch.all(sparse.weight.detach().abs().double() <= fan_in.rsqrt() + 1e-7)


def test_from_dense_and_to_dense():
    dense = nn.Linear(10, 6)
    with torch.no_grad():
        dense.weight[dense.weight.abs() < 0.15] = 0
    sparse = SparseLinear.from_dense(dense)
    assert sparse.nnz == int((dense.weight != 0).sum())
    torch.testing.assert_close(sparse.to_dense(), dense.weight)
    x = torch.randn(3, 10)
    torch.testing.assert_close(sparse(x), dense(x))
    mask = torch.zeros(6, 10, dtype=torch.bool)
    mask[0, 1] = mask[5, 9] = True
    masked = SparseLinear.from_dense(dense, mask)
    assert masked.indices().tolist() == [[0, 5], [1, 9]]
    assert masked.weight.tolist() == [dense.weight[0, 1].item(), dense.weight[5, 9].item()]
    with pytest.raises(ValueError, match="mask must have the weight's shape"):
        SparseLinear.from_dense(dense, mask[:3])


def test_indices_nnz_density_repr():
    layer = _layer(in_f=10, out_f=5, density=0.4)
    assert layer.nnz == 20 and layer.density == pytest.approx(0.4)
    idx = layer.indices()
    assert idx.shape == (2, 20) and idx.dtype == torch.int64
    dense = layer.to_dense()
    torch.testing.assert_close(dense[idx[0], idx[1]], layer.weight)
    assert int((dense != 0).sum()) <= 20
    assert "in_features=10, out_features=5, nnz=20" in repr(layer)


def test_dtype_conversion_and_dtype_errors():
    layer = _layer().to(torch.float64)
    assert layer.weight.dtype == torch.float64 and layer.row_ptr.dtype == torch.int32
    y = layer(torch.randn(3, 24, dtype=torch.float64))
    assert y.dtype == torch.float64
    with pytest.raises(TypeError, match="float32 but the layer's weight is torch.float64"):
        layer(torch.randn(3, 24))
    with pytest.raises(TypeError, match="not supported on cpu"):
        layer.to(torch.float8_e5m2)(torch.randn(3, 24).to(torch.float8_e5m2))


@pytest.mark.parametrize("block", [1, 8])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8, torch.float8_e5m2, torch.float64,
                                   torch.float16])
def test_a_dtype_mismatch_suggests_a_cast_that_works(dtype, block):
    """An input of another dtype is refused with advice that works: ``layer.to(dtype)`` only for a dtype the kernels
    run (nn.Module cannot cast a layer to an integer or bool dtype), else casting the input to the layer's dtype;
    following the advice gives nn.Linear's result."""
    layer = SparseLinear(24, 16, density=0.3, block=block)
    x = (torch.randn(3, 24) * 4).to(dtype)
    with pytest.raises(TypeError, match=f"input has dtype {dtype} but the layer's weight is torch.float32") as exc:
        layer(x)
    message = str(exc.value)
    assert f"input.to({torch.float32})" in message
    assert (f"layer.to({dtype})" in message) == (dtype in (torch.float64, torch.float16))
    with torch.no_grad():
        want = layer.to_linear().double()(x.to(torch.float32).double())
        torch.testing.assert_close(layer(x.to(torch.float32)).double(), want, rtol=1e-5, atol=1e-5)
        if dtype in (torch.float64, torch.float16):
            cast = copy.deepcopy(layer).to(dtype)
            tol = 1e-10 if dtype == torch.float64 else 1e-2
            torch.testing.assert_close(cast(x).double(), cast.to_linear().double()(x.double()), rtol=tol, atol=tol)


def test_shape_device_and_argument_errors():
    layer = _layer()
    with pytest.raises(ValueError, match="last dimension is 23 but the layer has in_features=24"):
        layer(torch.randn(3, 23))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        layer(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="input is on meta but the layer's weight is on cpu"):
        layer(torch.randn(3, 24, device="meta"))
    with pytest.raises(ValueError, match="backward must be one of"):
        _layer(backward="fast")
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        layer([1.0] * 24)


@pytest.mark.parametrize("block", [1, 8])
def test_a_weight_of_another_shape_is_refused_and_the_advised_copy_works(block):
    """``layer.weight = p`` with p not of the layer's [nnz] shape (a tie's [out, in] matrix, a longer vector) raises
    before anything changes; one of the same shape is taken, as nn.Linear takes it; the copy the message advises
    gives the layer a dense matrix's values at its connections (checked against the masked matrix in float64)."""
    layer = SparseLinear(16, 24, density=0.3, block=block, dtype=torch.float64)
    weight, values = layer.weight, layer.weight.detach().clone()
    for bad in (torch.randn(24, 16), torch.randn(layer.nnz + block), torch.randn(layer.nnz, 1)):
        with pytest.raises(ValueError, match=rf"holds the layer's {layer.nnz} edge values .*shape "
                                             rf"{re.escape(str(tuple(bad.shape)))}.*not changed"):
            layer.weight = nn.Parameter(bad.double())
        assert layer.weight is weight and torch.equal(layer.weight, values)
    replacement = nn.Parameter(torch.randn(layer.nnz, dtype=torch.float64))
    layer.weight = replacement
    assert layer.weight is replacement
    dense = torch.randn(24, 16, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(dense[layer.dst.long(), layer.src.long()])
    mask = torch.zeros(24, 16, dtype=torch.bool)
    mask[layer.dst.long(), layer.src.long()] = True
    x = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ (dense * mask).T + layer.bias, rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip_and_topology_transfer():
    a, b = _layer(seed=1), _layer(seed=2)
    assert not a.topology.same_as(b.topology)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    assert b.topology.same_as(a.topology)
    x = torch.randn(5, 24)
    torch.testing.assert_close(b(x), a(x))
    assert set(a.state_dict()) == {"weight", "bias", "row_ptr", "dst", "_extra_state"}


def test_load_changes_shape_when_checkpoint_says_so():
    small, big = _layer(in_f=8, out_f=4, density=0.5), _layer(in_f=30, out_f=20, density=0.2)
    small.load_state_dict(big.state_dict())
    assert (small.in_features, small.out_features, small.nnz) == (30, 20, big.nnz)
    torch.testing.assert_close(small(torch.ones(2, 30)), big(torch.ones(2, 30)))


def _snapshot(layer):
    return {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda sd: sd.__setitem__("dst", sd["dst"].flip(0)), "not sorted|duplicate"),
        (lambda sd: sd.__setitem__("weight", sd["weight"][:-1]), "weight must have shape"),
        (lambda sd: sd.__setitem__("row_ptr", sd["row_ptr"][:-1]), "row_ptr"),
        (lambda sd: sd.__setitem__("dst", sd["dst"] + 1000), "out of range"),
        (lambda sd: sd.__setitem__("bias", sd["bias"][:3]), "bias must have shape"),
        (lambda sd: sd.pop("dst"), "Missing key"),
    ],
)
def test_malformed_checkpoint_raises_and_leaves_layer_unchanged(corrupt, message):
    source, target = _layer(seed=1), _layer(seed=2)
    before = _snapshot(target)
    state = source.state_dict()
    corrupt(state)
    with pytest.raises(RuntimeError, match=message):
        target.load_state_dict(state)
    after = _snapshot(target)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_deepcopy_is_independent():
    layer = _layer()
    clone = copy.deepcopy(layer)
    with torch.no_grad():
        clone.weight.add_(1)
    assert not torch.equal(clone.weight, layer.weight)
    assert clone.topology.same_as(layer.topology) and clone.row_ptr.data_ptr() != layer.row_ptr.data_ptr()


def test_functional_form_matches_module():
    layer = _layer(dtype=torch.float64)
    x = torch.randn(4, 24, dtype=torch.float64)
    torch.testing.assert_close(sparse_linear(x, layer.weight, layer.topology, layer.bias), layer(x))
    torch.testing.assert_close(sparse_linear(x, layer.weight, layer.topology),
                               reference_forward(x, layer.weight, layer.topology))


def test_from_topology_and_no_bias():
    topo = CSRTopology.from_mask(torch.eye(5, dtype=torch.bool))
    layer = SparseLinear.from_topology(topo, bias=False)
    assert layer.bias is None and layer.nnz == 5
    assert "bias" not in layer.state_dict()


def test_small_model_trains():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(SparseLinear(32, 64, density=0.25, generator=g), nn.ReLU(),
                          SparseLinear(64, 4, density=0.5, generator=g))
    x = torch.randn(256, 32)
    y = (x[:, :4] * 2 - x[:, 4:8]).argmax(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    assert losses[-1] < 0.5 * losses[0]


def test_repr_shows_the_backward_strategy_by_name():
    for backward in ("auto", "fused_atomic", "atomic_free"):
        text = repr(_layer(backward=backward))
        assert text.endswith(f"bias=True, backward='{backward}')") and "Strategy" not in text


CASTS = {  # every way a cast reaches the buffers: only floating tensors are values
    "type(float64)": lambda m: m.type(torch.float64),
    "double()": lambda m: m.double(),
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
    "to(float64)": lambda m: m.to(torch.float64),
    "to(cpu, float64)": lambda m: m.to("cpu", torch.float64),
    "float()": lambda m: m.float(),
    "_apply(integers to int64)": lambda m: m._apply(lambda t: t if t.is_floating_point() else t.long()),
    "_apply(type float16)": lambda m: m._apply(lambda t: t.type(torch.float16)),
}


@pytest.mark.parametrize("through_parent", [False, True], ids=["layer", "parent"])
@pytest.mark.parametrize("cast", list(CASTS))
def test_casts_keep_the_index_buffers_int32_and_their_values(cast, through_parent):
    layer = SparseLinear(300, 40, density=0.3, generator=torch.Generator().manual_seed(0))  # indices past fp16's 2048
    index = {name: buf.clone() for name, buf in layer.named_buffers() if name != "_extra_state"}
    record = layer.get_buffer("_extra_state").clone()  # the shape record (int64) as a buffer
    CASTS[cast](nn.Sequential(layer) if through_parent else layer)
    for name, before in index.items():
        assert getattr(layer, name).dtype == torch.int32 and torch.equal(getattr(layer, name), before), name
    assert torch.equal(layer.get_buffer("_extra_state"), record) and record.tolist() == [2, 300, 40, 1]
    layer.topology.validate()
    if layer.weight.dtype in (torch.float32, torch.float64):
        x = torch.randn(3, 300, dtype=layer.weight.dtype)
        want = x.double() @ layer.to_dense().double().T + layer.bias.double()
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_share_memory_shares_the_index_buffers():
    layer = _layer()
    dst = layer.dst.clone()
    layer.share_memory()
    assert all(t.is_shared() for t in (*layer.parameters(), *layer.buffers())) and torch.equal(layer.dst, dst)


def test_pickled_module_round_trip_like_nn_linear():
    meta = SparseLinear(12, 6, density=0.5, device="meta", generator=torch.Generator().manual_seed(3))
    for layer in (_layer(), meta):
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        clone = copy.deepcopy(layer)
        if layer.weight.is_meta:  # the construction's seed travels: all three materialise alike
            for m in (layer, loaded, clone):
                m.to_empty(device="cpu").reset_parameters()
        x = torch.randn(4, layer.in_features)
        torch.testing.assert_close(loaded(x), layer(x), rtol=0, atol=0)
        torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
        assert repr(loaded) == repr(layer)


def test_module_entry_points_like_nn_linear():
    layer = _layer()
    layer(torch.randn(2, 24)).sum().backward()
    layer.zero_grad()
    assert layer.weight.grad is None and layer.bias.grad is None  # set_to_none, as nn.Linear
    layer.requires_grad_(False)
    assert not any(p.requires_grad for p in layer.parameters())
    assert not layer(torch.randn(2, 24)).requires_grad
    kept = layer.state_dict(keep_vars=True)
    assert kept["weight"] is layer.weight and kept["row_ptr"] is layer.row_ptr
    state = _layer(seed=5).state_dict()
    assert state._metadata[""]["version"] == nn.Linear(2, 2).state_dict()._metadata[""]["version"]
    layer.load_state_dict(state)  # with torch's _metadata
    assert torch.equal(layer.dst, state["dst"])


def test_registered_buffers_and_modules_load_with_the_layer():
    source, target = _layer(seed=1), _layer(seed=2)
    for layer, value in ((source, 3.0), (target, 1.0)):
        layer.register_buffer("scale", torch.tensor(value))
        layer.register_module("norm", nn.LayerNorm(4))
    with torch.no_grad():
        source.norm.weight.fill_(2.0)
    target.load_state_dict(source.state_dict())
    assert float(target.scale) == 3.0 and torch.equal(target.norm.weight, source.norm.weight)
    assert target.topology.same_as(source.topology)
    before = _snapshot(target)
    bad = {**source.state_dict(), "scale": torch.zeros(3)}
    with pytest.raises(RuntimeError, match="size mismatch for scale"):
        target.load_state_dict(bad)
    after = _snapshot(target)
    assert all(torch.equal(before[k], after[k]) for k in before)
