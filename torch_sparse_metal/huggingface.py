"""Hugging Face model utilities that need to know a sparse output layer.

``PreTrainedModel.resize_token_embeddings`` resizes the input embeddings first and then reads the output layer's
weight as an ``[out, in]`` matrix, which a ``SparseLinear`` does not have: it would fail half-way, with the input
embeddings already resized. :func:`resize_token_embeddings` resizes a sparse output layer itself, before anything
else changes, and lets Hugging Face resize the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from ._modules import registered_names, set_submodule
from .nn import SparseLinear
from .topology import CSRTopology, check_block

__all__ = ["resize_token_embeddings"]


def resize_token_embeddings(model: nn.Module, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True, *, generator: torch.Generator | None = None) -> nn.Module:
    """``model.resize_token_embeddings(...)`` (same arguments, same return value) for a Hugging Face model whose
    output layer (``get_output_embeddings()``) may be a ``SparseLinear``; any other model is passed through.

    The sparse output layer keeps the connections and values of the tokens that remain; each new token's output
    gets connections drawn uniformly at the layer's density (whole vectors for a vector layer, whose ``block`` must
    divide the new vocabulary size) and values and bias drawn as :meth:`SparseLinear.reset_parameters` draws them
    (``mean_resizing`` applies to the input embeddings only). The new layer is built and checked before the model
    changes; build the optimizer afterwards, as for a dense resize.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from torch_sparse_metal import sparsify
        >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        >>> model = sparsify(LlamaForCausalLM(config), density=0.25, filter=lambda name, m: name == "lm_head")
        >>> resize_token_embeddings(model, 80).weight.shape, model.lm_head.out_features
        (torch.Size([80, 32]), 80)
    """
    head = model.get_output_embeddings()
    if not isinstance(head, SparseLinear) or (new_num_tokens is None and pad_to_multiple_of is None):
        return model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
    tokens = head.out_features if new_num_tokens is None else new_num_tokens
    if pad_to_multiple_of is not None:  # as Hugging Face pads
        tokens = (tokens + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
    new_head = _resized(head, tokens, generator)
    names = registered_names(model, head)
    for name in names:  # an empty slot: Hugging Face then resizes the input embeddings alone
        set_submodule(model, name, None)
    try:
        embeddings = model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
    finally:
        for name in names:
            set_submodule(model, name, head)
    for name in names:
        set_submodule(model, name, new_head)
    return embeddings


def _resized(head: SparseLinear, tokens: int, generator: torch.Generator | None) -> SparseLinear:
    """``head`` with ``tokens`` outputs: the edges into the first ``min(tokens, out_features)`` outputs kept with
    their values, new outputs connected at the layer's density."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"new_num_tokens must be a positive int, got {tokens!r}")
    check_block(head.block, tokens)
    old = head.topology
    keep = (old.dst < tokens).cpu()
    src, dst = [old.src.long().cpu()[keep]], [old.dst.long().cpu()[keep]]
    if tokens > head.out_features:
        grown = CSRTopology.random(head.in_features, tokens - head.out_features, head.density, generator=generator,
                                   block=head.block)
        src.append(grown.src.long())
        dst.append(grown.dst.long() + head.out_features)
    topology, order = CSRTopology.from_indices(torch.stack([torch.cat(dst), torch.cat(src)]), head.in_features,
                                               tokens, block=head.block)
    new = SparseLinear.from_topology(topology, bias=head.bias is not None, backward=head.backward.value,
                                     device=head.weight.device, dtype=head.weight.dtype, generator=generator)
    with torch.no_grad():
        given = torch.empty_like(new.weight)  # the values in the order the edges were given: kept ones first
        given[order.to(given.device)] = new.weight
        given[: int(keep.sum())] = head.weight[keep.to(head.weight.device)]
        new.weight.copy_(given[order.to(given.device)])
        if head.bias is not None:
            shared = min(tokens, head.out_features)
            new.bias[:shared] = head.bias[:shared]
    new.weight.requires_grad_(head.weight.requires_grad)
    if head.bias is not None:
        new.bias.requires_grad_(head.bias.requires_grad)
    return new.train(head.training)
