"""``SparseLinear``: a drop-in for ``nn.Linear`` whose weight is an unstructured-sparse CSR matrix."""

from __future__ import annotations

import copy
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._copies import note_copy
from ._lending import Lending
from .contract import DTYPES
from .functional import sparse_linear
from .layer_assigned import check_shape_buffer, mark_unset, take_assigned
from .layer_buffers import (
    DERIVED_BUFFERS,
    SHAPE_BUFFER,
    cached_topology,
    index_after,
    index_buffers,
    record_shape,
    set_constant_fan_in,
    set_topology,
    write_topology,
)
from .layer_format import TOPOLOGY_KEYS, extra_state, read_layer_topology
from .layer_loading import load_from_state_dict, load_state_dict
from .strategy import parse_strategy
from .topology import (
    CSRTopology,
    check_block,
    check_constant_fan_in,
    check_constant_fan_in_option,
    check_generator,
    check_layout,
)

__all__ = ["SparseLinear", "read_layer_topology"]  # read_layer_topology: its home is layer_format


@dataclass(frozen=True)
class _Redraw:
    """How ``reset_parameters`` draws a topology for a layer built from a density whose index buffers hold none:
    uniformly random with the layer's edge count, from ``seed`` (meta construction: reproducible) or, without one,
    from the generator given to ``reset_parameters`` (default: torch's global generator, as ``nn.Linear``)."""

    seed: int | None


#: ``_deferred`` of a layer whose topology was given (not drawn) and is gone: only a checkpoint can restore it.
_GIVEN = "given"
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
            fan-in, Lasby et al. 2024; with ``block`` V, every group of V outputs has that many vectors). The layer
            keeps the property (:attr:`constant_fan_in`): its checkpoint records it, and topology updates
            (``DynamicSparsity``, ``GradualPruning``) then drop and grow per output (per group of V outputs) so that
            every output keeps one in-degree (0 for outputs that neuron ablation removed).

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
        check_constant_fan_in_option(constant_fan_in)
        if torch.empty(0, device=device).device.type == "meta":
            self._build_deferred(in_features, out_features, density, block, bias, backward, dtype, generator,
                                 constant_fan_in)
            return
        topology = CSRTopology.random(in_features, out_features, density, generator=generator, block=block,
                                      constant_fan_in=constant_fan_in)
        self._build(topology, bias, backward, device, dtype)
        set_constant_fan_in(self, constant_fan_in)
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
        set_constant_fan_in(self, constant_fan_in)
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
        set_constant_fan_in(layer, constant_fan_in)
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
        if self.weight.device.type == "meta":  # its tensors may be set one at a time from outside (layer_assigned)
            mark_unset(self)

    # The index buffers and the topology cached over them (layer_buffers): evolve.apply_update replaces or writes
    # them through these too.
    _set_topology = set_topology
    _write_topology = write_topology
    _index_buffers = index_buffers

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
        A compiled model sees such a change too (:func:`torch_sparse_metal.layer_buffers.cached_topology`). A layer
        built on the meta device whose entries were all set from outside (accelerate's big-model loading) takes them
        here (:mod:`torch_sparse_metal.layer_assigned`).
        """
        if self.__dict__.get("_deferred") is not None:
            take_assigned(self, refuse=False)
        return cached_topology(self)

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
        if self.__dict__.get("_deferred") is not None:
            take_assigned(self, refuse=False)  # entries set from outside are the topology to keep
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
        if self.__dict__.get("_deferred") is not None:
            take_assigned(self, refuse=True)
        if self.__dict__.get("_deferred") is not None and self.weight.device.type != "meta":
            raise RuntimeError(f"{what}: {_NO_TOPOLOGY}; call reset_parameters(), or load_state_dict() a checkpoint")
        return self.topology

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.to``, ``.type``, ``.half``, ``to_empty``, ...) for the values; the index buffers
        are no values: they keep int32 and the topology's entries wherever they had them, and move with the weight.
        A layer whose index buffers end up on meta, or come from there, holds no topology until
        ``reset_parameters`` or ``load_state_dict`` gives it one."""
        if self.__dict__.get("_deferred") is not None:
            take_assigned(self, refuse=False)  # entries set from outside move as the layer's topology
        else:
            check_shape_buffer(self)
        if self.__dict__.get("_deferred") is None and not self.dst.is_meta:
            self.topology  # noqa: B018 - derived arrays made stale before the move are rebuilt (or refused) first
        before = {name: self._buffers[name] for name in self._index_buffers()}
        super()._apply(fn, recurse=recurse)
        for name, old in before.items():
            self._buffers[name] = index_after(old, self._buffers[name])
        record_shape(self, keep=self._buffers.get(SHAPE_BUFFER))  # cast or emptied (to_empty): made again
        if self.__dict__.get("_deferred") is None and (before["dst"].is_meta or self.dst.is_meta):
            self.__dict__["_deferred"] = self.__dict__.get("_recipe") or _GIVEN
        if self.__dict__.get("_deferred") is not None:
            mark_unset(self)
        return self

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.__dict__.get("_deferred") is not None:
            take_assigned(self, refuse=True)
        elif not torch.compiler.is_compiling():
            check_shape_buffer(self)
        if self.__dict__.get("_deferred") is not None and self.weight.device.type != "meta":
            raise RuntimeError("this SparseLinear was created on the meta device and its topology was never drawn: "
                               "call reset_parameters() after to_empty(), or load_state_dict() a checkpoint")
        if len(self._forward_pre_hooks) > 1 or "parametrizations" in self._modules:
            _refuse_matrix_wrappings(self)
        if _in_onnx_export():
            raise RuntimeError(_NO_ONNX)
        return sparse_linear(input, self.weight, cached_topology(self), self.bias, backward=self.backward)

    def __setattr__(self, name: str, value: object) -> None:
        """``nn.Module``'s, refusing a ``weight`` of another shape than the layer's values before anything changes
        (:func:`_check_weight_assignment`)."""
        if name == "weight" and isinstance(value, torch.Tensor):
            _check_weight_assignment(self, value)
        super().__setattr__(name, value)

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
        return extra_state(self.in_features, self.out_features, self.block, self.constant_fan_in)

    def set_extra_state(self, state: torch.Tensor | dict) -> None:  # read in _load_from_state_dict
        pass

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        """``nn.Module``'s, noting ``row_ptr`` and ``dst`` as lent: the caller may write them in place
        (``dcp.load``), and a compiled call must then derive the kernels' arrays again (:mod:`._lending`)."""
        if self.__dict__.get("_deferred") is not None:
            take_assigned(self, refuse=False)  # entries set from outside are saved as the layer's
        super()._save_to_state_dict(destination, prefix, keep_vars)
        lent = [destination[prefix + name] for name in TOPOLOGY_KEYS if prefix + name in destination]
        lending = self.__dict__.get("_lending")
        if lent and lending is not None:
            lending.lend(lent, tracked=not any(t is self._buffers[name] for t, name in zip(lent, TOPOLOGY_KEYS)))

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
        state.pop("_own_shape", None)  # weak references (layer_assigned): __setstate__ notes them again
        state.pop("_unset", None)
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
        if SHAPE_BUFFER in self._buffers:
            self.__dict__["_own_shape"] = weakref.ref(self._buffers[SHAPE_BUFFER])
        else:  # pickled by a version that kept no shape record buffer
            record_shape(self)
        if self.__dict__.get("_deferred") is not None:
            mark_unset(self)
        if self.block > 1:  # pickled by a version that kept a vector layer's element-level arrays too
            for name in DERIVED_BUFFERS:
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
        return load_state_dict(self, state_dict, strict, assign, super().load_state_dict)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Values and topology together, checked before anything changes (:mod:`.layer_loading`)."""
        load_from_state_dict(self, super()._load_from_state_dict, state_dict, prefix, local_metadata, strict,
                             missing_keys, unexpected_keys, error_msgs)


def _check_declared_fan_in(topology: CSRTopology, constant_fan_in: object) -> None:
    """A layer declared constant fan-in gets a topology that is (one in-degree for every connected output)."""
    check_constant_fan_in_option(constant_fan_in)
    if constant_fan_in and topology.device.type != "meta":
        check_constant_fan_in(topology)


def _check_weight_assignment(layer: SparseLinear, value: torch.Tensor) -> None:
    """Refuse ``layer.weight = value`` when ``value``'s shape is not that of the layer's weight Parameter (its values,
    one per element-level edge in the topology's order): the layer would keep its topology with values that do not
    fit it, its own values lost, and fail at its next forward. The usual source is a tie: Hugging Face's
    ``tie_weights()`` (which ``from_pretrained``, ``post_init`` and ``resize_token_embeddings`` call) assigns the
    input embeddings' ``[vocab, hidden]`` Parameter to the output layer when the configuration ties them. A weight
    that is not a Parameter of the layer (pruned: ``weight_orig``; parametrized) is its wrapping's business."""
    current = layer.__dict__.get("_parameters", {}).get("weight")
    if current is None or value.shape == current.shape:
        return
    tie = ""
    if value.dim() == 2:
        tie = ("A matrix here usually comes from tied weights: Hugging Face's tie_weights() (called by "
               "from_pretrained, post_init and resize_token_embeddings) gives the output layer the input embeddings' "
               "matrix when the configuration ties them, which a sparse layer cannot share; untie them with "
               "model.config.tie_word_embeddings = False (the layer holds its own values). ")
    raise ValueError(f"SparseLinear.weight holds the layer's {current.shape[0]} edge values (shape "
                     f"{tuple(current.shape)}, one per connection of its topology); it cannot be replaced by a tensor "
                     f"of shape {tuple(value.shape)}. {tie}To give the layer a dense matrix W's values at its "
                     "connections: with torch.no_grad(): layer.weight.copy_(W[layer.dst.long(), layer.src.long()]) "
                     "(or build it with SparseLinear.from_dense). The layer was not changed")


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


for _name in DERIVED_BUFFERS:
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
