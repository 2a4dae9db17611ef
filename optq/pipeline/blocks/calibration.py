"""Turning what the user passed as calibration data into equal-sized token batches."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["calibration_samples", "make_batches", "max_positions", "check_seqlen", "tensor_digest"]

DEFAULT_NSAMPLES = 128
DEFAULT_SEQLEN = 512


def _windows(stream: torch.Tensor, nsamples: int, seqlen: int, seed: int) -> list[torch.Tensor]:
    if stream.numel() < nsamples * seqlen:
        raise ValueError(
            f"the calibration text has {stream.numel()} tokens, fewer than nsamples x seqlen = "
            f"{nsamples} x {seqlen} = {nsamples * seqlen}; give more text or lower nsamples/seqlen"
        )
    from optq.data.tokens import calibration_tokens  # the one seeded window protocol

    return list(calibration_tokens(stream, nsamples, seqlen, seed))


def _tokenize(texts: str | Sequence[str], tokenizer: Any) -> torch.Tensor:
    if tokenizer is None:
        raise ValueError("calibration is text: pass tokenizer= (or give token ids instead)")
    text = texts if isinstance(texts, str) else "\n\n".join(texts)
    try:
        from optq.data.tokens import tokenize  # the data module's protocol (no special tokens)
    except ImportError:
        return torch.as_tensor(tokenizer(text)["input_ids"], dtype=torch.long).reshape(-1)
    return tokenize(text, tokenizer)


def _check_range(name: str, value: int | None, high: int, what: str) -> None:
    if value is not None and not (isinstance(value, int) and 1 <= value <= high):
        raise ValueError(f"{name}={value!r} is out of range: {what} allow 1..{high}")


def max_positions(model: Any) -> int | None:
    """The longest sequence a model (or its transformers config) takes: the config's
    ``max_position_embeddings``, or None."""
    limit = getattr(getattr(model, "config", model), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_seqlen(seqlen: int | None, limit: int | None) -> None:
    """Refuse windows longer than the model's ``limit`` positions (see ``max_positions``), up
    front: ``optq.quantize``, ``optq.perplexity`` and the command line share this one check."""
    if limit is not None:
        _check_range("seqlen", seqlen, limit, "the model's positions")


def calibration_samples(
    calibration: Any,
    *,
    tokenizer: Any = None,
    nsamples: int | None = None,
    seqlen: int | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> list[torch.Tensor]:
    """Calibration samples as a list of 1-D LongTensors.

    ``calibration`` is a LongTensor [n, seqlen] (rows are samples), a list of 1-D LongTensors,
    a 1-D LongTensor (a token stream: ``nsamples`` random windows of ``seqlen`` tokens are drawn
    with ``seed``), or a string / list of strings, tokenized with ``tokenizer`` into such a stream.
    """
    for name, value in (("nsamples", nsamples), ("seqlen", seqlen)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r} is out of range: give a positive integer")
    check_seqlen(seqlen, max_positions)
    if isinstance(calibration, str) or (
        isinstance(calibration, Sequence) and calibration and all(isinstance(t, str) for t in calibration)
    ):
        calibration = _tokenize(calibration, tokenizer)
    if isinstance(calibration, torch.Tensor):
        if calibration.dtype not in (torch.int64, torch.int32) or calibration.dim() not in (1, 2):
            raise ValueError(
                f"calibration tensor must hold token ids (int64) of shape [n, seqlen] or [tokens], "
                f"got {calibration.dtype} {tuple(calibration.shape)}"
            )
        if calibration.dim() == 1:
            samples = _windows(calibration.long(), nsamples or DEFAULT_NSAMPLES, seqlen or DEFAULT_SEQLEN, seed)
        else:
            samples = list(calibration.long())
    elif isinstance(calibration, Sequence) and all(isinstance(t, torch.Tensor) for t in calibration):
        samples = [torch.as_tensor(t).long().reshape(-1) for t in calibration]
    else:
        raise TypeError(
            "calibration must be token ids (LongTensor [n, seqlen], a list of 1-D LongTensors, "
            f"a 1-D token stream) or text with a tokenizer, not {type(calibration).__name__}"
        )
    if not samples:
        raise ValueError("calibration is empty: give at least one sample")
    _check_range("nsamples", nsamples, len(samples), f"the {len(samples)} calibration samples")
    samples = samples[: nsamples or len(samples)]
    if seqlen is not None:
        short = [i for i, s in enumerate(samples) if s.numel() < seqlen]
        if short:
            raise ValueError(
                f"seqlen={seqlen} is out of range: calibration sample {short[0]} has only "
                f"{samples[short[0]].numel()} tokens; lower seqlen or give longer samples"
            )
        samples = [s[:seqlen] for s in samples]
    for i, s in enumerate(samples):
        if s.numel() == 0:
            raise ValueError(f"calibration sample {i} is empty")
        if vocab_size is not None and (int(s.min()) < 0 or int(s.max()) >= vocab_size):
            raise ValueError(
                f"calibration sample {i} holds token ids outside the model's vocabulary "
                f"(0..{vocab_size - 1}): was it tokenized with this model's tokenizer?"
            )
    if max_positions is not None and max(s.numel() for s in samples) > max_positions:
        raise ValueError(
            f"calibration samples are longer than the model's {max_positions} positions; pass seqlen to truncate them"
        )
    return samples


def make_batches(samples: Sequence[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Stack consecutive samples of equal length into batches of at most ``batch_size``."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is out of range: give a positive integer")
    batches: list[list[torch.Tensor]] = []
    for s in samples:
        if batches and len(batches[-1]) < batch_size and batches[-1][0].numel() == s.numel():
            batches[-1].append(s)
        else:
            batches.append([s])
    return [torch.stack(b) for b in batches]


def tensor_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the dtypes, shapes and bytes of ``tensors`` (the calibration samples)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
