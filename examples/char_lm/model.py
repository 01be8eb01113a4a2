"""A character-level Transformer language model whose block matrices are :class:`SparseLinear` layers.

Why this model: a pre-LayerNorm Transformer is the strongest small character model that trains reliably in a
few minutes, and nearly all of its weights and arithmetic sit in four matrices per block (the fused QKV
projection, the attention output projection and the two FFN matrices). Making exactly those sparse is what
turns a fixed budget of nonzero weights into width: at density ``p`` the model can be ``1/sqrt(p)`` times
wider than a dense model with the same number of weights, with a wider residual stream, more attention
dimensions and more FFN units. The token and position embeddings and the output head stay dense: with a
vocabulary of ~100-200 characters they are small, and they are per-character tables that have no useful
sparse structure. ``sparse=False`` builds the same architecture with ``nn.Linear``; use
:meth:`ModelConfig.dense_equivalent` for the dense model with the same number of nonzero weights, the
comparison ``--dense`` runs. Measured (``docs/training.md``, gcide stand-in corpus, H200, 10 minutes each, one
seed): at ``d_model=256``, density 0.25, with the topology evolving by RigL (``--prune-every 1000 --regrow
rigl``), the sparse model ends 0.018 bits per character below its dense twin (1.1605 against 1.1780) with 10%
faster steps; with a fixed topology it ended 0.005 behind (1.1746 against 1.1697), and at ``d_model=512``,
density 1/16, 0.043 behind.

Example:
    >>> cfg = ModelConfig(vocab_size=50, context=32, d_model=64, n_layers=2, n_heads=2, density=0.25)
    >>> model = CharTransformer(cfg, generator=torch.Generator().manual_seed(0))
    >>> idx = torch.randint(0, 50, (3, 32))
    >>> model(idx).shape, model.loss(idx, idx).shape
    (torch.Size([3, 32, 50]), torch.Size([]))
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear
from torch_sparse_metal.distribution import layer_densities
from torch_sparse_metal.topology import check_block

__all__ = ["CharTransformer", "ModelConfig"]

#: The layer-wise distributions of the block matrices ("global" needs trained weights: sparsify).
_DISTRIBUTIONS = ("uniform", "er", "erk")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of :class:`CharTransformer`. ``density`` is the fraction of the block matrices' connections
    kept when ``sparse``, shared among them by ``distribution`` ("uniform", "er" or "erk":
    :mod:`torch_sparse_metal.distribution`; :meth:`layer_density`), and ``block`` (1, or a vector length V:
    ``SparseLinear(block=V)``) is their layout. ``constant_fan_in`` gives every output of a block matrix the same
    in-degree (``SparseLinear(constant_fan_in=True)``, SRigL; with ``block`` V, every group of V outputs the same
    number of vectors)."""

    vocab_size: int
    context: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_mult: int = 4
    density: float = 0.25
    block: int = 1
    sparse: bool = True
    backward: str = "auto"
    dropout: float = 0.0  # on the embeddings, the attention weights and each residual branch, in training only
    distribution: str = "uniform"
    constant_fan_in: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.sparse and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        check_block(self.block)
        if self.distribution not in _DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {_DISTRIBUTIONS}, got {self.distribution!r}")
        if self.sparse and self.d_model % self.block:
            raise ValueError(f"d_model={self.d_model} must be a multiple of block={self.block} (every block matrix's "
                             "outputs come in whole vectors)")

    def layer_density(self, fan_in: int, fan_out: int) -> float:
        """The density of the block matrices of shape ``fan_in -> fan_out``: ``density`` shared among one block's
        matrices by ``distribution`` (every block has the same shapes, so the share holds for the whole model).

        Example:
            >>> cfg = ModelConfig(vocab_size=50, d_model=64, density=0.25, distribution="erk")
            >>> [round(cfg.layer_density(i, o), 3) for i, o in cfg.block_shapes()]
            [0.25, 0.375, 0.234, 0.234]
        """
        shapes = {str(k): (o, i) for k, (i, o) in enumerate(self.block_shapes())}
        found = layer_densities(shapes, self.density, self.distribution, block=self.block)
        return found[str(self.block_shapes().index((fan_in, fan_out)))]

    def _linear_params(self, fan_in: int, fan_out: int) -> int:
        weights = (CSRTopology.random_edge_count(fan_in, fan_out, self.layer_density(fan_in, fan_out),
                                                 block=self.block, constant_fan_in=self.constant_fan_in)
                   if self.sparse else fan_in * fan_out)
        return weights + fan_out  # + bias

    def block_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each block's matrices, the sparse layers: attention's qkv and output, the two feed-forward."""
        d, f = self.d_model, self.ffn_mult * self.d_model
        return [(d, 3 * d), (d, d), (d, f), (f, d)]

    def block_weights(self) -> int:
        """Nonzero weights of the block matrices (the edges when sparse), biases excluded."""
        return self.n_layers * sum(self._linear_params(i, o) - o for i, o in self.block_shapes())

    def n_params(self) -> int:
        """Trainable parameters, counting a sparse matrix by its nonzero weights (what ``--dense`` matches)."""
        d, f, v = self.d_model, self.ffn_mult * self.d_model, self.vocab_size
        per_block = (4 * d + self._linear_params(d, 3 * d) + self._linear_params(d, d)
                     + self._linear_params(d, f) + self._linear_params(f, d))
        return v * d + self.context * d + self.n_layers * per_block + 2 * d + d * v + v

    def dense_equivalent(self) -> ModelConfig:
        """The same architecture with dense layers, its width chosen (a multiple of ``n_heads``) so that its
        parameter count is the closest to this model's nonzero count.

        Example:
            >>> ModelConfig(vocab_size=100, d_model=256, density=0.25).dense_equivalent().d_model
            132
        """
        target = self.n_params()
        widths = range(self.n_heads, max(self.d_model, self.n_heads) + 1, self.n_heads)
        dense = replace(self, sparse=False, block=1, constant_fan_in=False)
        best = min(widths, key=lambda d: abs(replace(dense, d_model=d).n_params() - target))
        return replace(dense, d_model=best)

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with (possibly sparse) QKV and output projections."""

    def __init__(self, cfg: ModelConfig, linear) -> None:
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.qkv = linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def _dropout(p: float) -> nn.Module:
    # No module at p = 0, so that the default model runs exactly the kernels it ran before the option existed.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: ``x + drop(attn(ln(x)))``, then ``x + drop(ffn(ln(x)))``, GELU FFN."""

    def __init__(self, cfg: ModelConfig, linear) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, linear)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = linear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.out = linear(cfg.ffn_mult * cfg.d_model, cfg.d_model)
        self.drop = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class CharTransformer(nn.Module):
    """Character-level language model: embeddings, ``n_layers`` blocks, a final LayerNorm and a dense head."""

    def __init__(self, cfg: ModelConfig, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
        self.drop = _dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, self._linear_factory(generator)) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self._init_weights(generator)

    def _linear_factory(self, generator: torch.Generator | None):
        cfg = self.cfg
        if cfg.sparse:
            return lambda i, o: SparseLinear(i, o, density=cfg.layer_density(i, o), block=cfg.block,
                                             backward=cfg.backward, generator=generator,
                                             constant_fan_in=cfg.constant_fan_in)
        return nn.Linear

    @torch.no_grad()
    def _init_weights(self, generator: torch.Generator | None) -> None:
        """Embeddings N(0, 0.02); residual output projections scaled by ``1/sqrt(2 n_layers)`` (GPT-2); the
        rest keep ``nn.Linear``'s fan-in scale (which ``SparseLinear`` applies per output's actual fan-in).
        ``nn.Linear`` draws from the global RNG: seed it (``torch.manual_seed``) before building the model."""
        for table in (self.tok_emb.weight, self.pos_emb):
            table.copy_(torch.randn(table.shape, generator=generator) * 0.02)
        scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        for block in self.blocks:
            block.attn.proj.weight.mul_(scale)
            block.out.weight.mul_(scale)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        """Logits ``[batch, time, vocab]`` for token ids ``[batch, time]`` (time <= context); with ``targets``,
        the loss instead (as :meth:`loss`). The loss is a forward mode so that a ``DistributedDataParallel``
        wrapper, which hooks ``forward`` only, sees the training loss computed through it."""
        x = self.drop(self.tok_emb(idx) + self.pos_emb[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy in nats per character (``reduction`` as ``F.cross_entropy``)."""
        return self(idx, targets, reduction)

    def block_weights(self) -> int:
        """Nonzero weights of the block matrices (edges of the sparse layers), from the built modules."""
        total = 0
        for m in self.blocks.modules():
            if isinstance(m, SparseLinear):
                total += m.nnz
            elif isinstance(m, nn.Linear):
                total += m.weight.numel()
        return total

    def n_params(self) -> int:
        """Trainable parameters of the built model (a sparse matrix counts its stored values)."""
        return sum(p.numel() for p in self.parameters())
