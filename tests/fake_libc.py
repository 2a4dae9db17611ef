"""A stand-in for glibc that records the malloc calls optq makes instead of making them (the
process-state tests patch ``optq.core.memory._libc`` to return one)."""

from __future__ import annotations


class FakeLibc:
    """Records glibc's malloc calls instead of making them."""

    def __init__(self):
        self.calls: list[tuple] = []

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1
