"""The shift matrix (issue 18): calibrated on one text, does GPTQ still beat round-to-nearest on others?

For each model, bit width (group 128), calibration source and candidate, a fresh copy of the fp
model is quantized with GPTQ and its perplexity measured on every evaluation text. Each cell is

    (GPTQ ppl - fp ppl) / (RTN ppl - fp ppl)

below 1: GPTQ beats round-to-nearest (RTN) on that text; 0: as good as fp. fp and RTN need no
calibration: they are measured once per (model, bits, group, text, seqlen, windows) and cached.

A calibration source is a named corpus (``enwiki``, ``debref-de``, ``code``) or a mixture
written with ``+`` (``enwiki+debref-de+code``: equal shares of --nsamples,
``optq.data.tokens.mixed_calibration``). A candidate is a GPTQ variant in ``optq compare``'s
grammar (``optq.eval.compare.VARIANT_HELP``), GPTQ or GPTAQ: ``gptq+shrink0`` (plain GPTQ),
``gptq+shrink0.5`` (H shrunk halfway toward its diagonal: optq's default), ``gptq+shrink0+damp0.1``,
``gptq+shrink0.5+mse``, ``gptaq+shrink0.5``, ``gptaq+shrink0.5+hmse`` (optq's default since
2026-12-06). Every candidate and RTN fit min/max ranges unless the name says ``+mse`` (the plain
range search) or ``+hmse`` (weighted by H's diagonal), so a key in the JSON means one run whatever
optq's defaults of the day are; a bare ``gptq`` takes the day's other defaults;
and shift's own ``+lw``: each layer's shrink chosen from its calibration statistics
(benchmarks/shift_rules.py), measured once per calibration and passed as per-layer overrides.

Every run goes into benchmarks/results/shift.json (written atomically after each run): a run
already there is not repeated, so a killed sweep resumes where it stopped and a longer list of
models, bits, sources or candidates extends it. The table, the heat maps (docs/lab/shift-*.png)
and docs/shift.md are redrawn from the JSON after every run.

    python benchmarks/shift.py [--models smollm2-135m] [--bits 4,3] [--calib enwiki,code,enwiki+code]
        [--candidates gptq,gptq+shrink0.5] [--nsamples 32 --seqlen 512 --windows 8] [--eval ...]
    python benchmarks/shift.py --write-only      # table, figures and docs/shift.md from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shift_report
import torch
from common import ROOT

import optq

RESULTS = ROOT / "benchmarks" / "results" / "shift.json"
# The defaults: docs/shift.md says why these texts, sources and candidates.
EVAL, CALIB, CANDIDATES = shift_report.EVAL, shift_report.CALIB, shift_report.CANDIDATES


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to sweep: the grid of runs, and the calibration and evaluation sizes."""

    bits: tuple[int, ...] = (4, 3)
    group_size: int = 128
    calib: tuple[str, ...] = tuple(CALIB)
    candidates: tuple[str, ...] = tuple(CANDIDATES)
    nsamples: int = 32
    seqlen: int = 512
    windows: int = 8
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class Subject:
    """One model under test: the fp model, its evaluation windows per text, and how to draw
    calibration windows of a source (``calibrate(spec, nsamples) -> [nsamples, seqlen]``)."""

    name: str
    model: torch.nn.Module
    evaluation: dict[str, torch.Tensor]
    calibrate: Callable[[str, int], torch.Tensor]


def load_subject(name: str, plan: Plan, corpora: list[str]) -> Subject:
    """Load a model of the zoo and tokenise its evaluation texts (BOS per window where it needs one)."""
    from optq.data import tokens, zoo

    model, tok = zoo.load_model(name)
    bos = zoo.eval_bos_id(name, tok, model.config)
    evaluation = {
        c: tokens.eval_windows(tokens.load_tokens(c, tok, "eval"), plan.seqlen, plan.windows, bos_id=bos)
        for c in corpora
    }

    def calibrate(source: str, nsamples: int) -> torch.Tensor:
        return tokens.calibration_windows(source.replace("+", ","), tok, nsamples, plan.seqlen, plan.seed)

    return Subject(name=name, model=model, evaluation=evaluation, calibrate=calibrate)


class Results:
    """shift.json: ``baselines`` (fp and RTN perplexity per text), ``runs`` (one GPTQ run each)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.data.setdefault("baselines", {})
        self.data.setdefault("runs", {})

    def save(self) -> None:
        from optq.formats.atomic import atomic_write

        self.data["machine"] = {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "optq": optq.__version__,
        }
        atomic_write(self.path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")


def baseline_key(model: str, method: str, bits: int, plan: Plan, corpus: str) -> str:
    """fp does not depend on bits or group: one entry per text serves every bit width."""
    return shift_report.baseline_key(model, method, bits, plan.group_size, plan.seqlen, plan.windows, corpus)


def run_key(model: str, bits: int, calib: str, candidate: str, plan: Plan) -> str:
    return f"{model}|b{bits}|g{plan.group_size}|{calib}|{candidate}|n{plan.nsamples}|L{plan.seqlen}|w{plan.windows}"


def _variant(spec: str, bits: int, plan: Plan) -> Any:
    """``spec`` in optq compare's grammar, plus shift's own modifier ``+lw``: each layer's
    diag_shrink chosen from its calibration statistics (benchmarks/shift_rules.py), which
    :func:`run_one` fills in as per-layer overrides."""
    from optq.eval.compare import parse_variant

    method, *mods = spec.split("+")
    base = "+".join([method, *(m for m in mods if m != "lw")])
    # min/max ranges unless the name asks for a search: the keys recorded before the search
    # became optq's default (2026-12-06) keep their meaning
    return parse_variant(base, optq.QuantConfig(bits=bits, group_size=plan.group_size, mse=False))


def layer_shrinks(results: Results, subject: Subject, calib: str, calibration: torch.Tensor, plan: Plan) -> dict:
    """The ``+lw`` rule's diag_shrink per linear for this calibration (cached: it needs no bits)."""
    from shift_rules import layer_shrinks as measure
    from shift_rules import units_of

    key = f"{subject.name}|{calib}|n{plan.nsamples}|L{plan.seqlen}|s{plan.seed}"
    cache = results.data.setdefault("layer_shrinks", {})
    if key not in cache:
        cache[key] = measure(subject.model, units_of(calibration, len(calib.split("+"))))
        results.save()
    return cache[key]


def _evaluate(subject: Subject, variant: Any, calibration: torch.Tensor | None, corpora: list[str]) -> Any:
    from optq.eval.compare import compare

    evaluation = {c: subject.evaluation[c] for c in corpora}
    placeholder = torch.zeros(1, 2, dtype=torch.long)  # fp and RTN never read it
    (res,) = compare(
        subject.model, [variant], placeholder if calibration is None else calibration, evaluation, progress=False
    )
    return res


def ensure_baselines(results: Results, subject: Subject, bits: int, plan: Plan) -> None:
    """fp and RTN perplexity on every text not yet in the cache, one model pass each."""
    for method in ("fp", "rtn"):
        missing = [
            c
            for c in subject.evaluation
            if baseline_key(subject.name, method, bits, plan, c) not in results.data["baselines"]
        ]
        if not missing:
            continue
        grid = "" if method == "fp" else f" {bits}-bit g{plan.group_size}"
        print(f"  {subject.name} {method}{grid} on {', '.join(missing)}", flush=True)
        t = time.perf_counter()
        res = _evaluate(subject, _variant(method, bits, plan), None, missing)
        seconds = time.perf_counter() - t
        for c in missing:
            results.data["baselines"][baseline_key(subject.name, method, bits, plan, c)] = {
                "model": subject.name,
                "method": method,
                "bits": None if method == "fp" else bits,
                "group_size": None if method == "fp" else plan.group_size,
                "corpus": c,
                "seqlen": plan.seqlen,
                "windows": plan.windows,
                "ppl": res.perplexity[c],
                "seconds": seconds,
            }
        results.save()


def run_one(results: Results, subject: Subject, bits: int, calib: str, candidate: str, plan: Plan) -> bool:
    """Quantize with ``candidate`` calibrated on ``calib`` and evaluate; False when already done."""
    key = run_key(subject.name, bits, calib, candidate, plan)
    done = results.data["runs"].get(key, {}).get("ppl", {})
    if set(subject.evaluation) <= set(done):
        return False
    variant = _variant(candidate, bits, plan)
    if variant.method not in ("gptq", "gptaq"):
        raise SystemExit(f"candidate {candidate!r} is neither GPTQ nor GPTAQ; fp and RTN are the baselines")
    print(f"  run {key}", flush=True)
    t = time.perf_counter()
    calibration = subject.calibrate(calib, plan.nsamples)
    shrinks = layer_shrinks(results, subject, calib, calibration, plan) if "lw" in candidate.split("+") else {}
    if shrinks:
        overrides = tuple((name, {"diag_shrink": value}) for name, value in shrinks.items())
        variant = dataclasses.replace(variant, overrides=overrides)
    res = _evaluate(subject, variant, calibration, list(subject.evaluation))
    row = {
        "model": subject.name,
        "bits": bits,
        "group_size": plan.group_size,
        "calib": calib,
        "candidate": candidate,
        "config": variant.config.to_dict(),
        "nsamples": plan.nsamples,
        "seqlen": plan.seqlen,
        "windows": plan.windows,
        "seed": plan.seed,
        "ppl": {**done, **res.perplexity},
        "quantize_s": res.quantize_s,
        "seconds": time.perf_counter() - t,
    }
    if shrinks:
        values = sorted(shrinks.values())
        row["layer_shrink"] = {"min": values[0], "median": values[len(values) // 2], "max": values[-1]}
    if res.report is not None and res.report.fallbacks:
        row["fallbacks"] = res.report.fallbacks
    results.data["runs"][key] = row
    results.save()
    return True


def sweep(results: Results, subject: Subject, plan: Plan, after_run: Callable[[], None] | None = None) -> int:
    """Every (bits, candidate, calibration) run of ``plan`` not yet in ``results``, bits first,
    then candidates in their order; baselines before the first run of each width. Returns the
    number of runs made."""
    made = 0
    for bits in plan.bits:
        ensure_baselines(results, subject, bits, plan)
        for candidate in plan.candidates:
            for calib in plan.calib:
                if run_one(results, subject, bits, calib, candidate, plan):
                    made += 1
                    if after_run is not None:
                        after_run()
    return made


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m", help="zoo names, e.g. smollm2-135m,gemma3-270m")
    ap.add_argument("--bits", default="4,3")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calib", default=",".join(CALIB), help="sources; a mixture joins corpora with +")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="GPTQ variants (optq compare's grammar)")
    ap.add_argument("--eval", default=",".join(EVAL), help="evaluation texts")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--docs", type=Path, default=ROOT / "docs", help="where shift.md and lab/shift-*.png go")
    ap.add_argument("--write-only", action="store_true", help="only print the table and redraw from the JSON")
    args = ap.parse_args(argv)
    plan = Plan(
        bits=tuple(int(b) for b in _split(args.bits)),
        group_size=args.group_size,
        calib=tuple(_split(args.calib)),
        candidates=tuple(_split(args.candidates)),
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        windows=args.windows,
    )
    results = Results(args.json)

    def report() -> None:
        print(shift_report.text_tables(results.data), flush=True)
        shift_report.write_doc(results.data, args.docs)

    made = 0
    if not args.write_only:
        from optq.data.corpora import is_corpus_name

        unknown = [s for s in [*plan.calib, *_split(args.eval)] for c in s.split("+") if not is_corpus_name(c)]
        if unknown:
            raise SystemExit(f"unknown corpora in {unknown}; a mixture joins corpus names with +")
        for name in _split(args.models):
            for spec in plan.candidates:
                for bits in plan.bits:
                    _variant(spec, bits, plan)  # a typo fails now, not hours into the sweep
            torch.manual_seed(0)
            subject = load_subject(name, plan, _split(args.eval))
            made += sweep(results, subject, plan, after_run=report)
            del subject
    if not made:  # after a run the table is already printed
        report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
