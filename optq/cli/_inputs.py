"""What ``optq quantize`` reads and writes, checked before any work: the model folder (a
folder, a built-in name, a .gguf file, a hub id), its transformers config, the calibration
tokens, and an output folder that can be created. Each failure is one CliError line."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
from pathlib import Path
from typing import Any

from . import CliError, check_writable


def _model_folder(name: str) -> Path:
    from optq.data.zoo import known_models
    from optq.pipeline.stream.quantize import local_folder

    try:
        return local_folder(name)
    except (OSError, ValueError, RuntimeError) as exc:
        why = " ".join(str(exc).split())
        if name in known_models() or Path(name).expanduser().exists():
            raise CliError(why) from None  # the zoo's or the folder's own message says what to do
        # Neither a folder, a file nor a built-in name: most likely a typo, so the names come
        # first; the hub's (network) error is the last guess, in short.
        close = difflib.get_close_matches(name, known_models(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        logging.getLogger("optq.cli").debug("%s as a hub id: %s", name, why)  # shown with -v
        found = re.search(r"[A-Za-z]+Error\b", why)
        hub = found[0] if found else why[:120]
        raise CliError(
            f"unknown model {name!r}: not a model folder, a .gguf file or a built-in name "
            f"({', '.join(known_models())}){hint}; as a hub id it could not be fetched ({hub}; -v shows why)"
        ) from None


def _hf_config(folder: Path) -> Any:
    """The model's transformers config; a malformed field is one line naming it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CliError(f"{folder / 'config.json'}: {' '.join(str(exc).split())}") from None
    except Exception as exc:  # huggingface_hub's strict dataclass errors derive from Exception only
        if type(exc).__module__.startswith(("huggingface_hub", "transformers")):
            raise CliError(f"{folder / 'config.json'}: {' '.join(str(exc).split())}") from None
        raise


def _calibration_tokens(spec: str, folder: Path, args: argparse.Namespace) -> Any:
    """One source: its token stream (the pipeline draws the windows). Several, comma-separated:
    the windows, shared equally between them (``optq.data.tokens.mixed_calibration``).

    Tokenised in a child process (``calibration_in_subprocess``): the tokenizer, its imports and
    the heap that tokenising the text leaves (0.3 GB for SmolLM2 on enwiki,
    ``benchmarks/scale_memory.py``) never join the process that then holds the model's blocks."""
    from optq.data.tokens import calibration_in_subprocess

    try:
        return calibration_in_subprocess(folder, spec, args.nsamples, args.seqlen, args.seed)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CliError(f"cannot read calibration data {spec!r}: {exc}") from None


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an output folder that could not be written at the end of the run:
    a file, an existing folder without ``overwrite``, or a place where no folder can be created
    (``check_writable``)."""
    if (out.exists() or out.is_symlink()) and out.is_dir() and not overwrite:
        raise CliError(f"output folder {out} exists; pass --overwrite to replace it")
    check_writable(out, "-o", folder=True)
