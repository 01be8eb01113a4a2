"""Conversions between SparseLinear, torch.sparse tensors and nn.Linear, and sparsify(model): one convention
everywhere (PyTorch's: a weight is [out_features, in_features]; indices() row 0 is the output index), checked on
non-square layers so a transposition cannot pass."""

from __future__ import annotations

import copy
import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, sparsify


def _sparse_weight(out_features: int = 5, in_features: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=g)
    dense[torch.rand(out_features, in_features, generator=g) < 0.6] = 0.0
    dense[1, 2] = 0.0
    return dense


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr"])
def test_from_sparse_keeps_the_matrix_not_its_transpose(layout):
    dense = _sparse_weight()
    sparse = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc(),
              "bsr": dense.to_sparse_bsr((1, 1))}[layout]
    layer = SparseLinear.from_sparse(sparse, bias=torch.arange(5.0))
    assert (layer.out_features, layer.in_features) == (5, 7)
    torch.testing.assert_close(layer.to_dense(), dense)
    x = torch.randn(3, 7)
    torch.testing.assert_close(layer(x), x @ dense.T + torch.arange(5.0))


def test_explicit_zeros_stay_edges():
    idx = torch.tensor([[0, 1, 1], [2, 0, 3]])
    sparse = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 0.0, 2.0]), (2, 4))
    layer = SparseLinear.from_sparse(sparse)
    assert layer.nnz == 3 and sorted(map(tuple, layer.indices().T.tolist())) == [(0, 2), (1, 0), (1, 3)]


def test_round_trip_through_torch_sparse_csr():
    layer = SparseLinear(9, 4, density=0.4, generator=torch.Generator().manual_seed(1))
    csr = layer.to_sparse_csr()
    assert csr.layout == torch.sparse_csr and csr.shape == (4, 9)
    torch.testing.assert_close(csr.to_dense(), layer.to_dense())
    back = SparseLinear.from_sparse(csr, layer.bias.detach())
    assert back.topology.same_as(layer.topology)
    torch.testing.assert_close(back.weight, layer.weight)


def test_to_sparse_csr_is_differentiable():
    layer = SparseLinear(6, 3, density=0.5, bias=False, generator=torch.Generator().manual_seed(2))
    x = torch.randn(6, 2)
    (layer.to_sparse_csr() @ x).sum().backward()
    ref = x.sum(1)[layer.src.long()]  # d/dw[e] of sum(W @ x) = sum_j x[src[e], j]
    torch.testing.assert_close(layer.weight.grad, ref)


def test_from_indices_uses_the_indices_convention():
    layer = SparseLinear(8, 3, density=0.5, generator=torch.Generator().manual_seed(3))
    shuffled = torch.randperm(layer.nnz, generator=torch.Generator().manual_seed(4))
    topo, order = CSRTopology.from_indices(layer.indices()[:, shuffled], in_features=8, out_features=3)
    assert topo.same_as(layer.topology)
    assert torch.equal(shuffled[order], torch.arange(layer.nnz))  # values[order] realigns shuffled values
    with pytest.raises(ValueError, match=r"indices\[0\] \(output\)"):
        CSRTopology.from_indices(torch.tensor([[3], [0]]), in_features=8, out_features=3)


def test_to_linear_computes_the_same_function():
    layer = SparseLinear(10, 6, density=0.3, generator=torch.Generator().manual_seed(5))
    x = torch.randn(4, 10)
    torch.testing.assert_close(layer.to_linear()(x), layer(x))


def test_init_weight_applies_nn_init():
    layer = SparseLinear(20, 10, density=0.5, generator=torch.Generator().manual_seed(6))
    dst = layer.dst.clone()
    layer.init_weight_(nn.init.constant_, 0.25)
    assert torch.all(layer.weight == 0.25) and torch.equal(layer.dst, dst)
    layer.init_weight_(nn.init.xavier_uniform_)
    bound = (6 / 30) ** 0.5
    assert layer.weight.abs().max() <= bound and layer.weight.std() > 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Sequential(nn.Linear(9, 5), nn.Tanh()), nn.Linear(5, 2))


def test_sparsify_by_magnitude_keeps_the_largest_weights():
    model = _model()
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    sparsify(model, density=0.3)
    for name, weight in dense.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, SparseLinear) and layer.nnz == CSRTopology.random_edge_count(*weight.shape[::-1], 0.3)
        kept = layer.to_dense() != 0
        assert weight.abs()[kept].min() >= weight.abs()[~kept].max()
        torch.testing.assert_close(layer.to_dense()[kept], weight[kept])


def test_sparsify_density_one_is_the_same_model():
    model = _model()
    x = torch.randn(3, 12)
    ref = model(x)
    torch.testing.assert_close(sparsify(model, density=1.0)(x), ref)


def test_sparsify_random_filter_and_masks():
    a = sparsify(_model(), density=0.5, method="random", generator=torch.Generator().manual_seed(7))
    b = sparsify(_model(), density=0.5, method="random", generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0].dst, b[0].dst)
    only_first = sparsify(_model(), density=0.5, filter=lambda name, m: name == "0")
    assert isinstance(only_first[0], SparseLinear) and type(only_first[2][0]) is nn.Linear
    mask = torch.zeros(5, 9, dtype=torch.bool)
    mask[0, 0] = mask[4, 8] = True
    masked = sparsify(_model(), masks={"2.0": mask}, filter=lambda name, m: name == "2.0")
    assert masked[2][0].nnz == 2


def test_sparsify_checks_everything_before_changing_anything():
    model = _model()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match="mask for '3' must be a bool tensor of shape"):
        sparsify(model, density=0.5, masks={"3": torch.ones(2, 5)})
    assert all(type(m) is type(n) for m, n in zip(model.modules(), before.modules()))
    with pytest.raises(ValueError, match="not nn.Linear layers"):
        sparsify(model, density=0.5, masks={"1": torch.ones(1, dtype=torch.bool)})
    with pytest.raises(ValueError, match="pass density"):
        sparsify(model)


def test_sparsify_example_runs(capsys):
    """examples/sparsify_model.py: dense training, sparsify, fine-tuning, with tiny settings."""
    path = Path(__file__).resolve().parents[1] / "examples" / "sparsify_model.py"
    spec = importlib.util.spec_from_file_location("sparsify_model_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "20", "--finetune-steps", "10", "--d-model", "32", "--context", "32",
                           "--batch-size", "4", "--eval-chars", "2048"])
    assert set(results) == {"dense", "sparsified", "fine-tuned"}
    assert all(math.isfinite(v) and 0 < v < 10 for v in results.values())
    assert "| sparsified to density 0.25 (8 SparseLinear layers) |" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- sparsify's rules
def _assert_unchanged(model: nn.Module, before: nn.Module) -> None:
    """Same module objects' types under the same names, same sharing, same parameter values and flags."""
    now = [(n, type(m)) for n, m in model.named_modules(remove_duplicate=False)]
    assert now == [(n, type(m)) for n, m in before.named_modules(remove_duplicate=False)]
    params = dict(model.named_parameters(remove_duplicate=False))
    ref = dict(before.named_parameters(remove_duplicate=False))
    assert params.keys() == ref.keys()
    for name, p in params.items():
        assert torch.equal(p, ref[name]) and p.requires_grad == ref[name].requires_grad, name
    sharing = {n: [k for k, q in params.items() if q is p] for n, p in params.items()}
    assert sharing == {n: [k for k, q in ref.items() if q is p] for n, p in ref.items()}


def _random_mask(shape, seed, density=0.4):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density


class _Shared(nn.Module):
    """One nn.Linear registered under two names (and reached through a third path via a shared container)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = self.a
        self.block = nn.Sequential(nn.Linear(6, 6))
        self.again = self.block

    def forward(self, x):
        return self.again(self.b(torch.tanh(self.a(x))))


def test_sparsify_replaces_a_shared_linear_under_every_name_with_one_layer():
    torch.manual_seed(1)
    model = _Shared()
    dense = copy.deepcopy(model)
    mask_a, mask_block = _random_mask((6, 6), 2), _random_mask((6, 6), 3)
    sparsify(model, masks={"b": mask_a, "again.0": mask_block})  # masks keyed by any of a layer's names
    assert isinstance(model.a, SparseLinear) and model.a is model.b
    assert isinstance(model.block[0], SparseLinear) and model.block is model.again
    assert len(list(model.parameters())) == 4  # two layers, each weight and bias once
    with torch.no_grad():
        dense.a.weight.mul_(mask_a)
        dense.block[0].weight.mul_(mask_block)
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(model.double()(x), dense.double()(x))


def test_sparsify_refuses_a_filter_or_masks_that_split_a_shared_linear():
    model = _Shared()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"filter accepts \['a'\] but rejects \['b'\].*make filter agree"):
        sparsify(model, density=0.5, filter=lambda name, m: name != "b")
    with pytest.raises(ValueError, match="masks given for both 'a' and 'b'"):
        sparsify(model, masks={"a": _random_mask((6, 6), 0), "b": _random_mask((6, 6), 1)}, density=0.5)
    _assert_unchanged(model, before)


def test_sparsify_keeps_requires_grad_training_flag_device_and_dtype():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4), nn.Linear(4, 3, bias=False)).double()
    model[0].weight.requires_grad_(False)  # a frozen weight with a trainable bias
    model[2].requires_grad_(False)  # a frozen layer
    model[2].eval()
    sparsify(model, density=0.5)
    assert all(isinstance(model[i], SparseLinear) for i in (0, 2, 3))
    flags = [(p.requires_grad, p.dtype, p.device.type) for p in model.parameters()]
    assert flags == [(False, torch.float64, "cpu"), (True, torch.float64, "cpu"), (False, torch.float64, "cpu"),
                     (False, torch.float64, "cpu"), (True, torch.float64, "cpu")]
    assert [m.training for m in model] == [True, True, False, True]
    model(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    assert model[0].weight.grad is None and model[0].bias.grad is not None and model[2].weight.grad is None


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


def test_sparsify_refuses_tied_weights_naming_both_places():
    model = _TiedLM()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"weight of the nn.Linear at 'head' is the same Parameter as "
                                         r"\['embed.weight'\].*filter=lambda name, m: name not in \['head'\]"):
        sparsify(model, density=0.5)
    _assert_unchanged(model, before)
    sparsify(model, density=0.5, filter=lambda name, m: name not in ["head"])  # what the message says to do
    assert isinstance(model.body, SparseLinear) and model.head.weight is model.embed.weight


def test_sparsify_refuses_a_parameter_shared_by_two_linears():
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    model[1].bias = model[0].bias
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"bias of the nn.Linear at '0' is the same Parameter as \['1.bias'\]"
                                         r".*name not in \['0', '1'\]"):
        sparsify(model, density=0.5)
    _assert_unchanged(model, before)


def test_sparsify_of_a_linear_returns_the_sparse_layer():
    linear = nn.Linear(9, 4).double()
    mask = _random_mask((4, 9), 5)
    sparse = sparsify(linear, masks={"": mask})
    assert isinstance(sparse, SparseLinear) and list(linear.named_children()) == []
    x = torch.randn(3, 9, dtype=torch.float64)
    torch.testing.assert_close(sparse(x), x @ (linear.weight * mask).T + linear.bias)
    assert sparsify(linear, density=0.5, filter=lambda name, m: False) is linear


def test_sparsify_lazy_linear_needs_a_forward_first():
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"at '1': it is an uninitialised nn.LazyLinear: run a forward pass first"):
        sparsify(model, density=0.5)
    assert type(model[0]) is nn.Linear and type(model[1]) is type(before[1])
    x = torch.randn(2, 4)
    ref = model(x)  # initialises it: it becomes an nn.Linear
    sparsify(model, density=1.0)
    assert isinstance(model[1], SparseLinear)
    torch.testing.assert_close(model(x), ref)


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_sparsify_keeps_attention_out_proj_dense_and_refuses_linear_subclasses():
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2, batch_first=True), "ff": nn.Linear(8, 8)})
    sparsify(model, density=0.5)
    assert isinstance(model["ff"], SparseLinear) and type(model["attn"].out_proj).__name__ == \
        "NonDynamicallyQuantizableLinear"
    x = torch.randn(2, 3, 8)
    assert model["attn"](x, x, x)[0].shape == (2, 3, 8)

    model = nn.Sequential(nn.Linear(4, 4), _ScaledLinear(4, 4))
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"at '1': it is a _ScaledLinear, a subclass of nn.Linear.*filter="):
        sparsify(model, density=0.5)
    _assert_unchanged(model, before)
    sparsify(model, density=0.5, filter=lambda name, m: type(m) is nn.Linear)
    assert isinstance(model[0], SparseLinear) and type(model[1]) is _ScaledLinear


def _with_hook(m):
    m.register_forward_hook(lambda *a: None)
    return m


def _with_param_hook(m):
    m.weight.register_post_accumulate_grad_hook(lambda p: None)
    return m


def _meta(m):
    return m.to("meta")


@pytest.mark.parametrize("make, message", [
    (lambda m: nn.utils.parametrizations.weight_norm(m), "parametrizations"),
    (lambda m: nn.utils.weight_norm(m), r"holds \['weight_g', 'weight_v'\]"),
    (_with_hook, r"hooks \(forward_hooks\)"),
    (_with_param_hook, r"hooks \(weight.post_accumulate_grad_hooks\)"),
    (_meta, "meta device"),
])
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
def test_sparsify_refuses_state_a_sparse_layer_would_drop(make, message):
    model = nn.Sequential(nn.Linear(4, 4), make(nn.Linear(4, 4)))
    types = [type(m) for m in model]
    with pytest.raises(ValueError, match=message + r".*nothing was changed"):
        sparsify(model, density=0.5)
    assert [type(m) for m in model] == types


def _encoder_and_masks(activation: str, nested: bool):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.1, activation=activation, batch_first=True,
                                       dtype=torch.float64)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
    masks = {f"layers.{i}.{name}": _random_mask(encoder.get_submodule(f"layers.{i}.{name}").weight.shape, 10 * i + j)
             for i in range(2) for j, name in enumerate(["linear1", "linear2"])}
    return encoder, masks


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("padding", [False, True])
def test_sparsified_transformer_encoder_runs_in_eval_without_grad(activation, no_grad, padding):
    encoder, masks = _encoder_and_masks(activation, nested=True)
    dense = copy.deepcopy(encoder)
    sparsify(encoder, masks=masks)
    with torch.no_grad():
        for name, mask in masks.items():
            dense.get_submodule(name).weight.mul_(mask)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = pad[2, 2:] = True
    kwargs = {"src_key_padding_mask": pad} if padding else {}
    encoder.eval()
    dense.eval()
    ref = dense(x, **kwargs)  # grad enabled and parameters requiring it: torch's unfused path
    with no_grad():
        out = encoder(x, **kwargs)
        out_layer = encoder.layers[0](x, **({"src_key_padding_mask": pad} if padding else {}))
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(out_layer, dense.layers[0](x, **kwargs).detach())
    assert encoder.layers[0].activation is dense.layers[0].activation


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_hand_placed_sparse_layers_keep_an_encoder_layer_off_its_fused_kernel(activation, no_grad):
    # Assigned by hand, not by sparsify: the layer's eval, no-grad forward must still call the SparseLinears.
    torch.manual_seed(int(torch.randint(1000, (1,))))
    dense = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.1, activation=activation, batch_first=True,
                                       dtype=torch.float64).eval()
    layer = copy.deepcopy(dense)
    for name in ("linear1", "linear2"):
        linear = getattr(dense, name)
        mask = _random_mask(linear.weight.shape, len(name))
        with torch.no_grad():
            linear.weight.mul_(mask)
        setattr(layer, name, SparseLinear.from_dense(linear, mask))
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    ref = dense(x)  # grad enabled with parameters requiring it: torch's unfused path
    with no_grad():
        out = layer(x)
    torch.testing.assert_close(out, ref.detach())
    assert dense.activation_relu_or_gelu == layer.activation_relu_or_gelu  # nothing of the layer was changed


def test_a_nested_input_is_refused_with_what_to_do():
    layer = nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True)
    layer.linear1 = SparseLinear(16, 24, density=0.5)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x, pad = torch.randn(3, 7, 16), torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    with torch.no_grad(), warnings.catch_warnings(), \
            pytest.raises(ValueError, match="nested tensor.*enable_nested_tensor=False"):
        warnings.simplefilter("ignore")  # torch's note that nested tensors are a prototype
        encoder(x, src_key_padding_mask=pad)
    nested = torch.nested.nested_tensor([torch.randn(2, 16), torch.randn(5, 16)])
    with pytest.raises(ValueError, match="nested tensor"):
        SparseLinear(16, 4)(nested)
    encoder.use_nested_tensor = False  # what the message says: the encoder then computes as in training mode
    with torch.no_grad():
        out = encoder(x, src_key_padding_mask=pad)
    encoder.train()
    torch.testing.assert_close(out, encoder(x, src_key_padding_mask=pad).detach())
