"""Run settings: everything a quantization run needs beyond ``QuantConfig``, in one object.

``QuantConfig`` says how each linear layer is rounded; :class:`RunSettings` says how the run
around it goes: the calibration's shape, how activations propagate, the execution strategy and
device, the compute and Hessian dtypes, the mixture-of-experts policy, memory budgets, and the
output. It is frozen and validated once, where it is built (``optq.quantize``,
``quantize_pretrained``, the CLI), and then passed whole to preparation, the block loop, the
expert stages, the dry-run plan, the journal (which compares it on resume) and the report
(which records :meth:`RunSettings.to_dict`). Nothing below restates a default.

Example::

    >>> s = RunSettings(nsamples=64, seqlen=256, hessian_dtype="float64")
    >>> s.hessian_itemsize
    8
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optq.core.gptaq import DEFAULT_ALPHA
from optq.formats.engines import parse_engines
from optq.formats.files import parse_size
from optq.formats.layout import CHECKPOINT_FORMATS
from optq.pipeline import methods
from optq.pipeline.schemes import parse_overrides

__all__ = [
    "RunSettings",
    "GPTAQ_FORMS",
    "PROPAGATE",
    "STRATEGIES",
    "MOE_CALIBRATION",
    "MOE_WEIGHTING",
    "FORMATS",
    "COMPUTE_DTYPES",
    "HESSIAN_DTYPES",
    "default_hessian_budget",
    "dtype_name",
]

GPTAQ_FORMS = ("paper", "full")
PROPAGATE = ("quantized", "original")
STRATEGIES = ("pause", "replay")
MOE_CALIBRATION = ("routed", "all")
MOE_WEIGHTING = ("none", "routing")
FORMATS = CHECKPOINT_FORMATS
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
HESSIAN_DTYPES = ("float32", "float64")


def default_hessian_budget() -> int:
    """A quarter of this machine's physical memory, in bytes: how work is chunked, never what
    it computes (so it may depend on the machine)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: a dtype as the settings and the report write it."""
    return str(dtype).removeprefix("torch.")


def _patterns(value: Sequence[str] | str | None, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(p, str) and p for p in items):
        raise ValueError(f"{what}={value!r} must be a pattern or a list of non-empty patterns")
    return items


def _engines(value: Any) -> tuple[str, ...]:
    text = value if isinstance(value, str) else ",".join(value or ())
    return () if text.strip() in ("", "none") else parse_engines(text)


def _target_bits(s: RunSettings) -> None:
    b = s.target_bits
    if b is None:
        return
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 2 < b <= 10:
        raise ValueError(
            f"target_bits={b!r} is out of range: give the average stored bits per weight, above 2 "
            "(2-bit codes plus their scales) and at most 10 (8-bit codes with small groups)"
        )
    object.__setattr__(s, "target_bits", float(b))
    if s.overrides:
        raise ValueError("target_bits chooses every layer's bits and group size: give it without overrides")
    if "transformers" in s.serve and s.format != "compressed-tensors":
        raise ValueError(
            f"target_bits gives layers different bits, but transformers reads a {s.format} checkpoint with one "
            "scheme for every layer (optimum ignores per-layer `dynamic`): name the engines you serve with "
            "without transformers (--serve vllm,optq), or write --format compressed-tensors"
        )


def _gptaq(s: RunSettings) -> None:
    a = s.gptaq_alpha
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a < float("inf"):
        raise ValueError(f"gptaq_alpha={a!r} is out of range: give a finite number >= 0 (0: GPTQ, 1: the closed form)")
    object.__setattr__(s, "gptaq_alpha", float(a))
    _choice("gptaq_form", s.gptaq_form, GPTAQ_FORMS)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _count(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        more = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, "an integer")
        raise ValueError(f"{name}={value!r} is out of range: give {more}")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How a run goes, beyond how each layer is rounded (``QuantConfig``). Every field maps to
    one command-line flag (``--nsamples`` ... ``--offload-activations``).

    Calibration:
        nsamples, seqlen: windows drawn from a token stream, and their length (None: the
            samples as given; the CLI's defaults are 128 x 512). seed: the draw's seed.
        batch_size: windows per block forward (the weights depend on it only through float
            summation order).
    What and how:
        method: the name of a registered method (``optq.pipeline.methods``; the object is
            :attr:`method_object`, which also refuses settings it cannot honour): "gptaq" (the
            default), "gptq" or "rtn" (round-to-nearest; the report still measures it on H).
            "gptaq" (``optq.core.gptaq``; chosen on the shift matrix, docs/lab.md section 8)
            fits each layer to the float model's outputs: it runs a float copy of each block
            beside the quantized one on the float model's own
            activations (a second copy of the activations, one more block in memory, about one
            more block forward per group), not with propagate="original" nor routed experts.
        gptaq_alpha: the scale of GPTAQ's correction (0: GPTQ; 1: the paper's closed form;
            0.25: the authors' code). gptaq_form: "paper" (each input channel's shift absorbed by
            the later columns as it is rounded) or "full" (start from the least-squares optimum).
        propagate: "quantized" (each block calibrates on the quantized blocks' outputs) or
            "original" (on the unquantized model's; one more forward per block).
        strategy: "replay" (re-run the block per group; least memory) or "pause" (pause every
            batch's forward per group; one forward per block, several times the memory). Blocks
            with experts, repeated calls or several processes are always replayed.
        include, exclude: module-name patterns (wildcards or ``re:REGEX``) choosing the linears.
        overrides: per-layer settings, ``{pattern: {QuantConfig field: value}}`` (or pairs), the
            first matching pattern deciding (``optq.pipeline.schemes``).
    Where it will be served:
        serve: the engines every layer must run on, of "vllm", "transformers", "optq" (or
            "all"; the command line's default). A layer's group size they refuse (one that does
            not divide its width) is replaced by the largest they take; other refusals stop the
            run before work. Empty (the library's default): no check.
        strict_groups: refuse such layers instead, naming them.
        target_bits: average stored bits per quantized weight (scales, zero points and g_idx
            included): each linear's bits (2, 3, 4, 8) and group size are chosen under that
            budget from measured sensitivity, candidates checked by their KL to the float model
            (``optq.pipeline.allocation.allocate``); the config's bits and group size are then
            ignored. Not with ``overrides``, nor with transformers serving a GPTQ format.
        target_check: how many of the allocations with the lowest KL by that check are then
            quantized as the run does (GPTAQ on its own inputs, say; about one run of the method
            each) and compared again, the lowest KL winning; 0: the first check decides.
    Where and in what precision:
        device: the compute device (None: where the model's blocks are; CPU when streaming).
        compute_dtype: dtype of the block forwards, "float32", "bfloat16" or "float16" (None:
            float32 on CPU, the source's dtype on CUDA).
        hessian_dtype: "float32", or "float64" (sums exact enough that batch order and size do
            not change the weights; twice the Hessian memory).
    Mixture of experts (docs/moe.md):
        moe_calibration: "all" (every token through every expert, for the Hessians only) or
            "routed" (the tokens routed to each expert).
        moe_min_tokens: with "routed", an expert routed fewer tokens is starved (None: the
            layer's input width).
        moe_weighting: "none", or "routing" (each routed token weighs its squared routing weight).
        max_hessian_memory: bytes (or "8GB") for one stage of experts' Hessians, and for the
            streams and candidates of ``target_bits``; more are collected in chunks, one forward
            or pass each, to the same weights (None: a quarter of the RAM). It schedules the
            work only: the journal does not record it, and a resume may change it.
    Output (streaming runs):
        format: "gptq", "gptq_v2" or "compressed-tensors".
        max_shard_size: the largest output file, bytes or e.g. "2GB".
        offload_activations: keep the calibration activations in a memory-mapped file in
            ``OUT.partial/`` instead of RAM (CPU only).
    """

    nsamples: int | None = None
    seqlen: int | None = None
    seed: int = 0
    batch_size: int = 8
    method: str = "gptaq"
    gptaq_alpha: float = DEFAULT_ALPHA
    gptaq_form: str = "paper"
    propagate: str = "quantized"
    strategy: str = "replay"
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    overrides: tuple[tuple[str, dict[str, Any]], ...] = ()
    serve: tuple[str, ...] = ()
    strict_groups: bool = False
    target_bits: float | None = None
    target_check: int = 3
    device: str | None = None
    compute_dtype: str | None = None
    hessian_dtype: str = "float32"
    moe_calibration: str = "all"
    moe_min_tokens: int | None = None
    moe_weighting: str = "none"
    max_hessian_memory: int | None = None
    format: str = "gptq"
    max_shard_size: int | str = "5GB"
    offload_activations: bool = False

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # normalise a field of the frozen object
            object.__setattr__(self, name, value)

        _count("nsamples", self.nsamples, minimum=1, optional=True)
        _count("seqlen", self.seqlen, minimum=1, optional=True)
        _count("seed", self.seed, minimum=-(2**63))
        _count("batch_size", self.batch_size, minimum=1)
        methods.get(self.method)  # a registered method's name (the object: ``method_object``)
        _choice("propagate", self.propagate, PROPAGATE)
        _choice("strategy", self.strategy, STRATEGIES)
        put("include", _patterns(self.include, "include"))
        put("exclude", _patterns(self.exclude, "exclude"))
        put("overrides", parse_overrides(self.overrides))
        put("serve", _engines(self.serve))
        if not isinstance(self.strict_groups, bool):
            raise ValueError(f"strict_groups={self.strict_groups!r} must be True or False")
        if not isinstance(self.offload_activations, bool):
            raise ValueError(f"offload_activations={self.offload_activations!r} must be True or False")
        if self.offload_activations and self.device is not None and not str(self.device).startswith("cpu"):
            raise ValueError("offload_activations keeps activations in a memory-mapped file: CPU only")
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(
                    f"device={self.device!r} is not a torch device ({exc}); use e.g. 'cpu' or 'cuda'"
                ) from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device={str(device)!r} asked, but this torch has no usable CUDA; use 'cpu'")
            put("device", str(device))
        if isinstance(self.compute_dtype, torch.dtype):
            put("compute_dtype", dtype_name(self.compute_dtype))
        if self.compute_dtype is not None:
            _choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _choice("hessian_dtype", self.hessian_dtype, HESSIAN_DTYPES)
        _choice("moe_calibration", self.moe_calibration, MOE_CALIBRATION)
        _count("moe_min_tokens", self.moe_min_tokens, minimum=0, optional=True)
        _choice("moe_weighting", self.moe_weighting, MOE_WEIGHTING)
        if self.max_hessian_memory is not None:
            put("max_hessian_memory", parse_size(self.max_hessian_memory, "max_hessian_memory"))
        _choice("format", self.format, FORMATS)
        _count("target_check", self.target_check, minimum=0)
        _target_bits(self)
        _gptaq(self)
        self.method_object.check(self)  # what the method refuses
        parse_size(self.max_shard_size, "max_shard_size")

    @classmethod
    def of(cls, settings: RunSettings | None = None, **options: Any) -> RunSettings:
        """``settings`` with ``options`` (any fields) replaced, or new settings from ``options``;
        an unknown option is a TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown run option(s) {unknown}; the options are RunSettings' fields: {sorted(names)}")
        return cls(**options) if settings is None else dataclasses.replace(settings, **options)

    @property
    def method_object(self) -> methods.Method:
        """The method named by ``method``, from the registry (``optq.pipeline.methods``)."""
        return methods.get(self.method)

    @property
    def reads_calibration(self) -> bool:
        """Whether the run needs calibration activations: the method reads a Hessian or a float
        chain, or ``target_bits`` measures the layers. Round-to-nearest alone does not."""
        method = self.method_object
        return method.reads_hessian or method.float_chain or self.target_bits is not None

    @property
    def hessian_budget(self) -> int:
        """Bytes one stage of experts' Hessians may take (the default resolved on this machine)."""
        return self.max_hessian_memory or default_hessian_budget()

    @property
    def hessian_itemsize(self) -> int:
        """Bytes per Hessian entry."""
        return 8 if self.hessian_dtype == "float64" else 4

    @property
    def hessian_torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.hessian_dtype == "float64" else torch.float32

    @property
    def shard_bytes(self) -> int:
        return parse_size(self.max_shard_size, "max_shard_size")

    def torch_device(self, home: torch.device | None = None) -> torch.device:
        """The compute device: the one asked, else ``home`` (where the model is) unless that is the
        meta device, else the CPU."""
        if self.device is not None:
            return torch.device(self.device)
        return home if home is not None and home.type != "meta" else torch.device("cpu")

    def compute(self, device: torch.device, source_dtype: torch.dtype) -> torch.dtype:
        """The block forwards' dtype: the one asked, else float32 on CPU and the source's on CUDA."""
        if self.compute_dtype is not None:
            return getattr(torch, self.compute_dtype)
        return torch.float32 if device.type == "cpu" else source_dtype

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (the report's options, the journal's manifest)."""
        out = dataclasses.asdict(self)
        for key in ("include", "exclude"):
            if out[key] is not None:
                out[key] = list(out[key])
        out["max_shard_size"] = str(self.max_shard_size)
        out["overrides"] = [[p, dict(f)] for p, f in self.overrides]
        out["serve"] = list(self.serve)
        return out
