"""vLLM Marlin's act-order shape rule on its boundaries (issue 32, item 5).

vLLM (``vllm/model_executor/layers/quantization/utils/marlin_utils.py``) sets
``GPTQ_MARLIN_MIN_THREAD_N = 64`` and ``GPTQ_MARLIN_MIN_THREAD_K = 128``; with act-order
(``desc_act``) Marlin cannot pad a tile-misaligned layer, so it takes a layer only when its output
width is a multiple of 64 and its input width a multiple of 128; without act-order it pads and
takes any width its group size divides. Widths that are multiples of 32 but not of 64 (96, 160,
...) sit on the boundary a looser rule (``% 32``) would wrongly accept."""

from __future__ import annotations

import itertools

import pytest

from optq.formats.engines import LayerShape, verdict

MIN_THREAD_N, MIN_THREAD_K = 64, 128  # vLLM's constants, as above

OUTS = range(32, 513, 32)  # every multiple of 32: half of them are not multiples of 64
INS = (128, 256, 384, 512, 640)


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_layers_go_to_marlin_exactly_when_vllms_thread_tiles_divide_them(fmt, bits):
    taken = refused = 0
    for n, k in itertools.product(OUTS, INS):
        v = verdict("vllm", LayerShape(k, n, bits, 128, desc_act=True), fmt)
        if n % MIN_THREAD_N == 0 and k % MIN_THREAD_K == 0:
            assert v.kernel == "Marlin" and not v.refusals, (n, k, v)
            taken += 1
        else:
            assert v.kernel != "Marlin" and v.refusals[0][0] == "Marlin", (n, k, v)
            why = v.refusals[0][1]
            assert ("GPTQ_MARLIN_MIN_THREAD_N" in why) == (n % MIN_THREAD_N != 0), why
            refused += 1
    assert taken and refused


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_without_act_order_marlin_takes_the_same_widths(fmt):
    for n, k in itertools.product(OUTS, INS):
        assert verdict("vllm", LayerShape(k, n, 4, 128), fmt).kernel == "Marlin", (n, k)


def test_a_96_wide_act_order_layer_falls_through_to_exllama_naming_the_rule():
    v = verdict("vllm", LayerShape(256, 96, 4, 128, desc_act=True))
    assert v.kernel == "Exllama (float16 models)"
    assert v.refusals[0][0] == "Marlin" and "GPTQ_MARLIN_MIN_THREAD_N" in v.refusals[0][1]
    assert verdict("vllm", LayerShape(256, 128, 4, 128, desc_act=True)).kernel == "Marlin"
