"""Choose one option per unit (a layer, or layers that must share a setting) under a size budget.

Each unit has options ``(size, error)``. :func:`solve` returns the choice of least summed error
whose summed size is at most ``budget``, by the Lagrangian method: every unit moves along the
lower convex hull of its options, cheapest upgrade (error saved per bit) first; each prefix of
those moves is an exact optimum for its own total size (the choice minimising error + λ·size
for some λ). When the next move does not fit, the budget left is filled greedily with any
upgrade that fits (best error saved per bit first), so no budget that could buy an improvement
is left unused. Pure: numbers in, indices out.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["solve", "hull_path", "smallest"]

Option = tuple[float, float]  # (size, error)


def smallest(units: Sequence[Sequence[Option]]) -> list[int]:
    """Each unit's smallest option (the least error among equally small ones)."""
    return [min(range(len(opts)), key=lambda j: (opts[j][0], opts[j][1])) for opts in units]


def _hull(opts: Sequence[Option]) -> list[int]:
    """Indices of the lower convex hull of (size, error), from the smallest size on, error
    strictly falling: the options some λ ≥ 0 makes best."""
    order = sorted(range(len(opts)), key=lambda j: (opts[j][0], opts[j][1]))
    hull: list[int] = []
    for j in order:
        if hull and opts[j][1] >= opts[hull[-1]][1]:
            continue  # no better than a smaller option
        while len(hull) >= 2:
            (s1, e1), (s2, e2), (s3, e3) = opts[hull[-2]], opts[hull[-1]], opts[j]
            # hull[-1] is above the segment hull[-2] -> j: drop it
            if (e1 - e2) * (s3 - s1) <= (e1 - e3) * (s2 - s1):
                hull.pop()
            else:
                break
        hull.append(j)
    return hull


def hull_path(units: Sequence[Sequence[Option]]) -> list[list[int]]:
    """The Lagrangian choices from the smallest one, one hull move at a time (most error saved
    per bit first): each is the least-error choice of its own total size."""
    steps = []
    for u, opts in enumerate(units):
        hull = _hull(opts)
        for a, b in zip(hull, hull[1:]):
            slope = (opts[a][1] - opts[b][1]) / (opts[b][0] - opts[a][0])
            steps.append((-slope, u, len(steps), b))
    # Within a unit, slopes along a convex hull fall, so this order keeps each unit's moves in turn.
    steps.sort()
    choice = [_hull(opts)[0] for opts in units]
    path = [list(choice)]
    for _, u, _, b in steps:
        choice[u] = b
        path.append(list(choice))
    return path


def _size(units: Sequence[Sequence[Option]], choice: Sequence[int]) -> float:
    return sum(units[u][j][0] for u, j in enumerate(choice))


def solve(units: Sequence[Sequence[Option]], budget: float) -> list[int] | None:
    """Indices of the chosen option per unit (None when even the smallest choice exceeds
    ``budget``)."""
    if not units:
        return []
    first = [_hull(opts)[0] for opts in units]
    if _size(units, first) > budget:
        return None
    choice = first
    for step in hull_path(units):
        if _size(units, step) > budget:
            break
        choice = step
    choice = list(choice)
    left = budget - _size(units, choice)
    while True:
        best = None
        for u, opts in enumerate(units):
            s0, e0 = opts[choice[u]]
            for j, (s, e) in enumerate(opts):
                if e < e0 and s - s0 <= left:
                    gain = (e0 - e) / max(s - s0, 1e-12)
                    if best is None or gain > best[0]:
                        best = (gain, u, j)
        if best is None:
            return choice
        _, u, j = best
        left -= units[u][j][0] - units[u][choice[u]][0]
        choice[u] = j
