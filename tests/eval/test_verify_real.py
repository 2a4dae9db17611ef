"""On the real SmolLM2-135M (skipped unless `optq fetch smollm2-135m` was run): `optq quantize`
records the built-in probes in a compressed-tensors checkpoint, and `optq verify` finds optq's
two paths and transformers (with compressed-tensors, where installed) in agreement with them."""

from __future__ import annotations

import importlib.util
import json

import pytest

from optq.cli import main

pytestmark = pytest.mark.real


def test_smollm2_checkpoint_verifies_on_every_installed_engine(tmp_path, capsys):
    from optq.data.zoo import model_available

    if not model_available("smollm2-135m"):
        pytest.skip("SmolLM2-135M not available offline (optq fetch smollm2-135m)")
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "q"
    args = ["quantize", "smollm2-135m", "-o", str(out), "--method", "rtn", "--calib", str(calib)]
    assert main([*args, "--nsamples", "2", "--seqlen", "64", "--format", "compressed-tensors", "--no-progress"]) == 0
    capsys.readouterr()
    code = main(["verify", str(out), "--engines", "optq,optq-exact,transformers", "--json", str(tmp_path / "v.json")])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads((tmp_path / "v.json").read_text())
    status = {e["engine"]: e for e in doc["engines"]}
    assert status["optq-exact"]["status"] == "agree" and status["optq-exact"]["max_logprob_diff"] < 1e-5
    assert status["optq"]["status"] == "agree" and sum(p["steps"] for p in status["optq"]["prompts"]) >= 16
    if importlib.util.find_spec("compressed_tensors") is not None:
        assert status["transformers"]["status"] == "agree", text
