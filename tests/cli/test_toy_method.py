"""A fourth method added in this one file: registered, then run end to end by ``optq.quantize``,
``optq compare`` and ``optq quantize``, with nothing else in optq changed.

The toy method rounds to nearest after a twist: every weight is first scaled by ``SHRINK``, so its
result differs from round-to-nearest's on every layer and is known in closed form (each linear's
rows rounded on their own grid: ``optq.rtn(SHRINK * W)``, one layer at a time here, while the
pipeline solves stacked groups), whatever the calibration.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_args import quantize_args

import optq
from optq.cli import build_parser, main
from optq.core import solver
from optq.pipeline import methods

transformers = pytest.importorskip("transformers")
from tiny import build, tokens  # noqa: E402

SHRINK = 0.75
NAME = "shrink-rtn"


class ShrinkThenRound(methods.Method):
    name = NAME
    help = f"round to nearest after scaling every weight by {SHRINK}"
    reads_hessian = False

    def solve(self, W, H, hessians, config, settings):
        return solver.rtn(W * SHRINK, config), W

    def check(self, settings):
        if settings.strategy == "pause":
            raise ValueError(f"method={NAME!r} refuses strategy='pause' (a refusal of its own, for the test)")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls run faster on one thread of a busy machine
    yield
    torch.set_num_threads(before)


@pytest.fixture
def toy():
    method = methods.register(ShrinkThenRound())
    try:
        yield method
    finally:
        methods.unregister(NAME)


def _expected(model: torch.nn.Module, config: optq.QuantConfig) -> dict[str, torch.Tensor]:
    """Every block linear's weight as the toy method must leave it, from the float model."""
    from optq.formats.linears import find_linears

    return {
        n: optq.rtn(m.weight.detach() * SHRINK, config).weight
        for n, m in find_linears(model.model.layers, "model.layers").items()
    }


def test_the_registry_names_it_everywhere_and_its_refusal_holds(toy):
    assert methods.get(NAME) is toy and NAME in methods.names()
    with pytest.raises(ValueError, match="already registered"):
        methods.register(ShrinkThenRound())
    assert optq.RunSettings(method=NAME).method_object is toy
    with pytest.raises(ValueError, match="refuses strategy='pause'"):
        optq.RunSettings(method=NAME, strategy="pause")
    args = build_parser().parse_args(["quantize", "m", "-o", "out", "--method", NAME])
    assert args.method == NAME
    from optq.eval.compare import parse_variant

    v = parse_variant(f"{NAME}+g16", optq.QuantConfig(bits=3))
    assert (v.method, v.config.group_size) == (NAME, 16)
    with pytest.raises(ValueError, match="read the Hessian"):  # it reads no H: no act-order modifier
        parse_variant(f"{NAME}+act_order", optq.QuantConfig(bits=3))


def test_the_registry_forgets_it():
    assert NAME not in methods.names()
    with pytest.raises(ValueError, match="is not one of"):
        optq.RunSettings(method=NAME)


def test_optq_quantize_runs_it_and_gives_the_closed_form(toy, one_thread):
    model = build("llama")
    config = optq.QuantConfig(bits=3, group_size=16)
    expected = _expected(model, config)
    report = optq.quantize(model, tokens(), config, method=NAME, progress=False)
    assert report.to_dict()["options"]["method"] == NAME
    from optq.formats.linears import find_linears

    got = find_linears(model.model.layers, "model.layers")
    assert set(got) == set(expected) and len(got) == 14
    for name, module in got.items():
        assert torch.equal(module.weight, expected[name]), name
        # It reads no Hessian: quantized from the weights alone, no error measured (none made up).
        assert report.layers[name].objective is None and report.layers[name].rtn_objective is None
    assert NAME in report.unmeasured


def test_compare_runs_it_through_the_pipeline(toy, one_thread):
    from optq.eval.compare import compare, parse_variant

    model = build("llama")
    config = optq.QuantConfig(bits=3, group_size=16)
    expected = _expected(model, config)
    seen = {}
    results = compare(
        model,
        [parse_variant(v, config) for v in ("rtn", NAME)],
        tokens(),
        {"text": tokens(3, seed=5)},
        progress=False,
        on_result=lambda r, m: seen.__setitem__(r.variant.name, m),
    )
    from optq.formats.linears import find_linears

    for name, module in find_linears(seen[NAME].model.layers, "model.layers").items():
        assert torch.equal(module.weight, expected[name]), name
    rtn, mine = results
    assert rtn.report is not None and mine.report is not None  # both went through the pipeline
    assert mine.totals["layers"] == rtn.totals["layers"] == 14
    assert rtn.perplexity["text"] != mine.perplexity["text"]


def test_the_cli_writes_its_model(toy, model_dir, tmp_path):
    out = tmp_path / "q"
    assert main(quantize_args(model_dir, out, "--method", NAME)) == 0
    report = json.loads((out / "quantization_report.json").read_text())
    assert report["options"]["method"] == NAME
    from optq.data.zoo import load_model

    fp, _ = load_model(model_dir / "model")
    expected = _expected(fp, optq.QuantConfig(bits=3, group_size=16))
    written, _ = load_model(out, embeddings="model")
    from optq.formats.linears import find_linears, get_weight

    for name, module in find_linears(written.model.layers, "model.layers").items():
        torch.testing.assert_close(get_weight(module).float(), expected[name].float(), rtol=0, atol=1e-3)
