"""Turn an existing model's ``nn.Linear`` layers into ``SparseLinear`` ones, in one call."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from ._modules import set_submodule
from .distribution import layer_densities
from .huggingface import configured_ties, route_resize_token_embeddings
from .layer_buffers import set_constant_fan_in
from .nn import SparseLinear
from .topology import CSRTopology, check_block, check_constant_fan_in, check_constant_fan_in_option

__all__ = ["sparsify", "sparsify_densities"]

_log = logging.getLogger(__name__)

METHODS = ("magnitude", "random")

# Module state a SparseLinear built from the weights would not have: refused rather than dropped.
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


@dataclass
class _Registration:
    """One ``nn.Linear`` object and every name it is registered under (a shared module has several)."""

    linear: nn.Linear
    names: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return " and ".join(repr(n) for n in self.names)


def sparsify(
    model: nn.Module,
    density: float | None = None,
    *,
    method: str = "magnitude",
    filter: Callable[[str, nn.Linear], bool] | None = None,  # noqa: A002 - the name users expect
    masks: dict[str, torch.Tensor] | None = None,
    block: int = 1,
    backward: str = "auto",
    generator: torch.Generator | None = None,
    distribution: str = "uniform",
    keep_dense: Iterable[str] = (),
    constant_fan_in: bool = False,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (those ``filter(name, module)`` accepts) by a ``SparseLinear``
    that keeps the dense weights on the connections it keeps, and the bias. ``model`` is changed in place and
    returned; use the return value: when ``model`` itself is an ``nn.Linear``, it is the new ``SparseLinear``.

    Which connections: ``masks[name]`` (a bool ``[out, in]`` mask) where given, else ``round(d * in * out)`` of
    them per layer, the largest in magnitude (``method="magnitude"``) or drawn uniformly (``"random"``, from
    ``generator``). ``density`` is the target over all the layers without a mask, and ``distribution`` shares it
    out (:mod:`torch_sparse_metal.distribution`): ``"uniform"`` (``d = density`` for each layer), ``"er"`` /
    ``"erk"`` (RigL's Erdős–Rényi-kernel densities), ``"global"`` (one magnitude threshold across the layers).
    Layers named in ``keep_dense`` stay ``nn.Linear`` and count toward the target, as do layers a distribution
    fills to density 1 (ERK's small layers); the others' counts then add up to ``round(density * total)``.
    :func:`sparsify_densities` returns the per-layer densities without changing the model; ``sparsify`` logs them
    (logger ``torch_sparse_metal.convert``, level INFO). With ``block`` V (``SparseLinear(block=V)``) the
    connections are whole vectors of V outputs: the ``round(d * in * out / V)`` vectors of largest L2 norm, or
    drawn uniformly, and a given mask is covered by vectors (:meth:`CSRTopology.covering`); every chosen layer's
    ``out_features`` must be a multiple of V (exclude others with ``filter=``).

    What is kept: each parameter's ``requires_grad`` (frozen layers stay frozen), the module's ``training`` flag,
    device and dtype. The parameters are new ones: build the optimizer after sparsify. One ``nn.Linear``
    registered under several names (a shared module) becomes one ``SparseLinear`` registered under all of them;
    ``filter`` must give the same answer for all its names, and its mask may be given under any one of them.

    What stays dense: the ``out_proj`` of ``nn.MultiheadAttention``, which reads it as a matrix. An encoder layer
    (``nn.TransformerEncoderLayer``) whose ``linear1`` or ``linear2`` is sparse stays off torch's fused inference
    kernel, which also reads them as matrices (every SparseLinear carries a no-op forward pre-hook, one of that
    kernel's exclusions, so this holds for layers placed by hand too), and the ``nn.TransformerEncoder`` holding it
    stops converting padded inputs to nested tensors: in ``eval()`` under ``torch.no_grad()`` it computes what it
    computes in training mode, without dropout.

    What is refused (``ValueError``, naming the layer and what to do; ``filter=`` excludes a layer): a weight or
    bias shared with another module (tied weights: a SparseLinear cannot share them); an uninitialised
    ``nn.LazyLinear`` (run a forward pass first); subclasses of ``nn.Linear`` and parametrized layers (their own
    forward or state would be lost); layers with hooks, extra parameters, buffers or submodules (e.g. from
    ``torch.nn.utils.weight_norm``); layers on the meta device whose connections would be chosen by magnitude (with
    ``method="random"`` or a mask they become meta SparseLinears with those connections, which ``to_empty`` plus
    ``reset_parameters``, or ``load_state_dict``, give values). Every layer is checked and converted before any is
    replaced, so a refusal leaves the model as it was.

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> model = sparsify(model, density=0.25, filter=lambda name, m: m.out_features > 2)
        >>> [type(m).__name__ for m in model]
        ['SparseLinear', 'ReLU', 'Linear']
        >>> type(sparsify(nn.Linear(16, 8), density=0.25)).__name__
        'SparseLinear'

    ``constant_fan_in=True`` gives every output of a layer of density ``d`` the same in-degree ``round(d * in)``:
    the largest weights of each output (``"magnitude"``) or drawn per output (``"random"``); with ``block`` V, the
    ``round(d * in)`` vectors of largest L2 norm (or drawn) of each group of V outputs. The layers know it
    (``SparseLinear.constant_fan_in``: SRigL's constant fan-in). A mask given for a layer must then have one
    in-degree for every output that has any (after the covering of whole vectors, for block V).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_block(block)
    check_constant_fan_in_option(constant_fan_in)
    chosen = [reg for reg in _registrations(model) if _accepted(reg, filter)]
    chosen_masks = _masks_by_layer(dict(masks or {}), chosen)
    densities = _densities(chosen, chosen_masks, density, distribution, keep_dense, block)
    chosen = [reg for reg in chosen if densities.get(reg.names[0]) != _STAYS_DENSE]
    for reg in chosen:
        _check_convertible(reg, block, needs_values=method == "magnitude" and id(reg.linear) not in chosen_masks)
    _check_untied_by_config(model, chosen)
    _check_untied(model, chosen)
    for name, d in densities.items():
        _log.info("sparsify: %s density %s", name, "1 (stays nn.Linear)" if d == _STAYS_DENSE else f"{d:.6g}")
    plans = [(reg, _convert(reg.linear, chosen_masks.get(id(reg.linear)), densities.get(reg.names[0]), method,
                            generator, backward, block, constant_fan_in)) for reg in chosen]
    for reg, sparse in plans:
        if reg.linear is model:
            return sparse  # the model is the Linear itself: nothing else to replace
        for name in reg.names:
            set_submodule(model, name, sparse)
    _keep_encoders_off_nested_tensors(model)
    if plans:  # a sparse output layer anywhere in a Hugging Face model: its resize_token_embeddings must know it
        route_resize_token_embeddings(model)
    return model


def sparsify_densities(
    model: nn.Module,
    density: float,
    *,
    distribution: str = "uniform",
    keep_dense: Iterable[str] = (),
    filter: Callable[[str, nn.Linear], bool] | None = None,  # noqa: A002 - as sparsify's
    block: int = 1,
) -> dict[str, float]:
    """The density :func:`sparsify` with the same arguments gives each ``nn.Linear`` of
    ``model`` (by its first name), without changing ``model``; 1.0 for a layer that stays ``nn.Linear``
    (``keep_dense``, or filled by the distribution).

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> {k: round(v, 3) for k, v in sparsify_densities(model, 0.1, distribution="erk").items()}
        {'0': 0.15, '2': 0.06, '4': 0.8}
        >>> sparsify_densities(model, 0.1, distribution="uniform", keep_dense=["4"])["2"] < 0.1
        True
    """
    chosen = [reg for reg in _registrations(model) if _accepted(reg, filter)]
    check_block(block)
    found = _densities(chosen, {}, density, distribution, keep_dense, block)
    return {name: 1.0 if d == _STAYS_DENSE else d for name, d in found.items()}


#: The density of a layer that stays nn.Linear: kept dense by name, or filled to 1 by a distribution.
_STAYS_DENSE = -1.0


def _densities(chosen: list[_Registration], masks: dict[int, torch.Tensor], density: float | None, distribution: str,
               keep_dense: Iterable[str], block: int) -> dict[str, float]:
    """Each chosen layer's density by its first name (none for a masked layer), ``_STAYS_DENSE`` for those that
    stay dense; checked before anything changes."""
    if isinstance(keep_dense, str):
        raise TypeError(f"keep_dense takes layer names (a list), got the string {keep_dense!r}")
    keep = set(keep_dense)
    by_name = {name: reg for reg in chosen for name in reg.names}
    unknown = sorted(keep - set(by_name))
    if unknown:
        raise ValueError(f"keep_dense names {unknown}, which are not nn.Linear layers chosen for sparsify")
    free = [reg for reg in chosen if id(reg.linear) not in masks]
    if not free:
        return {}
    if density is None:
        raise ValueError("pass density (the fraction of connections to keep) or a mask for every layer")
    dense_ids = {id(by_name[name].linear) for name in keep}
    if any(id(reg.linear) in masks for reg in chosen if id(reg.linear) in dense_ids):
        raise ValueError("a layer named in keep_dense also has a mask: give it one or the other")
    for reg in free:  # what the shares are computed from: a shape (not a lazy layer's), in whole vectors
        lazy = isinstance(reg.linear, LazyModuleMixin) and reg.linear.has_uninitialized_params()
        if lazy or reg.linear.out_features % block:
            _check_convertible(reg, block, needs_values=False)
    shapes = {reg.names[0]: tuple(reg.linear.weight.shape) for reg in free}
    weights = {reg.names[0]: reg.linear.weight for reg in free} if distribution == "global" else None
    densities = layer_densities(shapes, density, distribution, block=block, weights=weights,
                                keep_dense=[reg.names[0] for reg in free if id(reg.linear) in dense_ids])
    dense_names = {reg.names[0] for reg in free if id(reg.linear) in dense_ids}
    filled = distribution != "uniform" or bool(keep)  # a distribution chose the density: at 1, a layer stays dense
    return {name: _STAYS_DENSE if name in dense_names or (filled and d >= 1.0) else d
            for name, d in densities.items()}


def _registrations(model: nn.Module) -> list[_Registration]:
    """Every ``nn.Linear`` of ``model`` with all the names it is registered under, except attention ``out_proj``."""
    dense_only = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    found: dict[int, _Registration] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear) and id(module) not in dense_only:
            found.setdefault(id(module), _Registration(module)).names.append(name)
    return list(found.values())


def _accepted(reg: _Registration, filter: Callable[[str, nn.Linear], bool] | None) -> bool:  # noqa: A002
    if filter is None:
        return True
    verdicts = {name: bool(filter(name, reg.linear)) for name in reg.names}
    if len(set(verdicts.values())) > 1:
        yes = [n for n, v in verdicts.items() if v]
        no = [n for n, v in verdicts.items() if not v]
        raise ValueError(f"filter accepts {yes} but rejects {no}, which are one nn.Linear registered under several "
                         "names; it is replaced under all of its names or none: make filter agree on them")
    return next(iter(verdicts.values()))


def _check_convertible(reg: _Registration, block: int, needs_values: bool) -> None:
    problem = _conversion_problem(reg.linear, needs_values)
    if problem is None and reg.linear.out_features % block:
        problem = (f"its out_features={reg.linear.out_features} is not a multiple of block={block}, so it has no "
                   "whole vectors")
    if problem is not None:
        raise ValueError(f"cannot sparsify the layer at {reg}: {problem}; nothing was changed. Exclude it with "
                         f"filter= (e.g. filter=lambda name, m: name != {reg.names[0]!r})")


def _conversion_problem(linear: nn.Linear, needs_values: bool) -> str | None:
    """Why ``linear`` cannot become a SparseLinear without losing something, or None. ``needs_values``: its
    connections are chosen from its weights (by magnitude), which a layer on the meta device does not have."""
    if isinstance(linear, LazyModuleMixin) and linear.has_uninitialized_params():
        return "it is an uninitialised nn.LazyLinear: run a forward pass first (it then becomes an nn.Linear)"
    if parametrize.is_parametrized(linear):
        return ("it has parametrizations (torch.nn.utils.parametrize) a SparseLinear would not keep: remove them "
                "first with parametrize.remove_parametrizations")
    if type(linear) is not nn.Linear:
        return (f"it is a {type(linear).__name__}, a subclass of nn.Linear whose own forward or state would be lost "
                "(sparsify replaces exact nn.Linear only; convert it yourself with SparseLinear.from_dense)")
    extra = [n for n, p in linear._parameters.items() if p is not None and n not in ("weight", "bias")]
    extra += [*linear._buffers, *linear._modules]
    if extra:
        return (f"it holds {extra} besides weight and bias (torch.nn.utils.weight_norm adds weight_g and weight_v), "
                "which a SparseLinear would not keep")
    hooks = [kind.strip("_") for kind in _MODULE_HOOKS if getattr(linear, kind)]
    hooks += [f"{name}.{kind.strip('_')}" for name, p in linear.named_parameters(recurse=False)
              for kind in _TENSOR_HOOKS if getattr(p, kind, None)]
    if hooks:
        return f"it has hooks ({', '.join(hooks)}) that would not carry over to a SparseLinear: remove them first"
    weight, bias = linear.weight, linear.bias
    if weight.device.type == "meta" and needs_values:
        return ("its weight is on the meta device and has no values to choose connections by magnitude from: pass "
                "method='random' or a mask (or materialise it first: to_empty, then reset_parameters or "
                "load_state_dict)")
    if bias is not None and (bias.dtype, bias.device) != (weight.dtype, weight.device):
        return (f"its bias ({bias.dtype}, {bias.device}) and weight ({weight.dtype}, {weight.device}) differ in "
                "dtype or device; a SparseLinear has one of each")
    return None


def _check_untied_by_config(model: nn.Module, chosen: list[_Registration]) -> None:
    """Refuse a chosen layer whose weight a Hugging Face configuration ties to another parameter: the model's
    ``tie_weights()`` (``from_pretrained``, ``post_init``, ``resize_token_embeddings``) would assign that parameter
    to the sparse layer, whether or not the two share one Parameter now."""
    ties = configured_ties(model, [name for reg in chosen for name in reg.names])
    if not ties:
        return
    target, source = ties[0]
    reg = next(reg for reg in chosen if {_join(name, "weight") for name in reg.names} & {target, source})
    name = reg.names[0]
    raise ValueError(f"the model's configuration ties {target} to {source} (tie_word_embeddings), so the model's "
                     "tie_weights() (which from_pretrained, post_init and resize_token_embeddings call) would give "
                     f"the layer at {reg} that matrix in place of a SparseLinear's values. Nothing was changed. "
                     "Untie them first: model.config.tie_word_embeddings = False, and give the layer its own weight "
                     f"(model.get_submodule({name!r}).weight = "
                     f"torch.nn.Parameter(model.get_submodule({name!r}).weight.detach().clone())); or exclude it with "
                     f"filter=lambda name, m: name not in {sorted(reg.names)}")


def _check_untied(model: nn.Module, chosen: list[_Registration]) -> None:
    """Refuse a chosen layer whose weight or bias is also another module's parameter (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for reg in chosen:
        own = {_join(name, "weight") for name in reg.names} | {_join(name, "bias") for name in reg.names}
        for kind in ("weight", "bias"):
            param = getattr(reg.linear, kind)
            others = [n for n in owners.get(id(param), []) if n not in own] if param is not None else []
            if not others:
                continue
            tied = [n for other in chosen if other.linear is not reg.linear
                    and any(p is param for p in (other.linear.weight, other.linear.bias)) for n in other.names]
            exclude = sorted({*reg.names, *tied})
            raise ValueError(f"the {kind} of the nn.Linear at {reg} is the same Parameter as {others} (tied "
                             "weights); a SparseLinear stores its own values, so sparsify would untie them. Nothing "
                             f"was changed. Exclude it with filter=lambda name, m: name not in {exclude}")


def _masks_by_layer(masks: dict[str, torch.Tensor], chosen: list[_Registration]) -> dict[int, torch.Tensor]:
    """``masks`` (keyed by any name of a layer) checked and keyed by the layer's id."""
    by_name = {name: reg for reg in chosen for name in reg.names}
    unknown = sorted(set(masks) - set(by_name))
    if unknown:
        raise ValueError(f"masks given for {unknown}, which are not nn.Linear layers chosen for sparsify")
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, mask in masks.items():
        linear = by_name[name].linear
        if id(linear) in found:
            raise ValueError(f"masks given for both {found[id(linear)][0]!r} and {name!r}, which are one nn.Linear "
                             "registered under two names: give its mask once")
        if not isinstance(mask, torch.Tensor) or mask.shape != linear.weight.shape or mask.dtype != torch.bool:
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask for {name!r} must be a bool tensor of shape {tuple(linear.weight.shape)}, "
                             f"got {got}")
        found[id(linear)] = (name, mask)
    return {key: mask for key, (_, mask) in found.items()}


def _convert(linear: nn.Linear, mask: torch.Tensor | None, density: float | None, method: str,
             generator: torch.Generator | None, backward: str, block: int, constant_fan_in: bool = False
             ) -> SparseLinear:
    """The SparseLinear for ``linear``, with its parameters' ``requires_grad`` and its ``training`` flag."""
    if mask is None and constant_fan_in:
        mask = _fan_in_mask(linear.weight.detach(), density, method, generator, block)
    elif mask is None:
        mask = _mask(linear.weight.detach(), density, method, generator, block)
    if linear.weight.device.type == "meta":  # no values to keep: a meta layer with the chosen connections
        mask = mask.to(device="cpu", dtype=torch.bool)
        topology = CSRTopology.from_mask(CSRTopology.covering(mask, block) if block > 1 else mask, block=block)
        sparse = SparseLinear.from_topology(topology, bias=linear.bias is not None, backward=backward, device="meta",
                                            dtype=linear.weight.dtype, constant_fan_in=constant_fan_in)
    else:
        sparse = SparseLinear.from_dense(linear, mask, block=block, backward=backward)
        if constant_fan_in:
            check_constant_fan_in(sparse.topology, "the mask")
            set_constant_fan_in(sparse, True)
    sparse.weight.requires_grad_(linear.weight.requires_grad)
    if linear.bias is not None:
        sparse.bias.requires_grad_(linear.bias.requires_grad)
    return sparse.train(linear.training)


def _keep_encoders_off_nested_tensors(model: nn.Module) -> None:
    """``nn.TransformerEncoder`` in eval mode converts a padded input to a nested tensor for its layers' fused
    kernel, which sparse layers do not take: an encoder holding a sparse layer is told not to. (The layers
    themselves leave their fused kernel by the hook every SparseLinear carries:
    ``torch_sparse_metal.nn._off_fused_transformer_kernels``.)"""
    sparse_layers = {id(m) for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)
                     and (isinstance(m.linear1, SparseLinear) or isinstance(m.linear2, SparseLinear))}
    for encoder in model.modules():
        if isinstance(encoder, nn.TransformerEncoder) and any(id(layer) in sparse_layers for layer in encoder.layers):
            encoder.use_nested_tensor = False


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _fan_in_mask(weight: torch.Tensor, density: float, method: str, generator: torch.Generator | None,
                 block: int = 1) -> torch.Tensor:
    """The ``[out, in]`` mask of a constant fan-in layer: ``round(density * in)`` inputs of each output, its largest
    weights or drawn uniformly; with ``block`` V, as many vectors of each group of V outputs (by L2 norm)."""
    out_features, in_features = weight.shape
    groups = out_features // block
    k = CSRTopology.random_edge_count(in_features, groups, density, constant_fan_in=True) // max(groups, 1)
    if method == "magnitude":
        topology = CSRTopology.top_per_output(weight.reshape(groups, block, in_features).norm(dim=1), k)
    else:
        topology = CSRTopology.random(in_features, groups, k / in_features if in_features else 0.0,
                                      generator=generator, constant_fan_in=True)
    mask = topology.to_sparse_csr(torch.ones(topology.nnz)).to_dense() != 0  # [groups, in]
    mask = mask.view(groups, 1, in_features).expand(-1, block, -1).reshape(out_features, in_features)
    return mask.to(weight.device if method == "magnitude" else "cpu")


def _mask(weight: torch.Tensor, density: float, method: str, generator: torch.Generator | None,
          block: int) -> torch.Tensor:
    """The ``[out, in]`` mask of the chosen connections: ``k`` vectors of ``block`` outputs (elements for 1), by
    magnitude (a vector's L2 norm) or uniformly at random."""
    out_features, in_features = weight.shape
    k = CSRTopology.random_edge_count(in_features, out_features, density, block=block) // block
    score = weight.view(out_features // block, block, in_features).norm(dim=1)  # [groups, in]
    mask = torch.zeros(score.numel(), dtype=torch.bool, device=weight.device if method == "magnitude" else "cpu")
    if method == "magnitude":
        mask[score.flatten().topk(k).indices] = True
    else:  # drawn on the CPU (as generator is): a layer on the meta device gets real connections too
        mask[torch.randperm(score.numel(), generator=generator)[:k]] = True
    return mask.view(-1, 1, in_features).expand(-1, block, -1).reshape(out_features, in_features)
