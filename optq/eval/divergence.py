"""How far a model's next-token distributions are from a reference (float) model's, on the same
windows as its perplexity: the mean KL(reference || model) per predicted token, its 99th
percentile over the tokens, and the share of positions whose most likely token is the
reference's.

The positions are perplexity's (``optq.eval.perplexity``): in each window of L tokens,
positions 0..L-2, each predicting the next token. KL is optq's one implementation
(``optq.pipeline.allocation.passes.kl_terms``), in float32 per position, in nats.

Streamed: the windows go through both models one batch at a time, and the logits of both are
made a slice of rows at a time (``_HEAD_ROWS``, for a plain head, or one batch's otherwise); what
stays is one float per predicted token (for the percentile) and a count of agreements. Never
vocabulary x tokens for the whole set. The cost: one more forward of each model per batch;
:func:`perplexity_and_divergence` makes the model's perplexity from that same forward (the bits
``optq.eval.perplexity`` gives), so perplexity and KL together cost one forward of each model.

Example::

    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> divergence_detail(model, model, torch.randint(0, 64, (2, 16))).top1
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from optq.eval.perplexity import (
    _HEAD_ROWS,
    PerplexityResult,
    _device_of,
    _finite,
    _head_inputs,
    _logits,
    _picked_sum,
    _plain_head,
    _result,
)
from optq.pipeline.allocation.passes import kl_terms, log_probs
from optq.pipeline.blocks.calibration import check_seqlen, max_positions

__all__ = ["divergence_detail", "perplexity_and_divergence", "DivergenceResult", "quantile", "FIELDS"]

FIELDS = ("kl", "kl_p99", "top1")  # the JSON fields, per corpus, of optq eval and optq compare


@dataclass(frozen=True, kw_only=True)
class DivergenceResult:
    """KL(reference || model) and top-token agreement over ``tokens`` predicted positions."""

    kl: float  # mean KL per predicted token, nats
    kl_p99: float  # its 99th percentile over the tokens (linear between order statistics)
    top1: float  # share of positions whose argmax token is the reference's
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


SAME = DivergenceResult(kl=0.0, kl_p99=0.0, top1=1.0, tokens=0)  # a model against itself, by definition


def quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``values``, linear between the two nearest order statistics (as
    numpy's default); any size (``torch.quantile`` stops at 16M elements)."""
    ordered = values.double().flatten().sort().values
    if ordered.numel() == 0:
        return math.nan
    pos = q * (ordered.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def _check_windows(windows: torch.Tensor, batch_size: int) -> torch.Tensor:
    batches = torch.as_tensor(windows, dtype=torch.long)
    if batches.dim() != 2:
        raise ValueError(f"windows must be [windows, tokens], got shape {tuple(batches.shape)}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if batches.shape[1] < 2:
        raise ValueError(f"windows need at least 2 tokens, got {batches.shape[1]}")
    return batches


def divergence_detail(
    reference: torch.nn.Module,
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    batch_size: int = 1,
    progress: bool = False,
    device: str | torch.device | None = None,
) -> DivergenceResult:
    """KL(reference || model) per predicted token (mean and 99th percentile) and the share of
    positions where both models' top tokens agree, on token ``windows`` [W, L] (for text, those
    :func:`optq.data.tokens.eval_windows` cuts, as perplexity's). Both models run in eval mode on
    ``device`` (default: ``model``'s). Raises ValueError when their vocabularies differ."""
    batches = _check_windows(windows, batch_size)
    return _pass(reference, model, batches, batch_size, progress, device, nll=False)[1]


def perplexity_and_divergence(
    reference: torch.nn.Module,
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    bos_id: int | None = None,
    batch_size: int = 1,
    progress: bool = False,
    device: str | torch.device | None = None,
) -> tuple[PerplexityResult, DivergenceResult]:
    """``model``'s perplexity on ``windows`` [W, L] and its :func:`divergence_detail` from
    ``reference``, from one forward of each model per batch: the perplexity has the bits
    :func:`optq.eval.perplexity.perplexity_detail` gives on the same windows and batch size (each
    label's log-probability is picked from the rows KL reads, and summed as it sums them).
    ``bos_id`` is only recorded, as there. Raises ValueError for windows longer than ``model``'s
    positions, :class:`~optq.eval.perplexity.NonFiniteLogitsError` at the first batch whose
    NLL is not finite."""
    batches = _check_windows(windows, batch_size)
    check_seqlen(batches.shape[1], max_positions(model))
    nll_sum, div = _pass(reference, model, batches, batch_size, progress, device, nll=True)
    return _result(nll_sum, *batches.shape, bos_id), div


@torch.no_grad()
def _pass(
    reference: torch.nn.Module,
    model: torch.nn.Module,
    batches: torch.Tensor,
    batch_size: int,
    progress: bool,
    device: str | torch.device | None,
    *,
    nll: bool,
) -> tuple[float, DivergenceResult]:
    """One forward of each model per batch: (the model's summed NLL when ``nll``, else 0.0; the
    divergence)."""
    device = torch.device(device) if device is not None else _device_of(model)
    modes = (reference.training, model.training)
    reference.eval()
    model.eval()
    per_token: list[torch.Tensor] = []  # one float32 per predicted token
    agree = 0
    nll_sum = 0.0  # a python float: double precision across batches, as perplexity_detail's
    try:
        starts = range(0, batches.shape[0], batch_size)
        desc = "perplexity and KL" if nll else "KL"
        for start in tqdm(starts, disable=not progress, desc=desc, unit="batch"):
            batch = batches[start : start + batch_size].to(device)
            labels = batch[:, 1:].reshape(-1)
            picked: list[torch.Tensor] = []  # each predicted token's log-probability under the model
            row = 0
            # Not zip(): it would keep the previous pair alive while making the next.
            model_rows = _row_logits(model, batch)
            for p_logits in _row_logits(reference, batch):
                p = log_probs(p_logits)
                del p_logits
                q = log_probs(next(model_rows))
                if p.shape != q.shape:
                    raise ValueError(
                        f"the reference model's vocabulary ({p.shape[-1]}) differs from the model's "
                        f"({q.shape[-1]}): KL needs the same tokens"
                    )
                if nll:
                    picked.append(q.gather(1, labels[row : row + q.shape[0], None]))
                    row += q.shape[0]
                per_token.append(kl_terms(p, q).sum(-1).cpu())
                agree += int((p.argmax(-1) == q.argmax(-1)).sum())
                del p, q
            if nll:  # summed as perplexity's _batch_nll sums them
                nll_sum += _finite(float(_picked_sum(picked, labels)), start, batch, batches.shape[0])
    finally:
        reference.train(modes[0])
        model.train(modes[1])
    kl = torch.cat(per_token)
    n = kl.numel()
    div = DivergenceResult(kl=float(kl.double().sum()) / n, kl_p99=quantile(kl, 0.99), top1=agree / n, tokens=n)
    return nll_sum, div


def _row_logits(model: torch.nn.Module, batch: torch.Tensor) -> Iterator[torch.Tensor]:
    """The logits [rows, vocab] of every predicted position of ``batch`` (positions 0..L-2 of each
    window, window-major), ``_HEAD_ROWS`` rows at a time: for a plain head only those rows' logits are
    made (the model runs with its head swapped for the identity, as perplexity's ``_batch_nll``);
    logits of the batch made whole otherwise, then sliced alike: two models' slices pair up."""
    head_name = _plain_head(model)
    if head_name is None:
        logits = _logits(model(input_ids=batch, use_cache=False))
        rows = logits[:, :-1, :].reshape(-1, logits.shape[-1])
        del logits
        for s in range(0, rows.shape[0], _HEAD_ROWS):
            yield rows[s : s + _HEAD_ROWS]
        return
    rows, head = _head_inputs(model, batch, head_name)
    for s in range(0, rows.shape[0], _HEAD_ROWS):
        yield head(rows[s : s + _HEAD_ROWS])
