"""What a quantization method is to the pipeline, and the registry that names the methods.

A :class:`Method` says everything the run needs to know about one way of quantizing a group of
linears that share an input, so that no other module asks for a method by its name:

- the activation chains it reads: the quantized model's alone, or also the float model's
  (``float_chain``: a float copy of each block runs beside it, one more forward per block, and each
  Hessian input is paired with the float model's, which adds the cross Hessian per input);
- whether its solve reads the Hessian at all (``reads_hessian``; round-to-nearest does not);
- the solve itself (:meth:`Method.solve`, one stacked group on its Hessians);
- what it refuses, and why (:meth:`Method.check` on the run's settings, :meth:`Method.check_experts`
  on a model's experts);
- how ``--target-bits``' proxy stands in for it (:attr:`Method.proxy`, :meth:`Method.proxy_weights`,
  :meth:`Method.differs_from_proxy`);
- its terms in the dry-run plan (``float_chain`` adds a forward per block and doubles the activations,
  :meth:`Method.solve_cost`);
- its modifiers in ``optq compare`` (:meth:`Method.variant_setting`, :meth:`Method.check_variant`).

Each implementation is registered once (:func:`register`) under its name; the CLI's choices,
``RunSettings`` validation, ``compare``'s variants and the plan read :func:`names` and :func:`get`.
``RunSettings.method`` stays the name (flags and journals record it); the object is looked up here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

__all__ = ["Method", "register", "unregister", "get", "names"]


class Method:
    """One quantization method (subclass it, set the class attributes, register an instance)."""

    name: ClassVar[str]
    help: ClassVar[str]  # one clause for ``--method``'s help
    reads_hessian: ClassVar[bool] = True
    float_chain: ClassVar[bool] = False

    def check(self, settings: Any) -> None:
        """Raise ValueError, saying why and what to do instead, for run settings this method
        cannot honour (a ``RunSettings``, validated otherwise)."""

    def check_experts(self, own: Sequence[str]) -> None:
        """Raise ValueError for a model whose experts under ``own`` (module names) are the model's
        own code, which optq runs only on the tokens their router picks."""

    def solve(self, W: Any, H: Any, hessians: Any, config: Any, settings: Any) -> tuple[Any, Any]:
        """Quantize the stacked rows ``W`` of a group with ``config`` on its Hessian ``H`` (from
        ``hessians``, the group's ``LayerHessians``, which holds the other statistics) under the
        run's ``settings``: (the ``optq.core.solver.Solution``, the weight its objectives are
        measured against: ``W`` itself, or what the method fits instead)."""
        raise NotImplementedError

    @property
    def proxy(self) -> Method:
        """The method ``--target-bits``' proxy quantizes with in this method's runs (itself by
        default): one whose :meth:`proxy_weights` works on the float model's H alone."""
        return self

    def proxy_weights(self, W: Any, H: Any, config: Any, settings: Sequence[tuple[int, int]]) -> Iterator[Any]:
        """``W`` (float32, stacked rows) quantized at each (bits, group size) of ``settings`` in
        turn, on the float model's ``H`` (None: no token reached the layer): the weights."""
        raise NotImplementedError(f"method {self.name!r} has no proxy of its own")

    @property
    def proxy_text(self) -> str:
        """How the allocation's report names this method where it is the proxy."""
        return self.name

    def differs_from_proxy(self, settings: Any) -> bool:
        """Whether a run with ``settings`` quantizes otherwise than the proxy (then the best
        allocations are quantized as the run does and compared again)."""
        return True

    def solve_cost(self, K: int, R: int) -> float:
        """The plan's solve units for ``R`` stacked rows of input width ``K`` (a K x K
        factorisation and R rows swept over it)."""
        return K**3 + R * K * K if self.reads_hessian else 0

    def variant_setting(self, modifier: str) -> dict[str, Any] | None:
        """``RunSettings`` fields set by a ``compare`` modifier of this method's own (``+full``),
        or None when ``modifier`` is not one."""
        return None

    def check_variant(self, spec: str, modifiers: Sequence[str], propagate: str) -> None:
        """Raise ValueError for a ``compare`` variant whose modifiers this method cannot take."""
        if not self.reads_hessian and (
            set(modifiers) & {"act_order", "static_groups", "plain", "no_norm", "original"}
            or any(m.startswith("shrink") for m in modifiers)
        ):
            raise ValueError(
                f"{spec!r}: act-order, propagation modes and H shrinking apply to methods that read the "
                f"Hessian, which {self.name} does not"
            )

    def __repr__(self) -> str:
        return f"<method {self.name}>"


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` under its name (once: a second method with the same name is refused)."""
    if not isinstance(method, Method):
        raise TypeError(f"{method!r} is not a Method")
    if method.name in _REGISTRY:
        raise ValueError(f"a method named {method.name!r} is already registered")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove the method registered as ``name`` (for tests that register one of their own)."""
    _REGISTRY.pop(name)


def get(name: str) -> Method:
    """The method registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"method={name!r} is not one of {names()}") from None


def names() -> tuple[str, ...]:
    """The registered methods' names, in the order they were registered."""
    return tuple(_REGISTRY)
