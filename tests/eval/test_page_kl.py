"""The report page's quality section shows KL from fp and top-1 agreement, from a comparison
(per variant and corpus) and from an ``optq eval --json`` file."""

from __future__ import annotations

import json

from test_page import _outline, checkpoint  # noqa: F401 - the module's checkpoint fixture

from optq.eval.page import build_page


def test_comparison_kl_columns_follow_the_perplexities(checkpoint):  # noqa: F811
    folder, result, _ = checkpoint
    o = _outline(build_page(folder, figures=False))
    head, *rows = o.sections["quality"]
    assert head[:4] == ["variant", "text (calibration)", "other", "quantize s"]
    assert head[4:] == ["KL text", "KL p99", "top-1", "KL other", "KL p99", "top-1"]
    by_name = {r[0]: r for r in rows}
    for v in result["variants"]:
        row = by_name[v["name"]]
        for i, c in enumerate(("text", "other")):
            kl, p99, top1 = row[4 + 3 * i : 7 + 3 * i]
            assert kl == f"{v['kl'][c]:.4g}" and p99 == f"{v['kl_p99'][c]:.4g}"
            assert top1 == f"{100 * v['top1'][c]:.2f}%"
    assert by_name["fp"][4:7] == ["0", "0", "100.00%"]
    assert float(by_name["rtn"][4]) > 0
    assert "KL(fp || quantized)" in build_page(folder, figures=False)


def test_eval_json_kl_columns_only_when_measured(checkpoint, tmp_path):  # noqa: F811
    folder, _, _ = checkpoint
    row = {"corpus": "enwiki", "windows": 4, "tokens": 2044, "perplexity": 19.5}
    measured = {"reference": "smollm2-135m", "results": [{**row, "kl": 0.0312, "kl_p99": 0.41, "top1": 0.9123}]}
    plain = {"reference": None, "results": [{**row, "kl": None, "kl_p99": None, "top1": None}]}
    for name, data in (("m.json", measured), ("p.json", plain)):
        (tmp_path / name).write_text(json.dumps(data))
    o = _outline(build_page(folder, [tmp_path / "m.json"], figures=False))
    head, values = o.sections["quality"]
    assert head == ["corpus", "windows", "tokens", "perplexity", "KL (vs smollm2-135m)", "KL p99", "top-1 agreement"]
    assert values == ["enwiki", "4", "2044", "19.5", "0.0312", "0.41", "91.23%"]
    head, values = _outline(build_page(folder, [tmp_path / "p.json"], figures=False)).sections["quality"]
    assert head == ["corpus", "windows", "tokens", "perplexity"] and values[3] == "19.5"
