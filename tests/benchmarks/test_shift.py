"""benchmarks/shift.py: the cell arithmetic, the baselines it caches and resuming a sweep (tiny model)."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import tiny
import torch

import optq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shift  # noqa: E402
import shift_report  # noqa: E402

PLAN = shift.Plan(
    bits=(4,),
    group_size=16,
    calib=("a", "a+b"),
    candidates=("gptq+shrink0", "gptq+shrink0.5"),
    nsamples=4,
    seqlen=16,
    windows=2,
)


def subject(corpora=("a", "b")) -> shift.Subject:
    evaluation = {c: tiny.tokens(PLAN.windows, PLAN.seqlen, seed=10 + i) for i, c in enumerate(corpora)}
    # Each source calibrates on its own draw, so different sources give different models.
    draws = {"a": 1, "b": 2, "a+b": 3}
    return shift.Subject(
        name="tiny",
        model=tiny.llama(),
        evaluation=evaluation,
        calibrate=lambda source, n: tiny.tokens(n, PLAN.seqlen, seed=draws[source]),
    )


def test_cell_is_the_share_of_rtns_loss():
    assert shift_report.cell(gptq=12.0, rtn=20.0, fp=10.0) == pytest.approx(0.2)
    assert shift_report.cell(gptq=25.0, rtn=20.0, fp=10.0) == pytest.approx(1.5)  # GPTQ loses to RTN
    assert math.isnan(shift_report.cell(gptq=12.0, rtn=10.0, fp=10.0))  # RTN lossless: no ratio


def test_matrix_and_summary_from_a_results_file():
    def base(method, corpus, ppl):
        key = shift_report.baseline_key("m", method, 4, 128, 512, 8, corpus)
        return key, {"ppl": ppl}

    baselines = dict([base("fp", "x", 10.0), base("fp", "y", 20.0), base("rtn", "x", 20.0), base("rtn", "y", 30.0)])
    common = {"model": "m", "bits": 4, "group_size": 128, "nsamples": 32, "seqlen": 512, "windows": 8}
    runs = {
        "1": {**common, "calib": "x", "candidate": "gptq", "ppl": {"x": 13.0, "y": 31.0}, "seconds": 1.0},
        "2": {**common, "calib": "x+y", "candidate": "gptq", "ppl": {"x": 15.0, "y": 24.0}, "seconds": 1.0},
    }
    data = {"baselines": baselines, "runs": runs}
    (sec,) = shift_report.sections(data)
    m = shift_report.matrix(data, sec, "gptq")
    assert m == {"x": {"x": pytest.approx(0.3), "y": pytest.approx(1.1)}, "x+y": {"x": 0.5, "y": 0.4}}
    s = shift_report.summary(m)
    assert s["worst_off"] == (pytest.approx(1.1), "x", "y")  # the mixture's cells are all in-domain
    assert s["worst_in"] == (0.5, "x+y", "x")
    assert s["in_gain"] == pytest.approx(1 - (0.3 + 0.5 + 0.4) / 3)
    assert (s["above_1"], s["done"], s["total"]) == (1, 4, 4)


def _rtn_model(model: torch.nn.Module, config: optq.QuantConfig) -> torch.nn.Module:
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for layer in rounded.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(optq.rtn(module.weight, config).weight)
    return rounded


def test_sweep_caches_baselines_and_resumes(tmp_path, monkeypatch):
    path = tmp_path / "shift.json"
    subj = subject()
    assert shift.sweep(shift.Results(path), subj, PLAN) == 4
    data = json.loads(path.read_text())
    assert len(data["runs"]) == 4 and len(data["baselines"]) == 4  # fp and RTN on two texts
    run = data["runs"][shift.run_key("tiny", 4, "a+b", "gptq+shrink0.5", PLAN)]
    assert (run["calib"], run["nsamples"], run["windows"], run["config"]["diag_shrink"]) == ("a+b", 4, 2, 0.5)
    # The cached baselines are the fp model's and the round-to-nearest model's own perplexities.
    cfg = optq.QuantConfig(bits=4, group_size=16)
    for c, windows in subj.evaluation.items():
        fp = data["baselines"][shift.baseline_key("tiny", "fp", 4, PLAN, c)]["ppl"]
        rtn = data["baselines"][shift.baseline_key("tiny", "rtn", 4, PLAN, c)]["ppl"]
        assert fp == pytest.approx(optq.perplexity(subj.model, windows, seqlen=PLAN.seqlen), rel=1e-5)
        assert rtn == pytest.approx(optq.perplexity(_rtn_model(subj.model, cfg), windows, seqlen=16), rel=1e-5)
    assert run["ppl"]["a"] != data["runs"][shift.run_key("tiny", 4, "a", "gptq+shrink0.5", PLAN)]["ppl"]["a"]

    # Nothing is repeated: a second sweep over the same file quantizes and evaluates nothing.
    def refuse(*args, **kwargs):
        raise AssertionError("a finished run or cached baseline was computed again")

    monkeypatch.setattr(shift, "_evaluate", refuse)
    assert shift.sweep(shift.Results(path), subj, PLAN) == 0
    monkeypatch.undo()

    # Killed before one run was written: only that run is made, the others stay as they were.
    data["runs"].pop(shift.run_key("tiny", 4, "a", "gptq+shrink0", PLAN))
    path.write_text(json.dumps(data))
    assert shift.sweep(shift.Results(path), subj, PLAN) == 1
    again = json.loads(path.read_text())
    assert (
        again["runs"][shift.run_key("tiny", 4, "a+b", "gptq+shrink0", PLAN)]
        == data["runs"][shift.run_key("tiny", 4, "a+b", "gptq+shrink0", PLAN)]
    )

    # A new evaluation text: its baselines are measured, every run gains its perplexity.
    wider = subject(("a", "b", "c"))
    assert shift.sweep(shift.Results(path), wider, PLAN) == 4
    final = json.loads(path.read_text())
    assert len(final["baselines"]) == 6
    assert all(set(r["ppl"]) == {"a", "b", "c"} for r in final["runs"].values())


def test_write_only_draws_the_page(tmp_path):
    path = tmp_path / "shift.json"
    shift.sweep(shift.Results(path), subject(), PLAN)
    assert shift.main(["--write-only", "--json", str(path), "--docs", str(tmp_path / "docs")]) == 0
    page = (tmp_path / "docs" / "shift.md").read_text()
    assert "tiny, 4-bit g16: calibrated on 4 x 16 tokens, evaluated on 2 windows of 16 per text" in page
    assert "| gptq+shrink0.5 |" in page


def test_the_lw_candidate_shrinks_each_layer_by_its_rule(tmp_path):
    results = shift.Results(tmp_path / "shift.json")
    subj = subject()
    assert shift.run_one(results, subj, 4, "a+b", "gptq+lw", PLAN)
    assert shift.run_one(results, subj, 4, "a+b", "gptq+shrink0", PLAN)
    (shrinks,) = results.data["layer_shrinks"].values()
    from shift_rules import layer_shrinks, units_of

    expected = layer_shrinks(subj.model, units_of(subj.calibrate("a+b", PLAN.nsamples), 2))
    assert shrinks == pytest.approx(expected)
    lw = results.data["runs"][shift.run_key("tiny", 4, "a+b", "gptq+lw", PLAN)]
    plain = results.data["runs"][shift.run_key("tiny", 4, "a+b", "gptq+shrink0", PLAN)]
    assert lw["layer_shrink"]["max"] == max(expected.values()) > 0
    assert lw["ppl"] != plain["ppl"]  # the overrides reached the solver


def test_a_candidate_name_means_min_max_ranges_unless_it_asks_for_a_search():
    # The JSON's keys predate the range search becoming optq's default: a name keeps its run.
    cases = {
        "rtn": (False, False),
        "gptq+shrink0": (False, False),
        "gptaq+shrink0.5": (False, False),
        "gptq+shrink0.5+mse": (True, False),
        "gptaq+shrink0.5+hmse": (True, True),
    }
    for name, (mse, weighted) in cases.items():
        config = shift._variant(name, 3, PLAN).config
        assert (config.mse, config.mse_hessian, config.bits, config.group_size) == (mse, weighted, 3, 16), name
    assert optq.QuantConfig().mse and optq.QuantConfig().mse_hessian  # while optq's own default searches
