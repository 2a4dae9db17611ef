"""GPTQModel for one test, without installing it: its wheel requires a CUDA torch >= 2.14, so it
is never a dependency of optq. The pinned packages below (GPTQModel 7.7.0 and what its import
and transformers' GPTQ loader need) are fetched once with ``pip download --no-deps`` into the
optq cache and unpacked into one folder, which a subprocess gets as PYTHONPATH. PyPcre has no
wheel on PyPI: it is built with ``pip wheel --no-deps`` (a C compiler and libpcre2-8).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PINNED = [
    "gptqmodel==7.7.0",
    "optimum==2.3.0",
    "logbar==0.4.15",
    "device-smi==0.5.7",
    "tokenicer==0.0.14",
    "defuser==0.0.28",
    "threadpoolctl==3.8.0",
    "dill==0.4.1",
]
BUILT = ["pypcre==0.6.4"]  # sdist with a C extension


class Unavailable(Exception):
    """The packages could not be fetched or built here (no network, no compiler)."""


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise Unavailable(f"pip {args[0]} failed: {last[0]}")


def _unpack_sdist(archive: Path, into: Path) -> None:
    """Copy an sdist's packages and egg-info (the version metadata transformers checks)."""
    with tarfile.open(archive) as tar, tempfile.TemporaryDirectory(dir=into.parent) as scratch:
        tar.extractall(scratch, filter="data")
        (root,) = Path(scratch).iterdir()
        for entry in root.iterdir():
            if (
                entry.is_dir()
                and entry.name != "tests"
                and ((entry / "__init__.py").exists() or entry.name.endswith(".egg-info"))
            ):
                shutil.copytree(entry, into / entry.name, dirs_exist_ok=True)


def gptqmodel_path(cache: Path) -> Path:
    """The folder to put on PYTHONPATH (built once under ``cache``); raises Unavailable."""
    site = cache / "gptqmodel-7.7.0" / "site"
    if (site / ".complete").exists():
        return site
    work = site.parent / "download"
    shutil.rmtree(site, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    site.mkdir(parents=True)
    _pip("download", "--no-deps", "-d", str(work), *PINNED, cwd=work)
    _pip("wheel", "--no-deps", "-w", str(work), *BUILT, cwd=work)
    for f in sorted(work.iterdir()):
        if f.suffix == ".whl":
            with zipfile.ZipFile(f) as z:
                z.extractall(site)
        elif f.name.endswith(".tar.gz"):
            _unpack_sdist(f, site)
    missing = [m for m in ("gptqmodel", "optimum", "pcre", "logbar") if not (site / m).is_dir()]
    if missing:
        raise Unavailable(f"{missing} missing from {site} after unpacking {sorted(f.name for f in work.iterdir())}")
    (site / ".complete").write_text("\n".join(PINNED + BUILT) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return site


LOAD_SCRIPT = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
folder, ids_file, out_file = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
with torch.no_grad():
    logits = model(load_file(ids_file)["ids"]).logits
kinds = sorted({type(m).__module__ + "." + type(m).__name__ for m in model.model.layers.modules()})
save_file({"logits": logits.contiguous()}, out_file, metadata={"kinds": json.dumps(kinds)})
"""


def load_with_transformers(site: Path | None, folder: Path, ids_file: Path, out_file: Path) -> None:
    """Run ``from_pretrained`` on ``folder`` in a subprocess with ``site`` first on the path."""
    _run(site, LOAD_SCRIPT, folder, ids_file, out_file)


def _run(site: Path | None, script: str, folder: Path, ids_file: Path, out_file: Path, *extra: str) -> None:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(ids_file), str(out_file), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode:
        raise AssertionError(f"transformers + GPTQModel failed on {folder}:\n{proc.stderr[-3000:]}")


GPTQMODEL_SCRIPT = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from gptqmodel import BACKEND, GPTQModel
folder, ids_file, out_file = sys.argv[1:4]
model = GPTQModel.load(folder, device="cpu", backend=BACKEND.AUTO, dtype=torch.bfloat16).model
with torch.no_grad():
    logits = model(load_file(ids_file)["ids"]).logits.float()
layers = {
    n: [getattr(m, k, None) for k in ("bits", "group_size", "sym", "desc_act")]
    for n, m in model.named_modules()
    if type(m).__module__.startswith("gptqmodel.")
}
save_file({"logits": logits.contiguous()}, out_file, metadata={"layers": json.dumps(layers)})
"""


def load_with_gptqmodel(site: Path | None, folder: Path, ids_file: Path, out_file: Path) -> None:
    """Run GPTQModel's own loader (``GPTQModel.load``, transformers underneath; it reads
    ``dynamic``) on ``folder`` in a subprocess, in bfloat16 (its CPU kernels' dtypes)."""
    _run(site, GPTQMODEL_SCRIPT, folder, ids_file, out_file)


GENERATE_SCRIPT = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
folder, ids_file, out_file, kernels = sys.argv[1:5]
if kernels == "no-avx512":  # GPTQModel's choice on a CPU without AVX512-BF16 (most CI runners)
    import gptqmodel.utils.cpu_features as cpu

    cpu.has_avx512_bf16 = lambda: False
ids = load_file(ids_file)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu")
with torch.no_grad():
    logits = model(ids["sequence"]).logits.float()
    out = model.generate(ids["prompt"], max_new_tokens=int(ids["new_tokens"]), do_sample=False)
kinds = sorted({type(m).__module__ + "." + type(m).__name__ for m in model.model.layers.modules()})
tensors = {"logits": logits.contiguous(), "generated": out.contiguous()}
save_file(tensors, out_file, metadata={"kinds": json.dumps(kinds)})
"""


def generate_with_transformers(
    site: Path | None, folder: Path, ids_file: Path, out_file: Path, kernels: str = "auto"
) -> None:
    """In a subprocess with ``site`` first on the path: ``from_pretrained`` on ``folder`` (fp32),
    the logits of ``ids_file``'s ``sequence`` and a greedy ``generate`` of ``new_tokens`` (a 0-d
    tensor) tokens after its ``prompt``, saved to ``out_file`` (``logits``, ``generated``; the
    metadata's ``kinds``: the module classes in the blocks). ``kernels``: "auto" (GPTQModel picks
    for this CPU) or "no-avx512" (GPTQModel told this CPU lacks AVX512-BF16)."""
    _run(site, GENERATE_SCRIPT, folder, ids_file, out_file, kernels)
