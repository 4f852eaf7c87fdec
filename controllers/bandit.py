"""An online bandit over the fixed arms, per prompt, with no training: the training-free
baseline a learned round plan has to beat (issue 42 item 6; BanditSpec, ICML 2025, and TapOut,
2025, choose speculative configurations the same way).

Each round after the prompt's own, UCB1 (Auer et al. 2002) picks one arm among those available:

* ``step``: a plain target step (no drafter);
* ``copy``: prompt lookup's copy (``uag.decoding.lookup``), available only in a round whose last
  target tokens occurred before;
* ``static-K`` for each K of ``lookaheads`` (default 1, 2, 4): the assistant drafts K tokens.

**Reward**: the round's emitted tokens per second of its wall time (``IterationRecord.round_s``:
the choice, the draft with its catch-up, the verify, everything). Tokens per second is what the
arms are meant to buy, and a round's own wall time is known without a latency profile.
UCB1's bound assumes rewards in [0, 1]; raw rates are some hundred tokens/s on a CPU and
thousands on a GPU, which would make the exploration term vanish beside them. So each arm's
mean rate is divided, when an arm is picked, by the largest single-round rate seen so far in
this generation: every mean is on the same scale at each decision, the best lucky round is 1,
and the exploration term ``c·sqrt(ln t / n)`` (``c`` = √2: UCB1's own) is weighed against
rates of the same order whatever the machine. (A running max taken *into* each stored reward
instead would leave early rewards on a scale later ones are not.)

**State per generation**: ``BanditPlan.begin`` starts a fresh UCB1 every generation, so nothing
learned on one prompt carries to the next.

**Outcome without a hook**: the round records itself (``session.records``) before the next
round's choice, so ``next_action`` first credits the newest record to the arm it played; the
loop needs no new call. A drafting arm's action is ``Draft(lookahead=K)``: K tokens, no early
stop.

What it cannot see: a copy or a plain step leaves the assistant behind, and the next drafting
round pays its catch-up, so that cost is charged to the drafting arm, not to the arm that caused
it. Greedy output is the target's whatever the arms (every arm is verified); under sampling
each choice depends on the past only, so the output keeps the target's distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from uag.decoding.actions import Action, Copy, Draft, Step
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import FixedDrafts, Sources
from uag.decoding.round import Session
from uag.errors import UagError

LOOKAHEADS = (1, 2, 4)
"""The static lookaheads the bandit's drafting arms use (issue 42 item 6)."""
EXPLORATION = math.sqrt(2.0)
"""UCB1's constant: the index is ``mean + sqrt(2 ln t / n)``."""


@dataclass(frozen=True)
class BanditArm:
    """One fixed way to run a round."""

    kind: Literal["step", "copy", "draft"]
    k: int = 0
    """The assistant's lookahead (``draft`` only)."""

    @property
    def name(self) -> str:
        return f"static-{self.k}" if self.kind == "draft" else self.kind


@dataclass
class Ucb1:
    """UCB1 over ``arms`` arms whose rewards are rates on an unknown scale: the means are
    divided by the largest single reward seen (see the module's docstring), so they lie in
    [0, 1] as UCB1 assumes. Arms may be unavailable in a round (``select``'s ``available``)."""

    arms: int
    exploration: float = EXPLORATION
    counts: list[int] = field(default_factory=list)
    sums: list[float] = field(default_factory=list)
    scale: float = 0.0
    """The largest single reward so far."""

    def __post_init__(self) -> None:
        if self.arms < 1:
            raise ValueError(f"a bandit needs at least one arm, got {self.arms}")
        self.counts = [0] * self.arms
        self.sums = [0.0] * self.arms

    def index(self, arm: int) -> float:
        """UCB1's index of a played arm: its scaled mean plus the exploration bonus."""
        plays = sum(self.counts)
        mean = self.sums[arm] / self.counts[arm] / self.scale if self.scale > 0 else 0.0
        return mean + self.exploration * math.sqrt(math.log(plays) / self.counts[arm])

    def select(self, available: Sequence[int]) -> int:
        """The arm to play among ``available``: the first one never played, else the highest
        index (the first of equals)."""
        if not available:
            raise ValueError("no arm is available")
        for arm in available:
            if self.counts[arm] == 0:
                return arm
        return max(available, key=self.index)

    def update(self, arm: int, reward: float) -> None:
        if not reward >= 0.0:
            raise ValueError(f"a reward is a rate >= 0, got {reward}")
        self.counts[arm] += 1
        self.sums[arm] += reward
        self.scale = max(self.scale, reward)


class BanditPlan(FixedDrafts):
    """``bandit`` in ``controllers.spec``'s grammar: UCB1 over step, copy and static-K, with the
    round's tokens per second as reward (module docstring). ``lookup``: the prompt lookup the
    copy arm copies from (its table sets the length; None: no copy arm)."""

    name = "bandit"

    def __init__(
        self,
        *,
        lookup: PromptLookup | None = None,
        lookaheads: tuple[int, ...] = LOOKAHEADS,
        exploration: float = EXPLORATION,
    ) -> None:
        if not lookaheads or min(lookaheads) < 1:
            raise UagError(f"the bandit's lookaheads must be >= 1, got {lookaheads}")
        if not exploration >= 0.0:
            raise UagError(f"the exploration constant must be >= 0, got {exploration}")
        self.lookup, self.lookaheads, self.exploration = lookup, lookaheads, exploration
        self.begin(Sources())

    def begin(self, sources: Sources) -> None:
        """A fresh bandit over the arms these sources allow."""
        self.sources = sources
        arms = [BanditArm("step")]
        if sources.lookup is not None:
            arms.append(BanditArm("copy"))
        if sources.assistant is not None:
            arms += [BanditArm("draft", k=k) for k in self.lookaheads]
        self.arms: tuple[BanditArm, ...] = tuple(arms)
        self.ucb = Ucb1(arms=len(arms), exploration=self.exploration)
        self.played: list[str] = []
        """The arm of every bandit round, by name, in order."""
        self._pending: tuple[int, int] | None = None
        """(arm, the round's index in ``session.records``) until its record is credited."""

    def credit(self, session: Session) -> None:
        """The last round's emitted tokens per second, to the arm that played it."""
        if self._pending is None:
            return
        arm, at = self._pending
        if len(session.records) <= at:
            return  # not recorded yet (the loop records every round before the next choice)
        record = session.records[at]
        self._pending = None
        if record.round_s > 0.0:
            self.ucb.update(arm, record.emitted / record.round_s)

    def next_action(self, session: Session) -> Action:
        self.credit(session)
        if not session.target.cached or session.room <= 1:
            # The prompt's pass, or a last token with no room for candidates: every arm is the
            # plain step there, and the prompt's cost would swamp whatever arm it was credited to.
            return Step()
        copied = self.sources.lookup.match(session) if self.sources.lookup is not None else []
        available = [i for i, a in enumerate(self.arms) if a.kind != "copy" or copied]
        arm = self.ucb.select(available)
        self._pending = (arm, len(session.records))
        chosen = self.arms[arm]
        self.played.append(chosen.name)
        if chosen.kind == "copy":
            return Copy(length=len(copied))
        if chosen.kind == "step":
            return Step()
        return Draft(lookahead=chosen.k)
