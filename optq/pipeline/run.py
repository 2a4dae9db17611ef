"""One run: quantize a whole causal LM in memory, one decoder block at a time (``optq.quantize``),
and :func:`before_blocks`, what every run does between preparing and the block loop.

For each block: find the linears and group them by the input they share (q/k/v, then o, then
gate/up, then down in a Llama block); for each group in that order, run the calibration batches
through the block up to that group, accumulate ONE Hessian of the group's input, solve all of
the group's weights together (their rows stacked: GPTQ treats rows independently and they share
H), and write the quantized weights back, so the next group sees the effect of the earlier ones.
The block's outputs then become the next block's inputs (``optq.pipeline.blocks.block`` does one block).
A method that reads no calibration statistic (round-to-nearest, ``Run.weights_only``) skips all
of that: each target is quantized from its weight alone, and no block runs a forward.

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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from optq.core.config import QuantConfig
from optq.pipeline.allocation.allocate import apply, plan
from optq.pipeline.blocks import capture
from optq.pipeline.blocks.loop import BlockSource, InMemory, new_report, run_blocks
from optq.pipeline.blocks.prepare import Run, check_finite_weights, prepare
from optq.pipeline.report import Report
from optq.pipeline.settings import RunSettings

__all__ = ["quantize", "before_blocks"]

log = logging.getLogger("optq.pipeline")

Chain = list[torch.Tensor]


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
            hidden, calls, fp = before_blocks(run, model, memory, report)
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


def before_blocks(
    run: Run,
    model: nn.Module,
    source: BlockSource,
    report: Report,
    *,
    load_head: Callable[[], None] | None = None,
    after_allocation: Callable[[Chain], tuple[Chain, Callable[[], Chain] | None]] | None = None,
) -> tuple[Chain, list[list[capture.Call]], Chain | None]:
    """What every run does between ``prepare`` and the block loop, in memory and streamed: capture
    block 0's inputs; with ``target_bits``, choose every target's (bits, group size) now, before
    any weight changes (unless ``report`` already holds the allocation a resumed run recorded);
    start the float chain GPTAQ needs. Returns the hidden states, every block's calls and the
    float chain (None unless the method reads one: GPTAQ).

    ``source``: the run's block source (the allocation's passes load blocks through it);
    ``load_head``: makes what the allocation's KL needs beyond the embeddings resident (a streamed
    run's head), called only when an allocation is chosen; ``after_allocation``: a streamed run's
    release of what only the capture and the allocation needed, and its journal check, given the
    captured hidden states: returns the hidden states to continue from and, when resuming, a
    loader of the journal's float chain.

    A run that quantizes from the weights alone (``run.weights_only``: round-to-nearest) needs
    none of this: no hidden states, no calls (an empty list per block), no float chain.
    """
    if run.weights_only:
        return [], [[] for _ in run.blocks], None
    hidden, calls = capture.capture_inputs(model, run.blocks, run.batches, run.device)
    if run.settings.target_bits is not None and not report.allocation:
        if load_head is not None:
            load_head()
        allocation, schemes = plan(run, model, source, (hidden, calls))
        apply(run, allocation, report, schemes)
    saved_fp = None
    if after_allocation is not None:
        hidden, saved_fp = after_allocation(hidden)
    # GPTAQ: the float chain starts where the quantized one does (embeddings stay float), or
    # where the journal left it.
    fp = None
    if run.settings.method_object.float_chain:
        fp = saved_fp() if saved_fp is not None else [h.clone() for h in hidden]
    return hidden, calls, fp


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
