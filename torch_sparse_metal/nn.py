"""``SparseLinear``: a drop-in for ``nn.Linear`` whose weight is an unstructured-sparse CSR matrix."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ._resize import replace_data
from .contract import DTYPES
from .functional import sparse_linear
from .strategy import parse_strategy
from .topology import CSRTopology, check_generator

__all__ = ["SparseLinear"]

_TOPOLOGY_BUFFERS = ("row_ptr", "dst")  # saved in state_dict; the rest is derived
_DERIVED_BUFFERS = ("src", "col_ptr", "src_by_dst", "perm")


class SparseLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``[out_features, in_features]`` stored as CSR by input.

    ``weight`` is the 1-D ``Parameter`` of the ``nnz`` stored values, aligned with :meth:`indices`. It is
    initialised like ``nn.Linear`` given each output's actual fan-in: values of edges into output ``o`` are
    uniform in ``±1/sqrt(fan_in(o))``, so outputs have the same scale as a dense layer's. The bias is uniform
    in ``±1/sqrt(fan_in(o))`` as well (``nn.Linear`` uses ``in_features``, which is the dense fan-in).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        density: fraction of the ``in_features * out_features`` connections present, drawn uniformly.
        backward: ``"fused_atomic"``, ``"atomic_free"`` or ``"auto"`` (see :mod:`torch_sparse_metal.strategy`).
        device, dtype: as ``nn.Linear``. On the ``meta`` device (or under ``with torch.device("meta")``) nothing
            is drawn: the layer has its shapes only, and ``to_empty(device=...)`` then ``reset_parameters()``
            draws its topology and values, reproducibly (from a seed taken from ``generator`` at construction),
            or ``load_state_dict`` fills it from a checkpoint.
        generator: a CPU ``torch.Generator`` for reproducible topology and initial values.

    Example:
        >>> layer = SparseLinear(64, 32, density=0.1, generator=torch.Generator().manual_seed(0))
        >>> layer(torch.randn(4, 10, 64)).shape, layer.nnz
        (torch.Size([4, 10, 32]), 205)
    """

    __constants__ = ["in_features", "out_features"]
    in_features: int
    out_features: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        density: float = 0.1,
        backward: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        check_generator(generator)
        if torch.empty(0, device=device).device.type == "meta":
            self._build_deferred(in_features, out_features, density, bias, backward, dtype, generator)
            return
        topology = CSRTopology.random(in_features, out_features, density, generator=generator)
        self._build(topology, bias, backward, device, dtype)
        self.reset_parameters(generator=generator)

    def _build_deferred(self, in_features: int, out_features: int, density: float, bias: bool, backward: str,
                        dtype: torch.dtype | None, generator: torch.Generator | None) -> None:
        """Meta-device construction: index buffers and parameters of the right shapes, no values; the topology is
        drawn by ``reset_parameters`` once the layer is materialised, from a seed taken here."""
        nnz = CSRTopology.random_edge_count(in_features, out_features, density)
        meta = {"device": "meta", "dtype": torch.int32}
        shapes = (in_features + 1, nnz, nnz, out_features + 1, nnz, nnz)
        topology = CSRTopology(in_features, out_features, *(torch.empty(n, **meta) for n in shapes))
        self._build(topology, bias, backward, "meta", dtype)
        seed = int(torch.randint(2**62, (1,), generator=generator, device="cpu"))
        self.__dict__["_deferred"] = (density, seed)

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
    ) -> SparseLinear:
        """A freshly initialised layer with the given connectivity.

        Example:
            >>> SparseLinear.from_topology(CSRTopology.from_mask(torch.eye(4, dtype=torch.bool))).nnz
            4
        """
        if not isinstance(topology, CSRTopology):
            raise TypeError(f"topology must be a CSRTopology, got {type(topology).__name__}")
        layer = cls.__new__(cls)
        layer._build(topology, bias, backward, device, dtype)
        layer.reset_parameters(generator=generator)
        return layer

    @classmethod
    def from_dense(cls, linear: nn.Linear, mask: torch.Tensor | None = None, *, backward: str = "auto") -> SparseLinear:
        """The sparse layer holding ``linear``'s weights where ``mask`` is true (default: its nonzeros).

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
        topology = CSRTopology.from_mask(mask.to(device="cpu", dtype=torch.bool))
        layer = cls.__new__(cls)
        layer._build(topology, linear.bias is not None, backward, w.device, w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w[layer.dst.long(), layer.src.long()])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    @classmethod
    def from_sparse(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backward: str = "auto"
                    ) -> SparseLinear:
        """The layer whose weight is the sparse ``[out_features, in_features]`` tensor ``weight`` (COO, CSR, CSC
        or BSR): every stored element becomes an edge, explicit zeros included (they are connections that may
        learn). ``bias`` is a dense ``[out_features]`` tensor, or None for no bias.

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
        topology, order = CSRTopology.from_indices(coo.indices().cpu(), in_features, out_features)
        layer = cls.__new__(cls)
        layer._build(topology, bias is not None, backward, coo.device, coo.dtype)
        with torch.no_grad():
            layer.weight.copy_(coo.values()[order.to(coo.device)])
            if bias is not None:
                if bias.shape != (out_features,):
                    raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
                layer.bias.copy_(bias)
        return layer

    def _build(self, topology: CSRTopology, bias: bool, backward: str, device, dtype) -> None:
        super().__init__()
        self.__dict__["_deferred"] = None  # (density, seed) while a meta-constructed layer has no topology
        factory = {"device": device, "dtype": dtype}
        if dtype is not None and dtype not in DTYPES:  # a layer no kernel can run would fail only at forward
            raise TypeError(f"dtype {dtype} is not supported (supported: {', '.join(str(d) for d in DTYPES)})")
        self.backward = parse_strategy(backward)
        self.weight = nn.Parameter(torch.empty(topology.nnz, **factory))
        self.bias = nn.Parameter(torch.empty(topology.out_features, **factory)) if bias else None
        self._set_topology(topology.to(self.weight.device))

    def _set_topology(self, topology: CSRTopology) -> None:
        self.in_features, self.out_features = topology.in_features, topology.out_features
        for name in _TOPOLOGY_BUFFERS:
            self.register_buffer(name, getattr(topology, name), persistent=True)
        for name in _DERIVED_BUFFERS:
            self.register_buffer(name, getattr(topology, name), persistent=False)

    # --------------------------------------------------------------------------------------------- behaviour
    @property
    def topology(self) -> CSRTopology:
        """The layer's connectivity (shares the layer's index buffers; nothing is copied)."""
        if torch.compiler.is_compiling():  # no cache writes while tracing
            return CSRTopology(self.in_features, self.out_features, self.row_ptr, self.dst, self.src, self.col_ptr,
                               self.src_by_dst, self.perm)
        # Cached, and rebuilt whenever the buffers were replaced (.to(), a checkpoint, a topology update).
        cached = self.__dict__.get("_topology")
        if cached is None or cached.perm is not self.perm or cached.dst is not self.dst:
            cached = CSRTopology(self.in_features, self.out_features, self.row_ptr, self.dst, self.src,
                                 self.col_ptr, self.src_by_dst, self.perm)
            self.__dict__["_topology"] = cached
        return cached

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
        return (self.col_ptr[1:] - self.col_ptr[:-1]).long()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Re-draw weights and bias with ``nn.Linear``'s output scale, given each output's actual fan-in.

        A layer constructed on the meta device and materialised with ``to_empty`` draws its topology here first
        (from its construction seed; ``generator``, if given, then draws the values). On meta it does nothing.

        Example:
            >>> layer = SparseLinear(16, 8, density=0.25, device="meta")
            >>> layer = layer.to_empty(device="cpu")
            >>> layer.reset_parameters()
            >>> layer(torch.randn(2, 16)).shape
            torch.Size([2, 8])
        """
        if self.weight.device.type == "meta":
            return
        deferred = self.__dict__.get("_deferred")
        if deferred is not None:
            density, seed = deferred
            drawn = torch.Generator().manual_seed(seed)
            topology = CSRTopology.random(self.in_features, self.out_features, density, generator=drawn)
            self._set_topology(topology.to(self.weight.device))
            self.__dict__["_deferred"] = None
            generator = generator if generator is not None else drawn
        bound = self.fan_in().clamp(min=1).double().rsqrt().to(device="cpu")  # per output
        with torch.no_grad():
            u = torch.rand(self.nnz, generator=generator, dtype=torch.float64) * 2 - 1
            self.weight.copy_(u * bound[self.dst.long().cpu()])
            if self.bias is not None:
                ub = torch.rand(self.out_features, generator=generator, dtype=torch.float64) * 2 - 1
                self.bias.copy_(ub * bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.__dict__.get("_deferred") is not None and self.weight.device.type != "meta":
            raise RuntimeError("this SparseLinear was created on the meta device and its topology was never drawn: "
                               "call reset_parameters() after to_empty(), or load_state_dict() a checkpoint")
        return sparse_linear(input, self.weight, self.topology, self.bias, backward=self.backward)

    def indices(self) -> torch.Tensor:
        """``[2, nnz]`` int64: row 0 output index, row 1 input index, aligned with ``weight``."""
        return self.topology.indices()

    def to_sparse_csr(self) -> torch.Tensor:
        """The weight as a torch sparse CSR tensor ``[out_features, in_features]`` (differentiable with respect to
        ``weight``)."""
        return self.topology.to_sparse_csr(self.weight)

    def to_linear(self) -> nn.Linear:
        """A dense ``nn.Linear`` computing the same function (zeros where there is no edge).

        Example:
            >>> layer = SparseLinear(8, 4, density=0.5)
            >>> x = torch.randn(2, 8)
            >>> torch.allclose(layer.to_linear()(x), layer(x), atol=1e-6)
            True
        """
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
        dense = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        init(dense, *args, **kwargs)
        with torch.no_grad():
            self.weight.copy_(dense[self.dst.long(), self.src.long()])
        return self

    def to_dense(self) -> torch.Tensor:
        """The dense ``[out_features, in_features]`` weight (differentiable with respect to ``weight``)."""
        dense = self.weight.new_zeros(self.out_features, self.in_features)
        return dense.index_put((self.dst.long(), self.src.long()), self.weight)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.nnz}, "
                f"density={self.density:.4g}, bias={self.bias is not None}, backward={self.backward!r}")

    # --------------------------------------------------------------------------------------------- checkpoints
    def get_extra_state(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features, "format": 1}

    def set_extra_state(self, state: dict) -> None:  # handled in _load_from_state_dict
        pass

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, all or nothing: with ``strict``, unexpected or missing keys raise
        before anything is loaded (``nn.Module`` loads, then raises); a malformed entry raises and leaves the
        layer unchanged either way. (Inside a larger model, the model's ``load_state_dict`` applies torch's rule.)
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        odd = [key for key in state_dict if not isinstance(key, str)]
        if odd:
            raise TypeError(f"state_dict keys must be strings, got {odd[0]!r} (nothing was loaded)")
        if strict:
            expected = set(self.state_dict())
            unexpected, missing = sorted(set(state_dict) - expected), sorted(expected - set(state_dict))
            if unexpected or missing:  # torch's wording, said before loading
                lines = [f"{kind} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + "."
                         for kind, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys]
                raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__} (nothing was loaded):"
                                   "\n\t" + "\n\t".join(lines))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Load values and topology together; a checkpoint with another topology turns this layer into that
        layer. Everything is validated before anything changes, so a malformed checkpoint leaves the layer
        as it was (the error is reported by ``load_state_dict``)."""
        names = ["weight", *_TOPOLOGY_BUFFERS] + (["bias"] if self.bias is not None else [])
        ours = {name: prefix + name for name in [*names, "_extra_state"]}
        unexpected = [key for key in state_dict
                      if key.startswith(prefix) and "." not in key[len(prefix):] and key not in ours.values()]
        unexpected_keys.extend(unexpected)
        absent = [ours[n] for n in names if ours[n] not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        try:
            loaded = _read_checkpoint(state_dict, ours, self)
        except (ValueError, TypeError) as exc:
            error_msgs.append(f"{type(self).__name__} at '{prefix}': {exc}")
            return
        topology, weight, bias = loaded
        self.__dict__["_deferred"] = None  # the checkpoint's topology is the layer's from now on
        with torch.no_grad():
            if not topology.same_as(self.topology):
                self._set_topology(topology.to(self.weight.device))
                replace_data(self.weight, torch.empty(topology.nnz, dtype=self.weight.dtype, device=self.weight.device))
            self.weight.copy_(weight)
            if bias is not None:
                if self.bias.shape != bias.shape:
                    replace_data(self.bias, torch.empty(bias.shape, dtype=self.bias.dtype, device=self.bias.device))
                self.bias.copy_(bias)


def _dense_tensor(state_dict: dict, key: str, *, floating: bool) -> torch.Tensor:
    """``state_dict[key]`` if it is a dense tensor with data (not meta, not sparse), else a TypeError naming it."""
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{key} must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.device.type == "meta":
        raise TypeError(f"{key} must be a dense tensor with data, got a {value.layout} tensor on {value.device}")
    if floating and not value.dtype.is_floating_point:
        raise TypeError(f"{key} must be floating point, got {value.dtype}")
    return value


def _read_checkpoint(state_dict: dict, keys: dict, layer: SparseLinear):
    """Validated (topology, weight, bias) from a state dict; raises ValueError/TypeError naming the problem."""
    extra = state_dict.get(keys["_extra_state"], {})
    if not isinstance(extra, dict):
        raise TypeError(f"{keys['_extra_state']} must be a dict, got {type(extra).__name__}")
    if extra.get("format", 1) != 1:
        raise ValueError(f"{keys['_extra_state']} has format {extra.get('format')!r}; this version reads format 1")
    row_ptr = _dense_tensor(state_dict, keys["row_ptr"], floating=False)
    dst = _dense_tensor(state_dict, keys["dst"], floating=False)
    in_features = extra.get("in_features", row_ptr.numel() - 1)
    out_features = extra.get("out_features", layer.out_features)
    topology = CSRTopology.from_csr(row_ptr.cpu(), dst.cpu(), in_features, out_features)
    weight = _dense_tensor(state_dict, keys["weight"], floating=True)
    if weight.shape != (topology.nnz,):
        raise ValueError(f"weight must have shape ({topology.nnz},) to match the checkpoint's topology, got "
                         f"{tuple(weight.shape)}")
    bias = None
    if layer.bias is not None:  # a layer with a bias needs one: None would leave a bias of another size behind
        bias = _dense_tensor(state_dict, keys["bias"], floating=True)
        if bias.shape != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
    return topology, weight, bias
