"""Faults through the Python API: a block is written back whole or not at all."""

from __future__ import annotations

import pytest
import torch

import optq

pytest.importorskip("transformers")
from tiny import CFG, build, tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit for bit, NaN included (the poisoned norm holds one).
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _poison(model, block: int) -> None:
    # The MLP's input norm of one block: q/k/v/o of that block are quantized first, then the
    # gate/up input is NaN and the run stops in the middle of the block.
    with torch.no_grad():
        model.model.layers[block].post_attention_layernorm.weight[0] = float("nan")


def test_nan_activations_in_the_first_block_leave_the_model_as_it_was():
    model = build("llama")
    _poison(model, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="no weight was changed") as info:
        optq.quantize(model, tokens(n=4, seqlen=16), CFG, progress=False)
    assert "mlp.gate_proj" in str(info.value)  # the layers whose input was bad are named
    after = model.state_dict()
    changed = [k for k in before if not _same_bits(before[k], after[k])]
    assert changed == []  # q/k/v/o were quantized, then restored with the block


def test_a_failure_in_a_later_block_keeps_the_earlier_blocks_and_restores_its_own():
    model = build("llama")
    reference = build("llama")  # the same seed: the same weights
    _poison(model, 1)
    _poison(reference, 1)
    # What block 0 becomes when it succeeds: its layers alone quantized (block 1's are not).
    optq.quantize(reference, tokens(n=4, seqlen=16), CFG, progress=False, include="model.layers.0.*")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"blocks 0 to 0 \(7 of 14 layers\); block 1, where it failed, is as it was"):
        optq.quantize(model, tokens(n=4, seqlen=16), CFG, progress=False)
    after, done = model.state_dict(), reference.state_dict()
    for k in before:
        if k.startswith("model.layers.1."):
            assert _same_bits(after[k], before[k]), k  # restored exactly
        elif k.startswith("model.layers.0.") and k.endswith("proj.weight"):
            assert torch.equal(after[k], done[k]), k  # block 0 quantized, as a run of it alone
            assert not torch.equal(after[k], before[k]), k
