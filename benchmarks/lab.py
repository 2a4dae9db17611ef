"""The lab: each claim of the method reproduced on SmolLM2-135M on this machine, with a verdict.

Runs the experiments, keeps every result in benchmarks/results/lab.json (a run already there
is not repeated: delete the file to start over), draws the figures into docs/lab/ and writes
docs/lab.md. Every quantized run calibrates on ``--nsamples`` x ``--seqlen`` tokens (fewer than
the demo's 128 x 512, to fit the whole lab in well under an hour on 2 CPU cores) and is
evaluated on the same ``--windows`` held-out windows of enwiki, debref-de, code and debref-ja.

    python benchmarks/lab.py [--claims 1,2,3,4,5,6,7] [--nsamples 32] [--seqlen 512] [--windows 10]
    python benchmarks/lab.py --write-only      # redraw figures and docs/lab.md from lab.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from typing import Any

import torch
from common import ROOT
from lab_report import write_doc

import optq

RESULTS = ROOT / "benchmarks" / "results" / "lab.json"
MODEL = "smollm2-135m"
CORPORA = ["enwiki", "debref-de", "code", "debref-ja"]
BASE = optq.QuantConfig(bits=4, group_size=128, diag_shrink=0.0)  # the method's claims: plain GPTQ's H


class Lab:
    """The model, the token sets and the results file, loaded once."""

    def __init__(self, nsamples: int, seqlen: int, windows: int) -> None:
        from optq.data import corpora, tokens, zoo

        for name in CORPORA:
            corpora.fetch_corpus(name)
        self.model, self.tok = zoo.load_model(MODEL)
        bos = zoo.eval_bos_id(MODEL, self.tok, self.model.config)
        self.nsamples, self.seqlen, self.windows = nsamples, seqlen, windows
        self.evaluation = {
            c: tokens.eval_windows(tokens.load_tokens(c, self.tok, "eval"), seqlen, windows, bos_id=bos)
            for c in CORPORA
        }
        self.data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        settings = {"model": MODEL, "nsamples": nsamples, "seqlen": seqlen, "windows": windows, "corpora": CORPORA}
        if self.data.get("settings", settings) != settings:
            raise SystemExit(f"{RESULTS} was made with {self.data['settings']}; delete it or use those settings")
        self.data["settings"] = settings
        self.data.setdefault("runs", {})
        self.data["machine"] = {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "optq": optq.__version__,
        }

    def save(self) -> None:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(self.data, indent=1) + "\n")

    def calibration(self, calib: str, nsamples: int | None = None) -> torch.Tensor:
        from optq.data.tokens import calibration_windows

        return calibration_windows(calib, self.tok, nsamples or self.nsamples, self.seqlen, 0)

    def run(self, variant: str, calib: str = "enwiki", nsamples: int | None = None) -> dict[str, Any]:
        """Quantize a fresh copy with ``variant`` (optq compare's names), evaluate on every corpus."""
        from optq.eval.compare import compare, parse_variant

        key = f"{variant}|{calib}|{nsamples or self.nsamples}"
        if key in self.data["runs"]:
            return self.data["runs"][key]
        print(f"  run {key}", flush=True)
        v = parse_variant(variant, BASE)
        calibration = self.calibration(calib, nsamples) if v.method == "gptq" else self.calibration("enwiki", 4)
        t = time.perf_counter()
        (res,) = compare(self.model, [v], calibration, self.evaluation, progress=False)
        row = {
            "variant": variant,
            "calib": calib,
            "nsamples": nsamples or self.nsamples,
            "perplexity": res.perplexity,
            "quantize_s": res.quantize_s,
            "seconds": time.perf_counter() - t,
        }
        if res.report is not None:
            row["layers"] = {n: [r.objective, r.rtn_objective] for n, r in res.report.layers.items()}
            row["fallbacks"] = res.report.fallbacks
        self.data["runs"][key] = row
        self.save()
        return row

    def inputs(self, linear: str, nsamples: int) -> torch.Tensor:
        """The fp model's inputs to ``linear`` over ``nsamples`` enwiki windows: [tokens, features]."""
        xs = []
        module = self.model.get_submodule(linear)
        handle = module.register_forward_pre_hook(lambda m, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
        calib = self.calibration("enwiki", nsamples)
        try:
            with torch.no_grad():
                for b in range(0, len(calib), 8):
                    self.model(input_ids=calib[b : b + 8], use_cache=False)
        finally:
            handle.remove()
        return torch.cat(xs)


# ------------------------------------------------------------------------------------ claims
def claim1(lab: Lab) -> dict[str, Any]:
    """GPTQ's objective never above RTN's, equal for a diagonal H, the gap growing with correlation."""
    d, n, rows = 256, 2048, 64
    sweep = []
    for rho in (0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99):
        ratios, diag = [], []
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            # AR(1) features: corr(x_i, x_j) = rho^|i-j|
            X = torch.empty(n, d, dtype=torch.float64)
            X[:, 0] = torch.randn(n, generator=g, dtype=torch.float64)
            for j in range(1, d):
                X[:, j] = rho * X[:, j - 1] + math.sqrt(1 - rho * rho) * torch.randn(
                    n, generator=g, dtype=torch.float64
                )
            h = optq.Hessian(d, dtype=torch.float64, normalize_tokens=False)
            h.update(X)
            H = h.matrix()
            W = torch.randn(rows, d, generator=g, dtype=torch.float64)
            cfg = optq.QuantConfig(bits=4, group_size=128, diag_shrink=0.0)
            rtn = optq.objective(W, optq.rtn(W, cfg).weight, H)
            ratios.append(optq.gptq(W, H, cfg).loss / rtn)
            Hd = torch.diag(H.diagonal())
            diag.append(optq.gptq(W, Hd, cfg).loss / optq.objective(W, optq.rtn(W, cfg).weight, Hd))
        sweep.append(
            {
                "rho": rho,
                "ratio_mean": sum(ratios) / len(ratios),
                "ratio_max": max(ratios),
                "diag_ratio_min": min(diag),
                "diag_ratio_max": max(diag),
            }
        )
    layers = lab.run("gptq")["layers"]
    ratios = {name: (o / r if r > 0 else 1.0) for name, (o, r) in layers.items()}
    return {"synthetic": sweep, "layer_ratios": ratios}


def claim2(lab: Lab) -> dict[str, Any]:
    """Damping: too little explodes, too much degenerates toward RTN."""
    from optq.core.factor import FactorizationError

    damps = [1e-4, 1e-2, 1e-1, 1.0]
    rows = [{"damp": d, "perplexity": lab.run("gptq" if d == 1e-2 else f"gptq+damp{d:g}")["perplexity"]} for d in damps]
    rtn = lab.run("rtn")["perplexity"]
    # Few samples: 128 tokens for down_proj's 1536 inputs give a singular H.
    X = lab.inputs("model.layers.3.mlp.down_proj", 2)[: 2 * 64]
    h = optq.Hessian(X.shape[1], normalize_tokens=True)
    h.update(X)
    H = h.matrix()
    W = lab.model.get_submodule("model.layers.3.mlp.down_proj").weight.detach()
    few: dict[str, Any] = {
        "tokens": int(X.shape[0]),
        "inputs": int(X.shape[1]),
        "rank": int(torch.linalg.matrix_rank(H.double(), rtol=1e-5)),
    }  # float32 noise aside
    try:
        optq.gptq(W, H, optq.QuantConfig(bits=4, group_size=128, damp=0.0, damp_max=0.0, diag_shrink=0.0))
        few["damp0"] = "factorised"
    except FactorizationError as exc:
        few["damp0"] = f"FactorizationError: {str(exc)[:160]}"
    sol = optq.gptq(W, H, optq.QuantConfig(bits=4, group_size=128, damp=0.0, diag_shrink=0.0))
    few["damp0_escalated_to"] = sol.damp
    for d in (1e-6, 1e-4, 1e-2):
        cfg = optq.QuantConfig(bits=4, group_size=128, damp=d, damp_max=d, diag_shrink=0.0)
        try:
            s = optq.gptq(W, H, cfg)
            few[f"ratio_damp{d:g}"] = s.loss / optq.objective(W, optq.rtn(W, cfg).weight, H)
            few[f"max_abs_weight_damp{d:g}"] = float(s.weight.abs().max())
        except FactorizationError as exc:
            few[f"ratio_damp{d:g}"] = f"FactorizationError: {str(exc)[:80]}"
    few["max_abs_weight_fp"] = float(W.abs().max())
    return {"rows": rows, "rtn": rtn, "few": few}


def claim3(lab: Lab) -> dict[str, Any]:
    """Error propagation: the already-quantized model's activations against the original's."""
    rows = []
    for bits in (2, 3, 4):
        b = "" if bits == 4 else f"+b{bits}"
        rows.append(
            {
                "bits": bits,
                "quantized": lab.run(f"gptq{b}")["perplexity"],
                "original": lab.run(f"gptq{b}+original")["perplexity"],
                "rtn": lab.run(f"rtn{b}")["perplexity"],
            }
        )
    return {"rows": rows, "fp": lab.run("fp")["perplexity"]}


def claim4(lab: Lab) -> dict[str, Any]:
    """Greedy OBQ order vs GPTQ's fixed order vs act-order, on layers small enough for OBQ."""
    out = []
    for linear, rows in (
        ("model.layers.0.self_attn.k_proj", 32),
        ("model.layers.15.self_attn.k_proj", 32),
        ("model.layers.15.mlp.up_proj", 16),
    ):
        X = lab.inputs(linear, 8)
        W = lab.model.get_submodule(linear).weight.detach()[:rows].double()
        h = optq.Hessian(X.shape[1], dtype=torch.float64)
        h.update(X.double())
        H = h.matrix()
        entry: dict[str, Any] = {"layer": linear, "shape": [rows, X.shape[1]]}
        for name, fn, cfg in (
            ("rtn", optq.rtn, optq.QuantConfig(bits=3, group_size=128, act_order=False, diag_shrink=0.0)),
            (
                "gptq, natural order",
                optq.gptq,
                optq.QuantConfig(bits=3, group_size=128, act_order=False, diag_shrink=0.0),
            ),
            ("gptq, act-order", optq.gptq, optq.QuantConfig(bits=3, group_size=128, act_order=True, diag_shrink=0.0)),
            ("obq, greedy order", optq.obq, optq.QuantConfig(bits=3, group_size=128, act_order=False, diag_shrink=0.0)),
        ):
            t = time.perf_counter()
            sol = fn(W, H, cfg) if fn is not optq.rtn else fn(W, cfg)
            entry[name] = {"objective": optq.objective(W, sol.weight, H), "seconds": time.perf_counter() - t}
        out.append(entry)
        print(f"  claim 4: {linear} done", flush=True)
    return {"layers": out, "bits": 3, "group_size": 128}


def claim5(lab: Lab) -> dict[str, Any]:
    """Calibration dependence, and two mitigations on the same matrix."""
    rows = {"rtn": lab.run("rtn")["perplexity"], "fp": lab.run("fp")["perplexity"]}
    for calib in ("enwiki", "debref-de", "code"):
        rows[f"gptq, calibrated on {calib}"] = lab.run("gptq", calib=calib)["perplexity"]
    rows["gptq, calibrated on enwiki+debref-de+code"] = lab.run("gptq", calib="enwiki,debref-de,code")["perplexity"]
    for s in (0.5,):
        rows[f"gptq on enwiki, H shrunk {s:g} toward its diagonal"] = lab.run(f"gptq+shrink{s:g}")["perplexity"]
    return {"rows": rows}


SIZES = [4, 16, 64]  # claim 6's calibration sizes (--sizes)


def claim6(lab: Lab) -> dict[str, Any]:
    """Calibration size: perplexity and the Hessian's effective rank against nsamples."""
    sizes = SIZES
    rows = []
    for n in sizes:
        ppl = lab.run("gptq", nsamples=n)["perplexity"]
        ranks = {}
        for linear in ("model.layers.0.self_attn.q_proj", "model.layers.15.mlp.down_proj"):
            X = lab.inputs(linear, n)
            for norm in (False, True):
                h = optq.Hessian(X.shape[1], dtype=torch.float64, normalize_tokens=norm)
                h.update(X.double())
                ev = torch.linalg.eigvalsh(h.matrix()).clamp_min(0)
                p = ev / ev.sum()
                ranks[f"{linear}|{'normalised' if norm else 'plain'}"] = float(
                    torch.exp(-(p[p > 0] * p[p > 0].log()).sum())
                )
        rows.append({"nsamples": n, "tokens": n * lab.seqlen, "perplexity": ppl, "effective_rank": ranks})
        print(f"  claim 6: nsamples {n} done", flush=True)
    return {"rows": rows, "rtn": lab.run("rtn")["perplexity"]}


def claim7(lab: Lab) -> dict[str, Any]:
    """Plain vs token-normalised Hessians at 2, 3 and 4 bits, and the token norms that explain it."""
    rows = []
    for bits in (2, 3, 4):
        b = "" if bits == 4 else f"+b{bits}"
        rows.append(
            {
                "bits": bits,
                "normalised": lab.run(f"gptq{b}")["perplexity"],
                "plain": lab.run(f"gptq{b}+no_norm")["perplexity"],
                "rtn": lab.run(f"rtn{b}")["perplexity"],
            }
        )
    return {"rows": rows, "fp": lab.run("fp")["perplexity"], "norms": _token_norms(lab)}


def _token_norms(lab: Lab, windows: int = 8) -> dict[str, Any]:
    """|x|² of every token entering each layer group (the first linear of q/k/v, o, gate/up,
    down in every block) over ``windows`` enwiki windows of the fp model: the share of Σ|x|²
    at position 0 and in the top 1% of tokens, per group, and the histogram of the group where
    position 0 owns the most."""
    from optq.formats.linears import find_linears

    firsts = [n for n in find_linears(lab.model) if n.endswith(("q_proj", "o_proj", "gate_proj", "down_proj"))]
    energy: dict[str, list[torch.Tensor]] = {n: [] for n in firsts}
    handles = [
        lab.model.get_submodule(n).register_forward_pre_hook(
            lambda m, a, n=n: energy[n].append(a[0].detach().double().pow(2).sum(-1))
        )
        for n in firsts
    ]
    calib = lab.calibration("enwiki", windows)
    try:
        with torch.no_grad():
            lab.model(input_ids=calib, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    groups = {}
    for n in firsts:
        sq = torch.cat(energy[n])  # [windows, length]
        top = torch.topk(sq.flatten(), max(1, sq.numel() // 100)).values.sum()
        groups[n] = {
            "position0_share": float(sq[:, 0].sum() / sq.sum()),
            "top1pct_share": float(top / sq.sum()),
            "position0_over_median": float(sq[:, 0].mean() / sq[:, 1:].median()),
        }
    worst = max(groups, key=lambda n: groups[n]["position0_share"])
    sq = torch.cat(energy[worst])
    return {
        "windows": windows,
        "groups": groups,
        "worst": worst,
        "hist": _log_hist(sq[:, 1:].flatten()),
        "hist_first": _log_hist(sq[:, 0]),
    }


def _log_hist(values: torch.Tensor) -> dict[str, list[float]]:
    edges = torch.logspace(-2, 8, 51)
    counts = torch.histc(values.clamp(1e-2, 1e8).log10(), bins=50, min=-2, max=8)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


CLAIMS = {1: claim1, 2: claim2, 3: claim3, 4: claim4, 5: claim5, 6: claim6, 7: claim7}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", default="1,2,3,4,5,6,7")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--sizes", default="4,16,64", help="claim 6's calibration windows")
    ap.add_argument("--write-only", action="store_true", help="only redraw figures and docs/lab.md")
    args = ap.parse_args()
    SIZES[:] = [int(x) for x in args.sizes.split(",")]
    if not args.write_only:
        torch.manual_seed(0)
        lab = Lab(args.nsamples, args.seqlen, args.windows)
        for c in (int(x) for x in args.claims.split(",")):
            print(f"claim {c}: {CLAIMS[c].__doc__}", flush=True)
            t = time.perf_counter()
            lab.data[f"claim{c}"] = {**CLAIMS[c](lab), "seconds": time.perf_counter() - t}
            lab.save()
    data = json.loads(RESULTS.read_text())
    print(f"wrote {write_doc(data, ROOT / 'docs')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
