"""Smaller float tensors for a loaded model: the token embedding table and the output head.

Once the decoder's linears are 4-bit, the float tensors left dominate a small model: SmolLM2-135M's
tied 49152 x 576 embedding is 113 MB in float32 against 55 MB for all its packed linears, and its
head is the largest matrix read per decoded token. :func:`compact_embeddings` stores them as

- ``"bfloat16"``: half the bytes; lookups return the model's dtype, the head multiplies in
  bfloat16 (the CPU's bfloat16 matmul; where that is emulated, long inputs go through float32,
  :data:`HEAD_FLOAT32_ROWS`) and returns the model's dtype. Every value is rounded
  to 8 significant bits, as the fast path's activations already are.
- ``"int8"``: a quarter of the bytes, one float32 scale per row (symmetric, |max| / 127); the
  head runs PyTorch's int8 weight kernel ``_weight_int8pack_mm`` (one scale per output channel:
  here per vocabulary row, exactly this layout), lookups dequantize the rows they read.

A tied table stays one tensor shared by the lookup and the head. A quantized head
(:class:`~optq.formats.qlinear.QuantLinear`) is left as it is. Scaled embeddings (Gemma's
``embed_scale``) keep their scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

logger = logging.getLogger("optq.checkpoint")

__all__ = ["EMBEDDINGS", "CompactEmbedding", "CompactHead", "compact_embeddings"]

EMBEDDINGS = ("model", "bfloat16", "int8")
"""Storage of the embedding table and head: the model's dtype (unchanged), bfloat16, int8.
``optq.load`` stores them in bfloat16 unless told otherwise: on SmolLM2-135M's default 4-bit
checkpoint that changed enwiki perplexity by +0.004% (int8: +0.24%) and saved 57 MB of the
loaded model's 237 (benchmarks/inference.py)."""


Rows = Callable[[torch.Tensor, int, int], torch.Tensor]
"""``rows(weight, a, b)``: rows ``a:b`` of a table, in its dtype (``weight[a:b]`` unless a loader
reads them from its file, the table itself still on the meta device)."""
_CHUNK = 4 << 20  # bytes of float32 rows converted at a time

HEAD_FLOAT32_ROWS = 64
"""On a CPU whose bfloat16 matmul is emulated (``cpu_kernels.BF16_MATMUL_NATIVE`` False: x86
with AVX2 only), a bfloat16 head multiplies at least this many rows in float32, over the same
bfloat16 operands, a slice of the table at a time. Measured on a 2-core AMD EPYC without
AVX-512, SmolLM2's head [49152, 576]: 511 rows took 4.27 s in bfloat16 against 1.13 s so, 64
rows 0.48 s against 0.45 s, one row (decoding) 0.013 s against 0.107 s: below this, bfloat16."""
_HEAD_SLICE = 4096  # table rows made float32 at a time: 9 MB for a width of 576


def _slice(weight: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return weight[a:b]


class _Table(nn.Module):
    """A [rows, width] table in bfloat16, or int8 with one float32 scale per row; converted a
    block of rows at a time (each row on its own: the same values as converting it whole)."""

    def __init__(self, weight: torch.Tensor, kind: str, rows: Rows | None = None) -> None:
        super().__init__()
        read = rows or _slice
        n, width = weight.shape
        step = max(1, _CHUNK // max(1, 4 * width))
        store = torch.int8 if kind == "int8" else torch.bfloat16
        table = scale = None
        for a in range(0, n, step):
            block = read(weight, a, min(n, a + step)).detach()
            if table is None:
                table = torch.empty(n, width, dtype=store, device=block.device)
                scale = torch.empty(n, dtype=torch.float32, device=block.device) if kind == "int8" else None
            b = a + block.shape[0]
            if kind == "int8":
                s = block.abs().amax(dim=1).float().clamp(min=torch.finfo(torch.float32).tiny) / 127.0
                table[a:b] = torch.round(block.float() / s[:, None]).clamp_(-127, 127).to(torch.int8)
                scale[a:b] = s
            else:
                table[a:b] = block.to(torch.bfloat16)
            del block
        if table is None:  # no rows
            table = torch.empty(n, width, dtype=store, device=weight.device)
            scale = torch.empty(n, dtype=torch.float32, device=weight.device) if kind == "int8" else None
        self.register_buffer("weight", table)
        if scale is not None:
            self.register_buffer("scale", scale)
            self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        else:
            self.scale = self.scale_bf16 = None
        self.kind = kind

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = F.embedding(ids, self.weight).to(dtype)
        if self.scale is not None:
            out = out * self.scale[ids].unsqueeze(-1).to(dtype)
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ table.T`` in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if self.scale is None:
            if cpu_kernels.BF16_MATMUL_NATIVE or x2.shape[0] < HEAD_FLOAT32_ROWS:
                y = F.linear(x2, self.weight)
            else:
                y = _bf16_product_in_float32(x2, self.weight)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scale_bf16)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _bf16_product_in_float32(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x @ table.T`` for bfloat16 ``x`` [M, K] and ``table`` [N, K] by the float32 kernel, a
    slice of the table's rows at a time; rounded to bfloat16, as the bfloat16 kernel returns it."""
    xf = x.float()
    out = torch.empty(x.shape[0], table.shape[0], dtype=torch.bfloat16, device=x.device)
    for a in range(0, table.shape[0], _HEAD_SLICE):
        out[:, a : a + _HEAD_SLICE] = xf @ table[a : a + _HEAD_SLICE].float().T
    return out


class CompactEmbedding(nn.Module):
    """A token embedding read from a compact table, returned in ``dtype`` (times ``embed_scale``)."""

    def __init__(self, table: _Table, dtype: torch.dtype, embed_scale: torch.Tensor | float | None = None) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        if isinstance(embed_scale, torch.Tensor):
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = embed_scale

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.rows(ids, self.dtype)
        if self.embed_scale is not None:
            scale = self.embed_scale
            out = out * (scale.to(self.dtype) if isinstance(scale, torch.Tensor) else scale)
        return out

    def extra_repr(self) -> str:
        return f"{tuple(self.table.weight.shape)}, storage={self.table.kind}"


class CompactHead(nn.Module):
    """An output head ``x @ table.T (+ bias)`` over a compact table."""

    def __init__(self, table: _Table, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.table = table
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.table.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.table.weight.shape)}, storage={self.table.kind}"


def compact_embeddings(model: nn.Module, kind: str, rows: Rows | None = None) -> nn.Module:
    """Store ``model``'s input embedding and float output head as ``kind`` (see :data:`EMBEDDINGS`).

    In place; returns ``model``. ``rows`` (see :data:`Rows`) gives the tables' rows, a block at
    a time, when they are not in memory (optq.load: never the whole float table at once).
    ``"model"`` changes nothing, nor does an input embedding that
    is not an ``nn.Embedding`` (a warning says so). A head tied to the embedding shares its
    compact table; an untied float head gets its own.
    """
    if kind not in EMBEDDINGS:
        raise ValueError(f"embeddings={kind!r}: choose one of {EMBEDDINGS}")
    if kind == "model":
        return model
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding):
        logger.warning("the input embedding is a %s, not nn.Embedding: kept as it is", type(embed).__name__)
        return model
    dtype = embed.weight.dtype
    table = _Table(embed.weight, kind, rows)
    tied = isinstance(head, nn.Linear) and head.weight is embed.weight
    model.set_input_embeddings(CompactEmbedding(table, dtype, getattr(embed, "embed_scale", None)))
    if isinstance(head, nn.Linear):
        head_table = table if tied else _Table(head.weight, kind, rows)
        model.set_output_embeddings(CompactHead(head_table, head.bias))
    return model
