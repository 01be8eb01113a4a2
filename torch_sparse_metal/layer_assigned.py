"""A ``SparseLinear`` whose saved tensors were set one at a time from outside the layer.

accelerate's big-model loading (``load_checkpoint_and_dispatch``, ``load_checkpoint_in_model`` with a
``device_map``) does not call ``load_state_dict``: it puts each checkpoint entry into the module's ``_parameters`` or
``_buffers`` with ``set_module_tensor_to_device``, one entry at a time. A layer's entries only mean something together
(``weight`` holds one value per edge of ``row_ptr`` and ``dst``; ``_extra_state`` says the layer's shape), so the
layer takes such tensors only once all of them are set and checked against each other and the layer:

- a layer holding no topology (built on the meta device, as under ``accelerate.init_empty_weights``) notes which
  tensors it holds then (:func:`mark_unset`); once ``weight``, ``bias``, ``row_ptr``, ``dst`` and ``_extra_state``
  have all been replaced (the index entries by tensors with data; ``weight`` and ``bias`` may stay on the meta device,
  offloaded until each call), :func:`take_assigned` checks them and makes them its topology, at the layer's next use
  (a call, ``.to()``, ``state_dict()``, ``topology``); with some replaced and others not, a call refuses and names
  both;
- a layer holding a topology sees replaced ``row_ptr`` and ``dst`` through its topology cache
  (:func:`~torch_sparse_metal.layer_buffers.cached_topology`), and a replaced ``_extra_state`` is checked against
  the layer (:func:`check_shape_buffer`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .contract import DTYPES
from .layer_buffers import SHAPE_BUFFER, set_topology
from .layer_format import TOPOLOGY_KEYS, extra_state, read_extra_state, read_layer_topology
from .topology import check_constant_fan_in

__all__ = ["check_shape_buffer", "mark_unset", "take_assigned"]

_LOAD = ("load the checkpoint with torch_sparse_metal.load_sparse_checkpoint(model, checkpoint), or "
         "model.load_state_dict(state_dict, assign=True)")


def _saved_tensors(layer: nn.Module) -> dict[str, torch.Tensor | None]:
    """The tensors behind the layer's state-dict entries, by entry name (``weight`` None when a parametrization or
    pruning holds it: such a layer is never taken from outside)."""
    tensors = {"weight": layer._parameters.get("weight")}
    if "bias" in layer._parameters and layer._parameters["bias"] is not None:
        tensors["bias"] = layer._parameters["bias"]
    for name in (*TOPOLOGY_KEYS, SHAPE_BUFFER):
        tensors[name] = layer._buffers.get(name)
    return tensors


def mark_unset(layer: nn.Module) -> None:
    """Note the tensors a layer holding no topology has now (weakly): only tensors set in their place later count as
    set from outside."""
    layer.__dict__["_unset"] = {name: weakref.ref(t) for name, t in _saved_tensors(layer).items() if t is not None}


def _replaced(layer: nn.Module) -> tuple[list[str], list[str]]:
    """The layer's entries replaced since :func:`mark_unset` (the index entries by tensors with data; ``weight``
    and ``bias`` may be replaced by tensors on the meta device: offloaded, they arrive before each call), and the
    others."""
    unset = layer.__dict__.get("_unset", {})
    fresh, left = [], []
    for name, t in _saved_tensors(layer).items():
        was = unset.get(name)
        new = t is not None and (was is None or was() is not t) and (name in ("weight", "bias") or not t.is_meta)
        (fresh if new else left).append(name)
    return fresh, left


def take_assigned(layer: nn.Module, *, refuse: bool) -> bool:
    """For a layer holding no topology: if every entry was set from outside, check them against each other and the
    layer and make them its topology, weight and bias (True); if none was, nothing (False). With some set and others
    not, raise when ``refuse`` (the layer is about to compute), else do nothing (False). Entries that do not form
    this layer raise either way.

    Example:
        >>> from torch_sparse_metal import SparseLinear
        >>> trained = SparseLinear(8, 4, density=0.5)
        >>> with torch.device("meta"):
        ...     layer = SparseLinear(8, 4, density=0.5)
        >>> for name, t in trained.state_dict().items():  # as accelerate's set_module_tensor_to_device does
        ...     if name in layer._parameters:
        ...         layer._parameters[name] = torch.nn.Parameter(t.clone())
        ...     else:
        ...         layer._buffers[name] = t.clone()
        >>> take_assigned(layer, refuse=True), torch.equal(layer.to_dense(), trained.to_dense())
        (True, True)
    """
    if "_unset" not in layer.__dict__:
        return False
    fresh, left = _replaced(layer)
    if not fresh:
        return False
    if left:
        if not refuse:
            return False
        raise RuntimeError(
            f"this SparseLinear ({layer.in_features} -> {layer.out_features}) holds no topology (built on the meta "
            f"device), and its entries were set one at a time from outside (e.g. by accelerate's "
            f"set_module_tensor_to_device): {', '.join(fresh)} set, {', '.join(left)} not. Its entries only mean "
            f"something together; set them all from one checkpoint of this layer, or {_LOAD}")
    tensors = _saved_tensors(layer)
    try:
        topology = _check(layer, tensors)
    except (ValueError, TypeError) as exc:
        raise RuntimeError(
            f"the entries set from outside into this SparseLinear ({layer.in_features} -> {layer.out_features}, "
            f"e.g. by accelerate's set_module_tensor_to_device) do not form the layer: {exc}. Build the model with "
            f"the checkpoint's layers, or {_LOAD}") from None
    set_topology(layer, topology.to(tensors["dst"].device))
    layer.__dict__["_deferred"] = None
    del layer.__dict__["_unset"]
    return True


def _check(layer: nn.Module, tensors: dict[str, torch.Tensor]):
    """The topology that ``tensors`` (every entry of the layer, with data) give the layer; raises ValueError or
    TypeError naming what does not fit."""
    _check_shape(layer, tensors[SHAPE_BUFFER])
    topology = read_layer_topology(tensors, "", out_features=layer.out_features, block=layer.block)
    weight, bias = tensors["weight"], tensors.get("bias")
    if weight.dim() != 1 or weight.numel() != topology.nnz:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, row_ptr and dst have {topology.nnz} edges")
    if weight.dtype not in DTYPES:
        raise TypeError(f"weight is {weight.dtype}; supported: {', '.join(str(d) for d in DTYPES)}")
    if bias is not None and (bias.shape != (layer.out_features,) or (bias.dtype, bias.device.type)
                             != (weight.dtype, weight.device.type)):
        raise ValueError(f"bias is a {bias.dtype} tensor of shape {tuple(bias.shape)} on {bias.device}, the weight "
                         f"{weight.dtype} on {weight.device} for {layer.out_features} outputs")
    if layer.constant_fan_in:
        check_constant_fan_in(topology, "row_ptr and dst, set into a constant fan-in layer,")
    return topology


def _check_shape(layer: nn.Module, record: torch.Tensor) -> None:
    """``record`` (an ``_extra_state`` set from outside) says what the layer is; raises ValueError if not."""
    theirs = read_extra_state({SHAPE_BUFFER: record.detach().cpu()}, SHAPE_BUFFER)
    mine = read_extra_state({SHAPE_BUFFER: extra_state(layer.in_features, layer.out_features, layer.block,
                                                       layer.constant_fan_in)}, SHAPE_BUFFER)
    if theirs != mine:
        differ = {key: theirs.get(key) for key in mine if theirs.get(key) != mine[key]}
        raise ValueError(f"_extra_state is of another layer: {differ}, where this layer has "
                         f"{ {key: mine[key] for key in differ} }")


def check_shape_buffer(layer: nn.Module) -> None:
    """A layer holding a topology whose ``_extra_state`` buffer was set from outside: the buffer must describe the
    layer (then it is kept as the layer's own), else RuntimeError. A buffer on the meta device is not read."""
    record = layer._buffers.get(SHAPE_BUFFER)
    own = layer.__dict__.get("_own_shape")
    if record is None or (own is not None and own() is record) or record.is_meta:
        return
    try:
        _check_shape(layer, record)
    except (ValueError, TypeError) as exc:
        raise RuntimeError(
            f"this SparseLinear's _extra_state was set from outside (e.g. by accelerate's "
            f"set_module_tensor_to_device loading a checkpoint) and does not describe it: {exc}. Build the model "
            f"with the checkpoint's layers, or {_LOAD}") from None
    layer.__dict__["_own_shape"] = weakref.ref(record)
