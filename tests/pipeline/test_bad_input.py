"""NaN/Inf in a model: refused up front with the layer's name (weights), or named by block and
layer when it appears in the activations; the report says under which thread count it ran."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from tiny import build, run  # noqa: E402


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before):
    after = model.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True, msg=f"{k} changed")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_named_and_nothing_changes(bad):
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = bad
    before = _snapshot(model)
    with pytest.raises(ValueError) as info:
        run(model)
    message = str(info.value)
    assert message.startswith("model.layers.1.mlp.down_proj.weight has NaN/Inf values; the model is unchanged")
    assert "\n" not in message
    _assert_unchanged(model, before)  # block 0 was not quantized before the error either


def test_non_finite_weights_of_layers_not_quantized_are_not_checked():
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    report = run(model, exclude="*.down_proj")
    assert "model.layers.1.mlp.down_proj" not in report.layers and len(report.layers) == 12


@pytest.mark.parametrize("strategy", ["replay", "pause"])
def test_non_finite_activations_name_the_block_and_layers(strategy):
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[2] = float("inf")
    with pytest.raises(ValueError) as info:
        run(model, strategy=strategy)
    message = str(info.value)
    assert message.startswith(
        "model.layers.1: the input of self_attn.q_proj, self_attn.k_proj, self_attn.v_proj: calibration input contains"
    )
    # block 0 is quantized by then: the message says so instead of implying a clean model
    assert message.endswith(
        "the model is left partly quantized: blocks 0 to 0 (7 of 14 layers); block 1, where it failed, is as it "
        "was: load the model again before using it"
    )


def test_non_finite_activations_before_any_change_say_so():
    model = build("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(float("nan"))
    before = _snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"^model\.layers\.0: the input of self_attn\.q_proj, .*"
        r"; no weight was changed$",
    ):
        run(model)
    _assert_unchanged(model, before)


def test_report_records_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        report = run(build("llama"), include="*.0.mlp.*")
    finally:
        torch.set_num_threads(threads)
    assert report.options["num_threads"] == 1
    assert report.to_dict()["options"]["num_threads"] == 1
    assert run(build("llama"), include="*.0.mlp.*").options["num_threads"] == threads
