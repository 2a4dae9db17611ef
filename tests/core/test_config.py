"""QuantConfig validation: every bad field is named together with what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from optq import QuantConfig


def test_defaults_and_derived_values():
    cfg = QuantConfig()
    # act-order with static groups and token-normalised Hessians: the best settings measured
    # on SmolLM2-135M that cost nothing at inference time (README, "Quality")
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
        ({"bits": 1}, "bits", "2 to 8"),
        ({"bits": 9}, "bits", "2 to 8"),
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
        ({"act_order": "yes"}, "act_order", "bool"),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_values(kwargs, field, allowed):
    with pytest.raises(ValueError, match=f"QuantConfig.{field}=") as info:
        QuantConfig(**kwargs)
    assert allowed in str(info.value)


def test_valid_corner_values():
    QuantConfig(bits=2, group_size=-1)
    QuantConfig(bits=8, group_size=1, damp=0.0, act_order=True, static_groups=True)
