"""QuantLinear under torch.compile: its fast path traces as one graph (no breaks) and gives the
eager fast path's outputs."""

from __future__ import annotations

import pytest
import torch
from formats.bounds import bf16_bound

import optq
from optq.formats.qlinear import QuantLinear, build_fast_paths

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
