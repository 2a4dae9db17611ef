"""Each linear's own ``QuantConfig``: the run's, a per-layer override, and what the engines take.

A run has one ``QuantConfig``; :func:`resolve` gives every linear to quantize its own, before any
block is read:

1. ``overrides`` (``RunSettings.overrides``, ``--override``): ``(pattern, {field: value})`` pairs
   in order, patterns as ``include``'s (wildcards or ``re:REGEX``); the first pattern matching a
   layer replaces those ``QuantConfig`` fields for it (GPTQModel's ``dynamic`` works the same way).
2. The serving engines (``RunSettings.serve``): each layer's shape and settings are checked
   against the table in :mod:`optq.formats.engines`. Where the group size does not divide the
   layer's input width (SmolLM2's 576 with 128), the layer gets the largest group size that
   does and that the engines take (64), unless ``strict_groups``, which refuses instead, naming
   the layers. Any other refusal (bits or symmetry an engine cannot run, layers that vLLM fuses
   with different settings) stops the run before work, naming the layers, the engine and why.

The result, :class:`LayerSchemes`, is what the solver uses per layer, what the checkpoint's
``quantization_config`` records per layer, and what the report lists with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from optq.core.config import QuantConfig
from optq.formats.linears import get_weight
from optq.pipeline.discovery import select_names

__all__ = ["LayerSchemes", "resolve", "parse_overrides", "parse_override_text", "OVERRIDABLE"]

# normalize_tokens shapes the Hessian, which the linears reading one input share: one per run.
OVERRIDABLE = tuple(f.name for f in dataclasses.fields(QuantConfig) if f.name != "normalize_tokens")


def parse_overrides(value: Any) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Normalise ``overrides``: a mapping ``{pattern: {field: value}}`` or pairs, to a tuple of
    ``(pattern, fields)``; ValueError for a field ``QuantConfig`` lacks or a value it refuses."""
    if value is None:
        return ()
    items = list(value.items()) if isinstance(value, Mapping) else list(value)
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], Mapping)):
            raise ValueError(f"overrides entry {item!r}: give (pattern, {{field: value}}) pairs or a mapping")
        pattern, fields = item
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"overrides pattern {pattern!r} must be a non-empty string")
        unknown = sorted(set(fields) - set(OVERRIDABLE))
        if unknown or not fields:
            raise ValueError(
                f"overrides[{pattern!r}] sets {unknown or 'nothing'}; give QuantConfig fields of {OVERRIDABLE}"
            )
        try:  # each value checked as QuantConfig checks it
            QuantConfig(**{"act_order": fields.get("act_order", bool(fields.get("static_groups"))), **fields})
        except ValueError as exc:
            raise ValueError(f"overrides[{pattern!r}]: {exc}") from None
        out.append((pattern, dict(fields)))
    return tuple(out)


def parse_override_text(text: str) -> tuple[str, dict[str, Any]]:
    """``--override`` text ``PATTERN:FIELD=VALUE[,FIELD=VALUE...]`` (``*.down_proj:bits=8``,
    ``re:layers\\.0\\.:bits=8,group_size=64``) as ``(pattern, fields)``; booleans as true/false."""
    head, eq, rest = text.partition("=")
    pattern, colon, first = head.rpartition(":")
    if not (eq and colon and pattern and first):
        raise ValueError(f"--override {text!r}: write PATTERN:FIELD=VALUE[,FIELD=VALUE...], e.g. '*.down_proj:bits=8'")
    fields: dict[str, Any] = {}
    for part in f"{first}={rest}".split(","):
        key, sep, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in OVERRIDABLE:
            raise ValueError(f"--override {text!r}: {key!r} is not one of {OVERRIDABLE}")
        kind = next(f.type for f in dataclasses.fields(QuantConfig) if f.name == key).split(" ")[0]
        raw = raw.strip()
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "yes", "no", "1", "0"):
                    raise ValueError(raw)
                fields[key] = raw.lower() in ("true", "yes", "1")
            else:
                fields[key] = int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"--override {text!r}: {key}={raw!r} is not a {kind}") from None
    return pattern, fields


@dataclass
class LayerSchemes:
    """Every quantized linear's ``QuantConfig``: ``base`` (the run's) except the ``layers`` given
    their own, each with the reason in ``why``."""

    base: QuantConfig
    layers: dict[str, QuantConfig] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # one line per kind of change, for the summary

    def of(self, name: str) -> QuantConfig:
        """The config layer ``name`` is quantized with."""
        return self.layers.get(name, self.base)

    def to_dict(self) -> dict[str, Any]:
        """The report's ``schemes``: each layer that differs from the run's config, by name, with
        the fields that differ and why."""
        base = self.base.to_dict()
        return {
            name: {"changes": {k: v for k, v in cfg.to_dict().items() if v != base[k]}, "why": self.why.get(name, "")}
            for name, cfg in sorted(self.layers.items())
        }


def resolve(
    linears: Mapping[str, nn.Module],
    targets: Sequence[str],
    config: QuantConfig,
    overrides: Sequence[tuple[str, Mapping[str, Any]]] = (),
    *,
    serve: Sequence[str] = (),
    strict_groups: bool = False,
    fmt: str = "gptq",
) -> LayerSchemes:
    """The per-layer configs of ``targets`` (names in ``linears``, shapes from their weights, meta
    or real). Raises ValueError before any work for what no setting can fix (see the module)."""
    from optq.formats import engines

    names = sorted(targets)
    out = LayerSchemes(config)
    pattern_of: dict[str, str] = {}
    for pattern, fields in overrides:
        for name in select_names(names, [pattern]):  # raises for a pattern matching nothing
            if name in pattern_of:
                continue  # an earlier pattern decided this layer
            pattern_of[name] = pattern
            try:
                out.layers[name] = dataclasses.replace(config, **fields)
            except ValueError as exc:
                raise ValueError(f"override {pattern!r} on {name}: {exc}") from None
            out.why[name] = f"override {pattern!r}"
    if not serve:
        return out
    shapes = {n: tuple(get_weight(linears[n]).shape) for n in names}
    need = _needed(out, names, shapes, serve, fmt)  # name -> (asked, chosen) group size, for its own shape
    if strict_groups and need:
        shown = ", ".join(f"{n} ({shapes[n][1]})" for n in list(need)[:6]) + (" ..." if len(need) > 6 else "")
        raise ValueError(
            f"--strict-groups: {len(need)} layer(s) need another group size for {','.join(serve)} "
            f"(a group must divide the input width; widths in parentheses): {shown}. Choose a group size that "
            "divides every width, or drop --strict-groups to let optq choose one for those layers"
        )
    refit = _refit(out, need, names, serve, fmt)
    whole = set(refit) - set(need)  # fitted for the checkpoint's one scheme
    for name, (asked, chosen) in refit.items():
        out.layers[name] = dataclasses.replace(out.of(name), group_size=chosen)
        why = f"group size {chosen} instead of {asked}: " + (
            "one group size for every layer, as transformers reads GPTQ checkpoints"
            if name in whole
            else f"input width {shapes[name][1]} ({','.join(serve)})"
        )
        out.why[name] = f"{out.why[name]}; {why}" if name in out.why else why
    for (asked, chosen), members in _by_value(refit).items():
        widths = sorted({shapes[n][1] for n in members})
        out.notes.append(
            f"group size {chosen} instead of {asked} for {len(members)} layer(s) (input widths "
            f"{', '.join(map(str, widths))}) so that {', '.join(serve)} run them; --strict-groups refuses instead"
        )
    layers = {n: _shape(shapes[n], out.of(n)) for n in names}
    refused = [
        (engine, name, v)
        for engine, verdicts in engines.check_engines(layers, serve, fmt).items()
        for name, v in verdicts.items()
        if v.refused
    ]
    if refused:
        lines = [
            f"{name} ({engine}): " + "; ".join(f"{k}: {why}" for k, why in v.refusals)
            for engine, name, v in refused[:6]
        ]
        more = f" (and {len(refused) - 6} more)" if len(refused) > 6 else ""
        raise ValueError(
            f"{len(refused)} layer(s) would be refused by an engine named in --serve "
            f"({','.join(serve)}){more}:\n  " + "\n  ".join(lines) + "\nchange the settings of those layers "
            "(--override) or name only the engines you serve with (--serve)"
        )
    return out


def _refit(
    schemes: LayerSchemes, need: Mapping[str, tuple[int, int]], names: Sequence[str], serve: Sequence[str], fmt: str
) -> dict[str, tuple[int, int]]:
    """Layers whose group size changes: ``{name: (asked, chosen)}``.

    ``need``: the layers whose own shape needs another (``engines.group_size_for``: 576 with 128
    gives 64). transformers builds every layer of a GPTQ checkpoint from the config's one scheme
    (optimum reads no per-layer ``dynamic``), so when it is served from a GPTQ format, every layer
    asking the same group size gets the smallest size chosen among them (which the larger widths'
    divisors include)."""
    chosen = dict(need)
    if chosen and "transformers" in serve and fmt != "compressed-tensors":
        for asked in {a for a, _ in chosen.values()}:
            one = min((c for a, c in chosen.values() if a == asked and c != -1), default=-1)
            for name in names:
                if schemes.of(name).group_size == asked:
                    chosen[name] = (asked, one)
    return chosen


def _needed(
    schemes: LayerSchemes, names: Sequence[str], shapes: Mapping[str, tuple[int, ...]], serve: Sequence[str], fmt: str
) -> dict[str, tuple[int, int]]:
    """The layers whose own shape needs another group size: ``{name: (asked, chosen)}``."""
    from optq.formats import engines

    chosen: dict[str, tuple[int, int]] = {}
    cache: dict[tuple, int] = {}
    for name in names:
        cfg, (n_out, n_in) = schemes.of(name), shapes[name]
        key = (n_in, n_out, cfg.group_size, cfg.bits, cfg.sym)
        if key not in cache:
            try:
                cache[key] = engines.group_size_for(
                    n_in, cfg.group_size, engines=serve, bits=cfg.bits, sym=cfg.sym, out_features=n_out, fmt=fmt
                )
            except ValueError:  # no group size helps: the check after says what the engines refuse
                cache[key] = cfg.group_size
        if cache[key] != cfg.group_size:
            chosen[name] = (cfg.group_size, cache[key])
    return chosen


def _shape(shape: tuple[int, ...], cfg: QuantConfig) -> Any:
    from optq.formats.engines import LayerShape

    n_out, n_in = shape
    return LayerShape(n_in, n_out, cfg.bits, cfg.group_size, cfg.sym, not cfg.natural_groups)


def _by_value(items: Mapping[str, Any]) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = {}
    for k, v in items.items():
        out.setdefault(v, []).append(k)
    return out
