"""QuantLinear under torch.compile: its fast path traces as one graph (no breaks) and gives the
eager fast path's outputs."""

from __future__ import annotations

import pytest
import torch
from formats.bounds import bf16_bound

import optq
from optq.formats.fused import build_fast_paths
from optq.formats.qlinear import QuantLinear

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("bits", [4, 8])
def test_the_fast_path_compiles_without_graph_breaks(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    H = optq.Hessian(192)
    H.update(torch.randn(800, 192, generator=g))
    sol = optq.gptq(torch.randn(128, 192, generator=g), H.matrix(), optq.QuantConfig(bits=bits, group_size=64))
    layer = QuantLinear.from_solution(sol, bias=torch.randn(128))
    build_fast_paths(torch.nn.Sequential(layer))  # codes dropped, as after optq.load
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # a graph break would raise
    with torch.no_grad():
        for rows in (1, 96):  # the int4 kernel, and dequantize + matmul
            x = torch.randn(rows, 192)
            ref = layer.forward_reference(x)
            got = compiled(x)
            assert got.shape == ref.shape
            assert ((got - ref).abs() <= bf16_bound(x, layer, ref)).all(), (got - ref).abs().max()


def test_fused_siblings_trace_as_one_kernel_call() -> None:
    """q, k and v fused: the traced graph multiplies once (the first member computes, the others
    take their slices), every output as the eager members give it, and the group keeps no tensor
    between calls (its state back to empty, so no guard sees a change)."""
    from formats.test_fused import Attention
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.attn.q_proj(x), self.attn.k_proj(x), self.attn.v_proj(x)

    block = Block()
    build_fast_paths(block)
    assert block.attn.q_proj._fused is not None
    calls = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        calls.append(sum("int4pack_mm" in str(node.target) for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=counting, fullgraph=True)
    group = block.attn.q_proj._fused[0]
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(1, 2, 192)
            got, want = compiled(x), block(x)
            for g, w in zip(got, want, strict=True):
                assert torch.allclose(g, w, rtol=1e-5, atol=1e-5), (g - w).abs().max()
            assert group._traced_input is None and all(o is None for o in group._traced_outputs)
    assert calls == [1]  # one graph, one int4 call for the three (4-bit: one plane); no recompile
