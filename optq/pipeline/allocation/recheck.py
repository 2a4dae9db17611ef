"""The last step of ``--target-bits``: the best few candidates quantized as the run quantizes.

The proxy that ranks every candidate (``passes.divergence``) quantizes each layer by GPTQ on the
float model's inputs. A GPTQ run with quantized propagation and a GPTAQ run (the default) solve
each layer on the partly quantized model's inputs, and GPTAQ also corrects for how they differ
from the float model's, so the proxy misranks close candidates: on Gemma-3-270M at 3.5 bits it
ranked the first-and-last-blocks heuristic and down_proj at 4 bits below uniform 3-bit filled,
while under GPTAQ both had the lower enwiki perplexity (docs/allocation.md).

:func:`recheck` therefore takes the ``target_check`` candidates with the lowest proxy KL and
quantizes each as the run will: block by block through ``quantize_block`` (the run's own code:
its method, propagation, strategy and each layer's settings from the candidate's schemes), on the
sensitivity windows, each candidate on its own quantized chain (and, for GPTAQ, beside the shared
float chain). The held-out windows then run through each candidate's quantized block, and each
candidate scores mean KL(float || candidate) per token at the head, as the proxy does. Every
block's weights are restored after each candidate. Cost: about one run of the method on the
sensitivity windows per candidate; memory: one chain of the sensitivity and the held-out windows
per candidate, beside the float chains: as many candidates at a time as ``max_hessian_memory``
holds (at least one), each further group in one more pass over the model, to the same KL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from optq.pipeline.allocation.passes import Streams, block_targets, mean_kl, swapped
from optq.pipeline.blocks.block import quantize_block
from optq.pipeline.blocks.capture import run_block
from optq.pipeline.blocks.loop import new_report
from optq.pipeline.blocks.prepare import Run
from optq.pipeline.schemes import LayerSchemes

__all__ = ["choose", "recheck", "needed", "affordable"]

log = logging.getLogger("optq.pipeline")


def needed(run: Run) -> bool:
    """Whether the proxy differs from the run: not for round-to-nearest (rounding does not depend
    on the inputs) nor for GPTQ on the float model's inputs (``propagate="original"``: the proxy)."""
    return run.settings.method_object.differs_from_proxy(run.settings)


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def affordable(run: Run, fit: Streams, held: Streams, wanted: int) -> int:
    """How many candidates' chains (sensitivity and held-out windows each) fit ``max_hessian_memory``
    (at least one): the candidates rechecked in each pass over the model."""
    per = _bytes(fit.hidden) + _bytes(held.hidden)
    return max(1, min(wanted, run.settings.hessian_budget // per)) if per else wanted


def recheck(
    run: Run,
    source,
    streams: tuple[Streams, Streams],
    schemes: Mapping[str, LayerSchemes],
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Mean KL(float || candidate) per token on the held-out windows (``streams[1]``) of each
    candidate of ``schemes`` (its per-layer schemes) quantized as the run does on the sensitivity
    windows (``streams[0]``); neither stream is changed, and every weight is left as it was."""
    from tqdm.auto import tqdm

    fit, held = streams
    bar = tqdm(disable=True)  # quantize_block shows each layer on the run's bar; none here
    gptaq = run.settings.method_object.float_chain  # the run pairs the float chain with the quantized one
    chains = {k: ([h.clone() for h in fit.hidden], [h.clone() for h in held.hidden]) for k in schemes}
    fp_fit = list(fit.hidden) if gptaq else None  # new lists per block; each candidate takes copies
    fp_held = list(held.hidden)
    kept = run.schemes
    with torch.no_grad():
        for i, block in enumerate(run.blocks):
            source.load(i, block)
            try:
                fp_held = [run_block(block, h, c) for h, c in zip(fp_held, held.calls[i])]
                fp_next = [run_block(block, h, c) for h, c in zip(fp_fit, fit.calls[i])] if gptaq else None
                for key, chosen in schemes.items():
                    run.schemes = chosen
                    chains[key] = _candidate_block(run, (i, block), streams, chains[key], (fp_fit, bar))
                fp_fit = fp_next
            finally:
                run.schemes = kept
                source.release(i, block)
        return mean_kl(fp_held, {k: q_held for k, (_, q_held) in chains.items()}, logits)


def _candidate_block(run: Run, where, streams: tuple[Streams, Streams], chains, context):
    """Block ``where`` quantized by the run's code with ``run.schemes`` on the candidate's chain of
    sensitivity windows (advanced in place), its held-out chain carried through it; the block's
    weights restored. ``context``: the float chain of the sensitivity windows (GPTAQ; else None)
    and the progress bar. Returns the two chains."""
    (i, block), (fit, held), (q_fit, q_held), (fp_fit, bar) = where, streams, chains, context
    with swapped(block_targets(run, i, block)):
        fp_in = [h.clone() for h in fp_fit] if fp_fit is not None else None  # the twin advances its chain
        quantize_block(run, run.block_name(i), block, (q_fit, fit.calls[i]), new_report(run, {}), bar, fp_in)
        return q_fit, [run_block(block, h, c) for h, c in zip(q_held, held.calls[i])]


def choose(run: Run, source: Any, streams: tuple[Streams, Streams], ranked, logits):
    """The first ``target_check`` of ``ranked`` (name, per-layer schemes) pairs quantized as the run does
    (``recheck``): the report's ``check`` and their KL by name (empty: the proxy decides)."""
    s, need = run.settings, needed(run)
    wanted = s.target_check if need else 0
    count = wanted
    skipped = None
    if not need:
        skipped = f"not needed: the proxy quantizes as the run does ({s.method}, propagate={s.propagate})"
    check = {"wanted": wanted, "candidates": count, "skipped": skipped, "seconds": 0.0}
    if count == 0:
        return check, {}
    t0 = time.perf_counter()
    log.info("target-bits: the %d best allocations by the proxy quantized as the run does (%s)", count, s.method)
    schemes = dict(ranked[:count])
    step, found = affordable(run, *streams, len(schemes)), {}  # memory decides the passes, not the result
    for a in range(0, len(schemes), step):
        found.update(recheck(run, source, streams, dict(list(schemes.items())[a : a + step]), logits))
    check["seconds"] = time.perf_counter() - t0
    return check, found
