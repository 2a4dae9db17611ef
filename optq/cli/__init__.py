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
import os
import pkgutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "CliError", "check_text_source", "check_writable"]


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every subcommand registered."""
    from optq import __version__

    parser = argparse.ArgumentParser(
        prog="optq", description="GPTQ post-training weight quantization for language models."
    )
    parser.add_argument("--version", action="version", version=f"optq {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output; tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    for command in sub.choices.values():
        # -v also after the subcommand (optq quantize ... -v); SUPPRESS: unless given there,
        # the subcommand leaves the value parsed before it alone.
        if not {"-v", "--verbose"} & set(command._option_string_actions):
            command.add_argument(
                "-v",
                "--verbose",
                action="count",
                default=argparse.SUPPRESS,
                help="more log output; tracebacks of errors",
            )
    return parser


def check_text_source(source: str) -> None:
    """Refuse, before any work, a --calib/--data value that is neither a corpus, a file nor hf:."""
    from optq.data.corpora import is_corpus_name, known_corpora

    path = Path(source).expanduser()
    if path.is_file() and path.stat().st_size == 0:
        raise CliError(f"{source} is empty (0 bytes): there is no text in it; give a file with text")
    if source.startswith("hf:") or is_corpus_name(source) or path.is_file():
        return
    raise CliError(
        f"{source!r} is not a known corpus or a file; known corpora: "
        f"{', '.join(known_corpora())}; or give a .txt or .jsonl file, or hf:DATASET[:CONFIG]"
    )


def check_writable(path: Path, flag: str, *, folder: bool = False) -> None:
    """Refuse, before any work, an output ``path`` (a file, or with ``folder`` a folder) that
    could not be written at the end: its nearest existing ancestor must be a folder where a
    folder can be created (probed by creating and removing an empty one)."""
    path = path.expanduser()
    what = "folder" if folder else "file"
    if (path.exists() or path.is_symlink()) and path.is_dir() != folder:  # a dangling link too
        raise CliError(f"{flag} {path}: is a {'file' if folder else 'folder'}, not a {what}; choose another {flag}")
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: cannot be created, {parent} is a file, not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=parent)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise CliError(f"{flag} {path}: cannot write the {what}, nothing can be created in {parent} ({why})") from None
    os.rmdir(probe)


def _user_error_types() -> tuple[type[BaseException], ...]:
    # Errors that describe bad input or a bad environment, never a bug in optq: our own error
    # classes (CheckpointError, CorpusError, FactorizationError are ValueErrors) and the
    # ValueErrors/OSErrors of the libraries we call. Imported here, after the fact: the error's
    # module is already loaded, and a command that fails early need not import the zoo.
    types: list[type[BaseException]] = [CliError, ValueError, OSError]
    try:
        from optq.data.zoo import ModelNotInstalledError

        types.append(ModelNotInstalledError)
    except ImportError:  # pragma: no cover - a broken install; the error is still shown
        pass
    ranks = sys.modules.get("optq.pipeline.distributed.ranks")  # loaded if a process group ran
    if ranks is not None:  # another rank failed, stopped answering, or was started differently
        types.append(ranks.DistributedError)
    return tuple(types)


def _message(exc: BaseException) -> str:
    """One line saying what went wrong, for ``optq: error: ...``."""
    if isinstance(exc, OSError) and exc.strerror:
        # "[Errno 28] No space left on device: 'out/x'" -> "out/x: No space left on device"
        where = f"{exc.filename}: " if exc.filename is not None else ""
        text = f"{where}{exc.strerror}"
    elif isinstance(exc, KeyError) or not str(exc):
        text = f"{type(exc).__name__}: {exc}"
    else:
        text = str(exc)
    return " ".join(text.split())  # one line, whatever the library put in its message


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``optq`` console script and ``python -m optq``.

    Returns the exit status: 0 on success, 2 for any error (a bad flag, a missing model, corpus
    or file, a corrupt checkpoint, a full disk, a permission denied, ...), 130 on Ctrl-C. Errors
    are printed as one ``optq: error:`` line, with the traceback under ``-v``; anything else is a
    bug and keeps its traceback.
    """
    try:
        # Building the parser imports every subcommand (torch among them: about a second), so a
        # Ctrl-C can come before the command runs: it ends as cleanly as one during the command.
        # A library's import may catch the KeyboardInterrupt (a bare ``except:`` around an
        # optional import) and carry on: the Ctrl-C is also recorded, and counts all the same.
        # Only over Python's own handler: a process started with SIGINT ignored (``nohup ... &``)
        # or with a handler of its caller's keeps it.
        seen: list[int] = []

        def on_sigint(signum: int, frame: object) -> None:
            seen.append(signum)
            raise KeyboardInterrupt

        ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        previous = _set_sigint(on_sigint) if ours else None
        try:
            parser = build_parser()
        finally:
            _set_sigint(previous)
        if seen:
            raise KeyboardInterrupt
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or argparse's own usage error (printed)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        return _run(parser, args)
    except KeyboardInterrupt:
        print("optq: interrupted", file=sys.stderr)
        return 130


def _set_sigint(handler: Any) -> Any:
    """Install a SIGINT handler, returning the previous one (None, and nothing done, off the main
    thread, where Python cannot set handlers, or when the previous one was not set from Python)."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        return None


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    verbose = getattr(args, "verbose", 0) or 0
    # Other libraries' INFO lines (matplotlib's font cache, ...) stay quiet: only optq's own
    # logger speaks at INFO, or DEBUG with -v.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("optq").setLevel(logging.DEBUG if verbose else logging.INFO)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (`optq inspect out | head`): what it wanted was printed. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if not isinstance(exc, _user_error_types()):
            raise  # a bug: the traceback is what a report needs
        if verbose:
            traceback.print_exc()
        print(f"optq: error: {_message(exc)}", file=sys.stderr)
        return 2
