"""``SparseLinear``: a drop-in for ``nn.Linear`` whose weight is an unstructured-sparse CSR matrix."""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from ._copies import note_copy
from ._lending import Lending
from ._resize import replace_data
from .contract import DTYPES, TOPOLOGY_ARGS
from .functional import sparse_linear
from .strategy import parse_strategy
from .topology import (
    CSRTopology,
    check_block,
    check_constant_fan_in,
    check_constant_fan_in_option,
    check_generator,
    check_layout,
)

__all__ = ["SparseLinear", "read_layer_topology"]

#: The index buffers. Every layer saves its edges as ``row_ptr`` and ``dst`` (element-level: the checkpoint format for
#: every block, and what torch.distributed.checkpoint writes in place); the kernels' arrays beside them are derived:
#: for block 1 the rest of the element-level topology, for block V > 1 the topology over vectors (vector_row_ptr,
#: vector_dst, ...: CSRTopology.vectors), whose element-level src, col_ptr, ... are derived when read, not kept.
_TOPOLOGY_BUFFERS = ("row_ptr", "dst")
_DERIVED_BUFFERS = ("src", "col_ptr", "src_by_dst", "perm")
_VECTOR_BUFFERS = tuple(f"vector_{name}" for name in TOPOLOGY_ARGS)


@dataclass(frozen=True)
class _Redraw:
    """How ``reset_parameters`` draws a topology for a layer built from a density whose index buffers hold none:
    uniformly random with the layer's edge count, from ``seed`` (meta construction: reproducible) or, without one,
    from the generator given to ``reset_parameters`` (default: torch's global generator, as ``nn.Linear``)."""

    seed: int | None


#: ``_deferred`` of a layer whose topology was given (not drawn) and is gone: only a checkpoint can restore it.
_GIVEN = "given"
#: The checkpoint format ``get_extra_state`` writes: 2 is a tensor ``[2, in, out, block]``; 3 adds a constant fan-in
#: flag, ``[3, in, out, block, 1]``, written only by constant fan-in layers; 1 (a dict) is still read.
_FORMAT = 2
_FORMAT_FAN_IN = 3
_EXTRA_FIELDS = {_FORMAT: ("format", "in_features", "out_features", "block"),
                 _FORMAT_FAN_IN: ("format", "in_features", "out_features", "block", "constant_fan_in")}
_NO_TOPOLOGY = ("this SparseLinear's index buffers hold no topology (it was constructed on the meta device, or moved "
                "there, and materialised with to_empty)")


_NO_ONNX = ("torch.onnx.export cannot export SparseLinear: ONNX has no translation of its op "
            "torch_sparse_metal::csr_linear (neither exporter, dynamo=True or False, knows it). Export a dense copy: "
            "replace each SparseLinear by layer.to_linear(), the nn.Linear computing the same function, before "
            "torch.onnx.export; torch.export and torch.jit.trace record the op itself")


@torch._dynamo.assume_constant_result  # read once while tracing (a compiled model is not retraced per call)
def _in_onnx_export() -> bool:
    """Whether torch.onnx is exporting (either exporter), without importing torch.onnx when nothing did."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


def _off_fused_transformer_kernels(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that does nothing, carried by every SparseLinear. ``nn.TransformerEncoderLayer`` in eval
    mode without grad calls a fused kernel that reads ``linear1.weight`` and ``linear2.weight`` as matrices, unless
    one of its modules has a hook: so a layer holding a SparseLinear, put there by ``sparsify`` or by hand, runs its
    unfused path, which calls the SparseLinear."""


class SparseLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out_features, in_features]`` stored as CSR by input.

    ``weight`` is the 1-D ``Parameter`` of the ``nnz`` stored values, aligned with :meth:`indices`. It is
    initialised like ``nn.Linear`` given each output's actual fan-in: values of edges into output ``o`` are
    uniform in ``±1/sqrt(fan_in(o))``, so outputs have the same scale as a dense layer's. The bias is uniform
    in ``±1/sqrt(fan_in(o))`` as well (``nn.Linear`` uses ``in_features``, which is the dense fan-in).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        density: fraction of the ``in_features * out_features`` connections present, drawn uniformly.
        block: 1 (unstructured, default) or V in ``contract.VECTOR_BLOCKS`` (8, 16, 32): connections are vectors of
            V consecutive outputs sharing one input, drawn uniformly as whole vectors, and the layer runs the vector
            kernels. ``out_features`` must be a multiple of V. ``weight`` stays 1-D with one value per edge (a
            vector's V values are consecutive), and :meth:`indices`, :meth:`to_dense` and :meth:`to_sparse_csr` keep
            their element-level meaning.
        backward: ``"fused_atomic"``, ``"atomic_free"`` or ``"auto"`` (see :mod:`torch_sparse_metal.strategy`).
        device, dtype: as ``nn.Linear``. On the ``meta`` device (or under ``with torch.device("meta")``) nothing
            is drawn: the layer has its shapes only, and ``to_empty(device=...)`` then ``reset_parameters()``
            draws its topology and values, reproducibly (from a seed taken from ``generator`` at construction),
            or ``load_state_dict`` fills it from a checkpoint.
        generator: a CPU ``torch.Generator`` for reproducible topology and initial values.
        constant_fan_in: every output gets the same in-degree ``round(density * in_features)`` (SRigL's constant
            fan-in, Lasby et al. 2024; block 1 only). The layer keeps the property (:attr:`constant_fan_in`): its
            checkpoint records it, and topology updates (``DynamicSparsity``, ``GradualPruning``) then drop and grow
            per output so that every output keeps one in-degree (0 for outputs that neuron ablation removed).

    Example:
        >>> layer = SparseLinear(64, 32, density=0.1, generator=torch.Generator().manual_seed(0))
        >>> layer(torch.randn(4, 10, 64)).shape, layer.nnz
        (torch.Size([4, 10, 32]), 205)
        >>> SparseLinear(64, 32, density=0.25, block=16).nnz  # 32 vectors of 16
        512
    """

    __constants__ = ["in_features", "out_features", "block"]
    in_features: int
    out_features: int
    block: int = 1  # the class default serves modules pickled before vector layouts existed

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        density: float = 0.1,
        block: int = 1,
        backward: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
        constant_fan_in: bool = False,
    ) -> None:
        check_generator(generator)
        check_block(block, out_features if isinstance(out_features, int) else None)
        check_constant_fan_in_option(constant_fan_in, block)
        if torch.empty(0, device=device).device.type == "meta":
            self._build_deferred(in_features, out_features, density, block, bias, backward, dtype, generator,
                                 constant_fan_in)
            return
        topology = CSRTopology.random(in_features, out_features, density, generator=generator, block=block,
                                      constant_fan_in=constant_fan_in)
        self._build(topology, bias, backward, device, dtype)
        self.__dict__["_constant_fan_in"] = constant_fan_in
        self.__dict__["_recipe"] = _Redraw(None)
        self.reset_parameters(generator=generator)

    def _build_deferred(self, in_features: int, out_features: int, density: float, block: int, bias: bool,
                        backward: str, dtype: torch.dtype | None, generator: torch.Generator | None,
                        constant_fan_in: bool = False) -> None:
        """Meta-device construction: index buffers and parameters of the right shapes, no values; the topology is
        drawn by ``reset_parameters`` once the layer is materialised, from a seed taken here."""
        nnz = CSRTopology.random_edge_count(in_features, out_features, density, block=block,
                                            constant_fan_in=constant_fan_in)

        def shapes_only(out: int, edges: int, **fields) -> CSRTopology:
            sizes = (in_features + 1, edges, edges, out + 1, edges, edges)
            return CSRTopology(in_features, out, *(torch.empty(n, device="meta", dtype=torch.int32) for n in sizes),
                               **fields)

        if block > 1:  # the element-level row_ptr and dst beside the vectors (the rest is derived when read)
            vectors = shapes_only(out_features // block, nnz // block)
            row_ptr, dst = (torch.empty(n, device="meta", dtype=torch.int32) for n in (in_features + 1, nnz))
            topology = CSRTopology(in_features, out_features, row_ptr, dst, block=block, vectors=vectors)
        else:
            topology = shapes_only(out_features, nnz)
        self._build(topology, bias, backward, "meta", dtype)
        self.__dict__["_constant_fan_in"] = constant_fan_in
        seed = int(torch.randint(2**62, (1,), generator=generator, device="cpu"))
        self.__dict__["_recipe"] = self.__dict__["_deferred"] = _Redraw(seed)

    @classmethod
    def from_topology(
        cls,
        topology: CSRTopology,
        bias: bool = True,
        *,
        backward: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
        constant_fan_in: bool = False,
    ) -> SparseLinear:
        """A freshly initialised layer with the given connectivity (and its ``block``). ``constant_fan_in=True``
        declares it a constant fan-in layer (:attr:`constant_fan_in`): refused unless every connected output of
        ``topology`` has the same in-degree.

        Example:
            >>> SparseLinear.from_topology(CSRTopology.from_mask(torch.eye(4, dtype=torch.bool))).nnz
            4
        """
        if not isinstance(topology, CSRTopology):
            raise TypeError(f"topology must be a CSRTopology, got {type(topology).__name__}")
        _check_declared_fan_in(topology, constant_fan_in)
        layer = cls.__new__(cls)
        layer._build(topology, bias, backward, device, dtype)
        layer.__dict__["_constant_fan_in"] = constant_fan_in
        layer.reset_parameters(generator=generator)
        return layer

    @classmethod
    def from_dense(cls, linear: nn.Linear, mask: torch.Tensor | None = None, *, block: int = 1,
                   backward: str = "auto") -> SparseLinear:
        """The sparse layer holding ``linear``'s weights where ``mask`` is true (default: its nonzeros). With
        ``block`` V the connections are the vectors that cover the mask (:meth:`CSRTopology.covering`), holding
        ``linear``'s weights in every lane, so the layer computes what ``linear`` masked by the mask computes plus
        the weights of the lanes the covering adds.

        Example:
            >>> dense = nn.Linear(8, 4)
            >>> sparse = SparseLinear.from_dense(dense)
            >>> torch.allclose(sparse.to_dense(), dense.weight)
            True
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_dense expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if mask is None:
            mask = w != 0
        elif mask.shape != w.shape:
            raise ValueError(f"mask must have the weight's shape {tuple(w.shape)}, got {tuple(mask.shape)}")
        mask = mask.to(device="cpu", dtype=torch.bool)
        check_block(block, linear.out_features)
        if block > 1:
            mask = CSRTopology.covering(mask, block)
        topology = CSRTopology.from_mask(mask, block=block)
        layer = cls.__new__(cls)
        layer._build(topology, linear.bias is not None, backward, w.device, w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w[topology.dst.long(), topology.src.long()])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    @classmethod
    def from_sparse(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block: int = 1,
                    backward: str = "auto") -> SparseLinear:
        """The layer whose weight is the sparse ``[out_features, in_features]`` tensor ``weight`` (COO, CSR, CSC
        or BSR): every stored element becomes an edge, explicit zeros included (they are connections that may
        learn). ``bias`` is a dense ``[out_features]`` tensor, or None for no bias. With ``block`` V every stored
        element's vector becomes a connection (the lanes it adds start at 0).

        Example:
            >>> w = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]]).to_sparse_csr()
            >>> layer = SparseLinear.from_sparse(w)
            >>> layer.nnz, layer.to_dense().tolist()
            (3, [[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]])
        """
        if not isinstance(weight, torch.Tensor) or weight.layout == torch.strided:
            kind = weight.layout if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise TypeError(f"from_sparse expects a torch sparse tensor (COO, CSR, CSC or BSR), got {kind}; "
                            "for a dense nn.Linear use SparseLinear.from_dense")
        if weight.dim() != 2 or weight.dense_dim() != 0:
            raise ValueError(f"weight must be a 2-D sparse matrix [out_features, in_features] with scalar values, "
                             f"got shape {tuple(weight.shape)}")
        coo = (weight if weight.layout == torch.sparse_coo else weight.to_sparse_coo()).coalesce()
        out_features, in_features = coo.shape
        check_block(block, out_features)
        indices = coo.indices().cpu()
        if block > 1:  # the vectors holding the stored elements; each element lands on its own edge
            keys = torch.unique(indices[1] * (out_features // block) + indices[0] // block)
            vectors = CSRTopology.from_edges(keys // (out_features // block), keys % (out_features // block),
                                             in_features, out_features // block, sort=False)
            topology = CSRTopology.from_vectors(vectors, block)
            order = torch.searchsorted(topology.edge_keys(), indices[1] * out_features + indices[0])
        else:
            topology, order = CSRTopology.from_indices(indices, in_features, out_features)
        layer = cls.__new__(cls)
        layer._build(topology, bias is not None, backward, coo.device, coo.dtype)
        with torch.no_grad():
            if block > 1:
                layer.weight.zero_()
                layer.weight[order.to(coo.device)] = coo.values()
            else:
                layer.weight.copy_(coo.values()[order.to(coo.device)])
            if bias is not None:
                if bias.shape != (out_features,):
                    raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
                layer.bias.copy_(bias)
        return layer

    def _build(self, topology: CSRTopology, bias: bool, backward: str, device, dtype) -> None:
        check_layout(topology)
        super().__init__()
        self.register_forward_pre_hook(_off_fused_transformer_kernels)
        # _deferred: None while the index buffers hold the topology, else how reset_parameters gets one (_Redraw,
        # a CPU CSRTopology, or _GIVEN: only a checkpoint). _recipe: what _deferred becomes if the topology is lost
        # (the layer moved to meta): a _Redraw for layers built from a density, None for a given topology.
        self.__dict__["_deferred"] = None
        self.__dict__["_recipe"] = None
        self.__dict__["_lending"] = Lending()  # row_ptr and dst held outside the layer (a compiled call reads it)
        factory = {"device": device, "dtype": dtype}
        if dtype is not None and dtype not in DTYPES:  # a layer no kernel can run would fail only at forward
            raise TypeError(f"dtype {dtype} is not supported (supported: {', '.join(str(d) for d in DTYPES)})")
        self.backward = parse_strategy(backward)
        self.block = topology.block
        self.weight = nn.Parameter(torch.empty(topology.nnz, **factory))
        self.bias = nn.Parameter(torch.empty(topology.out_features, **factory)) if bias else None
        if self.weight.device.type == "meta":  # the layer holds shapes only; the topology is kept for reset_parameters
            self.__dict__["_deferred"] = topology.to("cpu") if topology.device.type != "meta" else _GIVEN
        elif topology.device.type == "meta":
            raise ValueError("topology is on the meta device and has no edges to give a layer with data; build the "
                             "layer on the meta device too, or from a topology with data")
        self._set_topology(topology.to(self.weight.device))

    def _set_topology(self, topology: CSRTopology) -> None:
        if topology.block != self.block:
            raise ValueError(f"the topology has block {topology.block} but the layer has block {self.block}")
        self.in_features, self.out_features = topology.in_features, topology.out_features
        for name, t in zip(self._index_buffers(), self._topology_arrays(topology)):
            self.register_buffer(name, _outside_inference(t), persistent=name in _TOPOLOGY_BUFFERS)
        self._cache_topology()

    def _index_buffers(self) -> tuple[str, ...]:
        """The names of every index buffer of the layer: the saved edges and the kernels' arrays (module comment)."""
        return _TOPOLOGY_BUFFERS + (_VECTOR_BUFFERS if self.block > 1 else _DERIVED_BUFFERS)

    def _topology_arrays(self, topology: CSRTopology) -> list[torch.Tensor]:
        """``topology``'s arrays in the order of :meth:`_index_buffers`."""
        derived = topology.vectors.kernel_args() if self.block > 1 else [getattr(topology, n) for n in _DERIVED_BUFFERS]
        return [topology.row_ptr, topology.dst, *derived]

    def _write_topology(self, topology: CSRTopology) -> None:
        """Copy ``topology``'s arrays into the index buffers, which keep their storage (a topology update that keeps
        the edge count, for captured CUDA graphs: ``evolve.apply_update(..., in_place=True)``)."""
        names = self._index_buffers()
        pairs = [(self._buffers[name], t) for name, t in zip(names, self._topology_arrays(topology))]
        if topology.block != self.block:
            raise ValueError(f"the topology has block {topology.block} but the layer has block {self.block}")
        if (topology.in_features, topology.out_features) != (self.in_features, self.out_features) or any(
                mine.shape != theirs.shape for mine, theirs in pairs):
            raise ValueError(f"an in-place topology write keeps the shape and edge count: the layer is "
                             f"{self.in_features} -> {self.out_features} with {self.dst.numel()} edges, the topology "
                             f"{topology.in_features} -> {topology.out_features} with {topology.nnz}")
        for mine, theirs in pairs:
            mine.copy_(theirs)
        self._cache_topology()

    # --------------------------------------------------------------------------------------------- behaviour
    @property
    def topology(self) -> CSRTopology:
        """The layer's connectivity (shares the layer's index buffers; nothing is copied).

        The index buffers are cached as a topology together with each buffer's identity and version counter, so a
        change that bypasses the layer is seen at the next call without reading any values: when every index
        buffer was replaced or written (``.to()``, a topology update, ``DistributedDataParallel`` broadcasting all
        of them) the buffers are taken as they are; when only some were (``torch.distributed.checkpoint`` or a
        ``copy_`` into ``state_dict()`` tensors writes ``row_ptr`` and ``dst`` alone), the derived arrays are
        rebuilt from ``row_ptr`` and ``dst``, or the call raises if those no longer form a topology of the layer.

        A compiled model runs this only while tracing, and Dynamo does not guard on version counters: there the
        layer's :class:`~torch_sparse_metal._lending.Lending` (a Python flag Dynamo guards on) says whether
        ``row_ptr`` and ``dst`` were handed out (``state_dict()``, ``load_state_dict(assign=True)``) since the
        derived arrays were made; if so the traced call derives them again on the device first.
        """
        lending = self.__dict__.get("_lending")
        if torch.compiler.is_compiling():  # no cache writes while tracing
            if lending is not None and lending.pending:
                self._rederive_on_device()
                lending.settle()
            return self._topology_of_buffers()
        buffers = [self._buffers[name] for name in self._index_buffers()]
        key = _buffer_key(buffers)
        cached = self.__dict__.get("_topology")
        if cached is not None and cached[0] == key:
            topology = cached[1]
        elif cached is not None and any(old == new for old, new in zip(cached[0], key)):
            self._rederive_topology()  # some index buffers changed without the others: the derived ones are stale
            topology = self.__dict__["_topology"][1]
        else:
            topology = self._cache_topology()
        if lending is not None and lending.pending:  # the version counters were just checked: all is consistent
            lending.settle()
        return topology

    def _cache_topology(self) -> CSRTopology:
        """Take the index buffers as they are (they were just set together) as the layer's topology; the cached
        topology object is kept when it holds these very buffers (an in-place write)."""
        buffers = [self._buffers[name] for name in self._index_buffers()]
        cached = self.__dict__.get("_topology")
        if cached is not None and all(a is b for a, b in zip(self._topology_arrays(cached[1]), buffers)):
            topology = cached[1]
        else:
            topology = self._topology_of_buffers()
        self.__dict__["_topology"] = (_buffer_key(buffers), topology)
        return topology

    def _rederive_topology(self) -> None:
        """Rebuild the derived index arrays from ``row_ptr`` and ``dst``, in place (their storage is kept, as
        :meth:`_write_topology` keeps it), after those were changed behind the layer's back."""
        try:
            fresh = CSRTopology.from_csr(self.row_ptr.cpu(), self.dst.cpu(), self.in_features, self.out_features,
                                         block=self.block)
            if fresh.nnz != self.nnz:
                raise ValueError(f"dst has {fresh.nnz} edges for {self.nnz} weight values")
            self._write_topology(fresh.to(self.weight.device))
        except (ValueError, TypeError) as exc:
            raise RuntimeError(
                "this SparseLinear's row_ptr and dst were changed without the layer (e.g. written in place by "
                "torch.distributed.checkpoint, or a copy_ into state_dict() tensors) and no longer form a topology "
                f"of it: {exc}. Load a checkpoint with load_state_dict(), which checks the topology and loads it "
                "together with the weight") from None

    def _rederive_on_device(self) -> None:
        """Derive the index arrays from ``row_ptr`` and ``dst`` again and write them into their buffers, with device
        ops of sizes known in advance only (no host read; traceable), for a compiled call after the sources were
        lent. It trusts the sources (the eager path validates them; a checkpoint's topology was valid when saved)."""
        row_ptr, dst = self.row_ptr.long(), self.dst.long()
        src = torch.repeat_interleave(torch.arange(self.in_features, device=dst.device), row_ptr[1:] - row_ptr[:-1],
                                      output_size=dst.numel())
        fresh = CSRTopology._derive(self.in_features, self.out_features, src, dst, self.block)
        names = self._index_buffers()
        for name, array in zip(names[len(_TOPOLOGY_BUFFERS):], self._topology_arrays(fresh)[len(_TOPOLOGY_BUFFERS):]):
            self._buffers[name].copy_(array)

    def _topology_of_buffers(self) -> CSRTopology:
        arrays = [self._buffers[name] for name in self._index_buffers()]
        if self.block > 1:  # the element-level src, col_ptr, ... are derived from the vectors when read
            vectors = CSRTopology(self.in_features, self.out_features // self.block, *arrays[2:])
            return CSRTopology(self.in_features, self.out_features, *arrays[:2], block=self.block, vectors=vectors)
        return CSRTopology(self.in_features, self.out_features, *arrays)

    @property
    def nnz(self) -> int:
        """Number of stored weights (edges)."""
        return self.weight.shape[0]

    @property
    def density(self) -> float:
        """``nnz / (in_features * out_features)``."""
        return self.topology.density

    def fan_in(self) -> torch.Tensor:
        """Number of edges into each output, ``[out_features]`` int64."""
        return self._require_topology("fan_in()").fan_in()

    @property
    def constant_fan_in(self) -> bool:
        """Whether the layer keeps every output's in-degree equal (SRigL's constant fan-in): built so
        (``constant_fan_in=True``, ``sparsify(..., constant_fan_in=True)``) or loaded from such a checkpoint.
        Topology updates then keep it: every output with inputs has the same number of them.

        Example:
            >>> layer = SparseLinear(32, 8, density=0.25, constant_fan_in=True)
            >>> layer.constant_fan_in, layer.fan_in().tolist()
            (True, [8, 8, 8, 8, 8, 8, 8, 8])
        """
        return self.__dict__.get("_constant_fan_in", False)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-draw weights and bias with ``nn.Linear``'s output scale, given each output's actual fan-in.

        The topology is kept: it is not a parameter (``to_empty`` keeps it too). A layer whose index buffers hold no
        topology (constructed on the meta device, or moved there, then materialised with ``to_empty``) gets one here
        first: the one it was built from (``from_topology`` on meta), or, for a layer built from a density, a
        uniformly random one with its edge count, from its construction seed when constructed on meta (``generator``,
        if given, then draws the values), else from ``generator``. A layer whose given topology was lost raises: only
        ``load_state_dict`` can restore it. On meta it does nothing.

        Example:
            >>> layer = SparseLinear(16, 8, density=0.25, device="meta")
            >>> layer = layer.to_empty(device="cpu")
            >>> layer.reset_parameters()
            >>> layer(torch.randn(2, 16)).shape
            torch.Size([2, 8])
        """
        if self.weight.device.type == "meta":
            return
        if self.__dict__.get("_deferred") is not None:
            generator = self._restore_topology(generator)
        bound = self.fan_in().clamp(min=1).double().rsqrt().to(device="cpu")  # per output
        with torch.no_grad():
            u = torch.rand(self.nnz, generator=generator, dtype=torch.float64) * 2 - 1
            self.weight.copy_(u * bound[self.topology.dst.long().cpu()])
            if self.bias is not None:
                ub = torch.rand(self.out_features, generator=generator, dtype=torch.float64) * 2 - 1
                self.bias.copy_(ub * bound)

    def _restore_topology(self, generator: torch.Generator | None) -> torch.Generator | None:
        """Give a layer whose index buffers hold no topology one (see :meth:`reset_parameters`); returns the
        generator that draws the values."""
        deferred = self.__dict__["_deferred"]
        if isinstance(deferred, CSRTopology):
            topology = deferred
        elif isinstance(deferred, _Redraw):
            drawn = torch.Generator().manual_seed(deferred.seed) if deferred.seed is not None else generator
            total = self.in_features * self.out_features
            density = self.nnz / total if total else 0.0  # round(density * total) == nnz: the weight's size
            topology = CSRTopology.random(self.in_features, self.out_features, density, generator=drawn,
                                          block=self.block, constant_fan_in=self.constant_fan_in)
            generator = generator if generator is not None else drawn
        else:
            raise RuntimeError(_NO_TOPOLOGY + ", and it was given (a topology, a dense or sparse weight), not drawn "
                               "from a density, so reset_parameters cannot draw it: load_state_dict a checkpoint")
        self._set_topology(topology.to(self.weight.device))
        self.__dict__["_deferred"] = None
        return generator

    def _require_topology(self, what: str) -> CSRTopology:
        """The layer's topology, for ``what``; raises if the layer holds none."""
        if self.__dict__.get("_deferred") is not None and self.weight.device.type != "meta":
            raise RuntimeError(f"{what}: {_NO_TOPOLOGY}; call reset_parameters(), or load_state_dict() a checkpoint")
        return self.topology

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.to``, ``.type``, ``.half``, ``to_empty``, ...) for the values; the index buffers
        are no values: they keep int32 and the topology's entries wherever they had them, and move with the weight.
        A layer whose index buffers end up on meta, or come from there, holds no topology until
        ``reset_parameters`` or ``load_state_dict`` gives it one."""
        if self.__dict__.get("_deferred") is None and not self.dst.is_meta:
            self.topology  # noqa: B018 - derived arrays made stale before the move are rebuilt (or refused) first
        before = {name: self._buffers[name] for name in self._index_buffers()}
        super()._apply(fn, recurse=recurse)
        for name, old in before.items():
            self._buffers[name] = _index_after(old, self._buffers[name])
        if self.__dict__.get("_deferred") is None and (before["dst"].is_meta or self.dst.is_meta):
            self.__dict__["_deferred"] = self.__dict__.get("_recipe") or _GIVEN
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.__dict__.get("_deferred") is not None and self.weight.device.type != "meta":
            raise RuntimeError("this SparseLinear was created on the meta device and its topology was never drawn: "
                               "call reset_parameters() after to_empty(), or load_state_dict() a checkpoint")
        if len(self._forward_pre_hooks) > 1 or "parametrizations" in self._modules:
            _refuse_matrix_wrappings(self)
        if _in_onnx_export():
            raise RuntimeError(_NO_ONNX)
        return sparse_linear(input, self.weight, self.topology, self.bias, backward=self.backward)

    def indices(self) -> torch.Tensor:
        """``[2, nnz]`` int64: row 0 output index, row 1 input index, aligned with ``weight``."""
        return self._require_topology("indices()").indices()

    def to_sparse_csr(self) -> torch.Tensor:
        """The weight as a torch sparse CSR tensor ``[out_features, in_features]`` (differentiable with respect to
        ``weight``)."""
        return self._require_topology("to_sparse_csr()").to_sparse_csr(self.weight)

    def to_linear(self) -> nn.Linear:
        """A dense ``nn.Linear`` computing the same function (zeros where there is no edge).

        Example:
            >>> layer = SparseLinear(8, 4, density=0.5)
            >>> x = torch.randn(2, 8)
            >>> torch.allclose(layer.to_linear()(x), layer(x), atol=1e-6)
            True
        """
        self._require_topology("to_linear()")
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.weight.device,
                          dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(self.to_dense())
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    def init_weight_(self, init: Callable[..., torch.Tensor], *args, **kwargs) -> SparseLinear:
        """Set the edge values with a ``torch.nn.init`` function (or any in-place initialiser of a 2-D tensor):
        it fills a dense ``[out_features, in_features]`` tensor, and each edge keeps its entry. Dense-fan-in rules
        (``kaiming_*``, ``xavier_*``) then give outputs about ``density`` times as large as a dense layer's;
        :meth:`reset_parameters` scales by each output's actual fan-in instead. Returns the layer.

        Example:
            >>> layer = SparseLinear(16, 8, density=0.5).init_weight_(torch.nn.init.kaiming_uniform_, a=5 ** 0.5)
            >>> layer.weight.shape
            torch.Size([64])
        """
        topology = self._require_topology("init_weight_()")
        dense = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        init(dense, *args, **kwargs)
        with torch.no_grad():
            self.weight.copy_(dense[topology.dst.long(), topology.src.long()])
        return self

    def to_dense(self) -> torch.Tensor:
        """The dense ``[out_features, in_features]`` weight (differentiable with respect to ``weight``)."""
        topology = self._require_topology("to_dense()")
        dense = self.weight.new_zeros(self.out_features, self.in_features)
        return dense.index_put((topology.dst.long(), topology.src.long()), self.weight)

    def extra_repr(self) -> str:
        block = f", block={self.block}" if self.block > 1 else ""
        block += ", constant_fan_in=True" if self.constant_fan_in else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}, "
                f"density={self.density:.4g}{block}, bias={self.bias is not None}, backward={self.backward.value!r}")

    # --------------------------------------------------------------------------------------------- checkpoints
    def get_extra_state(self) -> torch.Tensor:
        """The layer's shape as a tensor (``[format, in_features, out_features, block]`` int64; a constant fan-in
        layer's ``[3, in_features, out_features, block, 1]``), so that every ``state_dict()`` entry is a tensor, as
        safetensors, Hugging Face and distributed checkpoints require."""
        if self.constant_fan_in:
            return torch.tensor([_FORMAT_FAN_IN, self.in_features, self.out_features, self.block, 1],
                                dtype=torch.int64)
        return torch.tensor([_FORMAT, self.in_features, self.out_features, self.block], dtype=torch.int64)

    def set_extra_state(self, state: torch.Tensor | dict) -> None:  # read in _load_from_state_dict
        pass

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        """``nn.Module``'s, noting ``row_ptr`` and ``dst`` as lent: the caller may write them in place
        (``dcp.load``), and a compiled call must then derive the kernels' arrays again (:mod:`._lending`)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        lent = [destination[prefix + name] for name in _TOPOLOGY_BUFFERS if prefix + name in destination]
        lending = self.__dict__.get("_lending")
        if lent and lending is not None:
            lending.lend(lent, tracked=not any(t is self._buffers[name] for t, name in zip(lent, _TOPOLOGY_BUFFERS)))

    def __prepare_scriptable__(self) -> SparseLinear:
        raise TypeError("torch.jit.script cannot compile SparseLinear (its forward calls a custom op through Python "
                        "code TorchScript does not support); record the model with torch.jit.trace or torch.export "
                        "instead, which capture the torch_sparse_metal::csr_linear op")

    def __getstate__(self) -> dict:
        """Pickle state of plain values only, so that ``torch.load(weights_only=True)`` of a pickled model needs just
        the module classes allow-listed: the strategy as its name, the construction recipe as a tuple, the cached
        topology and the layer's own forward pre-hook left out (``__setstate__`` restores them)."""
        state = super().__getstate__().copy()
        state.pop("_topology", None)
        state.pop("_lending", None)  # follows tensors of this process: a copy starts with none lent
        state["backward"] = self.backward.value
        state["_forward_pre_hooks"] = OrderedDict(
            (k, h) for k, h in self._forward_pre_hooks.items() if h is not _off_fused_transformer_kernels)
        for key in ("_deferred", "_recipe"):
            value = state.get(key)
            if isinstance(value, _Redraw):
                state[key] = ("redraw", value.seed)
            elif isinstance(value, CSRTopology):
                state[key] = ("topology", value.in_features, value.out_features, value.block, value.row_ptr, value.dst)
        return state

    def __deepcopy__(self, memo: dict) -> SparseLinear:
        """What ``copy.deepcopy`` does by default (``__getstate__``, a deep copy of it, ``__setstate__``), and the
        copy noted as one of this layer's (``_copies``): a topology update finds the copies whose per-edge values
        it must remap or refuse, such as those of ``torch.optim.swa_utils.AveragedModel``."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        note_copy(self, new)
        return new

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        if isinstance(state.get("backward"), str):
            state["backward"] = parse_strategy(state["backward"])
        for key in ("_deferred", "_recipe"):
            value = state.get(key)
            if isinstance(value, tuple) and value[0] == "redraw":
                state[key] = _Redraw(value[1])
            elif isinstance(value, tuple) and value[0] == "topology":
                state[key] = CSRTopology.from_csr(value[4], value[5], value[1], value[2], block=value[3])
        super().__setstate__(state)
        self.__dict__["_lending"] = Lending()
        if self.block > 1:  # pickled by a version that kept a vector layer's element-level arrays too
            for name in _DERIVED_BUFFERS:
                self._buffers.pop(name, None)
        if _off_fused_transformer_kernels not in self._forward_pre_hooks.values():
            self.register_forward_pre_hook(_off_fused_transformer_kernels, prepend=True)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, all or nothing: with ``strict``, unexpected or missing keys raise
        before anything is loaded (``nn.Module`` loads, then raises); a malformed entry raises and leaves the
        layer unchanged either way. (Inside a larger model, the model's ``load_state_dict`` applies torch's rule.)

        With ``strict=False`` what the checkpoint holds is loaded and what it lacks is reported and kept: without
        ``bias``, the weight and topology load and the bias stays; without ``row_ptr`` and ``dst``, the weight
        loads onto the layer's own topology if it has one value per edge of it (else it raises). Entries that only
        make sense together raise when one comes alone (``row_ptr`` without ``dst``; a topology of other edges
        without ``weight``). ``assign=True`` (e.g. onto a layer built on the meta device) gives the layer the
        checkpoint's tensors, as ``nn.Module`` does.

        Example:
            >>> trained = SparseLinear(8, 4, density=0.5)
            >>> with torch.device("meta"):
            ...     layer = SparseLinear(8, 4, density=0.5)
            >>> layer.load_state_dict(trained.state_dict(), assign=True)
            <All keys matched successfully>
            >>> layer.weight.data_ptr() == trained.weight.data_ptr()  # the checkpoint's tensor, not a copy
            True
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        state_dict, reported = self._run_load_pre_hooks(state_dict, assign)
        odd = [key for key in state_dict if not isinstance(key, str)]
        if odd:
            raise TypeError(f"state_dict keys must be strings, got {odd[0]!r} (nothing was loaded)")
        missing, unexpected, errors = reported
        if strict:
            expected = set(self.state_dict())
            unexpected = sorted({*unexpected, *(set(state_dict) - expected)})
            missing = sorted({*missing, *(expected - set(state_dict))})
        if errors or (strict and (unexpected or missing)):  # torch's wording, said before loading
            lines = [f"{kind} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + "."
                     for kind, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys and strict]
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__} (nothing was loaded):"
                               "\n\t" + "\n\t".join(lines + errors))
        if next(self.children(), None) is not None or _other_entries(self):  # loaded after the layer's own entries
            try:
                _check_other_entries(self, state_dict, _plan_load(self, state_dict, "", assign))
            except (ValueError, TypeError) as exc:
                raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__} (nothing was loaded):"
                                   f"\n\t{exc}") from None
        hooks, self._load_state_dict_pre_hooks = self._load_state_dict_pre_hooks, OrderedDict()  # they ran above
        try:
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self._load_state_dict_pre_hooks = hooks
        result.missing_keys.extend(key for key in reported[0] if key not in result.missing_keys)
        result.unexpected_keys.extend(key for key in reported[1] if key not in result.unexpected_keys)
        return result

    def _run_load_pre_hooks(self, state_dict: Mapping, assign: bool
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
        if self._load_state_dict_pre_hooks:
            local_metadata = {} if metadata is None else metadata.get("", {})
            if assign:
                local_metadata["assign_to_params_buffers"] = assign
            for hook in self._load_state_dict_pre_hooks.values():
                hook(state_dict, "", local_metadata, True, *reported)
        return state_dict, reported

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Load values and topology together; a checkpoint with another topology turns this layer into that
        layer. The layer's entries are validated against each other before anything changes, so a malformed
        checkpoint leaves the layer as it was (the error is reported by ``load_state_dict``); then the layer takes
        the checkpoint's shapes and torch's own loader copies (or assigns) every entry and reports missing ones."""
        hooks = self._load_state_dict_pre_hooks  # run here, before the checkpoint is read, and not again below
        for hook in hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        try:
            plan = _plan_load(self, state_dict, prefix, assign)
        except (ValueError, TypeError) as exc:
            error_msgs.append(f"{type(self).__name__} at '{prefix}': {exc}")
            return
        self._take_shapes(plan, assign)
        self._load_state_dict_pre_hooks = OrderedDict()
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._load_state_dict_pre_hooks = hooks
        if plan.topology is not None and not (self.weight.device.type == "meta" and not assign):
            self._adopt_topology(plan.topology, [state_dict.get(prefix + name) for name in _TOPOLOGY_BUFFERS])
            self._cache_topology()  # the loader wrote row_ptr and dst alone, with the checked topology's entries
            self.__dict__["_constant_fan_in"] = plan.constant_fan_in
        _refresh_pruned(self)

    def _take_shapes(self, plan: _Load, assign: bool) -> None:
        """Before torch's loader copies: the checkpoint's topology and parameters of its shapes. On meta without
        ``assign`` nothing changes (torch's loader warns that copying into meta is a no-op)."""
        if plan.topology is None or (self.weight.device.type == "meta" and not assign):
            return
        device = plan.weight.device if assign and plan.weight is not None else self.weight.device
        if plan.new_edges or self.dst.device != device:
            self._set_topology(plan.topology.to(device))
        for name, shape in (("weight", (plan.topology.nnz,)), ("bias", (plan.topology.out_features,))):
            key, wrap = _slot(self, name)
            param = self._parameters.get(key) if wrap != "parametrized" else None  # parametrized: same shape
            if param is not None and param.shape != shape:
                with torch.inference_mode(False):  # a load under inference_mode leaves a layer that can train
                    replace_data(param, torch.empty(shape, dtype=param.dtype, device=param.device))
                    if wrap == "pruned":  # the checkpoint has the mask of that shape (_plan_load)
                        mask = self._buffers[f"{name}_mask"]
                        self._buffers[f"{name}_mask"] = torch.empty(shape, dtype=mask.dtype, device=mask.device)
        self.__dict__["_deferred"] = None

    def _adopt_topology(self, topology: CSRTopology, given: list[torch.Tensor | None]) -> None:
        """After torch's loader: index buffers it assigned (``assign=True``; ``given`` holds the checkpoint's
        ``row_ptr`` and ``dst``) keep the checkpoint's storage where they are what the kernels take (int32,
        contiguous, on the weight's device), as aliases: the caller's tensors are then lent (:mod:`._lending`).
        Others are replaced by converted copies, and the derived arrays follow the weight's device."""
        device = self.weight.device
        if any(self._buffers[name].device != device for name in self._index_buffers()):
            self._set_topology(topology.to(device))
        lent = []
        for name, theirs in zip(_TOPOLOGY_BUFFERS, given):
            mine = self._buffers[name]
            if mine.dtype != torch.int32 or not mine.is_contiguous() or mine.device != device or mine.dim() != 1:
                self._buffers[name] = _outside_inference(getattr(topology.to(device), name))
            elif mine is theirs:
                self._buffers[name] = mine.detach()  # shares storage and version counter; the caller's is followed
                lent.append(mine)
        if lent:
            self.__dict__["_lending"].lend(lent, tracked=True)


def _check_declared_fan_in(topology: CSRTopology, constant_fan_in: object) -> None:
    """A layer declared constant fan-in gets a topology that is (block 1, one in-degree for every connected output)."""
    check_constant_fan_in_option(constant_fan_in, topology.block)
    if constant_fan_in and topology.device.type != "meta":
        check_constant_fan_in(topology)


def _element_view(name: str) -> property:
    """``layer.<name>`` for an element-level array that is a buffer of a block-1 layer only: a vector layer derives it
    from its topology when read (module comment), so that the name means the same for every block."""

    def get(self: SparseLinear) -> torch.Tensor:
        buffer = self.__dict__.get("_buffers", {}).get(name)
        if buffer is not None:
            return buffer
        if self.__dict__.get("block", 1) > 1:
            return getattr(self._require_topology(name), name)
        raise AttributeError(name)  # not registered yet: nn.Module.__getattr__ says so

    return property(get, doc=f"The element-level {name} (a buffer for block 1; derived when read for block V > 1).")


for _name in _DERIVED_BUFFERS:
    setattr(SparseLinear, _name, _element_view(_name))


def _refuse_matrix_wrappings(layer: SparseLinear) -> None:
    """Refuse the weight wrappings of ``torch.nn.utils`` that treat the weight as a matrix: on the 1-D vector of edge
    values they would compute something else than on the equivalent ``nn.Linear`` (per-edge norms instead of
    per-output ones, a Frobenius norm instead of the largest singular value)."""
    from torch.nn.utils.parametrizations import _SpectralNorm, _WeightNorm
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    wrappings = list(layer._forward_pre_hooks.values())
    if "parametrizations" in layer._modules:
        wrappings += [p for plist in layer.parametrizations.values() for p in plist]
    for wrapping in wrappings:
        if isinstance(wrapping, (SpectralNorm, _SpectralNorm)):
            what = "spectral_norm"
        elif isinstance(wrapping, (WeightNorm, _WeightNorm)) and wrapping.dim != -1:
            what = f"weight_norm with dim={wrapping.dim}"
        else:
            continue
        undo = ("torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')"
                if isinstance(wrapping, nn.Module) else f"torch.nn.utils.remove_{what.split()[0]}(layer)")
        raise RuntimeError(
            f"{what} on a SparseLinear would normalise its 1-D vector of edge values, not the "
            f"[out_features, in_features] matrix nn.Linear normalises, and compute something else; remove it ({undo}). "
            "weight_norm(layer, dim=None) (one norm over all weights) means the same on both and is accepted")


def _buffer_key(buffers: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """Each buffer's identity and version counter: what changes when a buffer is replaced or written in place.
    (The cached topology holds the buffers, so their ids are not reused while the key is kept.)"""
    try:
        return tuple((id(b), b._version) for b in buffers)
    except RuntimeError:  # inference tensors keep no version counter; outside inference_mode they cannot be written
        return tuple((id(b), -1 if b.is_inference() else b._version) for b in buffers)


def _outside_inference(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it made outside ``torch.inference_mode`` when it was made inside (a topology read from a
    checkpoint, or drawn, under inference_mode): autograd cannot save an inference tensor for backward, so a layer
    keeping one would fail (or, through a view of it, lose the weight's gradient) once it trains."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def _index_after(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
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


def _plan_load(layer: SparseLinear, state_dict: Mapping, prefix: str, assign: bool) -> _Load:
    """The layer's entries of ``state_dict``, validated against each other and the layer without changing it;
    raises ValueError/TypeError naming the problem."""
    topology = read_layer_topology(state_dict, prefix, out_features=layer.out_features, block=layer.block)
    constant_fan_in = layer.constant_fan_in
    if topology is not None:
        saved = _read_extra_state(state_dict, prefix + "_extra_state")
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


def _check_resizable(layer: SparseLinear, prefix: str, name: str, size: int, now: int) -> None:
    """A parameter that is a tensor subclass (a DTensor shard of FSDP2's ``fully_shard``, say) cannot be given
    another size here: refused before anything changes."""
    param = layer._parameters.get(name)
    if param is None or type(param.data) is torch.Tensor:
        return
    raise ValueError(f"{prefix}{name} is a {type(param.data).__name__} (e.g. sharded by FSDP2's fully_shard), and the "
                     f"checkpoint's topology would change its size from {now} to {size}, which sharded parameters "
                     "cannot do in place: load the checkpoint into the model before sharding it (fully_shard after "
                     "load_state_dict), or build the model with the checkpoint's topology")


def _check_wrapped_resize(layer: SparseLinear, state_dict: Mapping, prefix: str, name: str, size: int, now: int
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


def read_layer_topology(state_dict: Mapping, prefix: str = "", *, out_features: int | None = None,
                        block: int | None = None) -> CSRTopology | None:
    """The validated topology of the ``SparseLinear`` saved under ``prefix`` in ``state_dict``, None when it has
    neither ``row_ptr`` nor ``dst``; raises ValueError/TypeError naming what is wrong. ``out_features`` serves a
    checkpoint that does not record it; ``block``, when given, is the block the checkpoint must have (a checkpoint
    without one is read with it; else with 1).

    Example:
        >>> layer = SparseLinear(8, 4, density=0.5)
        >>> read_layer_topology(layer.state_dict()).same_as(layer.topology)
        True
    """
    extra = _read_extra_state(state_dict, prefix + "_extra_state")
    present = [name for name in _TOPOLOGY_BUFFERS if prefix + name in state_dict]
    if not present:
        return None
    if len(present) == 1:
        absent = next(name for name in _TOPOLOGY_BUFFERS if name not in present)
        raise ValueError(f"{prefix}{present[0]} comes without {prefix}{absent}: the topology needs both")
    row_ptr = _dense_tensor(state_dict, prefix + "row_ptr", floating=False)
    dst = _dense_tensor(state_dict, prefix + "dst", floating=False)
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
        try:
            check_constant_fan_in_option(True, saved)
        except ValueError as exc:
            raise ValueError(f"the checkpoint's constant_fan_in is invalid: {exc}") from None
        check_constant_fan_in(topology, f"the checkpoint's topology ({prefix}row_ptr, {prefix}dst), saved as constant "
                              "fan-in,")
    return topology


def _read_extra_state(state_dict: Mapping, key: str) -> dict:
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


def _read_values(layer: SparseLinear, state_dict: Mapping, prefix: str, name: str, size: int, placed: bool
                 ) -> torch.Tensor | None:
    """The checkpoint's values of ``name`` (wherever a wrapping keeps them), checked to have ``size`` entries;
    None when absent. ``placed``: the size comes from the checkpoint's topology (else from the layer's)."""
    suffix, _ = _slot(layer, name)
    if suffix is None or prefix + suffix not in state_dict:
        return None
    value = _dense_tensor(state_dict, prefix + suffix, floating=True)
    if value.shape != (size,):
        if name == "bias":
            raise ValueError(f"{suffix} must have shape ({size},), got {tuple(value.shape)}")
        where = ("the checkpoint's topology" if placed else
                 f"the layer's topology, as the checkpoint has none ({prefix}row_ptr, {prefix}dst) to place them")
        raise ValueError(f"{suffix} must have shape ({size},) to match {where}, got {tuple(value.shape)}")
    return value


def _other_entries(layer: SparseLinear) -> dict[str, torch.Tensor]:
    """The layer's state-dict tensors that are not its values or topology: a parametrization's state, a pruning
    mask, buffers a user registered."""
    own = {"weight", "bias", *_TOPOLOGY_BUFFERS, "_extra_state", _slot(layer, "weight")[0], _slot(layer, "bias")[0]}
    return {key: value for key, value in layer.state_dict(keep_vars=True).items()
            if key not in own and isinstance(value, torch.Tensor)}


def _check_other_entries(layer: SparseLinear, state_dict: Mapping, plan: _Load) -> None:
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


def _dense_tensor(state_dict: Mapping, key: str, *, floating: bool) -> torch.Tensor:
    """``state_dict[key]`` if it is a dense tensor with data (not meta, not sparse), else a TypeError naming it."""
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{key} must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.device.type == "meta":
        raise TypeError(f"{key} must be a dense tensor with data, got a {value.layout} tensor on {value.device}")
    if floating and not value.dtype.is_floating_point:
        raise TypeError(f"{key} must be floating point, got {value.dtype}")
    return value
