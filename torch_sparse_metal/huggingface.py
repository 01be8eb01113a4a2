"""Hugging Face model utilities that need to know a sparse output layer.

``PreTrainedModel.resize_token_embeddings`` resizes the input embeddings first and then reads the output layer's
weight as an ``[out, in]`` matrix, which a ``SparseLinear`` does not have: it would fail half-way, with the input
embeddings already resized. :func:`resize_token_embeddings` resizes a sparse output layer itself, before anything
else changes, and lets Hugging Face resize the rest.

A model's own ``model.resize_token_embeddings`` is routed to it: wherever a ``SparseLinear`` is registered in a
module that has that method (``model.lm_head = layer``, ``sparsify``, ``load_sparse_checkpoint``), the module gets an
instance attribute of that name calling :func:`resize_token_embeddings` (as accelerate's ``add_hook_to_module``
puts a wrapper of ``forward`` on the instance). It behaves as the class's method while the output layer is dense.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ._modules import registered_names, set_submodule
from .nn import SparseLinear
from .topology import CSRTopology, check_block

__all__ = ["configured_ties", "resize_token_embeddings", "route_resize_token_embeddings"]


def resize_token_embeddings(model: nn.Module, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True, *, generator: torch.Generator | None = None) -> nn.Module:
    """``model.resize_token_embeddings(...)`` (same arguments, same return value) for a Hugging Face model whose
    output layer (``get_output_embeddings()``) may be a ``SparseLinear``; any other model is passed through.

    The sparse output layer keeps the connections and values of the tokens that remain; each new token's output
    gets connections drawn uniformly at the layer's density (whole vectors for a vector layer, whose ``block`` must
    divide the new vocabulary size) and values and bias drawn as :meth:`SparseLinear.reset_parameters` draws them
    (``mean_resizing`` applies to the input embeddings only). The new layer is built and checked before the model
    changes; build the optimizer afterwards, as for a dense resize. A model whose configuration ties the output
    layer to the input embeddings (``tie_word_embeddings``) is refused before anything changes: a ``SparseLinear``
    cannot share the embedding matrix, and Hugging Face's re-tying would replace its values.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from torch_sparse_metal import sparsify
        >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        >>> model = sparsify(LlamaForCausalLM(config), density=0.25, filter=lambda name, m: name == "lm_head")
        >>> resize_token_embeddings(model, 80).weight.shape, model.lm_head.out_features
        (torch.Size([80, 32]), 80)
        >>> model.resize_token_embeddings(96).weight.shape, model.lm_head.out_features  # routed here
        (torch.Size([96, 32]), 96)
    """
    resize_dense = functools.partial(type(model).resize_token_embeddings, model)  # the class's, not this route
    head = model.get_output_embeddings()
    if not isinstance(head, SparseLinear) or (new_num_tokens is None and pad_to_multiple_of is None):
        return resize_dense(new_num_tokens, pad_to_multiple_of, mean_resizing)
    tokens = head.out_features if new_num_tokens is None else new_num_tokens
    if isinstance(pad_to_multiple_of, int) and not isinstance(pad_to_multiple_of, bool) and pad_to_multiple_of > 0:
        tokens = (tokens + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of  # as Hugging Face pads
    names = registered_names(model, head)
    _check_untied(model, names)
    new_head = _resized(head, tokens, generator)
    undo = _Undo(model)
    for name in names:  # an empty slot: Hugging Face then resizes the input embeddings alone
        set_submodule(model, name, None)
    try:
        embeddings = resize_dense(new_num_tokens, pad_to_multiple_of, mean_resizing)
        if embeddings.weight.shape[0] != tokens:
            raise ValueError(f"Hugging Face resized the input embeddings to {embeddings.weight.shape[0]} tokens, the "
                             f"sparse output layer was built for {tokens}")
    except BaseException:
        undo()
        for name in names:
            set_submodule(model, name, head)
        raise
    for name in names:
        set_submodule(model, name, new_head)
    return embeddings


def route_resize_token_embeddings(model: nn.Module) -> None:
    """Make ``model.resize_token_embeddings`` call :func:`resize_token_embeddings` (an instance attribute), if
    ``model``'s class has that method; nothing else changes, and a model that already has one keeps it.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        >>> route_resize_token_embeddings(model)
        >>> model.resize_token_embeddings.func is resize_token_embeddings
        True
    """
    if not callable(getattr(type(model), "resize_token_embeddings", None)) or \
            not callable(getattr(type(model), "get_output_embeddings", None)) or \
            "resize_token_embeddings" in model.__dict__:
        return
    model.__dict__["resize_token_embeddings"] = functools.partial(resize_token_embeddings, model)


def _route_on_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """A module registration hook: a SparseLinear registered in a module that can resize token embeddings."""
    if isinstance(submodule, SparseLinear):
        route_resize_token_embeddings(module)


torch.nn.modules.module.register_module_module_registration_hook(_route_on_registration)


class _Undo:
    """What Hugging Face's ``resize_token_embeddings`` changes besides the output layer, as it was: put back if the
    resize fails, so that the model is never left half-resized. Hugging Face keeps the input embedding module and
    gives its weight Parameter the new data (and sets ``num_embeddings``, ``padding_idx``), so those are kept too."""

    _FIELDS = ("num_embeddings", "padding_idx")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.embeddings = model.get_input_embeddings()
        self.weight = self.embeddings.weight
        self.data = self.weight.data
        fields = self.embeddings.__dict__
        self.fields = {name: fields[name] for name in self._FIELDS if name in fields}
        config = getattr(model, "config", None)
        configs = [] if config is None else [config, config.get_text_config()]
        self.vocab_sizes = [(c, c.vocab_size) for c in {id(c): c for c in configs}.values() if hasattr(c, "vocab_size")]
        self.attribute = model.__dict__.get("vocab_size")

    def __call__(self) -> None:
        self.model.set_input_embeddings(self.embeddings)
        self.embeddings.weight = self.weight
        self.weight.data = self.data
        self.embeddings.__dict__.update(self.fields)
        for config, vocab_size in self.vocab_sizes:
            config.vocab_size = vocab_size
        if self.attribute is None:
            self.model.__dict__.pop("vocab_size", None)
        else:
            self.model.vocab_size = self.attribute


def configured_ties(model: nn.Module, names: list[str]) -> list[tuple[str, str]]:
    """The ties of a Hugging Face ``model``'s configuration (``tie_word_embeddings`` and the model's tied keys) that
    involve the weight of a module registered at one of ``names``, as ``(tied parameter, the parameter it becomes)``
    pairs: what ``model.tie_weights()`` would assign. None for a model without such a configuration.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        >>> configured_ties(LlamaForCausalLM(config), ["lm_head"])
        [('lm_head.weight', 'model.embed_tokens.weight')]
    """
    own = {f"{name}.weight" if name else "weight" for name in names}
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(expand):  # transformers 5: {tied parameter: the parameter it becomes}
        return [(target, source) for target, source in expand(all_submodels=True).items() if {target, source} & own]
    config, output = getattr(model, "config", None), getattr(model, "get_output_embeddings", None)
    get_text_config = getattr(config, "get_text_config", None)
    if not callable(get_text_config) or not callable(output) or output() is None:
        return []
    heads = {f"{name}.weight" for name in registered_names(model, output())} & own
    if not heads or not getattr(get_text_config(), "tie_word_embeddings", False):
        return []
    return [(sorted(heads)[0], "the input embeddings")]


def _check_untied(model: nn.Module, names: list[str]) -> None:
    """Refuse a model whose configuration ties the sparse output layer's weight to another parameter."""
    ties = configured_ties(model, names)
    if ties:
        target, source = ties[0]
        raise ValueError(f"the model's configuration ties {target} to {source} (tie_word_embeddings), but its output "
                         "layer is a SparseLinear, whose values cannot be the embedding matrix; Hugging Face's "
                         "re-tying after a resize would replace them. Set model.config.tie_word_embeddings = False "
                         "(the sparse layer holds its own values already) and resize again; nothing was changed")


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
