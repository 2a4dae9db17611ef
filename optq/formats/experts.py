"""Mixture-of-experts layers as one linear per expert matrix, named as in the source checkpoint.

transformers 5 keeps a layer's routed experts fused: ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]`` (3-D parameters, no ``nn.Linear``), and renames some modules at
load time (Mixtral's ``block_sparse_moe`` becomes ``mlp``). Checkpoints on disk, and the serving
engines that read them (vLLM, GPTQModel), keep one 2-D matrix per expert under the original
names: ``block_sparse_moe.experts.3.w1.weight`` (Mixtral), ``mlp.experts.3.gate_proj.weight``
(Qwen-MoE, DeepSeek-V3, OLMoE). transformers records that conversion per model type
(``transformers.conversion_mapping``); this module reads it, in both directions:

- :func:`unfuse_experts` replaces every fused experts module by :class:`ExpertLinears`: one
  ``nn.Linear`` per expert matrix, the children named as the checkpoint names them
  (``experts.3.w1``), and a forward computing the same function (same routing, same order of
  accumulation). Each expert's linears then receive exactly the tokens routed to it, so the
  pipeline builds each expert's Hessian from its own tokens, and packs each expert like any linear.
- :func:`checkpoint_namer` maps the model's tensor names to the checkpoint's (the reverse of
  transformers' load-time renamings), for writing and for reading shards.

GPT-OSS's fused experts differ (transposed, biased, gate and up interleaved, a clamped SwiGLU);
transformers records no per-expert layout for them, so optq names them as GPTQModel and vLLM read
them (:data:`GPT_OSS`, docs/moe-checkpoints.md): ``experts.3.gate_proj`` holds the first half of
the fused ``gate_up_proj[3]`` columns, ``up_proj`` the second half, each with its bias, and the
forward concatenates the halves back before the model's own gate function.

A fused module of another layout (no gate, a post-expert norm, unexpected shapes) or whose model
type has no recorded per-expert checkpoint layout is left alone; :func:`unfuse_experts` returns it
with the reason, and the run reports its weights as float, by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ExpertLinears",
    "ExpertLinear",
    "ExpertsLayout",
    "GPT_OSS",
    "unfuse_experts",
    "checkpoint_namer",
    "layer_namer",
    "experts_layout",
    "is_router",
]

_PER_EXPERT = re.compile(r"experts\.\*\.(\w+)\.weight$")
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def is_router(name: str) -> bool:
    """True for a mixture-of-experts router (``mlp.gate``, ``router``, ``shared_expert_gate``)."""
    return name.rsplit(".", 1)[-1] in ROUTER_NAMES


@dataclass(frozen=True)
class ExpertsLayout:
    """How a fused module maps to per-expert linears: ``gate_up`` names the matrices stacked (in
    this order, along the output dimension) into ``gate_up_proj[e]``; ``down`` is ``down_proj[e]``.

    ``transposed``: the fused tensors are stored [E, in, out] (GPT-OSS), with biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H] that become the linears' biases;
    the gate/up halves are then those of the fused columns, interleaved or not: the activation is
    the fused module's own ``_apply_gate`` on the two halves concatenated back."""

    gate_up: tuple[str, ...]
    down: str
    transposed: bool = False


# transformers records no per-expert layout for GPT-OSS: these are the names GPTQModel's GPT-OSS
# definition and vLLM's expert mapping read (docs/moe-checkpoints.md).
GPT_OSS = ExpertsLayout(("gate_proj", "up_proj"), "down_proj", transposed=True)
_OWN_LAYOUTS = {"gpt_oss": GPT_OSS}
_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
_PLAIN = dict(zip(_FLAGS, (True, False, False, True, False)))  # Mixtral, Qwen-MoE, DeepSeek-V3
_TRANSPOSED = dict(zip(_FLAGS, (True, True, True, False, False)))  # GPT-OSS


def experts_layout(model: nn.Module) -> ExpertsLayout | None:
    """The per-expert checkpoint layout of this model type: the one transformers records, or for
    GPT-OSS (which transformers keeps fused on disk too) the one optq chose, :data:`GPT_OSS`."""
    own = _OWN_LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))
    if own is not None:
        return own
    gate_up = down = None
    for conv in _conversions(model):
        if type(conv).__name__ != "WeightConverter":
            continue
        targets = list(conv.target_patterns)
        leaves = [m.group(1) for m in (_PER_EXPERT.search(s) for s in conv.source_patterns) if m]
        ops = [type(op).__name__ for op in getattr(conv, "operations", [])]
        if len(targets) != 1 or len(leaves) != len(conv.source_patterns) or not ops or ops[0] != "MergeModulelist":
            continue
        if targets[0].endswith("experts.gate_up_proj") and len(leaves) == 2 and ops[1:] == ["Concatenate"]:
            gate_up = tuple(leaves)
        elif targets[0].endswith("experts.down_proj") and len(leaves) == 1 and len(ops) == 1:
            down = leaves[0]
    return ExpertsLayout(gate_up, down) if gate_up and down else None


def _conversions(model: nn.Module) -> list:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without load-time conversions: names are the checkpoint's
        return []
    try:
        convs = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # not a transformers model (custom nn.Module)
        return []
    return [c for c in convs if type(c).__name__ != "PrefixChange"]


def checkpoint_namer(model: nn.Module) -> Callable[[str], str]:
    """A function from the model's tensor names to the names its checkpoint stores them under.

    The identity for models transformers loads without renaming (every dense model optq has
    met); Mixtral's ``model.layers.0.mlp.experts.3.w1.weight`` becomes
    ``model.layers.0.block_sparse_moe.experts.3.w1.weight``. Apply it after
    :func:`unfuse_experts`: fused 3-D expert tensors have no per-expert name.
    """
    renamings = []
    for conv in reversed(_conversions(model)):
        if type(conv).__name__ == "WeightRenaming":
            renamings.append(conv.reverse_transform())
    if not renamings:
        return lambda name: name
    from transformers.core_model_loading import apply_renamings

    cache: dict[str, str] = {}

    def name(key: str) -> str:
        if key not in cache:
            cache[key] = apply_renamings(key, renamings)
        return cache[key]

    return name


class ExpertLinear(nn.Linear):
    """An expert matrix with a bias, computed as the fused experts do: ``x @ W.T``, then ``+ b``
    (``nn.Linear`` adds the bias inside the matrix product, which rounds differently at large
    widths). Packed, saved and loaded like any ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class _GatedAct:
    """``act(gate) * up``: the activation of the plain layouts."""

    def __init__(self, act_fn: Callable) -> None:
        self.act_fn = act_fn

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


class _FusedGate:
    """The fused module's own ``_apply_gate`` on the two halves concatenated back (GPT-OSS: the
    clamped SwiGLU over interleaved columns), bound to a copy of its settings (alpha, limit), not
    to the module, whose fused weights are freed."""

    def __init__(self, module: nn.Module) -> None:
        self.fn = type(module)._apply_gate
        self.settings = SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("_")})

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.fn(self.settings, torch.cat([gate, up], dim=-1))


class ExpertLinears(nn.ModuleList):
    """Routed experts as ``nn.Linear`` modules: ``self[e]`` holds expert ``e``'s matrices under
    their checkpoint names; ``forward(hidden_states, top_k_index, top_k_weights)`` is that of
    transformers' fused experts (``activation(gate(x), up(x))``, then ``down``, scaled by the
    routing weight and summed per token, experts in increasing order). ``activation`` is
    ``act(gate) * up``, or for GPT-OSS the model's clamped SwiGLU on the fused columns.

    The module holds weights only: the pipeline's Hessian passes swap in a forward of their own
    (``optq.pipeline.blocks.moe.collect.calibrating``) built from :meth:`routes` and :meth:`expert`.
    """

    def __init__(
        self,
        layout: ExpertsLayout,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        num_experts: int,
        hidden: int,
        inter: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        experts = []
        cls, bias = (ExpertLinear, True) if layout.transposed else (nn.Linear, False)
        for _ in range(num_experts):
            e = nn.Module()
            for leaf in layout.gate_up:
                setattr(e, leaf, cls(hidden, inter, bias=bias, device=device, dtype=dtype))
            setattr(e, layout.down, cls(inter, hidden, bias=bias, device=device, dtype=dtype))
            experts.append(e)
        super().__init__(experts)
        self.layout = layout
        # Not a child module: a ModuleList's children are its members (len, iteration, indexing).
        self.__dict__["activation"] = activation
        self.num_experts = num_experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` applied to the tokens ``x`` (without the routing weight)."""
        ex = self[e]
        gate, up = (getattr(ex, leaf)(x) for leaf in self.layout.gate_up)
        return getattr(ex, self.layout.down)(self.activation(gate, up))

    def routes(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> list[tuple[int, torch.Tensor, torch.Tensor] | None]:
        """Per expert ``e``: ``(e, tokens, weights)``, the indices of the tokens routed to it and
        their routing weights as a column, or None when no token is routed to it."""
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0)[: self.num_experts].tolist()
        out: list[tuple[int, torch.Tensor, torch.Tensor] | None] = []
        for e in range(self.num_experts):
            if not hit[e]:
                out.append(None)
                continue
            pos, idx = torch.where(mask[e])
            out.append((e, idx, top_k_weights[idx, pos, None]))
        return out

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for route in self.routes(top_k_index, top_k_weights):
            if route is None:
                continue
            e, idx, w = route
            y = self.expert(e, hidden_states[idx]) * w
            out.index_add_(0, idx, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, layout={self.layout}"


def _fused_reason(module: nn.Module, layout: ExpertsLayout | None) -> str | None:
    """Why a module holding 3-D expert parameters cannot become ExpertLinears of ``layout`` (the
    model type's; None: it has none) (None: it can)."""
    gu, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if gu is None or down is None:
        return "fused experts without gate_up_proj/down_proj"
    flags = _TRANSPOSED if layout is not None and layout.transposed else _PLAIN
    odd = [k for k, want in flags.items() if getattr(module, k, _PLAIN[k]) != want]
    if odd:
        return "fused experts with a layout optq does not unfuse (" + ", ".join(odd) + ")"
    if gu.dim() != 3 or down.dim() != 3 or not hasattr(module, "_apply_gate" if flags["is_transposed"] else "act_fn"):
        return "fused experts of an unknown layout"
    if flags["is_transposed"]:
        e, h, two_i = gu.shape
        shapes = [(down, (e, two_i // 2, h)), (module._parameters.get("gate_up_proj_bias"), (e, two_i))]
        shapes.append((module._parameters.get("down_proj_bias"), (e, h)))
    else:
        e, two_i, h = gu.shape
        shapes = [(down, (e, h, two_i // 2))]
    if two_i % 2 or any(t is None or tuple(t.shape) != want for t, want in shapes):
        return f"fused experts of unexpected shapes {tuple(gu.shape)} and {tuple(down.shape)}"
    return None


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding 3-D (fused) expert weights, by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if any(p.dim() == 3 for p in m._parameters.values() if p is not None)
    }


def unfuse_experts(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """Replace each fused experts module of ``model`` by :class:`ExpertLinears`, in place.

    Weights are copied per expert (meta tensors stay meta). Returns the names of the replaced
    modules and, for fused modules left as they are, ``{parameter name: reason}``.
    """
    fused = fused_experts(model)
    if not fused:
        return [], {}
    layout = experts_layout(model)
    done: list[str] = []
    left: dict[str, str] = {}
    for name, module in fused.items():
        reason = _fused_reason(module, layout)
        if reason is None and layout is None:
            reason = "fused experts of a model type whose per-expert checkpoint names transformers does not record"
        if reason is not None:
            for pname, p in module._parameters.items():
                if p is not None and p.dim() == 3:
                    left[f"{name}.{pname}"] = reason
            continue
        assert layout is not None
        new = _split(module, layout)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        done.append(name)
    return done, left


def _split(module: nn.Module, layout: ExpertsLayout) -> ExpertLinears:
    """``module``'s experts as ExpertLinears: each expert's fused gate/up split in two halves of
    its output rows, in the orientation of ``nn.Linear`` ([out, in]), biases with them."""
    gu, down = module.gate_up_proj, module.down_proj
    if layout.transposed:  # [E, H, 2I] and [E, I, H]: the linears' weights are their transposes
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
        activation: Callable = _FusedGate(module)
    else:
        activation = _GatedAct(module.act_fn)
    e, two_i, h = gu.shape
    inter = two_i // 2
    new = ExpertLinears(layout, activation, e, h, inter, device="meta", dtype=gu.dtype)
    for k in range(e):
        for leaf, rows in zip(layout.gate_up, (slice(0, inter), slice(inter, two_i))):
            getattr(new[k], leaf).weight = _param(gu[k, rows])
            if layout.transposed:
                getattr(new[k], leaf).bias = _param(module.gate_up_proj_bias[k, rows])
        getattr(new[k], layout.down).weight = _param(down[k])
        if layout.transposed:
            getattr(new[k], layout.down).bias = _param(module.down_proj_bias[k])
    return new


def _param(w: torch.Tensor) -> nn.Parameter:
    # A copy of its own per expert: views of one storage would share a version counter, and the
    # pipeline's solutions watch each weight's counter for changes.
    # Contiguous, also when ``w`` is a transposed view (GPT-OSS).
    if w.is_meta:
        data = torch.empty(w.shape, dtype=w.dtype, device="meta")
    else:
        data = w.detach().clone(memory_format=torch.contiguous_format)
    return nn.Parameter(data, requires_grad=False)


def layer_namer(names: Callable[[str], str]) -> Callable[[str], str]:
    """Module names from a tensor namer (:func:`checkpoint_namer`'s): a module ``m`` is named as
    its weight ``m.weight`` is, so that the packed tensors ``m.qweight``... sit where it did."""

    def name(module: str) -> str:
        full = names(f"{module}.weight")
        return full[: -len(".weight")] if full.endswith(".weight") else names(module)

    return name
