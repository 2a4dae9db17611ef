"""``optq inspect FOLDER``: what a quantized checkpoint holds, its size, and which kernels take it."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from . import CliError

MARLIN_GROUPS = (-1, 32, 64, 128)


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


def run(args: argparse.Namespace) -> int:
    """Print a summary (format, grid, layers, parameters, size, Marlin), then the layers."""
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
        view = {"bits": w.get("num_bits"), "group_size": w.get("group_size") or -1, "sym": w.get("symmetric", True),
                "desc_act": bool(w.get("actorder"))}
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
    floats = sum(math.prod(shape) for key, (_, shape, dtype) in index.items()
                 if dtype.is_floating_point and not (key.startswith(prefixes) and not key.endswith(".bias")))
    tensor_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in index.values())
    disk = sum((folder / f).stat().st_size for f in {f for f, _, _ in index.values()})
    fp32 = 4 * (quantized + floats)
    bits, group = view.get("bits"), view.get("group_size")
    print(f"{folder}: {fmt}, {bits}-bit, group size {group}, "
          f"{'symmetric' if view.get('sym', True) else 'asymmetric'}, "
          f"act-order (desc_act): {'yes' if view.get('desc_act') else 'no'}")
    print(f"quantized layers: {len(layers)}; parameters: {quantized / 1e6:.2f} M quantized, "
          f"{floats / 1e6:.2f} M float")
    print(f"size on disk: {disk / 1e6:.1f} MB ({tensor_bytes / 1e6:.1f} MB of tensors); "
          f"fp32: {fp32 / 1e6:.1f} MB; ratio {disk / max(fp32, 1):.3f}")
    print(f"vLLM Marlin kernels: {marlin_note(view)}")
    width = max((len(n) for n in layers), default=5)
    print(f"\n  {'layer':{width}s} {'in':>6s} {'out':>6s}")
    for name in layers:
        n_in, n_out = shapes[name]
        print(f"  {name:{width}s} {n_in:6d} {n_out:6d}")
    print(f"\nquantization_config: {json.dumps(qc, sort_keys=True)}")
    return 0
