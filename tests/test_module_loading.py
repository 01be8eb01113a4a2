"""Loading and materialising SparseLinear as nn.Linear is loaded: partial checkpoints with ``strict=False``,
``assign=True`` onto a meta-built model, ``to_empty`` then ``reset_parameters`` from any device, layers wrapped by
``torch.nn.utils.parametrize`` and ``torch.nn.utils.prune``, and ``to_sparse_csr`` without torch's beta warnings.
Each case is checked against torch's own behaviour for ``nn.Linear`` and a float64 dense reference."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from torch_sparse_metal import CSRTopology, SparseLinear
from torch_sparse_metal_tools.testing.reference import reference_forward
from tsm_dev.snapshot import changes, snapshot


def _layer(seed: int, n_in: int = 12, n_out: int = 7, density: float = 0.4, **kw) -> SparseLinear:
    return SparseLinear(n_in, n_out, density=density, generator=torch.Generator().manual_seed(seed), **kw)


def _seed() -> int:
    return int(torch.randint(2**31, (1,)))


def _reference(x: torch.Tensor, layer: SparseLinear) -> torch.Tensor:
    """The layer's function in float64, from its indices and values."""
    out = reference_forward(x, layer.weight, layer.topology)
    return out + layer.bias.detach().double() if layer.bias is not None else out


def _assert_computes(layer: SparseLinear, x: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def _edges(layer: SparseLinear) -> set[tuple[int, int]]:
    return set(map(tuple, layer.indices().T.tolist()))


def _refuses(layer: nn.Module, sd: dict, match: str, **load_kwargs) -> dict:
    """``layer.load_state_dict(sd, **load_kwargs)`` raises a RuntimeError matching ``match`` and leaves the layer
    bitwise as it was; returns its snapshot."""
    before = snapshot(layer)
    with pytest.raises(RuntimeError, match=match):
        layer.load_state_dict(sd, **load_kwargs)
    assert changes(before, layer) == []
    return before


# ------------------------------------------------------------------------------------ partial checkpoints (item 1)
def test_without_bias_loads_weight_and_topology_and_keeps_the_bias_like_linear():
    dense_src, dense_dst = nn.Linear(12, 7), nn.Linear(12, 7)
    kept_bias = dense_dst.bias.detach().clone()
    sd = dense_src.state_dict()
    del sd["bias"]
    linear_result = dense_dst.load_state_dict(sd, strict=False)
    assert torch.equal(dense_dst.weight, dense_src.weight) and torch.equal(dense_dst.bias, kept_bias)  # torch's rule

    source, target = _layer(_seed()), _layer(_seed())
    bias = target.bias.detach().clone()
    sd = source.state_dict()
    del sd["bias"]
    result = target.load_state_dict(sd, strict=False)
    assert result.missing_keys == linear_result.missing_keys == ["bias"] and result.unexpected_keys == []
    assert _edges(target) == _edges(source) and torch.equal(target.weight, source.weight)
    assert torch.equal(target.bias, bias)
    x = torch.randn(5, 12)
    want = x.double() @ source.to_dense().double().T + bias.double()
    _assert_computes(target, x, want)


def test_without_bias_through_a_parent_model():
    source = nn.Sequential(_layer(_seed()), nn.ReLU(), _layer(_seed(), 7, 3))
    target = nn.Sequential(_layer(_seed()), nn.ReLU(), _layer(_seed(), 7, 3))
    kept = target[2].bias.detach().clone()
    sd = source.state_dict()
    del sd["2.bias"]
    result = target.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["2.bias"]
    assert _edges(target[0]) == _edges(source[0]) and _edges(target[2]) == _edges(source[2])
    assert torch.equal(target[2].weight, source[2].weight) and torch.equal(target[2].bias, kept)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2.bias"'):
        target.load_state_dict(sd)  # strict: torch's rule inside a model


def test_without_bias_of_another_out_features_refuses():
    target = _layer(_seed())
    sd = _layer(_seed(), 12, 5).state_dict()
    del sd["bias"]
    _refuses(target, sd, r"bias is missing, and the checkpoint's layer has out_features=5", strict=False)


def test_weight_without_topology_loads_onto_the_layers_own_edges():
    target = _layer(_seed())
    edges = _edges(target)
    values = torch.randn(target.nnz)
    result = target.load_state_dict({"weight": values}, strict=False)
    assert sorted(result.missing_keys) == ["_extra_state", "bias", "dst", "row_ptr"]
    assert _edges(target) == edges and torch.equal(target.weight.detach(), values)


@pytest.mark.parametrize("size_change", [-1, 1, 20])
def test_weight_without_topology_of_another_size_refuses(size_change):
    target = _layer(_seed())
    _refuses(target, {"weight": torch.randn(target.nnz + size_change)},
             "to match the layer's topology, as the checkpoint has none", strict=False)


@pytest.mark.parametrize("present", ["row_ptr", "dst"])
def test_half_a_topology_refuses(present):
    target = _layer(_seed())
    sd = _layer(_seed()).state_dict()
    del sd["dst" if present == "row_ptr" else "row_ptr"]
    _refuses(target, sd, f"{present} comes without .*the topology needs both", strict=False)


def test_topology_without_weight():
    target = _layer(_seed())
    sd = _layer(_seed()).state_dict()
    del sd["weight"]
    before = _refuses(target, sd, "weight is missing, and the checkpoint's topology has other edges", strict=False)
    own = target.state_dict()  # the same edges: nothing to place, the weight stays
    new_bias = torch.randn(7)
    own = {**{k: v for k, v in own.items() if k != "weight"}, "bias": new_bias}
    assert target.load_state_dict(own, strict=False).missing_keys == ["weight"]
    assert torch.equal(target.weight, before["module.weight"]) and torch.equal(target.bias.detach(), new_bias)


def test_weight_alone_onto_a_layer_without_topology_refuses():
    layer = SparseLinear(12, 7, density=0.4, device="meta").to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="the layer holds no topology"):
        layer.load_state_dict({"weight": torch.randn(layer.nnz)}, strict=False)


# ------------------------------------------------------------------------------------- assign=True on meta (item 2)
def _model(density: float = 0.4) -> nn.Sequential:
    return nn.Sequential(SparseLinear(12, 9, density=density), nn.ReLU(), nn.Linear(9, 6),
                         SparseLinear(6, 3, density=0.5, bias=False))


def test_assign_onto_a_meta_model_gives_the_checkpoints_model():
    source = _model()
    with torch.device("meta"):
        model = _model(density=0.2)  # another edge count: the checkpoint decides
    sd = source.state_dict()
    result = model.load_state_dict(sd, assign=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(4, 12)
    torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    for key in ("0.weight", "0.bias", "2.weight", "3.weight", "0.row_ptr", "0.dst"):  # torch's assign: no copies
        assert model.state_dict()[key].data_ptr() == sd[key].data_ptr(), key
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    for layer in (model[0], model[3]):
        layer.topology.validate()
        assert _edges(layer) == _edges(source[0] if layer is model[0] else source[3])


def test_assign_keeps_the_modules_requires_grad_and_takes_parameters_as_nn_linear():
    source = _layer(_seed())
    with torch.device("meta"):
        layer, linear = SparseLinear(12, 7, density=0.4), nn.Linear(12, 7)
    layer.requires_grad_(False)
    linear.requires_grad_(False)
    sd, lsd = source.state_dict(keep_vars=True), nn.Linear(12, 7).state_dict(keep_vars=True)
    layer.load_state_dict(sd, assign=True)
    linear.load_state_dict(lsd, assign=True)
    assert (layer.weight is sd["weight"]) == (linear.weight is lsd["weight"]) is True
    assert layer.weight.requires_grad == linear.weight.requires_grad is False


def test_assign_converts_index_arrays_the_kernels_cannot_take():
    source = _layer(_seed())
    sd = {k: (v.long() if k in ("row_ptr", "dst") else v) for k, v in source.state_dict().items()}
    with torch.device("meta"):
        layer = SparseLinear(12, 7, density=0.4)
    layer.load_state_dict(sd, assign=True)
    assert layer.row_ptr.dtype == layer.dst.dtype == torch.int32
    x = torch.randn(3, 12)
    torch.testing.assert_close(layer(x), source(x), rtol=0, atol=0)


def test_assign_takes_the_checkpoints_dtype_as_nn_linear():
    source = _layer(_seed(), dtype=torch.float64)
    layer, linear = _layer(_seed()), nn.Linear(2, 2)
    layer.load_state_dict(source.state_dict(), assign=True)
    linear.load_state_dict(nn.Linear(2, 2, dtype=torch.float64).state_dict(), assign=True)
    assert layer.weight.dtype == layer.bias.dtype == linear.weight.dtype == torch.float64
    x = torch.randn(3, 12, dtype=torch.float64)
    _assert_computes(layer, x, _reference(x, source))


def test_assign_of_a_weight_and_bias_of_different_dtypes_refuses():
    layer = _layer(_seed())
    sd = _layer(_seed()).state_dict()
    sd["bias"] = sd["bias"].double()
    _refuses(layer, sd, "different dtypes or devices", assign=True)


def test_copy_onto_meta_is_a_no_op_with_torchs_warning():
    with torch.device("meta"):
        layer, linear = SparseLinear(12, 7, density=0.4), nn.Linear(12, 7)
    with pytest.warns(UserWarning, match="copying from a non-meta parameter .* which is a no-op"):
        linear.load_state_dict(nn.Linear(12, 7).state_dict())
    with pytest.warns(UserWarning, match="copying from a non-meta parameter .* which is a no-op"):
        layer.load_state_dict(_layer(_seed()).state_dict())
    assert layer.weight.is_meta and layer.dst.is_meta
    layer.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="reset_parameters"):
        layer(torch.randn(2, 12))  # still without a topology: nothing was loaded


# ------------------------------------------------------------------------------ to_empty + reset_parameters (item 3)
def _from_topology() -> SparseLinear:
    return SparseLinear.from_topology(CSRTopology.from_mask(torch.rand(7, 12) < 0.3))


def _from_dense() -> SparseLinear:
    return SparseLinear.from_dense(nn.Linear(12, 7), mask=torch.rand(7, 12) < 0.5)


BUILDERS = {"density": lambda: _layer(_seed()), "from_topology": _from_topology, "from_dense": _from_dense}


def _reset_all(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


@pytest.mark.parametrize("through_parent", [False, True], ids=["layer", "parent"])
@pytest.mark.parametrize("build", list(BUILDERS))
def test_to_empty_keeps_the_topology_and_reset_parameters_initialises(build, through_parent):
    layer = BUILDERS[build]()
    edges, index = _edges(layer), {n: getattr(layer, n).clone() for n in ("row_ptr", "dst", "perm", "col_ptr")}
    model = nn.Sequential(layer, nn.Linear(7, 2))
    (model if through_parent else layer).to_empty(device="cpu")
    _reset_all(model)
    assert _edges(layer) == edges and all(torch.equal(getattr(layer, n), t) for n, t in index.items())
    layer.topology.validate()
    bound = layer.fan_in().clamp(min=1).double().rsqrt()[layer.dst.long()]
    assert (layer.weight.detach().double().abs() <= bound).all()  # nn.Linear's scale per output's fan-in
    x = torch.randn(4, 12)
    _assert_computes(layer, x, _reference(x, layer))


def test_a_density_layer_moved_to_meta_draws_a_new_topology_of_its_edge_count():
    layer = _layer(_seed())
    nnz = layer.nnz
    layer.to("meta").to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="reset_parameters"):
        layer(torch.randn(2, 12))
    with pytest.raises(RuntimeError, match="to_dense.*hold no topology"):
        layer.to_dense()
    layer.reset_parameters(generator=torch.Generator().manual_seed(5))
    assert layer.nnz == nnz
    CSRTopology.from_csr(layer.row_ptr, layer.dst, 12, 7).validate()  # sorted, in range, no duplicates
    x = torch.randn(3, 12)
    _assert_computes(layer, x, _reference(x, layer))
    again = _layer(_seed()).to("meta").to_empty(device="cpu")
    again.reset_parameters(generator=torch.Generator().manual_seed(5))
    assert _edges(again) == _edges(layer)  # the generator makes the draw reproducible


@pytest.mark.parametrize("build", ["from_topology", "from_dense"])
def test_a_given_topology_lost_on_meta_refuses_reset_and_a_checkpoint_restores_it(build):
    layer = BUILDERS[build]()
    trained = BUILDERS[build]()
    layer.to("meta").to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="given.*not drawn from a density.*load_state_dict"):
        layer.reset_parameters()
    with pytest.raises(RuntimeError, match="reset_parameters"):
        layer(torch.randn(2, 12))
    layer.load_state_dict(trained.state_dict())
    x = torch.randn(3, 12)
    torch.testing.assert_close(layer(x), trained(x), rtol=0, atol=0)


def test_from_topology_on_meta_materialises_the_given_topology():
    topology = CSRTopology.from_mask(torch.rand(7, 12) < 0.3)
    with torch.device("meta"):
        layer = SparseLinear.from_topology(topology)
    assert layer.weight.is_meta
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.equal(layer.dst, topology.dst) and torch.equal(layer.row_ptr, topology.row_ptr)


# --------------------------------------------------------------------------------- parametrize and prune (item 4)
class _Scale(nn.Module):
    """A parametrization with state of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor(1.0) + torch.rand(()))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.factor


def _parametrized(seed: int, names=("weight", "bias"), **kw) -> SparseLinear:
    layer = _layer(seed, **kw)
    for name in names:
        parametrize.register_parametrization(layer, name, _Scale())
    return layer


def _pruned(seed: int, amount: float = 0.5, **kw) -> SparseLinear:
    layer = _layer(seed, **kw)
    prune.l1_unstructured(layer, "weight", amount)
    prune.random_unstructured(layer, "bias", 0.3)
    return layer


WRAPPED = {"parametrize weight": lambda s, **kw: _parametrized(s, ("weight",), **kw),
           "parametrize bias": lambda s, **kw: _parametrized(s, ("bias",), **kw),
           "parametrize both": lambda s, **kw: _parametrized(s, **kw),
           "prune": lambda s, **kw: _pruned(s, **kw)}


def test_torch_loads_an_nn_linear_under_the_same_wrappings():
    for wrap in (lambda m: parametrize.register_parametrization(m, "weight", _Scale()),
                 lambda m: prune.l1_unstructured(m, "weight", 0.5)):
        a, b = nn.Linear(4, 3), nn.Linear(4, 3)
        wrap(a)
        wrap(b)
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("wrap", list(WRAPPED))
def test_a_wrapped_layer_loads_its_own_checkpoint_and_a_fresh_one_loads_it(wrap):
    source = WRAPPED[wrap](_seed())
    x = torch.randn(4, 12)
    want = source(x).detach()
    assert source.load_state_dict(source.state_dict()).missing_keys == []
    torch.testing.assert_close(source(x), want, rtol=0, atol=0)
    fresh = WRAPPED[wrap](_seed())  # another topology of the same edge count, identically wrapped
    assert _edges(fresh) != _edges(source)
    fresh.load_state_dict(source.state_dict())
    assert _edges(fresh) == _edges(source)
    torch.testing.assert_close(fresh(x), want, rtol=0, atol=0)
    assert torch.equal(fresh.weight, source.weight) and torch.equal(fresh.bias, source.bias)


def test_a_pruned_layer_loads_a_pruned_checkpoint_of_another_size_and_trains():
    source = _pruned(_seed(), n_out=5, density=0.2)
    target = _pruned(_seed())
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    target.load_state_dict(source.state_dict())
    x = torch.randn(4, 12)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    assert target.nnz == source.nnz and target.weight_mask.shape == (source.nnz,)
    target(x).square().sum().backward()
    optimizer.step()
    assert target.weight_orig.grad.shape == (source.nnz,)


@pytest.mark.parametrize("wrap", ["parametrize weight", "parametrize bias"])
def test_a_parametrized_layer_refuses_a_checkpoint_of_another_size(wrap):
    target = WRAPPED[wrap](_seed())
    _refuses(target, WRAPPED[wrap](_seed(), n_out=5, density=0.2).state_dict(),
             "is parametrized, and the checkpoint's topology would change its size.*remove_parametrizations")


@pytest.mark.parametrize("wrap", list(WRAPPED))
def test_a_malformed_checkpoint_leaves_a_wrapped_layer_unchanged(wrap):
    target = WRAPPED[wrap](_seed())
    before = snapshot(target)
    for corrupt in (lambda sd: sd.__setitem__("dst", sd["dst"].flip(0)),
                    lambda sd: sd.__setitem__(next(k for k in sd if k.endswith("factor") or k.endswith("_mask")),
                                              torch.zeros(3))):
        sd = WRAPPED[wrap](_seed()).state_dict()
        corrupt(sd)
        with pytest.raises(RuntimeError, match="nothing was loaded|not sorted|duplicate|size mismatch"):
            target.load_state_dict(sd)
        assert changes(before, target) == []


# ------------------------------------------------------------------------------------- to_sparse_csr (item 7)
def _warnings_in_a_fresh_interpreter(statement: str) -> list[str]:
    """The warnings ``statement`` emits in a new process (torch emits these two once per process)."""
    code = ("import warnings, torch\n"
            "from torch_sparse_metal import SparseLinear\n"
            "layer = SparseLinear(16, 8, density=0.25)\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            f"    csr = {statement}\n"
            "assert torch.equal(csr.to_dense(), layer.to_dense().detach())\n"
            "print('\\n'.join(str(w.message).splitlines()[0] for w in caught))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return [line for line in out.stdout.splitlines() if line]


def test_to_sparse_csr_lets_no_torch_warning_escape():
    assert _warnings_in_a_fresh_interpreter("layer.to_sparse_csr()") == []
    raw = _warnings_in_a_fresh_interpreter(  # the same tensor from torch's constructor: both warnings show
        "torch.sparse_csr_tensor(layer.col_ptr.long(), layer.src_by_dst.long(), "
        "layer.weight.detach()[layer.perm.long()], size=(8, 16))")
    assert any("beta state" in w for w in raw) and any("invariant checks" in w for w in raw), raw


def test_to_sparse_csr_leaves_the_callers_warning_filters_alone():
    before = list(warnings.filters)
    _layer(_seed()).to_sparse_csr()
    assert warnings.filters == before


# ---------------------------------------------------------------------- given a topology under inference_mode
def _grads_against_float64(layer: SparseLinear, indices: torch.Tensor) -> None:
    """One forward and backward of ``layer``: output and gradients of input, weight and bias equal float64 dense
    math over ``indices`` (``[2, nnz]``: the edges the layer must have, aligned with its values)."""
    x = torch.randn(5, layer.in_features, requires_grad=True)
    out = layer(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    w64 = layer.weight.detach().double().requires_grad_()
    b64 = layer.bias.detach().double().requires_grad_()
    dense = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64).index_put(
        (indices[0], indices[1]), w64)
    x64 = x.detach().double().requires_grad_()
    want = x64 @ dense.T + b64
    want.backward(grad_out.double())
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is not None and layer.bias.grad is not None
    for got, ref in ((x.grad, x64.grad), (layer.weight.grad, w64.grad), (layer.bias.grad, b64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [1, 8])
@pytest.mark.parametrize("how", ["copy", "assign", "reset"])
def test_a_layer_given_its_topology_under_inference_mode_trains_like_nn_linear(how, block):
    """nn.Linear loaded (copied or assigned) or reset under torch.inference_mode trains normally afterwards; so does
    SparseLinear of either layout when that gives it a topology of other edges (a checkpoint's, or one drawn after
    to_empty): its tensors are not inference tensors, and gradients of input, weight and bias equal float64 dense
    math, before and after an optimizer step."""
    gen = torch.Generator().manual_seed(_seed())
    trained = SparseLinear(16, 24, density=0.5, block=block, generator=gen)
    with torch.device("meta" if how != "copy" else "cpu"):
        layer = SparseLinear(16, 24, density=0.25, block=block, generator=gen)
        linear = nn.Linear(16, 24)
    if how == "reset":
        layer, linear = layer.to_empty(device="cpu"), linear.to_empty(device="cpu")
    linear_source = nn.Linear(16, 24)
    with torch.inference_mode():
        if how == "reset":
            layer.reset_parameters()
            linear.reset_parameters()
        else:
            layer.load_state_dict(trained.state_dict(), assign=how == "assign")
            linear.load_state_dict(linear_source.state_dict(), assign=how == "assign")
    linear(torch.randn(3, 16)).sum().backward()  # torch's behaviour, which the layer must match
    assert linear.weight.grad is not None and linear.bias.grad is not None
    tensors = [*layer.parameters(), *layer.buffers()]
    assert not any(t.is_inference() for t in tensors)
    indices = trained.indices() if how != "reset" else layer.indices()
    if how != "reset":
        assert _edges(layer) == _edges(trained) and torch.equal(layer.weight, trained.weight)
    _grads_against_float64(layer, indices)
    before = layer.weight.detach().clone()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert not torch.equal(layer.weight, before)
    layer.zero_grad()
    _grads_against_float64(layer, indices)


# ------------------------------------------------------------------------------------ load_state_dict pre-hooks
def _renaming_hook(calls: list[str]):
    """A load pre-hook (``register_load_state_dict_pre_hook``) that renames ``<prefix>old_<key>`` to
    ``<prefix><key>``, recording each call."""
    def hook(module, state_dict, prefix, *_):
        calls.append(prefix)
        for key in [k for k in state_dict if k.startswith(prefix + "old_")]:
            state_dict[prefix + key[len(prefix) + 4:]] = state_dict.pop(key)
    return hook


@pytest.mark.parametrize("block", [1, 8])
@pytest.mark.parametrize("through_parent", [False, True], ids=["layer", "parent"])
def test_a_renaming_pre_hook_runs_first_as_for_nn_linear(block, through_parent):
    """A load pre-hook sees the checkpoint before any key is checked, once, as nn.Linear's does: a checkpoint of
    renamed keys loads with strict=True into the layer (or its parent), values and topology included."""
    gen = torch.Generator().manual_seed(_seed())
    source = SparseLinear(16, 24, density=0.5, block=block, generator=gen)
    layer = SparseLinear(16, 24, density=0.25, block=block, generator=gen)
    linear, linear_source = nn.Linear(16, 24), nn.Linear(16, 24)
    results = []
    for target, src in ((linear, linear_source), (layer, source)):
        calls: list[str] = []
        target.register_load_state_dict_pre_hook(_renaming_hook(calls))
        prefix = "0." if through_parent else ""
        renamed = {f"{prefix}old_{key}": value for key, value in src.state_dict().items()}
        loader = nn.Sequential(target) if through_parent else target
        results.append(loader.load_state_dict(renamed))
        assert calls == [prefix]
    assert results[1] == results[0] and not results[1].missing_keys and not results[1].unexpected_keys
    assert torch.equal(linear.weight, linear_source.weight)
    assert _edges(layer) == _edges(source) and torch.equal(layer.weight, source.weight)
    x = torch.randn(4, 16)
    _assert_computes(layer, x, _reference(x, source))


def test_a_pre_hook_that_reports_keys_or_errors_is_heard_before_anything_loads():
    """What a pre-hook adds to the missing or unexpected keys or the error messages counts as torch counts it: with
    strict=True (or any error message) the load raises, and the layer is unchanged."""
    layer, source = _layer(_seed()), _layer(_seed(), density=0.7)

    def reporting(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        unexpected.append("from_the_hook")

    layer.register_load_state_dict_pre_hook(reporting)
    _refuses(layer, source.state_dict(), 'Unexpected key\\(s\\) in state_dict: "from_the_hook"')
    assert layer.load_state_dict(source.state_dict(), strict=False).unexpected_keys == ["from_the_hook"]
    assert _edges(layer) == _edges(source)
    failing = _layer(_seed())
    failing.register_load_state_dict_pre_hook(lambda module, sd, prefix, *rest: rest[-1].append("the hook says no"))
    _refuses(failing, source.state_dict(), "the hook says no", strict=False)
