"""Adversarial tables for every state-changing call: a malformed checkpoint or plan raises an exception naming the
problem and leaves every tensor (parameters, buffers, optimizer state) and the schedule bitwise as it was.

Covers SparseLinear.load_state_dict (each entry replaced by None, a meta, sparse or wrong-dtype/shape tensor, a
non-tensor; missing and unexpected keys; strict and non-strict; non-strict partial checkpoints that cannot be
placed), DynamicSparsity.load_state_dict, plan_update and apply_update (plans for another layer, collapsing or
out-of-range edge maps, hand-built topologies, bad optimizers).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.evolve import DynamicSparsity, EdgeMap, apply_update, plan_update
from tsm_dev.snapshot import changes, snapshot


def _layer(seed: int = 0, n_in: int = 12, n_out: int = 7, bias: bool = True) -> SparseLinear:
    return SparseLinear(n_in, n_out, bias=bias, density=0.4, generator=torch.Generator().manual_seed(seed))


def _trained(layer: SparseLinear) -> tuple[torch.optim.Optimizer, ...]:
    """An AdamW and an SGD-with-momentum optimizer, each with per-edge state after one step."""
    opts = (torch.optim.AdamW(layer.parameters(), lr=0.01), torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9))
    for opt in opts:
        layer(torch.randn(4, layer.in_features)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return opts


def _trained_snapshot() -> tuple[SparseLinear, tuple[torch.optim.Optimizer, ...], object]:
    """A layer, its trained optimizers (:func:`_trained`) and their snapshot, to compare after a refusal."""
    layer = _layer()
    opts = _trained(layer)
    return layer, opts, snapshot(layer, opts)


# ------------------------------------------------------------------------------------ SparseLinear checkpoints
def _put(key, value):
    return lambda sd: sd.__setitem__(key, value(sd[key]) if callable(value) else value)


def _extra(index: int, value: int):
    """Set one field of the extra-state tensor ``[format, in_features, out_features, block]``."""
    return _put("_extra_state", lambda t: t.index_fill(0, torch.tensor([index]), value))


def _legacy(**fields):
    """Replace the extra state by the dict earlier versions wrote (format 1), with ``fields`` changed."""
    def corrupt(sd):
        fmt, n_in, n_out, block = sd["_extra_state"].tolist()
        sd["_extra_state"] = {"in_features": n_in, "out_features": n_out, "block": block, "format": 1, **fields}
    return corrupt


ENTRY = {  # what replaces an entry: (value from the valid one, message)
    "None": (None, "must be a tensor, got NoneType"),
    "meta": (lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), "dense tensor with data"),
    "sparse": (lambda t: t.to_sparse(), "dense tensor with data"),
    "list": (lambda t: t.tolist(), "must be a tensor, got list"),
    "str": ("0,1,2", "must be a tensor, got str"),
    "numpy": (lambda t: t.numpy(), "must be a tensor, got ndarray"),
    "2-D": (lambda t: t[None].clone(), "must have shape|must be 1-D"),
    "empty": (lambda t: t[:0].clone(), "must have shape|entries|ends at"),
    "truncated": (lambda t: t[:-1].clone(), "must have shape|entries|ends at"),
    "bool": (lambda t: t.bool(), "must be floating point|must hold integers"),
    "complex": (lambda t: t.to(torch.complex64), "must be floating point|must hold integers"),
}
INDEX_ONLY = {  # corruptions of the index arrays' values
    "dst shifted past out_features": (_put("dst", lambda t: t + 1000), "out of range"),
    "dst negative": (_put("dst", lambda t: t - 1000), "out of range"),
    "dst reversed": (_put("dst", lambda t: t.flip(0)), "not sorted|duplicate"),
    "dst duplicated edge": (_put("dst", lambda t: t.index_fill(0, torch.tensor([1]), int(t[0]))), "not sorted|dupl"),
    "row_ptr starts at 1": (_put("row_ptr", lambda t: t.index_fill(0, torch.tensor([0]), 1)), "start at 0"),
    "row_ptr decreases": (_put("row_ptr", lambda t: t.index_fill(0, torch.tensor([3]), -1)), "non-decreasing"),
    "row_ptr ends past nnz": (_put("row_ptr", lambda t: t.index_fill(0, torch.tensor([len(t) - 1]), 10**6)),
                              "ends at"),
    "row_ptr float": (_put("row_ptr", lambda t: t.float()), "must hold integers"),
    "in_features not int": (_legacy(in_features="9"), "in_features must be an int"),
    "in_features negative": (_legacy(in_features=-1), "in_features must be >= 0"),
    "in_features disagrees": (_legacy(in_features=4), "row_ptr must have"),
    "out_features 0": (_legacy(out_features=0), "cannot fit"),
    "out_features past int32": (_legacy(out_features=2**40), "int32"),
    "format from the future (legacy dict)": (_legacy(format=2), "format 2"),
    "tensor in_features negative": (_extra(1, -1), "in_features must be >= 0"),
    "tensor in_features disagrees": (_extra(1, 4), "row_ptr must have"),
    "tensor out_features 0": (_extra(2, 0), "cannot fit"),
    "tensor out_features past int32": (_extra(2, 2**40), "int32"),
    "tensor format from the future": (_extra(0, 3), "format 3"),
    "tensor block 3": (_extra(3, 3), "checkpoint's block is invalid: block must be one of"),
    "tensor too short": (_put("_extra_state", lambda t: t[:3].clone()), "must hold \\[format, in_features"),
    "tensor float": (_put("_extra_state", lambda t: t.float()), "1-D integer tensor"),
    "tensor 2-D": (_put("_extra_state", lambda t: t[None].clone()), "1-D integer tensor"),
    "tensor empty": (_put("_extra_state", lambda t: t[:0].clone()), "has format None"),
    "extra state None": (_put("_extra_state", None), "_extra_state must be a tensor"),
    "extra state list": (_put("_extra_state", [1, 2]), "_extra_state must be a tensor"),
    "legacy block 3": (_legacy(block=3), "checkpoint's block is invalid"),
    "legacy block '8'": (_legacy(block="8"), "checkpoint's block is invalid"),
    "weight long": (_put("weight", lambda t: t.long()), "weight must be floating point"),
    "bias long": (_put("bias", lambda t: t.long()), "bias must be floating point"),
    "bias too short": (_put("bias", lambda t: t[:3].clone()), "bias must have shape"),
    "bias a float": (_put("bias", 0.0), "bias must be a tensor, got float"),
}
CHECKPOINT_CASES = {f"{key} {kind}": (_put(key, value), message)
                    for key in ("weight", "bias", "row_ptr", "dst") for kind, (value, message) in ENTRY.items()}
CHECKPOINT_CASES.update(INDEX_ONLY)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_malformed_checkpoint_changes_nothing(case, strict):
    corrupt, message = CHECKPOINT_CASES[case]
    layer, opts, before = _trained_snapshot()
    state = copy.deepcopy(_layer(seed=1, n_in=9, n_out=5).state_dict())  # another shape and topology
    corrupt(state)
    with pytest.raises(RuntimeError, match=message):
        layer.load_state_dict(state, strict=strict)
    assert changes(before, layer, opts) == []
    assert layer(torch.randn(2, 12)).shape == (2, 7)


KEY_CASES = {
    "missing weight": (lambda sd: sd.pop("weight"), 'Missing key\\(s\\) in state_dict: "weight"'),
    "missing row_ptr": (lambda sd: sd.pop("row_ptr"), '"row_ptr"'),
    "missing bias": (lambda sd: sd.pop("bias"), '"bias"'),
    "unexpected key": (lambda sd: sd.__setitem__("stray", torch.zeros(1)),
                       'Unexpected key\\(s\\) in state_dict: "stray"'),
    "unexpected nested key": (lambda sd: sd.__setitem__("a.b", torch.zeros(1)), '"a.b"'),
    "derived buffer saved": (lambda sd: sd.__setitem__("perm", torch.zeros(3, dtype=torch.int32)), '"perm"'),
}


@pytest.mark.parametrize("case", list(KEY_CASES))
def test_strict_load_with_wrong_keys_changes_nothing(case):
    corrupt, message = KEY_CASES[case]
    layer, opts, before = _trained_snapshot()
    state = _layer(seed=1, n_in=9, n_out=5).state_dict()
    corrupt(state)
    with pytest.raises(RuntimeError, match=f"(?s)nothing was loaded.*{message}"):
        layer.load_state_dict(state)
    assert changes(before, layer, opts) == []


@pytest.mark.parametrize("bad", [None, [("weight", torch.zeros(3))], "weights.pt", {3: torch.zeros(1)}],
                         ids=["None", "list of pairs", "a path", "int key"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_a_state_dict_that_is_no_mapping_of_names_changes_nothing(bad, strict):
    layer = _layer()
    before = snapshot(layer)
    with pytest.raises(TypeError, match="state_dict must be a mapping|keys must be strings"):
        layer.load_state_dict(bad, strict=strict)
    assert changes(before, layer) == []


@pytest.mark.parametrize("drop", ["row_ptr", "dst"])
def test_non_strict_load_with_half_a_topology_refuses_and_changes_nothing(drop):
    layer = _layer()
    before = snapshot(layer)
    state = _layer(seed=1, n_in=9, n_out=5).state_dict()
    del state[drop]
    with pytest.raises(RuntimeError, match="comes without .*the topology needs both"):
        layer.load_state_dict(state, strict=False)
    assert changes(before, layer) == []


PARTIAL_CASES = {  # non-strict loads whose entries contradict each other: (drop, corrupt, message)
    "topology of other edges without weight": ("weight", None, "weight is missing"),
    "no bias, other out_features": ("bias", None, "bias is missing"),
    "weight without topology, other size": (("row_ptr", "dst"), None, "as the checkpoint has none"),
    "weight without topology, malformed": (("row_ptr", "dst"), _put("weight", lambda t: t[None].clone()),
                                           "must have shape"),
    "bias alone of another size": (("row_ptr", "dst", "weight"), None, "bias must have shape"),
}


@pytest.mark.parametrize("case", list(PARTIAL_CASES))
def test_non_strict_partial_load_that_cannot_be_placed_changes_nothing(case):
    drop, corrupt, message = PARTIAL_CASES[case]
    layer, opts, before = _trained_snapshot()
    state = _layer(seed=1, n_in=9, n_out=5).state_dict()
    for key in (drop,) if isinstance(drop, str) else drop:
        del state[key]
    if corrupt is not None:
        corrupt(state)
    with pytest.raises(RuntimeError, match=message):
        layer.load_state_dict(state, strict=False)
    assert changes(before, layer, opts) == []


# ----------------------------------------------------------------------------------- DynamicSparsity checkpoints
def _schedule():
    model = torch.nn.Sequential(_layer(2), torch.nn.ReLU(), _layer(3, n_in=7, n_out=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    evo = DynamicSparsity(model, opt, prune_every=5, total_steps=100, generator=torch.Generator().manual_seed(0))
    return evo, evo.state_dict()


def _with(**entries):
    return lambda sd: {**sd, **entries}


EVO_CASES = {
    "not a dict": lambda sd: [1, 2],
    "None": lambda sd: None,
    "no steps": lambda sd: {k: v for k, v in sd.items() if k != "steps"},
    "no history": lambda sd: {k: v for k, v in sd.items() if k != "history"},
    "steps None": _with(steps=None),
    "steps negative": _with(steps=-5),
    "steps float": _with(steps=2.7),
    "steps str": _with(steps="3"),
    "steps bool": _with(steps=True),
    "steps tensor of 2": _with(steps=torch.tensor([1, 2])),
    "progress NaN": _with(progress=float("nan")),
    "progress inf": _with(progress=float("inf")),
    "progress str": _with(progress="half"),
    "start_nnz of another model": _with(start_nnz=[1]),
    "start_nnz negative": _with(start_nnz=[-1, 3]),
    "start_nnz float": _with(start_nnz=[1.5, 3]),
    "history malformed": _with(history=[("x", [1])]),
    "history negative count": _with(history=[(0, [-1, 2])]),
    "regrown of another length": _with(regrown=[1, 2, 3]),
    "regrown negative": _with(regrown=[-1]),
    "generator of another size": _with(generator=torch.zeros(3, dtype=torch.uint8)),
    "generator not bytes": _with(generator=torch.zeros(5056, dtype=torch.int64)),
}


@pytest.mark.parametrize("case", list(EVO_CASES))
def test_malformed_dynamic_sparsity_state_changes_nothing(case):
    evo, good = _schedule()
    other = {**copy.deepcopy(good), "steps": 7, "progress": 0.25,
             "history": [(0, good["start_nnz"]), (5, good["start_nnz"])], "regrown": [0, 4]}
    bad = EVO_CASES[case](other)  # every other field differs from the schedule's, so a partial load shows
    generator_state = evo.generator.get_state().clone()
    with pytest.raises(ValueError, match="DynamicSparsity state|layers|regrown|generator"):
        evo.load_state_dict(bad)
    after = evo.state_dict()
    assert {k: v for k, v in after.items() if k != "generator"} == {k: v for k, v in good.items() if k != "generator"}
    assert torch.equal(evo.generator.get_state(), generator_state)


# ---------------------------------------------------------------------------------------------- topology updates
def _plan(layer: SparseLinear):
    return plan_update(layer, 3, 3, generator=torch.Generator().manual_seed(0))


def _replace(field, make):
    def corrupt(layer, topology, edge_map):
        return dataclasses.replace(topology, **{field: make(getattr(topology, field))}), edge_map
    return corrupt


def _map(old_to_new=None, grown=None):
    def corrupt(layer, topology, edge_map):
        return topology, EdgeMap(edge_map.old_to_new if old_to_new is None else old_to_new(edge_map.old_to_new),
                                 edge_map.grown if grown is None else grown(edge_map.grown))
    return corrupt


APPLY_CASES = {
    "another layer's plan": (lambda layer, t, m: _plan(_layer(4, 9, 5)), "the plan is for a 9 -> 5 layer"),
    "all edges onto one": (_map(old_to_new=lambda t: torch.where(t >= 0, 0, t)), "exactly once"),
    "indices past the new topology": (_map(old_to_new=lambda t: t + 1000), "outside -1"),
    "indices below -1": (_map(old_to_new=lambda t: t - 1000), "outside -1"),
    "map of another length": (_map(old_to_new=lambda t: t[:-1]), "covers"),
    "grown repeated": (_map(grown=lambda g: g[:1].repeat(len(g))), "exactly once"),
    "grown missing": (_map(grown=lambda g: g[:0]), "exactly once"),
    "float map": (_map(old_to_new=lambda t: t.double()), "1-D int64 or int32 tensor"),
    "2-D grown": (_map(grown=lambda g: g[None]), "1-D int64 or int32 tensor"),
    "uint8 grown (indexes as a mask)": (_map(grown=lambda g: g.to(torch.uint8)), "1-D int64 or int32 tensor"),
    "list map": (_map(old_to_new=lambda t: t.tolist()), "1-D int64 or int32 tensor"),
    "hand-built dst out of range": (_replace("dst", lambda t: t + 50), "out of range"),
    "hand-built perm reversed": (_replace("perm", lambda t: t.flip(0).contiguous()), "perm does not match"),
    "hand-built src shifted": (_replace("src", lambda t: (t + 1) % 12), "src does not match"),
    "hand-built int64 dst": (_replace("dst", lambda t: t.long()), "contiguous 1-D int32"),
    "hand-built meta arrays": (lambda layer, t, m: (t.to("meta"), m), "on meta"),
    "not a plan": (lambda layer, t, m: (t, "map"), "pair that plan_update returns"),
    "optimizer None": (lambda layer, t, m: (t, m, [None]), "optimizer must be"),
    "layer None": (lambda layer, t, m: (t, m, "layer"), "layer must be a SparseLinear"),
}


@pytest.mark.parametrize("case", list(APPLY_CASES))
def test_apply_update_refuses_and_changes_nothing(case):
    corrupt, message = APPLY_CASES[case]
    layer, opts, before = _trained_snapshot()
    plan = corrupt(layer, *_plan(layer))
    target, optimizers = layer, list(opts)
    if len(plan) == 3:
        optimizers = plan[2] if plan[2] != "layer" else optimizers
        target = None if plan[2] == "layer" else layer
    with pytest.raises((ValueError, TypeError), match=message):
        apply_update(target, plan[0], plan[1], optimizers)
    assert changes(before, layer, opts) == []


PLAN_CASES = {
    "drop float": ({"drop": 2.5, "grow": 1}, "drop must be an integer"),
    "drop bool": ({"drop": True, "grow": 1}, "drop must be an integer"),
    "drop tensor": ({"drop": torch.tensor(2), "grow": 1}, "drop must be an integer"),
    "drop negative": ({"drop": -1, "grow": 1}, "drop must be an integer >= 0"),
    "drop more than nnz": ({"drop": 10**6, "grow": 0}, "cannot drop"),
    "grow float": ({"drop": 1, "grow": 1.0}, "grow must be an integer"),
    "grow past capacity": ({"drop": 0, "grow": 10**6}, "exceed|absent"),
    "mode unknown": ({"drop": 1, "grow": 1, "mode": "random"}, "mode must be"),
    "rigl without grad": ({"drop": 1, "grow": 1, "mode": "rigl"}, "needs the layer's input"),
    "rigl grad of wrong width": ({"drop": 1, "grow": 1, "mode": "rigl", "grad": (torch.randn(4, 11),
                                                                                  torch.randn(4, 7))}, "widths"),
    "rigl grad transposed": ({"drop": 1, "grow": 1, "mode": "rigl", "grad": (torch.randn(12, 4),
                                                                              torch.randn(7, 4))}, "shapes|widths"),
    "rigl grad of other batches": ({"drop": 1, "grow": 1, "mode": "rigl", "grad": (torch.randn(4, 12),
                                                                                    torch.randn(3, 7))}, "shapes"),
    "rigl grad a list": ({"drop": 1, "grow": 1, "mode": "rigl", "grad": [torch.randn(4, 12), torch.randn(4, 7)]},
                         "pair of tensors"),
    "rigl chunk 0": ({"drop": 1, "grow": 3, "mode": "rigl", "chunk": 0, "grad": (torch.randn(4, 12),
                                                                                  torch.randn(4, 7))}, "chunk"),
    "rigl chunk negative": ({"drop": 1, "grow": 3, "mode": "rigl", "chunk": -1, "grad": (torch.randn(4, 12),
                                                                                          torch.randn(4, 7))}, "chunk"),
    "generator a seed": ({"drop": 1, "grow": 1, "generator": 0}, "generator"),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_update_names_bad_arguments_and_changes_nothing(case):
    kwargs, message = PLAN_CASES[case]
    layer = _layer()
    before = snapshot(layer)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        plan_update(layer, **kwargs)
    assert changes(before, layer) == []


def test_rigl_plan_with_a_negative_chunk_grew_nothing_before():
    """Regression: chunk=-1 ranked no rows and returned a plan growing 0 of the 3 edges asked for."""
    with pytest.raises(ValueError, match="chunk must be an integer >= 1, got -1"):
        plan_update(_layer(), 1, 3, mode="rigl", grad=(torch.randn(4, 12), torch.randn(4, 7)), chunk=-1)
