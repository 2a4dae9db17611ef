"""optq against its peers on one model and bit width: the same calibration token ids, one evaluator.

    python benchmarks/peers.py --model smollm2-135m --bits 4 [--group-size 128]
        [--peers optq,optq-gptq,gptqmodel,...] [--quick] [--json F] [--work DIR]

Each peer quantizes in a child process (benchmarks/peers_child/), optq with this interpreter and
this checkout, every other peer in its own pinned virtualenv that this script creates on first
use under WORK/venvs/ (torch 2.13.0 CPU; the install time is kept in the venv's
optq-peer.json). Every method reads the same [nsamples, seqlen] int64 ids from
WORK/calib-*.safetensors and is asked for the same bits, group size and a symmetric grid; what
each did instead is in its row's notes. Then ``optq eval`` scores every checkpoint on the same
windows: perplexity per corpus, KL(fp || quantized) (mean and 99th percentile) and top-1
agreement against the float model, averaged over the corpora. Results go to --json after every
cell; a rerun skips finished cells and retries failed ones. A failed peer is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common  # noqa: F401 - this checkout first on the path
from common import ROOT, md_table

CHILDREN = ROOT / "benchmarks" / "peers_child"
RESULTS = ROOT / "benchmarks" / "results"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel on local disk; unpinned, pip pulls a CUDA build
CORPORA = ("enwiki", "debref-de", "code")


@dataclass(frozen=True)
class Peer:
    name: str
    venv: str | None  # a key of VENVS; None: this interpreter
    child: str  # script in benchmarks/peers_child/
    variant: str  # what the child is told to run


PEERS = {
    p.name: p
    for p in (
        Peer("optq", None, "optq_child.py", "gptaq"),
        Peer("optq-gptq", None, "optq_child.py", "gptq"),
        Peer("optq-rtn", None, "optq_child.py", "rtn"),
        Peer("optq-mse", None, "optq_child.py", "gptaq-mse"),  # the default's search unweighted: an option
        Peer("optq-minmax", None, "optq_child.py", "gptaq-minmax"),  # --no-mse: the default before 2026-12-06
        Peer("optq-gptq-minmax", None, "optq_child.py", "gptq-minmax"),  # --method gptq --no-mse
        Peer("gptqmodel", "gptqmodel", "gptqmodel_child.py", "gptq"),
        Peer("gptqmodel-gptaq", "gptqmodel", "gptqmodel_child.py", "gptaq"),
        Peer("llm-compressor", "llm-compressor", "llmcompressor_child.py", "gptq"),
        Peer("llm-compressor-imatrix", "llm-compressor", "llmcompressor_child.py", "gptq-imatrix"),
        Peer("llm-compressor-awq", "llm-compressor", "llmcompressor_child.py", "awq"),
        Peer("auto-round", "auto-round", "autoround_child.py", "default"),
        Peer("auto-round-fast", "auto-round", "autoround_child.py", "fast"),
    )
}
VENVS = {  # pinned packages of each virtualenv, installed with TORCH_PIN
    "gptqmodel": ("gptqmodel==7.6.0",),
    "llm-compressor": ("llmcompressor==0.14.0.1",),
    "auto-round": ("auto-round==0.16.1",),
}
QUICK_PEERS = ("optq", "optq-gptq", "gptqmodel", "llm-compressor")
ROW_KEYS = ("peer", "bits", "group_size", "quantize_s", "peak_rss_mb", "kl", "kl_p99", "top1", "ppl", "bytes", "notes")


def protocol(quick: bool) -> dict[str, Any]:
    """Calibration and evaluation sizes: the README's (128 x 512, 40 windows) or --quick's."""
    if quick:
        return {"nsamples": 16, "seqlen": 256, "eval_seqlen": 512, "windows": 4, "corpora": list(CORPORA)}
    return {"nsamples": 128, "seqlen": 512, "eval_seqlen": 512, "windows": 40, "corpora": list(CORPORA)}


def parse_peers(spec: str | None, quick: bool) -> list[str]:
    """The peers to run, in the order given; None: every peer (--quick: QUICK_PEERS)."""
    if spec is None:
        return list(QUICK_PEERS if quick else PEERS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    if not names:
        raise ValueError(f"--peers names no peer; known: {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


def default_json(model: str, bits: int, quick: bool) -> Path:
    stem = Path(model).name if Path(model).is_dir() else model
    return RESULTS / f"peers-{stem}-{bits}{'-quick' if quick else ''}.json"


def load_results(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The results so far in ``path`` (``header`` + rows), or a fresh one. A file written under
    another protocol (model, bits, sizes) is an error, not overwritten."""
    if not path.exists():
        return {**header, "rows": []}
    results = json.loads(path.read_text())
    differ = {k: (results.get(k), v) for k, v in header.items() if results.get(k) != v}
    if differ:
        raise ValueError(f"{path} holds another run ({differ}: stored, asked); give another --json")
    return results


def save_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def finished(results: dict[str, Any], peer: str) -> bool:
    return any(r["peer"] == peer and not r.get("error") for r in results["rows"])


def put_row(results: dict[str, Any], row: dict[str, Any]) -> None:
    """Replace ``row["peer"]``'s row (a failed try) or append it."""
    rows = [r for r in results["rows"] if r["peer"] != row["peer"]]
    results["rows"] = [*rows, row]


def error_row(peer: str, bits: int, group_size: int, error: str, notes: str = "") -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(peer=peer, bits=bits, group_size=group_size, ppl={}, notes=notes, error=error)
    return row


def make_row(peer: str, bits: int, group_size: int, quant: dict, evaluation: dict) -> dict[str, Any]:
    """A finished cell: the child's measurements and ``optq eval``'s JSON, averaged over corpora."""
    res = evaluation["results"]
    mean = (lambda k: sum(r[k] for r in res) / len(res)) if evaluation.get("reference") else (lambda k: None)
    return {
        "peer": peer,
        "bits": bits,
        "group_size": group_size,
        "quantize_s": quant.get("quantize_s"),
        "peak_rss_mb": quant.get("peak_rss_mb"),
        "kl": mean("kl"),
        "kl_p99": mean("kl_p99"),
        "top1": mean("top1"),
        "ppl": {r["corpus"]: r["perplexity"] for r in res},
        "bytes": quant.get("bytes"),
        "notes": quant.get("notes", ""),
        "version": quant.get("version"),
        "by_corpus": {r["corpus"]: {k: r.get(k) for k in ("kl", "kl_p99", "top1", "windows")} for r in res},
    }


def write_calibration(path: Path, ids: Any) -> None:
    """[nsamples, seqlen] int64 token ids as safetensors (``ids``), read by every child."""
    import torch
    from safetensors.torch import save_file

    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"calibration ids must be [nsamples, seqlen] int64, got {tuple(ids.shape)} {ids.dtype}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"ids": ids.contiguous()}, str(path))


def read_calibration(path: Path) -> Any:
    from safetensors.torch import load_file

    return load_file(str(path))["ids"]


def calibration_file(work: Path, folder: Path, proto: dict[str, Any]) -> Path:
    path = work / f"calib-{folder.name}-enwiki-{proto['nsamples']}x{proto['seqlen']}.safetensors"
    if not path.exists():
        from transformers import AutoTokenizer

        from optq.data.tokens import calibration_windows

        tok = AutoTokenizer.from_pretrained(str(folder))
        write_calibration(path, calibration_windows("enwiki", tok, proto["nsamples"], proto["seqlen"]))
    return path


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def ensure_venv(work: Path, name: str) -> tuple[Path, dict[str, Any]]:
    """WORK/venvs/NAME's python and its optq-peer.json, installed on first use."""
    venv = work / "venvs" / name
    python, marker = venv / "bin" / "python", venv / "optq-peer.json"
    packages = [TORCH_PIN, *VENVS[name]]
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("packages") == packages:
            return python, info
    start = time.perf_counter()
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", str(venv)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", *packages], capture_output=True, text=True)
    (venv / "install.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"pip install {' '.join(packages)} failed:\n{_tail(proc.stderr or proc.stdout)}")
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    info = {"packages": packages, "install_s": round(time.perf_counter() - start, 1), "freeze": freeze.split()}
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return python, info


def _env(optq_on_path: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if optq_on_path:
        env["PYTHONPATH"] = str(ROOT)
    return env


def run_child(python: Path, peer: Peer, args: list[str], log: Path, optq_on_path: bool) -> dict[str, Any]:
    """Run the peer's child script; its last ``PEER_RESULT {json}`` line, or RuntimeError.

    The child's output (stdout and stderr as they come) goes to ``log`` while it runs, so a long
    quantization can be followed there and a killed one leaves what it printed."""
    cmd = [str(python), str(CHILDREN / peer.child), "--variant", peer.variant, *args]
    with log.open("w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        # in the cell folder: GPTQModel writes logs/ into its working directory
        env = {**_env(optq_on_path), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=log.parent)
    printed = log.read_text()
    lines = [line for line in printed.splitlines() if line.startswith("PEER_RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{peer.child} exit {proc.returncode}:\n{_tail(printed)}")
    return json.loads(lines[-1].removeprefix("PEER_RESULT "))


def evaluate(model: str | Path, reference: Path | None, proto: dict[str, Any], out: Path) -> dict[str, Any]:
    """``optq eval`` (this checkout) on the protocol's corpora and windows; its JSON."""
    cmd = [sys.executable, "-m", "optq", "eval", str(model), "--data", ",".join(proto["corpora"])]
    cmd += ["--seqlen", str(proto["eval_seqlen"]), "--windows", str(proto["windows"]), "--json", str(out)]
    cmd += ["--reference", str(reference) if reference else "none", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(True))
    if proc.returncode:
        raise RuntimeError(f"optq eval exit {proc.returncode}:\n{_tail(proc.stderr or proc.stdout)}")
    return json.loads(out.read_text())


def folder_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's weight files (*.safetensors)."""
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))


def model_folder(out: Path) -> Path:
    """The folder under a child's --out that holds the checkpoint: OUT itself, or its one
    subfolder with a config.json (auto-round 0.16 writes into OUT/<model>-w<bits>g<group>/)."""
    if (out / "config.json").exists():
        return out
    inner = [d for d in out.iterdir() if (d / "config.json").exists()] if out.is_dir() else []
    if len(inner) > 1:
        names = ", ".join(sorted(d.name for d in inner))
        raise RuntimeError(f"{out} holds {len(inner)} checkpoints ({names}): which one the peer wrote is unclear")
    if not inner:
        raise RuntimeError(f"{out} holds no checkpoint (no config.json in it or in one subfolder of it)")
    return inner[0]


def run_cell(peer: Peer, args: argparse.Namespace, folder: Path, calib: Path, work: Path, proto: dict) -> dict:
    size = f"{proto['nsamples']}x{proto['seqlen']}"
    cell = work / "cells" / f"{folder.name}-{peer.name}-{args.bits}b-g{args.group_size}-{size}"
    ckpt, done = cell / "checkpoint", cell / "quantize.json"
    cell.mkdir(parents=True, exist_ok=True)
    if done.exists():  # quantized before, the evaluation failed or was interrupted
        quant = json.loads(done.read_text())
    else:
        if peer.venv is None:
            python, install = Path(sys.executable), {}
        else:
            python, install = ensure_venv(work, peer.venv)
        child_args = ["--model", str(folder), "--ids", str(calib), "--out", str(ckpt)]
        child_args += ["--bits", str(args.bits), "--group-size", str(args.group_size)]
        quant = run_child(python, peer, child_args, cell / "quantize.log", peer.venv is None)
        quant.update(bytes=folder_bytes(ckpt), install_s=install.get("install_s"))
        done.write_text(json.dumps(quant, indent=2) + "\n")
    evaluation = evaluate(model_folder(ckpt), folder, proto, cell / "eval.json")
    return {**make_row(peer.name, args.bits, args.group_size, quant, evaluation), "install_s": quant.get("install_s")}


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def by_kl(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows best first (lowest mean KL), errors last in the order they were run."""
    return sorted(rows, key=lambda r: (r.get("error") is not None or r.get("kl") is None, r.get("kl") or 0.0))


def corpus_table(results: dict[str, Any]) -> str:
    """KL by corpus, top-1 agreement in brackets, one row per peer that ran (best first)."""
    corpora = results["corpora"]
    rows = []
    for r in by_kl(results["rows"]):
        if r.get("error") or not r.get("by_corpus"):
            continue
        cells = [r["by_corpus"].get(c) for c in corpora]
        rows.append([r["peer"], *("-" if x is None else f"{x['kl']:.3f} ({x['top1']:.1%})" for x in cells)])
    return md_table(["peer", *corpora], rows)


def table(results: dict[str, Any]) -> str:
    corpora = results["corpora"]
    head = ["peer", "quantize s", "peak RSS MB", "KL", "KL p99", "top-1", *(f"ppl {c}" for c in corpora), "MB"]
    rows = []
    for r in by_kl(results["rows"]):
        if r.get("error"):
            rows.append([r["peer"], "error: " + r["error"].strip().splitlines()[0][:80], *[""] * (len(head) - 2)])
            continue
        ppl = [fmt(r["ppl"].get(c), ".3f") for c in corpora]
        mb = fmt(r["bytes"] / 1e6 if r["bytes"] else None, ".1f")
        rows.append(
            [r["peer"], fmt(r["quantize_s"], ".0f"), fmt(r["peak_rss_mb"], ".0f"), fmt(r["kl"], ".4f")]
            + [fmt(r["kl_p99"], ".3f"), fmt(r["top1"], ".1%"), *ppl, mb]
        )
    return md_table(head, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or model folder")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, default=128)
    quick = ",".join(QUICK_PEERS)
    ap.add_argument("--peers", help=f"comma-separated, of: {', '.join(PEERS)} (default: all; --quick: {quick})")
    ap.add_argument("--quick", action="store_true", help="16 x 256 calibration, 4 evaluation windows a corpus, 4 peers")
    ap.add_argument("--json", type=Path, help="default benchmarks/results/peers-MODEL-BITS[-quick].json")
    ap.add_argument("--work", type=Path, help="venvs, calibration ids and checkpoints (default OPTQ_CACHE/bench/peers)")
    ap.add_argument("--tables", action="store_true", help="print the tables of the JSON as it stands and stop")
    args = ap.parse_args(argv)
    if args.tables:
        path = args.json or default_json(args.model, args.bits, args.quick)
        results = json.loads(path.read_text())
        print(f"{table(results)}\n\nKL by corpus, in brackets top-1 agreement:\n\n{corpus_table(results)}")
        return 0
    try:
        peers = parse_peers(args.peers, args.quick)
    except ValueError as exc:
        ap.error(str(exc))
    from optq.data.corpora import cache_dir
    from optq.data.zoo import resolve_model

    work = (args.work or cache_dir() / "bench" / "peers").resolve()
    folder = Path(resolve_model(args.model)).resolve()
    proto = protocol(args.quick)
    path = args.json or default_json(args.model, args.bits, args.quick)
    header = {"model": str(args.model), "bits": args.bits, "group_size": args.group_size, **proto}
    try:
        results = load_results(path, header)
    except ValueError as exc:
        ap.error(str(exc))
    calib = calibration_file(work, folder, proto)
    if "fp" not in results:
        results["fp"] = evaluate(folder, None, proto, work / f"fp-{folder.name}-eval.json")["results"]
        save_results(path, results)
    for name in peers:
        if finished(results, name):
            print(f"{name}: done before, skipped")
            continue
        print(f"{name}: quantizing and evaluating ...", flush=True)
        try:
            row = run_cell(PEERS[name], args, folder, calib, work, proto)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is its row, the run goes on
            row = error_row(name, args.bits, args.group_size, str(exc))
        put_row(results, row)
        results["updated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        results["load_avg"] = os.getloadavg()[0]
        save_results(path, results)
        print(f"{name}: {'error: ' + row['error'][:300] if row.get('error') else 'KL ' + fmt(row['kl'], '.4f')}")
    fp = "  ".join(f"{r['corpus']} {r['perplexity']:.3f}" for r in results["fp"])
    print(f"\n{args.model} {args.bits}-bit g{args.group_size}, fp perplexity: {fp}\n")
    print(table(results))
    print(f"\n{corpus_table(results)}\n\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
