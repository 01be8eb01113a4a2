"""The training step under CUDA graphs (``Trainer(graphs=True)``, ``--graphs``): replayed steps equal eager steps
bitwise (atomic_free backward, math attention, a float32-exact learning rate), across SET and RigL updates written
in place and across a growing update that captures again; checkpoints of a graphed run resume either way; and
--graphs is refused where the step cannot be captured.

Each test runs on CUDA with real graphs (skipped without a CUDA device) and on the CPU with a stand-in graph whose
replay runs the captured step's Python again on the static inputs: that checks the loop's bookkeeping (which steps
replay, the metric count, the learning-rate tensor and capturable AdamW, re-capture after growth, checkpoints)
everywhere, and only a real graph checks that nothing a replay skips was needed.
"""

import contextlib

import pytest
import torch
from char_lm import loop
from char_lm.cli import main
from char_lm.data import CharCorpus, fallback_text, split_text
from char_lm.graphs import GraphedStep
from char_lm.loop import TrainConfig, Trainer
from char_lm.model import ModelConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_sparse_metal import devices

cuda = pytest.mark.skipif("cuda" not in devices.available(), reason="needs a CUDA device and the CUDA kernels")
DEVICES = [pytest.param("cuda", marks=cuda), "cpu"]


class _StandInGraph:
    def __init__(self, body, inputs):
        self.body, self.inputs = body, inputs

    def replay(self):
        self.body(*self.inputs)


class _CPUGraphedStep(GraphedStep):
    """GraphedStep on the CPU: the 'graph' runs the body again on the static inputs."""

    def _capture(self, x, y):
        self._inputs = (torch.empty_like(x), torch.empty_like(y))
        self._prepare()
        self._graph = _StandInGraph(self._body, self._inputs)
        self.captures += 1


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu":
        monkeypatch.setattr(loop, "graphs_refusal", lambda device, world: None)
        monkeypatch.setattr(loop, "GraphedStep", _CPUGraphedStep)
    return request.param

STEPS = 14
#: A learning rate float32 holds exactly, constant (no warm-up, no decay): the capturable AdamW reads it as float32.
EXACT_LR = dict(lr=2.0**-9, min_lr_ratio=1.0, warmup_steps=0)


def _corpus():
    return CharCorpus.from_splits(*split_text(fallback_text()), source="fallback")


def _trainer(graphs, corpus, device, *, dtype="float32", steps=STEPS, out_dir=None, block=1, **evolve):
    model_cfg = ModelConfig(vocab_size=corpus.vocab.size, context=32, d_model=64, n_layers=2, n_heads=2,
                            density=0.25, block=block, backward="atomic_free")
    cfg = TrainConfig(steps=steps, batch_size=8, log_every=5, eval_every=7, eval_chars=512, dtype=dtype,
                      **EXACT_LR, **evolve)
    return Trainer(model_cfg, cfg, corpus, device, out_dir=out_dir, progress=False, verbose=False, graphs=graphs)


def _state(trainer):
    """Every parameter, buffer (the topologies) and optimizer state tensor, and the loss accumulator, on the host."""
    found = {f"model.{k}": v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()
             if torch.is_tensor(v)}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        found |= {f"opt.{names[id(p)]}.{k}": v.detach().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
    found["train_loss"] = trainer.train_loss.total.detach().cpu().clone()
    return found


def _differences(a, b):
    assert a.keys() == b.keys()
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


@contextlib.contextmanager
def _deterministic():
    """Math attention (the fused attention kernels' backward may sum in any order)."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _run_side_by_side(corpus, device, dtype="float32", block=1, **evolve):
    eager, graphed = (_trainer(graphs, corpus, device, dtype=dtype, block=block, **evolve) for graphs in (False, True))
    assert not _differences(_state(eager), _state(graphed))
    with _deterministic():
        for step in range(STEPS):
            for trainer in (eager, graphed):
                trainer.train_step(trainer.step / STEPS)
            assert _differences(_state(eager), _state(graphed)) == [], f"after step {step + 1}"
    return eager, graphed


@pytest.mark.parametrize("block", [1, 16], ids=["unstructured", "vectors16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("regrow", ["set", "rigl"])
def test_replayed_steps_equal_eager_steps_across_in_place_updates(device, dtype, regrow, block):
    """Also with vector layers (block 16): their topology over vectors is written in place with the rest."""
    if dtype not in loop.autocast_dtypes(torch.device(device)):
        pytest.skip(f"{device} cannot autocast to {dtype} here")
    eager, graphed = _run_side_by_side(_corpus(), device, dtype, block=block, prune_every=4, regrow=regrow)
    # updates after steps 4 and 8 (12 is past prune_stop 0.75)
    assert len(eager.evolve.history) == 3 and graphed.evolve.history == eager.evolve.history
    assert graphed.evolve.updated_in_place
    assert graphed.graphed.captures == 1  # the graph survived every update
    # eager: the warm-up, and for RigL each step before an update (its gradient hooks are Python)
    eager_steps = STEPS - graphed.graphed.replays
    assert graphed.graphed.replays > 0 and eager_steps == 3 + (2 if regrow == "rigl" else 0)
    assert eager.train_loss.read() == graphed.train_loss.read()


def test_a_growing_update_captures_again(device):
    eager, graphed = _run_side_by_side(_corpus(), device, prune_every=4, grow_to=0.4, grow_until=0.5)
    counts = [sum(n) for _, n in graphed.evolve.history]
    assert counts[1] > counts[0]  # the first update grew: new tensors, a new capture after one eager step
    assert graphed.graphed.captures >= 2


def test_a_graphed_checkpoint_resumes_eagerly_and_graphed(device, tmp_path):
    corpus = _corpus()
    with _deterministic():
        whole = _trainer(False, corpus, device, out_dir=tmp_path / "eager", prune_every=4)
        whole.fit()
        first = _trainer(True, corpus, device, out_dir=tmp_path / "graphs", prune_every=4)
        first.fit(stop_step=8)
        saved = torch.load(tmp_path / "graphs" / "checkpoint.pt", map_location="cpu", weights_only=True)
        assert all(type(g["lr"]) is float and g["capturable"] is False for g in saved["optimizer"]["param_groups"])
        for graphs in (False, True):
            resumed = Trainer.resume(tmp_path / "graphs", corpus, device, out_dir=tmp_path / f"resumed-{graphs}",
                                     progress=False, verbose=False, graphs=graphs)
            resumed.fit()
            assert _differences(_state(whole), _state(resumed)) == [], f"resumed with graphs={graphs}"
            assert (resumed.graphed is not None) == graphs
    assert first.summary()["graphs"]["replays"] > 0 and whole.summary()["graphs"] is None


def test_graphs_are_refused_off_cuda(capsys):
    corpus = CharCorpus.from_splits("abcdefgh" * 200, "abcdefgh" * 20, "abcdefgh" * 20, "inline")
    mcfg = ModelConfig(vocab_size=corpus.vocab.size, context=16, d_model=32, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="graphs: CUDA graphs capture CUDA work; this run is on cpu"):
        Trainer(mcfg, TrainConfig(steps=2, batch_size=4), corpus, "cpu", progress=False, graphs=True)
    with pytest.raises(SystemExit) as exit_info:
        main(["--graphs", "--device", "cpu", "--steps", "2", "--offline"])
    assert exit_info.value.code == 2
    assert "--graphs: CUDA graphs capture CUDA work; this run is on cpu" in capsys.readouterr().err


@cuda
def test_graphs_are_refused_with_decoupled(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--graphs", "--decoupled", "--device", "cuda", "--steps", "2", "--offline"])
    assert exit_info.value.code == 2 and "--graphs: not with --decoupled" in capsys.readouterr().err
