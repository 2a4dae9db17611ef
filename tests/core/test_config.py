"""QuantConfig validation: every bad field is named together with what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from optq import QuantConfig
from optq.core.config import SUPPORTED_BITS


def test_defaults_and_derived_values():
    cfg = QuantConfig()
    # act-order with static groups and token-normalised Hessians: the best settings measured
    # on SmolLM2-135M that cost nothing at inference time (docs/results.md, "Quality")
    assert (cfg.act_order, cfg.static_groups, cfg.normalize_tokens) == (True, True, True)
    assert QuantConfig(act_order=False).static_groups is False
    assert (cfg.bits, cfg.group_size, cfg.sym, cfg.damp, cfg.block_size) == (4, 128, True, 0.01, 128)
    assert cfg.maxq == 15
    assert QuantConfig(bits=3).maxq == 7
    assert cfg.to_dict()["group_size"] == 128


def test_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuantConfig().bits = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        QuantConfig(4)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,field,allowed",
    [
        ({"bits": 1}, "bits", "(2, 3, 4, 8)"),
        ({"bits": 9}, "bits", "(2, 3, 4, 8)"),
        ({"bits": 4.0}, "bits", "int"),
        ({"group_size": 0}, "group_size", "-1"),
        ({"group_size": -2}, "group_size", "-1"),
        ({"sym": 1}, "sym", "bool"),
        ({"static_groups": True, "act_order": False}, "static_groups", "act_order"),
        ({"damp": -0.1}, "damp", ">= 0"),
        ({"damp": float("nan")}, "damp", ">= 0"),
        ({"damp": 0.5, "damp_max": 0.1}, "damp_max", ">= damp"),
        ({"block_size": 0}, "block_size", "positive"),
        ({"mse_grid": 0}, "mse_grid", "positive"),
        ({"mse_maxshrink": 1.0}, "mse_maxshrink", "between 0 and 1"),
        ({"mse_norm": 0.0}, "mse_norm", "positive"),
        ({"mse": False, "mse_hessian": True}, "mse_hessian", "mse=True"),
        ({"act_order": "yes"}, "act_order", "bool"),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError, match=f"QuantConfig.{field}=") as info:
        QuantConfig(**kwargs)
    assert allowed in str(info.value)


def test_valid_corner_values():
    low = QuantConfig(bits=2, group_size=-1, act_order=False)
    assert (low.bits, low.group_size, low.maxq, low.static_groups) == (2, -1, 3, False)
    high = QuantConfig(bits=8, group_size=1, damp=0.0, damp_max=0.0, act_order=True, static_groups=False)
    assert (high.bits, high.group_size, high.maxq, high.damp, high.damp_max) == (8, 1, 255, 0.0, 0.0)
    assert high.static_groups is False  # an explicit False survives act_order=True
    assert QuantConfig(act_order=True).static_groups is True  # the default follows act_order
    assert high.to_dict() == {
        **QuantConfig().to_dict(),
        "bits": 8,
        "group_size": 1,
        "damp": 0.0,
        "damp_max": 0.0,
        "static_groups": False,
    }
    assert QuantConfig(**high.to_dict()) == high  # the dict form round-trips


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_widths_the_checkpoints_cannot_pack_are_refused_up_front(bits):
    # the solver could run at these widths, but saving would fail only after the whole model
    with pytest.raises(ValueError, match=rf"QuantConfig.bits={bits} is invalid") as info:
        QuantConfig(bits=bits)
    message = str(info.value)
    assert "\n" not in message and "(2, 3, 4, 8)" in message and "checkpoint" in message


def test_supported_bits_are_every_width_a_config_accepts():
    assert SUPPORTED_BITS == (2, 3, 4, 8)
    accepted = []
    for bits in range(17):
        try:
            accepted.append(QuantConfig(bits=bits).bits)
        except ValueError:
            pass
    assert tuple(accepted) == SUPPORTED_BITS
