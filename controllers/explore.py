"""On-policy collection: follow a controller, but now and then draft the full lookahead.

Why: a controller trained on data collected with a fixed long draft meets other states at run
time (short drafts, skipped rounds, what follows them). Collecting *with* the controller puts
the data on the states it meets, but then a round is labelled only up to where the controller
stopped. ``ExplorePolicy`` follows the controller and, with probability ``eps`` per round,
drafts ``lookahead`` tokens whatever it says, so every position gets labels from the states
the controller leads to. Per round it records whether it explored and, per drafted position,
whether the controller itself would have drafted it; a row's *propensity* (the chance that a
round in this state drafts it) is then ``eps + (1 - eps) * would_draft``, for weighting.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome, StopPolicy


@dataclass(frozen=True)
class RoundLog:
    """One iteration as the exploring policy saw it."""

    explored: bool
    """This round drafted the full lookahead regardless of the controller."""
    would_draft: tuple[bool, ...]
    """Per drafted position (1-based order): would the controller have drafted it."""


@dataclass
class ExplorePolicy:
    """``inner`` with probability ``1 - eps`` per round, a full ``lookahead`` draft otherwise."""

    inner: StopPolicy
    eps: float
    lookahead: int
    seed: str = "explore"
    """Seeds the per-round coin (a prompt id makes a resumed run draw the same coins)."""
    name: str = field(default="explore", init=False)
    needs_features: ClassVar[bool] = True
    rounds: list[RoundLog] = field(default_factory=list, init=False)
    """One entry per iteration, in order (``update`` closes each)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps <= 1.0:
            raise ValueError(f"eps must be in [0, 1], got {self.eps}")
        self._rng = random.Random(self.seed)
        self._new_round()

    def _new_round(self) -> None:
        self._explored, self._inner_going, self._inner_left = False, False, 0
        self._would: list[bool] = []

    def reset(self) -> None:
        self.inner.reset()
        self._rng = random.Random(self.seed)
        self.rounds = []
        self._new_round()

    def budget(self, ctx: DraftContext) -> int:
        inner = min(self.inner.budget(ctx), self.lookahead)
        self._explored = self._rng.random() < self.eps
        self._inner_going = inner > 0
        self._inner_left = inner
        return self.lookahead if self._explored else inner

    def stop(self, step: DraftStep) -> bool:
        would = self._inner_going and step.position <= self._inner_left
        self._would.append(would)
        inner_stops = self.inner.stop(step) if would else True
        self._inner_going = would and not inner_stops
        return False if self._explored else inner_stops

    def update(self, outcome: IterationOutcome) -> None:
        self.inner.update(outcome)
        self.rounds.append(RoundLog(explored=self._explored, would_draft=tuple(self._would)))
        self._new_round()
