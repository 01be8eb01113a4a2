"""Sparse fine-tuning of one dense layer: ``SparseDelta`` adds a trainable sparse delta to an ``nn.Linear``.

``y = base(x) + x @ delta^T``, where ``delta`` is a ``SparseLinear`` without bias whose values start at zero, so a
fresh wrapper computes exactly what ``base`` computes. The delta's gradient is the layer's own backward: the product
``grad_out^T x`` sampled at the delta's connections, one value per connection, so the gradient and the optimizer
state of the delta are proportional to its connections and no dense ``[out, in]`` gradient is formed. With the base
frozen (the default) its dense weight gets no gradient at all.

The delta is a ``SparseLinear`` child (``wrapper.delta``), so everything that works on those layers works on it:
``DynamicSparsity`` drops the delta's smallest-magnitude connections and regrows others (SpIEL's drop and regrow:
``mode="rigl"`` grows where the dense gradient of the weight is largest, ``"set"`` at random), the checkpoint
helpers read its topology, and both layouts (``block=1`` unstructured, ``block=V`` vectors of V outputs) are built
the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from ._torch_private import forward_ad_level, functorch_transforms_active, global_module_hooks_set, jit_tracing_state
from .delta_product import FusedDeltaLinear, flat_cells, fused_pays
from .functional import _AUTOCAST_DEVICES, _autocast
from .layer_assigned import check_shape_buffer
from .layer_buffers import cached_topology
from .nn import SparseLinear, _in_onnx_export, _off_fused_transformer_kernels
from .topology import CSRTopology, check_block, check_generator

__all__ = ["SparseDelta", "top_connections"]


def top_connections(scores: torch.Tensor, density: float, *, block: int = 1) -> CSRTopology:
    """The topology of the ``round(density * out * in)`` connections with the largest ``scores`` (a float
    ``[out_features, in_features]`` tensor, larger is more important, such as the magnitude of an accumulated
    gradient). With ``block`` V it keeps that many edges as whole vectors of V outputs, ranked by the L2 norm of
    their V scores. Ties are broken by position (``torch.topk``'s order); NaN scores raise.

    Example:
        >>> scores = torch.tensor([[0.1, 5.0, 0.2], [3.0, 0.0, 0.4]])
        >>> top_connections(scores, 2 / 6).indices().tolist()  # [outputs, inputs]
        [[1, 0], [0, 1]]
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError("scores must be a floating-point [out_features, in_features] tensor, got "
                         + (f"{scores.dtype} of shape {tuple(scores.shape)}" if isinstance(scores, torch.Tensor)
                            else type(scores).__name__))
    out_features, in_features = scores.shape
    count = CSRTopology.random_edge_count(in_features, out_features, density, block=block)
    scores = scores.detach().to(device="cpu", dtype=torch.float64)
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores hold NaN: the connections to keep cannot be ranked")
    if block > 1:
        scores = scores.view(out_features // block, block, in_features).norm(dim=1)
    chosen = torch.topk(scores.reshape(-1), count // block).indices
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[chosen] = True
    vectors = CSRTopology.from_mask(mask.view(scores.shape))
    return CSRTopology.from_vectors(vectors, block) if block > 1 else vectors


class SparseDelta(nn.Module):
    """``y = base(x) + x @ delta^T``: a trainable sparse delta (a ``SparseLinear`` without bias, values starting at
    zero) over an existing ``nn.Linear``.

    The delta's connections are, by precedence: ``topology`` (a ``CSRTopology`` of the base's shape, given), the
    ``density`` fraction with the largest ``scores`` (:func:`top_connections`; the magnitude of an accumulated
    gradient: :func:`torch_sparse_metal.finetune.accumulated_gradients`), or the ``density`` fraction drawn at random
    (``generator`` makes it reproducible). ``block`` V makes them vectors of V outputs (the vector kernels).

    ``freeze_base=True`` (default) sets ``requires_grad=False`` on the base's weight and bias: they then get no
    gradient. The delta has the base weight's device and dtype.

    :meth:`merge` adds the delta into the base weight (the forward is then ``base(x)`` alone) and :meth:`unmerge`
    takes it out again, restoring the base weight bit for bit. The merged state is saved (``_extra_state``); a
    merged checkpoint loads merged, and its unmerge subtracts the delta (exact up to float rounding, as the values
    from before the merge are not saved).

    Example:
        >>> base = nn.Linear(32, 16)
        >>> layer = SparseDelta(base, density=0.05, generator=torch.Generator().manual_seed(0))
        >>> x = torch.randn(4, 32)
        >>> torch.equal(layer(x), base(x)), layer.delta.nnz, layer.delta.weight.shape  # zero delta at the start
        (True, 26, torch.Size([26]))
        >>> layer(x).sum().backward()
        >>> base.weight.grad is None, layer.delta.weight.grad.shape
        (True, torch.Size([26]))
    """

    def __init__(self, base: nn.Linear, density: float | None = None, *, topology: CSRTopology | None = None,
                 scores: torch.Tensor | None = None, block: int = 1, freeze_base: bool = True,
                 generator: torch.Generator | None = None, backward: str = "auto") -> None:
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        if isinstance(base, SparseDelta) or not isinstance(base.weight, torch.Tensor):
            raise TypeError("base has no dense weight to add a delta to")
        if not isinstance(freeze_base, bool):
            raise TypeError(f"freeze_base must be a bool, got {type(freeze_base).__name__}")
        check_generator(generator)
        topology = _delta_topology(base, density, topology, scores, block, generator)
        super().__init__()
        weight = base.weight
        delta = SparseLinear.from_topology(topology, bias=False, backward=backward, device=weight.device,
                                           dtype=weight.dtype)
        with torch.no_grad():
            delta.weight.zero_()
        self.base = base
        self.delta = delta
        self.in_features, self.out_features = base.in_features, base.out_features
        self._merge: tuple[torch.Tensor, ...] | None = None
        if freeze_base:
            for p in base.parameters(recurse=False):
                p.requires_grad_(False)
        self.register_load_state_dict_post_hook(_settle_loaded_merge)

    @property
    def merged(self) -> bool:
        """Whether the delta is in the base weight (:meth:`merge`)."""
        return self._merge is not None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._merge is not None:
            return self.base(input)
        fused = self._fused(input)
        if fused is not None:
            return fused
        return self.base(input) + self.delta(input)

    def _fused(self, input: torch.Tensor) -> torch.Tensor | None:
        """``base(x) + delta(x)`` as one dense product over the weight with the delta scattered into a copy of it
        (:mod:`torch_sparse_metal.delta_product`), where that costs less (``fused_pays``) and computes what the
        two module calls compute; else None, and the two calls run (with their checks, errors and hooks).

        The two calls stay wherever the fused product would skip something they do: hooks on either module (such
        as ``DynamicSparsity``'s RigL capture) or global module hooks, a base or delta class with its own
        forward, parametrizations, a delta not yet materialised, tracing, compiling and ``torch.func`` transforms
        (which see the layers' own ops), tensor subclasses (DTensor), and any argument the layers would refuse
        or cast (mismatched dtypes or devices)."""
        base, delta = self.base, self.delta
        weight, bias, values = base.weight, base.bias, delta.weight
        if not (_plain(input) and _plain(weight) and _plain(values) and (bias is None or _plain(bias))):
            return None
        if input.dim() == 0 or input.shape[-1] != self.in_features or input.numel() == 0:
            return None
        rows = input.numel() // self.in_features
        if not fused_pays(rows, values.shape[0], self.out_features, self.in_features):
            return None
        if (type(base).forward is not nn.Linear.forward or type(delta).forward is not SparseLinear.forward
                or _hooked(base) or _hooked(delta) or global_module_hooks_set()
                or delta.__dict__.get("_deferred") is not None or delta.bias is not None):
            return None
        if (torch.compiler.is_compiling() or jit_tracing_state() is not None or functorch_transforms_active()
                or forward_ad_level() >= 0 or input.is_nested or _in_onnx_export()):
            return None
        device = input.device.type
        autocast = device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device)
        if autocast:  # the rule of nn.Linear's and sparse_linear's autocast: the same casts, then the product
            input, weight, bias, values = _autocast(device, input, weight, bias, values)
        if not (input.dtype == weight.dtype == values.dtype and (bias is None or bias.dtype == input.dtype)
                and input.device == weight.device == values.device
                and (bias is None or bias.device == input.device)):
            return None
        check_shape_buffer(delta)
        topology = cached_topology(delta)
        if topology.dst.device != input.device:
            return None
        cells = self.__dict__.get("_flat_cells")  # (topology, its flat cells): made again when the topology changes
        if cells is None or cells[0] is not topology:
            cells = (topology, flat_cells(topology))
            self.__dict__["_flat_cells"] = cells
        x = input.reshape(rows, self.in_features)
        if autocast:
            with torch.autocast(device, enabled=False):
                y = FusedDeltaLinear.apply(x, weight, bias, values, topology, cells[1], delta.backward)
        else:
            y = FusedDeltaLinear.apply(x, weight, bias, values, topology, cells[1], delta.backward)
        return y.view(*input.shape[:-1], self.out_features)

    def _cells(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self.delta.indices().to(self.base.weight.device)
        return rows, cols

    @torch.no_grad()
    def merge(self) -> None:
        """Add the delta into the base weight; the forward is then ``base(x)``. The base weight's values at the
        delta's connections before the merge are kept (one per connection) for :meth:`unmerge`.

        Example:
            >>> layer = SparseDelta(nn.Linear(8, 4), density=0.5)
            >>> with torch.no_grad():
            ...     _ = layer.delta.weight.normal_()
            >>> x = torch.randn(2, 8)
            >>> y = layer(x)
            >>> layer.merge(); torch.allclose(layer(x), y, atol=1e-6)
            True
        """
        if self._merge is not None:
            raise RuntimeError("the delta is merged already: unmerge() it first")
        weight = self.base.weight
        rows, cols = self._cells()
        before = weight[rows, cols].clone()
        added = self.delta.weight.detach().to(weight.dtype)
        after = before + added
        weight[rows, cols] = after
        self._merge = (rows, cols, before, after, added)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the merged delta out of the base weight. Where the base still holds what :meth:`merge` wrote, the
        values from before the merge come back bit for bit; where it changed since (the base trained while merged)
        the merged delta is subtracted.

        Example:
            >>> base = nn.Linear(8, 4)
            >>> before = base.weight.detach().clone()
            >>> layer = SparseDelta(base, density=0.5)
            >>> with torch.no_grad():
            ...     _ = layer.delta.weight.normal_()
            >>> layer.merge(); layer.unmerge()
            >>> torch.equal(base.weight, before), layer.merged
            (True, False)
        """
        if self._merge is None:
            raise RuntimeError("the delta is not merged")
        rows, cols, before, after, added = self._merge
        weight = self.base.weight
        now = weight[rows, cols]
        weight[rows, cols] = torch.where(now == after, before, now - added)
        self._merge = None

    def _apply(self, fn, recurse: bool = True):
        # The merge record follows the base weight through .to(), .half() and the like: fn converts its values as
        # it converts the weight (and leaves the integer indices' dtype alone), so unmerge compares like with like.
        super()._apply(fn, recurse)
        if self._merge is not None:
            self._merge = tuple(fn(t) for t in self._merge)
        return self

    def get_extra_state(self) -> torch.Tensor:
        """Whether the delta is merged, as a tensor (every state-dict entry a tensor, for safetensors)."""
        return torch.tensor([int(self.merged)], dtype=torch.int64)

    def set_extra_state(self, state: torch.Tensor) -> None:
        if not isinstance(state, torch.Tensor) or state.numel() != 1 or int(state.reshape(-1)[0]) not in (0, 1):
            raise ValueError(f"not a SparseDelta merge state: {state!r}")
        # applied by _settle_loaded_merge once the base and the delta have loaded too
        self.__dict__["_loaded_merged"] = bool(int(state.reshape(-1)[0]))

    def extra_repr(self) -> str:
        return f"merged={self.merged}"


def _plain(t: object) -> bool:
    """A tensor the fused product takes as it is: a strided torch.Tensor or Parameter, no subclass."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` would run a hook of its own (other than the no-op every SparseLinear carries,
    ``nn._off_fused_transformer_kernels``) or change it through a parametrization."""
    pre = [h for h in module._forward_pre_hooks.values() if h is not _off_fused_transformer_kernels]
    return bool(pre or module._forward_hooks or module._backward_hooks or module._backward_pre_hooks
                or "parametrizations" in module._modules)


def _settle_loaded_merge(module: SparseDelta, incompatible_keys) -> None:
    """After a load: the wrapper takes the checkpoint's merge state; a merged checkpoint's base weight holds the
    delta, whose values from before the merge are then known only up to rounding (``weight - delta``)."""
    loaded = module.__dict__.pop("_loaded_merged", None)
    if loaded is None:
        return
    module._merge = None
    if loaded:
        with torch.no_grad():
            rows, cols = module._cells()
            after = module.base.weight[rows, cols].clone()
            added = module.delta.weight.detach().to(after.dtype)
            module._merge = (rows, cols, after - added, after, added)


def _delta_topology(base: nn.Linear, density: float | None, topology: CSRTopology | None,
                    scores: torch.Tensor | None, block: int, generator: torch.Generator | None) -> CSRTopology:
    """The connections of ``base``'s delta (see :class:`SparseDelta`), checked against the base's shape."""
    shape = (base.out_features, base.in_features)
    if topology is not None:
        if density is not None or scores is not None:
            raise ValueError("give either topology or density (with scores or without), not both")
        if not isinstance(topology, CSRTopology):
            raise TypeError(f"topology must be a CSRTopology, got {type(topology).__name__}")
        if (topology.out_features, topology.in_features) != shape:
            raise ValueError(f"the topology is {topology.out_features}x{topology.in_features} but the base layer "
                             f"is {shape[0]}x{shape[1]} (out x in)")
        if block not in (1, topology.block):
            raise ValueError(f"block={block} but the given topology has block {topology.block}")
        topology.validate()
        return topology
    if density is None:
        raise ValueError("give density (the fraction of the base's connections the delta gets) or a topology")
    check_block(block, base.out_features)
    if scores is not None:
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != shape:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"scores must be a tensor of the base weight's shape {shape}, got {got}")
        return top_connections(scores, density, block=block)
    return CSRTopology.random(base.in_features, base.out_features, density, generator=generator, block=block)
