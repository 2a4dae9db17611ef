"""The ``optq`` command line: the only place that parses arguments and prints for people.

Each subcommand lives in its own module of this package and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (a callable taking the
parsed namespace and returning an exit code). Modules are discovered, so adding a subcommand
touches no other file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

__all__ = ["main", "build_parser"]


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every subcommand registered."""
    from optq import __version__

    parser = argparse.ArgumentParser(
        prog="optq", description="GPTQ post-training weight quantization for language models."
    )
    parser.add_argument("--version", action="version", version=f"optq {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``optq`` console script and ``python -m optq``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"optq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("optq: interrupted", file=sys.stderr)
        return 130
