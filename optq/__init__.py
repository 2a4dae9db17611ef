"""optq: GPTQ (OPTQ) post-training weight quantization for transformer language models.

Example::

    >>> import torch, optq
    >>> W = torch.randn(64, 256)
    >>> X = torch.randn(1024, 256)
    >>> H = optq.Hessian(256)
    >>> H.update(X)
    >>> sol = optq.gptq(W, H.matrix(), optq.QuantConfig(bits=4, group_size=128))
    >>> sol.codes.max().item() <= 15
    True

Importing the package has no side effects; submodules load on first use of their names.
The layers (see docs/architecture.md): ``optq.core`` (the math), ``optq.formats`` (packing and
checkpoints), ``optq.data`` (corpora, token sets, the model zoo), ``optq.pipeline`` (whole
models), ``optq.eval`` (perplexity, comparisons) and ``optq.cli``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule that defines it (loaded lazily, so `import optq` stays cheap and
# never pulls in transformers).
_EXPORTS = {
    "QuantConfig": "core.config",
    "Hessian": "core.hessian",
    "Solution": "core.solver",
    "gptq": "core.solver",
    "rtn": "core.solver",
    "obq": "core.obq",
    "gptaq": "core.gptaq",
    "objective": "core.solver",
    "FactorizationError": "core.factor",
    "pack": "formats.packing",
    "unpack": "formats.packing",
    "QuantLinear": "formats.qlinear",
    "quantize": "pipeline.run",
    "quantize_pretrained": "pipeline.stream.quantize",
    "RunSettings": "pipeline.settings",
    "Report": "pipeline.report",
    "save": "formats.checkpoint",
    "load": "formats.checkpoint",
    "perplexity": "eval.perplexity",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'optq' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
