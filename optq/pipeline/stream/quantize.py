"""Quantize a model folder larger than memory: one block at a time, written as it finishes.

``quantize_pretrained(source, out, calibration, config)`` builds the model on the meta device,
reads each decoder block from the safetensors shards only while it is quantized (seam 1,
``optq.pipeline.stream.source``), packs the block's layers and writes them to the resume journal in
``OUT.partial/`` (``optq.pipeline.stream.journal``), then frees the block. At the end the checkpoint
is assembled shard by shard: packed tensors from the journal, every other tensor copied from
the source as stored (a bf16 model's embeddings, norms and head stay bf16), under the source's
own names: the packed layers too, a Mixtral expert's as ``block_sparse_moe.experts.3.w1.qweight``
where transformers names the module ``mlp.experts.3.w1``. Peak memory: the runtime, the
calibration activations, one block in the compute dtype and its solve, the embeddings, and one
output shard at the end; not the model's depth.

A run killed at any moment resumes with ``resume=True`` (``--resume``) after the last finished
block, from the activations saved with it, and ends with the same bytes as an uninterrupted run
at the same thread count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from optq.core.config import QuantConfig
from optq.formats import compressed_tensors
from optq.formats.checkpoint import REPORT_FILE, layer_namer
from optq.formats.experts import checkpoint_namer
from optq.formats.files import INDEX, read_header, write_json, write_safetensors_lazily
from optq.formats.gptq_config import describe_gptq, is_natural
from optq.formats.linears import find_linears
from optq.formats.qlinear import QuantLinear
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.block import quantize_block
from optq.pipeline.distributed.ranks import current
from optq.pipeline.stream.journal import Journal
from optq.pipeline.blocks.loop import _versions, check_finite_weights, prepare
from optq.pipeline.report import LayerReport, Report
from optq.pipeline.stream.source import SafetensorsSource, SourceError

__all__ = ["quantize_pretrained", "local_folder", "STREAM_FORMATS"]

log = logging.getLogger("optq.pipeline")
STREAM_FORMATS = ("gptq", "gptq_v2", "compressed-tensors")
# Files of a model folder that are not weights and travel with the checkpoint (tokenizer, chat
# template, generation settings, provenance).
_COPIED = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
_NOT_COPIED = {"config.json", INDEX, REPORT_FILE, "quantize_config.json"}


def quantize_pretrained(
    source: str | Path,
    out: str | Path,
    calibration: Any,
    config: QuantConfig,
    *,
    tokenizer: Any = None,
    format: str = "gptq",
    max_shard_size: int | str = "5GB",
    compute_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    propagate: str = "quantized",
    nsamples: int | None = None,
    seqlen: int | None = None,
    seed: int = 0,
    include: Any = None,
    exclude: Any = None,
    batch_size: int = 8,
    method: str = "gptq",
    strategy: str = "replay",
    resume: bool = False,
    overwrite: bool = False,
    offload_activations: bool = False,
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
    moe_calibration: str = "all",
    moe_min_tokens: int | None = None,
    max_hessian_memory: int | None = None,
    moe_weighting: str = "none",
    hessian_dtype: str = "float32",
) -> Report:
    """Quantize the safetensors model at ``source`` into the checkpoint folder ``out``.

    Example::

        >>> report = quantize_pretrained("smollm2-135m", "out/smol-4bit", token_ids,
        ...                              optq.QuantConfig(bits=4, group_size=128))  # doctest: +SKIP

    ``source``: a model folder, a built-in name, or a hub id (its local snapshot). The other
    arguments are those of :func:`optq.quantize`, plus: ``format`` ("gptq" or "gptq_v2"),
    ``max_shard_size`` of the output (transformers' default, 5GB), ``compute_dtype`` of the
    block forwards (default float32 on CPU, the source dtype on CUDA), ``resume`` (continue an
    interrupted run in ``OUT.partial/``) and ``overwrite`` (replace ``out``, or start a partial
    run again), ``offload_activations`` (keep the calibration activations in a memory-mapped
    file in ``OUT.partial/`` rather than in RAM, for runs whose nsamples x seqlen x hidden does
    not fit; CPU only), ``provenance`` (what the caller wants recorded in the report's options, such as
    the model name and corpus given on the command line). Returns the report, also written to ``out/quantization_report.json``; its
    ``solutions`` are empty (each block's are packed and freed as it finishes).
    """
    if offload_activations and device is not None and torch.device(device).type != "cpu":
        raise ValueError("offload_activations keeps activations in a memory-mapped file: CPU only")
    if format not in STREAM_FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {STREAM_FORMATS}")
    if format == "compressed-tensors":
        compressed_tensors.check_exportable({"desc_act": config.act_order and not config.static_groups,
                                             "static_groups": config.static_groups})
    start = time.perf_counter()
    src = SafetensorsSource(local_folder(source))
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = compute_dtype or (torch.float32 if device.type == "cpu" else src.dtype)
    model = src.skeleton(dtype)
    run = prepare(model, calibration, config, propagate=propagate, tokenizer=tokenizer, nsamples=nsamples,
                  seqlen=seqlen, seed=seed, include=include, exclude=exclude, device=device,
                  batch_size=batch_size, method=method, strategy=strategy, moe_calibration=moe_calibration,
                  moe_min_tokens=moe_min_tokens, max_hessian_memory=max_hessian_memory,
                  moe_weighting=moe_weighting, hessian_dtype=hessian_dtype)
    src.use_names(checkpoint_namer(model))  # after prepare, which splits fused experts per expert
    options = {**run.options, "format": format, "max_shard_size": str(max_shard_size),
               "compute_dtype": str(dtype).removeprefix("torch."), "source_dtype": str(src.dtype).removeprefix("torch."),
               "streaming": True, **(provenance or {})}
    manifest = {
        "source": _source_digest(src),
        "calibration": run.calibration_digest,
        "config": config.to_dict(),
        "options": {k: v for k, v in options.items() if k not in ("num_threads", "device")},
        "versions": _versions(),
    }
    dist = current()
    journal = Journal(out, manifest, resume=resume, overwrite=overwrite, dist=dist)
    report = Report(layers={}, config=config.to_dict(), options=options, versions=_versions(),
                    seconds=0.0, block_seconds=[], skipped=dict(run.skipped))
    _restore(report, journal.state.get("report"))
    blocks, prefix = run.blocks, run.blocks_name
    head = _head_name(model)
    outside = (f"{prefix}.", *((f"{head}.",) if head else ()))
    log.info("streaming %d blocks of %s from %s (%s) in %s on %s, %d x %d calibration tokens",
             len(blocks), prefix, src.folder, options["source_dtype"], options["compute_dtype"], device,
             options["nsamples"], options["seqlen"])
    if journal.done < len(blocks):  # else killed while assembling: only that is left to do
        with torch.no_grad():
            src.load(model, "", device, dtype, skip=outside)  # embeddings, final norm
            _buffers_to(model, device)  # rotary tables
            src.load(blocks[0], f"{prefix}.0", device, dtype)  # the capture runs block 0 once
            hidden, calls = capture.capture_inputs(model, blocks, run.batches, device)
            src.release(model, skip=(f"{prefix}.",))  # the embeddings served the capture only
            if journal.done:
                src.release(blocks[0])
                hidden.clear()  # the journal's activations replace the captured ones
                hidden = [h.to(device) for h in journal.activations()]
            if offload_activations:
                hidden = journal.offload(hidden)
            _blocks(src, journal, run, config, hidden, calls, report, dtype, format, progress and dist.rank == 0)
            del hidden, calls
            src.release(model)
    natural = journal.state["report"].get("natural", True)
    qconfig = describe_gptq(bits=config.bits, group_size=config.group_size, sym=config.sym, natural=natural,
                            static_groups=bool(config.static_groups), damp=config.damp,
                            checkpoint_format="gptq_v2" if format == "compressed-tensors" else format)
    if format == "compressed-tensors":
        ignore = compressed_tensors.ignored(model, run.targets, layer_namer(src.names))
        qconfig = compressed_tensors.describe(qconfig, ignore)
    report.seconds = time.perf_counter() - start
    if dist.rank == 0:  # one writer: the other ranks' results are in rank 0's journal
        with journal.writing(journal.folder):
            _assemble(src, journal, qconfig, report, len(blocks), max_shard_size)
            journal.finish()
    dist.barrier()
    log.info("wrote %s in %.1f s", journal.out, report.seconds)
    return report


def _blocks(src: SafetensorsSource, journal: Journal, run: Any, config: QuantConfig, hidden: list[torch.Tensor],
            calls: list[list[capture.Call]], report: Report, dtype: torch.dtype, fmt: str, progress: bool) -> None:
    from tqdm.auto import tqdm

    blocks, prefix = run.blocks, run.blocks_name
    opts = {**run.options, "device": run.device, "dist": current()}
    natural = (journal.state.get("report") or {}).get("natural", True)
    module_name = layer_namer(src.names)  # packed tensors go under the checkpoint's names
    bar = tqdm(total=len(blocks), initial=journal.done, desc="optq", unit="block", disable=not progress)
    try:
        for i in range(journal.done, len(blocks)):
            t0 = time.perf_counter()
            name = f"{prefix}.{i}"
            block = blocks[i]
            if i > 0 or journal.done:
                src.load(block, name, run.device, dtype)  # seam 1: where a block's weights come from
            linears = find_linears(block, name)
            check_finite_weights({n: m for n, m in linears.items() if n in run.targets})
            quantize_block(name, block, hidden, calls[i], run.targets, config, opts, report, bar)
            packed: dict[str, torch.Tensor] = {}
            for lname, module in linears.items():
                sol = report.solutions.pop(lname, None)
                if sol is None or opts["dist"].rank != 0:  # rank 0 alone writes the journal
                    continue
                layer = QuantLinear.from_solution(sol, module.bias, "gptq_v2" if fmt == "compressed-tensors" else fmt)
                natural = natural and is_natural(layer)
                if fmt == "compressed-tensors":
                    tensors = compressed_tensors.export_layer(lname, layer, sym=config.sym, dtype=src.dtype)
                else:
                    tensors = layer.state_dict()
                packed.update({f"{module_name(lname)}.{k}": v for k, v in tensors.items()})
            src.release(block)
            report.block_seconds.append(time.perf_counter() - t0)
            journal.write_block(i, packed)
            last = i + 1 == len(blocks)
            journal.commit(i + 1, None if last else hidden, {**_snapshot(report), "natural": natural})
            bar.update(1)
    finally:
        bar.close()


def _assemble(src: SafetensorsSource, journal: Journal, qconfig: dict[str, Any], report: Report, n_blocks: int,
              max_shard_size: int | str) -> None:
    """Write the final shards, config, tokenizer files and report into ``journal.final``."""
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
    for key, (_, shape, dtype) in src.index.items():
        if key.rsplit(".", 1)[0] not in replaced:  # a quantized layer's weight is in its packed tensors
            specs[key] = (tuple(shape), dtype)

    def fetch(key: str) -> torch.Tensor:
        # Each tensor copied out of a file opened just for it: mapped pages of open files would
        # stay resident, and the assembly would hold the whole output instead of one tensor.
        if key in packed:
            with safe_open(str(packed[key]), framework="pt") as f:
                return f.get_tensor(key).clone()
        return src.read(key)

    write_safetensors_lazily(folder, dict(sorted(specs.items())), fetch, max_shard_size)
    config = {k: v for k, v in src.config_dict.items() if k != "quantization_config"}
    config["quantization_config"] = qconfig
    write_json(folder / "config.json", config)
    if qconfig["quant_method"] == "gptq":
        write_json(folder / "quantize_config.json", qconfig)
    for pattern in _COPIED:
        for path in sorted(src.folder.glob(pattern)):
            if path.name not in _NOT_COPIED and path.is_file():
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

        return Path(snapshot_download(str(where), allow_patterns=["*.json", "*.safetensors", *_COPIED]))
    except Exception as exc:
        raise SourceError(f"cannot get a local snapshot of {where!r} ({exc})") from None


def _source_digest(src: SafetensorsSource) -> str:
    h = hashlib.sha256(json.dumps(src.config_dict, sort_keys=True).encode())
    for key, (fname, shape, dtype) in sorted(src.index.items()):
        h.update(f"{key}|{fname}|{shape}|{dtype}".encode())
    for fname in sorted({v[0] for v in src.index.values()}):
        h.update(f"{fname}:{(src.folder / fname).stat().st_size}".encode())
    return h.hexdigest()


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    # Non-persistent buffers (rotary tables) are computed at construction, on the CPU.
    for mod in model.modules():
        for key, buf in list(mod._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                mod._buffers[key] = buf.to(device)


def _snapshot(report: Report) -> dict[str, Any]:
    return {
        "layers": [dataclasses.asdict(r) for r in report.layers.values()],  # a list keeps the run's order
        "block_seconds": report.block_seconds,
        "skipped": report.skipped,
        "fallbacks": report.fallbacks,
        "moe": report.moe,
    }


def _restore(report: Report, state: dict[str, Any] | None) -> None:
    if not state:
        return
    names = {f.name for f in dataclasses.fields(LayerReport)}
    for row in state["layers"]:
        row = {k: v for k, v in row.items() if k in names}
        row["shape"] = tuple(row["shape"])
        report.layers[row["name"]] = LayerReport(**row)
    report.block_seconds.extend(state["block_seconds"])
    report.skipped.update(state["skipped"])
    report.fallbacks.update(state["fallbacks"])
    report.moe.update(state.get("moe", {}))
