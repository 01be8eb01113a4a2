"""Training utilities for the character-level WikiText-103 example (``examples/train_wikitext103.py``).

- :mod:`.data`: corpora (WikiText-103, local files, the bundled offline corpus), vocabulary, device batching.
- :mod:`.model`: the character-level Transformer with sparse block matrices.
- :mod:`.loop`: the sync-free training step, evaluation, checkpoint/resume.
- :mod:`.decoupled`: decoupled forward/backward workers with layer-wise updates (PD-ASGD, ``--decoupled F:B``).
- :mod:`.metrics`: device-side accumulators, step clocks, bits per character.
- :mod:`.report`: the JSON log, the BPC plot and the results table.

Example:
    >>> from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer
    >>> corpus = CharCorpus.from_splits("the cat sat " * 100, "the cat " * 10, "sat " * 10, "inline")
    >>> cfg = ModelConfig(vocab_size=corpus.vocab.size, context=16, d_model=32, n_layers=1, n_heads=2)
    >>> Trainer(cfg, TrainConfig(steps=2, batch_size=2), corpus, "cpu", progress=False, verbose=False).fit()["steps"]
    2
"""

from importlib.util import find_spec

_MISSING = [name for name in ("tqdm", "matplotlib") if find_spec(name) is None]
if _MISSING:
    raise ImportError(f"char_lm (the training example) needs {' and '.join(_MISSING)}: "
                      "pip install 'torch_sparse_metal[train]'")

from .data import CharCorpus, CharVocab, WindowSampler, load_corpus  # noqa: E402
from .decoupled import DecoupledConfig, DecoupledTrainer  # noqa: E402
from .loop import TrainConfig, Trainer, evaluate_bpc, pick_device  # noqa: E402
from .metrics import DeviceMean, nats_to_bpc  # noqa: E402
from .model import CharTransformer, ModelConfig  # noqa: E402

__all__ = [
    "CharCorpus",
    "CharTransformer",
    "CharVocab",
    "DecoupledConfig",
    "DecoupledTrainer",
    "DeviceMean",
    "ModelConfig",
    "TrainConfig",
    "Trainer",
    "WindowSampler",
    "evaluate_bpc",
    "load_corpus",
    "nats_to_bpc",
    "pick_device",
]
