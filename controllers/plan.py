"""A round's plan by expected tokens per second: price each action, pick the best.

Why: the fixed rule copies whenever prompt lookup matches and lets the assistant draft
otherwise; what a round should verify depends on what each choice would yield *and* cost on
this machine (a copy of 11 is cheap where a verify row is, an assistant draft where its step
is). Each action ``a`` (``uag.decoding.actions``) has an expected yield ``E_a`` (target tokens
the round emits) and a price ``T_a`` (seconds, from the latency profile: the verify over its
rows, the assistant's steps, its catch-up on the text it lags by, the round's bookkeeping).
Maximising tokens per second over a whole generation is a ratio; Dinkelbach's rule turns it
into one choice per round: take ``argmax_a E_a − R · T_a`` where ``R`` is the rate the plan
achieves (tokens per second). A plain step is always among the actions, so the rule never
chooses something it expects to be slower than the target's own step at that rate.

``OraclePlan`` knows every ``E_a`` exactly (counterfactual labels from the recorded target
run, ``uag.harness.counterfactual``): the ceiling a learned plan is judged against, printed
by ``uag bench`` as the ``oracle`` arm. ``LearnedPlan`` (``controllers.learned_plan``)
estimates ``E_a`` from features known at the round's start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from uag.decoding.actions import ActionSet, Copy, Draft
from uag.decoding.plan_features import PLAN_FEATURE_NAMES
from uag.decoding.profile import LatencyProfile

_MATCH = PLAN_FEATURE_NAMES.index("match_tokens")
_LAG = PLAN_FEATURE_NAMES.index("lag")
_RATIO = PLAN_FEATURE_NAMES.index("draft_ratio")
_ROOM = PLAN_FEATURE_NAMES.index("room")


def action_price(
    profile: LatencyProfile,
    *,
    candidates: int,
    draft_steps: int,
    lag: int,
) -> float:
    """Seconds one round costs: bookkeeping, the verify over ``candidates``, and, when the
    assistant drafts, its ``draft_steps`` forwards and the catch-up on ``lag`` tokens. A plan
    reads no target statistics, so the verify is priced without them (``stats_s``)."""
    return profile.round_cost(drafted=draft_steps, candidates=candidates, lag=lag) - profile.stats_s


class ActionPrices:
    """Each action's price at a round start for one action set and profile (``row_prices``).

    Why a class: the run-time plan prices every round; the copies' and the step's prices do
    not change within a run and a draft's differ only by the catch-up and the candidates per
    drafted token, so they are computed once here and each round is a few additions (the
    per-action loop through ``LatencyProfile`` cost ~50 µs a round in the decode loop)."""

    def __init__(self, actions: ActionSet, profile: LatencyProfile) -> None:
        self.step = action_price(profile, candidates=0, draft_steps=0, lag=0)
        self.copies = [
            (i, a.length, action_price(profile, candidates=a.length, draft_steps=0, lag=0))
            for i, a in enumerate(actions)
            if isinstance(a, Copy)
        ]
        self.drafts = [
            (i, a.lookahead)
            for i, a in enumerate(actions)
            if isinstance(a, Draft) and a.lookahead is not None
        ]
        self.steps = [i for i, a in enumerate(actions) if not isinstance(a, Copy | Draft)]
        self.profile = profile
        self.width = len(actions)

    def for_row(self, row: np.ndarray, *, drafts: bool = True) -> list[float]:
        """The prices at the round start ``row`` (``row_prices``'s rule)."""
        match = int(row[_MATCH])
        out = [np.inf] * self.width
        for i in self.steps:
            out[i] = self.step
        for i, length, price in self.copies:
            if length <= match:
                out[i] = price
        if drafts and self.drafts:
            profile = self.profile
            lag = int(round(math.expm1(float(row[_LAG]))))
            ratio = float(row[_RATIO])
            base = profile.round_s + profile.catchup(lag)  # action_price's sums, in its order
            for i, k in self.drafts:
                candidates = max(int(round(k * ratio)), 1)
                out[i] = base + k * profile.draft_s + profile.verify(candidates) - profile.stats_s
        return out


def row_prices(
    row: np.ndarray, *, actions: ActionSet, profile: LatencyProfile, drafts: bool = True
) -> np.ndarray:
    """Each action's price at a round start, from its plan feature row alone (so run time and
    training's evaluation price alike); ``inf`` for an action the round cannot run (a copy
    longer than the match, a draft without the assistant). A draft of ``k`` is priced at ``k``
    assistant steps, ``k`` × the sequence's candidates per drafted token so far, and the
    catch-up on the tokens the assistant lags by."""
    return np.asarray(ActionPrices(actions, profile).for_row(row, drafts=drafts), dtype=np.float64)


def plan_choice(
    expected: Sequence[float] | np.ndarray,
    row: np.ndarray,
    *,
    prices: Sequence[float] | np.ndarray,
    rate: float,
) -> int:
    """The round's action from the estimated yields (cut at the room left) and the prices."""
    room = max(float(row[_ROOM]), 1.0)
    return best_action([min(float(e), room) for e in expected], prices, rate=rate)


def best_action(
    expected: Sequence[float] | np.ndarray, prices: Sequence[float] | np.ndarray, *, rate: float
) -> int:
    """Dinkelbach's choice: the index maximising ``expected − rate · price`` (the first on a
    tie: the action set lists the plain step first). A plain loop: ~25 actions a round, where
    numpy's per-call overhead is most of the time."""
    best, best_gain = 0, -math.inf
    for i, (e, p) in enumerate(zip(expected, prices, strict=True)):
        gain = float(e) - rate * float(p)
        if gain > best_gain and math.isfinite(gain):
            best, best_gain = i, gain
    return best
