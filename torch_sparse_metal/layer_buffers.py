"""How a ``SparseLinear`` keeps its topology: in index buffers, with the ``CSRTopology`` over them cached.

Every layer saves its edges as ``row_ptr`` and ``dst`` (element-level: the checkpoint format for every block, and what
torch.distributed.checkpoint writes in place); the kernels' arrays beside them are derived: for block 1 the rest of the
element-level topology (:data:`DERIVED_BUFFERS`), for block V > 1 the topology over vectors (``vector_row_ptr``,
``vector_dst``, ...: ``CSRTopology.vectors``), whose element-level ``src``, ``col_ptr``, ... are derived when read,
not kept. The layer keeps the cache as ``(key, topology)`` in its ``__dict__["_topology"]``, the key being each
index buffer's identity and version counter (:func:`cached_topology`).

The layer's shape record (what :func:`~torch_sparse_metal.layer_format.extra_state` writes as the checkpoint's
``_extra_state``) is also kept as a non-persistent buffer of that name (:func:`record_shape`): tools that set a
checkpoint's entries one at a time as a module's parameters or buffers (accelerate's ``set_module_tensor_to_device``)
find a buffer for every entry, and the layer checks the one they set against itself
(:mod:`torch_sparse_metal.layer_assigned`). ``state_dict()`` still writes the entry through ``get_extra_state``.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .contract import TOPOLOGY_ARGS
from .layer_format import TOPOLOGY_KEYS, extra_state
from .topology import CSRTopology

__all__ = ["DERIVED_BUFFERS", "SHAPE_BUFFER", "cache_topology", "cached_topology", "index_after", "index_buffers",
           "outside_inference", "record_shape", "set_constant_fan_in", "set_topology", "topology_arrays",
           "write_topology"]

DERIVED_BUFFERS = ("src", "col_ptr", "src_by_dst", "perm")
_VECTOR_BUFFERS = tuple(f"vector_{name}" for name in TOPOLOGY_ARGS)
#: The non-persistent buffer holding the layer's shape record (module docstring).
SHAPE_BUFFER = "_extra_state"


def set_topology(layer: nn.Module, topology: CSRTopology) -> None:
    """Register ``topology``'s arrays as the layer's index buffers (new tensors: the old ones are let go) and take
    the layer's ``in_features`` and ``out_features`` from it."""
    if topology.block != layer.block:
        raise ValueError(f"the topology has block {topology.block} but the layer has block {layer.block}")
    layer.in_features, layer.out_features = topology.in_features, topology.out_features
    for name, t in zip(index_buffers(layer), topology_arrays(layer, topology)):
        layer.register_buffer(name, outside_inference(t), persistent=name in TOPOLOGY_KEYS)
    cache_topology(layer)
    record_shape(layer)


def record_shape(layer: nn.Module, keep: torch.Tensor | None = None) -> None:
    """Register the layer's shape record (``[format, in_features, out_features, block]``, int64: what it saves as
    ``_extra_state``) as the non-persistent buffer ``_extra_state``, on its index buffers' device, and note that
    tensor as the layer's own (one set from outside is checked before use: ``layer_assigned.check_shape_buffer``).
    ``keep`` (what ``nn.Module._apply`` made of the record: moved, shared) is kept when it still holds the record."""
    record = extra_state(layer.in_features, layer.out_features, layer.block, layer.constant_fan_in)
    device = layer._buffers["dst"].device
    if (keep is not None and not keep.is_meta and keep.dtype == torch.int64 and keep.device == device
            and torch.equal(keep.cpu(), record)):
        record = keep
    record = outside_inference(record.to(device))
    layer.register_buffer(SHAPE_BUFFER, record, persistent=False)
    layer.__dict__["_own_shape"] = weakref.ref(record)


def set_constant_fan_in(layer: nn.Module, flag: bool) -> None:
    """Declare whether the layer is constant fan-in (its topology was checked by the caller); its shape record
    follows."""
    layer.__dict__["_constant_fan_in"] = bool(flag)
    record_shape(layer)


def index_buffers(layer: nn.Module) -> tuple[str, ...]:
    """The names of every index buffer of the layer: the saved edges and the kernels' arrays (module docstring)."""
    return TOPOLOGY_KEYS + (_VECTOR_BUFFERS if layer.block > 1 else DERIVED_BUFFERS)


def structure_buffers(layer: nn.Module) -> tuple[str, ...]:
    """The buffers that describe the layer rather than hold values: the index buffers and the shape record. They are
    copied, never averaged or cast, where a layer's values are."""
    return index_buffers(layer) + ((SHAPE_BUFFER,) if SHAPE_BUFFER in layer._buffers else ())


def topology_arrays(layer: nn.Module, topology: CSRTopology) -> list[torch.Tensor]:
    """``topology``'s arrays in the order of :func:`index_buffers`."""
    derived = topology.vectors.kernel_args() if layer.block > 1 else [getattr(topology, n) for n in DERIVED_BUFFERS]
    return [topology.row_ptr, topology.dst, *derived]


def write_topology(layer: nn.Module, topology: CSRTopology) -> None:
    """Copy ``topology``'s arrays into the index buffers, which keep their storage (a topology update that keeps
    the edge count, for captured CUDA graphs: ``evolve.apply_update(..., in_place=True)``)."""
    names = index_buffers(layer)
    pairs = [(layer._buffers[name], t) for name, t in zip(names, topology_arrays(layer, topology))]
    if topology.block != layer.block:
        raise ValueError(f"the topology has block {topology.block} but the layer has block {layer.block}")
    if (topology.in_features, topology.out_features) != (layer.in_features, layer.out_features) or any(
            mine.shape != theirs.shape for mine, theirs in pairs):
        raise ValueError(f"an in-place topology write keeps the shape and edge count: the layer is "
                         f"{layer.in_features} -> {layer.out_features} with {layer.dst.numel()} edges, the topology "
                         f"{topology.in_features} -> {topology.out_features} with {topology.nnz}")
    for mine, theirs in pairs:
        mine.copy_(theirs)
    cache_topology(layer)


def cached_topology(layer: nn.Module) -> CSRTopology:
    """:attr:`SparseLinear.topology <torch_sparse_metal.SparseLinear.topology>` (which says how a change that
    bypasses the layer is seen).

    A compiled model runs this only while tracing, and Dynamo does not guard on version counters: there the
    layer's :class:`~torch_sparse_metal._lending.Lending` (a Python flag Dynamo guards on) says whether
    ``row_ptr`` and ``dst`` were handed out (``state_dict()``, ``load_state_dict(assign=True)``) since the
    derived arrays were made; if so the traced call derives them again on the device first.
    """
    lending = layer.__dict__.get("_lending")
    if torch.compiler.is_compiling():  # no cache writes while tracing
        if lending is not None and lending.pending:
            _rederive_on_device(layer)
            lending.settle()
        return _topology_of_buffers(layer)
    buffers = [layer._buffers[name] for name in index_buffers(layer)]
    key = _buffer_key(buffers)
    cached = layer.__dict__.get("_topology")
    if cached is not None and cached[0] == key:
        topology = cached[1]
    elif cached is not None and any(old == new for old, new in zip(cached[0], key)):
        _rederive_topology(layer)  # some index buffers changed without the others: the derived ones are stale
        topology = layer.__dict__["_topology"][1]
    else:
        topology = cache_topology(layer)
    if lending is not None and lending.pending:  # the version counters were just checked: all is consistent
        lending.settle()
    return topology


def cache_topology(layer: nn.Module) -> CSRTopology:
    """Take the index buffers as they are (they were just set together) as the layer's topology; the cached
    topology object is kept when it holds these very buffers (an in-place write)."""
    buffers = [layer._buffers[name] for name in index_buffers(layer)]
    cached = layer.__dict__.get("_topology")
    if cached is not None and all(a is b for a, b in zip(topology_arrays(layer, cached[1]), buffers)):
        topology = cached[1]
    else:
        topology = _topology_of_buffers(layer)
    layer.__dict__["_topology"] = (_buffer_key(buffers), topology)
    return topology


def _rederive_topology(layer: nn.Module) -> None:
    """Rebuild the derived index arrays from ``row_ptr`` and ``dst``, in place (their storage is kept, as
    :func:`write_topology` keeps it), after those were changed behind the layer's back."""
    try:
        fresh = CSRTopology.from_csr(layer.row_ptr.cpu(), layer.dst.cpu(), layer.in_features, layer.out_features,
                                     block=layer.block)
        if fresh.nnz != layer.nnz:
            raise ValueError(f"dst has {fresh.nnz} edges for {layer.nnz} weight values")
        write_topology(layer, fresh.to(layer.weight.device))
    except (ValueError, TypeError) as exc:
        raise RuntimeError(
            "this SparseLinear's row_ptr and dst were changed without the layer (e.g. written in place by "
            "torch.distributed.checkpoint, or a copy_ into state_dict() tensors) and no longer form a topology "
            f"of it: {exc}. Load a checkpoint with load_state_dict(), which checks the topology and loads it "
            "together with the weight") from None


def _rederive_on_device(layer: nn.Module) -> None:
    """Derive the index arrays from ``row_ptr`` and ``dst`` again and write them into their buffers, with device
    ops of sizes known in advance only (no host read; traceable), for a compiled call after the sources were
    lent. It trusts the sources (the eager path validates them; a checkpoint's topology was valid when saved)."""
    row_ptr, dst = layer.row_ptr.long(), layer.dst.long()
    src = torch.repeat_interleave(torch.arange(layer.in_features, device=dst.device), row_ptr[1:] - row_ptr[:-1],
                                  output_size=dst.numel())
    fresh = CSRTopology._derive(layer.in_features, layer.out_features, src, dst, layer.block)
    names = index_buffers(layer)
    for name, array in zip(names[len(TOPOLOGY_KEYS):], topology_arrays(layer, fresh)[len(TOPOLOGY_KEYS):]):
        layer._buffers[name].copy_(array)


def _topology_of_buffers(layer: nn.Module) -> CSRTopology:
    """A new topology over the layer's index buffers as they are (nothing is checked or copied)."""
    arrays = [layer._buffers[name] for name in index_buffers(layer)]
    if layer.block > 1:  # the element-level src, col_ptr, ... are derived from the vectors when read
        vectors = CSRTopology(layer.in_features, layer.out_features // layer.block, *arrays[2:])
        return CSRTopology(layer.in_features, layer.out_features, *arrays[:2], block=layer.block, vectors=vectors)
    return CSRTopology(layer.in_features, layer.out_features, *arrays)


def _buffer_key(buffers: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Each buffer's identity and version counter: what changes when a buffer is replaced or written in place.
    (The cached topology holds the buffers, so their ids are not reused while the key is kept.)"""
    try:
        return tuple((id(b), b._version) for b in buffers)
    except RuntimeError:  # inference tensors keep no version counter; outside inference_mode they cannot be written
        return tuple((id(b), -1 if b.is_inference() else b._version) for b in buffers)


def outside_inference(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it made outside ``torch.inference_mode`` when it was made inside (a topology read from a
    checkpoint, or drawn, under inference_mode): autograd cannot save an inference tensor for backward, so a layer
    keeping one would fail (or, through a view of it, lose the weight's gradient) once it trains."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def index_after(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """An index buffer after ``fn`` of an ``_apply`` turned ``old`` into ``new``: int32 always, and the topology's
    entries wherever ``old`` had them (``new`` is kept only when it holds exactly those, e.g. pinned or shared;
    a cast or ``to_empty`` gets ``old``, moved to ``new``'s device)."""
    if new is old:
        return old
    if old.is_meta or new.is_meta:  # no entries to keep: shapes only (or to_empty of a meta layer)
        return new if new.dtype == old.dtype else torch.empty_like(new, dtype=old.dtype)
    if new.device != old.device:
        return old.to(new.device)
    same = new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
    return new if same else old
