"""Quantization methods as objects: the protocol and registry (``base``) and one module per
method, each registering itself once (``rtn``, ``gptq``, ``gptaq``). A new method is one new
module: subclass :class:`Method`, :func:`register` an instance, import the module here."""

from optq.pipeline.methods.base import Method, get, names, register, unregister
from optq.pipeline.methods.gptaq import GPTAQ
from optq.pipeline.methods.gptq import GPTQ
from optq.pipeline.methods.rtn import ROUNDING

__all__ = ["Method", "get", "names", "register", "unregister", "ROUNDING", "GPTQ", "GPTAQ"]
