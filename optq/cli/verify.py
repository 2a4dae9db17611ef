"""``optq verify CHECKPOINT``: does each engine still compute what optq recorded when it wrote it?

Exit status: 0 when every engine that ran agrees with ``optq_probes.json`` (skipped engines do
not count), 1 when an engine fails to load or decode, or disagrees beyond its tolerance (the
table names the engine and the prompt), 2 for usage errors: no such folder, no config.json, no
``optq_probes.json`` (nothing to compare), an unreadable probes file, an unknown engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import CliError, check_writable


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``verify`` subcommand."""
    from optq.eval.verify import DEFAULT_ENGINES, ENGINES

    p = subparsers.add_parser(
        "verify",
        help="check that engines reproduce the outputs recorded in a checkpoint",
        description="Decode the prompts recorded in CHECKPOINT/optq_probes.json (written by optq "
        "quantize and optq.save with a tokenizer) on each engine and compare with the record: greedy "
        "tokens equal up to the first near-tie, log-probability differences within the engine's "
        "tolerance. Engines that are not installed are skipped with the command that installs them. "
        "Exit status 0: all engines that ran agree; 1: one failed or disagrees; 2: usage error.",
    )
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a folder written by optq quantize / optq.save")
    p.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated, from {', '.join(ENGINES)} (default: all)",
    )
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=None,
        help="the Python interpreter of a vLLM install (default: $OPTQ_VLLM_PYTHON, else ./.venv-vllm/bin/python)",
    )
    p.add_argument("--json", type=Path, metavar="F", default=None, help="also write the results as JSON to F")
    p.set_defaults(func=run)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list) -> list[str]:
    """The results as lines: one row per engine, then what disagreed, failed or was skipped."""
    from optq.eval.verify import ENGINES

    head = ("engine", "result", "prompts", "steps", "max |dlogp|", "mean |dlogp|", "tie/logp tol", "tok/s", "load s")
    rows = [head]
    for r in results:
        e = ENGINES[r.engine]
        agree = sum(p.ok for p in r.prompts)
        ties = sum(p.tie_at is not None for p in r.prompts)
        prompts = f"{agree}/{len(r.prompts)}" + (f" ({ties} tie)" if ties else "") if r.prompts else "-"
        steps = str(sum(p.steps for p in r.prompts)) if r.prompts else "-"
        rows.append(
            (
                r.engine,
                r.status,
                prompts,
                steps,
                _fmt(r.max_diff, ".2g"),
                _fmt(r.mean_diff, ".2g"),
                f"{e.tie:g}/{e.logprob:g}",
                _fmt(r.tokens_per_s, ".1f"),
                _fmt(r.load_s, ".1f"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for r in results:
        if r.kernel:
            lines.append(f"{r.engine}: kernel: {r.kernel}")
        if r.status in ("skipped", "failed"):
            lines.append(f"{r.engine}: {'failed to load or decode' if r.status == 'failed' else 'skipped'}: {r.detail}")
        for p in r.prompts:
            text = f" {p.text!r}" if p.text is not None else ""
            if not p.ok:
                lines.append(f"{r.engine}: DISAGREES on prompt {p.index}{text}: {p.mismatch}")
            elif p.tie_at is not None:
                lines.append(f"{r.engine}: prompt {p.index}{text}: took the other token at near-tie step {p.tie_at}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Verify; print the table (rank 0); return 0, or 1 when an engine failed or disagrees."""
    from optq.eval.verify import ENGINES, verify
    from optq.formats.atomic import atomic_write
    from optq.formats.probes import PROBES_FILE, read

    folder: Path = args.checkpoint
    if not folder.is_dir():
        raise CliError(f"{folder}: no such folder" if not folder.exists() else f"{folder}: is a file, not a folder")
    if not (folder / "config.json").is_file():
        raise CliError(
            f"{folder}/config.json: not found; give a checkpoint folder written by optq quantize / optq.save"
        )
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise CliError(
            f"--engines {args.engines!r}: {unknown[0] if unknown else 'none'} is not an engine; "
            f"choose from {', '.join(ENGINES)}"
        )
    if args.json is not None:
        check_writable(args.json, "--json")
    probes = read(folder)  # ValueError naming the file when it is damaged: exit 2
    if probes is None:
        raise CliError(
            f"{folder}/{PROBES_FILE}: not found, so there is nothing to compare; optq quantize writes it, and "
            "optq.save(..., tokenizer=tok) (checkpoints written before optq recorded probes have none)"
        )
    results = verify(folder, probes, engines, vllm_python=args.vllm_python)
    failed = [r for r in results if r.status in ("failed", "disagree")]
    made = probes.get("produced_by") or {}
    print(
        f"{folder}: {len(probes['prompts'])} recorded prompts x {probes['new_tokens']} tokens, top "
        f"{probes['top_k']} log-probabilities, by optq {made.get('optq', '?')} ({made.get('path', '?')})"
    )
    for line in table(results):
        print(line)
    ran = [r for r in results if r.status != "skipped"]
    if failed:
        print(f"FAILED: {', '.join(r.engine for r in failed)}")
    elif ran:
        print(f"OK: {', '.join(r.engine for r in ran)} agree with the record")
    else:
        print("nothing was compared: every engine was skipped")
    if args.json is not None:
        doc = {"checkpoint": str(folder), "produced_by": made, "ok": not failed}
        doc["engines"] = [r.to_dict() for r in results]
        atomic_write(args.json, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 1 if failed else 0
