"""Quantize a whole causal LM, one decoder block at a time: ``optq.quantize``.

For each block: find the linears and group them by the input they share (q/k/v, then o, then
gate/up, then down in a Llama block); for each group in that order, run the calibration batches
through the block up to that group, accumulate ONE Hessian of the group's input, solve all of
the group's weights together (their rows stacked: GPTQ treats rows independently and they share
H), and write the quantized weights back, so the next group sees the effect of the earlier ones.
The block's outputs then become the next block's inputs (``optq.pipeline.blocks.block`` does one block).

Memory: the model stays where it is; only the current block is moved to ``device``. With
T = nsamples x seqlen calibration tokens, b = batch_size x seqlen tokens per forward, h the
hidden size, i the MLP's intermediate size and float32 activations, the peak is about

    the runtime and the model                     (a lazily loaded model becomes resident)
  + T x h x 4                                     the block inputs, each batch's overwritten
                                                  by its outputs as soon as they exist
  + T x h x 4                                     strategy="replay": one finished child's
                                                  recorded outputs (the attention's)
  + T x h x 4                                     propagate="original": the unquantized
                                                  block's outputs, beside its inputs
  + b x (3 i + 3 h) x 4                           one batch's temporaries inside the block
  + ~6 x the largest group's weights x 4 + K^2 x 4   the solve (stacked rows, copies) and H
  + T x (i + 2 h) x 4                             strategy="pause" only: every batch's paused
                                                  forward (at worst inside the MLP)
  + one block's parameters on ``device``          when the model lives elsewhere

plus what the allocator holds between the heap trims after each pass. SmolLM2-135M at 128 x 512
tokens: 144 + 144 + 99 + ~50 MB beside the 513 MB model (pause: +528 MB); the peak measured by
benchmarks/quantize_model.py is printed next to this formula's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.formats.linears import find_linears, get_weight, set_weight
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.block import quantize_block
from optq.pipeline.blocks.prepare import Run, check_finite_weights, prepare
from optq.pipeline.report import Report
from optq.pipeline.settings import RunSettings

__all__ = ["quantize", "run_blocks", "BlockSource", "BlockSink", "Report", "new_report", "versions"]

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


def quantize(
    model: nn.Module,
    calibration: Any,
    config: QuantConfig,
    *,
    tokenizer: Any = None,
    settings: RunSettings | None = None,
    progress: bool = True,
    **options: Any,
) -> Report:
    """Quantize the linears of ``model``'s decoder blocks in place; returns a ``Report``.

    Example::

        >>> report = optq.quantize(model, token_ids, optq.QuantConfig(bits=4, group_size=128))
        >>> report.totals["mean_objective_ratio"]   # GPTQ / round-to-nearest, below 1

    Args:
        calibration: token ids (LongTensor [n, seqlen], a list of 1-D LongTensors, or a 1-D
            token stream to draw ``nsamples`` windows of ``seqlen`` from with ``seed``), or text
            (a string or list of strings) together with ``tokenizer``.
        settings: how the run goes (:class:`optq.pipeline.settings.RunSettings`); ``options``
            are its fields as keywords, replacing those of ``settings`` (e.g. ``nsamples=64,
            propagate="original", strategy="pause", device="cuda", moe_calibration="routed",
            hessian_dtype="float64"``; RunSettings' docstring says what each does). ``device``
            defaults to where the model's blocks are.
        progress: show a tqdm bar over the blocks.
    """
    start = time.perf_counter()
    run = prepare(model, calibration, config, RunSettings.of(settings, **options), tokenizer)
    check_finite_weights({n: m for n, m in run.linears.items() if n in run.targets})
    s = run.settings
    log.info(
        "quantizing %d linears in %d blocks of %s on %d x %d tokens (%s, %s)",
        len(run.targets),
        len(run.blocks),
        run.blocks_name,
        run.facts["nsamples"],
        run.facts["seqlen"],
        s.method,
        s.propagate,
    )
    was_training = model.training
    model.eval()
    report = new_report(run, run.options())
    memory = InMemory(run)
    try:
        with torch.no_grad():
            hidden, calls = capture.capture_inputs(model, run.blocks, run.batches, run.device)
            if s.target_bits is not None:
                from optq.pipeline.allocation.allocate import apply, plan

                apply(run, plan(run, model, memory, (hidden, calls)), report)
            # GPTAQ: the float chain starts where the quantized one does (embeddings stay float).
            fp = [h.clone() for h in hidden] if s.method_object.float_chain else None
            run_blocks(
                run, memory, memory, (hidden, calls), report, progress=progress and run.dist.rank == 0, fp_hidden=fp
            )
    except ValueError as exc:
        # Found inside the loop (non-finite activations, a Hessian that cannot be factorised):
        # every finished block was written back, the failing one was restored; say what state
        # the model is left in, since it is quantized in place.
        raise _with_state(exc, _state(report, run)) from exc
    finally:
        model.train(was_training)
    report.seconds = time.perf_counter() - start
    ratio = report.totals["mean_objective_ratio"]
    log.info(
        "done in %.1f s: %d layers, mean objective ratio to round-to-nearest %s",
        report.seconds,
        report.totals["layers"],
        "n/a" if ratio is None else f"{ratio:.4f}",
    )
    return report


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


def _with_state(exc: ValueError, state: str) -> ValueError:
    # The same type (a FactorizationError stays one) when it can be built from a message.
    try:
        return type(exc)(f"{exc}; {state}")
    except Exception:
        return ValueError(f"{exc}; {state}")


def _state(report: Report, run: Run) -> str:
    done = len(report.layers)
    blocks = len(report.block_seconds)
    if done == 0:
        return "no weight was changed"
    return (
        f"the model is left partly quantized: blocks 0 to {blocks - 1} ({done} of {len(run.targets)} layers); "
        f"block {blocks}, where it failed, is as it was: load the model again before using it"
    )


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
