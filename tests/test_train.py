"""Tests of the WikiText-103 training example: loading, the model, the sync-free step, resume, the CLI."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer, load_corpus
from char_lm.cli import main
from char_lm.data import WindowSampler, eval_windows, fallback_text, split_text
from char_lm.loop import DTYPES, TrainingDiverged, autocast_dtypes
from char_lm.report import plot_bpc
from PIL import Image  # matplotlib's dependency

from torch_sparse_metal_tools.testing import axes

ROOT = Path(__file__).resolve().parents[1]

WIKI_TRAIN = (
    " \n = Valkyrie Road = \n \n"
    " The road was built in 1931 @-@ 1934 by the county , at a cost of $ 2 @,@ 400 . \n \n"
    " = = History = = \n \n"
    " It crosses the river twice and climbs 300 @.@ 5 metres . \n"
) * 20
WIKI_VALID = " \n = The café = \n \n The café was built in 1950 . \n"
WIKI_TEST = " \n = Test = \n \n A road @-@ side inn . \n"

DEVICES = axes.DEVICES


def tiny_model(corpus: CharCorpus, **kw) -> ModelConfig:
    cfg = dict(vocab_size=corpus.vocab.size, context=32, d_model=32, n_layers=1, n_heads=2, density=0.25)
    return ModelConfig(**{**cfg, **kw})


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus.from_splits(*split_text(fallback_text()), source="fallback")


def needs_autocast(dtype: str, device: str = "cpu") -> None:
    if dtype not in autocast_dtypes(torch.device(device)):
        pytest.skip(f"torch {torch.__version__} cannot autocast to {dtype} on {device}")


def quiet(_msg: str) -> None:
    pass


QUIET = {"progress": False, "verbose": False}


# ------------------------------------------------------------------------------------------------- data
def test_wikitext_dir_round_trips_raw_text(tmp_path):
    for name, text in (("wiki.train.raw", WIKI_TRAIN), ("wiki.valid.raw", WIKI_VALID), ("wiki.test.raw", WIKI_TEST)):
        (tmp_path / name).write_text(text, encoding="utf-8")
    c = load_corpus(tmp_path, log=quiet)
    assert c.source.startswith("wikitext-dir:")
    assert c.vocab.decode(c.train.tolist()) == WIKI_TRAIN  # headings, blank lines and @-@ kept as written
    assert (c.train.numel(), c.valid.numel(), c.test.numel()) == (len(WIKI_TRAIN), len(WIKI_VALID), len(WIKI_TEST))
    assert "é" not in c.vocab.chars
    assert c.vocab.decode(c.valid.tolist()) == WIKI_VALID.replace("é", "\ufffd")  # unknown -> id 0
    assert int((c.valid == 0).sum()) == WIKI_VALID.count("é")
    assert c.train.dtype == torch.int16 and int(c.train.min()) >= 1


def test_wikitext_dir_missing_split_is_named(tmp_path):
    (tmp_path / "wiki.train.raw").write_text(WIKI_TRAIN)
    with pytest.raises(FileNotFoundError, match="wiki.valid.raw"):
        load_corpus(tmp_path, log=quiet)


def test_single_file_and_gzip_split_90_5_5(tmp_path):
    text = WIKI_TRAIN * 3
    plain, dz = tmp_path / "corpus.txt", tmp_path / "corpus.dict.dz"
    plain.write_text(text, encoding="utf-8")
    with gzip.open(dz, "wt", encoding="utf-8") as f:
        f.write(text)
    a, b = load_corpus(plain, log=quiet), load_corpus(dz, log=quiet)
    assert torch.equal(a.train, b.train) and torch.equal(a.valid, b.valid) and torch.equal(a.test, b.test)
    n = len(text)
    assert a.train.numel() == int(0.9 * n) and a.valid.numel() == int(0.05 * n)
    assert a.train.numel() + a.valid.numel() + a.test.numel() == n


def test_missing_data_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_corpus(tmp_path / "absent", log=quiet)


def test_datasets_path_is_used_when_available(monkeypatch):
    calls = []

    def load_dataset(path, name):
        calls.append((path, name))
        lines = lambda text: {"text": text.splitlines(keepends=True)}  # noqa: E731  (rows are raw lines)
        return {"train": lines(WIKI_TRAIN), "validation": lines(WIKI_VALID), "test": lines(WIKI_TEST)}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    c = load_corpus(None, log=quiet)
    assert calls == [("Salesforce/wikitext", "wikitext-103-raw-v1")]
    assert c.source.startswith("hf:")
    assert c.vocab.decode(c.train.tolist()) == WIKI_TRAIN and c.valid.numel() == len(WIKI_VALID)


@pytest.mark.parametrize("failure", ["not installed", "hub unreachable"])
def test_fallback_corpus_when_wikitext_unavailable(monkeypatch, failure):
    if failure == "not installed":
        monkeypatch.setitem(sys.modules, "datasets", None)  # import raises ImportError
    else:
        def load_dataset(path, name):
            raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub")

        monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    messages = []
    c = load_corpus(None, log=messages.append)
    assert c.source.startswith("fallback:")
    text = " ".join(messages)
    assert "WikiText-103 unavailable" in text and "Falling back" in text
    assert ("not installed" in text) == (failure == "not installed")


def test_fallback_corpus_is_plain_prose_of_the_right_size():
    text = fallback_text()
    assert 30_000 <= len(text.encode("utf-8")) <= 60_000
    assert text.isascii() and len(text.split()) > 5000


def test_sampler_draws_shifted_windows_and_resumes():
    tokens = torch.arange(500, dtype=torch.int16)
    s = WindowSampler(tokens, context=16, batch_size=8, seed=3)
    x, y = s.sample()
    assert x.shape == (8, 16) and x.dtype == torch.int64 and torch.equal(y - x, torch.ones_like(x))
    state = s.state_dict()
    expected = s.sample()
    s2 = WindowSampler(tokens, context=16, batch_size=8, seed=99)
    s2.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(s2.sample(), expected))


@pytest.mark.parametrize("named", [True, False], ids=["device-named", "older-checkpoint"])
def test_sampler_state_from_another_device_type_reseeds_deterministically(named):
    # A CUDA generator's state (16 bytes) cannot be set on a CPU generator: a run moved between device types
    # continues from a seed derived from the position, the same on every such resume.
    tokens = torch.arange(500, dtype=torch.int16)
    state = {"generator": torch.zeros(16, dtype=torch.uint8), "batches": 7} | ({"device": "cuda"} if named else {})
    drawn = []
    for _ in range(2):
        s = WindowSampler(tokens, context=16, batch_size=8, seed=3)
        assert s.load_state_dict(state) is False and s.batches == 7
        drawn.append(s.sample()[0])
    fresh = WindowSampler(tokens, context=16, batch_size=8, seed=3).sample()[0]
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], fresh)


def test_sampler_refuses_a_damaged_state_of_its_own_device_type():
    s = WindowSampler(torch.arange(500, dtype=torch.int16), context=16, batch_size=8, seed=3)
    with pytest.raises(RuntimeError):
        s.load_state_dict({"generator": torch.zeros(16, dtype=torch.uint8), "batches": 7, "device": "cpu"})


def test_resume_of_a_checkpoint_from_another_device_type_warns_and_continues(corpus):
    cfg = dict(steps=4, batch_size=4, warmup_steps=1, log_every=2, eval_every=4, eval_chars=256)
    first = Trainer(tiny_model(corpus), TrainConfig(**cfg), corpus, "cpu", **QUIET)
    first.fit(stop_step=2)
    state = first.state_dict()
    state["sampler"] = {"generator": torch.zeros(16, dtype=torch.uint8), "batches": 2, "device": "cuda"}
    resumed = Trainer(tiny_model(corpus), TrainConfig(**cfg), corpus, "cpu", **QUIET)
    with pytest.warns(UserWarning, match="drawn on cuda; on cpu they continue from a new seed"):
        resumed.load_state_dict(state)
    resumed.fit()
    assert resumed.step == 4 and resumed.sampler.batches == 4


def test_eval_windows_cover_each_character_once():
    x, y = eval_windows(torch.arange(101, dtype=torch.int16), context=10, max_chars=55)
    assert x.shape == (5, 10) and torch.equal(y.flatten(), torch.arange(1, 51))


# ------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("sparse", [True, False])
def test_param_count_formula_matches_built_model(corpus, sparse):
    from char_lm import CharTransformer

    cfg = tiny_model(corpus, sparse=sparse, d_model=48, n_heads=4)
    model = CharTransformer(cfg, generator=torch.Generator().manual_seed(0))
    assert model.n_params() == cfg.n_params() and model.block_weights() == cfg.block_weights()


@pytest.mark.parametrize("sparse", [True, False])
def test_dropout_acts_in_training_only(corpus, sparse):
    from char_lm import CharTransformer

    idx = torch.randint(0, corpus.vocab.size, (2, 32), generator=torch.Generator().manual_seed(1))
    model = CharTransformer(tiny_model(corpus, sparse=sparse, dropout=0.3), generator=torch.Generator().manual_seed(0))
    plain = CharTransformer(tiny_model(corpus, sparse=sparse), generator=torch.Generator().manual_seed(0))
    plain.load_state_dict(model.state_dict())  # dropout adds no parameters or buffers
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    torch.testing.assert_close(model(idx), plain(idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        tiny_model(corpus, dropout=1.0)


def test_dense_equivalent_matches_nonzero_count(corpus):
    sparse = ModelConfig(vocab_size=corpus.vocab.size, d_model=256, density=0.25)
    dense = sparse.dense_equivalent()
    assert not dense.sparse and dense.d_model < sparse.d_model and dense.n_layers == sparse.n_layers
    assert abs(dense.n_params() - sparse.n_params()) / sparse.n_params() < 0.03


# ------------------------------------------------------------------------------------------------- training
def test_loss_falls_in_a_few_cpu_steps(corpus):
    cfg = TrainConfig(steps=60, batch_size=16, lr=3e-3, warmup_steps=5, log_every=10, eval_every=1000,
                      eval_chars=1024)
    summary = Trainer(tiny_model(corpus), cfg, corpus, "cpu", **QUIET).fit()
    train = [bpc for _, _, bpc in summary["history"]["train"]]
    assert summary["steps"] == 60 and len(train) == 6
    assert train[-1] < train[0] - 1.0, train  # from ~log2(vocab) = 6.2 bits towards the unigram entropy
    assert summary["val_bpc"] < 5.5 and summary["edges"] > 0 and summary["median_step_ms"] > 0
    assert summary["fwd_ms"] > 0 and summary["bwd_ms"] > 0 and summary["timed_steps"] >= 1


def _snapshot(trainer: Trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(("evolve", "dropout"), [({}, 0.0), (dict(prune_every=2, grow_to=0.4, regrow="set"), 0.0),
                                                 (dict(prune_every=3, drop_fraction=0.5, regrow="rigl"), 0.0),
                                                 ({}, 0.2), (dict(dtype="float16"), 0.0),
                                                 (dict(prune_every=2, prune_to=0.05, prune_stop=0.75), 0.0)],
                         ids=["fixed", "set-growing", "rigl", "dropout", "float16", "gradual-pruning"])
def test_resume_continues_bitwise(corpus, tmp_path, evolve, dropout):
    needs_autocast(evolve.get("dtype", "float32"))
    cfg = dict(steps=8, batch_size=4, warmup_steps=3, log_every=2, eval_every=4, eval_chars=256, **evolve)
    # atomic_free: fused_atomic adds grad_w from several threads, in an order that varies between runs on a CPU
    # with many cores, so only the atomic-free backward can promise bitwise equal runs.
    model = tiny_model(corpus, dropout=dropout, backward="atomic_free")
    whole = Trainer(model, TrainConfig(**cfg), corpus, "cpu", **QUIET)
    whole.fit()

    first = Trainer(model, TrainConfig(**cfg), corpus, "cpu", out_dir=tmp_path, **QUIET)
    first.fit(stop_step=3)  # interrupted between two metric reads: the accumulator is mid-window
    assert first.step == 3 and (tmp_path / "checkpoint.pt").is_file()
    resumed = Trainer.resume(tmp_path, corpus, "cpu", **QUIET)
    resumed.fit()

    assert resumed.step == whole.step == 8
    a, b = _snapshot(whole), _snapshot(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("train", "val"):
        assert [row[1:] for row in whole.history[key]] == [row[1:] for row in resumed.history[key]]
    opt_a, opt_b = whole.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    assert whole.sampler.batches == resumed.sampler.batches == 8
    assert whole.scaler.state_dict() == resumed.scaler.state_dict()  # float16's loss scale and growth tracker
    if "prune_every" in evolve:  # the topology really changed before and after the interruption
        assert whole.summary()["edges_history"] == resumed.summary()["edges_history"]
        assert len(whole.summary()["edges_history"]) > 2
    if "prune_to" in evolve:  # pruned on the cubic schedule to its final count by prune_stop * steps = step 6
        edges = whole.summary()["edges_history"]
        assert [row[0] for row in edges] == [0, 2, 4, 6] and all(a[1] > b[1] for a, b in zip(edges, edges[1:]))
        assert edges[-1][1] == sum(round(0.05 * i * o) for i, o in model.block_shapes()) * model.n_layers


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_trains_float32_master_weights(corpus, dtype):
    needs_autocast(dtype)
    cfg = TrainConfig(steps=40, batch_size=16, lr=3e-3, warmup_steps=5, log_every=10, eval_every=1000,
                      eval_chars=1024, dtype=dtype)
    trainer = Trainer(tiny_model(corpus), cfg, corpus, "cpu", **QUIET)
    with trainer.autocast():  # the forward really runs in the 16-bit dtype
        assert trainer.model(trainer.sampler.sample()[0]).dtype == getattr(torch, dtype)
    summary = trainer.fit()
    train = [bpc for _, _, bpc in summary["history"]["train"]]
    assert all(map(math.isfinite, train)) and math.isfinite(summary["val_bpc"])
    assert train[-1] < train[0] - 0.5, train
    assert summary["dtype"] == summary["train"]["dtype"] == dtype
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    states = trainer.optimizer.state_dict()["state"].values()
    assert all(t.dtype == torch.float32 for st in states for k, t in st.items() if k != "step")
    assert trainer.scaler.is_enabled() == (dtype == "float16")


def test_float16_checkpoint_carries_the_loss_scale(corpus, tmp_path):
    needs_autocast("float16")
    cfg = TrainConfig(steps=6, batch_size=4, log_every=2, eval_every=100, eval_chars=256, dtype="float16")
    trainer = Trainer(tiny_model(corpus), cfg, corpus, "cpu", out_dir=tmp_path, **QUIET)
    trainer.fit(stop_step=3)
    trainer.scaler.update(1024.0)  # a scale no fresh scaler starts from
    trainer.save()
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["scaler"]
    assert saved["scale"] == 1024.0 and saved["_growth_tracker"] == 3
    resumed = Trainer.resume(tmp_path, corpus, "cpu", **QUIET)
    assert resumed.scaler.state_dict() == saved and resumed.scaler.get_scale() == 1024.0
    assert resumed.fit()["steps"] == 6


def test_resume_rejects_another_vocabulary(corpus, tmp_path):
    trainer = Trainer(tiny_model(corpus), TrainConfig(steps=1, batch_size=2), corpus, "cpu", **QUIET)
    trainer.save(tmp_path / "ck.pt")
    other = CharCorpus.from_splits("xyz " * 100, "xyz", "xyz", "other")
    with pytest.raises(ValueError, match="vocabulary"):
        Trainer.resume(tmp_path / "ck.pt", other, "cpu", **QUIET)


# ------------------------------------------------------------------------------------------------- no host reads
HOST_READS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("evolve", [{}, dict(prune_every=50, grow_to=0.5)], ids=["fixed", "evolving"])
@pytest.mark.parametrize("device", DEVICES)
def test_steady_state_step_reads_nothing_on_the_host(corpus, device, monkeypatch, evolve, dtype):
    needs_autocast(dtype, device)
    trainer = Trainer(tiny_model(corpus), TrainConfig(steps=100, batch_size=4, dtype=dtype, **evolve), corpus, device,
                      **QUIET)
    for _ in range(2):  # warm-up: optimizer state, allocator, lazy initialisation
        trainer.train_step(0.0)
    counts: dict[str, int] = {}

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    for k in range(5):
        trainer.train_step(0.1 + 0.01 * k)
    monkeypatch.undo()
    assert counts == {}, f"host reads in the steady-state step: {counts}"
    assert trainer.train_loss.count == 7 and trainer.train_loss.read() > 0  # the one read, outside the steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_steady_state_step_never_synchronises_cuda(corpus, dtype):
    needs_autocast(dtype, "cuda")
    trainer = Trainer(tiny_model(corpus), TrainConfig(steps=100, batch_size=4, dtype=dtype), corpus, "cuda", **QUIET)
    for _ in range(2):
        trainer.train_step(0.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            trainer.train_step(0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.train_loss.read() > 0


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_help_runs_as_a_script():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_wikitext103.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for option in ("--backward", "--density", "--minutes", "--steps", "--dense", "--resume", "--data", "--out",
                   "--eval-every", "--log-every", "--device", "--seed", "--dtype"):
        assert option in out.stdout


def test_cli_trains_writes_outputs_and_resumes(tmp_path, capsys):
    common = ["--device", "cpu", "--offline", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32",
              "--batch-size", "4", "--eval-chars", "512", "--log-every", "2", "--no-progress", "--out", str(tmp_path)]
    assert main(["--steps", "4", "--density", "0.3", *common]) == 0
    log = json.loads((tmp_path / "log.json").read_text())
    for key in ("steps", "train_bpc", "val_bpc", "best_val_bpc", "median_step_ms", "fwd_ms", "bwd_ms", "edges"):
        assert log[key] is not None, key
    assert log["steps"] == 4 and log["model"]["density"] == 0.3 and log["corpus"]["source"].startswith("fallback")
    assert (tmp_path / "bpc.png").stat().st_size > 1000
    assert "| Steps completed | 4 |" in capsys.readouterr().out

    assert main(["--resume", str(tmp_path), "--steps", "6", *common]) == 0
    assert json.loads((tmp_path / "log.json").read_text())["steps"] == 6


def test_plot_has_an_edge_panel_for_evolving_runs_old_and_new_logs(tmp_path):
    history = {"train": [[1.0, 10, 3.0], [2.0, 20, 2.5]], "val": [[2.0, 20, 2.6]]}
    runs = {"rigl": {"history": history, "edges_history": [[0, 100, 0], [10, 100, 30]]},
            "older log": {"history": history, "edges_history": [[0, 100], [10, 120]]},
            "dense": {"history": history, "edges_history": []}}
    plot_bpc(tmp_path / "two_panels.png", runs)
    plot_bpc(tmp_path / "one_panel.png", {"dense": runs["dense"]})
    wide, narrow = (Image.open(tmp_path / f"{n}.png").size for n in ("two_panels", "one_panel"))
    assert wide[0] > 1.5 * narrow[0] and wide[1] == narrow[1]


def test_cli_dense_matches_sparse_nonzero_count(tmp_path):
    common = ["--steps", "1", "--device", "cpu", "--offline", "--d-model", "64", "--layers", "1", "--heads", "2",
              "--context", "16", "--batch-size", "2", "--eval-chars", "64", "--no-progress"]
    main([*common, "--out", str(tmp_path / "s")])
    main([*common, "--dense", "--out", str(tmp_path / "d")])
    s, d = (json.loads((tmp_path / n / "log.json").read_text()) for n in ("s", "d"))
    assert s["model"]["sparse"] and not d["model"]["sparse"] and d["model"]["d_model"] < 64
    assert abs(s["params"] - d["params"]) / s["params"] < 0.05


def _tiny(tmp_path) -> list[str]:
    return ["--device", "cpu", "--offline", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32",
            "--batch-size", "4", "--eval-chars", "512", "--log-every", "2", "--no-progress", "--out", str(tmp_path)]


def test_cli_resume_takes_data_from_the_checkpoint_and_reports_overrides(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    run = tmp_path / "run"
    assert main(["--steps", "4", "--data", str(text), *_tiny(run)]) == 0
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "6", "--density", "0.9", "--lr", "0.5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"--resume: using --data {text.resolve()} from the checkpoint" in out
    assert "ignoring --density 0.9: the checkpoint's run has 0.25" in out
    assert "ignoring --lr 0.5: the checkpoint's run has 0.002" in out
    log = json.loads((run / "log.json").read_text())
    assert log["steps"] == 6 and str(text.resolve()) in log["corpus"]["source"]


def test_cli_mixed_precision_run_and_resume_keep_the_checkpoint_dtype(tmp_path, capsys):
    needs_autocast("bfloat16")
    assert main(["--steps", "4", "--dtype", "bfloat16", *_tiny(tmp_path)]) == 0
    assert "| Precision | bfloat16 |" in capsys.readouterr().out
    assert main(["--resume", str(tmp_path), "--steps", "6", "--dtype", "float32", "--offline", "--no-progress"]) == 0
    assert "ignoring --dtype float32: the checkpoint's run has bfloat16" in capsys.readouterr().out
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["steps"] == 6 and log["dtype"] == log["train"]["dtype"] == "bfloat16"
    assert all(math.isfinite(bpc) for _, _, bpc in log["history"]["train"])


def test_cli_names_the_dtypes_the_device_can_autocast_to(monkeypatch, capsys):
    # torch.autocast only warns and runs float32 for an unsupported pair: the CLI refuses it before any work.
    monkeypatch.setattr("char_lm.cli.autocast_dtypes", lambda device: ("float32", "bfloat16"))
    with pytest.raises(SystemExit) as exc:
        main(["--dtype", "float16", "--device", "cpu", "--offline"])
    assert exc.value.code == 2
    assert "--dtype float16, which torch" in (err := capsys.readouterr().err)
    assert "cannot autocast to on cpu; supported there: --dtype float32 or bfloat16" in err


def test_cli_resume_of_a_finished_run_says_how_to_extend_it(tmp_path, capsys):
    assert main(["--steps", "4", *_tiny(tmp_path)]) == 0
    before = (tmp_path / "checkpoint.pt").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["--resume", str(tmp_path), "--offline", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "is finished (step 4, budget 4 steps); to train on, give a larger budget: --steps N (N > 4)" in out
    assert (tmp_path / "checkpoint.pt").stat().st_mtime_ns == before  # nothing trained, nothing rewritten


@pytest.mark.parametrize("kind", ["empty-dir", "corrupt", "foreign"])
def test_cli_bad_resume_is_a_usage_error(tmp_path, kind, capsys):
    target = tmp_path / "ckpt.pt"
    if kind == "empty-dir":
        target = tmp_path
    elif kind == "corrupt":
        target.write_bytes(b"not a checkpoint at all")
    else:
        torch.save({"format": 99}, target)
    with pytest.raises(SystemExit) as exc:
        main(["--resume", str(target), "--offline", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    expected = "no checkpoint there" if kind == "empty-dir" else "is not a training checkpoint of this program"
    assert expected in err


def test_cli_unusable_data_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "wiki.train.raw").write_text(WIKI_TRAIN)  # a WikiText folder without its other splits
    with pytest.raises(SystemExit) as exc:
        main(["--steps", "2", "--data", str(tmp_path), *_tiny(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--data {tmp_path}" in err and "wiki.valid.raw" in err


def test_cli_diverged_run_stops_with_a_message(tmp_path, capsys):
    assert main(["--steps", "8", "--lr", "1e6", "--eval-every", "4", *_tiny(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "training diverged" in err and "lower --lr (now 1e+06)" in err
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "bpc.png").exists()


def test_divergence_keeps_the_last_good_checkpoint(corpus, tmp_path):
    trainer = Trainer(tiny_model(corpus), TrainConfig(steps=8, batch_size=4, eval_every=4, log_every=2), corpus,
                      "cpu", out_dir=tmp_path, **QUIET)
    trainer.fit(stop_step=4)
    good = (tmp_path / "checkpoint.pt").read_bytes()
    with torch.no_grad():
        trainer.params[0].fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="the checkpoint of step 4 in .* is kept unchanged"):
        trainer.fit()
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


@pytest.mark.parametrize("decoupled", [False, True])
def test_cli_resume_times_the_first_window_by_its_own_steps(tmp_path, monkeypatch, decoupled):
    """Each step takes exactly 5 ms of a fake clock, so every recorded window is 5 ms per step; the first window
    after --resume counts the steps since the resume, not the checkpoint's step count."""
    from char_lm import DecoupledTrainer

    now = [1000.0]
    monkeypatch.setattr("char_lm.metrics.time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    kind, name = (DecoupledTrainer, "_forward") if decoupled else (Trainer, "train_step")
    step = getattr(kind, name)

    def five_ms_step(self, *args, **kwargs):
        now[0] += 0.005
        return step(self, *args, **kwargs)

    monkeypatch.setattr(kind, name, five_ms_step)
    mode = ["--decoupled", "1:2"] if decoupled else []
    assert main(["--steps", "6", *mode, *_tiny(tmp_path)]) == 0  # windows of 2 steps (--log-every 2)
    assert main(["--resume", str(tmp_path), "--steps", "10", *mode, "--offline", "--no-progress"]) == 0
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 10
    assert state["window_ms"] == pytest.approx([5.0] * 5)
    assert json.loads((tmp_path / "log.json").read_text())["median_step_ms"] == pytest.approx(5.0)
