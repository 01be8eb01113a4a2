"""How a ``SparseLinear`` loads a state dict: values and topology together, all or nothing.

The layer's entries are read and checked against each other and the layer first (:func:`_plan_load`, which changes
nothing); only then does the layer take the checkpoint's shapes and torch's own loader copy (or assign) them. The
layer's ``load_state_dict`` and ``_load_from_state_dict`` are :func:`load_state_dict` and
:func:`load_from_state_dict`, given ``nn.Module``'s implementation to call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from ._resize import replace_data
from .contract import DTYPES
from .layer_buffers import cache_topology, index_buffers, outside_inference, set_constant_fan_in, set_topology
from .layer_format import TOPOLOGY_KEYS, dense_tensor, read_extra_state, read_layer_topology
from .topology import CSRTopology, check_constant_fan_in

__all__ = ["load_from_state_dict", "load_state_dict"]


def load_state_dict(layer: nn.Module, state_dict: Mapping, strict: bool, assign: bool,
                    module_load: Callable) -> Any:
    """``layer.load_state_dict``: ``module_load`` (``nn.Module``'s, the layer's parent's) after the layer's own
    checks, so that a refused load changes nothing (``SparseLinear.load_state_dict`` says what is checked)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    state_dict, reported = _run_load_pre_hooks(layer, state_dict, assign)
    odd = [key for key in state_dict if not isinstance(key, str)]
    if odd:
        raise TypeError(f"state_dict keys must be strings, got {odd[0]!r} (nothing was loaded)")
    missing, unexpected, errors = reported
    if strict:
        expected = set(layer.state_dict())
        unexpected = sorted({*unexpected, *(set(state_dict) - expected)})
        missing = sorted({*missing, *(expected - set(state_dict))})
    if errors or (strict and (unexpected or missing)):  # torch's wording, said before loading
        lines = [f"{kind} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + "."
                 for kind, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys and strict]
        raise RuntimeError(f"Error(s) in loading state_dict for {type(layer).__name__} (nothing was loaded):"
                           "\n\t" + "\n\t".join(lines + errors))
    if next(layer.children(), None) is not None or _other_entries(layer):  # loaded after the layer's own entries
        try:
            _check_other_entries(layer, state_dict, _plan_load(layer, state_dict, "", assign))
        except (ValueError, TypeError) as exc:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(layer).__name__} (nothing was loaded):"
                               f"\n\t{exc}") from None
    hooks, layer._load_state_dict_pre_hooks = layer._load_state_dict_pre_hooks, OrderedDict()  # they ran above
    try:
        result = module_load(state_dict, strict=strict, assign=assign)
    finally:
        layer._load_state_dict_pre_hooks = hooks
    result.missing_keys.extend(key for key in reported[0] if key not in result.missing_keys)
    result.unexpected_keys.extend(key for key in reported[1] if key not in result.unexpected_keys)
    return result


def _run_load_pre_hooks(layer: nn.Module, state_dict: Mapping, assign: bool
                        ) -> tuple[OrderedDict, tuple[list[str], list[str], list[str]]]:
    """The layer's ``load_state_dict`` pre-hooks run on a copy of ``state_dict``, with the arguments
    ``nn.Module.load_state_dict`` gives them, before any key is checked (a hook may rename keys, as it may for
    ``nn.Linear``). Returns the copy and the missing keys, unexpected keys and error messages the hooks
    reported."""
    metadata = getattr(state_dict, "_metadata", None)
    state_dict = OrderedDict(state_dict)
    if metadata is not None:
        state_dict._metadata = metadata
    reported: tuple[list[str], list[str], list[str]] = ([], [], [])
    if layer._load_state_dict_pre_hooks:
        local_metadata = {} if metadata is None else metadata.get("", {})
        if assign:
            local_metadata["assign_to_params_buffers"] = assign
        for hook in layer._load_state_dict_pre_hooks.values():
            hook(state_dict, "", local_metadata, True, *reported)
    return state_dict, reported


def load_from_state_dict(layer: nn.Module, module_load: Callable, state_dict: Mapping, prefix: str,
                         local_metadata: dict, strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                         error_msgs: list[str]) -> None:
    """Load values and topology together; a checkpoint with another topology turns this layer into that
    layer. The layer's entries are validated against each other before anything changes, so a malformed
    checkpoint leaves the layer as it was (the error is reported by ``load_state_dict``); then the layer takes
    the checkpoint's shapes and torch's own loader (``module_load``: ``nn.Module._load_from_state_dict``) copies (or
    assigns) every entry and reports missing ones."""
    hooks = layer._load_state_dict_pre_hooks  # run here, before the checkpoint is read, and not again below
    for hook in hooks.values():
        hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    assign = bool(local_metadata.get("assign_to_params_buffers", False))
    try:
        plan = _plan_load(layer, state_dict, prefix, assign)
    except (ValueError, TypeError) as exc:
        error_msgs.append(f"{type(layer).__name__} at '{prefix}': {exc}")
        return
    _take_shapes(layer, plan, assign)
    layer._load_state_dict_pre_hooks = OrderedDict()
    try:
        module_load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    finally:
        layer._load_state_dict_pre_hooks = hooks
    if plan.topology is not None and not (layer.weight.device.type == "meta" and not assign):
        _adopt_topology(layer, plan.topology, [state_dict.get(prefix + name) for name in TOPOLOGY_KEYS])
        cache_topology(layer)  # the loader wrote row_ptr and dst alone, with the checked topology's entries
        set_constant_fan_in(layer, plan.constant_fan_in)
    _refresh_pruned(layer)


def _take_shapes(layer: nn.Module, plan: _Load, assign: bool) -> None:
    """Before torch's loader copies: the checkpoint's topology and parameters of its shapes. On meta without
    ``assign`` nothing changes (torch's loader warns that copying into meta is a no-op)."""
    if plan.topology is None or (layer.weight.device.type == "meta" and not assign):
        return
    device = plan.weight.device if assign and plan.weight is not None else layer.weight.device
    if plan.new_edges or layer.dst.device != device:
        set_topology(layer, plan.topology.to(device))
    for name, shape in (("weight", (plan.topology.nnz,)), ("bias", (plan.topology.out_features,))):
        key, wrap = _slot(layer, name)
        param = layer._parameters.get(key) if wrap != "parametrized" else None  # parametrized: same shape
        if param is not None and param.shape != shape:
            with torch.inference_mode(False):  # a load under inference_mode leaves a layer that can train
                replace_data(param, torch.empty(shape, dtype=param.dtype, device=param.device))
                if wrap == "pruned":  # the checkpoint has the mask of that shape (_plan_load)
                    mask = layer._buffers[f"{name}_mask"]
                    layer._buffers[f"{name}_mask"] = torch.empty(shape, dtype=mask.dtype, device=mask.device)
    layer.__dict__["_deferred"] = None


def _adopt_topology(layer: nn.Module, topology: CSRTopology, given: list[torch.Tensor | None]) -> None:
    """After torch's loader: index buffers it assigned (``assign=True``; ``given`` holds the checkpoint's
    ``row_ptr`` and ``dst``) keep the checkpoint's storage where they are what the kernels take (int32,
    contiguous, on the weight's device), as aliases: the caller's tensors are then lent (:mod:`._lending`).
    Others are replaced by converted copies, and the derived arrays follow the weight's device."""
    device = layer.weight.device
    if any(layer._buffers[name].device != device for name in index_buffers(layer)):
        set_topology(layer, topology.to(device))
    lent = []
    for name, theirs in zip(TOPOLOGY_KEYS, given):
        mine = layer._buffers[name]
        if mine.dtype != torch.int32 or not mine.is_contiguous() or mine.device != device or mine.dim() != 1:
            layer._buffers[name] = outside_inference(getattr(topology.to(device), name))
        elif mine is theirs:
            layer._buffers[name] = mine.detach()  # shares storage and version counter; the caller's is followed
            lent.append(mine)
    if lent:
        layer.__dict__["_lending"].lend(lent, tracked=True)


@dataclass(frozen=True)
class _Load:
    """The layer's entries of a checkpoint, validated: its topology (None when it has none), weight and bias
    (None when absent, or held by a parametrization that splits them)."""

    topology: CSRTopology | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    new_edges: bool  # the checkpoint's topology is not the one the layer holds
    constant_fan_in: bool  # what the layer is after loading (the checkpoint's flag, else the layer's)


def _slot(layer: nn.Module, name: str) -> tuple[str | None, str | None]:
    """Where ``name``'s values are in a state dict (key suffix, None when a parametrization splits them into
    several tensors), and the torch.nn.utils wrapping that owns them (None, "parametrized" or "pruned")."""
    if parametrize.is_parametrized(layer, name):
        plist = layer.parametrizations[name]
        return (f"parametrizations.{name}.original" if hasattr(plist, "original") else None), "parametrized"
    if f"{name}_orig" in layer._parameters and f"{name}_mask" in layer._buffers:
        return f"{name}_orig", "pruned"
    return name, None


_UNWRAP = {"parametrized": "torch.nn.utils.parametrize.remove_parametrizations(layer, {name!r})",
           "pruned": "torch.nn.utils.prune.remove(layer, {name!r})"}


def _plan_load(layer: nn.Module, state_dict: Mapping, prefix: str, assign: bool) -> _Load:
    """The layer's entries of ``state_dict``, validated against each other and the layer without changing it;
    raises ValueError/TypeError naming the problem."""
    topology = read_layer_topology(state_dict, prefix, out_features=layer.out_features, block=layer.block)
    constant_fan_in = layer.constant_fan_in
    if topology is not None:
        saved = read_extra_state(state_dict, prefix + "_extra_state")
        if saved:  # the checkpoint says what the layer is; without its _extra_state the layer stays what it is
            constant_fan_in = bool(saved.get("constant_fan_in", False))
        elif constant_fan_in:
            check_constant_fan_in(topology, f"the checkpoint's topology ({prefix}row_ptr, {prefix}dst), loaded without "
                                  f"{prefix}_extra_state into a constant fan-in layer,")
    deferred = layer.__dict__.get("_deferred") is not None
    nnz = topology.nnz if topology is not None else layer.nnz
    out_features = topology.out_features if topology is not None else layer.out_features
    try:  # live row_ptr and dst overwritten into no topology (RuntimeError) are replaced, not compared
        current = None if topology is None or deferred else layer.topology
    except RuntimeError:
        current = None
    new_edges = topology is not None and (current is None or not topology.same_as(current))
    weight = _read_values(layer, state_dict, prefix, "weight", nnz, topology is not None)
    weight_key, _ = _slot(layer, "weight")
    if weight is None and weight_key is not None and new_edges:
        raise ValueError(f"{prefix}{weight_key} is missing, and the checkpoint's topology has other edges than the "
                         "layer's: the layer's values cannot stay on other edges; load the weight with its topology")
    if weight is not None and topology is None and deferred and layer.weight.device.type != "meta":
        raise ValueError(f"{prefix}{weight_key} cannot be placed: the layer holds no topology (materialised from "
                         f"the meta device) and the checkpoint has none ({prefix}row_ptr, {prefix}dst)")
    bias = None
    if layer.bias is not None:
        bias = _read_values(layer, state_dict, prefix, "bias", out_features, True)
        bias_key, _ = _slot(layer, "bias")
        if bias is None and bias_key is not None and out_features != layer.out_features:
            raise ValueError(f"{prefix}{bias_key} is missing, and the checkpoint's layer has out_features="
                             f"{out_features}, the layer's bias {layer.out_features} values: load the bias too")
    for name, size, now in (("weight", nnz, layer.nnz), ("bias", out_features, layer.out_features)):
        if size != now:
            _check_wrapped_resize(layer, state_dict, prefix, name, size, now)
            _check_resizable(layer, prefix, name, size, now)
    if assign and weight is not None:
        if weight.dtype not in DTYPES:
            raise TypeError(f"{prefix}{weight_key} is {weight.dtype}, which assign=True would give the layer; "
                            f"supported: {', '.join(str(d) for d in DTYPES)}")
        if bias is not None and (bias.dtype, bias.device) != (weight.dtype, weight.device):
            raise TypeError(f"assign=True would give the layer a weight ({weight.dtype} on {weight.device}) and a bias "
                            f"({bias.dtype} on {bias.device}) of different dtypes or devices")
    return _Load(topology, weight, bias, new_edges, constant_fan_in)


def _check_resizable(layer: nn.Module, prefix: str, name: str, size: int, now: int) -> None:
    """A parameter that is a tensor subclass (a DTensor shard of FSDP2's ``fully_shard``, say) cannot be given
    another size here: refused before anything changes."""
    param = layer._parameters.get(name)
    if param is None or type(param.data) is torch.Tensor:
        return
    raise ValueError(f"{prefix}{name} is a {type(param.data).__name__} (e.g. sharded by FSDP2's fully_shard), and the "
                     f"checkpoint's topology would change its size from {now} to {size}, which sharded parameters "
                     "cannot do in place: load the checkpoint into the model before sharding it (fully_shard after "
                     "load_state_dict), or build the model with the checkpoint's topology")


def _check_wrapped_resize(layer: nn.Module, state_dict: Mapping, prefix: str, name: str, size: int, now: int
                          ) -> None:
    """A wrapped ``name`` may change its size only when pruned and the checkpoint has its mask of the new size (a
    parametrization's own state has the layer's size, and torch's loader cannot resize it)."""
    wrap = _slot(layer, name)[1]
    if wrap is None:
        return
    mask = state_dict.get(f"{prefix}{name}_mask")
    if wrap == "pruned" and isinstance(mask, torch.Tensor) and mask.shape == (size,):
        return
    raise ValueError(f"{name} is {wrap}, and the checkpoint's topology would change its size from {now} to {size}"
                     + (f" without a {prefix}{name}_mask of that size" if wrap == "pruned" else "")
                     + f"; {_UNWRAP[wrap].format(name=name)} before loading, then wrap it again")


def _read_values(layer: nn.Module, state_dict: Mapping, prefix: str, name: str, size: int, placed: bool
                 ) -> torch.Tensor | None:
    """The checkpoint's values of ``name`` (wherever a wrapping keeps them), checked to have ``size`` entries;
    None when absent. ``placed``: the size comes from the checkpoint's topology (else from the layer's)."""
    suffix, _ = _slot(layer, name)
    if suffix is None or prefix + suffix not in state_dict:
        return None
    value = dense_tensor(state_dict, prefix + suffix, floating=True)
    if value.shape != (size,):
        if name == "bias":
            raise ValueError(f"{suffix} must have shape ({size},), got {tuple(value.shape)}")
        where = ("the checkpoint's topology" if placed else
                 f"the layer's topology, as the checkpoint has none ({prefix}row_ptr, {prefix}dst) to place them")
        raise ValueError(f"{suffix} must have shape ({size},) to match {where}, got {tuple(value.shape)}")
    return value


def _other_entries(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's state-dict tensors that are not its values or topology: a parametrization's state, a pruning
    mask, buffers a user registered."""
    own = {"weight", "bias", *TOPOLOGY_KEYS, "_extra_state", _slot(layer, "weight")[0], _slot(layer, "bias")[0]}
    return {key: value for key, value in layer.state_dict(keep_vars=True).items()
            if key not in own and isinstance(value, torch.Tensor)}


def _check_other_entries(layer: nn.Module, state_dict: Mapping, plan: _Load) -> None:
    """The checks torch's loader makes of :func:`_other_entries` (a tensor of the layer's shape; a pruning mask of
    the checkpoint's), made before anything is loaded."""
    resized = {"weight_mask": plan.topology.nnz, "bias_mask": plan.topology.out_features} if plan.topology else {}
    for key, mine in _other_entries(layer).items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key} must be a tensor, got {type(value).__name__}")
        shape = (resized[key],) if key in resized else tuple(mine.shape)
        if tuple(value.shape) != shape:
            raise ValueError(f"size mismatch for {key}: {tuple(value.shape)} in the checkpoint, {shape} in the layer")


def _refresh_pruned(layer: nn.Module) -> None:
    """A pruned tensor (``weight = weight_orig * weight_mask``) from what was just loaded, as the pruning hook
    computes it before each forward."""
    for hook in layer._forward_pre_hooks.values():
        if isinstance(hook, prune.BasePruningMethod) and hook._tensor_name in ("weight", "bias"):
            setattr(layer, hook._tensor_name, hook.apply_mask(layer))

