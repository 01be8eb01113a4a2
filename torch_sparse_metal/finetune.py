"""Sparse fine-tuning of a whole model: ``SparseDelta`` wrappers on the linear layers named as PEFT's
``target_modules`` names them, connections chosen from an accumulated gradient, merging, and saving and loading
the deltas alone (values and indices) or with the model (safetensors, ``save_pretrained``): docs/finetuning.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from ._modules import set_submodule
from .checkpoint import read_checkpoint
from .delta import SparseDelta
from .layer_format import layer_prefixes, read_layer_topology
from .topology import CSRTopology

__all__ = ["accumulated_gradients", "add_sparse_deltas", "delta_state_dict", "load_deltas", "merge_and_unload",
           "merge_deltas", "save_deltas", "sparse_deltas", "target_names", "unmerge_deltas"]

_DELTA = ".delta."


def target_names(model: nn.Module, target_modules: str | Iterable[str]) -> list[str]:
    """The names of ``model``'s ``nn.Linear`` layers that ``target_modules`` selects, as PEFT's
    ``target_modules`` does: a string is a regular expression the whole name must match; a list of strings selects
    the layers whose name is one of them or ends with ``"." + one of them``. The modules inside a ``SparseDelta``
    (``base``, ``delta``) are never selected; selecting a wrapper (a layer that has a delta already), a module that
    is not an ``nn.Linear``, or nothing raises ``ValueError``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> target_names(model, ["0", "2"]), target_names(model, r"[02]")
        (['0', '2'], ['0', '2'])
    """
    if isinstance(target_modules, str):
        pattern = re.compile(target_modules)

        def chosen(name: str) -> bool:
            return pattern.fullmatch(name) is not None
    else:
        suffixes = list(target_modules)
        if not suffixes or not all(isinstance(s, str) and s for s in suffixes):
            raise ValueError(f"target_modules must be a regular expression or a list of module names, got "
                             f"{target_modules!r}")

        def chosen(name: str) -> bool:
            return any(name == s or name.endswith("." + s) for s in suffixes)
    inside = {id(m) for wrapper in model.modules() if isinstance(wrapper, SparseDelta) for m in wrapper.modules()
              if m is not wrapper}  # a wrapper's base and delta are reached through the wrapper
    names = [name for name, m in model.named_modules() if name and chosen(name) and id(m) not in inside]
    wrapped = [name for name in names if isinstance(model.get_submodule(name), SparseDelta)]
    if wrapped:
        raise ValueError(f"target_modules selects layers that have a sparse delta already: {', '.join(wrapped)}")
    wrong = [f"{name} ({type(model.get_submodule(name)).__name__})" for name in names
             if not isinstance(model.get_submodule(name), nn.Linear)]
    if wrong:
        raise ValueError(f"target_modules selects modules that are not nn.Linear: {', '.join(wrong)}")
    if not names:
        raise ValueError(f"target_modules={target_modules!r} selects no nn.Linear layer of the model")
    return names


def sparse_deltas(model: nn.Module) -> dict[str, SparseDelta]:
    """Every ``SparseDelta`` of ``model``, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SparseDelta)}


def add_sparse_deltas(model: nn.Module, target_modules: str | Iterable[str], density: float | None = None, *,
                      block: int = 1, scores: Mapping[str, torch.Tensor] | None = None,
                      topologies: Mapping[str, CSRTopology] | None = None, train_only_deltas: bool = True,
                      generator: torch.Generator | None = None, backward: str = "auto") -> dict[str, SparseDelta]:
    """Wrap each ``nn.Linear`` that ``target_modules`` selects (:func:`target_names`) in a :class:`SparseDelta`,
    in place, and return the wrappers by name.

    Each delta's connections come from ``topologies[name]`` if given, else the ``density`` fraction with the largest
    ``scores[name]`` (:func:`accumulated_gradients`), else the ``density`` fraction at random. With
    ``train_only_deltas`` (default) every other parameter of the model is frozen, as PEFT does; build the optimizer
    afterwards (the weights of the model's deltas stay trainable). Every wrapper is built before the model changes,
    so an error leaves it as it was.

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> deltas = add_sparse_deltas(model, ["0"], density=0.1)
        >>> list(deltas), [n for n, p in model.named_parameters() if p.requires_grad]
        (['0'], ['0.delta.weight'])
    """
    names = target_names(model, target_modules)
    for what, given in (("scores", scores), ("topologies", topologies)):
        unknown = sorted(set(given or {}) - set(names))
        if unknown:
            raise ValueError(f"{what} names layers target_modules does not select: {unknown}")
    wrappers = {}
    for name in names:
        topology = (topologies or {}).get(name)
        wrappers[name] = SparseDelta(model.get_submodule(name), None if topology is not None else density,
                                     topology=topology, scores=(scores or {}).get(name), block=block,
                                     freeze_base=False, generator=generator, backward=backward)
    for name, wrapper in wrappers.items():
        set_submodule(model, name, wrapper)
    if train_only_deltas:
        _train_only_deltas(model)
    return wrappers


def _train_only_deltas(model: nn.Module) -> None:
    """Freeze every parameter of ``model`` but the weights of its deltas."""
    for p in model.parameters():
        p.requires_grad_(False)
    for wrapper in sparse_deltas(model).values():
        wrapper.delta.weight.requires_grad_(True)


def accumulated_gradients(model: nn.Module, target_modules: str | Iterable[str], batches: Iterable,
                          loss_fn: Callable[[nn.Module, object], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``|sum of the gradients of loss_fn(model, batch) over batches|`` for the weight of each selected
    ``nn.Linear``: the scores that choose a delta's connections (``add_sparse_deltas(..., scores=...)``, the
    gradient-based selection of SpIEL and Super-Tuning).

    Cost: one forward and backward of the model per batch, and one dense ``[out, in]`` float32 tensor per selected
    layer while it runs (the selected weights are the only parameters that take a gradient meanwhile). The model's
    ``requires_grad`` flags and existing ``.grad`` are restored afterwards.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> batches = [torch.randn(4, 8) for _ in range(3)]
        >>> scores = accumulated_gradients(model, ["0"], batches, lambda m, x: m(x).square().mean())
        >>> scores["0"].shape
        torch.Size([8, 8])
    """
    names = target_names(model, target_modules)
    weights = {name: model.get_submodule(name).weight for name in names}
    flags = [(p, p.requires_grad, p.grad) for p in model.parameters()]
    sums = {name: torch.zeros(w.shape, dtype=torch.float32, device=w.device) for name, w in weights.items()}
    try:
        for p, _, _ in flags:
            p.requires_grad_(False)
            p.grad = None
        for w in weights.values():
            w.requires_grad_(True)
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor")
            loss.backward()
            for name, w in weights.items():
                if w.grad is not None:
                    sums[name] += w.grad.float()
                    w.grad = None
    finally:
        for p, requires_grad, grad in flags:
            p.requires_grad_(requires_grad)
            p.grad = grad
    return {name: s.abs_() for name, s in sums.items()}


def merge_deltas(model: nn.Module) -> None:
    """:meth:`SparseDelta.merge` every unmerged delta of ``model``."""
    for wrapper in sparse_deltas(model).values():
        if not wrapper.merged:
            wrapper.merge()


def unmerge_deltas(model: nn.Module) -> None:
    """:meth:`SparseDelta.unmerge` every merged delta of ``model``."""
    for wrapper in sparse_deltas(model).values():
        if wrapper.merged:
            wrapper.unmerge()


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge every delta into its base layer and put the base ``nn.Linear`` back in the wrapper's place (PEFT's
    ``merge_and_unload``); returns ``model`` (or the base layer, if ``model`` is itself a wrapper).

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8))
        >>> _ = add_sparse_deltas(model, ["0"], density=0.25)
        >>> type(merge_and_unload(model)[0]).__name__
        'Linear'
    """
    if isinstance(model, SparseDelta):
        if not model.merged:
            model.merge()
        return model.base
    for name, wrapper in sparse_deltas(model).items():
        if not wrapper.merged:
            wrapper.merge()
        set_submodule(model, name, wrapper.base)
    return model


def delta_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The deltas alone: for each wrapper ``name``, its delta's values and indices (``name.delta.weight``,
    ``.row_ptr``, ``.dst``, ``._extra_state``) and its merge state (``name._extra_state``), on the CPU.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 8))
        >>> _ = add_sparse_deltas(model, ["0"], density=0.25)
        >>> sorted(delta_state_dict(model))
        ['0._extra_state', '0.delta._extra_state', '0.delta.dst', '0.delta.row_ptr', '0.delta.weight']
    """
    state = {}
    for name, wrapper in sparse_deltas(model).items():
        state[f"{name}._extra_state"] = wrapper.get_extra_state()
        for key, value in wrapper.delta.state_dict(prefix=name + _DELTA).items():
            state[key] = value.detach().cpu().contiguous()
    return state


def save_deltas(model: nn.Module, path: str | os.PathLike) -> None:
    """Write :func:`delta_state_dict` to ``path``: a ``.safetensors`` file, else a ``torch.save`` file."""
    state = delta_state_dict(model)
    if not state:
        raise ValueError("the model has no SparseDelta to save")
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)


def load_deltas(model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, torch.Tensor], *,
                train_only_deltas: bool = True, backward: str = "auto") -> dict[str, SparseDelta]:
    """Put the deltas of ``checkpoint`` on ``model`` and load them; returns the wrappers by name.

    ``checkpoint`` is anything :func:`~torch_sparse_metal.checkpoint.read_checkpoint` reads: a file of
    :func:`save_deltas` (the deltas alone: the base layers keep their values), or a whole model's state or
    ``save_pretrained`` folder saved with its deltas (then every entry of the model is loaded: a key missing, other
    than a tied tensor's second name, or one the model lacks raises). Each
    layer a delta was saved for (an ``nn.Linear``, or a ``SparseDelta`` whose delta is replaced) gets a wrapper of
    the saved topology. A model built on the meta device (``accelerate.init_empty_weights()``) takes the tensors of a
    whole model's checkpoint. Everything is checked before the model changes; an error leaves it as it was. With
    ``train_only_deltas`` every other parameter is frozen.

    Example:
        >>> trained = nn.Sequential(nn.Linear(8, 8))
        >>> _ = add_sparse_deltas(trained, ["0"], density=0.25)
        >>> _ = trained[0].delta.weight.data.normal_()
        >>> fresh = nn.Sequential(nn.Linear(8, 8))
        >>> fresh[0].load_state_dict(trained[0].base.state_dict())
        <All keys matched successfully>
        >>> _ = load_deltas(fresh, delta_state_dict(trained))
        >>> x = torch.randn(2, 8)
        >>> torch.equal(fresh(x), trained(x))
        True
    """
    state = read_checkpoint(checkpoint)
    places = [prefix[: -len(_DELTA)] for prefix in layer_prefixes(state) if prefix.endswith(_DELTA)]
    if not places:
        raise ValueError("the checkpoint holds no sparse delta (no '<layer>.delta.row_ptr' entry)")
    deltas_only = all(_is_delta_key(key, places) for key in state)
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if deltas_only and on_meta:
        raise ValueError("the model is on the meta device and the checkpoint holds deltas alone: load the base "
                         "model's weights first (or a whole model's checkpoint with its deltas)")
    wrappers = {}
    for place in places:
        try:
            current = model.get_submodule(place)
        except AttributeError:
            raise ValueError(f"the checkpoint has a delta for {place!r}, which the model does not have") from None
        base = current.base if isinstance(current, SparseDelta) else current
        if not isinstance(base, nn.Linear):
            raise ValueError(f"the checkpoint has a delta for {place!r}, a {type(base).__name__} in the model, not "
                             "an nn.Linear")
        topology = read_layer_topology(state, place + _DELTA)
        wrappers[place] = SparseDelta(base, topology=topology, freeze_base=False, backward=backward)
    previous = {place: model.get_submodule(place) for place in places}
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for place, wrapper in wrappers.items():
            set_submodule(model, place, wrapper)
        if deltas_only:  # the base layers keep their values
            for place, wrapper in wrappers.items():
                own = {"base." + key: value for key, value in wrapper.base.state_dict().items()}
                wrapper.load_state_dict({**own, **_under(state, place + ".")}, strict=True)
        else:
            _check_whole_model_keys(model, state)
            model.load_state_dict(state, strict=False, assign=on_meta)  # a meta model takes the loaded tensors
    except BaseException:
        for place, module in previous.items():
            set_submodule(model, place, module)
        for p, requires_grad in flags:
            p.requires_grad_(requires_grad)
        raise
    if train_only_deltas:
        _train_only_deltas(model)
    return wrappers


def _check_whole_model_keys(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """A whole model's checkpoint holds every entry of the model but the second names of tied tensors (which
    ``save_pretrained`` leaves out, such as a tied ``lm_head.weight``), and nothing else."""
    entries = model.state_dict(keep_vars=True)
    present = {id(entries[key]) for key in state if key in entries}
    missing = sorted(key for key, value in entries.items() if key not in state and id(value) not in present)
    unexpected = sorted(set(state) - set(entries))
    shapes = sorted(f"{key} {tuple(state[key].shape)} for {tuple(entries[key].shape)}" for key in state
                    if key in entries and isinstance(state[key], torch.Tensor)
                    and isinstance(entries[key], torch.Tensor) and state[key].shape != entries[key].shape)
    if shapes:
        raise ValueError(f"the checkpoint's tensors do not fit the model's; nothing was changed: {shapes[:8]}")
    if missing or unexpected:
        raise ValueError("the checkpoint does not fit the model with its deltas; nothing was changed. "
                         + " ".join(f"{kind} keys: {keys[:8]}{' ...' if len(keys) > 8 else ''}."
                                    for kind, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys))


def _is_delta_key(key: str, places: list[str]) -> bool:
    return any(key.startswith(place + _DELTA) or key == place + "._extra_state" for place in places)


def _under(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
