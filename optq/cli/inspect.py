"""``optq inspect FOLDER``: what a quantized checkpoint holds, its size, and which kernels take it."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import replace
from pathlib import Path

from optq.formats.schemes import LayerSetting

from . import CliError
from .inspect_engines import act_order, engine_lines, pattern, scheme_lines

MAX_ROWS = 200  # layers listed one per row; more are merged by pattern (--all-layers: never)
KINDS = ("attention", "experts (routed)", "shared experts", "routers", "dense MLP", "other")
_MLP = ("mlp", "block_sparse_moe", "feed_forward")
_EXPERTS = ("experts (routed)", "shared experts")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    p = subparsers.add_parser(
        "inspect",
        help="describe a quantized checkpoint folder",
        description=(
            "Describe a quantized checkpoint: format, size, which kernels each serving engine "
            "runs its layers on (or why it refuses them), act-order, per-layer settings and their "
            f"reasons, parameters by kind, then the layers (one row each up to {MAX_ROWS} layers; "
            "beyond, rows alike but for block and expert numbers are merged, with a count)."
        ),
    )
    p.add_argument("folder", type=Path, help="a folder written by `optq quantize` / optq.save")
    p.add_argument("--all-layers", action="store_true", help=f"one row per layer even past {MAX_ROWS} layers")
    p.set_defaults(func=run)


def kind_of(module: str) -> str:
    """Which of :data:`KINDS` a module (a checkpoint name without the tensor's last part) is.

    ``...experts.3.w1`` (or a fused ``...experts``) routed experts; ``shared_expert(s).``
    shared; a last part ``gate``/``router``/``shared_expert_gate`` a router; norms, embeddings
    and the head "other"; then ``attn``/``attention`` attention and ``mlp``/``block_sparse_moe``/
    ``feed_forward`` a dense MLP.
    """
    from optq.formats.experts import is_router

    parts = module.split(".")
    if re.search(r"(^|\.)experts(\.|$)", module):
        return "experts (routed)"
    if any(p in ("shared_expert", "shared_experts") for p in parts):
        return "shared experts"
    if is_router(module):
        return "routers"
    if "norm" in parts[-1]:
        return "other"
    if any("attn" in p or "attention" in p for p in parts):
        return "attention"
    if any(p in _MLP for p in parts):
        return "dense MLP"
    return "other"


def float_matrices(index: dict, quantized: tuple[str, ...]) -> dict[str, list]:
    """Float weights of >= 2 dimensions in the decoder blocks (names with a block number) that
    are not quantized: ``{name with numbers as *: [count, first shape, kind]}``."""
    out: dict[str, list] = {}
    for key, (_, shape, dtype) in index.items():
        if len(shape) < 2 or not dtype.is_floating_point or key.startswith(quantized) or key.endswith("bias"):
            continue  # per-expert biases are 2-D too, but no weight matrix
        if not re.search(r"\.\d+\.", key):
            continue  # embeddings, head: outside the blocks
        pattern = re.sub(r"\.\d+\.", ".*.", key)
        row = out.setdefault(pattern, [0, list(shape), kind_of(key.rpartition(".")[0])])
        row[0] += 1
    return out


def _by_kind(layers: dict[str, tuple[int, int]], index: dict, prefixes: tuple[str, ...]) -> list[str]:
    """The lines of the per-kind table (kinds holding no parameter left out)."""
    counts = {k: [0, 0] for k in KINDS}
    for name, (n_in, n_out) in layers.items():
        counts[kind_of(name)][0] += n_in * n_out
    for key, (_, shape, dtype) in index.items():
        if dtype.is_floating_point and not (key.startswith(prefixes) and not key.endswith(".bias")):
            counts[kind_of(key.rpartition(".")[0])][1] += math.prod(shape)
    lines = [f"{'parameters by kind':20s} {'quantized':>16s} {'float':>16s}"]
    lines += [f"  {k:18s} {q:16,d} {f:16,d}" for k, (q, f) in counts.items() if q or f]
    return lines


def _method(report: dict | None) -> str:
    """The method (and shrink) the run used, from its report, as " by gptaq (H shrunk 0.5 toward its
    diagonal)", or that it read no calibration activation; empty without a report that says."""
    report = report or {}
    method = (report.get("options") or {}).get("method")
    if method is None:
        return ""
    if report.get("unmeasured") is not None:  # a run from the weights alone: no H, no layer error
        return f" by {method} from the weights alone (no calibration forward: layer errors not measured)"
    shrink = (report.get("config") or {}).get("diag_shrink") or 0
    return f" by {method}" + (f" (H shrunk {shrink:g} toward its diagonal)" if shrink else "")


def _probes_line(folder: Path) -> str:
    """What the folder's optq_probes.json records (optq verify's expected outputs), or that it has none."""
    from optq.formats.probes import PROBES_FILE, read

    try:
        probes = read(folder)
    except ValueError as exc:
        return f"expected outputs: unreadable ({exc})"
    if probes is None:
        return f"expected outputs: none ({PROBES_FILE} absent: `optq verify` has nothing to compare)"
    n, k = len(probes["prompts"]), probes.get("top_k")
    return f"expected outputs: {PROBES_FILE}, {n} prompts x {probes.get('new_tokens')} greedy tokens, top-{k} logprobs"


def _report(folder: Path) -> tuple[dict | None, str | None]:
    """The folder's quantization_report.json (None when absent), and why it could not be read."""
    path = folder / "quantization_report.json"
    if not path.exists():
        return None, None
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"{path.name} unreadable ({exc}): reasons and act-order from the config alone"
    return (report, None) if isinstance(report, dict) else (None, f"{path.name} is no JSON object")


def _layers(folder: Path, index: dict, qc: dict) -> tuple[str, str, dict, dict, LayerSetting, bool]:
    """(format in words, engine format, {layer: (in, out)}, {layer: LayerSetting}, the base
    setting, act-order with static groups per the config) of the layers holding packed tensors."""
    from optq.formats.files import natural_key, read_tensors
    from optq.formats.schemes import base_setting, layer_schemes

    ct = qc.get("quant_method") == "compressed-tensors"
    if ct:
        engine_fmt, marker = "compressed-tensors", ".weight_packed"
        fmt = f"compressed-tensors ({qc.get('format', '?')})"
    else:
        engine_fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        fmt, marker = f"GPTQ (checkpoint_format {engine_fmt})", ".qweight"
    layers = sorted((k[: -len(marker)] for k in index if k.endswith(marker)), key=natural_key)
    shapes = {}
    try:
        for name in layers:
            if ct:
                n_out, n_in = next(read_tensors(folder, index, [f"{name}.weight_shape"]))[1].tolist()
            else:
                n_in, n_out = index[f"{name}.g_idx"][1][0], index[f"{name}.qweight"][1][1]
            shapes[name] = (int(n_in), int(n_out))
    except (KeyError, ValueError) as exc:
        raise CliError(f"cannot read {folder}: layer {name} is incomplete ({exc})") from None
    settings = layer_schemes(qc, layers)
    if ct:  # actorder "static", the only act-order optq reads there, keeps g_idx natural: no reordering
        static = any(s.desc_act for s in settings.values())
        settings = {n: replace(s, desc_act=False) for n, s in settings.items()}
        base = base_setting(settings) if settings else LayerSetting(0, -1, True, False)
        return fmt, engine_fmt, shapes, settings, base, static
    sym, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    base = LayerSetting(qc.get("bits"), qc.get("group_size", -1), sym, desc_act)
    return fmt, engine_fmt, shapes, settings, base, bool(qc.get("static_groups")) and not desc_act


def _rows(shapes: dict, settings: dict, merged: bool) -> list[str]:
    """The layer table: one row per layer, or (``merged``) one per pattern, shape and setting."""
    rows: dict[tuple, int] = {}
    for name, (n_in, n_out) in shapes.items():
        key = (pattern(name) if merged else name, n_in, n_out, settings[name])
        rows[key] = rows.get(key, 0) + 1
    width = max((len(k[0]) for k in rows), default=5)
    count = f" {'count':>6s}" if merged else ""
    lines = [f"  {'layer':{width}s}{count} {'in':>6s} {'out':>6s} {'bits':>4s} {'group':>5s} sym"]
    for (name, n_in, n_out, s), n in rows.items():
        count = f" {n:6d}" if merged else ""
        sym = "yes" if s.sym else "no"
        lines.append(f"  {name:{width}s}{count} {n_in:6d} {n_out:6d} {s.bits:4d} {s.group_size:5d} {sym}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print a summary (format, base setting, act-order, layers, parameters, size), per serving
    engine the kernels that run the layers and the refusals with reasons, the parameters by kind
    (attention, routed and shared experts, routers, dense MLP, other) quantized and float, the
    float weight matrices left in the decoder blocks, the layers whose setting differs and why,
    then the layers (merged by pattern past :data:`MAX_ROWS`, unless ``--all-layers``)."""
    from optq.formats.engines import LayerShape
    from optq.formats.files import CheckpointError, natural_key, read_config, read_index

    folder: Path = args.folder
    try:
        config = read_config(folder)
        index = read_index(folder)
    except CheckpointError as exc:  # names the file and what is wrong with it
        raise CliError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {folder}: {exc}") from None
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CliError(f"{folder}/config.json has no quantization_config: not a quantized checkpoint")
    fmt, engine_fmt, shapes, settings, base, static = _layers(folder, index, qc)
    report, unreadable = _report(folder)
    ct = engine_fmt == "compressed-tensors"
    prefixes = tuple(f"{n}." for n in shapes)
    quantized = sum(i * o for i, o in shapes.values())
    floats = sum(
        math.prod(shape)
        for key, (_, shape, dtype) in index.items()
        if dtype.is_floating_point and not (key.startswith(prefixes) and not key.endswith(".bias"))
    )
    tensor_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in index.values())
    disk = sum((folder / f).stat().st_size for f in {f for f, _, _ in index.values()})
    fp32 = 4 * (quantized + floats)
    differ = sum(1 for s in settings.values() if s != base)
    group = base.group_size
    print(
        f"{folder}: {fmt}, {base.bits}-bit, group size {group}, "
        f"{'symmetric' if base.sym else 'asymmetric'}"
        + (f" (base; {differ} layers differ: see schemes)" if differ else "")
        + f", act-order: {act_order(report, base.desc_act, static)}"
    )
    print(
        f"quantized layers: {len(shapes)}{_method(report)}; parameters: {quantized / 1e6:.2f} M quantized, "
        f"{floats / 1e6:.2f} M float"
    )
    print(
        f"size on disk: {disk / 1e6:.1f} MB ({tensor_bytes / 1e6:.1f} MB of tensors); "
        f"fp32: {fp32 / 1e6:.1f} MB; ratio {disk / max(fp32, 1):.3f}"
    )

    def shape(name: str, s: LayerSetting) -> LayerShape:
        return LayerShape(*shapes[name], s.bits, s.group_size, s.sym, s.desc_act)

    layer_shapes = {n: shape(n, s) for n, s in settings.items()}
    base_shape = None if ct or not shapes else LayerShape(1, 1, base.bits, base.group_size, base.sym, base.desc_act)
    served = (report.get("options") or {}).get("serve", []) if report else None
    for line in engine_lines(layer_shapes, engine_fmt, base_shape, served):
        print(line)
    matrices = float_matrices(index, prefixes)
    float_experts = [n for n, (_, _, kind) in matrices.items() if kind in _EXPERTS]
    if float_experts:
        shown = ", ".join(float_experts[:4]) + (" ..." if len(float_experts) > 4 else "")
        print(f"  expert weights left in float ({shown}) run unquantized on every engine")
    if unreadable:
        print(f"note: {unreadable}")
    print(_probes_line(folder))
    print()
    for line in _by_kind(shapes, index, prefixes):
        print(line)
    if matrices:
        print("float weight matrices in the decoder blocks (not quantized):")
        for name, (count, shape_, kind) in sorted(matrices.items(), key=lambda kv: natural_key(kv[0])):
            print(f"    {name}: {count} x {shape_}, {kind}")
    for line in scheme_lines(settings, base, report):
        print(line)
    print()
    for line in _rows(shapes, settings, len(shapes) > MAX_ROWS and not args.all_layers):
        print(line)
    print(f"\nquantization_config: {json.dumps(qc, sort_keys=True)}")
    return 0
