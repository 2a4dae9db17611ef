"""The block loop every run goes through, ``run_blocks``, with its seams: where a block's weights
come from (:class:`BlockSource`) and where its results go (:class:`BlockSink`); :class:`InMemory`
is both for a model in memory. The runs themselves, and what they do before the loop, are in
``optq.pipeline.run`` (in memory) and ``optq.pipeline.stream.quantize`` (streamed).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch
from torch import nn

from optq.formats.linears import find_linears, get_weight, set_weight
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.block import quantize_block
from optq.pipeline.blocks.prepare import Run
from optq.pipeline.report import Report

__all__ = ["run_blocks", "BlockSource", "BlockSink", "InMemory", "Report", "new_report", "versions"]

log = logging.getLogger("optq.pipeline")


class BlockSource(Protocol):
    """Seam 1, where a block's weights come from: a model in memory (:class:`InMemory`),
    safetensors shards (``optq.pipeline.stream.source``), later a remote store."""

    def load(self, i: int, block: nn.Module) -> None:
        """Make block ``i``'s weights ready on the run's compute device (a source that reads them
        only now checks them with ``check_finite_weights`` here, before any weight changes)."""

    def release(self, i: int, block: nn.Module) -> None:
        """Block ``i`` is done: move it back, or free its weights."""


class BlockSink(Protocol):
    """Where a finished block's results go: written back in place (:class:`InMemory`), or
    packed and journaled (``optq.pipeline.stream.sink``)."""

    def pack(self, i: int, block: nn.Module, report: Report) -> None:
        """Block ``i`` is quantized and still on the compute device."""

    def commit(
        self, i: int, block: nn.Module, hidden: list[torch.Tensor], report: Report, fp_hidden: list | None = None
    ) -> None:
        """Block ``i`` is released; ``hidden`` holds the next block's inputs (``fp_hidden``, with
        method="gptaq", the float model's)."""

    def rollback(self, i: int, block: nn.Module, report: Report) -> None:
        """Quantizing block ``i`` failed (still on the compute device): undo what it changed."""


def new_report(run: Run, options: dict[str, Any]) -> Report:
    """An empty report of ``run``, recording ``options`` (the settings and facts)."""
    return Report(
        layers={},
        config=run.config.to_dict(),
        options=options,
        versions=versions(),
        seconds=0.0,
        block_seconds=[],
        skipped=dict(run.skipped),
        schemes=run.schemes.to_dict() if run.schemes is not None else {},
        unmeasured=(
            f"method {run.settings.method} reads no calibration activation: every layer was quantized from "
            "its weight alone, with no calibration forward, so there is no Hessian to measure errors on"
            if run.weights_only
            else None
        ),
    )


def run_blocks(
    run: Run,
    source: BlockSource,
    sink: BlockSink,
    activations: tuple[list[torch.Tensor], list[list[capture.Call]]],
    report: Report,
    *,
    start: int = 0,
    progress: bool = True,
    fp_hidden: list[torch.Tensor] | None = None,
) -> None:
    """The block loop, the one every run goes through: for each block from ``start``, load it
    (seam 1), quantize it (``quantize_block``; seam 2 inside), hand it to the sink, release it,
    commit. ``activations``: the first block's inputs (replaced by each block's outputs in
    turn) and every block's captured call arguments; ``fp_hidden`` (method="gptaq"): the float
    model's inputs of block ``start`` (replaced by the float blocks' outputs)."""
    from tqdm.auto import tqdm

    hidden, calls = activations
    bar = tqdm(total=len(run.blocks), initial=start, desc="optq", unit="block", disable=not progress)
    try:
        for i in range(start, len(run.blocks)):
            t0 = time.perf_counter()
            block = run.blocks[i]
            source.load(i, block)
            try:
                quantize_block(run, run.block_name(i), block, (hidden, calls[i]), report, bar, fp_hidden)
            except BaseException:
                # A block is written back whole or not at all: a failure in its fifth layer
                # leaves none of its layers quantized.
                sink.rollback(i, block, report)
                raise
            sink.pack(i, block, report)
            source.release(i, block)
            report.block_seconds.append(time.perf_counter() - t0)
            log.debug("block %d done in %.2f s", i, report.block_seconds[-1])
            sink.commit(i, block, hidden, report, fp_hidden)
            bar.update(1)
    finally:
        bar.close()


class InMemory:
    """Source and sink of a model in memory: each block is moved to the compute device and back,
    and its solutions stay in the report beside the model (``optq.save`` packs them)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.home: dict[int, torch.device] = {}
        self.backup: dict[str, torch.Tensor] = {}  # the current block's weights to quantize, as loaded

    def load(self, i: int, block: nn.Module) -> None:
        self.home[i] = next(block.parameters()).device
        block.to(self.run.device)
        targets = {n: m for n, m in find_linears(block, self.run.block_name(i)).items() if n in self.run.targets}
        self.backup = {n: get_weight(m).detach().clone() for n, m in targets.items()}

    def rollback(self, i: int, block: nn.Module, report: Report) -> None:
        for name, mod in find_linears(block, self.run.block_name(i)).items():
            if name in self.backup:
                set_weight(mod, self.backup[name])
            for rows in (report.layers, report.solutions, report.fallbacks, report.solved_by):
                rows.pop(name, None)
        self.backup = {}
        self.release(i, block)

    def release(self, i: int, block: nn.Module) -> None:
        block.to(self.home.pop(i))

    def pack(self, i: int, block: nn.Module, report: Report) -> None:
        pass  # the weights are written back in place as each group is solved

    def commit(
        self, i: int, block: nn.Module, hidden: list[torch.Tensor], report: Report, fp_hidden: list | None = None
    ) -> None:
        self.backup = {}
        # Solutions live beside the model, not on the compute device, and their dequantized
        # weight is the module's own weight tensor (a view): no second copy of the model is kept.
        home = next(block.parameters()).device
        for name, mod in find_linears(block, self.run.block_name(i)).items():
            sol = report.solutions.get(name)
            if sol is None:
                continue
            # The view shares the parameter's version counter: a later in-place change of the
            # model's weight is noticed by the solution (see Solution.drop_codes).
            sol.weight = get_weight(mod)
            for field in ("scales", "zeros", "g_idx", "perm"):
                setattr(sol, field, getattr(sol, field).to(home))
            # The codes are the weight's, exactly: recomputed when a checkpoint is written instead
            # of held (one byte per weight, a quarter of an fp32 model) for the whole run.
            if not sol.drop_codes():
                sol.codes = sol.codes.to(home)


def versions() -> dict[str, str]:
    """The versions that can change a run's bytes (optq, torch, transformers)."""
    from optq import __version__

    out = {"optq": __version__, "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out
