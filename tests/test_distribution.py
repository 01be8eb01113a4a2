"""Layer-wise densities (uniform, ER/ERK, global magnitude, layers kept dense) against hand-computed references."""

import pytest
import torch
from torch import nn

from torch_sparse_metal import SparseLinear, sparsify
from torch_sparse_metal.convert import sparsify_densities
from torch_sparse_metal.distribution import layer_densities


def _random_shapes(gen, count):
    sizes = lambda: int(torch.randint(2, 90, (1,), generator=gen))  # noqa: E731
    return {f"l{i}": (sizes(), sizes()) for i in range(count)}


def _counts(shapes, densities):
    return {k: round(densities[k] * o * i) for k, (o, i) in shapes.items()}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("distribution", ["er", "erk"])
def test_erk_matches_the_formula_when_no_layer_fills(seed, distribution):
    gen = torch.Generator().manual_seed(seed)
    shapes = _random_shapes(gen, 2 + seed)
    total = sum(o * i for o, i in shapes.values())
    # the largest density that leaves every layer below 1: eps * max raw <= 1
    raw = {k: (o + i) / (o * i) for k, (o, i) in shapes.items()}
    most = min(1.0, sum(o + i for o, i in shapes.values()) / max(raw.values()) / total)
    density = float(torch.rand((), generator=gen)) * most * 0.95
    got = layer_densities(shapes, density, distribution)
    target = round(density * total)
    eps = target / sum(o + i for o, i in shapes.values())  # RigL: sum_l eps * (in + out) = kept connections
    counts = _counts(shapes, got)
    assert sum(counts.values()) == target
    for k, (o, i) in shapes.items():
        assert abs(counts[k] - eps * (o + i)) < 1.0, k  # rounded to a whole count, by less than one
        assert counts[k] == pytest.approx(got[k] * o * i, abs=1e-6)


def test_erk_fills_layers_past_one_and_rescales_the_rest():
    # a 4x3 layer's raw density (7/12) is far above the 64x64 ones' (1/32): at 30% it would exceed 1
    shapes = {"small": (4, 3), "a": (64, 64), "b": (64, 64), "tiny": (2, 2)}
    density = 0.3
    total = sum(o * i for o, i in shapes.values())
    target = round(density * total)
    eps = target / sum(o + i for o, i in shapes.values())
    assert eps * 7 / 12 > 1 and eps * 4 / 4 > 1  # both small layers would exceed 1 at the first eps
    # RigL's loop: first the largest raw density (tiny, 1.0) becomes dense, then small (7/12) still exceeds 1
    eps = (target - 4) / (7 + 128 + 128)
    assert eps * 7 / 12 > 1
    eps = (target - 4 - 12) / (128 + 128)
    got = layer_densities(shapes, density, "erk")
    assert got["tiny"] == 1.0 and got["small"] == 1.0
    counts = _counts(shapes, got)
    assert sum(counts.values()) == target
    for k in ("a", "b"):
        assert abs(counts[k] - eps * 128) < 1.0


@pytest.mark.parametrize("seed", range(4))
def test_global_keeps_the_largest_weights_of_all_layers_together(seed):
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(30, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 7))
    with torch.no_grad():
        for i, scale in zip((0, 2, 4), torch.rand(3, generator=gen) * 3):
            model[i].weight.copy_(torch.randn(model[i].weight.shape, generator=gen) * scale)
    dense = {i: model[i].weight.detach().clone() for i in (0, 2, 4)}
    density = 0.05 + 0.5 * float(torch.rand((), generator=gen))
    total = sum(w.numel() for w in dense.values())
    k = round(density * total)
    threshold = torch.cat([w.abs().flatten() for w in dense.values()]).sort(descending=True).values[k - 1]
    model = sparsify(model, density=density, distribution="global")
    assert sum(model[i].nnz for i in (0, 2, 4)) == k
    for i, w in dense.items():
        expected = w.abs() >= threshold
        assert torch.equal(model[i].to_dense() != 0, expected), i
        assert torch.equal(model[i].to_dense()[expected], w[expected])


def test_sparsify_erk_total_and_dense_layers(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    sizes = [m.weight.numel() for m in model if isinstance(m, nn.Linear)]
    density = 0.2
    planned = sparsify_densities(model, density, distribution="erk")
    raw = [(o + i) / (o * i) for o, i in ((128, 64), (128, 128), (4, 128))]
    eps = round(density * sum(sizes)) / sum(r * n for r, n in zip(raw, sizes))
    assert eps * raw[2] > 1 and planned["4"] == 1.0  # the 4-output head would exceed 1: it stays dense
    with caplog.at_level("INFO", logger="torch_sparse_metal.convert"):
        model = sparsify(model, density=density, distribution="erk")
    assert [r.getMessage() for r in caplog.records] == [
        f"sparsify: 0 density {planned['0']:.6g}", f"sparsify: 2 density {planned['2']:.6g}",
        "sparsify: 4 density 1 (stays nn.Linear)"]
    assert isinstance(model[0], SparseLinear) and isinstance(model[2], SparseLinear)
    assert type(model[4]) is nn.Linear
    assert model[0].nnz + model[2].nnz + model[4].weight.numel() == round(density * sum(sizes))
    assert model[0].density > model[2].density  # ERK: the smaller layer is denser
    assert [model[0].density, model[2].density] == pytest.approx([planned["0"], planned["2"]])


def test_uniform_with_layers_kept_dense_keeps_the_global_target():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    density = 0.5
    total = 32 * 64 + 64 * 64 + 64 * 10
    model = sparsify(model, density=density, keep_dense=["0", "4"])
    assert type(model[0]) is nn.Linear and type(model[4]) is nn.Linear and isinstance(model[2], SparseLinear)
    assert model[2].nnz == round(density * total) - 32 * 64 - 64 * 10


def test_plain_uniform_is_per_layer_as_before():
    model = nn.Sequential(nn.Linear(33, 17), nn.Linear(17, 9))
    model = sparsify(model, density=0.3)
    assert [m.nnz for m in model] == [round(0.3 * 33 * 17), round(0.3 * 17 * 9)]


def test_block_counts_whole_vectors():
    shapes = {"a": (64, 48), "b": (32, 100), "c": (8, 40)}
    got = layer_densities(shapes, 0.15, "erk", block=8)
    vectors = {k: got[k] * (o // 8) * i for k, (o, i) in shapes.items()}
    assert all(abs(v - round(v)) < 1e-6 for v in vectors.values())
    assert round(sum(vectors.values())) == round(0.15 * sum(o // 8 * i for o, i in shapes.values()))


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(distribution="lognormal"), ValueError, "distribution must be one of"),
    (dict(keep_dense=["9"]), ValueError, "not nn.Linear layers chosen"),
    (dict(keep_dense="0"), TypeError, "layer names"),
    (dict(keep_dense=["0", "2"], density=0.1), ValueError, "kept dense"),
])
def test_bad_distribution_arguments_change_nothing(kwargs, error, message):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=message):
        sparsify(model, **{"density": 0.3, **kwargs})
    assert all(type(m) is not SparseLinear for m in model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_global_needs_weights():
    with pytest.raises(ValueError, match="pass weights="):
        layer_densities({"a": (4, 4)}, 0.5, "global")


@pytest.mark.parametrize("d_model", [32, 48])
def test_char_transformer_erk_layers(d_model):
    from char_lm.cli import build_parser
    from char_lm.model import CharTransformer, ModelConfig

    assert build_parser().parse_args(["--distribution", "erk"]).distribution == "erk"
    density = 0.2
    cfg = ModelConfig(vocab_size=20, context=8, d_model=d_model, n_layers=2, n_heads=2, density=density,
                      distribution="erk")
    model = CharTransformer(cfg, generator=torch.Generator().manual_seed(0))
    shapes = cfg.block_shapes()  # (in, out)
    per_block = sum(i * o for i, o in shapes)
    eps = round(density * per_block) / sum(i + o for i, o in shapes)
    layers = [m for m in model.blocks.modules() if isinstance(m, SparseLinear)]
    assert len(layers) == 4 * cfg.n_layers
    for layer in layers:
        n_in, n_out = layer.in_features, layer.out_features
        assert abs(layer.nnz - eps * (n_in + n_out)) < 1.0
    assert model.block_weights() == cfg.n_layers * round(density * per_block) == cfg.block_weights()


def test_erk_totals_are_exact_and_densities_bounded_on_random_layers():
    gen = torch.Generator().manual_seed(7)
    for _ in range(300):
        shapes = _random_shapes(gen, int(torch.randint(1, 7, (1,), generator=gen)))
        density = float(torch.rand((), generator=gen))
        got = layer_densities(shapes, density, "erk")
        assert sum(_counts(shapes, got).values()) == round(density * sum(o * i for o, i in shapes.values()))
        assert all(0.0 <= d <= 1.0 for d in got.values())
        sparse = {k: (o + i) / (o * i) for k, (o, i) in shapes.items() if got[k] < 1.0}
        if len(sparse) > 1:  # the layers left sparse keep ERK's proportions (to whole edges)
            a, b = sorted(sparse, key=sparse.get)[:: len(sparse) - 1]
            slack = 1.0 / (shapes[a][0] * shapes[a][1]) + 1.0 / (shapes[b][0] * shapes[b][1])  # one edge each
            assert got[a] <= got[b] + slack + 1e-12
