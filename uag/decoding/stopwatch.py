"""One stopwatch per round: ``with clock("verify"):`` adds the block's wall time to a phase.

Why one object: a round's time split (draft, bridge, policy, verify) is what ``uag collect``
logs and what replay prices, so every phase is timed the same way and lands in the round's
record by name, instead of pairs of ``perf_counter()`` calls threaded through the loop.
"""

from __future__ import annotations

import time
from types import TracebackType

PHASES = ("draft", "bridge", "policy", "verify")
"""The phases a round's record splits its time into (``IterationRecord.*_s``)."""


class Stopwatch:
    """Seconds per phase for one round, and the round's own wall time since it was made.

    A plain context manager (not ``contextlib``'s generator): a drafting round enters it a
    dozen times, so each use costs two clock reads and little else. Phases do not nest."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._phase = ""
        self._t0 = 0.0

    def __call__(self, phase: str) -> Stopwatch:
        self._phase = phase
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.seconds[self._phase] += time.perf_counter() - self._t0

    def elapsed(self) -> float:
        """Wall time since the round began (everything, timed phases or not)."""
        return time.perf_counter() - self.started
