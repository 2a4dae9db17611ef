"""``optq quantize --method gptaq`` and ``optq compare``'s gptaq variants: flags, settings, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from cli_args import quantize_args
from safetensors.torch import load_file

import optq
from optq.cli import build_parser, main
from optq.cli.quantize import settings_from_args
from optq.eval.compare import compare, parse_variant

pytest.importorskip("transformers")


def _weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_method_gptaq_writes_its_own_checkpoint_and_says_so(model_dir, tmp_path, capsys):
    assert main(quantize_args(model_dir, tmp_path / "aq", "--method", "gptaq", "--gptaq-alpha", "1")) == 0
    assert main(quantize_args(model_dir, tmp_path / "q")) == 0
    options = json.loads((tmp_path / "aq" / "quantization_report.json").read_text())["options"]
    assert (options["method"], options["gptaq_alpha"], options["gptaq_form"]) == ("gptaq", 1.0, "paper")
    a, b = _weights(tmp_path / "aq"), _weights(tmp_path / "q")
    assert a.keys() == b.keys()
    differ = {k.rsplit(".", 2)[0] for k in a if k.endswith("qweight") and not torch.equal(a[k], b[k])}
    # the first group of the first block sees the same inputs in both models: the same codes there
    assert differ and not differ & {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--method", "gptaq", "--propagate", "original"], "propagate='original' both are the float model's"),
        (["--method", "gptaq", "--moe-calibration", "routed"], "moe_calibration='routed'"),
        (["--method", "gptaq", "--gptaq-alpha", "-0.5"], "gptaq_alpha=-0.5 is out of range"),
        (["--gptaq-form", "half"], "invalid choice: 'half'"),
    ],
)
def test_what_gptaq_cannot_do_is_refused_before_any_work(model_dir, tmp_path, capsys, extra, match):
    assert main(quantize_args(model_dir, tmp_path / "q", *extra)) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_the_flags_defaults_are_the_settings_defaults():
    args = build_parser().parse_args(["quantize", "m", "-o", "o"])
    parsed, default = settings_from_args(args), optq.RunSettings()
    for field in ("method", "gptaq_alpha", "gptaq_form"):
        assert getattr(parsed, field) == getattr(default, field), field


def test_compare_variants():
    base = optq.QuantConfig(bits=3, group_size=16)
    v = parse_variant("gptaq+alpha1+full+g32", base)
    assert v.method == "gptaq" and dict(v.settings) == {"gptaq_alpha": 1.0, "gptaq_form": "full"}
    assert v.config.group_size == 32
    assert parse_variant("gptaq", base).settings == ()
    for bad in ("gptaq+original", "gptq+alpha1", "rtn+full"):
        with pytest.raises(ValueError):
            parse_variant(bad, base)
    from tiny import build, tokens

    model = build("llama")
    results = compare(
        model, [parse_variant(s, base) for s in ("gptq", "gptaq+alpha1")], tokens(4, 16), {"t": tokens(2, 16, seed=3)},
        progress=False,
    )  # fmt: skip
    gptq, gptaq = results
    assert gptaq.report.to_dict()["options"]["gptaq_alpha"] == 1.0
    assert gptaq.to_dict()["settings"] == {"gptaq_alpha": 1.0}
    assert gptaq.perplexity["t"] != gptq.perplexity["t"]
