"""Drafting decisions by expected tokens per second: the learned controller's ``cost`` rule.

Why not one probability threshold: what a drafted token is worth depends on what it costs, and
the costs are not linear (on a CPU the first candidate of a verify costs several times what each
later one does; on a GPU a verify costs about the same for 1-8 candidates) and differ by machine.
This rule reads the prices from the latency profile the controller carries and decides by them:

* the controller estimates ``S_j``, the probability that the first ``j`` drafted tokens are all
  accepted (its score after the j-th token; made non-increasing in j), and before a round the
  gate estimates ``S_1``;
* drafting ``h`` more tokens and verifying them is worth ``ΔE(h) = Σ_{i=1..h} S_j · ρ^i``
  expected tokens (the hazard ``ρ = S_j / S_{j-1}`` held constant ahead) and costs
  ``ΔT(h) = h · draft + verify(c + h · r) − verify(c)`` seconds (``c`` target candidates so
  far, ``r`` per drafted token);
* keep drafting while some ``h`` gives ``ΔE(h) > R · ΔT(h)``, where ``R`` is the rate (tokens per
  second) the policy itself achieves: Dinkelbach's rule for maximising a ratio, here tokens per
  second over a whole generation. ``R`` is the rate of the target alone times a factor κ that
  training finds by iterating replay to its fixed point (``training.replay.rate_fixed_point``).

Skipping a round is the budget-0 case: the gate's ``S_1`` against the cost of a first draft,
which also feeds the assistant the text it lags by: the profile's ``catchup_s`` at the lag it
was measured at, plus ``feed_row_s`` for each token beyond (``DraftContext.lag``; after copied
rounds the assistant must be fed all the text it skipped).
The same function decides at run time and in replay, so replay predicts what the loop does.

With prompt lookup (``POLICY+lookup``) some rounds verify copied text instead, and they are
much cheaper per token (on the default pair and CPU ~4.5 ms against ~13 ms). A token the
assistant's draft wins is then worth less: the text it covers might have been copied a round
later. So ``R`` mixes in those rounds (``rate_with_copies``): the rounds the policy decides are
taken at κ × the target-alone rate, as trained, the copied ones at their priced cost. Without
copies ``R`` is exactly κ's, so nothing changes for a run without lookup. The gate then weighs
skipping even for a controller exported without one (``LearnedPolicy.budget``). Measured on 30
held-out prompts: learned+lookup 2.04x target-only before (drafting in almost every round
lookup left, the rounds right after copies at 15.5 ms per token against a plain step's 13.3),
2.19x after, lookup alone 2.23x.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COPY_PRIOR_TOKENS = 16
"""``rate_with_copies``: tokens at κ's rate assumed before any, so the first copies move R
gradually."""


@dataclass(frozen=True)
class CostRule:
    """Prices and the rate that turn acceptance estimates into draft/stop decisions."""

    draft_s: float
    """One assistant step."""
    verify_s: tuple[float, ...]
    """Target pass over the pending token and ``m`` candidates, m = 0, 1, ... (seconds)."""
    rate_factor: float
    """κ: the decisions assume the policy runs at κ × the target-alone rate."""
    max_lookahead: int
    logit_shift: float = 0.0
    """Subtracted from the classifier's logit to undo its training's class weighting (a
    positive weight ``w`` multiplies the odds it learns by ``w``), so scores are probabilities."""
    step_s: float | None = None
    """The target-alone step the rate is relative to (None: ``verify_s[0]``)."""
    catchup_s: float = 0.0
    """Extra cost of a round's first draft step (it feeds the text the assistant lags by)."""
    round_s: float = 0.0
    """The loop's time per round outside draft steps and verify (prices a copied round)."""
    catchup_lag: float = 0.0
    """The lag ``catchup_s`` was measured at (``LatencyProfile.catchup_lag``)."""
    feed_row_s: float = 0.0
    """Each token of lag beyond ``catchup_lag`` (``LatencyProfile.feed_row_s``)."""
    stats_s: float = 0.0
    """The part of ``verify_s`` a copied round does not pay (the target's statistics)."""

    @classmethod
    def from_profile(
        cls,
        profile: Mapping[str, Any],
        *,
        rate_factor: float,
        max_lookahead: int,
        logit_shift: float = 0.0,
    ) -> CostRule:
        """The rule priced by a latency profile in its dictionary form (``LatencyProfile``'s
        ``to_dict``, as collected data and exported controllers carry it)."""
        step = profile.get("step_s")
        return cls(
            draft_s=float(profile["draft_s"]),
            verify_s=tuple(float(v) for v in profile["verify_s"]),
            rate_factor=rate_factor,
            max_lookahead=max_lookahead,
            logit_shift=logit_shift,
            step_s=None if step is None else float(step),
            catchup_s=float(profile.get("catchup_s", 0.0)),
            round_s=float(profile.get("round_s", 0.0)),
            catchup_lag=float(profile.get("catchup_lag", 0.0)),
            feed_row_s=float(profile.get("feed_row_s", 0.0)),
            stats_s=float(profile.get("stats_s", 0.0)),
        )

    def __post_init__(self) -> None:
        if not self.verify_s or self.draft_s < 0 or min(self.verify_s) <= 0:
            raise ValueError("a cost rule needs a latency profile with positive verify costs")
        if not self.rate_factor > 0:
            raise ValueError(f"rate factor must be positive, got {self.rate_factor}")

    @property
    def rate(self) -> float:
        """R, tokens per second the decisions price time at."""
        return self.rate_factor / (self.step_s if self.step_s is not None else self.verify_s[0])

    def rate_with_copies(
        self, *, generated: int, copies: int, copied: int, copy_emitted: int
    ) -> float:
        """R for a generation in which ``copies`` rounds verified ``copied`` candidates from
        prompt lookup and emitted ``copy_emitted`` of its ``generated`` tokens: every token over
        the time it is priced at, the others' at κ × the target-alone rate (plus
        ``COPY_PRIOR_TOKENS`` more of those, so one early copy does not swing it). Copied rounds
        are priced at their mean candidate count (the verify cost is near linear in it), without
        the target's statistics (the loop reads them only for rounds that ask the policy)."""
        if copies <= 0:
            return self.rate
        own = COPY_PRIOR_TOKENS + max(generated - copy_emitted, 0)
        copy_s = copies * (self.round_s + self.verify(copied / copies) - self.stats_s)
        return (own + copy_emitted) / (own / self.rate + copy_s)

    def catchup(self, lag: int | None) -> float:
        """A round's first draft step beyond ``draft_s`` when it feeds ``lag`` tokens."""
        extra = 0.0 if lag is None else max(lag - self.catchup_lag, 0.0) * self.feed_row_s
        return self.catchup_s + extra

    def verify(self, candidates: float) -> float:
        """Verify cost at a possibly fractional candidate count: linear between the measured
        counts, extrapolated with the last step beyond them."""
        table = self.verify_s
        if candidates <= 0:
            return table[0]
        low = min(int(candidates), len(table) - 1)
        slope = (
            table[low + 1] - table[low]
            if low + 1 < len(table)
            else (max(table[-1] - table[-2], 0.0) if len(table) > 1 else 0.0)
        )
        return table[low] + (candidates - low) * slope

    def probability(self, score: float) -> float:
        """The classifier's score with the class weighting undone."""
        if self.logit_shift == 0.0:
            return score
        p = min(max(score, 1e-7), 1 - 1e-7)
        return 1.0 / (1.0 + math.exp(-(math.log(p / (1 - p)) - self.logit_shift)))

    def worth_drafting(
        self,
        *,
        survival: float,
        hazard: float,
        drafted: int,
        candidates: float,
        rate: float | None = None,
        lag: int | None = None,
    ) -> bool:
        """After ``drafted`` tokens (all accepted with probability ``survival``, which the
        draft's text made ``candidates`` target tokens): is drafting more worth its cost?
        ``rate``: R (tokens per second) if not ``self.rate`` (``rate_with_copies``); ``lag``:
        the tokens a first draft step feeds (``DraftContext.lag``; None: the typical case)."""
        rate = self.rate if rate is None else rate
        per_draft = candidates / drafted if drafted else 1.0
        gain, s = 0.0, survival
        base = self.verify(candidates) - (self.catchup(lag) if drafted == 0 else 0.0)
        for h in range(1, self.max_lookahead - drafted + 1):
            s *= hazard
            gain += s
            cost = h * self.draft_s + self.verify(candidates + h * per_draft) - base
            if gain > rate * cost:
                return True
        return False


@dataclass
class CostState:
    """One round's running survival estimate, as the loop feeds it drafted tokens."""

    rule: CostRule
    survival: float = 1.0
    rate: float | None = None
    """This round's R (None: the rule's own)."""

    def start(
        self, gate_score: float | None, *, rate: float | None = None, lag: int | None = None
    ) -> bool:
        """A new round: draft at all? (``gate_score`` None: no gate, always draft.) ``rate``:
        the round's R if not the rule's (``CostRule.rate_with_copies``); ``lag``: the tokens
        the first draft step feeds (None: the typical case)."""
        self.survival, self.rate = 1.0, rate
        if gate_score is None:
            return True
        first = self.rule.probability(gate_score)
        return self.rule.worth_drafting(
            survival=1.0, hazard=first, drafted=0, candidates=0.0, rate=rate, lag=lag
        )

    def keep_going(self, *, score: float, position: int, candidates: float) -> bool:
        """After the ``position``-th drafted token: draft another one?"""
        estimate = min(self.rule.probability(score), self.survival)
        hazard = estimate / self.survival if self.survival > 0 else 0.0
        self.survival = estimate
        return self.rule.worth_drafting(
            survival=estimate,
            hazard=hazard,
            drafted=position,
            candidates=candidates,
            rate=self.rate,
        )
