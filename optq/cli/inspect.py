"""``optq inspect FOLDER``: what a quantized checkpoint holds, its size, and which kernels take it."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from . import CliError

MARLIN_GROUPS = (-1, 32, 64, 128)
KINDS = ("attention", "experts (routed)", "shared experts", "routers", "dense MLP", "other")
_MLP = ("mlp", "block_sparse_moe", "feed_forward")
_EXPERTS = ("experts (routed)", "shared experts")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    p = subparsers.add_parser("inspect", help="describe a quantized checkpoint folder")
    p.add_argument("folder", type=Path, help="a folder written by `optq quantize` / optq.save")
    p.set_defaults(func=run)


def marlin_note(qc: dict) -> str:
    """Whether vLLM's Marlin kernels take these settings, and why not when they do not."""
    bits, group, sym = qc.get("bits"), qc.get("group_size"), qc.get("sym", True)
    reasons = []
    if bits not in (4, 8):
        reasons.append(f"bits={bits} (Marlin: 4 or 8)")
    if not sym:
        reasons.append("asymmetric (Marlin: symmetric only)")
    if group not in MARLIN_GROUPS:
        reasons.append(f"group_size={group} (Marlin: -1, 32, 64, 128)")
    return "yes" if not reasons else "no: " + ", ".join(reasons) + "; vLLM falls back to slower kernels"


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


def run(args: argparse.Namespace) -> int:
    """Print a summary (format, grid, layers, parameters, size, Marlin), the parameters by kind
    (attention, routed and shared experts, routers, dense MLP, other) quantized and float, the
    float weight matrices left in the decoder blocks, then the layers."""
    from optq.formats.files import natural_key, read_index, read_tensors

    folder: Path = args.folder
    try:
        config = json.loads((folder / "config.json").read_text())
        index = read_index(folder)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {folder}: {exc}") from None
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CliError(f"{folder}/config.json has no quantization_config: not a quantized checkpoint")
    ct = qc.get("quant_method") == "compressed-tensors"
    if ct:
        w = next(iter(qc.get("config_groups", {}).values()), {}).get("weights", {})
        view = {
            "bits": w.get("num_bits"),
            "group_size": w.get("group_size") or -1,
            "sym": w.get("symmetric", True),
            "desc_act": bool(w.get("actorder")),
        }
        fmt, marker = f"compressed-tensors ({qc.get('format', '?')})", ".weight_packed"
    else:
        view, marker = qc, ".qweight"
        fmt = f"GPTQ (checkpoint_format {qc.get('checkpoint_format', qc.get('format', 'gptq'))})"
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
    prefixes = tuple(f"{n}." for n in layers)
    quantized = sum(i * o for i, o in shapes.values())
    floats = sum(
        math.prod(shape)
        for key, (_, shape, dtype) in index.items()
        if dtype.is_floating_point and not (key.startswith(prefixes) and not key.endswith(".bias"))
    )
    tensor_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in index.values())
    disk = sum((folder / f).stat().st_size for f in {f for f, _, _ in index.values()})
    fp32 = 4 * (quantized + floats)
    bits, group = view.get("bits"), view.get("group_size")
    print(
        f"{folder}: {fmt}, {bits}-bit, group size {group}, "
        f"{'symmetric' if view.get('sym', True) else 'asymmetric'}, "
        f"act-order (desc_act): {'yes' if view.get('desc_act') else 'no'}"
    )
    print(f"quantized layers: {len(layers)}; parameters: {quantized / 1e6:.2f} M quantized, {floats / 1e6:.2f} M float")
    print(
        f"size on disk: {disk / 1e6:.1f} MB ({tensor_bytes / 1e6:.1f} MB of tensors); "
        f"fp32: {fp32 / 1e6:.1f} MB; ratio {disk / max(fp32, 1):.3f}"
    )
    matrices = float_matrices(index, prefixes)
    marlin = marlin_note(view)
    float_experts = [n for n, (_, _, kind) in matrices.items() if kind in _EXPERTS]
    if float_experts:
        shown = ", ".join(float_experts[:4]) + (" ..." if len(float_experts) > 4 else "")
        marlin = ("yes for the quantized layers" if marlin == "yes" else marlin) + (
            f"; expert weights left in float ({shown}) run unquantized"
        )
    print(f"vLLM Marlin kernels: {marlin}")
    print()
    for line in _by_kind(shapes, index, prefixes):
        print(line)
    if matrices:
        print("float weight matrices in the decoder blocks (not quantized):")
        for name, (count, shape, kind) in sorted(matrices.items(), key=lambda kv: natural_key(kv[0])):
            print(f"    {name}: {count} x {shape}, {kind}")
    width = max((len(n) for n in layers), default=5)
    print(f"\n  {'layer':{width}s} {'in':>6s} {'out':>6s}")
    for name in layers:
        n_in, n_out = shapes[name]
        print(f"  {name:{width}s} {n_in:6d} {n_out:6d}")
    print(f"\nquantization_config: {json.dumps(qc, sort_keys=True)}")
    return 0
