"""Side-by-side quality of quantization variants: fp vs round-to-nearest vs GPTQ (and friends).

Every variant starts from the same fp model, calibrates on the same token windows and is
evaluated on the same evaluation windows, so the differences are the methods' alone. The
perplexity increase over the fp model is what a user pays; comparing it across evaluation
corpora (the calibration domain and others) shows how much of GPTQ's gain is specific to the
calibration distribution.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.eval.divergence import FIELDS, SAME, perplexity_and_divergence
from optq.eval.perplexity import perplexity_detail
from optq.pipeline import methods

__all__ = ["Variant", "parse_variant", "compare", "VARIANT_HELP"]

log = logging.getLogger("optq.compare")

VARIANT_HELP = (
    f"fp | {' | '.join(methods.names())} (with optq's default settings; gptaq is the default method), each optionally "
    "followed by +modifiers: +plain (textbook GPTQ: no act-order, no token normalisation, H not shrunk, min/max "
    "ranges), +no_act_order, +no_norm, +act_order (dynamic groups), +static_groups, +hmse (each group's range "
    "searched for the least rounding error weighted by H's diagonal: the default; rtn, with no H, then keeps min/max "
    "ranges), +mse (the same search unweighted), +minmax (no search: min/max ranges), +original (propagate "
    "unquantized activations), +sym / +asym, +g<N> (group size), +b<N> (bits), +damp<X>, +shrink<S> (H toward "
    "its diagonal; default 0.5, gptq+shrink0 is GPTQ without it); gptaq also +alpha<A> "
    "(the correction's scale) and +full (from the least-squares optimum); e.g. gptq+plain, rtn+mse, "
    "gptq+g64, gptq+shrink0.5, gptaq+alpha1"
)


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One row of a comparison: a method, its settings and how activations propagate; ``serve``:
    the engines its layers must run on (``RunSettings.serve``: GPTQ and round-to-nearest both take
    the group sizes they need); ``overrides``: per-layer settings of GPTQ (``RunSettings.overrides``);
    ``settings``: other RunSettings fields (GPTAQ's)."""

    name: str
    method: str  # "fp" or a registered method's name (``optq.pipeline.methods``)
    config: QuantConfig | None = None
    propagate: str = "quantized"
    serve: tuple[str, ...] = ()
    overrides: tuple[tuple[str, dict[str, Any]], ...] = ()
    settings: tuple[tuple[str, Any], ...] = ()


def parse_variant(spec: str, base: QuantConfig) -> Variant:
    """Parse ``gptq+act_order+mse`` style names against ``base`` settings."""
    method, *mods = spec.strip().split("+")
    if method == "fp":
        if mods:
            raise ValueError(f"variant 'fp' takes no modifiers, got {spec!r}")
        return Variant(name="fp", method="fp")
    if method not in methods.names():
        raise ValueError(f"unknown variant {spec!r}: {VARIANT_HELP}")
    own = methods.get(method)
    changes: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    propagate = "quantized"
    for mod in mods:
        if (setting := own.variant_setting(mod)) is not None:  # the method's own modifiers
            settings.update(setting)
        elif mod == "act_order":
            changes.update(act_order=True, static_groups=False)
        elif mod == "no_act_order":
            changes.update(act_order=False, static_groups=False)
        elif mod == "no_norm":
            changes["normalize_tokens"] = False
        elif mod == "plain":  # min/max ranges too, as the paper's GPTQ
            changes.update(
                act_order=False,
                static_groups=False,
                normalize_tokens=False,
                diag_shrink=0.0,
                mse=False,
                mse_hessian=False,
            )
        elif mod == "static_groups":
            changes.update(act_order=True, static_groups=True)
        elif mod == "mse":  # the unweighted search
            changes.update(mse=True, mse_hessian=False)
        elif mod == "minmax":  # no search: each range from the group's min and max
            changes.update(mse=False, mse_hessian=False)
        elif mod == "hmse":  # the mse search weighted by H's diagonal
            if not own.reads_hessian:
                raise ValueError(f"{spec!r}: +hmse weights the range search by the Hessian, which {method} never reads")
            changes.update(mse=True, mse_hessian=True)
        elif mod in ("sym", "asym"):
            changes["sym"] = mod == "sym"
        elif mod == "original":
            propagate = "original"
        elif mod[:1] in ("g", "b") and mod[1:].lstrip("-").isdigit():
            changes["group_size" if mod[0] == "g" else "bits"] = int(mod[1:])
        elif mod.startswith("damp") and _is_number(mod.removeprefix("damp")):
            changes["damp"] = float(mod.removeprefix("damp"))
        elif mod.startswith("shrink") and _is_number(mod.removeprefix("shrink")):
            changes["diag_shrink"] = float(mod.removeprefix("shrink"))
        else:
            raise ValueError(f"unknown modifier {mod!r} in {spec!r}: {VARIANT_HELP}")
    own.check_variant(spec.strip(), mods, propagate)
    return Variant(
        name=spec.strip(),
        method=method,
        config=dataclasses.replace(base, **changes),
        propagate=propagate,
        settings=tuple(settings.items()),
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def round_to_nearest(model: nn.Module, config: QuantConfig, serve: Sequence[str] = ()) -> dict[str, Any]:
    """Round every linear of the decoder blocks to nearest on ``config``'s grid, in place; with
    ``serve``, each layer on the grid the pipeline would give it for those engines (the group
    sizes of ``optq.pipeline.schemes.resolve``), so that it compares like for like with GPTQ."""
    from optq.core.solver import rtn
    from optq.formats.linears import find_linears, get_weight, set_weight
    from optq.pipeline.discovery import find_blocks
    from optq.pipeline.schemes import resolve

    prefix, blocks = find_blocks(model)
    linears = {n: m for i, block in enumerate(blocks) for n, m in find_linears(block, f"{prefix}.{i}").items()}
    schemes = resolve(linears, list(linears), config, serve=serve)
    with torch.no_grad():
        for name, module in linears.items():
            set_weight(module, rtn(get_weight(module), schemes.of(name)).weight)
    return {"layers": len(linears), "blocks": len(blocks)}


@dataclass
class VariantResult:
    """Perplexities (per evaluation corpus) and quantization cost of one variant; ``divergence``:
    per corpus, KL(fp || variant) and top-token agreement (``DivergenceResult``; empty without
    an fp reference)."""

    variant: Variant
    perplexity: dict[str, float] = field(default_factory=dict)
    detail: dict[str, dict[str, Any]] = field(default_factory=dict)
    divergence: dict[str, Any] = field(default_factory=dict)
    quantize_s: float = 0.0
    totals: dict[str, Any] = field(default_factory=dict)
    report: Any = None  # the pipeline's Report (with solutions), not serialised

    def to_dict(self) -> dict[str, Any]:
        v = self.variant
        return {
            "name": v.name,
            "method": v.method,
            "propagate": v.propagate if v.method != "fp" else None,
            "config": v.config.to_dict() if v.config else None,
            "settings": dict(v.settings),
            "perplexity": self.perplexity,
            # per corpus; None: not measured (no fp model in memory)
            **{f: {c: getattr(d, f) for c, d in self.divergence.items()} or None for f in FIELDS},
            "detail": self.detail,
            "quantize_s": self.quantize_s,
            "report_totals": self.totals,
        }


def compare(
    base_model: nn.Module | Callable[[], nn.Module],
    variants: Sequence[Variant],
    calibration: torch.Tensor,
    evaluation: Mapping[str, torch.Tensor],
    *,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    progress: bool = True,
    on_result: Callable[[VariantResult, nn.Module], None] | None = None,
) -> list[VariantResult]:
    """Quantize a fresh copy of ``base_model`` per variant and evaluate each on ``evaluation``.

    Args:
        base_model: the fp model (left untouched; each variant works on a deep copy), or a
            function returning a fresh fp model (such as a load from disk), called once per
            variant: then one model is in memory at a time, each freed before the next is made.
        calibration: LongTensor [n, seqlen] of calibration windows shared by all variants.
        evaluation: corpus name -> LongTensor [windows, seqlen] of evaluation windows (BOS
            already placed where the model needs it).
        on_result: called with (result, quantized model) after each variant, e.g. to print a
            row as soon as it is known or to save the model.

    When ``base_model`` is a model (not a loader, which keeps no fp model in memory), each
    variant's KL(fp || variant) per token and top-token agreement are measured too, on the same
    windows (``optq.eval.divergence``: the variant's perplexity then comes from the same forward,
    so it costs one more forward of the fp model per batch); fp's own row is 0 and 1.0 by definition.
    """
    from optq.core.memory import release_host_memory
    from optq.pipeline.run import quantize  # the pipeline pulls in transformers-aware code

    results = []
    for v in variants:
        model = base_model() if callable(base_model) and not isinstance(base_model, nn.Module) else None
        model = copy.deepcopy(base_model) if model is None else model
        res = VariantResult(variant=v)
        if v.method != "fp":  # every method through the pipeline, round-to-nearest too
            t = time.perf_counter()
            report = quantize(
                model,
                calibration,
                v.config,
                method=v.method,
                propagate=v.propagate,
                progress=progress,
                batch_size=batch_size,
                device=device,
                serve=v.serve,
                overrides=v.overrides,
                **dict(v.settings),
            )
            res.quantize_s = time.perf_counter() - t
            res.totals = report.totals
            res.report = report
        for corpus, windows in evaluation.items():
            if isinstance(base_model, nn.Module) and v.method != "fp":  # perplexity and KL from one forward
                d, res.divergence[corpus] = perplexity_and_divergence(
                    base_model, model, windows, batch_size=batch_size, progress=progress, device=device
                )
            else:
                d = perplexity_detail(
                    model, windows, seqlen=windows.shape[1], batch_size=batch_size, progress=progress, device=device
                )
                if isinstance(base_model, nn.Module):
                    res.divergence[corpus] = SAME
            res.perplexity[corpus] = d.perplexity
            res.detail[corpus] = d.to_dict()
            log.info("%s on %s: perplexity %.3f", v.name, corpus, d.perplexity)
        results.append(res)
        if on_result is not None:
            on_result(res, model)
        del model
        release_host_memory()  # the variant's model and its forwards' freed pages, before the next
    return results
