"""Character-level corpora: loading WikiText-103 (or a stand-in), the vocabulary, and device-side batching.

Where the text comes from, in order (:func:`load_corpus`):

1. ``data=PATH``: a directory holding ``wiki.train.raw``, ``wiki.valid.raw`` and ``wiki.test.raw`` (WikiText's
   raw layout), or one text file split 90/5/5 in order. A file that starts with the gzip magic bytes (``.gz``,
   or dictd's ``.dz``) is decompressed while it is read.
2. ``data=None``: WikiText-103 raw through Hugging Face ``datasets`` (imported lazily; it is optional).
3. When ``datasets`` is missing or the hub cannot be reached: a clear message, then the small corpus of
   original prose shipped in ``examples/char_lm/data/``, so the example always runs offline.

The text is used as written (WikiText's raw files keep their `` = Heading = `` lines and `` @-@ `` tokens,
the usual convention for character-level results on it). The vocabulary is the set of characters of the
training split; id 0 stands for every character that the training split lacks.

Example:
    >>> corpus = load_corpus(None, allow_download=False, log=lambda msg: None)  # the bundled corpus
    >>> sampler = WindowSampler(corpus.train, context=64, batch_size=8, seed=0)
    >>> x, y = sampler.sample()  # both [8, 64] int64, on the corpus' device
    >>> x.shape, x.dtype
    (torch.Size([8, 64]), torch.int64)
"""

from __future__ import annotations

import gzip
import math
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "CharCorpus",
    "CharVocab",
    "WindowSampler",
    "check_eval_fits",
    "eval_windows",
    "fallback_text",
    "load_corpus",
    "load_hf_wikitext",
    "read_text",
    "read_wikitext_dir",
    "split_text",
]

WIKITEXT_FILES = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")
FALLBACK_NAME = "fallback_corpus.txt"
_GZIP_MAGIC = b"\x1f\x8b"
_UNICODE_SIZE = 0x110000


def _code_points(text: str) -> np.ndarray:
    """The text as an array of Unicode code points (uint32), without a Python loop."""
    return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)


@dataclass(frozen=True)
class CharVocab:
    """Characters of the training split; id 0 is the unknown character, ids 1.. the sorted characters.

    Example:
        >>> vocab = CharVocab.from_text("abca")
        >>> vocab.size, vocab.encode("abz").tolist(), vocab.decode([1, 2, 0])
        (4, [1, 2, 0], 'ab\ufffd')
    """

    chars: tuple[str, ...]
    UNK: str = "\ufffd"

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        counts = np.bincount(_code_points(text), minlength=_UNICODE_SIZE)
        return cls(tuple(chr(c) for c in np.flatnonzero(counts)))

    @property
    def size(self) -> int:
        """Number of ids, the unknown id included."""
        return len(self.chars) + 1

    @property
    def dtype(self) -> torch.dtype:
        """The narrowest integer dtype that holds every id (token tensors are stored in it)."""
        return torch.int16 if self.size <= 2**15 else torch.int32

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text`` as a CPU tensor of :attr:`dtype`; unknown characters become 0."""
        lut = np.zeros(_UNICODE_SIZE, dtype=np.int32)
        lut[[ord(c) for c in self.chars]] = np.arange(1, self.size, dtype=np.int32)
        return torch.from_numpy(lut[_code_points(text)]).to(self.dtype)

    def decode(self, ids) -> str:
        """Text of a sequence of ids (unknown ids become U+FFFD)."""
        table = (self.UNK, *self.chars)
        return "".join(table[int(i)] for i in ids)


@dataclass(frozen=True)
class CharCorpus:
    """Encoded train/valid/test splits, their vocabulary and where the text came from."""

    vocab: CharVocab
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    source: str

    @classmethod
    def from_splits(cls, train: str, valid: str, test: str, source: str) -> CharCorpus:
        """Build the vocabulary from ``train`` and encode all three splits.

        Example:
            >>> c = CharCorpus.from_splits("hello world", "hello", "wordy", "inline")
            >>> c.vocab.size, c.test.tolist()
            (9, [8, 6, 7, 2, 0])
        """
        if not train:
            raise ValueError(f"the training split of {source} is empty")
        vocab = CharVocab.from_text(train)
        return cls(vocab, vocab.encode(train), vocab.encode(valid), vocab.encode(test), source)

    def to(self, device: torch.device | str) -> CharCorpus:
        """The same corpus with its token tensors on ``device`` (copied once, kept there for batching)."""
        train, valid, test = (t.to(device) for t in (self.train, self.valid, self.test))
        return CharCorpus(self.vocab, train, valid, test, self.source)

    def describe(self) -> dict:
        """Sizes and source, for logs."""
        return {"source": self.source, "vocab_size": self.vocab.size, "train_chars": self.train.numel(),
                "valid_chars": self.valid.numel(), "test_chars": self.test.numel()}


# ------------------------------------------------------------------------------------------------- reading
def read_text(path: str | os.PathLike) -> str:
    """A file's text as UTF-8 (bad bytes replaced); gzip-compressed files (``.gz``, dictd ``.dz``) are
    recognised by their magic bytes, not their name."""
    path = Path(path)
    with open(path, "rb") as f:
        compressed = f.read(2) == _GZIP_MAGIC
    opener = gzip.open if compressed else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def split_text(text: str, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)) -> tuple[str, str, str]:
    """Split one text in order into train/valid/test by the given fractions (cut at character positions).

    Example:
        >>> split_text("abcdefghijklmnopqrst")
        ('abcdefghijklmnopqr', 's', 't')
    """
    if not math.isclose(sum(fractions), 1.0) or min(fractions) < 0:
        raise ValueError(f"fractions must be non-negative and sum to 1, got {fractions}")
    n = len(text)
    a = int(n * fractions[0])
    b = a + int(n * fractions[1])
    return text[:a], text[a:b], text[b:]


def read_wikitext_dir(path: str | os.PathLike) -> tuple[str, str, str]:
    """The three splits of a WikiText raw directory (``wiki.{train,valid,test}.raw``)."""
    path = Path(path)
    missing = [name for name in WIKITEXT_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a WikiText raw directory: missing {', '.join(missing)}")
    train, valid, test = (read_text(path / name) for name in WIKITEXT_FILES)
    return train, valid, test


def load_hf_wikitext(name: str = "wikitext-103-raw-v1") -> tuple[str, str, str]:
    """WikiText raw splits through Hugging Face ``datasets`` (raises ImportError without it, or the hub's
    error when it cannot be reached). Each row of the dataset is one line of the raw file, newline included,
    so joining the rows gives the raw files back."""
    from datasets import load_dataset  # optional dependency, imported only here

    ds = load_dataset("Salesforce/wikitext", name)
    return tuple("".join(ds[split]["text"]) for split in ("train", "validation", "test"))  # type: ignore[return-value]


def fallback_text() -> str:
    """The small corpus of original English prose shipped with the package (written for this project)."""
    return resources.files("char_lm").joinpath("data", FALLBACK_NAME).read_text(encoding="utf-8")


def load_corpus(data: str | os.PathLike | None = None, *, allow_download: bool = True, log=None) -> CharCorpus:
    """Load and encode a corpus: ``data`` if given, else WikiText-103 through ``datasets``, else the fallback.

    ``log`` receives one line saying what was loaded (default: print to stderr).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if data is not None:
        path = Path(data)
        if path.is_dir():
            corpus = CharCorpus.from_splits(*read_wikitext_dir(path), source=f"wikitext-dir:{path}")
        elif path.is_file():
            corpus = CharCorpus.from_splits(*split_text(read_text(path)), source=f"file:{path} (90/5/5)")
        elif path.exists():
            raise OSError(f"--data {path}: neither a text file nor a WikiText folder")
        else:
            raise FileNotFoundError(f"--data {path}: no such file or directory")
    else:
        corpus = None
        if allow_download:
            try:
                corpus = CharCorpus.from_splits(*load_hf_wikitext(), source="hf:Salesforce/wikitext-103-raw-v1")
            except ImportError:
                log("WikiText-103 unavailable: the optional package 'datasets' is not installed "
                    "(pip install datasets), and no --data PATH was given.")
            except (OSError, ValueError, RuntimeError) as exc:  # no hub (ConnectionError is an OSError), no cache
                log(f"WikiText-103 unavailable: loading it through 'datasets' failed ({type(exc).__name__}: {exc}).")
        if corpus is None:
            log(f"Falling back to the small offline corpus shipped with the package ({FALLBACK_NAME}); "
                "results on it are a smoke test, not WikiText-103 numbers. Pass --data PATH for real text.")
            corpus = CharCorpus.from_splits(*split_text(fallback_text()), source=f"fallback:{FALLBACK_NAME}")
    log(f"corpus {corpus.source}: {corpus.train.numel():,} train / {corpus.valid.numel():,} valid / "
        f"{corpus.test.numel():,} test characters, vocabulary {corpus.vocab.size}")
    return corpus


# ------------------------------------------------------------------------------------------------- batching
class WindowSampler:
    """Random training windows drawn on the device: offsets come from a generator on the tokens' device and
    index a device-resident token tensor, so drawing a batch never waits on the host or copies from it.

    The sampler's position (its generator state and the number of batches drawn) is part of
    :meth:`state_dict`, so a resumed run draws the same batches as an uninterrupted one on the same device type.
    A generator's state does not carry across device types (CPU, CUDA and MPS generators differ), so a run
    resumed on another device type continues from a seed derived from ``seed`` and the batches drawn: other
    windows than the uninterrupted run would draw, from the same distribution, and the same on every such resume.

    Example:
        >>> tokens = torch.arange(100, dtype=torch.int16)
        >>> x, y = WindowSampler(tokens, context=8, batch_size=4, seed=0).sample()
        >>> x.shape, bool((y - x == 1).all())
        (torch.Size([4, 8]), True)
    """

    def __init__(self, tokens: torch.Tensor, context: int, batch_size: int, *, seed: int) -> None:
        if tokens.numel() < context + 2:
            raise ValueError(f"the training split has {tokens.numel()} tokens, fewer than context + 2 = {context + 2}")
        self.tokens = tokens
        self.context = context
        self.batch_size = batch_size
        self.generator = torch.Generator(device=tokens.device)
        self.generator.manual_seed(seed)
        self.seed = seed
        self.batches = 0
        self._span = torch.arange(context + 1, device=tokens.device)
        self._high = tokens.numel() - context  # exclusive upper bound of a window's start

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, both ``[batch_size, context]`` int64; targets are inputs shifted by one."""
        start = torch.randint(0, self._high, (self.batch_size, 1), generator=self.generator,
                              device=self.tokens.device)
        window = self.tokens[start + self._span].long()
        self.batches += 1
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches": self.batches,
                "device": self.generator.device.type}

    def load_state_dict(self, state: dict) -> bool:
        """Restore the position; False when ``state`` was drawn on another device type and the stream was
        re-seeded instead (see the class notes). Checkpoints older than the ``device`` entry are told apart by
        their state's size."""
        saved, kind = state["generator"], state.get("device")
        if kind is None and isinstance(saved, torch.Tensor) and saved.numel() != self.generator.get_state().numel():
            kind = "another"
        if kind not in (None, self.generator.device.type):
            self.generator.manual_seed((self.seed + 1_000_003 * (state["batches"] + 1)) % 2**63)
            self.batches = state["batches"]
            return False
        self.generator.set_state(saved)
        self.batches = state["batches"]
        return True


def check_eval_fits(corpus: CharCorpus, context: int, eval_chars: int | None) -> None:
    """Raise ValueError unless an evaluation on ``corpus.valid`` holds at least one window of ``context``
    (checked when a trainer is built, not at its first evaluation).

    Example:
        >>> check_eval_fits(CharCorpus.from_splits("abc" * 30, "abc" * 3, "", "inline"), 16, None)
        Traceback (most recent call last):
        ...
        ValueError: the validation split of inline has 9 characters; one evaluation window of context 16 needs 17
    """
    if corpus.valid.numel() < context + 1:
        raise ValueError(f"the validation split of {corpus.source} has {corpus.valid.numel():,} characters; one "
                         f"evaluation window of context {context} needs {context + 1}")
    if eval_chars is not None and eval_chars < context:
        raise ValueError(f"eval_chars {eval_chars} is smaller than context {context}: an evaluation needs at "
                         "least one window")


def eval_windows(tokens: torch.Tensor, context: int, max_chars: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive non-overlapping windows covering the first ``max_chars`` predicted characters of a split.

    Returns ``(inputs, targets)`` ``[n_windows, context]`` int64 on the tokens' device. Every predicted
    character is counted once; a window's first characters see a short context, the same for every model.

    Example:
        >>> x, y = eval_windows(torch.arange(20, dtype=torch.int16), context=4)
        >>> x.shape, y[0].tolist()
        (torch.Size([4, 4]), [1, 2, 3, 4])
    """
    usable = tokens.numel() - 1
    if max_chars is not None:
        usable = min(usable, max_chars)
    n = usable // context
    if n == 0:
        raise ValueError(f"{tokens.numel()} tokens (max_chars {max_chars}) are too few for one window of context "
                         f"{context}: it needs context + 1 tokens and max_chars >= context")
    x = tokens[: n * context].view(n, context).long()
    y = tokens[1 : n * context + 1].view(n, context).long()
    return x, y
