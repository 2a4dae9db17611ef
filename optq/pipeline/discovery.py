"""Generic model surgery: find the decoder blocks and their linear layers, select by name.

No class per architecture: blocks are found through ``_no_split_modules`` (the class names
transformers itself keeps whole on one device) or, failing that, as the longest ``nn.ModuleList``
of modules of one class; linears are ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2), whose
weight is stored transposed ([in, out]). Capturing and replaying block inputs lives in
``optq.pipeline.blocks.capture``; which modules are linears, ``optq.formats.linears``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from torch import nn

from optq.formats.experts import is_router
from optq.formats.linears import find_linears

__all__ = ["find_blocks", "select_names", "drop_routers", "expert_parts", "siblings"]

_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<leaf>.+)$")


def _module_lists(model: nn.Module) -> Iterable[tuple[str, nn.ModuleList]]:
    for name, sub in model.named_modules():
        # Experts (a ModuleList of one expert per member) are never the decoder blocks.
        if isinstance(sub, nn.ModuleList) and len(sub) > 0 and name.rsplit(".", 1)[-1] != "experts":
            yield name, sub


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: ``(name of the ModuleList, the list)``.

    First choice: a ModuleList whose members all belong to ``model._no_split_modules`` and
    contain linears (the largest such list, so a vision tower loses to the text decoder).
    Otherwise the longest ModuleList of same-class modules that contain linears.

    Raises ``ValueError`` when the model has no such list.
    """
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    candidates = []
    for name, lst in _module_lists(model):
        classes = {type(m) for m in lst}
        if len(classes) != 1 or not find_linears(lst[0]):
            continue
        preferred = type(lst[0]).__name__ in no_split
        # Most blocks first; among equals, the _no_split_modules class, then the first found.
        candidates.append((preferred, len(lst), -len(candidates), name, lst))
    if not candidates:
        n_lin = len(find_linears(model))
        raise ValueError(
            f"found no decoder blocks in {type(model).__name__}: optq needs an nn.ModuleList of "
            f"identical blocks that contain linear layers (the model has {n_lin} linear layers "
            "in total); is this a transformer language model?"
        )
    preferred = [c for c in candidates if c[0]]
    best = max(preferred or candidates, key=lambda c: (c[1], c[2]))
    return best[3], best[4]


def _matches(name: str, pattern: str) -> bool:
    # "re:" selects a regular expression (searched anywhere in the name); otherwise a shell-style
    # wildcard pattern that must match the whole name, or its last components ("*.q_proj" and
    # "q_proj" both select every q_proj).
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def select_names(
    names: Sequence[str], include: Sequence[str] | str | None = None, exclude: Sequence[str] | str | None = None
) -> list[str]:
    """Filter module names: kept if some ``include`` pattern matches (all when None) and no
    ``exclude`` pattern does. Patterns are wildcards (``*.mlp.*``, ``q_proj``) or ``re:REGEX``.

    Raises ``ValueError`` for a pattern that matches none of ``names`` (a typo would otherwise
    silently quantize everything or nothing).
    """
    include = [include] if isinstance(include, str) else list(include or [])
    exclude = [exclude] if isinstance(exclude, str) else list(exclude or [])
    for kind, patterns in (("include", include), ("exclude", exclude)):
        for p in patterns:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ValueError(f"{kind} pattern {p!r} is not a valid regular expression: {exc}") from None
            if not any(_matches(n, p) for n in names):
                example = ", ".join(list(names)[:3])
                raise ValueError(
                    f"{kind} pattern {p!r} matches none of the {len(names)} quantizable linear "
                    f"layers (names look like: {example}); use wildcards such as '*.mlp.*' or "
                    "'re:<regex>'"
                )
    kept = [n for n in names if not include or any(_matches(n, p) for p in include)]
    return [n for n in kept if not any(_matches(n, p) for p in exclude)]


def drop_routers(
    names: Sequence[str], targets: set[str], include: Sequence[str] | str | None
) -> tuple[set[str], list[str]]:
    """``targets`` without the mixture-of-experts routers, and the routers dropped.

    A router stays a target only when an ``include`` pattern is about routers: one that matches
    routers and no other linear (``*.gate`` and ``*.shared_expert_gate`` do, ``*.mlp.*`` does not).
    """
    patterns = [include] if isinstance(include, str) else list(include or [])
    forced: set[str] = set()
    for p in patterns:
        hits = select_names(names, [p])
        if hits and all(is_router(n) for n in hits):
            forced.update(hits)
    dropped = sorted(n for n in targets if is_router(n) and n not in forced)
    return targets - set(dropped), dropped


def expert_parts(name: str) -> tuple[str, int, str] | None:
    m = _EXPERT.match(name)
    return (m["module"], int(m["e"]), m["leaf"]) if m else None


def siblings(names: Iterable[str], name: str) -> list[str]:
    """The same matrix of every expert of ``name``'s experts module (``name`` included)."""
    parts = expert_parts(name)
    assert parts is not None
    return [n for n in names if (p := expert_parts(n)) and p[0] == parts[0] and p[2] == parts[2]]
