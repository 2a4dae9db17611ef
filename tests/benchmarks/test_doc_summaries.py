"""The generated pages' opening summaries (issue 32): docs/shift.md's worst cells and docs/lab.md's
verdicts, computed by the generators from hand-made results, so regenerating keeps them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lab_report  # noqa: E402
import shift_report  # noqa: E402

SIZE = {"model": "m", "bits": 4, "group_size": 16, "nsamples": 4, "seqlen": 16, "windows": 2}
FP = {"a": 10.0, "b": 20.0}
RTN = {"a": 20.0, "b": 40.0}


def shift_data() -> dict:
    baselines = {}
    for method, ppl in (("fp", FP), ("rtn", RTN)):
        for corpus, value in ppl.items():
            key = shift_report.baseline_key("m", method, 4, 16, 16, 2, corpus)
            baselines[key] = {"ppl": value}
    runs = {
        # cells (ppl - fp) / (rtn - fp): plain GPTQ a 0.5, b 1.2 on "a"; 0.3, 0.9 on "b"
        "1": {**SIZE, "candidate": "gptq+shrink0", "calib": "a", "ppl": {"a": 15.0, "b": 44.0}, "seconds": 60},
        "2": {**SIZE, "candidate": "gptq+shrink0", "calib": "b", "ppl": {"a": 13.0, "b": 38.0}, "seconds": 60},
        # GPTAQ: 0.2, 0.5 on "a"; 0.7, 0.1 on "b"
        "3": {**SIZE, "candidate": "gptaq+shrink0.5", "calib": "a", "ppl": {"a": 12.0, "b": 30.0}, "seconds": 60},
        "4": {**SIZE, "candidate": "gptaq+shrink0.5", "calib": "b", "ppl": {"a": 17.0, "b": 22.0}, "seconds": 60},
    }
    return {"runs": runs, "baselines": baselines}


def test_shift_summary_gives_each_sections_worst_cell(tmp_path):
    page = shift_report.write_doc(shift_data(), tmp_path).read_text()
    title, summary, table = page.split("\n\n")[:3]
    assert title.startswith("# The shift matrix")
    assert summary.startswith("In short: each section's worst cell")
    head, rule, row = table.splitlines()
    # GPTQ with the shrink was not measured: no column for it.
    assert head == "| section | plain GPTQ | GPTAQ, H shrunk halfway (the default until 2026-12-06) |"
    assert row == "| m, 4-bit g16, 4 x 16; 2 windows of 16 per text | 1.20 | 0.70 |"


def test_lab_summary_lists_each_sections_verdict():
    sections = [
        "## 1. A claim\n\n**Claim.** x.\n\n**Verdict: confirmed.** Never above RTN,\nat 3 bits.\n\n| table |",
        "## 5. (not run yet: `python benchmarks/lab.py --claims 5`)\n",
        "## 9. Bits\n\n**Verdict on m1: nuanced.** 0.65 of uniform.\n\n**Verdict on m2: refuted.** 1.2.\n",
    ]
    summary = lab_report.verdicts(sections).splitlines()
    assert summary[0].startswith("In short, the verdicts")
    assert summary[2:] == [
        "- **1. A claim**: confirmed. Never above RTN, at 3 bits.",
        "- **9. Bits (m1)**: nuanced. 0.65 of uniform.",
        "- **9. Bits (m2)**: refuted. 1.2.",
    ]
