"""Expected outputs beside a checkpoint: ``optq_probes.json``, what the quantized model must produce.

For a few prompts (:data:`PROMPTS`, or the caller's) the file records the prompt's token ids, the
greedy continuation (:data:`NEW_TOKENS` tokens) and the top :data:`TOP_K` log-probabilities at each
step, computed by optq's exact reference path: the checkpoint loaded back from its own files, every
quantized layer's dequantized weight (``scales * (codes - zeros)``) in float32, the rest of the
model in float32 (:func:`exact`). ``optq verify`` decodes the same token ids on other engines
and compares (optq.eval.verify). The file is deterministic: the same checkpoint, library
versions and thread count give the same bytes (log-probabilities rounded to 6 decimals).

Format (``"format": "optq-probes/1"``)::

    {"format": "optq-probes/1", "new_tokens": 16, "top_k": 5,
     "produced_by": {"optq": "0.1.0", "path": "exact reference ...", "dtype": "float32",
                     "torch": "...", "transformers": "..."},
     "prompts": [{"text": "The capital of France is", "prompt_ids": [504, 3575, ...],
                  "tokens": [7042, ...],                      # new_tokens greedy token ids
                  "top_logprobs": [[[7042, -0.61], [...], ...], ...]}]}  # per step, best first

A checkpoint without the file loads as before; verify says it has nothing to compare.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optq.formats.atomic import atomic_write

__all__ = [
    "PROBES_FILE",
    "PROMPTS",
    "NEW_TOKENS",
    "TOP_K",
    "FORMAT",
    "MAX_PROMPTS",
    "read_prompts",
    "exact",
    "greedy",
    "record",
    "write",
    "read",
    "record_into",
]

log = logging.getLogger("optq.probes")

PROBES_FILE = "optq_probes.json"
FORMAT = "optq-probes/1"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
)
NEW_TOKENS = 16
TOP_K = 5
MAX_PROMPTS = 64
MAX_PROMPT_CHARS = 2000
EXACT_PATH = "exact reference: dequantized weights (scales * (codes - zeros)), float32 forward"


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a ``--probe-prompts`` file: UTF-8 text, one prompt per line, blank lines
    skipped, 1 to :data:`MAX_PROMPTS` prompts of at most :data:`MAX_PROMPT_CHARS` characters.
    Raises ValueError naming the file and what is wrong."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); give one prompt per line") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompt in it; give one prompt per line")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"{path}: {len(prompts)} prompts, at most {MAX_PROMPTS}; probes are meant to be cheap")
    for i, p in enumerate(prompts, 1):
        if len(p) > MAX_PROMPT_CHARS:
            raise ValueError(f"{path}: prompt {i} has {len(p)} characters, at most {MAX_PROMPT_CHARS}")
    return prompts


def exact(model: nn.Module) -> nn.Module:
    """``model`` (from :func:`optq.formats.loading.load` with ``dtype=torch.float32,
    embeddings="model", fast_path=False``) on optq's exact reference path: each QuantLinear
    computes ``F.linear(x, dequantize(float32), bias)``, exactly its ``forward_reference`` for
    float32 inputs, with the dequantized weight computed once instead of at every call."""
    from optq.formats.qlinear import QuantLinear

    for q in model.modules():
        if isinstance(q, QuantLinear):
            q.use_fast_path = False
            weight = _dequantize(q)
            bias = None if q.bias is None else q.bias.to(torch.float32)
            q.forward = _Pinned(weight, bias)  # an instance attribute: nn.Module.__call__ runs it
    return model


def _dequantize(q: Any) -> torch.Tensor:
    """``q.dequantize(torch.float32)``, the same values bit for bit (the same float32 operations
    per weight), computed in the packed tensors' own [K, N] layout: rows of ``scales`` gathered
    instead of columns, about 3.7 times faster on SmolLM2's layers (measured)."""
    from optq.formats.packing import unpack, zero_offset

    g = q.g_idx.long()
    codes = unpack(q.qweight, q.bits, q.in_features, dim=0)  # [K, N]
    zeros = unpack(q.qzeros, q.bits, q.out_features, dim=1) + zero_offset(q.checkpoint_format)  # [G, N]
    weight = q.scales[g].to(torch.float32) * (codes.to(torch.float32) - zeros[g].to(torch.float32))
    return weight.t().contiguous()


class _Pinned:
    """A reference forward whose dequantized weight is computed once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.weight.to(x.dtype), bias)


def _top(logits: torch.Tensor, k: int) -> dict[int, float]:
    """The ``k`` best log-probabilities of one step, best first (ties by token id)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(lp, min(k + 1, lp.numel()))
    pairs = sorted(zip(ids.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))[:k]
    return dict(pairs)


@torch.inference_mode()
def greedy(model: nn.Module, prompt_ids: Sequence[int], new_tokens: int, top_k: int) -> dict[str, list]:
    """Greedy decoding of one prompt with a KV cache: ``{"tokens": [id, ...], "logprobs":
    [{id: logprob} (top_k, best first) per step]}`` (the engines' common shape)."""
    if not prompt_ids:
        raise ValueError("a probe prompt has no tokens")
    out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True)
    tokens: list[int] = []
    steps: list[dict[int, float]] = []
    for step in range(new_tokens):
        top = _top(out.logits[0, -1], top_k)
        token = next(iter(top))
        tokens.append(token)
        steps.append(top)
        if step + 1 < new_tokens:
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return {"tokens": tokens, "logprobs": steps}


def _tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder``, or None when it holds none."""
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def record(
    folder: str | Path,
    tokenizer: Any = None,
    prompts: Sequence[str] | None = None,
    *,
    prompt_ids: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The probes of the checkpoint ``folder`` (its files, as any engine reads them): the
    ``prompts`` (default :data:`PROMPTS`) tokenized by ``tokenizer`` (default: the folder's), or
    ``prompt_ids`` given as token ids (then ``text`` is null), decoded on :func:`exact`."""
    import transformers

    from optq import __version__
    from optq.formats.loading import load

    folder = Path(folder)
    if prompt_ids is None:
        tokenizer = tokenizer if tokenizer is not None else _tokenizer(folder)
        if tokenizer is None:
            raise ValueError(f"{folder} has no tokenizer: give the prompts as token ids")
        texts = list(prompts if prompts is not None else PROMPTS)
        ids = [list(tokenizer(t)["input_ids"]) for t in texts]
        for t, i in zip(texts, ids):
            if not i:
                raise ValueError(f"probe prompt {t!r} has no tokens after tokenization")
    else:
        texts, ids = [None] * len(prompt_ids), [[int(t) for t in p] for p in prompt_ids]
    model = exact(load(folder, dtype=torch.float32, embeddings="model", fast_path=False))
    entries = []
    for text, p in zip(texts, ids):
        out = greedy(model, p, NEW_TOKENS, TOP_K)
        steps = [[[t, round(lp, 6)] for t, lp in s.items()] for s in out["logprobs"]]
        entries.append({"text": text, "prompt_ids": p, "tokens": out["tokens"], "top_logprobs": steps})
    produced_by = {
        "optq": __version__,
        "path": EXACT_PATH,
        "dtype": "float32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return {"format": FORMAT, "new_tokens": NEW_TOKENS, "top_k": TOP_K, "produced_by": produced_by, "prompts": entries}


def write(folder: str | Path, probes: dict[str, Any]) -> Path:
    """Write ``probes`` as ``folder/optq_probes.json`` atomically (sorted keys: same bytes for
    the same probes)."""
    return atomic_write(Path(folder) / PROBES_FILE, json.dumps(probes, indent=1, sort_keys=True) + "\n")


def read(folder: str | Path) -> dict[str, Any] | None:
    """The probes of ``folder`` (None when it has no probes file), checked: ValueError naming
    the file when it is not what :func:`write` writes."""
    path = Path(folder) / PROBES_FILE
    if not path.is_file():
        return None
    try:
        probes = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    found = probes.get("format") if isinstance(probes, dict) else None
    if found != FORMAT:
        raise ValueError(f"{path}: not an {FORMAT} file (format {found!r})")
    for i, p in enumerate(probes.get("prompts") or [], 1):
        ok = isinstance(p, dict) and all(isinstance(p.get(k), list) for k in ("prompt_ids", "tokens", "top_logprobs"))
        if not ok or not p["prompt_ids"] or len(p["tokens"]) != len(p["top_logprobs"]):
            raise ValueError(f"{path}: prompt {i} lacks prompt_ids, tokens or top_logprobs of equal length")
    if not probes.get("prompts"):
        raise ValueError(f"{path}: records no prompt")
    return probes


def _fp32_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's model in float32, quantized layers dequantized (counted as 4-bit:
    8 codes per int32 word; 2- and 3-bit models are counted low, which the caller's margin covers)."""
    from optq.formats.files import read_index

    total = 0
    for key, (_, shape, _) in read_index(folder).items():
        if key.endswith((".qweight", ".weight_packed")):
            total += 4 * 8 * math.prod(shape)
        elif not key.endswith((".qzeros", ".g_idx", ".weight_zero_point", ".weight_shape")):
            total += 4 * math.prod(shape)
    return total


def _available() -> int | None:
    """Memory available to this process, in bytes (None when unknown)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def record_into(folder: str | Path, prompts: Sequence[str] | None = None, tokenizer: Any = None) -> Path | None:
    """Record and write the probes of the checkpoint ``folder`` when it has a tokenizer (or
    ``tokenizer`` is given) and its float32 model fits in memory twice over; else, or when the
    recording fails (a warning names the error), write nothing and return None. The path
    written otherwise."""
    folder = Path(folder)
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(folder)
    if tokenizer is None:
        log.info("%s: no tokenizer, so no %s (optq verify will have nothing to compare)", folder, PROBES_FILE)
        return None
    need, free = 2 * _fp32_bytes(folder), _available()
    if free is not None and need > free:
        log.warning(
            "%s: no %s written: its float32 reference model needs about %.1f GB, %.1f GB are free",
            folder,
            PROBES_FILE,
            need / 1e9,
            free / 1e9,
        )
        return None
    try:
        probes = record(folder, tokenizer, prompts)
    except Exception as exc:  # the checkpoint stays valid without it: say why, do not fail the write
        log.warning("%s: no %s written, recording failed: %s: %s", folder, PROBES_FILE, type(exc).__name__, exc)
        return None
    return write(folder, probes)
