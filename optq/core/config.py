"""Quantization settings: one frozen, validated dataclass shared by the solver, pipeline and CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["QuantConfig", "SUPPORTED_BITS"]

# The code widths the checkpoint formats can pack into int32 words (optq.formats.packing reads
# them from here). The solver itself would run at any width from 2 to 8; 5, 6 and 7 are
# refused up front so that a long quantization never ends in a checkpoint that cannot be saved.
SUPPORTED_BITS: tuple[int, ...] = (2, 3, 4, 8)


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"QuantConfig.{field}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How to quantize each linear layer.

    Example::

        >>> cfg = QuantConfig(bits=4, group_size=128)
        >>> cfg.maxq
        15

    Fields:
        bits: code width: 2, 3, 4 or 8 (SUPPORTED_BITS, what the checkpoint formats pack).
        group_size: input channels sharing one scale/zero; -1 = one group per output channel.
            When it does not divide the layer width the last group is simply shorter.
        sym: symmetric grid (zero point fixed at 2^(bits-1)) or asymmetric (min/max fitted).
        act_order: quantize columns by descending Hessian diagonal (GPTQ "desc_act"). On by
            default, with static_groups: together they cost nothing at inference time.
        static_groups: with act_order, fit every group's parameters up front from the
            unquantized weights in natural column order, so g_idx stays k // group_size (the
            checkpoint then needs no reordering). Defaults to the value of act_order.
        damp: fraction of the mean Hessian diagonal added to the diagonal before factorising.
        damp_max: the largest damping fraction tried when the factorisation fails (the solver
            escalates geometrically from ``damp`` up to this value, then raises).
        block_size: width of the lazy-update blocks of the GPTQ solver.
        mse: fit each channel's/group's grid by searching shrunken ranges for the least
            rounding error instead of plain min/max. On by default since 2026-12-06: with
            ``mse_hessian``, GPTAQ's ratio to round-to-nearest's loss fell on 31 of the 32
            texts x models x bit widths of the shift matrix (docs/shift.md); ``mse=False`` is
            min/max.
        mse_grid: number of candidate shrink steps of that search.
        mse_maxshrink: largest fraction of the range the search may cut (0 < x < 1).
        mse_norm: exponent of the rounding error minimised by the search (2 = squared error).
        mse_hessian: with mse, weight each input column's rounding error in that search by the
            Hessian's diagonal (the column's mean squared calibration activation; llama.cpp's
            importance matrix, llm-compressor's ``imatrix_mse``): at mse_norm 2 the search
            minimises the diagonal part of the layer objective instead of the plain weight error.
            Defaults to the value of mse. Only methods that read a Hessian (gptq, gptaq) can
            weight: round-to-nearest reads none, so with it its ranges stay min/max
            (``grid.without_hessian``); ``mse_hessian=False`` gives it the unweighted search.
        normalize_tokens: accumulate each layer's Hessian from calibration tokens scaled to unit
            RMS, so every token weighs the same in the layer objective. Plain GPTQ weighs tokens
            by their squared activation norm, and in real models a few massive-activation
            tokens then own H; on SmolLM2-135M that made plain GPTQ lose to round-to-nearest
            end to end (docs/results.md, "Quality"). Only the pipeline reads it (optq.quantize).
        diag_shrink: shrink the Hessian toward its diagonal before solving,
            H <- (1 - s) H + s diag(H). The off-diagonal terms are the input correlations that
            GPTQ's compensation exploits; where calibration and serving text differ, those
            correlations may not hold. 0 is plain GPTQ; 1 makes H diagonal, where GPTQ
            compensates nothing and equals round-to-nearest. The default, 0.5, was chosen on
            the shift matrix (docs/lab.md, section 8): calibrated on enwiki, it beats
            round-to-nearest on every text measured at 3 and 4 bits on SmolLM2-135M and
            Gemma-3-270M, where plain GPTQ loses on code, Japanese and Chinese, and keeps 98%
            of plain GPTQ's gain on the calibration text; it costs perplexity on Gemma-3-270M
            at 3 bits. Report objectives stay on the unshrunk H.
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = True
    static_groups: bool | None = None
    damp: float = 0.01
    damp_max: float = 1.0
    block_size: int = 128
    mse: bool = True
    mse_grid: int = 100
    mse_maxshrink: float = 0.8
    mse_norm: float = 2.0
    mse_hessian: bool | None = None
    normalize_tokens: bool = True
    diag_shrink: float = 0.5

    def __post_init__(self) -> None:
        if self.static_groups is None:  # default: static groups whenever act-order is on
            object.__setattr__(self, "static_groups", self.act_order)
        if self.mse_hessian is None:  # default: the range search weighted by H whenever it runs
            object.__setattr__(self, "mse_hessian", self.mse)
        for f in fields(self):
            value = getattr(self, f.name)
            kind = f.type.split(" ")[0]  # "bool | None" is resolved above
            expected = {"bool": bool, "int": int, "float": (int, float)}[kind]
            # bool is an int subclass: refuse True for numeric fields and 1 for booleans.
            if isinstance(value, bool) != (kind == "bool") or not isinstance(value, expected):
                _fail(f.name, value, f"a value of type {kind}")
        if self.bits not in SUPPORTED_BITS:
            _fail("bits", self.bits, f"one of {SUPPORTED_BITS}, the widths the checkpoint formats can pack")
        if self.group_size != -1 and self.group_size < 1:
            _fail("group_size", self.group_size, "-1 (per output channel) or a positive integer")
        if self.static_groups and not self.act_order:
            _fail("static_groups", True, "True only together with act_order=True")
        if not 0.0 <= self.damp < float("inf") or self.damp != self.damp:
            _fail("damp", self.damp, "a finite fraction >= 0 of the mean Hessian diagonal")
        if not self.damp_max >= self.damp or self.damp_max == float("inf"):
            _fail("damp_max", self.damp_max, f"a finite value >= damp ({self.damp})")
        if self.block_size < 1:
            _fail("block_size", self.block_size, "a positive integer")
        if self.mse_grid < 1:
            _fail("mse_grid", self.mse_grid, "a positive integer")
        if not 0.0 < self.mse_maxshrink < 1.0:
            _fail("mse_maxshrink", self.mse_maxshrink, "a fraction strictly between 0 and 1")
        if not self.mse_norm > 0.0:
            _fail("mse_norm", self.mse_norm, "a positive exponent")
        if self.mse_hessian and not self.mse:
            _fail(
                "mse_hessian",
                True,
                "True only together with mse=True (it weights the mse search; default: mse's value; "
                "dataclasses.replace(config, mse=False) keeps the resolved mse_hessian=True: "
                "pass mse_hessian=False too)",
            )
        if not 0.0 <= self.diag_shrink <= 1.0:
            _fail("diag_shrink", self.diag_shrink, "a fraction from 0 to 1")

    @property
    def natural_groups(self) -> bool:
        """Whether ``g_idx`` stays k // group_size: no act-order, or act-order with static groups
        (loaders need not reorder; a checkpoint's ``desc_act`` is the negation)."""
        return not self.act_order or bool(self.static_groups)

    @property
    def maxq(self) -> int:
        """The largest code, 2^bits - 1."""
        return (1 << self.bits) - 1

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (for reports and checkpoint metadata)."""
        return asdict(self)
