"""Sibling QuantLinears that read the same input run as one fast-path call.

A transformer block feeds one tensor to its query, key and value projections and another to its
gate and up projections. On the CPU fast path each call has a fixed cost (the activation's cast to
bfloat16, the kernel's set-up, the module call), which at one token per step is most of a small
layer's time; one call on the concatenated weight pays it once. :func:`fuse_siblings` finds such
groups by name under each parent module (``q_proj/k_proj/v_proj``, ``gate_proj/up_proj``,
``w1/w3``, ``query/key/value``) and concatenates their packed planes along the output channels;
each member keeps views into the shared codes (no second copy) and its own scales, so it still
runs alone (as at a compiled prefill, which dequantizes each member's codes), and its codes are
still read back from them. Under torch.compile, decoding steps trace through
:meth:`FusedGroup.traced_output`: one kernel call for the group there too.

The first member called with an input computes every member's output and keeps them until each
member has taken its own; a member called with another input (or the same tensor changed in
place; under inference mode, where tensors keep no write counter, by identity only: an in-place
write between two siblings' calls would go unseen there, which transformers' blocks never do)
computes again. Members are fused only when their kernel layouts agree: the same bits'
plane count, kernel group, compute dtype and input-channel order (act-order sorts by the shared
Hessian, so siblings share it), and packed planes that can be read back.
"""

from __future__ import annotations

import torch
from torch import nn

from optq.core.memory import release_host_memory
from optq.formats import cpu_kernels
from optq.formats.cpu_kernels import FastWeight
from optq.formats.qlinear import QuantLinear, tensor_version

__all__ = ["SIBLINGS", "FusedGroup", "fuse_siblings", "build_fast_paths"]

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("query", "key", "value"))
"""Child names whose modules read the same input, in the order a block calls them."""


def _compatible(fasts: list[FastWeight], members: list[QuantLinear]) -> bool:
    first = fasts[0]
    for fast, member in zip(fasts, members, strict=True):
        if (
            len(fast.planes) != len(first.planes)
            or fast.group != first.group
            or fast.dtype != first.dtype
            or member.in_features != members[0].in_features
            or not cpu_kernels.from_packed(fast, member.out_features)
            or (fast.perm is None) != (first.perm is None)
            or (fast.perm is not None and not torch.equal(fast.perm, first.perm))
        ):
            return False
    return True


class FusedGroup:
    """Members' fast layouts concatenated along the output channels, and the outputs of the
    last input until every member has taken its own."""

    def __init__(self, members: list[QuantLinear]) -> None:
        fasts = [m.fast_weight for m in members]
        assert all(f is not None for f in fasts)
        first = fasts[0]
        planes = []
        for p in range(len(first.planes)):
            packed = torch.cat([f.planes[p][0] for f in fasts], dim=0)  # [N, K/2]: whole packer blocks
            scale_zero = torch.cat([f.planes[p][1] for f in fasts], dim=1).contiguous()  # [K/kg, N, 2]
            planes.append((packed, scale_zero))
        if len(first.planes) == 1:
            scale_zero = planes[0][1]
        else:
            scale_zero = torch.cat([f.scale_zero for f in fasts], dim=1).contiguous()
        self.fast = FastWeight(first.dtype, first.group, planes, scale_zero, first.perm, True, first.block)
        self.widths = [m.out_features for m in members]
        self.bits = members[0].bits
        starts = [sum(self.widths[:i]) for i in range(len(members))]
        self.spans = [(s, s + w) for s, w in zip(starts, self.widths, strict=True)]
        # each member's codes become views into the shared planes (its own copies are freed); its
        # scales stay its own, contiguous (a few percent of the codes' bytes), so that it also runs
        # alone, and under torch.compile (whose int4 lowering wants a contiguous scale tensor)
        self.member_fast: list[FastWeight] = []
        for m, f, (a, b) in zip(members, fasts, self.spans, strict=True):
            own = FastWeight(
                first.dtype,
                first.group,
                [(packed[a:b], sz) for (packed, _), (_, sz) in zip(planes, f.planes, strict=True)],
                f.scale_zero,
                first.perm,
                readable=True,
                block=first.block,
            )
            m._fast_cache.fast = own
            m._fused = (self, len(self.member_fast))
            self.member_fast.append(own)
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: list[torch.Tensor | None] = []
        self._traced_input: torch.Tensor | None = None
        self._traced_outputs: tuple[torch.Tensor | None, ...] = (None,) * len(members)

    def nbytes(self) -> int:
        """Bytes the group holds beyond its members' layouts: its concatenated scales (the
        members' codes are views into its planes and counted with them)."""
        scales = {id(sz): sz for _, sz in self.fast.planes}
        scales[id(self.fast.scale_zero)] = self.fast.scale_zero
        return sum(t.nbytes for t in scales.values())

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output for x, side by side [..., sum N_i] in x's dtype (no bias)."""
        n = self.spans[-1][1]
        return cpu_kernels.linear(
            self.fast, x, self.bits, n, lambda: cpu_kernels.dequantize(self.fast, self.bits, n, _no_codes)
        )

    def output(self, index: int, fast: FastWeight, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``index``'s output [..., N_i] for x (without bias: the caller adds it), or None
        when its layout was rebuilt since fusing (then it runs alone)."""
        if fast is not self.member_fast[index]:
            return None
        outputs = self._outputs
        if x is not self._input or tensor_version(x) != self._version or outputs[index] is None:
            y = self.compute(x)
            outputs = self._outputs = [y[..., a:b] for a, b in self.spans]
            self._input, self._version = x, tensor_version(x)
        out = outputs[index]
        outputs[index] = None
        if all(o is None for o in outputs):  # every member served: let go of the input
            self._input = None
        assert out is not None
        return out

    def traced_output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for x (no bias) as torch.compile traces it: the first member
        computes the group's product, the others take their slices from the traced state (in
        the graph the compiler sees the same tensors, so one kernel call), and the last one
        served empties the state again, so that the state a compiled call starts from is always
        the same (no recompilation) and no tensor is held between calls. By identity only, like
        :meth:`output` under inference mode; the layout is the group's, built at fusing."""
        outputs = self._traced_outputs
        if x is not self._traced_input or outputs[index] is None:
            y = self.compute(x)  # a decoding step: the int4 kernel, never the dequantized weight
            outputs = tuple(y[..., a:b] for a, b in self.spans)
            self._traced_input = x
        out = outputs[index]
        outputs = tuple(None if i == index else o for i, o in enumerate(outputs))
        if all(o is None for o in outputs):
            self._traced_input = None
        self._traced_outputs = outputs
        assert out is not None
        return out


def _no_codes() -> torch.Tensor:
    raise AssertionError("a fused group's codes are always read from its packed planes")


def fuse_siblings(model: nn.Module, recurse: bool = True) -> int:
    """Fuse every group of sibling QuantLinears whose fast layouts allow it (see the module's
    description); returns the number of groups. Their layouts must be built first
    (:func:`build_fast_paths`). ``recurse=False``: only the groups whose
    members are ``model``'s own children (optq.load fuses each parent once its layers are read)."""
    groups = 0
    for parent in model.modules() if recurse else [model]:
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, QuantLinear) for m in members):
                continue
            fasts = [m.fast_weight for m in members]
            if any(f is None for f in fasts) or not _compatible(fasts, members):
                continue
            FusedGroup(members)
            groups += 1
    return groups


def build_fast_paths(model: nn.Module, *, drop_codes: bool = True, fuse: bool = True) -> tuple[int, int]:
    """Build every CPU QuantLinear's fast path now (optq.load does), freeing the checkpoint
    codes they duplicate unless ``drop_codes=False`` (see :meth:`QuantLinear.build_fast_path`)
    and running siblings that read one input as one call unless ``fuse=False``
    (:func:`fuse_siblings`), then hand the temporaries' memory back; returns (layers on the
    fast path, quantized layers)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.scales.device.type == "cpu"]
    fast = sum(m.build_fast_path(drop_codes) for m in layers)
    if fuse:
        fuse_siblings(model)
    release_host_memory()  # the temporaries' heap pages, back to the system
    return fast, len(layers)
