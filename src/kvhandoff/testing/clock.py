"""`FakeClock`: a settable monotonic clock (the bootstrap registry, the transfer session)."""

from __future__ import annotations


class FakeClock:
    """A settable monotonic clock: call it for the time, `advance` to move it."""

    __slots__ = ("now",)

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Moves the clock `seconds` forward; returns the new time."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds})")
        self.now += seconds
        return self.now

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now})"
