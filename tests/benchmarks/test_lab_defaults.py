"""benchmarks/lab_report_defaults.py: issue 18's rule for the default, on hand-made shift numbers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lab_report_defaults as defaults  # noqa: E402
import shift_report  # noqa: E402

# fp 10 and RTN 20 on every text, so a cell is (ppl - 10) / 10
TEXTS = ("enwiki", "code")
SECTIONS = (("m1", 4), ("m1", 3), ("m2", 4))


def _data(cells: dict[str, dict[tuple[str, int], tuple[float, float]]]) -> dict:
    """Runs calibrated on enwiki at the sweep's size: candidate -> section -> (enwiki cell, code cell)."""
    n, seqlen, windows = defaults.SWEEP
    baselines = {}
    for model, bits in SECTIONS:
        for text in TEXTS:
            for method, ppl in (("fp", 10.0), ("rtn", 20.0)):
                key = shift_report.baseline_key(model, method, bits, 128, seqlen, windows, text)
                baselines[key] = {"ppl": ppl}
    runs = {}
    for cand, by_section in cells.items():
        for (model, bits), values in by_section.items():
            runs[f"{model}|{bits}|{cand}"] = {
                "model": model, "bits": bits, "group_size": 128, "nsamples": n, "seqlen": seqlen,
                "windows": windows, "calib": "enwiki", "candidate": cand,
                "ppl": {t: 10.0 + 10.0 * v for t, v in zip(TEXTS, values, strict=True)},
            }  # fmt: skip
    return {"baselines": baselines, "runs": runs}


def test_the_smallest_worst_cell_wins_among_those_keeping_95_percent_of_the_in_domain_gain():
    everywhere = lambda enwiki, code: {s: (enwiki, code) for s in SECTIONS}  # noqa: E731
    data = _data(
        {
            "gptq+shrink0": everywhere(0.5, 1.2),  # plain GPTQ: gain 0.5, worst 1.2
            "gptq+shrink0.5": {**everywhere(0.52, 0.7), ("m2", 4): (0.5, 0.8)},  # keeps 96%: worst 0.8
            "gptq+shrink0.9": {**everywhere(0.4, 0.6), ("m1", 3): (0.6, 0.6)},  # keeps 80% on m1 3-bit
            "gptq+damp": {("m1", 4): (0.1, 0.1)},  # the best cells, but on one section only
        }
    )
    rows, chosen = defaults.choose(data)
    assert chosen == "gptq+shrink0.5"
    by_name = {r[0]: r for r in rows}
    assert by_name["gptq+shrink0.5"][1] == "0.80 (m2 4-bit → code)"
    assert by_name["gptq+shrink0.5"][2].startswith("96%")
    assert by_name["gptq+shrink0.9"][4] == "no" and by_name["gptq+shrink0.9"][2].startswith("80% (m1 3-bit)")
    assert by_name["gptq+damp"][4] == "not measured on every section"
    # the perplexity rise over plain GPTQ is reported where the rule cannot see it
    assert by_name["gptq+shrink0.5"][3] == f"{(15.2 / 15.0 - 1):+.0%} (m1 4-bit enwiki)"
    # a section at another group size is shown on the page, not ruled on (the matrix is g128)
    n, seqlen, windows = defaults.SWEEP
    for text in TEXTS:
        data["baselines"][shift_report.baseline_key("m1", "rtn", 4, 64, seqlen, windows, text)] = {"ppl": 20.0}
    run = {**data["runs"]["m1|4|gptq+shrink0.5"], "group_size": 64, "ppl": {"enwiki": 60.0, "code": 60.0}}
    data["runs"]["m1|4|g64|gptq+shrink0.5"] = run
    assert defaults.choose(data) == (rows, chosen)


def test_the_section_says_when_the_code_disagrees_with_the_rule(tmp_path):
    import json

    from optq.core.config import QuantConfig
    from optq.pipeline.settings import RunSettings

    assert QuantConfig().diag_shrink == 0.5 and RunSettings().method == "gptaq"
    data = _data(
        {"gptq+shrink0": {s: (0.5, 1.2) for s in SECTIONS}, "gptq+shrink0.25": {s: (0.5, 0.6) for s in SECTIONS}}
    )
    (tmp_path / "shift.json").write_text(json.dumps(data))
    page = defaults.defaults_section(tmp_path, tmp_path)
    assert "gptq+shrink0.25 is chosen by the rule; optq's default is gptaq+shrink0.5" in page
    assert "(gptaq.json not found" in page
    # where the rule picks the code's default (method and shrink), the page says so
    data = _data(
        {"gptq+shrink0": {s: (0.5, 1.2) for s in SECTIONS}, "gptaq+shrink0.5": {s: (0.5, 0.6) for s in SECTIONS}}
    )
    (tmp_path / "shift.json").write_text(json.dumps(data))
    page = defaults.defaults_section(tmp_path, tmp_path)
    assert "gptaq+shrink0.5 is chosen by the rule and is optq's default (`method='gptaq'`, `diag_shrink=0.5`)" in page
