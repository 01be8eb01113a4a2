"""Sparse fine-tuning of whole models: deltas by module names, gradient-chosen connections, merge_and_unload, the
deltas saved and loaded alone or with the model, and a tiny Hugging Face model fine-tuned, saved and reloaded in
a fresh process with identical outputs."""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import run_python_json
from torch import nn

from torch_sparse_metal import SparseDelta, add_sparse_deltas, finetune, load_deltas, merge_and_unload, save_deltas


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.ReLU()), nn.Linear(32, 4))


def _seed() -> int:
    return int(torch.randint(2**31, (1,)))


def test_target_names_select_as_peft_does():
    model = _mlp(0)
    assert finetune.target_names(model, ["3"]) == ["3"]
    assert finetune.target_names(model, ["2.0"]) == ["2.0"]
    assert finetune.target_names(model, ["0", "3"]) == ["0", "2.0", "3"]  # "0" is also the suffix of "2.0"
    assert finetune.target_names(model, r"[03]") == ["0", "3"]  # a regular expression matches the whole name
    with pytest.raises(ValueError, match="not nn.Linear"):
        finetune.target_names(model, ["1"])
    with pytest.raises(ValueError, match="selects no"):
        finetune.target_names(model, ["q_proj"])
    with pytest.raises(ValueError, match="list of module names"):
        finetune.target_names(model, [])


def test_add_sparse_deltas_trains_only_the_deltas_and_refuses_without_changing_the_model():
    model = _mlp(_seed())
    x = torch.randn(5, 24)
    y = model(x)
    with pytest.raises(ValueError, match="not select"):
        add_sparse_deltas(model, ["3"], density=0.1, scores={"0": torch.rand(32, 24)})
    with pytest.raises(ValueError, match="density"):
        add_sparse_deltas(model, "0|3", density=2.0)
    assert not any(isinstance(m, SparseDelta) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    deltas = add_sparse_deltas(model, "0|3", density=0.1, block=1)
    assert list(deltas) == ["0", "3"] and model[0] is deltas["0"]
    assert torch.equal(model(x), y)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["0.delta.weight", "3.delta.weight"]
    add_sparse_deltas(model, ["2.0"], density=0.1)  # a second call keeps the first deltas trainable
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["0.delta.weight", "2.0.delta.weight",
                                                                            "3.delta.weight"]


def test_accumulated_gradients_are_the_summed_dense_gradients_and_leave_the_model_as_it_was():
    model = _mlp(_seed())
    model[3].weight.requires_grad_(False)
    marker = torch.randn_like(model[0].weight)
    model[0].weight.grad = marker.clone()
    batches = [torch.randn(6, 24) for _ in range(3)]

    def loss_fn(m, x):
        return m(x).square().mean()

    scores = finetune.accumulated_gradients(model, "0|3", batches, loss_fn)
    reference = {}
    for name in ("0", "3"):  # independent: float64 copy, full autograd per batch
        copy = _mlp(0).double()
        copy.load_state_dict(model.state_dict())
        total = torch.zeros_like(copy.get_submodule(name).weight)
        for x in batches:
            copy.zero_grad()
            loss_fn(copy, x.double()).backward()
            total += copy.get_submodule(name).weight.grad
        reference[name] = total.abs()
    for name in ("0", "3"):
        torch.testing.assert_close(scores[name].double(), reference[name], rtol=1e-4, atol=1e-6)
    assert torch.equal(model[0].weight.grad, marker) and model[3].weight.grad is None
    assert model[0].weight.requires_grad and not model[3].weight.requires_grad
    assert model[2][0].weight.grad is None

    deltas = add_sparse_deltas(model, "0", density=0.05, scores={"0": scores["0"]})
    count = deltas["0"].delta.nnz
    top = set(scores["0"].double().reshape(-1).argsort(descending=True)[:count].tolist())
    rows, cols = deltas["0"].delta.indices()
    assert {int(r) * 24 + int(c) for r, c in zip(rows, cols)} == top


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_deltas_alone_save_small_and_load_onto_a_fresh_model(tmp_path, suffix):
    seed = _seed()
    model = _mlp(seed)
    add_sparse_deltas(model, ["0", "2.0"], density=0.05, block=1)
    add_sparse_deltas(model, ["3"], density=0.25, block=1)
    for wrapper in (model[0], model[2][0], model[3]):
        with torch.no_grad():
            wrapper.delta.weight.normal_()
    path = tmp_path / f"deltas{suffix}"
    save_deltas(model, path)
    nnz = sum(m.delta.nnz for m in (model[0], model[2][0], model[3]))
    if suffix == ".safetensors":  # values and indices: a few bytes per connection, far below the dense weights
        assert path.stat().st_size < 16 * nnz + 4096 < 4 * (24 * 32 + 32 * 32 + 32 * 4)

    fresh = _mlp(seed)
    x = torch.randn(7, 24)
    loaded = load_deltas(fresh, path)
    assert sorted(loaded) == ["0", "2.0", "3"]
    assert torch.equal(fresh(x), model(x))
    assert [n for n, p in fresh.named_parameters() if p.requires_grad] == ["0.delta.weight", "2.0.delta.weight",
                                                                            "3.delta.weight"]


def test_a_refused_load_leaves_the_model_as_it_was():
    model = _mlp(_seed())
    add_sparse_deltas(model, "0", density=0.1)
    state = finetune.delta_state_dict(model)
    other = nn.Sequential(nn.Linear(24, 32))
    with pytest.raises(ValueError, match="16x24|32x24|out x in|features"):
        load_deltas(nn.Sequential(nn.Linear(24, 16)), state)
    with pytest.raises(ValueError, match="does not have"):
        load_deltas(nn.Sequential(), state)
    bad = {**state, "0.delta.weight": state["0.delta.weight"][:-1]}
    before = other[0]
    with pytest.raises(RuntimeError, match="weight must have shape"):
        load_deltas(other, bad)
    assert other[0] is before and all(p.requires_grad for p in other.parameters())
    with pytest.raises(ValueError, match="no sparse delta"):
        load_deltas(other, {"0.weight": torch.zeros(32, 24)})


def test_merge_and_unload_gives_plain_linear_layers_with_the_same_function():
    model = _mlp(_seed())
    bases = [model[0].weight.detach().clone(), model[3].weight.detach().clone()]
    add_sparse_deltas(model, "0|3", density=0.2, block=1)
    for name in ("0", "3"):
        with torch.no_grad():
            model.get_submodule(name).delta.weight.normal_()
    x = torch.randn(9, 24)
    y = model(x)
    finetune.merge_deltas(model)
    assert all(m.merged for m in (model[0], model[3]))
    finetune.unmerge_deltas(model)
    assert torch.equal(model[0].base.weight, bases[0]) and torch.equal(model[3].base.weight, bases[1])
    plain = merge_and_unload(model)
    assert plain is model and type(model[0]) is nn.Linear and type(model[3]) is nn.Linear
    assert not any(isinstance(m, SparseDelta) for m in model.modules())
    torch.testing.assert_close(model(x), y, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- Hugging Face
_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)

_RELOAD = """
import json, sys, torch, transformers
from torch_sparse_metal import load_deltas
base_dir, deltas, full_dir, ids = sys.argv[1:] if len(sys.argv) > 1 else ({args})
ids = torch.load(ids)
with_deltas = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
load_deltas(with_deltas, deltas)
whole = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{config})).eval()
load_deltas(whole, full_dir)
out = {{"deltas": with_deltas(ids).logits.tolist(), "whole": whole(ids).logits.tolist()}}
print(json.dumps(out))
"""


def test_hugging_face_model_fine_tunes_saves_and_reloads_in_a_fresh_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(_seed())
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CONFIG))
    model.save_pretrained(tmp_path / "base")  # the "pretrained" model
    deltas = add_sparse_deltas(model, ["q_proj", "v_proj"], density=0.05)
    add_sparse_deltas(model, ["up_proj"], density=0.125, block=8)  # the vector layout beside the unstructured one
    assert len(deltas) == 4 and all(isinstance(model.model.layers[i].mlp.up_proj, SparseDelta) for i in (0, 1))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 6 and all(p.dim() == 1 for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    data = torch.randint(0, 64, (4, 2, 9))
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    model.eval()
    ids = torch.randint(0, 64, (2, 7))
    torch.save(ids, tmp_path / "ids.pt")
    expected = model(ids).logits
    save_deltas(model, tmp_path / "deltas.safetensors")
    model.save_pretrained(tmp_path / "full")
    assert (tmp_path / "full" / "model.safetensors").exists()

    args = ", ".join(repr(str(tmp_path / p)) for p in ("base", "deltas.safetensors", "full", "ids.pt"))
    out = run_python_json(_RELOAD.format(args=args, config=json.dumps(_CONFIG).replace("false", "False")))
    assert torch.equal(torch.tensor(out["deltas"]), expected)
    assert torch.equal(torch.tensor(out["whole"]), expected)

    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        empty = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CONFIG))
    with pytest.raises(ValueError, match="meta device"):
        load_deltas(empty, tmp_path / "deltas.safetensors")
    load_deltas(empty, tmp_path / "full")
    assert not any(p.device.type == "meta" for p in empty.parameters())
    assert torch.equal(empty.eval()(ids).logits, expected)

    merged = merge_and_unload(model)
    assert not any(isinstance(m, SparseDelta) for m in merged.modules())
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_a_whole_model_checkpoint_that_does_not_fit_is_refused_before_anything_loads():
    seed = _seed()
    model = _mlp(seed)
    add_sparse_deltas(model, "0|3", density=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = _mlp(seed + 1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for bad, match in (({**state, "2.0.weight": torch.zeros(32, 31)}, "do not fit"),
                       ({k: v for k, v in state.items() if k != "2.0.bias"}, "Missing keys: \\['2.0.bias'\\]"),
                       ({**state, "9.weight": torch.zeros(1)}, "Unexpected keys: \\['9.weight'\\]")):
        with pytest.raises(ValueError, match=match):
            load_deltas(fresh, bad)
        assert not any(isinstance(m, SparseDelta) for m in fresh.modules())
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    load_deltas(fresh, state)
    x = torch.randn(3, 24)
    assert torch.equal(fresh(x), model(x))


def test_target_names_never_select_inside_a_wrapper_nor_a_wrapper_again():
    model = _mlp(0)
    add_sparse_deltas(model, "0", density=0.1)
    assert finetune.target_names(model, r".*\.0") == ["2.0"]  # not 0.base
    with pytest.raises(ValueError, match="have a sparse delta already: 0"):
        finetune.target_names(model, ["0"])
