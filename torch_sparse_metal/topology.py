"""CSR connectivity of a sparse linear layer, validated once and cached with everything kernels need.

Edges are stored by source (input neuron), sorted by (source, destination), without duplicates:
``row_ptr[in_features + 1]`` and ``dst[E]``. A topology of ``block`` V > 1 (the vector layout) connects whole
vectors: V consecutive outputs ``g*V .. g*V+V-1`` (group ``g``) share each input connection. What it holds is
:attr:`CSRTopology.vectors`, the same layer as a topology over vectors (``in_features -> out_features / V``), which
the vector kernels take; its edges are still listed one by one (a vector's V edges are consecutive in that order),
as element-level arrays derived from the vectors when asked for (:func:`element_array`) and not kept, unless given.

That layout is internal: the public convention is PyTorch's, a weight of shape ``[out_features, in_features]``
(:meth:`CSRTopology.from_mask`, :meth:`CSRTopology.from_indices`, :meth:`CSRTopology.indices`,
:meth:`CSRTopology.to_sparse_csr`). The by-destination view used by the gather forward, the per-edge source index,
and int32 copies for the kernels are derived once, at construction.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .contract import INT32_MAX, TOPOLOGY_ARGS, VECTOR_BLOCKS

__all__ = ["BLOCKS", "CSRTopology", "EdgeMap", "element_array", "element_edge_map", "element_index",
           "updated_topology"]

#: The block sizes a layer may have: 1 (unstructured) and the vector lengths of the contract.
BLOCKS = (1, *VECTOR_BLOCKS)


def check_block(block: int, out_features: int | None = None) -> None:
    """``block`` is one of :data:`BLOCKS` and divides ``out_features`` (when given)."""
    if isinstance(block, bool) or not isinstance(block, int) or block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS} (1: unstructured; V > 1: vectors of V consecutive outputs), "
                         f"got {block!r}")
    if out_features is not None and out_features % block:
        raise ValueError(f"out_features={out_features} is not a multiple of block={block}: a vector layout needs whole "
                         f"vectors of {block} outputs; pick a block that divides out_features, or block=1")


def check_layout(topology: CSRTopology) -> None:
    """``topology`` is of a layout the kernels have: its ``block`` passes :func:`check_block`, and a block V > 1 comes
    with its topology over vectors. The builders make only such topologies; the constructor trusts its arguments, so
    a hand-built one is checked here before a layer or a call uses it.

    Example:
        >>> vectors = CSRTopology.from_mask(torch.ones(1, 2, dtype=torch.bool))
        >>> check_layout(CSRTopology(2, 24, block=12, vectors=vectors))
        Traceback (most recent call last):
        ...
        ValueError: the topology has block=12: block must be one of (1, 8, 16, 32) (1: unstructured; \
V > 1: vectors of V consecutive outputs), got 12
    """
    try:
        check_block(topology.block, topology.out_features)
    except ValueError as exc:
        raise ValueError(f"the topology has block={topology.block}: {exc}") from None
    if topology.block > 1 and not isinstance(topology.vectors, CSRTopology):
        raise ValueError(f"a topology of block {topology.block} carries its topology over vectors (vectors); build "
                         "topologies with CSRTopology's builders")


def _check_dims(in_features: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        if value >= INT32_MAX:
            raise ValueError(f"{name}={value} does not fit the int32 indices the kernels use (limit {INT32_MAX})")


@dataclass(frozen=True, eq=False)
class CSRTopology:
    """Which (output, input) pairs of a linear layer are connected, as CSR by source.

    All index tensors are int32 and live on one device. Build one with :meth:`random`, :meth:`from_mask`
    or :meth:`from_edges`; the constructor itself trusts its arguments, the builders validate.

    With ``block`` V > 1 every builder takes (and :meth:`random` draws) whole vectors only: edges come in groups of
    V consecutive outputs ``g*V .. g*V+V-1`` with one input (:meth:`covering` turns any mask into the vectors that
    cover it). Such a topology holds its :attr:`vectors`; an element-level array it was not given is derived from
    them each time it is read (:func:`element_array`), so that a layer keeps one set of index arrays.

    Example:
        >>> topo = CSRTopology.from_edges(torch.tensor([0, 2]), torch.tensor([1, 0]), in_features=3, out_features=2)
        >>> topo.nnz, topo.indices().tolist()
        (2, [[1, 0], [0, 2]])
        >>> CSRTopology.random(64, 32, 0.25, block=16, generator=torch.Generator().manual_seed(0)).vectors.nnz
        32
    """

    in_features: int
    out_features: int
    # The element-level arrays; with block V > 1 each may be left out (None) and is then derived from `vectors`
    # when read (_ElementArray, below the class).
    row_ptr: torch.Tensor | None = None  # [in_features + 1]
    dst: torch.Tensor | None = None  # [E], output index per edge
    src: torch.Tensor | None = None  # [E], input index per edge (derived)
    col_ptr: torch.Tensor | None = None  # [out_features + 1], by-destination CSR (derived)
    src_by_dst: torch.Tensor | None = None  # [E], source at each by-destination position (derived)
    perm: torch.Tensor | None = None  # [E], edge id at each by-destination position (derived)
    block: int = 1  # V: outputs per vector (1: unstructured)
    vectors: CSRTopology | None = None  # block > 1: the layer over vectors, in_features -> out_features / V

    def __post_init__(self) -> None:
        if self.block != 1 and self.vectors is not None:  # arrays not given are read through _ElementArray
            for name in TOPOLOGY_ARGS:
                if self.__dict__.get(name) is None:
                    del self.__dict__[name]

    # ----------------------------------------------------------------------------------------------- builders
    @classmethod
    def from_edges(
        cls,
        src: torch.Tensor,
        dst: torch.Tensor,
        in_features: int,
        out_features: int,
        *,
        sort: bool = True,
        block: int = 1,
    ) -> CSRTopology:
        """Build from parallel lists of input (``src``) and output (``dst``) indices (the internal by-source order;
        :meth:`from_indices` takes PyTorch's ``[out, in]`` convention).

        With ``sort=True`` (default) the edges may come in any order; with ``sort=False`` they must already
        be sorted by (src, dst). Duplicates and out-of-range indices raise ``ValueError`` either way, and so do
        edges that do not form whole vectors of ``block`` outputs.
        """
        _check_dims(in_features, out_features)
        check_block(block, out_features)
        src, dst = _as_index(src, "src"), _as_index(dst, "dst")
        if src.shape != dst.shape:
            raise ValueError(f"src and dst must have the same length, got {src.numel()} and {dst.numel()}")
        if src.numel() > in_features * out_features:
            raise ValueError(
                f"{src.numel()} edges cannot fit a {out_features}x{in_features} layer without duplicates"
            )
        if src.numel() >= INT32_MAX:
            raise ValueError(f"{src.numel()} edges exceed the int32 index limit of the kernels ({INT32_MAX})")
        _check_range(src, in_features, "src", "in_features")
        _check_range(dst, out_features, "dst", "out_features")
        key = src * max(out_features, 1) + dst
        if sort:
            key, order = torch.sort(key)
            src, dst = src[order], dst[order]
        elif src.numel() > 1 and bool((key[1:] < key[:-1]).any()):
            raise ValueError("edges are not sorted by (src, dst); pass sort=True or sort them first")
        if src.numel() > 1 and bool((key[1:] == key[:-1]).any()):
            i = int(torch.nonzero(key[1:] == key[:-1])[0])
            raise ValueError(f"duplicate edge (src={int(src[i])}, dst={int(dst[i])}); every edge may appear once")
        if block > 1:
            _check_whole_vectors(src, dst, block)
        return cls._derive(in_features, out_features, src, dst, block)

    @classmethod
    def from_csr(cls, row_ptr: torch.Tensor, dst: torch.Tensor, in_features: int, out_features: int, *,
                 block: int = 1) -> CSRTopology:
        """Build from CSR-by-source arrays (e.g. a checkpoint), validating them fully. These are CSR of the
        *transposed* weight ``[in_features, out_features]``; for a torch sparse tensor use
        ``SparseLinear.from_sparse`` or :meth:`from_indices`."""
        _check_dims(in_features, out_features)
        row_ptr, dst = _as_index(row_ptr, "row_ptr"), _as_index(dst, "dst")
        if row_ptr.numel() != in_features + 1:
            raise ValueError(f"row_ptr must have in_features + 1 = {in_features + 1} entries, got {row_ptr.numel()}")
        if int(row_ptr[0]) != 0:
            raise ValueError(f"row_ptr must start at 0, got {int(row_ptr[0])}")
        if int(row_ptr[-1]) != dst.numel():
            raise ValueError(f"row_ptr ends at {int(row_ptr[-1])} but there are {dst.numel()} edges (dst)")
        if bool((row_ptr[1:] < row_ptr[:-1]).any()):
            raise ValueError("row_ptr must be non-decreasing")
        counts = row_ptr[1:] - row_ptr[:-1]
        src = torch.repeat_interleave(torch.arange(in_features, device=dst.device), counts)
        return cls.from_edges(src, dst, in_features, out_features, sort=False, block=block)

    @classmethod
    def from_indices(cls, indices: torch.Tensor, in_features: int, out_features: int, *, block: int = 1
                     ) -> tuple[CSRTopology, torch.Tensor]:
        """Build from ``[2, E]`` indices in PyTorch's convention for a ``[out_features, in_features]`` weight
        (row 0 the output index, row 1 the input index, as :meth:`indices` returns and ``torch.sparse`` COO
        tensors hold), in any order. Returns the topology and ``order``: ``values[order]`` aligns values given
        with ``indices`` to the topology's edges.

        Example:
            >>> topo, order = CSRTopology.from_indices(torch.tensor([[1, 0], [0, 2]]), in_features=3, out_features=2)
            >>> topo.indices().tolist(), order.tolist()
            ([[1, 0], [0, 2]], [0, 1])
        """
        if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.shape[0] != 2:
            shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise ValueError(f"indices must be a [2, E] tensor (row 0 output, row 1 input), got {shape}")
        dst, src = _as_index(indices[0], "indices[0] (output)"), _as_index(indices[1], "indices[1] (input)")
        _check_dims(in_features, out_features)
        _check_range(src, in_features, "indices[1] (input)", "in_features")
        _check_range(dst, out_features, "indices[0] (output)", "out_features")
        order = torch.argsort(src * max(out_features, 1) + dst)
        return cls.from_edges(src[order], dst[order], in_features, out_features, sort=False, block=block), order

    def to_sparse_csr(self, values: torch.Tensor) -> torch.Tensor:
        """The ``[out_features, in_features]`` torch sparse CSR tensor with ``values`` (aligned with the edges) at
        the edges: the by-destination arrays are its row pointers and columns.

        Example:
            >>> topo = CSRTopology.from_mask(torch.tensor([[True, False], [True, True]]))
            >>> topo.to_sparse_csr(torch.tensor([1.0, 2.0, 3.0])).to_dense().tolist()
            [[1.0, 0.0], [2.0, 3.0]]
        """
        if values.shape != (self.nnz,):
            raise ValueError(f"values must have shape ({self.nnz},), got {tuple(values.shape)}")
        # The arrays are valid by construction, so the invariant checks are off explicitly (torch warns when they
        # are off implicitly, and torch 2.11 warns even when they are off explicitly); the beta notice is torch's
        # about its CSR support, not about what was asked for.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
            warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
            return torch.sparse_csr_tensor(self.col_ptr.long(), self.src_by_dst.long(), values[self.perm.long()],
                                           size=(self.out_features, self.in_features), check_invariants=False)

    @classmethod
    def from_mask(cls, mask: torch.Tensor, *, block: int = 1) -> CSRTopology:
        """Build from a dense boolean mask shaped like ``nn.Linear.weight``: ``[out_features, in_features]``
        (with ``block`` V, one made of whole vectors: see :meth:`covering`).

        Example:
            >>> CSRTopology.from_mask(torch.eye(3, dtype=torch.bool)).nnz
            3
        """
        _check_mask(mask)
        out_features, in_features = mask.shape
        src_major = mask.t().nonzero()  # row-major over [in, out]: sorted by (src, dst) already
        return cls.from_edges(src_major[:, 0], src_major[:, 1], in_features, out_features, sort=False, block=block)

    @staticmethod
    def covering(mask: torch.Tensor, block: int) -> torch.Tensor:
        """The smallest mask of whole vectors of ``block`` outputs that holds every True of ``mask``
        (``[out_features, in_features]``): vector (group ``g``, input ``i``) is set when any of outputs
        ``g*V .. g*V+V-1`` connects to ``i``.

        Example:
            >>> m = torch.zeros(16, 2, dtype=torch.bool); m[3, 1] = True
            >>> CSRTopology.covering(m, 8)[:, 1].tolist() == [True] * 8 + [False] * 8
            True
        """
        _check_mask(mask)
        check_block(block, mask.shape[0])
        hit = mask.view(mask.shape[0] // block, block, mask.shape[1]).any(dim=1, keepdim=True)
        return hit.expand(-1, block, -1).reshape(mask.shape)

    @classmethod
    def from_vectors(cls, vectors: CSRTopology, block: int) -> CSRTopology:
        """The layer whose connections are the edges of ``vectors`` (a topology ``in_features -> groups``) as
        vectors of ``block`` outputs: ``in_features -> groups * block``.

        Example:
            >>> groups = CSRTopology.from_mask(torch.tensor([[True, False]]))  # input 0 -> group 0
            >>> CSRTopology.from_vectors(groups, 8).indices()[0].tolist()
            [0, 1, 2, 3, 4, 5, 6, 7]
        """
        if not isinstance(vectors, CSRTopology) or vectors.block != 1:
            raise TypeError("vectors must be an unstructured CSRTopology over vectors (block 1)")
        check_block(block)
        if block == 1:
            return vectors
        out_features = vectors.out_features * block
        _check_dims(vectors.in_features, out_features)
        if vectors.nnz * block >= INT32_MAX:
            raise ValueError(f"{vectors.nnz} vectors of {block} exceed the int32 index limit of the kernels")
        return cls(vectors.in_features, out_features, block=block, vectors=vectors)

    @classmethod
    def random(
        cls,
        in_features: int,
        out_features: int,
        density: float,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        block: int = 1,
        constant_fan_in: bool = False,
    ) -> CSRTopology:
        """Exactly ``round(density * in * out)`` distinct edges drawn uniformly at random; with ``block`` V,
        ``round(density * in * out / V)`` distinct vectors (:meth:`random_edge_count`).

        With ``constant_fan_in=True`` every output gets the same in-degree ``k = round(density * in_features)``,
        its ``k`` inputs drawn uniformly without replacement (``k * out_features`` edges: SRigL's constant fan-in,
        Lasby et al. 2024); with ``block`` V, every group of V outputs gets ``k`` vectors, so each output again has
        ``k`` inputs.

        ``generator`` (a CPU ``torch.Generator``) makes the draw reproducible; the result is moved to ``device``.

        Example:
            >>> g = torch.Generator().manual_seed(0)
            >>> CSRTopology.random(100, 50, 0.1, generator=g).nnz
            500
            >>> CSRTopology.random(100, 50, 0.1, generator=g, constant_fan_in=True).fan_in().unique().tolist()
            [10]
            >>> CSRTopology.random(100, 48, 0.1, generator=g, block=16, constant_fan_in=True).vectors.fan_in().tolist()
            [10, 10, 10]
        """
        nnz = cls.random_edge_count(in_features, out_features, density, block=block, constant_fan_in=constant_fan_in)
        check_generator(generator)
        if block > 1:
            vectors = cls.random(in_features, out_features // block, density, generator=generator,
                                 constant_fan_in=constant_fan_in)
            topo = cls.from_vectors(vectors, block)
            return topo.to(device) if device is not None else topo
        if constant_fan_in:
            fan_in = nnz // out_features if out_features else 0
            src, dst = _top_per_row(out_features, in_features, fan_in,
                                    lambda start, rows: torch.rand(rows, in_features, generator=generator))
            topo = cls.from_edges(src, dst, in_features, out_features)
            return topo.to(device) if device is not None else topo
        flat = _sample_without_replacement(in_features * out_features, nnz, generator).sort().values
        src = flat // max(out_features, 1)
        dst = flat % max(out_features, 1)
        topo = cls.from_edges(src, dst, in_features, out_features, sort=False)
        return topo.to(device) if device is not None else topo

    @classmethod
    def top_per_output(cls, scores: torch.Tensor, fan_in: int) -> CSRTopology:
        """The constant fan-in topology keeping, for every output, the ``fan_in`` inputs of largest score:
        ``scores`` is ``[out_features, in_features]`` like ``nn.Linear.weight`` (pass ``weight.abs()`` to keep the
        largest weights of each output). Ties are broken by torch.topk.

        Example:
            >>> w = torch.tensor([[0.1, -3.0, 2.0], [5.0, 0.0, -0.5]])
            >>> CSRTopology.top_per_output(w.abs(), 2).to_sparse_csr(torch.ones(4)).to_dense().tolist()
            [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]]
        """
        if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.dtype.is_floating_point:
            what = (f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                    else type(scores).__name__)
            raise ValueError(f"scores must be a 2-D floating tensor [out_features, in_features], got {what}")
        out_features, in_features = scores.shape
        _check_dims(in_features, out_features)
        if isinstance(fan_in, bool) or not isinstance(fan_in, int) or not 0 <= fan_in <= in_features:
            raise ValueError(f"fan_in must be an integer in [0, in_features={in_features}], got {fan_in!r}")
        if scores.device.type == "meta":
            raise ValueError("scores are on the meta device: there are no values to rank")
        if bool(torch.isnan(scores).any()):
            raise ValueError("scores hold NaN, which cannot be ranked")
        src, dst = _top_per_row(out_features, in_features, fan_in,
                                lambda start, rows: scores[start:start + rows].detach().float().cpu())
        return cls.from_edges(src, dst, in_features, out_features)

    def common_fan_in(self) -> int | None:
        """The in-degree every connected output shares (outputs without edges, such as those SRigL's neuron
        ablation removed, are left out; 0 for a topology without edges), or None when two outputs differ.

        Example:
            >>> CSRTopology.from_mask(torch.tensor([[True, True], [False, False], [True, True]])).common_fan_in()
            2
            >>> CSRTopology.from_mask(torch.tensor([[True, True], [False, True]])).common_fan_in() is None
            True
        """
        fan = self.fan_in()
        connected = fan[fan > 0]
        if connected.numel() == 0:
            return 0
        k = int(connected[0])
        return k if bool((connected == k).all()) else None

    @staticmethod
    def random_edge_count(in_features: int, out_features: int, density: float, *, block: int = 1,
                          constant_fan_in: bool = False) -> int:
        """The edge count :meth:`random` draws, ``round(density * in * out)``, after validating the arguments;
        with ``block`` V, ``V * round(density * in * out / V)`` (whole vectors); with ``constant_fan_in``,
        ``out * round(density * in)`` (any block: each group of V outputs has ``round(density * in)`` vectors).

        Example:
            >>> CSRTopology.random_edge_count(100, 50, 0.1), CSRTopology.random_edge_count(100, 48, 0.1, block=16)
            (500, 480)
            >>> CSRTopology.random_edge_count(30, 4, 0.1, constant_fan_in=True)  # 3 inputs per output
            12
        """
        _check_dims(in_features, out_features)
        check_block(block, out_features)
        check_constant_fan_in_option(constant_fan_in)
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise TypeError(f"density must be a float in [0, 1], got {type(density).__name__}")
        if not (0.0 <= density <= 1.0) or math.isnan(density):
            raise ValueError(f"density must be in [0, 1], got {density}")
        if constant_fan_in:
            nnz = out_features * round(density * in_features)
        else:
            nnz = block * round(density * in_features * (out_features // block))
        if nnz >= INT32_MAX:
            raise ValueError(f"density {density} gives {nnz} edges, past the int32 index limit ({INT32_MAX})")
        return nnz

    @classmethod
    def _derive(cls, in_features: int, out_features: int, src: torch.Tensor, dst: torch.Tensor,
                block: int = 1) -> CSRTopology:
        """Everything the kernels need, from edges already known to be valid, sorted by (src, dst) and, with
        ``block`` > 1, whole vectors.

        Only device-side ops whose output sizes are known in advance, so it never waits on the device (topology
        updates call it directly; the public builders validate first).
        """
        src, dst = src.long(), dst.long()
        if block > 1:
            vectors = cls._derive(in_features, out_features // block, src[::block], dst[::block] // block)
            return cls.from_vectors(vectors, block)
        row_ptr = _offsets(src, in_features)
        col_ptr = _offsets(dst, out_features)
        perm = torch.argsort(dst * max(in_features, 1) + src)  # by (dst, src): stable gather order
        # contiguous_format: an empty view keeps its strides through a plain .to() (the vectors' src[::V] of none)
        arrays = (row_ptr, dst, src, col_ptr, src[perm], perm)
        return cls(in_features, out_features,
                   *(t.to(torch.int32, memory_format=torch.contiguous_format) for t in arrays))

    # ----------------------------------------------------------------------------------------------- views
    @property
    def nnz(self) -> int:
        """Number of edges (stored weights)."""
        return self.vectors.nnz * self.block if self._over_vectors() else self.dst.numel()

    @property
    def density(self) -> float:
        """``nnz / (in_features * out_features)``; 0 for an empty layer."""
        total = self.in_features * self.out_features
        return self.nnz / total if total else 0.0

    @property
    def device(self) -> torch.device:
        return self.vectors.device if self._over_vectors() else self.dst.device

    def _over_vectors(self) -> bool:
        """Whether the topology is held as its vectors (block > 1), so that an element-level array may be derived."""
        return self.block != 1 and self.vectors is not None

    def fan_in(self) -> torch.Tensor:
        """Number of edges into each output, ``[out_features]`` int64 (for block V, each group's vectors, V times).

        Example:
            >>> CSRTopology.from_mask(torch.tensor([[True, True], [False, True]])).fan_in().tolist()
            [2, 1]
        """
        units = self.vectors if self._over_vectors() else self
        fan = (units.col_ptr[1:] - units.col_ptr[:-1]).long()
        return fan.repeat_interleave(self.block) if units is not self else fan

    def edge_keys(self) -> torch.Tensor:
        """Edge keys in storage order, ascending: ``src * out_features + dst`` (int64)."""
        return self.src.long() * self.out_features + self.dst.long()

    def indices(self) -> torch.Tensor:
        """``[2, E]`` int64: row 0 output index, row 1 input index, aligned with the weight values."""
        return torch.stack([self.dst.long(), self.src.long()])

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """The index tensors in the order the ops take them (row_ptr, dst, src, col_ptr, src_by_dst, perm)."""
        return (self.row_ptr, self.dst, self.src, self.col_ptr, self.src_by_dst, self.perm)

    def to(self, device: torch.device | str | None) -> CSRTopology:
        """The same topology on ``device`` (returns ``self`` when nothing moves; derived arrays are not made)."""
        if device is None or torch.device(device) == self.device:
            return self
        given = {name: self.__dict__.get(name) for name in TOPOLOGY_ARGS}
        moved = [None if t is None else t.to(device) for t in given.values()]
        vectors = self.vectors.to(device) if self.vectors is not None else None
        return CSRTopology(self.in_features, self.out_features, *moved, block=self.block, vectors=vectors)

    def validate(self) -> None:
        """Raise ``ValueError`` unless every array is exactly what :meth:`from_csr` derives from ``row_ptr`` and
        ``dst`` (int32, contiguous, one device). The builders guarantee this; a topology assembled by hand (the
        constructor, ``dataclasses.replace``) may not. Reads the values on the host, so it waits for the device.
        """
        for name, t in zip(TOPOLOGY_ARGS, self.kernel_args()):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
                what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"topology's {name} must be a contiguous 1-D int32 tensor, got {what}")
            if t.device != self.device or t.device.type == "meta":
                raise ValueError(f"topology's {name} is on {t.device}; all arrays must hold data on one device")
        check_block(self.block, self.out_features)
        ref = CSRTopology.from_csr(self.row_ptr.cpu(), self.dst.cpu(), self.in_features, self.out_features,
                                   block=self.block)
        for name, t, want in zip(TOPOLOGY_ARGS, self.kernel_args(), ref.kernel_args()):
            if t.shape != want.shape or not torch.equal(t.cpu(), want):
                raise ValueError(f"topology's {name} does not match its row_ptr and dst ({self.in_features} -> "
                                 f"{self.out_features}, {ref.nnz} edges); build topologies with CSRTopology's builders")
        if (self.vectors is None) != (self.block == 1):
            raise ValueError(f"a topology of block {self.block} must {'' if self.block > 1 else 'not '}carry its "
                             "topology over vectors (vectors); build topologies with CSRTopology's builders")
        if self.vectors is not None:
            if self.vectors.device != self.device:
                raise ValueError(f"topology's vectors are on {self.vectors.device}, its edges on {self.device}")
            self.vectors.validate()
            for name, t, want in zip(TOPOLOGY_ARGS, self.vectors.kernel_args(), ref.vectors.kernel_args()):
                if t.shape != want.shape or not torch.equal(t.cpu(), want):
                    raise ValueError(f"topology's vectors.{name} does not match its edges; build topologies with "
                                     "CSRTopology's builders")

    def same_as(self, other: CSRTopology) -> bool:
        """True when both describe the same edges in the same order."""
        return (
            self.in_features == other.in_features
            and self.out_features == other.out_features
            and self.block == other.block
            and torch.equal(self.row_ptr.cpu(), other.row_ptr.cpu())
            and torch.equal(self.dst.cpu(), other.dst.cpu())
        )

    def __repr__(self) -> str:
        return (
            f"CSRTopology(in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}, "
            f"density={self.density:.4g}, " + (f"block={self.block}, " if self.block > 1 else "")
            + f"device={self.device})"
        )


class _ElementArray:
    """An element-level array of a topology of block V > 1 that was not given to it: derived from its vectors each
    time it is read (:func:`element_array`), not kept. A non-data descriptor: an array that was given sits in the
    instance and is found first."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, topology: CSRTopology | None, owner: type | None = None) -> object:
        if topology is None:
            return None  # the class attribute: the dataclass field's default
        return element_array(topology.vectors, topology.block, self.name)


for _name in TOPOLOGY_ARGS:  # after the dataclass took its fields' defaults
    setattr(CSRTopology, _name, _ElementArray(_name))


def element_array(vectors: CSRTopology, block: int, name: str) -> torch.Tensor:
    """One element-level array (``name`` of ``contract.TOPOLOGY_ARGS``) of the layer whose connections are the edges
    of ``vectors`` as vectors of ``block`` outputs: the by-source ones from a repeat each, the by-destination ones
    through :func:`element_index`. Device ops of known output sizes, no host synchronisation.

    Example:
        >>> groups = CSRTopology.from_mask(torch.tensor([[True, False], [False, True]]))  # 2 inputs -> 2 groups
        >>> element_array(groups, 8, "row_ptr").tolist()
        [0, 8, 16]
    """
    if name == "row_ptr":
        out = vectors.row_ptr.long() * block
    elif name == "dst":
        out = (vectors.dst.long()[:, None] * block + torch.arange(block, device=vectors.device)).reshape(-1)
    elif name == "src":
        out = vectors.src.long().repeat_interleave(block)
    else:
        return element_index(vectors.kernel_args(), block)[TOPOLOGY_ARGS.index(name)]
    return out.to(torch.int32, memory_format=torch.contiguous_format)


def element_index(index: tuple[torch.Tensor, ...], block: int) -> tuple[torch.Tensor, ...]:
    """The index arrays (``kernel_args`` order) of the layer whose connections are the edges of ``index`` (a
    topology ``in -> groups``) as vectors of ``block`` outputs: edge ``j*V + l`` is lane ``l`` of vector ``j``, so
    a 1-D weight of ``vectors * V`` values lines up with both. Device ops of known output sizes, no sorting and
    no host synchronisation.

    Example:
        >>> groups = CSRTopology.from_mask(torch.tensor([[True, False], [False, True]]))  # 2 inputs -> 2 groups
        >>> element_index(groups.kernel_args(), 8)[1].tolist()[:9]  # dst: outputs 0..7 of input 0, then 8 of input 1
        [0, 1, 2, 3, 4, 5, 6, 7, 8]
    """
    row_ptr, dst, src, col_ptr, src_by_dst, perm = (t.long() for t in index)
    device = dst.device
    lanes = torch.arange(block, device=device)
    e_dst = (dst[:, None] * block + lanes).reshape(-1)
    e_src = src.repeat_interleave(block)
    # by destination: output g*V + l lists group g's vectors in their by-group order, lane l of each, so the
    # position of (k-th vector of g, lane l) is col_ptr[g]*V + l*fan_in[g] + k
    groups = col_ptr.numel() - 1
    fan_in = col_ptr[1:] - col_ptr[:-1]
    e_col_ptr = torch.zeros(groups * block + 1, dtype=torch.long, device=device)
    torch.cumsum(fan_in.repeat_interleave(block), 0, out=e_col_ptr[1:])
    group_of = torch.repeat_interleave(torch.arange(groups, device=device), fan_in, output_size=perm.numel())
    k = torch.arange(perm.numel(), device=device) - col_ptr[:-1][group_of]
    pos = ((col_ptr[:-1][group_of] * block + k)[:, None] + lanes * fan_in[group_of][:, None]).reshape(-1)
    e_src_by_dst = torch.empty(perm.numel() * block, dtype=torch.long, device=device)
    e_perm = torch.empty_like(e_src_by_dst)
    e_src_by_dst[pos] = src_by_dst.repeat_interleave(block)
    e_perm[pos] = (perm[:, None] * block + lanes).reshape(-1)
    return tuple(t.to(torch.int32, memory_format=torch.contiguous_format)
                 for t in (row_ptr * block, e_dst, e_src, e_col_ptr, e_src_by_dst, e_perm))


def _check_mask(mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [out_features, in_features], got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}; use mask != 0")


def _check_whole_vectors(src: torch.Tensor, dst: torch.Tensor, block: int) -> None:
    """Edges sorted by (src, dst) (no duplicates) form whole vectors: every (input, group) pair they touch, the
    vector of input ``i`` over outputs ``g*V .. g*V+V-1``, holds all ``V`` of its outputs."""
    n = src.numel()
    if not n:
        return
    groups = dst // block
    vector = src * (int(dst.max()) // block + 1) + groups  # non-decreasing: the edges are sorted by (src, dst)
    _, counts = torch.unique_consecutive(vector, return_counts=True)
    partial = counts != block
    if not bool(partial.any()):
        return
    first = int(torch.nonzero(partial)[0])
    start = int(counts[:first].sum())
    i, g = int(src[start]), int(groups[start])
    present = dst[start:start + int(counts[first])].tolist()
    raise ValueError(f"the edges are not whole vectors of block={block}: input {i} connects to outputs {present} of "
                     f"its vector over outputs {g * block}-{g * block + block - 1}, which is only partially present "
                     f"(a connection is a whole vector of {block} consecutive outputs g*{block} .. g*{block}+"
                     f"{block - 1} of one input){_more(int(partial.sum()) - 1)}; CSRTopology.covering(mask, {block}) "
                     "gives the vectors that cover a mask")


def _more(count: int) -> str:
    return f", and {count} more vector{'s are' if count > 1 else ' is'} partial" if count else ""


def check_constant_fan_in_option(constant_fan_in: object) -> None:
    """``constant_fan_in`` is a bool."""
    if not isinstance(constant_fan_in, bool):
        raise TypeError(f"constant_fan_in must be a bool, got {type(constant_fan_in).__name__}")


def check_constant_fan_in(topology: CSRTopology, what: str = "the topology") -> None:
    """Raise unless every connected output of ``topology`` has the same in-degree (:meth:`CSRTopology.common_fan_in`),
    naming two outputs that differ. With block V the outputs of a group share their in-degree (the group's vectors),
    so this is every connected group having the same number of vectors."""
    if topology.common_fan_in() is not None:
        return
    fan = topology.fan_in()
    connected = torch.nonzero(fan > 0).flatten()
    first = int(connected[0])
    other = int(connected[torch.nonzero(fan[connected] != fan[first])[0]])
    raise ValueError(f"{what} is not of constant fan-in: output {first} has {int(fan[first])} inputs and output "
                     f"{other} has {int(fan[other])} (constant fan-in: every output with inputs has the same number)")


def _top_per_row(out_features: int, in_features: int, k: int,
                 score_rows: Callable[[int, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` of the ``k`` highest-scoring inputs of every output, unsorted; ``score_rows(start, rows)``
    gives the ``[rows, in_features]`` scores of outputs ``start .. start + rows - 1`` (taken in chunks of about
    2**22 scores, so a large layer is never scored whole)."""
    if k == 0 or out_features == 0:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty
    chunk = max(1, (1 << 22) // max(in_features, 1))
    srcs, dsts = [], []
    for start in range(0, out_features, chunk):
        rows = min(chunk, out_features - start)
        srcs.append(torch.topk(score_rows(start, rows), k, dim=1, sorted=False).indices.reshape(-1))
        dsts.append(torch.arange(start, start + rows).repeat_interleave(k))
    return torch.cat(srcs), torch.cat(dsts)


def check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def check_rigl_grad(grad: tuple[torch.Tensor, torch.Tensor], topology: CSRTopology) -> None:
    """RigL's gradient argument fits ``topology``: a pair (x ``[N, in_features]``, grad_out ``[N, out_features]``)."""
    if not (isinstance(grad, tuple) and len(grad) == 2 and all(isinstance(t, torch.Tensor) for t in grad)):
        raise TypeError("grad must be a pair of tensors (x [N, in_features], grad_out [N, out_features])")
    x, grad_out = grad
    if x.dim() != 2 or grad_out.dim() != 2 or x.shape[0] != grad_out.shape[0]:
        raise ValueError(f"grad must be (x [N, in_features], grad_out [N, out_features]), got shapes "
                         f"{tuple(x.shape)} and {tuple(grad_out.shape)}")
    if (x.shape[1], grad_out.shape[1]) != (topology.in_features, topology.out_features):
        raise ValueError(f"grad has widths ({x.shape[1]}, {grad_out.shape[1]}) but the layer is "
                         f"{topology.in_features} -> {topology.out_features}")


def _offsets(index: torch.Tensor, size: int) -> torch.Tensor:
    """CSR offsets ``[size + 1]`` of a sorted-or-not index vector (counts by scatter_add, no host sync)."""
    counts = torch.zeros(size, dtype=torch.int64, device=index.device)
    counts.scatter_add_(0, index, torch.ones_like(index))
    offsets = torch.zeros(size + 1, dtype=torch.int64, device=index.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets


def _as_index(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.long()


def _check_range(t: torch.Tensor, limit: int, name: str, limit_name: str) -> None:
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} index {bad} is out of range for {limit_name}={limit} (valid: 0..{limit - 1})")


def _sample_without_replacement(total: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k distinct integers from [0, total): a permutation when dense, rejection sampling when sparse."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k * 4 >= total:
        return torch.randperm(total, generator=generator)[:k]
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < k:
        draw = torch.randint(0, total, (2 * (k - picked.numel()) + 16,), generator=generator)
        picked = torch.unique(torch.cat([picked, draw]))
    # unique sorts its output, so take a random subset, not the smallest ones.
    keep = torch.randperm(picked.numel(), generator=generator)[:k]
    return picked[keep]


@dataclass(frozen=True)
class EdgeMap:
    """How the edges of an old topology land in a new one.

    ``old_to_new[e]`` is the new index of old edge ``e``, or -1 if it was pruned; ``grown`` lists the new indices
    of edges that did not exist before.
    """

    old_to_new: torch.Tensor
    grown: torch.Tensor

    @property
    def kept(self) -> torch.Tensor:
        """Boolean mask over old edges: True where the edge survives."""
        return self.old_to_new >= 0


def updated_topology(topology: CSRTopology, kept: torch.Tensor, new_keys: torch.Tensor) -> tuple[CSRTopology, EdgeMap]:
    """The topology (block 1) holding the edges ``kept`` (indices of ``topology``'s edges) and the absent edges of
    ``new_keys`` (``src * out_features + dst``), with the :class:`EdgeMap` from ``topology`` to it. Device ops of
    known output sizes, no host wait (the caller guarantees the new keys are absent and distinct).

    Example:
        >>> topo = CSRTopology.from_mask(torch.tensor([[True, False], [False, True]]))  # edges (0,0), (1,1)
        >>> new, edge_map = updated_topology(topo, torch.tensor([1]), torch.tensor([2]))  # keep (1,1), add (0,1)
        >>> new.indices().tolist(), edge_map.old_to_new.tolist(), edge_map.grown.tolist()
        ([[0, 1], [1, 1]], [-1, 1], [0])
    """
    keys = torch.cat([topology.edge_keys()[kept], new_keys.to(topology.device)])
    keys, order = torch.sort(keys)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    old_to_new = torch.full((topology.nnz,), -1, dtype=torch.long, device=topology.device)
    old_to_new[kept] = position[: kept.numel()]
    out_f = max(topology.out_features, 1)
    new = CSRTopology._derive(topology.in_features, topology.out_features, keys // out_f, keys % out_f)
    return new, EdgeMap(old_to_new, position[kept.numel():])


def element_edge_map(edge_map: EdgeMap, block: int) -> EdgeMap:
    """The element-level :class:`EdgeMap` of a layer of ``block`` V whose vectors move as ``edge_map`` says (an edge
    map between topologies over vectors): edge ``j*V + l`` is lane ``l`` of vector ``j``, before and after.

    Example:
        >>> element_edge_map(EdgeMap(torch.tensor([-1, 0]), torch.tensor([1])), 8).old_to_new.tolist()[6:10]
        [-1, -1, 0, 1]
    """
    lanes = torch.arange(block, device=edge_map.old_to_new.device)
    old_to_new = edge_map.old_to_new[:, None]
    old_to_new = torch.where(old_to_new >= 0, old_to_new * block + lanes, -1).reshape(-1)
    return EdgeMap(old_to_new, (edge_map.grown[:, None] * block + lanes).reshape(-1))
