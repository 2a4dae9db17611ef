"""On the real SmolLM2-135M (skipped unless `optq fetch smollm2-135m enwiki` was run): optq's
default method and settings (GPTAQ on a shrunk H) beat round-to-nearest end to end at 3 bits, and
at 4 bits (the README's headline) beat both round-to-nearest and textbook GPTQ, on held-out enwiki,
with the reduced protocol of conftest.py (16 x 256 calibration tokens, 4 windows of 512)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import optq

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def fp_ppl(smollm2, enwiki):
    return optq.perplexity(smollm2[0], enwiki[1])


def _rtn_ppl(model, windows, config):
    from optq.eval.compare import round_to_nearest

    rtn = copy.deepcopy(model)
    assert round_to_nearest(rtn, config)["layers"] == 210
    return optq.perplexity(rtn, windows)


def test_gptq_beats_round_to_nearest_at_3_bits(smollm2, enwiki, fp_ppl):
    model, _ = smollm2
    calib, windows = enwiki
    cfg = optq.QuantConfig(bits=3, group_size=128)
    gptq = copy.deepcopy(model)
    report = optq.quantize(gptq, calib, cfg, progress=False)
    gptq_ppl = optq.perplexity(gptq, windows)
    del gptq
    rtn_ppl = _rtn_ppl(model, windows, cfg)
    assert report.totals["layers"] == 210
    assert fp_ppl < gptq_ppl < rtn_ppl
    # not a marginal win: GPTQ's increase over fp is well below round-to-nearest's
    assert gptq_ppl - fp_ppl < 0.7 * (rtn_ppl - fp_ppl)


def test_gptq_defaults_beat_round_to_nearest_and_plain_gptq_at_4_bits(smollm2, enwiki, fp_ppl, gptq4):
    model, _ = smollm2
    calib, windows = enwiki
    defaults = optq.QuantConfig()
    assert (
        defaults.bits,
        defaults.group_size,
        defaults.act_order,
        defaults.static_groups,
        defaults.normalize_tokens,
        defaults.diag_shrink,
    ) == (4, 128, True, True, True, 0.5)
    _, report, gptq_ppl = gptq4
    assert report.config == defaults.to_dict() and report.options["method"] == "gptaq"
    assert report.totals["layers"] == 210
    rtn_ppl = _rtn_ppl(model, windows, defaults)
    plain_cfg = dataclasses.replace(
        defaults, act_order=False, static_groups=False, normalize_tokens=False, diag_shrink=0.0
    )  # textbook GPTQ
    assert not plain_cfg.static_groups
    plain = copy.deepcopy(model)
    optq.quantize(plain, calib, plain_cfg, progress=False, method="gptq")
    plain_ppl = optq.perplexity(plain, windows)
    del plain
    print(f"4-bit enwiki perplexity: fp {fp_ppl:.3f}, rtn {rtn_ppl:.3f}, default {gptq_ppl:.3f}, plain {plain_ppl:.3f}")
    assert fp_ppl < gptq_ppl < min(rtn_ppl, plain_ppl)
    # Measured (16 x 256 calibration tokens, seed 0): the defaults' increase over fp is 0.32 of
    # round-to-nearest's and 0.33 of textbook GPTQ's (fp 20.38, RTN 30.88, textbook 30.55, defaults
    # 23.74; GPTQ with the shrink 24.18; before H was shrunk, about half); 0.7 leaves room for noise.
    assert gptq_ppl - fp_ppl < 0.7 * (rtn_ppl - fp_ppl)
    assert gptq_ppl - fp_ppl < 0.7 * (plain_ppl - fp_ppl)
