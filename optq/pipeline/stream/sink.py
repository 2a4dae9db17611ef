"""The streaming run's two sides of the block loop: blocks read from shards, results journaled.

:class:`StreamedBlocks` is the loop's block source over a :class:`SafetensorsSource` (a block's
tensors are read onto the compute device in the compute dtype, and released to the meta device
once it is packed); :class:`JournalSink` packs each finished block's layers under the source
checkpoint's names and commits them, with the next block's inputs, to the resume journal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from optq.formats import compressed_tensors
from optq.formats.experts import layer_namer
from optq.formats.gptq_config import is_natural
from optq.formats.layout import storage_format
from optq.formats.linears import find_linears
from optq.formats.qlinear import QuantLinear
from optq.pipeline.blocks.prepare import Run, check_finite_weights
from optq.pipeline.report import LayerReport, Report
from optq.pipeline.stream.journal import Journal
from optq.pipeline.stream.source import SafetensorsSource

__all__ = ["StreamedBlocks", "JournalSink", "restore"]


class StreamedBlocks:
    """Seam 1 for a model folder: block ``i``'s tensors read from the shards when it is loaded,
    freed when it is released. ``resident``: blocks already loaded (block 0, by the capture)."""

    def __init__(self, src: SafetensorsSource, run: Run, dtype: torch.dtype) -> None:
        self.src, self.run, self.dtype = src, run, dtype
        self.resident: set[int] = set()

    def load(self, i: int, block: nn.Module) -> None:
        name = self.run.block_name(i)
        if i not in self.resident:
            self.src.load(block, name, self.run.device, self.dtype)
        self.resident.discard(i)
        # Read only now (optq.quantize checks a model in memory whole, before the first block).
        check_finite_weights(
            {n: m for n, m in find_linears(block, name).items() if n in self.run.targets}, where=self._file
        )

    def _file(self, module: str) -> str:
        """The shard ``module``'s weight is read from (or of the fused tensor it is a slice of)."""
        key = self.src.names(f"{module}.weight")
        fused = self.src.slices.get(key)
        entry = self.src.index.get(fused.key if fused is not None else key)
        return str(self.src.folder / entry[0]) if entry is not None else str(self.src.folder)

    def release(self, i: int, block: nn.Module) -> None:
        self.src.release(block)


class JournalSink:
    """Packs each finished block (rank 0 alone writes) and commits it to ``journal``."""

    def __init__(self, journal: Journal, run: Run, src: SafetensorsSource) -> None:
        self.journal, self.run, self.src = journal, run, src
        self.natural = (journal.state.get("report") or {}).get("natural", True)
        self.module_name = layer_namer(src.names)  # packed tensors go under the checkpoint's names
        self.packed: dict[str, torch.Tensor] = {}

    def pack(self, i: int, block: nn.Module, report: Report) -> None:
        fmt = self.run.settings.format
        self.packed = {}
        for lname, module in find_linears(block, self.run.block_name(i)).items():
            sol = report.solutions.pop(lname, None)
            if sol is None or self.run.dist.rank != 0:  # rank 0 alone writes the journal
                continue
            layer = QuantLinear.from_solution(sol, module.bias, storage_format(fmt))
            self.natural = self.natural and is_natural(layer)
            if fmt == "compressed-tensors":
                tensors = compressed_tensors.export_layer(lname, layer, sym=sol.config.sym, dtype=self.src.dtype)
            else:
                tensors = layer.state_dict()
            self.packed.update({f"{self.module_name(lname)}.{k}": v for k, v in tensors.items()})

    def rollback(self, i: int, block: nn.Module, report: Report) -> None:
        # Nothing of block i has reached the journal: its packed tensors are dropped with the run.
        self.packed = {}

    def commit(
        self, i: int, block: nn.Module, hidden: list[torch.Tensor], report: Report, fp_hidden: list | None = None
    ) -> None:
        self.journal.write_block(i, self.packed)
        self.packed = {}
        last = i + 1 == len(self.run.blocks)
        snap = {**snapshot(report), "natural": self.natural}
        # The source tensors read so far, hashed as they were read: a resume or the assembly
        # proves with them that the source still holds what these blocks were computed from.
        # GPTAQ: the float chain's too, for an exact resume; a run from the weights alone has none.
        chains = None if last or self.run.weights_only else (hidden, fp_hidden)
        self.journal.commit(i + 1, chains, snap, dict(self.src.digests))


def snapshot(report: Report) -> dict[str, Any]:
    """The report so far, as the journal's state keeps it."""
    return {
        "layers": [dataclasses.asdict(r) for r in report.layers.values()],  # a list keeps the run's order
        "block_seconds": report.block_seconds,
        "skipped": report.skipped,
        "fallbacks": report.fallbacks,
        "moe": report.moe,
        "allocation": report.allocation,  # target_bits: a resumed run quantizes with these settings
    }


def restore(report: Report, state: dict[str, Any] | None) -> None:
    """Put a journal's report snapshot back into ``report`` (on resume)."""
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
    report.allocation = dict(state.get("allocation") or {})
