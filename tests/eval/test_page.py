"""optq report: the page's structure, numbers checked against independent computation, nothing
fetched from the network, and (where Chromium is installed) how it renders at two widths."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import transformers

import optq
from optq.cli import main
from optq.eval.compare import compare, parse_variant
from optq.eval.page import PageError, build_page, write_page

matplotlib = pytest.importorskip("matplotlib")


class _Outline(HTMLParser):
    """Sections by id, the rows of each section's tables, tags that could fetch, svg count."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, list[list[str]]] = {}
        self.section: str | None = None
        self.row: list[str] | None = None
        self.cell: list[str] | None = None
        self.fetching: list[str] = []
        self.svgs: dict[str, int] = {}
        self.uses: dict[str, int] = {}
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.section = a["id"]
            self.sections[self.section] = []
        if tag in ("script", "link", "img", "iframe", "object") or any(
            k in ("src", "href") and v and not v.startswith("#") for k, v in a.items() if k != "xmlns"
        ):
            if not (tag == "use" or a.get("href", "#").startswith("#")):
                self.fetching.append(f"<{tag} {a}>")
        if tag == "svg":
            self.svgs[self.section] = self.svgs.get(self.section, 0) + 1
        if tag == "use":
            self.uses[self.section] = self.uses.get(self.section, 0) + 1
        if tag == "tr":
            self.row = []
        if tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.row is not None and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        if tag == "tr" and self.row is not None and self.section:
            self.sections[self.section].append(self.row)
            self.row = None
        if tag == "section":
            self.section = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def _outline(page: str) -> _Outline:
    p = _Outline()
    p.feed(page)
    return p


def _llama_config():
    """The tiny Llama the page's checkpoint and the demo's estimate are built from."""
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict, int]:
    torch.manual_seed(0)
    cfg = _llama_config()
    model = transformers.LlamaForCausalLM(cfg).eval()
    fp_bytes = sum(p.numel() * 4 for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, 64, (4, 16), generator=g)
    windows = {"text": torch.randint(0, 64, (3, 16), generator=g), "other": torch.randint(0, 64, (3, 16), generator=g)}
    base = optq.QuantConfig(bits=3, group_size=16)
    folder = tmp_path_factory.mktemp("page") / "ckpt"
    rows = []

    def keep(res, m):
        rows.append(res.to_dict())
        if res.variant.method == "gptq":
            optq.save(m, folder, solutions=res.report.solutions, report=res.report)

    compare(
        model, [parse_variant(v, base) for v in ("fp", "rtn", "gptq")], calib, windows, progress=False, on_result=keep
    )
    result = {
        "model": "tiny",
        "calib": "text",
        "nsamples": 4,
        "seqlen": 16,
        "windows": 3,
        "corpora": ["text", "other"],
        "variants": rows,
    }
    (folder / "compare.json").write_text(json.dumps(result))
    return folder, result, fp_bytes


def test_page_sections_numbers_and_no_network(checkpoint):
    folder, result, fp_bytes = checkpoint
    page = build_page(folder)
    o = _outline(page)
    assert list(o.sections) == ["summary", "layers", "calibration", "quality", "float"]
    assert o.fetching == [], o.fetching
    for word in ("floating point", "round-to-nearest", "Hessian-aware"):
        assert word in page  # fp, RTN and GPTQ spelled out
    report = json.loads((folder / "quantization_report.json").read_text())

    summary = {r[0]: r[1] for r in o.sections["summary"]}
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert f"{disk / 1e6:,.1f} MB against {fp_bytes / 1e6:,.1f} MB in float32" in summary["size on disk"]
    assert f"{fp_bytes / disk:.2f}x smaller" in summary["size on disk"]
    assert "3-bit symmetric grid, group size 16" in summary["method"]
    assert "4 samples x 16 tokens" in summary["calibration"]

    layers = {r[0]: r for r in o.sections["layers"] if r[0].startswith("model.")}
    assert set(layers) == set(report["layers"])  # every quantized linear has its row
    for name, row in report["layers"].items():
        assert layers[name][4] == f"{row['objective']:.4g}" and layers[name][5] == f"{row['rtn_objective']:.4g}"
    groups = [r for r in o.sections["calibration"] if r[0].startswith("model.")]
    assert len(groups) == 2 * 4  # q/k/v, o, gate/up, down in each of 2 blocks
    for r in groups:
        stats = report["layers"][r[0]]["calibration"]
        assert r[2] == f"{stats['top1pct_share']:.4g}" and r[4] == f"{1 / 16:.4g}"

    ppl = {r[0]: r for r in o.sections["quality"][1:]}
    assert set(ppl) == {"fp", "rtn", "gptq"}
    for v in result["variants"]:
        assert ppl[v["name"]][1].startswith(f"{v['perplexity']['text']:.5g}")
    fp = result["variants"][0]["perplexity"]["other"]
    assert ppl["gptq"][2].endswith(f"({result['variants'][2]['perplexity']['other'] - fp:+.3f})")

    floats = {r[0] for r in o.sections["float"][1:]}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= floats
    assert not any(n.rsplit(".", 1)[0] in report["layers"] for n in floats)

    # Figures: 3 markers per layer in the objectives (GPTQ, RTN, ratio), one chart per section.
    assert o.svgs == {"layers": 1, "calibration": 1, "quality": 1}
    assert o.uses["layers"] >= 3 * len(report["layers"])
    assert build_page(folder) == page  # deterministic


def test_fallbacks_skips_and_float_layers_are_named(checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], folder)
    report = json.loads((folder / "quantization_report.json").read_text())
    name = sorted(report["layers"])[0]
    report["fallbacks"] = {name: "damping raised from 0.01 to 0.1 to factorise H"}
    report["skipped"] = {"model.layers.1.mlp.down_proj": "never called on the calibration data"}
    (folder / "quantization_report.json").write_text(json.dumps(report))
    o = _outline(build_page(folder, evaluations=[], figures=False))
    rows = o.sections["float"]
    assert [name, "damping raised from 0.01 to 0.1 to factorise H"] in rows
    assert ["model.layers.1.mlp.down_proj", "never called on the calibration data"] in rows
    assert o.svgs == {}
    assert "No evaluation found" in build_page(folder, evaluations=[], figures=False)


def test_cli_report_and_its_errors(checkpoint, tmp_path, capsys):
    folder = checkpoint[0]
    out = tmp_path / "r.html"
    assert main(["report", str(folder), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert out.read_text() == build_page(folder)
    assert out.stat().st_mode & 0o777 == 0o644
    assert main(["report", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip()
    assert "quantization_report.json" in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["report", str(folder), "--eval", str(bad), "-o", str(out)]) != 0
    assert "bad.json is not readable JSON" in capsys.readouterr().err
    with pytest.raises(PageError, match="not a folder"):
        build_page(tmp_path / "missing")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian package chromium)")
@pytest.mark.parametrize("width,height", [(1280, 900), (390, 844)])
def test_page_renders_in_headless_chromium(checkpoint, tmp_path, width, height):
    page = write_page(checkpoint[0], tmp_path / "report.html")
    shot = tmp_path / f"shot-{width}.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--window-size={width},{height}",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    import matplotlib.image

    image = matplotlib.image.imread(str(shot))
    assert image.shape[:2] == (height, width)
    # Something was drawn: the heading's dark text on the white page, not a blank or error page.
    dark = (image[..., :3].mean(axis=2) < 0.3).mean()
    assert 0.001 < dark < 0.5, dark
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            f"--user-data-dir={tmp_path / 'profile2'}",
            f"--window-size={width},{height}",
            "--dump-dom",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
        text=True,
    ).stdout
    assert re.search(r"<h1>optq report: ckpt</h1>", dom)


def test_demo_time_estimate_adds_quantize_and_evaluation(monkeypatch):
    import argparse

    from optq.cli import demo
    from optq.pipeline import planning as plan

    cfg = _llama_config()
    model = transformers.LlamaForCausalLM(cfg)
    # A machine of 1 FLOP/s and 1 s per solve unit: both terms run to hundreds of thousands of
    # minutes, so the whole minutes the line prints resolve each term to 1e-5 of itself (at the
    # real speed the tiny model's estimate is "about 0 min" whatever the terms are).
    speed = {"flops": 1.0, "solve_unit": 1.0}
    monkeypatch.setattr(plan, "machine_speed", lambda: speed)
    args = argparse.Namespace(nsamples=4, seqlen=16, windows=3)
    config = optq.QuantConfig(bits=4, group_size=16)
    parts = plan.plan(
        model.config, nsamples=4, seqlen=16, config=config, source_dtype=torch.float32, speed=speed
    ).seconds
    assert parts["forwards"] > 0 and parts["solves"] > 0  # both rates enter the quantize term
    quantize = sum(parts.values())
    # 3 variants x 2 corpora x 3 windows x 16 tokens, 2 FLOPs per parameter per token.
    evaluate = 3 * 2 * 3 * 16 * 2 * sum(p.numel() for p in model.parameters()) / speed["flops"]
    line = demo._estimate(model.config, args, corpora=2, variants=3, config=config)
    match = re.match(r"estimated time on this machine: about (\d+) min ", line)
    assert match, line
    minutes = int(match[1])
    assert abs(minutes - (quantize + evaluate) / 60) <= 0.5, (line, quantize / 60, evaluate / 60)
    # Each term is thousands of minutes: without either one the line would be far off.
    assert min(quantize, evaluate) / 60 > 1000


def test_layers_appear_in_run_order_whatever_the_json_order(checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], folder)
    report = json.loads((folder / "quantization_report.json").read_text())
    run_order = list(report["layers"])  # optq.quantize's order: block by block, group by group
    # Twelve blocks' worth of names sorted as strings would put layers.10 before layers.2; here
    # the keys are simply reversed, and the page must still follow blocks and groups.
    report["layers"] = dict(reversed(list(report["layers"].items())))
    (folder / "quantization_report.json").write_text(json.dumps(report))
    o = _outline(build_page(folder, evaluations=[], figures=False))
    shown = [r[0] for r in o.sections["layers"] if r[0].startswith("model.")]
    expected = sorted(run_order, key=lambda n: (int(n.split(".")[2]), report["layers"][n]["subset"], n))
    assert shown == expected
    assert [report["layers"][n]["subset"] for n in shown[:7]] == [0, 0, 0, 1, 2, 2, 3]
