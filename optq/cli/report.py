"""``optq report CHECKPOINT``: the checkpoint's report as one self-contained HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import CliError, check_writable


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``report`` subcommand."""
    p = sub.add_parser(
        "report",
        help="an HTML page of what quantization did (per layer, calibration, quality)",
        description="Write one self-contained HTML page (inline figures, no network) from the "
        "checkpoint's quantization_report.json, plus the comparison or evaluation JSON given with "
        "--eval, or found as compare.json / eval.json in the checkpoint folder or beside it.",
    )
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a folder written by optq")
    p.add_argument("-o", "--output", type=Path, help="the HTML file (default CHECKPOINT/report.html)")
    p.add_argument(
        "--eval",
        dest="evaluations",
        type=Path,
        action="append",
        metavar="FILE",
        help="a JSON of optq compare/demo or optq eval --json (repeatable; default: found beside)",
    )
    p.add_argument("--no-figures", action="store_true", help="tables only (no matplotlib needed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the page and print its path."""
    from optq.eval import figures
    from optq.eval.page import PageError, write_page
    from optq.formats.files import CheckpointError

    if not args.no_figures and not figures.available():
        raise CliError(
            'optq report draws its figures with matplotlib: pip install "optq[plot]" '
            "(or pass --no-figures for tables only)"
        )
    if args.output is not None:
        check_writable(args.output, "-o")
    try:
        path = write_page(args.checkpoint, args.output, args.evaluations, figures=not args.no_figures)
    except (PageError, CheckpointError) as exc:
        raise CliError(str(exc)) from None
    print(f"wrote {path}")
    return 0
