"""One stopwatch per round: ``with clock("verify"):`` adds the block's wall time to a phase.

Why one object: a round's time split (draft, bridge, policy, verify) is what ``uag collect``
logs and what replay prices, so every phase is timed the same way and lands in the round's
record by name, instead of pairs of ``perf_counter()`` calls threaded through the loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("draft", "bridge", "policy", "verify")
"""The phases a round's record splits its time into (``IterationRecord.*_s``)."""


class Stopwatch:
    """Seconds per phase for one round, and the round's own wall time since it was made."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def elapsed(self) -> float:
        """Wall time since the round began (everything, timed phases or not)."""
        return time.perf_counter() - self.started
