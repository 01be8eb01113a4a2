"""SparseLinear where users' tools take a model: safetensors, torch.save with weights_only, Hugging Face
save_pretrained / from-config loading / Trainer checkpoints, torch.distributed.checkpoint, torch.nn.utils
parametrizations, TorchScript and ONNX. Each workflow is checked against nn.Linear (or the dense model) doing the
same thing, with the real libraries on the CPU and tiny models built from configs (no downloads)."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, layer_buffers, load_sparse_checkpoint, sparsify
from torch_sparse_metal.checkpoint import read_checkpoint
from tsm_dev.snapshot import changes, snapshot


def _safetensors():
    return pytest.importorskip("safetensors.torch")


def _transformers():
    return pytest.importorskip("transformers")


def _layer(seed: int, n_in: int = 16, n_out: int = 8, density: float = 0.3, block: int = 1) -> SparseLinear:
    return SparseLinear(n_in, n_out, density=density, block=block, generator=torch.Generator().manual_seed(seed))


def _same_function(a: nn.Module, b: nn.Module, n_in: int) -> bool:
    x = torch.randn(5, n_in)
    return torch.equal(a(x), b(x))


# ------------------------------------------------------------------------------------------ tensor-only state
@pytest.mark.parametrize("block", [1, 8])
def test_every_state_dict_entry_is_a_tensor(block):
    layer = _layer(0, block=block)
    state = layer.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert state["_extra_state"].tolist() == [2, 16, 8, block]


def test_a_checkpoint_of_the_dict_format_still_loads():
    source = _layer(1)
    legacy = dict(source.state_dict())
    legacy["_extra_state"] = {"in_features": 16, "out_features": 8, "block": 1, "format": 1}
    layer = _layer(2, density=0.1)
    layer.load_state_dict(legacy)
    assert _same_function(layer, source, 16)


def test_safetensors_save_file_and_load_model_with_a_shared_module(tmp_path):
    safetensors_torch = _safetensors()
    shared = _layer(3)
    model = nn.Sequential(shared, nn.ReLU(), nn.Linear(8, 8), shared.__class__(8, 8, density=0.5))
    model.add_module("again", shared)  # one SparseLinear under two names: safetensors removes the duplicate
    safetensors_torch.save_model(model, tmp_path / "m.safetensors")
    other = nn.Sequential(_layer(4), nn.ReLU(), nn.Linear(8, 8), SparseLinear(8, 8, density=0.2))
    other.add_module("again", other[0])
    missing, unexpected = safetensors_torch.load_model(other, tmp_path / "m.safetensors")
    assert not missing and not unexpected
    assert other.again is other[0]
    assert _same_function(other[0], shared, 16) and _same_function(other[2:4], model[2:4], 8)

    safetensors_torch.save_file(shared.state_dict(), tmp_path / "layer.safetensors")
    layer = _layer(5, density=0.1)
    layer.load_state_dict(safetensors_torch.load_file(tmp_path / "layer.safetensors"))
    assert _same_function(layer, shared, 16)


def test_torch_load_weights_only_of_a_pickled_model_needs_only_its_module_classes():
    model = nn.Sequential(_layer(6, block=8), nn.ReLU(), _layer(7, n_in=8, n_out=4))
    with torch.device("meta"):
        deferred = SparseLinear(16, 8, density=0.25)  # a layer whose topology is drawn later, from its seed
    buffer = io.BytesIO()
    torch.save({"model": model, "deferred": deferred}, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([nn.Sequential, nn.ReLU, SparseLinear]):
        loaded = torch.load(buffer, weights_only=True)
    assert _same_function(loaded["model"], model, 16)
    assert loaded["model"][0].backward is model[0].backward
    hooks = [loaded["model"][0]._forward_pre_hooks, model[0]._forward_pre_hooks]
    assert [list(h.values()) for h in hooks][0] == list(hooks[1].values())  # the layer's own pre-hook, once
    a = loaded["deferred"].to_empty(device="cpu")
    b = copy.deepcopy(deferred).to_empty(device="cpu")
    a.reset_parameters()
    b.reset_parameters()
    assert a.topology.same_as(b.topology)


# ----------------------------------------------------------------------------------------- no stale topology
@pytest.mark.parametrize("block", [1, 8])
def test_a_copy_into_state_dict_tensors_gives_the_copied_layer(block):
    layer, source = _layer(8, block=block), _layer(9, block=block)
    assert layer.nnz == source.nnz and not layer.topology.same_as(source.topology)
    for key, value in layer.state_dict().items():
        value.copy_(source.state_dict()[key])  # what torch.distributed.checkpoint's load does
    assert _same_function(layer, source, 16)
    assert torch.equal(layer.to_dense(), source.to_dense()) and torch.equal(layer.fan_in(), source.fan_in())


@pytest.mark.parametrize("block", [1, 8])
def test_row_ptr_and_dst_overwritten_into_no_topology_refuse_until_a_checkpoint_loads(block):
    layer, source = _layer(10, block=block), _layer(11, block=block)
    layer.state_dict()["dst"].fill_(1000)
    with pytest.raises(RuntimeError, match="row_ptr and dst were changed without the layer.*load_state_dict"):
        layer(torch.randn(2, 16))
    with pytest.raises(RuntimeError, match="no longer form a topology"):
        layer.to_dense()
    layer.load_state_dict(source.state_dict())
    assert _same_function(layer, source, 16)


@pytest.mark.parametrize("block", [1, 8])
def test_every_index_buffer_written_together_is_taken_as_it_is(monkeypatch, block):
    """DistributedDataParallel broadcasts every parameter and buffer in place before each forward: the layer takes
    them without deriving anything (no host read per step)."""
    layer, source = _layer(12, block=block), _layer(13, block=block)
    layer(torch.randn(2, 16))
    monkeypatch.setattr(layer_buffers, "_rederive_topology", lambda layer: pytest.fail("derived again"))
    for name, value in layer.named_buffers():
        value.copy_(source.get_buffer(name))
    for name, value in layer.named_parameters():
        value.data.copy_(source.get_parameter(name))
    assert _same_function(layer, source, 16)


# ------------------------------------------------------------------------------- torch.distributed.checkpoint
def test_dcp_load_of_another_topology_computes_the_checkpoint(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    source = nn.Sequential(_layer(14), nn.Tanh(), _layer(15, n_in=8, n_out=4))
    dcp.save(source.state_dict(), checkpoint_id=tmp_path / "same", no_dist=True)
    model = nn.Sequential(_layer(16), nn.Tanh(), _layer(17, n_in=8, n_out=4))
    assert model[0].nnz == source[0].nnz
    state = model.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "same", no_dist=True)  # in place, into the live tensors
    assert _same_function(model, source, 16)  # without load_state_dict
    model.load_state_dict(state)  # the documented second step changes nothing more
    assert _same_function(model, source, 16)


def test_dcp_load_then_load_state_dict_reaches_a_compiled_model(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    source, model = nn.Sequential(_layer(30)), nn.Sequential(_layer(31))
    compiled = torch.compile(model)
    x = torch.randn(4, 16)
    compiled(x)
    dcp.save(source.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    model.load_state_dict(state)
    torch.testing.assert_close(compiled(x), source(x))



def _derived_arrays_of_the_sources(layer: SparseLinear) -> bool:
    """Whether the layer's kernel arrays are what its row_ptr and dst give (derived independently, on the CPU)."""
    fresh = SparseLinear.from_topology(
        CSRTopology.from_csr(layer.row_ptr.clone(), layer.dst.clone(), layer.in_features, layer.out_features,
                             block=layer.block))
    return all(torch.equal(layer.get_buffer(name), fresh.get_buffer(name)) for name, _ in layer.named_buffers())


@pytest.mark.parametrize("block", [1, 8])
def test_dcp_load_without_load_state_dict_reaches_a_compiled_model(tmp_path, block):
    """Dynamo guards on no version counter: a compiled layer learns from its lending flag that row_ptr and dst were
    handed out (state_dict()), and its traced call derives the kernels' arrays again before the op runs."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    source, target = nn.Sequential(_layer(26, block=block)), nn.Sequential(_layer(27, block=block))
    assert source[0].nnz == target[0].nnz and not source[0].topology.same_as(target[0].topology)
    dcp.save(source.state_dict(), checkpoint_id=tmp_path / "a", no_dist=True)
    compiled = torch.compile(target, fullgraph=True)
    x = torch.randn(4, 16)
    compiled(x)
    state = target.state_dict()
    compiled(x)  # a call between state_dict() and dcp.load: the lent tensors are still alive
    dcp.load(state, checkpoint_id=tmp_path / "a", no_dist=True)  # no load_state_dict after it
    torch.testing.assert_close(compiled(x), source(x), rtol=0, atol=0)
    assert _derived_arrays_of_the_sources(target[0])
    assert target[0]._lending.pending  # state is alive: a later dcp.load into it must be seen too
    again = nn.Sequential(_layer(28, block=block))
    dcp.save(again.state_dict(), checkpoint_id=tmp_path / "b", no_dist=True)
    dcp.load(state, checkpoint_id=tmp_path / "b", no_dist=True)
    torch.testing.assert_close(compiled(x), again(x), rtol=0, atol=0)
    del state
    compiled(x)
    assert not target[0]._lending.pending  # nothing lent: the steady-state graph again
    torch.testing.assert_close(compiled(x), again(x), rtol=0, atol=0)


def test_a_compiled_layer_derives_again_from_sources_lent_by_assign():
    layer, first, second = _layer(35, density=0.25), _layer(36, density=0.25), _layer(37, density=0.25)
    state = {k: v.clone() for k, v in first.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(3, 16)
    torch.testing.assert_close(compiled(x), first(x), rtol=0, atol=0)
    for key, value in second.state_dict().items():
        state[key].copy_(value)
    torch.testing.assert_close(compiled(x), second(x), rtol=0, atol=0)
    assert _derived_arrays_of_the_sources(layer)


def test_tensors_given_by_assign_are_followed_when_changed_in_place():
    layer, first, second = _layer(32, density=0.25), _layer(33, density=0.25), _layer(34, density=0.25)
    state = {k: v.clone() for k, v in first.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    assert layer.dst.data_ptr() == state["dst"].data_ptr() and _same_function(layer, first, 16)
    for key, value in second.state_dict().items():
        state[key].copy_(value)
    assert _same_function(layer, second, 16)


def test_dcp_checkpoint_of_another_edge_count_loads_through_load_sparse_checkpoint(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    source = nn.Sequential(_layer(18, density=0.5), nn.Tanh(), nn.Linear(8, 4))
    dcp.save(source.state_dict(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    model = nn.Sequential(_layer(19, density=0.1), nn.Tanh(), nn.Linear(8, 4))
    model = load_sparse_checkpoint(model, tmp_path / "ckpt")
    assert model[0].nnz == source[0].nnz and _same_function(model, source, 16)



def test_load_sparse_checkpoint_takes_the_model_of_a_dcp_model_and_optim_folder(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    source = nn.Sequential(_layer(24, density=0.5), nn.Tanh(), nn.Linear(8, 4))
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.randn(3, 16)).square().sum().backward()
    optimizer.step()
    dcp.save({"model": source.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    assert any(key.startswith("optim.state.") for key in read_checkpoint(tmp_path))  # optimizer tensors beside

    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))  # dense, as built from a configuration
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"sparse layer at 'model\.0', where the model has no module.*pass "
                                         r"prefix='model\.'.*nothing was changed"):
        load_sparse_checkpoint(model, tmp_path)  # without the prefix: the model's keys are not found
    with pytest.raises(ValueError, match=r"no key of the checkpoint starts with prefix='net\.'.*'model\.', "
                                         r"'optim\.'.*nothing was changed"):
        load_sparse_checkpoint(model, tmp_path, prefix="net.")
    assert changes(before, model) == [] and type(model[0]) is nn.Linear
    model = load_sparse_checkpoint(model, tmp_path, prefix="model.")
    assert isinstance(model[0], SparseLinear) and model[0].nnz == source[0].nnz
    assert torch.equal(model[0].indices(), source[0].indices()) and _same_function(model, source, 16)

# ---------------------------------------------------------------------------------------- load_sparse_checkpoint
def _mlp(device=None) -> nn.Module:
    with torch.device(device or "cpu"):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32, bias=False), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("where", ["cpu", "meta"])
@pytest.mark.parametrize("fmt", ["mapping", "torch", "safetensors"])
def test_load_sparse_checkpoint_rebuilds_the_sparse_model(tmp_path, where, fmt):
    safetensors_torch = _safetensors()
    torch.manual_seed(0)
    trained = sparsify(_mlp(), density=0.3, filter=lambda name, m: m.out_features > 4)
    trained[2] = SparseLinear.from_dense(trained[2].to_linear(), block=8)  # a vector layer too
    state = trained.state_dict()
    checkpoint = {"mapping": state, "torch": tmp_path / "m.pt", "safetensors": tmp_path / "m.safetensors"}[fmt]
    if fmt == "torch":
        torch.save(state, checkpoint)
    elif fmt == "safetensors":
        safetensors_torch.save_file(state, checkpoint)
    model = load_sparse_checkpoint(_mlp(where), checkpoint)
    assert [type(m) for m in model] == [type(m) for m in trained]
    assert model[2].block == 8 and all(p.device.type == "cpu" for p in model.parameters())
    assert _same_function(model, trained, 16)


BAD_PLACES = {
    "a module that is not linear": (lambda m: m.__setitem__(0, nn.Conv1d(16, 32, 1)), "not an nn.Linear"),
    "other features": (lambda m: m.__setitem__(0, nn.Linear(16, 24)), "is 16 -> 32, the model's layer 16 -> 24"),
    "no bias": (lambda m: m.__setitem__(0, nn.Linear(16, 32, bias=False)), "has bias, the model's layer has none"),
    "strict keys": (lambda m: m.append(nn.Linear(4, 4)), "Missing keys: \\['5.bias', '5.weight'\\]"),
}


@pytest.mark.parametrize("case", list(BAD_PLACES))
def test_load_sparse_checkpoint_refuses_what_does_not_fit_and_changes_nothing(case):
    spoil, message = BAD_PLACES[case]
    trained = sparsify(_mlp(), density=0.3, filter=lambda name, m: m.out_features > 4)
    model = _mlp()
    spoil(model)
    before, types = snapshot(model), [type(m) for m in model]
    with pytest.raises(ValueError, match=message):
        load_sparse_checkpoint(model, trained.state_dict())
    assert [type(m) for m in model] == types and changes(before, model) == []


def test_load_sparse_checkpoint_then_accelerate_dispatch_model_places_the_sparse_model(tmp_path):
    """A dense skeleton on meta (no sparse layers to fill): load_sparse_checkpoint puts the sparse layers in, then
    accelerate's dispatch_model places the model."""
    accelerate = pytest.importorskip("accelerate")
    safetensors = _safetensors()
    source = sparsify(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)), density=0.4,
                      generator=torch.Generator().manual_seed(5))
    safetensors.save_file(source.state_dict(), tmp_path / "model.safetensors")
    with accelerate.init_empty_weights():
        skeleton = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    model = load_sparse_checkpoint(skeleton, tmp_path)
    device_map = accelerate.infer_auto_device_map(model, max_memory={"cpu": 2**30})
    placed = accelerate.dispatch_model(model, device_map=device_map)
    assert isinstance(placed[0], SparseLinear) and not any(p.is_meta for p in placed.parameters())
    x = torch.randn(5, 16)
    reference = torch.tanh(x.double() @ source[0].to_dense().double().T + source[0].bias.double())
    reference = reference @ source[2].to_dense().double().T + source[2].bias.double()
    torch.testing.assert_close(placed(x).double(), reference, rtol=1e-6, atol=1e-6)


def _accelerate_model(meta: bool = False) -> nn.Sequential:
    """An MLP with an unstructured layer, a constant fan-in vector layer without bias and an unstructured head; on
    ``meta`` (under accelerate's init_empty_weights) the same shapes with other, undrawn connections."""
    torch.manual_seed(0 if not meta else 1)
    layers = [SparseLinear(16, 32, density=0.3), nn.Tanh(),
              SparseLinear(32, 32, bias=False, density=0.25, block=8, constant_fan_in=True), nn.Tanh(),
              SparseLinear(32, 8, density=0.5)]
    return nn.Sequential(*layers).eval()


def _save_for_accelerate(model: nn.Module, folder, fmt: str) -> None:
    state = model.state_dict()
    if fmt == "torch":
        torch.save(state, folder / "pytorch_model.bin")
    elif fmt == "safetensors":
        _safetensors().save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    else:  # sharded safetensors with the index accelerate reads
        import json

        from huggingface_hub import split_torch_state_dict_into_shards

        split = split_torch_state_dict_into_shards(state, max_shard_size=2000)
        assert len(split.filename_to_tensors) > 2
        for name, keys in split.filename_to_tensors.items():
            _safetensors().save_file({k: state[k] for k in keys}, folder / name, metadata={"format": "pt"})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename}))


def _float64_mlp(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The model's function in float64 dense math, from each layer's dense weight."""
    y = x.double()
    for i, m in enumerate(model):
        if isinstance(m, SparseLinear):
            y = y @ m.to_dense().double().T + (m.bias.double() if m.bias is not None else 0)
            y = torch.tanh(y) if i < len(model) - 1 else y
    return y


@pytest.mark.parametrize("device_map", [{"": "cpu"}, "auto"], ids=["cpu", "auto"])
@pytest.mark.parametrize("fmt", ["safetensors", "torch", "sharded"])
def test_accelerate_load_checkpoint_and_dispatch_onto_a_sparse_skeleton(tmp_path, fmt, device_map):
    """accelerate sets the checkpoint's entries one at a time into the empty skeleton's SparseLinear layers; the
    layers take them together and compute what the saved model computes."""
    accelerate = pytest.importorskip("accelerate")
    source = _accelerate_model()
    _save_for_accelerate(source, tmp_path, fmt)
    with accelerate.init_empty_weights():
        skeleton = _accelerate_model(meta=True)
    assert skeleton[0].weight.is_meta and not torch.equal(skeleton[0].__dict__["_deferred"].dst, source[0].dst)
    model = accelerate.load_checkpoint_and_dispatch(skeleton, tmp_path, device_map=device_map)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    x = torch.randn(6, 16)
    assert torch.equal(model(x), source(x))
    torch.testing.assert_close(model(x).double(), _float64_mlp(source, x), rtol=1e-5, atol=1e-5)
    assert model[2].constant_fan_in and model[2].block == 8 and model[2].topology.same_as(source[2].topology)
    assert model.state_dict().keys() == source.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
    model.train()
    model(x).square().sum().backward()  # it trains as the source does
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("offload", ["disk", "hooks"])
def test_accelerate_dispatch_with_offload_to_disk_or_hooks(tmp_path, offload):
    """Weights offloaded to disk (on meta between calls, set before each) and hooks across devices: the layers take
    their topology from the buffers accelerate placed."""
    accelerate = pytest.importorskip("accelerate")
    source = _accelerate_model()
    _save_for_accelerate(source, tmp_path, "safetensors")
    with accelerate.init_empty_weights():
        skeleton = _accelerate_model(meta=True)
    where = {"disk": "disk", "hooks": "cpu"}[offload]
    device_map = {"0": "cpu", "1": "cpu", "2": where, "3": "cpu", "4": where}
    model = accelerate.load_checkpoint_and_dispatch(skeleton, tmp_path, device_map=device_map,
                                                    offload_folder=tmp_path / "offload", force_hooks=True)
    x = torch.randn(6, 16)
    assert torch.equal(model(x), source(x)) and torch.equal(model(x), source(x))  # again, once weights went back


def test_hugging_face_skeleton_through_accelerate_load_checkpoint_and_dispatch(tmp_path):
    """The big-model-inference path: a sparse Hugging Face model saved sharded by save_pretrained, its sparse skeleton
    built empty, accelerate's load_checkpoint_and_dispatch fills it: the same logits."""
    transformers = _transformers()
    accelerate = pytest.importorskip("accelerate")
    model = _sparse_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    with accelerate.init_empty_weights():
        skeleton = transformers.AutoModelForCausalLM.from_config(_llama_config())
    skeleton = sparsify(skeleton, density=0.25, method="random",
                        filter=lambda name, m: ".mlp." in name or name == "lm_head")
    loaded = accelerate.load_checkpoint_and_dispatch(skeleton, tmp_path, device_map="auto").eval()
    ids = torch.randint(0, 64, (2, 7))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_entries_set_one_at_a_time_are_refused_until_all_are_set():
    """A meta-built layer with some entries set from outside (as accelerate leaves it when a later entry fails) does
    not compute: the refusal names what was set and what was not; once all are set it computes the source's
    function."""
    source = SparseLinear(16, 8, density=0.5)
    with torch.device("meta"):
        layer = SparseLinear(16, 8, density=0.5)
    state = source.state_dict()
    for name in ("weight", "bias", "row_ptr"):
        setattr(layer, name, nn.Parameter(state[name].clone()) if name in ("weight", "bias") else state[name].clone())
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match="weight, bias, row_ptr set, dst, _extra_state not.*load_sparse_checkpoint"):
        layer(x)
    with pytest.raises(RuntimeError, match="dst, _extra_state not"):
        layer.to_dense()
    layer.dst, layer._extra_state = state["dst"].clone(), state["_extra_state"].clone()
    assert torch.equal(layer(x), source(x))


def test_entries_of_another_layer_set_from_outside_are_refused(tmp_path):
    """A checkpoint whose layer has the skeleton's tensor shapes but another out_features (no bias, the same edge
    count): its edges fit the skeleton's larger layer, and only _extra_state says otherwise; the layer refuses
    rather than compute a wrong-shaped output, on meta (load_checkpoint_and_dispatch) and live alike."""
    accelerate = pytest.importorskip("accelerate")
    source = nn.Sequential(SparseLinear(16, 8, bias=False, density=0.5))
    _save_for_accelerate(source, tmp_path, "safetensors")
    with accelerate.init_empty_weights():
        skeleton = nn.Sequential(SparseLinear(16, 12, bias=False, density=64 / 192))
    assert skeleton[0].nnz == source[0].nnz == 64
    with pytest.raises(RuntimeError, match="_extra_state is of another layer: {'out_features': 8}.*'out_features': 12"):
        accelerate.load_checkpoint_and_dispatch(skeleton, tmp_path, device_map={"": "cpu"})
    live = nn.Sequential(SparseLinear(16, 12, bias=False, density=64 / 192))
    accelerate.load_checkpoint_in_model(live, tmp_path, device_map={"": "cpu"})
    with pytest.raises(RuntimeError, match="_extra_state was set from outside.*does not describe it"):
        live(torch.randn(2, 16))


def test_load_sparse_checkpoint_refuses_meta_buffers_no_checkpoint_fills():
    trained = sparsify(_mlp(), density=0.3)
    model = _mlp("meta")
    model[1].register_buffer("table", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(ValueError, match="buffers on the meta device.*'1.table'.*init_empty_weights"):
        load_sparse_checkpoint(model, trained.state_dict())
    assert isinstance(model[0], nn.Linear)


def test_sparsify_on_the_meta_device_draws_connections_without_dense_values():
    g = torch.Generator().manual_seed(0)
    model = sparsify(_mlp("meta"), density=0.25, method="random", generator=g)
    assert all(isinstance(m, SparseLinear) and m.weight.is_meta for m in model[::2])
    model.to_empty(device="cpu")
    for layer in model[::2]:
        layer.reset_parameters()
    assert model(torch.randn(3, 16)).shape == (3, 4)
    assert model[0].nnz == round(0.25 * 16 * 32)
    with pytest.raises(ValueError, match="meta device and has no values to choose connections by magnitude"):
        sparsify(_mlp("meta"), density=0.25)


# ----------------------------------------------------------------------------------------------- Hugging Face
def _llama_config(tied: bool = False):
    transformers = _transformers()
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _sparse_llama(seed: int = 0):
    transformers = _transformers()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_llama_config())
    return sparsify(model, density=0.25, filter=lambda name, m: ".mlp." in name or name == "lm_head").eval()


@pytest.mark.parametrize("shard", ["20KB", None], ids=["sharded", "one file"])
def test_save_pretrained_and_back_through_load_sparse_checkpoint(tmp_path, shard):
    transformers = _transformers()
    accelerate = pytest.importorskip("accelerate")
    model = _sparse_llama()
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")).exists()
    ids = torch.randint(0, 64, (2, 7))
    with accelerate.init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(_llama_config())
    loaded = load_sparse_checkpoint(empty, tmp_path).eval()
    assert isinstance(loaded.lm_head, SparseLinear) and isinstance(loaded.model.layers[1].mlp.down_proj, SparseLinear)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False),
                       model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False))


def test_hf_trainer_saves_checkpoints_and_resumes(tmp_path):
    transformers = _transformers()
    pytest.importorskip("accelerate")
    model = _sparse_llama(1).train()
    data = [{"input_ids": torch.randint(0, 64, (8,)), "labels": torch.randint(0, 64, (8,))} for _ in range(8)]
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1,
                use_cpu=True, report_to=[], learning_rate=1e-2, seed=0)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args), train_dataset=data)
    trainer.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    final = {k: v.clone() for k, v in model.state_dict().items()}

    resumed = _sparse_llama(2).train()
    trainer = transformers.Trainer(model=resumed, args=transformers.TrainingArguments(**args), train_dataset=data)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, final[key], msg=key)


def test_peft_lora_beside_sparse_layers_trains_and_saves_its_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_sparse_llama(3).train(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 64, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)  # the sparse layers are frozen with the base model
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
    with pytest.raises(ValueError, match="Target module SparseLinear.*is not supported"):  # peft's own refusal
        peft.get_peft_model(_sparse_llama(4), peft.LoraConfig(r=4, target_modules=["up_proj"]))


def test_from_pretrained_of_a_sparse_save_is_not_silently_dense(tmp_path):
    """What docs/ecosystem.md says: from_pretrained refuses the mismatch; ignore_mismatched_sizes re-initialises."""
    transformers = _transformers()
    _sparse_llama().save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------ parametrizations and exporters
def _dense_twin(layer: SparseLinear) -> nn.Linear:
    return layer.to_linear()


@pytest.mark.parametrize("api", ["parametrizations", "hook"])
def test_weight_norm_over_all_weights_means_what_it_means_on_nn_linear(api):
    layer = _layer(20)
    dense = _dense_twin(layer)
    norm = nn.utils.parametrizations.weight_norm if api == "parametrizations" else nn.utils.weight_norm
    with pytest.warns(FutureWarning) if api == "hook" else _nothing():
        norm(layer, dim=None)
        norm(dense, dim=None)
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(layer.double()(x), dense.double()(x))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


REFUSED = {
    "parametrizations.weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
    "parametrizations.spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m),
    "spectral_norm": lambda m: nn.utils.spectral_norm(m),
    "weight_norm": lambda m: nn.utils.weight_norm(m, dim=0),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
@pytest.mark.parametrize("case", list(REFUSED))
def test_matrix_norms_of_the_weight_are_refused_before_a_kernel_runs(case, monkeypatch):
    layer = _layer(21)
    REFUSED[case](layer)
    called = []
    monkeypatch.setattr("torch_sparse_metal.nn.sparse_linear", lambda *a, **k: called.append(a))
    what = "spectral_norm" if "spectral" in case else "weight_norm with dim=0"
    with pytest.raises(RuntimeError, match=f"{what} on a SparseLinear would normalise its 1-D vector.*remove it"):
        layer(torch.randn(2, 16))
    assert called == []


def test_torch_jit_script_refuses_naming_trace_and_export():
    message = "torch.jit.script cannot compile SparseLinear.*torch.jit.trace or torch.export"
    with pytest.raises(TypeError, match=message):
        torch.jit.script(nn.Sequential(_layer(22), nn.ReLU()))


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_export_refuses_naming_the_op_and_the_dense_copy(dynamo):
    if dynamo:
        pytest.importorskip("onnxscript")  # the dynamo exporter needs it before it looks at the model
    model = nn.Sequential(_layer(23), nn.ReLU())
    with pytest.raises(RuntimeError, match="torch.onnx.export cannot export SparseLinear.*torch_sparse_metal::"
                                           "csr_linear.*layer.to_linear()"):
        torch.onnx.export(model, (torch.randn(2, 16),), io.BytesIO() if not dynamo else None, dynamo=dynamo)
    assert not torch.onnx.is_in_onnx_export()
    x = torch.randn(3, 16)
    torch.testing.assert_close(model(x), nn.Sequential(model[0].to_linear(), nn.ReLU())(x), rtol=1e-6, atol=1e-6)


def test_onnx_export_of_the_dense_copy_works():
    pytest.importorskip("onnxscript")
    layer = _layer(25)
    program = torch.onnx.export(nn.Sequential(layer.to_linear()).eval(), (torch.randn(2, 16),), dynamo=True)
    assert "csr_linear" not in str(program.model) and any(node.op_type == "Gemm" or node.op_type == "MatMul"
                                                          for node in program.model.graph)


def test_read_checkpoint_refuses_a_folder_without_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        read_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        read_checkpoint(tmp_path / "missing.safetensors")


# ----------------------------------------------------------------------------------- FSDP2 with 2 gloo ranks
def _fsdp_net(seed: int, density: float) -> nn.Module:
    return nn.Sequential(_layer(seed, density=density), nn.Tanh(), _layer(seed + 1, n_in=8, n_out=4, density=0.5))


def _fsdp_worker(rank: int, world: int, out: str, checkpoint: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded(net: nn.Module) -> nn.Module:
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(7))
    source = sharded(_fsdp_net(0, 0.3))
    dcp.save(get_model_state_dict(source), checkpoint_id=checkpoint)
    expected = source(x).detach()

    same_count = sharded(_fsdp_net(10, 0.3))  # another topology with the same edge count
    state = get_model_state_dict(same_count)
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(same_count, state)
    got_same = same_count(x).detach()

    # A topology schedule over a sharded layer is refused when it is built (an update needs the whole weight).
    from torch_sparse_metal.evolve import DynamicSparsity
    from torch_sparse_metal.pruning import GradualPruning

    opt = torch.optim.SGD(same_count.parameters(), lr=0.1)
    schedules = []
    for build in (lambda: DynamicSparsity([same_count[0]], opt, total_steps=10),
                  lambda: GradualPruning([same_count[0]], opt, final_density=0.1, end_step=10)):
        try:
            build()
            schedules.append("no error")
        except ValueError as exc:
            schedules.append(str(exc))

    other_count = sharded(_fsdp_net(20, 0.1))
    before = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
              for k, v in other_count.state_dict().items()}
    full = get_model_state_dict(source, options=StateDictOptions(full_state_dict=True))
    try:
        set_model_state_dict(other_count, full, options=StateDictOptions(full_state_dict=True))
        refusal = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        refusal = str(exc)
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
             for k, v in other_count.state_dict().items()}
    # The refused layer is whole and unchanged; the model's other modules load, as torch's rule for a model with a
    # refused entry is (an nn.Linear of another shape is refused the same way, at the end of the load).
    unchanged = all(torch.equal(before[k], after[k]) for k in before if k.startswith("0."))
    torch.save({"expected": expected, "same": got_same, "refusal": refusal, "unchanged": unchanged,
                "works": other_count(x).shape, "schedules": schedules}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_fsdp2_loads_across_topologies_or_refuses_before_anything_changes(tmp_path):
    from tsm_dev.gloo import WORLD, launch, launch_errors

    codes = launch(_fsdp_worker, tmp_path, str(tmp_path / "ckpt"))
    assert codes == [0] * WORLD, launch_errors(tmp_path)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(result["same"], result["expected"], rtol=0, atol=0)
        assert "sharded by FSDP2's fully_shard" in result["refusal"] and "before sharding" in result["refusal"]
        assert result["unchanged"] and result["works"] == (6, 4)
        for refusal in result["schedules"]:
            assert "is a DTensor" in refusal and "under FSDP2 train a fixed topology" in refusal, refusal
    # One process, no torch.distributed: the same checkpoint through load_sparse_checkpoint.
    model = load_sparse_checkpoint(_fsdp_net(30, 0.1), tmp_path / "ckpt")
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(model(x), torch.load(tmp_path / "rank0.pt")["expected"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------- resize_token_embeddings
@pytest.mark.parametrize("tokens, block", [(80, 1), (48, 1), (96, 8), (64 + 5, 1)])
def test_resize_token_embeddings_keeps_every_remaining_token_as_nn_linear_does(tokens, block):
    from torch_sparse_metal.huggingface import resize_token_embeddings

    transformers = _transformers()
    torch.manual_seed(5)
    dense = transformers.LlamaForCausalLM(_llama_config()).eval()
    sparse = copy.deepcopy(dense)
    sparse.lm_head = SparseLinear.from_dense(sparse.lm_head, torch.rand(64, 32) < 0.1, block=block)
    ids = torch.randint(0, min(tokens, 64), (2, 7))
    before = sparse(ids).logits
    embeddings = resize_token_embeddings(sparse, tokens, generator=torch.Generator().manual_seed(0))
    dense.resize_token_embeddings(tokens)
    assert embeddings is sparse.get_input_embeddings() and embeddings.weight.shape == (tokens, 32)
    assert isinstance(sparse.lm_head, SparseLinear) and sparse.lm_head.out_features == tokens
    assert sparse.config.vocab_size == dense.config.vocab_size == tokens
    after = sparse(ids).logits
    assert after.shape == dense(ids).logits.shape == (2, 7, tokens)
    shared = min(tokens, 64)
    torch.testing.assert_close(after[..., :shared], before[..., :shared], rtol=0, atol=0)
    if tokens > 64:  # the new tokens' outputs are connected at the layer's density
        fan_in = sparse.lm_head.fan_in()[64:].double().mean()
        assert 0 < fan_in < 32


def test_resize_token_embeddings_refuses_a_size_the_vector_head_cannot_have_before_anything_changes():
    from torch_sparse_metal.huggingface import resize_token_embeddings

    model = _sparse_llama()
    model.lm_head = sparsify(nn.Sequential(nn.Linear(32, 64, bias=False)), density=0.25, block=8)[0]
    before, head = snapshot(model), model.lm_head
    with pytest.raises(ValueError, match="out_features=70 is not a multiple of block=8"):
        resize_token_embeddings(model, 70)
    assert changes(before, model) == [] and model.lm_head is head and model.config.vocab_size == 64


def _sparse_head_llama(how: str, tmp_path, tied: bool = False):
    """A Llama whose lm_head is sparse, made so in one of the ways users do it."""
    transformers = _transformers()
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(_llama_config(tied)).eval()
    if how == "sparsify":
        return sparsify(model, density=0.25, filter=lambda name, m: name == "lm_head")
    if how == "assigned":  # by hand (a tied model: sparsify refuses to untie it)
        model.lm_head = SparseLinear.from_dense(model.lm_head, torch.rand(64, 32) < 0.25)
        return model
    sparsify(model, density=0.25, filter=lambda name, m: name == "lm_head").save_pretrained(tmp_path)
    return load_sparse_checkpoint(transformers.LlamaForCausalLM(_llama_config()), tmp_path).eval()


@pytest.mark.parametrize("how", ["sparsify", "assigned", "load_sparse_checkpoint"])
@pytest.mark.parametrize("tokens, pad", [(80, None), (48, None), (70, 16)])
def test_hf_own_resize_token_embeddings_resizes_a_sparse_head(tmp_path, how, tokens, pad):
    model = _sparse_head_llama(how, tmp_path)
    dense = copy.deepcopy(model)
    dense.lm_head = dense.lm_head.to_linear()  # the same function, as nn.Linear: Hugging Face's own resize applies
    ids = torch.randint(0, min(tokens, 64), (2, 7))
    before = model(ids).logits
    embeddings = model.resize_token_embeddings(tokens, pad_to_multiple_of=pad)
    dense.resize_token_embeddings(tokens, pad_to_multiple_of=pad)
    size = dense.config.vocab_size
    assert size == (tokens if pad is None else 80)
    assert embeddings is model.get_input_embeddings() and embeddings.weight.shape == (size, 32)
    assert isinstance(model.lm_head, SparseLinear) and model.lm_head.out_features == model.config.vocab_size == size
    shared = min(size, 64)  # the remaining tokens' embeddings and outputs are those the dense resize keeps
    torch.testing.assert_close(embeddings.weight[:shared], dense.get_input_embeddings().weight[:shared], rtol=0, atol=0)
    after = model(ids).logits
    assert after.shape == (2, 7, size)
    torch.testing.assert_close(after[..., :shared], before[..., :shared], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.to_dense()[:shared].double(), dense.lm_head.weight[:shared].double(),
                               rtol=0, atol=0)


def test_hf_own_resize_token_embeddings_refuses_a_tied_config_before_anything_changes(tmp_path):
    model = _sparse_head_llama("assigned", tmp_path, tied=True)
    before, head, embeddings = snapshot(model), model.lm_head, model.get_input_embeddings()
    with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight.*tie_word_embeddings = "
                                         "False.*nothing was changed"):
        model.resize_token_embeddings(80)
    assert changes(before, model) == [] and model.lm_head is head and model.get_input_embeddings() is embeddings
    assert model.config.vocab_size == 64
    model.config.tie_word_embeddings = False  # what the refusal says: then it resizes
    model.resize_token_embeddings(80)
    assert model.lm_head.out_features == model.get_input_embeddings().num_embeddings == 80


def _tied_lm(arch: str):
    """A tiny tied Hugging Face language model from a configuration (its lm_head is the input embeddings)."""
    transformers = _transformers()
    torch.manual_seed(int(torch.randint(2**31, (1,))))
    if arch == "llama":
        model = transformers.LlamaForCausalLM(_llama_config(tied=True))
    else:  # GPT-2 ties by default
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                     n_positions=16, bos_token_id=0, eos_token_id=0))
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_tie_weights_cannot_put_the_embedding_matrix_on_a_sparse_head(arch):
    """A tied model whose lm_head was made sparse by hand: ``tie_weights()`` (which from_pretrained, post_init and
    resizes call) would assign the [vocab, hidden] embeddings to the layer's [nnz] values. It raises naming the
    untie, and the model computes what it computed; untied, tie_weights() leaves the sparse head alone."""
    model = _tied_lm(arch)
    mask = torch.rand(64, 32) < 0.25
    dense_head = nn.Linear(32, 64, bias=False)  # the reference: nn.Linear with the sparse head's matrix
    with torch.no_grad():
        dense_head.weight.copy_(model.lm_head.weight * mask)
    model.lm_head = SparseLinear.from_dense(model.lm_head, mask)
    head, weight, values = model.lm_head, model.lm_head.weight, model.lm_head.weight.detach().clone()
    ids = torch.randint(0, 64, (2, 7))
    hidden = model.base_model(ids).last_hidden_state
    expected = dense_head(hidden)
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"SparseLinear.weight holds the layer's \d+ edge values.*cannot be replaced "
                                         r"by a tensor of shape \(64, 32\).*tie_word_embeddings = False"):
        model.tie_weights()
    assert model.lm_head is head and head.weight is weight and torch.equal(weight, values)
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    model.config.tie_word_embeddings = False  # what the refusal says
    model.tie_weights()
    assert model.lm_head is head and head.weight is weight and torch.equal(weight, values)
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sparsify_refuses_a_head_the_configuration_ties_even_with_its_own_parameter(arch):
    """Untying the Parameters alone leaves the configuration's tie, which tie_weights() would apply to the sparse
    layer later: sparsify refuses before anything changes and names the untie; done as it says, it converts."""
    model = _tied_lm(arch)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # its own Parameter, config still tied
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"configuration ties lm_head.weight to .*tie_word_embeddings.*Nothing was "
                                         r"changed.*tie_word_embeddings = False"):
        sparsify(model, density=0.25, filter=lambda name, m: name == "lm_head")
    assert changes(before, model) == [] and type(model.lm_head) is nn.Linear
    model.config.tie_word_embeddings = False
    sparsify(model, density=0.25, filter=lambda name, m: name == "lm_head")
    model.tie_weights()
    assert isinstance(model.lm_head, SparseLinear) and model.lm_head.weight.shape == (model.lm_head.nnz,)
    assert model(torch.randint(0, 64, (1, 5))).logits.shape == (1, 5, 64)


def test_a_resize_that_fails_inside_hugging_face_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    model = _sparse_head_llama("sparsify", tmp_path)
    before, head, embeddings = snapshot(model), model.lm_head, model.get_input_embeddings()
    attribute = model.__dict__.get("vocab_size")

    def fail(self, *args, **kwargs):  # after Hugging Face replaced the input embeddings and set vocab_size
        raise RuntimeError("tie_weights failed")

    monkeypatch.setattr(type(model), "tie_weights", fail)
    with pytest.raises(RuntimeError, match="tie_weights failed"):
        model.resize_token_embeddings(80)
    assert changes(before, model) == [] and model.lm_head is head and model.get_input_embeddings() is embeddings
    assert model.config.vocab_size == 64 and model.__dict__.get("vocab_size") == attribute
    assert embeddings.num_embeddings == 64 and model(torch.randint(0, 64, (1, 5))).logits.shape == (1, 5, 64)


def test_a_routed_resize_of_a_dense_head_is_hugging_faces_own(tmp_path):
    model = _sparse_head_llama("sparsify", tmp_path)
    model.lm_head = model.lm_head.to_linear()  # dense again: the route passes through
    twin = copy.deepcopy(model)
    torch.manual_seed(3)
    model.resize_token_embeddings(72)
    torch.manual_seed(3)
    type(twin).resize_token_embeddings(twin, 72)
    assert type(model.lm_head) is nn.Linear
    mine, theirs = model.state_dict(), twin.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
