"""Byte counts of a plan's small files and safetensors headers (``optq.pipeline.planning.predict``)."""

from __future__ import annotations

import json
from typing import Any

import torch

from optq.formats.files import safetensors_header

# quantization_report.json: a layer's row (plus its name twice), a block's seconds, the rest.
_REPORT_BYTES_PER_LAYER, _REPORT_BYTES_PER_BLOCK, _REPORT_BYTES = 495, 26, 2900


def small_files(cfg: dict[str, Any], qconfig: dict[str, Any], n_blocks: int, targets: set[str], src: Any) -> int:
    """Bytes of config.json, quantize_config.json, the report, and the source's copied files."""
    conf = {k: v for k, v in cfg.items() if k != "quantization_config"} | {"quantization_config": qconfig}
    small = (
        json_len(conf)
        + json_len(qconfig)
        + _REPORT_BYTES
        + n_blocks * _REPORT_BYTES_PER_BLOCK
        + sum(_REPORT_BYTES_PER_LAYER + 2 * len(n) for n in targets)
    )
    if src is not None:
        from optq.pipeline.stream.assemble import COPIED, NOT_COPIED

        small += sum(
            p.stat().st_size for pat in COPIED for p in src.folder.glob(pat) if p.name not in NOT_COPIED and p.is_file()
        )
    return small


def header_bytes(entries: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of a safetensors header for these tensors, as optq writes it."""
    return len(safetensors_header(entries, {"format": "pt"})[1])


def json_len(obj: Any) -> int:
    return len((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
