"""Load a sparse checkpoint into the model it was saved from, rebuilt from its configuration.

A model that ``sparsify`` (or a hand placement) made sparse saves each ``SparseLinear`` as the tensors ``weight``
(one value per edge), ``bias``, ``row_ptr``, ``dst`` and ``_extra_state``. The class that built the model from its
configuration (a Hugging Face ``from_config``, a plain constructor) has ``nn.Linear`` layers there instead, so its
``load_state_dict`` (and ``from_pretrained``) sees a size mismatch. :func:`load_sparse_checkpoint` reads the
checkpoint, puts a ``SparseLinear`` of the checkpoint's topology wherever the checkpoint has one, and loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ._modules import registered_names, set_submodule
from .huggingface import route_resize_token_embeddings
from .layer_format import layer_prefixes, read_layer_topology
from .nn import SparseLinear

__all__ = ["load_sparse_checkpoint", "read_checkpoint"]

#: Files a directory checkpoint may hold, in the order they are looked for (Hugging Face's names).
_DIRECTORY_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                    "pytorch_model.bin")


def read_checkpoint(checkpoint: str | os.PathLike | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of ``checkpoint``, on the CPU: a mapping (returned as a dict), a ``.safetensors`` file, a
    ``torch.save`` file (read with ``weights_only=True``), a directory that ``save_pretrained`` wrote (sharded or
    not, safetensors or torch), or a ``torch.distributed.checkpoint`` directory (read whole, in one process).

    Example:
        >>> import tempfile, os
        >>> layer = SparseLinear(8, 4, density=0.5)
        >>> path = os.path.join(tempfile.mkdtemp(), "layer.pt")
        >>> torch.save(layer.state_dict(), path)
        >>> sorted(read_checkpoint(path))
        ['_extra_state', 'bias', 'dst', 'row_ptr', 'weight']
    """
    if isinstance(checkpoint, Mapping):
        return dict(checkpoint)
    path = Path(checkpoint)
    if path.is_dir():
        if (path / ".metadata").is_file():
            return _read_distributed(path)
        for name in _DIRECTORY_FILES:
            if (path / name).is_file():
                return _read_sharded(path / name) if name.endswith(".index.json") else _read_file(path / name)
        raise FileNotFoundError(f"{path} holds no checkpoint: looked for {', '.join(_DIRECTORY_FILES)} and a "
                                "torch.distributed.checkpoint .metadata")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return _read_sharded(path) if path.name.endswith(".index.json") else _read_file(path)


def load_sparse_checkpoint(model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, torch.Tensor], *,
                           strict: bool = True, backward: str = "auto", prefix: str = "") -> nn.Module:
    """Make ``model`` the model ``checkpoint`` was saved from and load it: every ``nn.Linear`` (or ``SparseLinear``)
    at a place where the checkpoint holds a sparse layer becomes a ``SparseLinear`` of the checkpoint's topology,
    then the model loads the whole checkpoint. ``model`` is changed in place and returned (use the return value: a
    model that is itself one sparse layer is replaced).

    ``model`` is typically built from its configuration; on the meta device (``torch.device("meta")``, or
    ``accelerate.init_empty_weights()``, which keeps buffers real) no dense weight is ever materialised: the
    parameters then become the checkpoint's tensors (``load_state_dict(assign=True)``). ``checkpoint`` is anything
    :func:`read_checkpoint` reads. Everything is checked before anything changes: a sparse layer where the model
    has no linear layer, other in/out features or bias, and (with ``strict``) keys the model and the checkpoint do
    not share raise ``ValueError`` and leave ``model`` as it was.

    ``prefix`` selects the model's entries of a checkpoint that holds more: only keys starting with it are read,
    without it. A ``torch.distributed.checkpoint`` of ``{"model": model.state_dict(), "optim": ...}`` flattens the
    model's keys to ``"model.<key>"``: pass ``prefix="model."``. A prefix no key starts with raises ``ValueError``.

    Example:
        >>> from torch_sparse_metal import sparsify
        >>> trained = sparsify(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)), density=0.25)
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> model = load_sparse_checkpoint(model, trained.state_dict())
        >>> x = torch.randn(3, 16)
        >>> torch.equal(model(x), trained(x))
        True
    """
    state = _under_prefix(read_checkpoint(checkpoint), prefix)
    places = layer_prefixes(state)
    replacements = {prefix: _replacement(model, state, prefix, backward) for prefix in places}
    if "" in replacements:  # the model is the layer itself
        new = replacements[""]
        new.load_state_dict(state, strict=strict, assign=_on_meta(model))
        return new
    _check_meta_buffers(model, state, places)
    registrations = {prefix: registered_names(model, model.get_submodule(prefix[:-1])) for prefix in places}
    previous = {name: model.get_submodule(name) for names in registrations.values() for name in names}
    for prefix, names in registrations.items():
        missing = sorted(set(names) - {p[:-1] for p in places})
        if missing:
            raise ValueError(f"the layer at {prefix[:-1]!r} is also registered as {missing}, where the checkpoint has "
                             "no sparse layer; nothing was changed")
    assign = _on_meta(model)
    try:
        for prefix, names in registrations.items():
            for name in names:
                set_submodule(model, name, replacements[prefix])
        if strict:
            _check_keys(model, state)
        model.load_state_dict(state, strict=strict, assign=assign)
    except BaseException:
        for name, module in previous.items():
            set_submodule(model, name, module)
        raise
    if places:  # a sparse output layer anywhere in a Hugging Face model: its resize_token_embeddings must know it
        route_resize_token_embeddings(model)
    return model


def _under_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` whose keys start with ``prefix``, keyed without it (all of them for "")."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if not prefix:
        return state
    chosen = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    if not chosen:
        tops = sorted({key.split(".", 1)[0] + "." for key in state})
        raise ValueError(f"no key of the checkpoint starts with prefix={prefix!r}; its keys start with "
                         f"{tops[:8]}{' ...' if len(tops) > 8 else ''}; nothing was changed")
    return chosen


def _replacement(model: nn.Module, state: Mapping, prefix: str, backward: str) -> SparseLinear:
    """The SparseLinear of the checkpoint's topology at ``prefix``, on the place's device and dtype (values not
    loaded yet), after checking that the model has a linear layer of the same shape there."""
    name = prefix[:-1]
    try:
        here = model.get_submodule(name) if name else model
    except AttributeError:
        first = name.split(".", 1)[0]
        hint = (f" (if the checkpoint holds more than the model, as a torch.distributed.checkpoint of "
                f"{{{first!r}: model.state_dict(), ...}} does, pass prefix={first + '.'!r})"
                if "." in name and not hasattr(model, first) else "")
        raise ValueError(f"the checkpoint has a sparse layer at {name!r}, where the model has no module{hint}; "
                         "nothing was changed") from None
    if not isinstance(here, (nn.Linear, SparseLinear)):
        raise ValueError(f"the checkpoint has a sparse layer at {name!r}, where the model has a "
                         f"{type(here).__name__}, not an nn.Linear; nothing was changed")
    try:
        topology = read_layer_topology(state, prefix, out_features=here.out_features)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the checkpoint's sparse layer at {name!r}: {exc}; nothing was changed") from None
    shape = (topology.in_features, topology.out_features)
    if shape != (here.in_features, here.out_features):
        raise ValueError(f"the checkpoint's sparse layer at {name!r} is {shape[0]} -> {shape[1]}, the model's layer "
                         f"{here.in_features} -> {here.out_features}; nothing was changed")
    has_bias = prefix + "bias" in state
    if has_bias != (here.bias is not None):
        raise ValueError(f"the checkpoint's sparse layer at {name!r} {'has' if has_bias else 'has no'} bias, the "
                         f"model's layer {'has none' if has_bias else 'has one'}; nothing was changed")
    new = SparseLinear.from_topology(topology, bias=has_bias, backward=backward, device=here.weight.device,
                                     dtype=here.weight.dtype)
    new.weight.requires_grad_(here.weight.requires_grad)
    if has_bias:
        new.bias.requires_grad_(here.bias.requires_grad)
    return new.train(here.training)


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _check_meta_buffers(model: nn.Module, state: Mapping, places: list[str]) -> None:
    """Buffers on the meta device that the checkpoint does not fill (non-persistent ones, such as rotary
    embeddings' ``inv_freq``) would stay without data: refused before anything changes."""
    empty = [name for name, buffer in model.named_buffers() if buffer.device.type == "meta" and name not in state
             and not any(name.startswith(prefix) for prefix in places)]
    if empty:
        raise ValueError(f"the model has buffers on the meta device that no checkpoint holds ({empty[:4]}"
                         f"{' ...' if len(empty) > 4 else ''}): build it with accelerate.init_empty_weights(), which "
                         "keeps buffers real, or on the CPU; nothing was changed")


def _check_keys(model: nn.Module, state: Mapping) -> None:
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError("the checkpoint does not fit the model; nothing was changed. "
                         + " ".join(f"{kind} keys: {keys[:8]}{' ...' if len(keys) > 8 else ''}."
                                    for kind, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys)
                         + " Pass strict=False to load what fits")


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """The shards named by a Hugging Face ``*.index.json`` (its ``weight_map``), merged."""
    weight_map = json.loads(index.read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state.update(_read_file(index.parent / shard))
    return state


def _read_distributed(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.distributed.checkpoint`` directory, every tensor whole on the CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state
