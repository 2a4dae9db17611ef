"""Quantize a model folder larger than memory: one block at a time, written as it finishes.

``quantize_pretrained(source, out, calibration, config)`` builds the model on the meta device,
reads each decoder block from the safetensors shards only while it is quantized (seam 1,
``optq.pipeline.stream.source``), packs the block's layers and writes them to the resume journal in
``OUT.partial/`` (``optq.pipeline.stream.journal``), then frees the block. At the end the checkpoint
is assembled shard by shard: packed tensors from the journal, every other tensor copied from
the source as stored (a bf16 model's embeddings, norms and head stay bf16), under the source's
own names: the packed layers too, a Mixtral expert's as ``block_sparse_moe.experts.3.w1.qweight``
where transformers names the module ``mlp.experts.3.w1``. A GPT-OSS source's fused experts are
read as slices, one expert matrix each, and written per expert (``mlp.experts.3.gate_proj``).
Peak memory: the runtime, the calibration activations, one block in the compute dtype and its
solve, the embeddings, and one output shard at the end; not the model's depth.

A run killed at any moment resumes with ``resume=True`` (``--resume``) after the last finished
block, from the activations saved with it, and ends with the same bytes as an uninterrupted run
at the same thread count. Before any work the resume checks every journal file against the
sha256 written with it (``optq.pipeline.stream.verify``) and that the source still holds what the
finished blocks were computed from (``optq.pipeline.stream.fingerprint``); a run that fails with
an error before its first block is finished leaves no journal behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats import compressed_tensors
from optq.formats.expert_slices import fused_in_source, fused_slices
from optq.formats.experts import checkpoint_namer, layer_namer
from optq.formats.layout import Scheme, quantization_config
from optq.formats.probes import record_into
from optq.pipeline.allocation.allocate import apply
from optq.pipeline.blocks.loop import new_report, run_blocks, versions
from optq.pipeline.blocks.prepare import Run, prepare
from optq.pipeline.report import Report
from optq.pipeline.run import before_blocks
from optq.pipeline.settings import FORMATS, RunSettings, dtype_name
from optq.pipeline.stream.assemble import assemble, local_folder
from optq.pipeline.stream.fingerprint import check_reads, check_shards, shard_prints
from optq.pipeline.stream.journal import Journal
from optq.pipeline.stream.records import check_resume, output_settings
from optq.pipeline.stream.sink import JournalSink, StreamedBlocks, restore
from optq.pipeline.stream.source import SafetensorsSource, SourceError

__all__ = ["quantize_pretrained", "local_folder", "STREAM_FORMATS"]

log = logging.getLogger("optq.pipeline")
STREAM_FORMATS = FORMATS  # every format optq writes streams


def quantize_pretrained(
    source: str | Path,
    out: str | Path,
    calibration: Any,
    config: QuantConfig,
    *,
    tokenizer: Any = None,
    settings: RunSettings | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
    probes: bool | Sequence[str] = True,
    **options: Any,
) -> Report:
    """Quantize the safetensors model at ``source`` into the checkpoint folder ``out``.

    Example::

        >>> report = quantize_pretrained("smollm2-135m", "out/smol-4bit", token_ids,
        ...                              optq.QuantConfig(bits=4, group_size=128))  # doctest: +SKIP

    ``source``: a model folder, a built-in name, or a hub id (its local snapshot). ``settings``
    and ``options`` (its fields as keywords) as in :func:`optq.quantize`; here ``format``,
    ``max_shard_size``, ``compute_dtype`` (default float32 on CPU, the source dtype on CUDA) and
    ``offload_activations`` matter too, and ``device`` defaults to the CPU. ``resume``: continue
    an interrupted run in ``OUT.partial/``; ``overwrite``: replace ``out``, or start a partial run
    again; ``provenance``: what the caller wants recorded in the report's options (such as the
    model name and corpus given on the command line); ``probes``: when the output has a tokenizer
    (copied from ``source``), write ``optq_probes.json`` for the built-in prompts (True), these
    prompts (a list), or not (False) (:mod:`optq.formats.probes`). Returns the report, also written to
    ``out/quantization_report.json``; its ``solutions`` are empty (each block's are packed and
    freed as it finishes).
    """
    settings = RunSettings.of(settings, **options)
    check_resume(out, config, settings, provenance, resume=resume, overwrite=overwrite)  # before any loading
    quantization_config(Scheme.of_config(config), settings.format)  # what the format cannot hold, up front
    start = time.perf_counter()
    src = SafetensorsSource(local_folder(source))
    device = settings.torch_device(torch.device("cpu"))
    dtype = settings.compute(device, src.dtype)
    model = src.skeleton(dtype)
    run = prepare(model, calibration, config, settings, tokenizer)
    src.use_names(checkpoint_namer(model))  # after prepare, which splits fused experts per expert
    src.use_slices(fused_slices(model, src.index, src.names))  # GPT-OSS as saved: experts fused on disk
    if (fused := fused_in_source(model, src.index, src.names)) is not None:
        raise SourceError(fused)
    quantization_config(_scheme(run, src, None), settings.format)  # the per-layer schemes, before any block
    options_ = {
        **run.options(),
        "compute_dtype": dtype_name(dtype),
        "source_dtype": dtype_name(src.dtype),
        "streaming": True,
        **(provenance or {}),
    }
    manifest = {
        "source": _source_digest(src),
        "calibration": run.calibration_digest,
        "config": config.to_dict(),
        "settings": output_settings(settings, provenance),
        # What changes the bytes: not where the run computes, nor where its activations live.
        "options": {k: v for k, v in options_.items() if k not in ("num_threads", "device", "offload_activations")},
        "versions": versions(),
        # Compared on resume by fingerprint.check_shards' rule, with the content hashes the state keeps.
        "shards": shard_prints(src.folder, (entry[0] for entry in src.index.values())),
    }
    journal = Journal(out, manifest, resume=resume, overwrite=overwrite, dist=run.dist)
    with journal.removed_if_empty():  # a run failing before its first block leaves no journal behind
        return _run(run, model, src, journal, options_, start, progress, probes)


def _run(
    run: Run,
    model: nn.Module,
    src: SafetensorsSource,
    journal: Journal,
    options_: dict[str, Any],
    start: float,
    progress: bool,
    probes: bool | Sequence[str] = True,
) -> Report:
    """The run once its journal is open: the blocks left, then the assembly."""
    dtype = getattr(torch, options_["compute_dtype"])  # the compute dtype, as dtype_name wrote it
    settings, device = run.settings, run.device
    if journal.done:  # resumed: the finished blocks must have been computed from this source
        with run.dist.failing_together():
            if run.dist.rank == 0:
                check_shards(src, journal.shards, journal.state.get("sources") or {}, journal.folder)
    report = new_report(run, options_)
    restore(report, journal.state.get("report"))
    if report.allocation:  # resumed: the settings the finished blocks were quantized with
        apply(run, report.allocation, report)
    log.info(
        "streaming %d blocks of %s from %s (%s) in %s on %s, %d x %d calibration tokens",
        len(run.blocks),
        run.blocks_name,
        src.folder,
        options_["source_dtype"],
        options_["compute_dtype"],
        device,
        run.facts["nsamples"],
        run.facts["seqlen"],
    )
    if journal.done < len(run.blocks):  # else killed while assembling: only that is left to do
        _quantize_blocks(run, model, src, journal, report, dtype, progress)
    natural = journal.state["report"].get("natural", True)
    ignore = ()
    if settings.format == "compressed-tensors":
        ignore = compressed_tensors.ignored(model, run.targets, layer_namer(src.names))
    qconfig = quantization_config(_scheme(run, src, natural), settings.format, ignore)
    report.seconds = time.perf_counter() - start
    if run.dist.rank == 0:  # one writer: the other ranks' results are in rank 0's journal
        with journal.writing(journal.folder):
            assemble(src, journal, qconfig, report, len(run.blocks), settings.max_shard_size)
            if probes:  # before the rename: OUT appears with its probes or not at all
                record_into(journal.final, None if probes is True else list(probes))
            journal.finish()
    run.dist.barrier()
    log.info("wrote %s in %.1f s", journal.out, report.seconds)
    return report


def _quantize_blocks(
    run: Run,
    root: nn.Module,
    src: SafetensorsSource,
    journal: Journal,
    report: Report,
    dtype: torch.dtype,
    progress: bool,
) -> None:
    """Capture the first block's inputs (or take them from the journal) and what else comes before
    the block loop (``optq.pipeline.run.before_blocks``), then the block loop. A run from the
    weights alone (``Run.weights_only``) captures nothing and journals no activations: a resume
    continues from the journal's last finished block."""
    model, prefix, device = run.blocks, run.blocks_name, run.device
    head = _head_name(root)
    outside = (f"{prefix}.", *((f"{head}.",) if head else ()))
    blocks = StreamedBlocks(src, run, dtype)
    with torch.no_grad():
        if not run.weights_only:  # a run from the weights alone reads each block's weights only
            src.load(root, "", device, dtype, skip=outside)  # embeddings, final norm
            _buffers_to(root, device)  # rotary tables
            src.load(model[0], f"{prefix}.0", device, dtype)  # the capture runs block 0 once
            blocks.resident.add(0)

        def load_head() -> None:  # the allocation's KL needs logits
            src.load(root, "", device, dtype, skip=(f"{prefix}.",))

        def after_allocation(hidden: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
            src.release(root, skip=(f"{prefix}.",))  # the embeddings served the capture only
            if not journal.done:
                return hidden, None
            # The capture read the embeddings and block 0 again: they must be what the finished
            # blocks were computed from, whatever the shards' fingerprints said.
            with run.dist.failing_together():
                check_reads(
                    src, sorted(src.digests), journal.state.get("sources") or {}, f"cannot resume {journal.folder}"
                )
            src.release(model[0])
            blocks.resident.clear()
            hidden.clear()  # the journal's activations replace the captured ones
            return [h.to(device) for h in journal.activations()], lambda: [
                h.to(device) for h in journal.activations(fp=True)
            ]

        hidden, calls, fp = before_blocks(
            run, root, blocks, report, load_head=load_head, after_allocation=after_allocation
        )
        if run.settings.offload_activations:
            hidden = journal.offload(hidden)
            fp = None if fp is None else journal.offload(fp, "fp")
        run_blocks(
            run,
            blocks,
            JournalSink(journal, run, src),
            (hidden, calls),
            report,
            start=journal.done,
            progress=progress and run.dist.rank == 0,
            fp_hidden=fp,
        )
        del hidden, calls, fp
        src.release(root)


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


def _scheme(run: Run, src: SafetensorsSource, natural: bool | None) -> Scheme:
    """The checkpoint's scheme: each target's config under its checkpoint name."""
    name = layer_namer(src.names)
    return Scheme.of_configs(run.config, {name(n): run.config_of(n) for n in sorted(run.targets)}, natural)
