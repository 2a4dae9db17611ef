"""QuantLinear: a linear layer holding exactly the GPTQ checkpoint's buffers, and running them.

The module's ``state_dict`` is the format's tensors (``qweight``, ``qzeros``, ``scales``,
``g_idx``, and ``bias`` when present), so saving and loading is a copy. Its forward has two paths:

- reference: unpack, dequantize ``scales[g] * (q - z)`` in the input dtype, matmul. Valid for
  every width and any ``g_idx`` (act-order included).
- fast (CPU, every bit width): PyTorch's packed int4 kernel for few rows (decode), dequantize
  to bfloat16 + matmul for many (prefill), both in ``fast_dtype`` (bfloat16 by default), so
  outputs match the reference to bfloat16 precision; see :mod:`optq.formats.cpu_kernels`. Chosen
  automatically when the layout allows (out_features % 16 == 0, a kernel group size of 32, 64,
  128 or 256 that divides both the group size and in_features, groups contiguous after sorting
  the input channels by ``g_idx``); the kernel's packed codes are built lazily (half a byte per
  weight; two planes, one byte, at 8 bits) and cached outside the state_dict. Those planes hold
  the codes exactly, so ``build_fast_path(drop_codes=True)`` (what ``optq.load`` does) frees
  ``qweight`` and rebuilds it wherever it is asked for: the codes are in memory once.

Typical use: ``replace_linears(model, solutions)`` after the pipeline, then ``optq.save``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from optq.core.grid import group_index
from optq.formats import cpu_kernels
from optq.formats.cpu_kernels import FastWeight
from optq.formats.packing import (
    SUPPORTED_BITS,
    pack_qweight,
    pack_qzeros,
    packed_length,
    unpack_qweight,
    unpack_qzeros,
    zero_offset,
)

if TYPE_CHECKING:
    from optq.core.config import QuantConfig
    from optq.core.solver import Solution

__all__ = ["QuantLinear", "replace_linears"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP16_TINY = 2.0**-24  # smallest positive float16; keeps recomputed codes finite


class _FastCache:
    """A QuantLinear's fast layout and the buffers it was built from (identity and version: a
    buffer replaced or changed in place makes it stale)."""

    NAMES = ("qweight", "qzeros", "scales", "g_idx")
    __slots__ = ("dtype", "fast", "tensors", "versions")

    def __init__(self, dtype: torch.dtype, tensors: tuple[torch.Tensor | None, ...], fast: FastWeight | None) -> None:
        self.dtype, self.fast, self.tensors = dtype, fast, tensors
        self.versions = tuple(tensor_version(t) for t in tensors)

    def fresh(self, buffers: Mapping[str, torch.Tensor | None], dtype: torch.dtype) -> bool:
        for name, t, v in zip(self.NAMES, self.tensors, self.versions, strict=True):
            if buffers[name] is not t or (t is not None and tensor_version(t) != v):
                return False
        return dtype == self.dtype


def tensor_version(t: torch.Tensor | None) -> int:
    """In-place writes so far (0 for None; inference-mode tensors keep no counter: -1)."""
    return 0 if t is None else -1 if t.is_inference() else t._version


def _num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else math.ceil(in_features / group_size)


class QuantLinear(nn.Module):
    """A ``Linear(in_features -> out_features)`` stored as GPTQ packed int32 codes.

    Buffers (the checkpoint's tensors): ``qweight`` int32 [K*b/32, N], ``qzeros`` int32
    [G, N*b/32], ``scales`` float16 [G, N], ``g_idx`` int32 [K], ``bias`` float16 [N] or None.
    Construct empty (for loading) with the shape arguments, or from a solver result with
    :meth:`from_solution`. Set ``use_fast_path = False`` to force the reference forward, and
    ``fast_dtype`` to the dtype the fast path computes in (bfloat16, the fast one, by default).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 4,
        group_size: int = 128,
        bias: bool = False,
        checkpoint_format: str = "gptq",
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={bits} is not supported; choose one of {SUPPORTED_BITS}")
        if group_size != -1 and group_size < 1:
            raise ValueError(f"group_size={group_size} must be -1 or a positive integer")
        zero_offset(checkpoint_format)  # validates the name
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.checkpoint_format = bits, group_size, checkpoint_format
        groups = _num_groups(in_features, group_size)
        kw: dict[str, Any] = {"device": device}
        self.register_buffer(
            "qweight", torch.zeros(packed_length(in_features, bits), out_features, dtype=torch.int32, **kw)
        )
        self.register_buffer("qzeros", torch.zeros(groups, packed_length(out_features, bits), dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, **kw))
        self.register_buffer("g_idx", group_index(in_features, group_size, device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, **kw) if bias else None)
        self.quant_config: QuantConfig | None = None  # the solver's settings, when known
        self.use_fast_path = True
        self.fast_dtype = torch.bfloat16
        self._fast_cache: _FastCache | None = None
        self._fused: tuple[Any, int] | None = None  # (FusedGroup, index) once fused with its siblings

    @classmethod
    def from_solution(
        cls, solution: Solution, bias: torch.Tensor | None = None, checkpoint_format: str = "gptq"
    ) -> QuantLinear:
        """Pack a solver :class:`~optq.core.solver.Solution` (bias: the layer's, or None).

        Scales are stored as float16, so codes are recomputed against the stored scales
        (``round(s32 * (q - z) / s16) + z``, clamped to [0, 2^b - 1]) before packing.
        Raises ValueError when a zero point cannot be stored in ``checkpoint_format``.
        """
        cfg = solution.config
        stored = solution.codes  # read once: a pipeline's solutions recompute them on access
        rows, cols = stored.shape
        layer = cls(cols, rows, cfg.bits, cfg.group_size, bias is not None, checkpoint_format, device=stored.device)
        scales = solution.scales.detach().to(torch.float64)
        scales16 = scales.to(torch.float16)
        if not torch.isfinite(scales16).all():
            raise ValueError(
                f"a scale of {float(scales.abs().max()):.3g} overflows float16; "
                "the GPTQ format stores scales as float16"
            )
        scales16 = scales16.clamp(min=_FP16_TINY)
        g = solution.g_idx.long()
        zeros = solution.zeros.to(torch.int64)
        exact = scales[:, g] * (stored.to(torch.int64) - zeros[:, g]).to(torch.float64)
        codes = torch.round(exact / scales16.to(torch.float64)[:, g]) + zeros[:, g]
        codes = codes.clamp_(0, cfg.maxq).to(torch.int64)
        with torch.no_grad():
            layer.qweight.copy_(pack_qweight(codes, cfg.bits))
            layer.qzeros.copy_(pack_qzeros(solution.zeros, cfg.bits, checkpoint_format))
            layer.scales.copy_(scales16.t())
            layer.g_idx.copy_(solution.g_idx.to(torch.int32))
            if bias is not None:
                layer.bias.copy_(bias.detach().reshape(rows).to(torch.float16))
        layer.quant_config = cfg
        return layer

    # ----------------------------------------------------------------- unpacked views
    def codes(self) -> torch.Tensor:
        """Integer codes [N, K] (int32, nn.Linear layout)."""
        if self.__dict__.get("_codes_dropped"):
            return cpu_kernels.codes_from_packed(self._fast_cache.fast, self.bits, self.out_features)
        return unpack_qweight(self.qweight, self.bits, self.in_features)

    def zeros(self) -> torch.Tensor:
        """Zero points [N, G] (int32, code units, the format's offset undone)."""
        return unpack_qzeros(self.qzeros, self.bits, self.out_features, self.checkpoint_format)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the format describes: ``scales[g_idx[k], n] * (q[k, n] - Z)``."""
        g = self.g_idx.long()
        q = self.codes().to(dtype)
        z = self.zeros()[:, g].to(dtype)
        return self.scales.t()[:, g].to(dtype) * (q - z)

    # ----------------------------------------------------------------- the checkpoint's codes, kept once
    # Once the fast path is built, its packed planes hold the codes exactly (cpu_kernels.codes_from_packed),
    # so ``qweight`` may be dropped (``build_fast_path(drop_codes=True)``, what optq.load does): the module
    # then rebuilds it wherever the format's tensor is asked for (reading ``.qweight``, state_dict, moving
    # to another device), so nothing outside sees a difference but the memory.
    def __getattr__(self, name: str) -> Any:
        if name == "qweight" and self.__dict__.get("_codes_dropped"):
            return self._restore_codes()
        return super().__getattr__(name)

    def _restore_codes(self) -> torch.Tensor:
        qweight = pack_qweight(self.codes(), self.bits)
        self._buffers["qweight"] = qweight
        self._codes_dropped = False
        cache = self._fast_cache
        cache.tensors = (qweight, *cache.tensors[1:])  # the same codes: the fast layout stays valid
        cache.versions = (tensor_version(qweight), *cache.versions[1:])
        return qweight

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if not self.__dict__.get("_codes_dropped"):
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        self._buffers["qweight"] = pack_qweight(self.codes(), self.bits)  # for this state_dict only
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._buffers["qweight"] = None

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        if self.__dict__.get("_codes_dropped"):
            self._restore_codes()  # the incoming qweight is copied into a real buffer
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        if self.__dict__.get("_codes_dropped"):
            probe = torch.zeros(0, dtype=torch.int32)
            moved = fn(probe)
            if moved.device != probe.device or moved.dtype != probe.dtype:  # .to(another device): codes go too
                self._restore_codes()
        return super()._apply(fn, recurse)

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` in x's dtype (the fast CPU path when the layout allows)."""
        if torch.compiler.is_compiling():
            return self._forward_traced(x)
        fast = self._fast_layout(x) if self.use_fast_path else None
        if fast is None:
            return self.forward_reference(x)
        fused = self._fused
        y = None if fused is None else fused[0].output(fused[1], fast, x)  # with its siblings (fused.py)
        if y is None:
            y = cpu_kernels.linear(fast, x, self.bits, self.out_features, lambda: self.dense_weight(fast))
        bias = self._buffers["bias"]
        return y if bias is None else y.add_(bias)

    def _forward_traced(self, x: torch.Tensor) -> torch.Tensor:
        """Under torch.compile: the fast layout built at load, else the reference path. Plain
        tensor operations the compiler traces (no cache bookkeeping); a fused member below the
        prefill threshold takes its slice of the group's one kernel call (``traced_output``:
        three traced calls on the group's planes were not merged by the compiler, measured), at
        prefill each member dequantizes its own codes."""
        fast = self.fast_weight if self.use_fast_path and x.device.type == "cpu" else None
        if fast is None:
            return self.forward_reference(x)
        n = self.out_features
        decode = x.numel() // self.in_features < cpu_kernels.PREFILL_ROWS[self.bits]
        if not decode and not cpu_kernels.from_packed(fast, n):
            return self.forward_reference(x)  # prefill needs a readable layout here
        fused = self._fused
        if decode and fused is not None and fused[0].member_fast[fused[1]] is fast:
            y = fused[0].traced_output(fused[1], x)
        else:
            y = cpu_kernels.linear(fast, x, self.bits, n, lambda: cpu_kernels.dequantize_traced(fast, n))
        bias = self._buffers["bias"]
        return y if bias is None else y + bias

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Unpack, dequantize in x's dtype, matmul: valid for every width and g_idx."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def build_fast_path(self, drop_codes: bool = False) -> bool:
        """Build the fast path's packed codes now (otherwise the first CPU forward does); True
        when this layer runs on it. ``drop_codes``: then free ``qweight``, which the packed
        codes reproduce exactly (rebuilt wherever it is asked for), when this torch's packed
        layout is the one :func:`optq.formats.cpu_kernels.packed_layout_known` checks."""
        if not self.use_fast_path:
            return False
        fast = self._fast_layout(self.scales.new_zeros(1, self.in_features).float())
        if fast is not None and drop_codes and cpu_kernels.from_packed(fast, self.out_features):
            self._buffers["qweight"] = None
            self._codes_dropped = True
            cache = self._fast_cache
            cache.tensors, cache.versions = (None, *cache.tensors[1:]), (0, *cache.versions[1:])
        return fast is not None

    @property
    def fast_weight(self) -> FastWeight | None:
        """The fast path's layout as built so far (None before the first CPU forward or
        :meth:`build_fast_path`, or when the layout does not allow it)."""
        return None if self._fast_cache is None else self._fast_cache.fast

    def _fast_layout(self, x: torch.Tensor) -> FastWeight | None:
        """The fast path's cached layout for x, or None when the reference path must run."""
        if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES or (x.requires_grad and torch.is_grad_enabled()):
            return None
        cache = self._fast_cache
        if cache is not None and cache.fresh(self._buffers, self.fast_dtype):
            return cache.fast
        if self.__dict__.get("_codes_dropped"):
            self._restore_codes()  # from the stale layout, whose codes are still the checkpoint's
        self._fast_cache = None  # the old layout's memory goes before the new one is built
        tensors = tuple(self._buffers[n] for n in _FastCache.NAMES)
        fast = None
        if self.qweight.device.type == "cpu" and cpu_kernels.supported(
            self.bits, self.in_features, self.out_features, self.group_size
        ):
            layer = {"scales": self.scales, "zeros": self.zeros(), "g_idx": self.g_idx}
            layer.update(bits=self.bits, group_size=self.group_size)
            codes = cpu_kernels.unpack_codes(self.qweight, self.bits, self.in_features) if 32 % self.bits == 0 else None
            fast = cpu_kernels.build(self.codes() if codes is None else codes, layer, self.fast_dtype)
        self._fast_cache = _FastCache(self.fast_dtype, tensors, fast)
        return fast

    def dense_weight(self, fast: FastWeight) -> torch.Tensor:
        """The prefill path's weight, W.T [K, N] in ``fast_dtype``, rows in the kernels' channel
        order (see cpu_kernels.dequantize), built for one call."""
        return cpu_kernels.dequantize(fast, self.bits, self.out_features, self.codes)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}, "
            f"checkpoint_format={self.checkpoint_format!r}"
        )


def replace_linears(model: nn.Module, solutions: Mapping[str, Solution], checkpoint_format: str = "gptq") -> nn.Module:
    """Replace each named ``nn.Linear``/``Conv1D`` of ``model`` by a QuantLinear, in place.

    ``solutions`` maps module names (``model.named_modules()`` keys, as in the pipeline's
    Report) to solver Solutions whose weight shape is the module's [out, in]. Biases are kept
    (as float16, the format's dtype). Returns ``model``.
    """
    from optq.formats.linears import get_weight, is_linear

    for name, solution in solutions.items():
        module = model.get_submodule(name)
        if not is_linear(module):
            raise TypeError(f"{name} is a {type(module).__name__}, not nn.Linear or Conv1D")
        weight = get_weight(module)
        if tuple(weight.shape) != tuple(solution.weight.shape):
            raise ValueError(
                f"solution for {name} has shape {tuple(solution.weight.shape)} but the layer's "
                f"weight is {tuple(weight.shape)} ([out_features, in_features])"
            )
        layer = QuantLinear.from_solution(solution, module.bias, checkpoint_format)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.to(weight.device))
    return model
