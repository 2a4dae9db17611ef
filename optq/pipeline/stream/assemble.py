"""The end of a streaming run: the checkpoint assembled from the journal and the source.

The final shards hold the packed tensors of every block (from ``OUT.partial/blocks/``) and every
other tensor copied from the source as stored (a bf16 model's embeddings, norms and head stay
bf16), under the source checkpoint's own names; a fused GPT-OSS source's experts are cut out of
the fused tensors and written per expert, as ``optq.save`` writes them. Then ``config.json``
with the ``quantization_config`` (``optq.formats.layout``), the tokenizer and other small files,
and the report.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from optq.formats.checkpoint import REPORT_FILE
from optq.formats.files import INDEX, read_header, write_json, write_safetensors_lazily
from optq.pipeline.report import Report
from optq.pipeline.stream.fingerprint import check_reads
from optq.pipeline.stream.journal import Journal
from optq.pipeline.stream.source import SafetensorsSource, SourceError

__all__ = ["assemble", "local_folder", "COPIED", "NOT_COPIED"]

# Files of a model folder that are not weights and travel with the checkpoint (tokenizer, chat
# template, generation settings, provenance).
COPIED = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
NOT_COPIED = {"config.json", INDEX, REPORT_FILE, "quantize_config.json"}


def assemble(
    src: SafetensorsSource,
    journal: Journal,
    qconfig: dict[str, Any],
    report: Report,
    n_blocks: int,
    max_shard_size: int | str,
) -> None:
    """Write the final shards, config, tokenizer files and report into ``journal.final``: packed
    tensors from the journal, every other tensor copied from the source as stored, under the
    source's own names, one tensor in memory at a time."""
    folder = journal.final
    shutil.rmtree(folder, ignore_errors=True)  # a resumed assembly starts clean
    folder.mkdir()
    packed: dict[str, Path] = {}
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i in range(n_blocks):
        path = journal.block_file(i)
        for key, spec in read_header(path).items():
            packed[key] = path
            specs[key] = spec
    replaced = {k.rsplit(".", 1)[0] for k in packed}  # quantized layers
    # Fused stored experts (GPT-OSS) count as their per-expert slices: the quantized ones are in
    # the packed tensors, the others (left out with exclude) are written per expert, as stored.
    for key, (shape, dtype) in src.entries().items():
        if key.rsplit(".", 1)[0] not in replaced:  # a quantized layer's weight is in its packed tensors
            specs[key] = (shape, dtype)

    def fetch(key: str) -> torch.Tensor:
        # Each tensor copied out of a file opened just for it: mapped pages of open files would
        # stay resident, and the assembly would hold the whole output instead of one tensor.
        if key in packed:
            with safe_open(str(packed[key]), framework="pt") as f:
                return f.get_tensor(key).clone()
        tensor = src.tensor(key)
        # Embeddings and norms were read by the capture and the blocks: what is copied must be
        # what the run calibrated with, or the checkpoint would mix two models.
        check_reads(src, [src.stored(key)], journal.state.get("sources") or {}, f"cannot assemble {folder}")
        return tensor

    write_safetensors_lazily(folder, dict(sorted(specs.items())), fetch, max_shard_size)
    src.drop_fused()
    config = {k: v for k, v in src.config_dict.items() if k != "quantization_config"}
    config["quantization_config"] = qconfig
    write_json(folder / "config.json", config)
    if qconfig["quant_method"] == "gptq":
        write_json(folder / "quantize_config.json", qconfig)
    for pattern in COPIED:
        for path in sorted(src.folder.glob(pattern)):
            if path.name not in NOT_COPIED and path.is_file():
                shutil.copyfile(path, folder / path.name)
    write_json(folder / REPORT_FILE, report.to_dict())


def local_folder(source: str | Path) -> Path:
    """The local model folder of a folder, built-in name, .gguf file or hub id (its snapshot)."""
    from optq.data.zoo import resolve_model

    where = resolve_model(source)
    if isinstance(where, Path):
        return where
    try:  # a hub id: its local snapshot (downloaded once, safetensors only)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(where), allow_patterns=["*.json", "*.safetensors", *COPIED]))
    except Exception as exc:
        raise SourceError(f"cannot get a local snapshot of {where!r} ({exc})") from None
