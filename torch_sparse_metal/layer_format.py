"""A ``SparseLinear``'s entries in a state dict: the keys of its edges, its ``_extra_state`` record and the topology
read from them. The layer writes them; its own loader and the checkpoint loaders (``checkpoint``, ``finetune``)
read them through this module."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .topology import CSRTopology, check_block, check_constant_fan_in

__all__ = ["TOPOLOGY_KEYS", "dense_tensor", "extra_state", "layer_prefixes", "read_extra_state",
           "read_layer_topology"]

#: The entries that hold a layer's edges (its persistent index buffers).
TOPOLOGY_KEYS = ("row_ptr", "dst")
#: The checkpoint format ``get_extra_state`` writes: 2 is a tensor ``[2, in, out, block]``; 3 adds a constant fan-in
#: flag, ``[3, in, out, block, 1]``, written only by constant fan-in layers; 1 (a dict) is still read.
_FORMAT = 2
_FORMAT_FAN_IN = 3
_EXTRA_FIELDS = {_FORMAT: ("format", "in_features", "out_features", "block"),
                 _FORMAT_FAN_IN: ("format", "in_features", "out_features", "block", "constant_fan_in")}


def extra_state(in_features: int, out_features: int, block: int, constant_fan_in: bool) -> torch.Tensor:
    """A layer's ``_extra_state`` entry: ``[2, in_features, out_features, block]`` int64, or a constant fan-in
    layer's ``[3, in_features, out_features, block, 1]``.

    Example:
        >>> extra_state(8, 4, 1, False).tolist(), read_extra_state({"e": extra_state(8, 4, 1, True)}, "e")
        ([2, 8, 4, 1], {'format': 3, 'in_features': 8, 'out_features': 4, 'block': 1, 'constant_fan_in': 1})
    """
    if constant_fan_in:
        return torch.tensor([_FORMAT_FAN_IN, in_features, out_features, block, 1], dtype=torch.int64, device="cpu")
    return torch.tensor([_FORMAT, in_features, out_features, block], dtype=torch.int64, device="cpu")


def layer_prefixes(state_dict: Mapping) -> list[str]:
    """The prefixes under which ``state_dict`` holds a ``SparseLinear`` (its keys ending in ``row_ptr``), sorted.

    Example:
        >>> layer_prefixes({"0.row_ptr": 0, "0.dst": 0, "2.delta.row_ptr": 0, "1.weight": 0})
        ['0.', '2.delta.']
    """
    return sorted({key[: -len(TOPOLOGY_KEYS[0])] for key in state_dict if key.endswith(TOPOLOGY_KEYS[0])})


def read_layer_topology(state_dict: Mapping, prefix: str = "", *, out_features: int | None = None,
                        block: int | None = None) -> CSRTopology | None:
    """The validated topology of the ``SparseLinear`` saved under ``prefix`` in ``state_dict``, None when it has
    neither ``row_ptr`` nor ``dst``; raises ValueError/TypeError naming what is wrong. ``out_features`` serves a
    checkpoint that does not record it; ``block``, when given, is the block the checkpoint must have (a checkpoint
    without one is read with it; else with 1).

    Example:
        >>> from torch_sparse_metal import SparseLinear
        >>> layer = SparseLinear(8, 4, density=0.5)
        >>> read_layer_topology(layer.state_dict()).same_as(layer.topology)
        True
    """
    extra = read_extra_state(state_dict, prefix + "_extra_state")
    present = [name for name in TOPOLOGY_KEYS if prefix + name in state_dict]
    if not present:
        return None
    if len(present) == 1:
        absent = next(name for name in TOPOLOGY_KEYS if name not in present)
        raise ValueError(f"{prefix}{present[0]} comes without {prefix}{absent}: the topology needs both")
    row_ptr = dense_tensor(state_dict, prefix + "row_ptr", floating=False)
    dst = dense_tensor(state_dict, prefix + "dst", floating=False)
    in_features = extra.get("in_features", row_ptr.numel() - 1)
    out_features = extra.get("out_features", out_features)
    if out_features is None:
        raise ValueError(f"{prefix}_extra_state is missing: the checkpoint does not say the layer's out_features")
    # A checkpoint without a block (written before vector layouts existed, or by hand) is read with the layer's: its
    # edges must then form whole vectors of it (from_csr says where they do not).
    saved = extra.get("block", block if block is not None else 1)
    try:  # a block no layer can have is named as such, not as one to build a layer with
        check_block(saved)
    except ValueError as exc:
        raise ValueError(f"the checkpoint's block is invalid: {exc}") from None
    if block is not None and saved != block:
        raise ValueError(f"the checkpoint is of a layer with block={saved} but this layer has block={block}: "
                         f"build the layer with block={saved} to load it")
    topology = CSRTopology.from_csr(row_ptr.cpu(), dst.cpu(), in_features, out_features, block=saved)
    flag = extra.get("constant_fan_in", False)
    if flag not in (0, 1, False, True):
        raise ValueError(f"the checkpoint's constant_fan_in flag must be 0 or 1, got {flag!r}")
    if flag:
        check_constant_fan_in(topology, f"the checkpoint's topology ({prefix}row_ptr, {prefix}dst), saved as constant "
                              "fan-in,")
    return topology


def read_extra_state(state_dict: Mapping, key: str) -> dict:
    """The checkpoint's ``_extra_state`` as a dict of its fields (empty when absent): the tensor
    ``[format, in_features, out_features, block]`` of format 2, ``[3, in_features, out_features, block,
    constant_fan_in]`` of format 3, or the dict of format 1 (earlier versions)."""
    extra = state_dict.get(key, {})
    if isinstance(extra, dict):  # format 1
        if extra.get("format", 1) != 1:
            raise ValueError(f"{key} has format {extra.get('format')!r}; this version reads formats 1 and {_FORMAT}")
        return extra
    if not isinstance(extra, torch.Tensor):
        raise TypeError(f"{key} must be a tensor (or, from earlier versions, a dict), got {type(extra).__name__}")
    if extra.layout != torch.strided or extra.device.type == "meta" or extra.dtype.is_floating_point \
            or extra.dtype.is_complex or extra.dtype == torch.bool or extra.dim() != 1:
        raise TypeError(f"{key} must be a 1-D integer tensor with data, got a {extra.dtype} {extra.layout} tensor of "
                        f"shape {tuple(extra.shape)} on {extra.device}")
    fields = extra.tolist()
    if not fields or fields[0] not in _EXTRA_FIELDS:
        raise ValueError(f"{key} has format {fields[0] if fields else None!r}; this version reads formats 1, "
                         f"{_FORMAT} and {_FORMAT_FAN_IN}")
    names = _EXTRA_FIELDS[fields[0]]
    if len(fields) != len(names):
        raise ValueError(f"{key} of format {fields[0]} must hold [{', '.join(names)}], got {len(fields)} entries")
    return dict(zip(names, fields))


def dense_tensor(state_dict: Mapping, key: str, *, floating: bool) -> torch.Tensor:
    """``state_dict[key]`` if it is a dense tensor with data (not meta, not sparse), else a TypeError naming it."""
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{key} must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.device.type == "meta":
        raise TypeError(f"{key} must be a dense tensor with data, got a {value.layout} tensor on {value.device}")
    if floating and not value.dtype.is_floating_point:
        raise TypeError(f"{key} must be floating point, got {value.dtype}")
    return value
