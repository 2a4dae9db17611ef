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
    """Print the config, the quantized layers, size on disk against fp32, Marlin support."""
    from optq.formats.files import read_index

    folder: Path = args.folder
    try:
        config = json.loads((folder / "config.json").read_text())
        index = read_index(folder)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {folder}: {exc}") from None
    qc = config.get("quantization_config")
    if qc is None:
        raise CliError(f"{folder}/config.json has no quantization_config: not a quantized checkpoint")
    ct = qc.get("quant_method") == "compressed-tensors"
    if ct:
        w = next(iter(qc.get("config_groups", {}).values()), {}).get("weights", {})
        view = {"bits": w.get("num_bits"), "group_size": w.get("group_size") or -1, "sym": w.get("symmetric", True)}
        marker = ".weight_packed"
    else:
        view, marker = qc, ".qweight"
    print("quantization_config:")
    print(json.dumps(qc, indent=2, sort_keys=True))
    bits, group = view.get("bits"), view.get("group_size")
    layers = sorted(k[: -len(marker)] for k in index if k.endswith(marker))
    fp32 = disk = 0
    print(f"\n{len(layers)} quantized layers:")
    print(f"  {'layer':60s} {'in':>6s} {'out':>6s} {'bits':>4s} {'group':>5s}")
    for key, (_, shape, dtype) in index.items():
        disk += math.prod(shape) * dtype.itemsize
        name = key.rsplit(".", 1)[0]
        if name not in layers and dtype.is_floating_point:
            fp32 += 4 * math.prod(shape)
    for name in layers:
        if ct:
            n_out, n_in = [int(x) for x in _weight_shape(folder, index, name)]
        else:
            n_in, n_out = len_k(index, name), index[f"{name}.qweight"][1][1]
        fp32 += 4 * n_in * n_out + (4 * n_out if f"{name}.bias" in index else 0)
        print(f"  {name:60s} {n_in:6d} {n_out:6d} {bits:4d} {group:5d}")
    print(f"\nsize on disk: {disk / 1e6:.1f} MB (tensors); fp32 original: {fp32 / 1e6:.1f} MB "
          f"(from shapes); ratio {disk / max(fp32, 1):.3f}")
    print(f"vLLM Marlin kernels: {marlin_note(view)}")
    return 0


def len_k(index: dict, name: str) -> int:
    """in_features of a GPTQ layer: the length of its g_idx."""
    return index[f"{name}.g_idx"][1][0]


def _weight_shape(folder: Path, index: dict, name: str) -> list[int]:
    from optq.formats.files import read_tensors

    return next(read_tensors(folder, index, [f"{name}.weight_shape"]))[1].tolist()
