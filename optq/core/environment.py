"""Every environment variable optq reads, and the one module that reads them.

Each variable is declared once in ``VARIABLES`` (its name, its default and what it does) and read
through :func:`get` when it is needed, never at import (a test or a launcher may set it later).
``docs/environment.md`` lists them all; ``tests/core/test_environment.py`` checks that no other
module of optq touches ``os.environ`` and that the page names every variable declared here.

Variables that torch.distributed reads itself (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...)
are torch's: optq never reads them, and the page only points at them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Variable", "VARIABLES", "get", "child_environment", "foreign_environment"]


@dataclass(frozen=True)
class Variable:
    """One environment variable optq reads: ``default`` is what an unset or empty one means."""

    name: str
    default: str
    meaning: str


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "OPTQ_CACHE",
            "$XDG_CACHE_HOME/optq, else ~/.cache/optq",
            "the cache folder: corpora, downloaded wheels, converted models",
        ),
        Variable("XDG_CACHE_HOME", "~/.cache", "the cache folder's parent when OPTQ_CACHE is unset (as optq/)"),
        Variable(
            "WORLD_SIZE", "1", "above 1, `optq quantize` joins a torch.distributed process group (set by torchrun)"
        ),
        Variable("LOCAL_RANK", "0", "this rank's GPU in a distributed CUDA run (cuda:LOCAL_RANK; set by torchrun)"),
        Variable("OPTQ_DIST_TIMEOUT", "600", "seconds: the process group's own timeout, the last resort"),
        Variable(
            "OPTQ_DIST_PEER_TIMEOUT", "60", "seconds without a peer's heartbeat after which every rank stops, naming it"
        ),
        Variable(
            "OPTQ_VLLM_PYTHON",
            ".venv-vllm/bin/python under the current folder, if it exists",
            "vLLM's interpreter (its own virtualenv: `optq install-vllm`), for the vLLM tests and checks",
        ),
        Variable(
            "PIP_FIND_LINKS",
            "(unset)",
            "pip's find-links, passed on to uv by `optq install-vllm` (uv reads no pip setting)",
        ),
        Variable(
            "PYTHONPATH",
            "(unset)",
            "passed on to the child that tokenises the calibration text, this optq's folder first",
        ),
    )
}


def get(name: str) -> str | None:
    """The value of the declared variable ``name`` now, or None when it is unset or empty.

    A name not in ``VARIABLES`` is a KeyError: every variable optq reads is declared."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in optq.core.environment.VARIABLES")
    return os.environ.get(name) or None


def child_environment(first_path: str) -> dict[str, str]:
    """This process's environment for a child Python, with ``first_path`` at the front of its
    ``PYTHONPATH`` (so the child imports the same optq)."""
    path = os.pathsep.join(filter(None, [first_path, get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def foreign_environment(**extra: str) -> dict[str, str]:
    """This process's environment for another project's interpreter (vLLM's virtualenv): without
    ``PYTHONPATH``, which names this interpreter's packages, and with ``extra`` set."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **extra}
