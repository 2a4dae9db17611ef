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
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule that defines it (loaded lazily, so `import optq` stays cheap and
# never pulls in transformers).
_EXPORTS = {
    "QuantConfig": "config",
    "Hessian": "hessian",
    "Solution": "solver",
    "gptq": "solver",
    "rtn": "solver",
    "obq": "obq",
    "objective": "solver",
    "FactorizationError": "factor",
    "pack": "packing",
    "unpack": "packing",
    "QuantLinear": "nn",
    "quantize": "pipeline",
    "Report": "pipeline",
    "save": "checkpoint",
    "load": "checkpoint",
    "perplexity": "evaluate",
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
