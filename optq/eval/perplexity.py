"""Perplexity of a causal language model over consecutive non-overlapping token windows.

What counts: in a window of L tokens the model predicts positions 1..L-1 from the tokens before
them (position 0, or the BOS token when one starts each window, is context only), so each
window contributes L-1 predicted tokens. Perplexity = exp(sum of NLL / number of predicted
tokens), NLL in nats, computed in float32 whatever the model's dtype.

Example::

    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> perplexity(model, torch.randint(0, 64, (200,)), seqlen=32) > 1.0
    True
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from optq.data.tokens import eval_windows
from optq.pipeline.blocks.calibration import check_seqlen, max_positions

__all__ = ["perplexity", "perplexity_detail", "PerplexityResult", "NonFiniteLogitsError"]


class NonFiniteLogitsError(ValueError):
    """The model's logits held NaN or infinite values: no perplexity exists.

    ``value`` is the offending window batch's NLL (nan or inf), ``window`` its first window.
    """

    def __init__(self, message: str, *, value: float = math.nan, window: int = 0) -> None:
        super().__init__(message)
        self.value = value
        self.window = window


@dataclass(frozen=True, kw_only=True)
class PerplexityResult:
    """The detail of one perplexity evaluation (all fields JSON-friendly)."""

    perplexity: float
    nll_sum: float  # nats, summed over predicted tokens
    tokens: int  # predicted tokens = windows * (seqlen - 1)
    windows: int
    seqlen: int
    bos_id: int | None

    @property
    def mean_nll(self) -> float:
        """Mean negative log-likelihood per predicted token, in nats."""
        return self.nll_sum / self.tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return {**asdict(self), "mean_nll": self.mean_nll}


def _logits(output: Any) -> torch.Tensor:
    # HF models return an object with .logits; a bare nn.Module may return a tensor or a tuple.
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


@torch.no_grad()
def perplexity_detail(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    seqlen: int = 512,
    windows: int | None = None,
    bos_id: int | None = None,
    batch_size: int = 1,
    progress: bool = False,
    device: str | torch.device | None = None,
) -> PerplexityResult:
    """Like :func:`perplexity`, returning the NLL sum, predicted-token count and window count too."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() == 2 and tokens.shape[0] > 1:
        # Already windows [W, L]: used as given (bos_id is then only recorded).
        batches = tokens if windows is None else tokens[:windows]
    else:
        batches = eval_windows(tokens, seqlen, windows, bos_id)
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n_windows, length = batches.shape
    if length < 2:
        raise ValueError(f"windows need at least 2 tokens, got {length}")
    check_seqlen(length, max_positions(model))
    device = torch.device(device) if device is not None else _device_of(model)
    was_training = model.training
    model.eval()
    nll_sum = 0.0  # python float accumulates in double precision across windows
    try:
        starts = range(0, n_windows, batch_size)
        for start in tqdm(starts, disable=not progress, desc="perplexity", unit="batch"):
            batch = batches[start : start + batch_size].to(device)
            nll_sum += _finite(float(_batch_nll(model, batch)), start, batch, n_windows)
    finally:
        model.train(was_training)
    return _result(nll_sum, n_windows, length, bos_id)


def _finite(value: float, start: int, batch: torch.Tensor, total: int) -> float:
    """A batch's summed NLL, or :class:`NonFiniteLogitsError` when it is NaN or infinite: a NaN/Inf
    logit poisons the mean, so evaluation stops at the first such batch."""
    if not math.isfinite(value):
        raise NonFiniteLogitsError(
            f"the model produced non-finite logits (NaN/Inf) in {_windows(start, batch, total)}; "
            "the checkpoint may be corrupt",
            value=value,
            window=start,
        )
    return value


def _result(nll_sum: float, n_windows: int, length: int, bos_id: int | None) -> PerplexityResult:
    """The perplexity of ``nll_sum`` nats over ``n_windows`` windows of ``length`` tokens."""
    count = n_windows * (length - 1)
    try:
        ppl = math.exp(nll_sum / count)
    except OverflowError:  # finite logits, but a mean NLL above ~709 nats
        ppl = math.inf
    return PerplexityResult(
        perplexity=ppl, nll_sum=nll_sum, tokens=count, windows=n_windows, seqlen=length, bos_id=bos_id
    )


# Models whose causal-LM forward ends in ``logits = head(hidden)`` and nothing else (no soft-capping,
# no logit scale): their logits can be computed a slice of rows at a time.
_PLAIN_HEADS = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_HEAD_ROWS = 512  # logit rows at a time: 512 x vocab x 4 bytes (0.1 GB for a 49k vocabulary), twice


def _batch_nll(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The summed NLL of a batch of windows (position t predicts token t+1).

    ``F.cross_entropy(logits, labels, reduction="sum")`` is ``log_softmax`` per row, then
    ``nll_loss``'s sum over the rows. For a plain head (``_PLAIN_HEADS``) the logits are never
    held whole (8 windows of 512 tokens of a 49k vocabulary are 0.8 GB, and the loss made two
    more such tensors): the model runs with its head swapped for the identity, then the head, the
    ``log_softmax`` and the pick of each label run ``_HEAD_ROWS`` rows at a time, and
    ``nll_loss`` sums the picked values in the same order: the same bits as the whole-batch loss
    (tests/eval/test_perplexity_rows.py)."""
    labels = batch[:, 1:].reshape(-1)
    head_name = _plain_head(model)
    if head_name is None:
        logits = _logits(model(input_ids=batch, use_cache=False))
        return F.cross_entropy(logits[:, :-1, :].float().reshape(-1, logits.shape[-1]), labels, reduction="sum")
    rows, head = _head_inputs(model, batch, head_name)
    picked = [
        F.log_softmax(head(rows[s : s + _HEAD_ROWS]).float(), 1).gather(1, labels[s : s + _HEAD_ROWS, None])
        for s in range(0, rows.shape[0], _HEAD_ROWS)
    ]
    return _picked_sum(picked, labels)


def _picked_sum(picked: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """``nll_loss``'s sum over each label's log-probability, ``picked`` a slice of rows [r, 1] at a
    time in row order: the bits of the whole-logits loss (tests/eval/test_perplexity_rows.py)."""
    return F.nll_loss(torch.cat(picked), torch.zeros_like(labels), reduction="sum")


def _head_inputs(model: torch.nn.Module, batch: torch.Tensor, head_name: str) -> tuple[torch.Tensor, torch.nn.Module]:
    """The rows the plain head ``head_name`` would read for every predicting position of
    ``batch`` ([windows * (L - 1), hidden]), from one forward with the head swapped for the
    identity, and the head itself: the caller applies it ``_HEAD_ROWS`` rows at a time."""
    parent_name, _, attr = head_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    head = getattr(parent, attr)
    setattr(parent, attr, torch.nn.Identity())
    try:
        hidden = _logits(model(input_ids=batch, use_cache=False))
    finally:
        setattr(parent, attr, head)
    return hidden[:, :-1, :].reshape(-1, hidden.shape[-1]), head


def _plain_head(model: torch.nn.Module) -> str | None:
    """The name of the output head of a model in ``_PLAIN_HEADS``, or None (then logits are whole)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEADS or getattr(config, "final_logit_softcapping", None):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return None
    return next((n for n, m in model.named_modules() if m is head and n), None)


def _windows(start: int, batch: torch.Tensor, total: int) -> str:
    last = start + batch.shape[0]
    return f"window {last} of {total}" if last == start + 1 else f"windows {start + 1}..{last} of {total}"


def perplexity(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    seqlen: int = 512,
    windows: int | None = None,
    bos_id: int | None = None,
    batch_size: int = 1,
    progress: bool = False,
    device: str | torch.device | None = None,
) -> float:
    """exp(mean NLL per predicted token) over consecutive non-overlapping windows of ``tokens``.

    ``tokens``: a 1-D token sequence, cut by :func:`optq.data.tokens.eval_windows` into ``windows``
    windows of ``seqlen`` (each starting with ``bos_id`` when given), or ready windows
    ``[W, L]``. Each window of L tokens predicts its last L-1 tokens (the first token or BOS is
    context only). The model runs in eval mode under no_grad with ``use_cache=False``; any
    module taking ``input_ids=`` and returning logits ``[B, L, V]`` (or an object with
    ``.logits``) works. ``device`` defaults to the model's.

    Raises ValueError up front for windows longer than the model's positions
    (``config.max_position_embeddings``), and :class:`NonFiniteLogitsError` (a ValueError) as
    soon as a batch's logits hold NaN or Inf.
    """
    return perplexity_detail(
        model,
        tokens,
        seqlen=seqlen,
        windows=windows,
        bos_id=bos_id,
        batch_size=batch_size,
        progress=progress,
        device=device,
    ).perplexity
