"""Hand-written stop policies: the baselines a learned controller has to beat."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.errors import UagError


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise UagError(f"{name} must be at least 1, got {value}")


@dataclass
class StaticPolicy:
    """Always draft exactly ``k`` tokens (the classic fixed speculation lookahead)."""

    k: int = 3
    name: str = field(default="static", init=False)
    needs_features: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _positive("lookahead", self.k)
        self.name = f"static-{self.k}"

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        return self.k

    def stop(self, step: DraftStep) -> bool:
        return False

    def update(self, outcome: IterationOutcome) -> None:
        pass


@dataclass
class NoDraftPolicy:
    """Never drafts. With prompt lookup (policy ``lookup``) the copied continuations are then
    the only drafts, and a round without one is a plain target step."""

    name: str = field(default="lookup", init=False)
    needs_features: ClassVar[bool] = False

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        return 0

    def stop(self, step: DraftStep) -> bool:
        return True

    def update(self, outcome: IterationOutcome) -> None:
        pass


@dataclass
class HeuristicPolicy:
    """Transformers' ``heuristic`` schedule: +2 after a fully accepted draft, −1 otherwise, min 1."""

    start: int = 5
    name: str = field(default="heuristic", init=False)
    needs_features: ClassVar[bool] = False
    k: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        _positive("lookahead", self.start)
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def budget(self, ctx: DraftContext) -> int:
        return self.k

    def stop(self, step: DraftStep) -> bool:
        return False

    def update(self, outcome: IterationOutcome) -> None:
        if outcome.drafted == 0:
            return
        if outcome.accepted == outcome.drafted:
            self.k += 2
        else:
            self.k = max(1, self.k - 1)


@dataclass
class ConfidencePolicy:
    """Stop after a drafted token whose probability is below ``threshold`` (that token is verified).

    Same semantics as Transformers' ``assistant_confidence_threshold`` (default 0.4), with
    ``max_lookahead`` playing ``num_assistant_tokens`` (default 20).
    """

    threshold: float = 0.4
    max_lookahead: int = 20
    name: str = field(default="confidence", init=False)
    needs_features: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _positive("lookahead", self.max_lookahead)
        if not 0.0 <= self.threshold <= 1.0:
            raise UagError(f"confidence threshold must be in [0, 1], got {self.threshold}")
        self.name = f"confidence-{self.threshold:g}"

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        return self.max_lookahead

    def stop(self, step: DraftStep) -> bool:
        return step.prob < self.threshold

    def update(self, outcome: IterationOutcome) -> None:
        pass


@dataclass
class EntropyPolicy:
    """Stop after a drafted token drawn from a distribution with entropy above ``threshold`` nats.

    High entropy means the assistant was unsure; unlike the probability rule it also reacts when
    the top token is fairly likely but the rest of the mass is spread thin.
    """

    threshold: float = 1.5
    max_lookahead: int = 20
    name: str = field(default="entropy", init=False)
    needs_features: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _positive("lookahead", self.max_lookahead)
        if self.threshold <= 0:
            raise UagError(f"entropy threshold must be positive, got {self.threshold}")
        self.name = f"entropy-{self.threshold:g}"

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        return self.max_lookahead

    def stop(self, step: DraftStep) -> bool:
        return step.entropy > self.threshold

    def update(self, outcome: IterationOutcome) -> None:
        pass
