"""What drafting and verifying cost on one machine, as data: the latency profile.

A learned controller trades draft work against target passes, so it needs the prices: one
assistant draft step, and one target verification of ``m`` candidates for every ``m`` it may
meet. ``uag.harness.latency`` measures them; collected data, exported controllers, replay
(``training.replay``) and the dry run (``uag.harness.dryrun``) carry and read them. Kept apart
from the measuring (which needs the models) so the readers below the harness need not import it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PROFILE_CONTEXT = 192
"""Context length (tokens) the profile is measured at: about where a 128-token generation after
a 130-token prompt spends its time (attention grows with the context)."""


@dataclass(frozen=True)
class LatencyProfile:
    """Median seconds per operation on one machine (``verify_s[m]``: m candidates, m = 0..L+1)."""

    device: str
    draft_s: float
    """One assistant step: one token in, full distribution out."""
    verify_s: list[float]
    """Target pass over the pending token and ``m`` candidates, greedy head included."""
    context_tokens: int = PROFILE_CONTEXT
    step_s: float | None = None
    """Target-alone decoding's step, back to back (None, in older profiles: ``verify_s[0]``)."""
    round_s: float = 0.0
    """Per round, the loop's time outside draft steps and verify (bridge, bookkeeping)."""
    catchup_s: float = 0.0
    """Extra cost of a round's first draft step over ``draft_s`` (it feeds the catch-up rows)."""
    catchup_lag: float = 0.0
    """The ``DraftContext.lag`` of the rounds ``catchup_s`` was measured over (the fewest tokens
    a measured round fed; older profiles: the median lag)."""
    feed_row_s: float = 0.0
    """Each further token a draft step feeds (catching up on text the assistant has not seen,
    e.g. after prompt lookup's rounds): a lag beyond ``catchup_lag`` costs this per token."""
    stats_s: float = 0.0
    """The part of every ``verify_s`` spent on the target's statistics (a feature for the next
    round): a policy that reads no features does not pay it (0 in older profiles)."""

    @property
    def target_step_s(self) -> float:
        """A plain target step (no candidates): what target-alone decoding pays per token."""
        return self.step_s if self.step_s is not None else self.verify_s[0]

    def catchup(self, lag: float | None) -> float:
        """What a round's first draft step costs beyond ``draft_s`` when it feeds ``lag``
        tokens (None: unknown, the measured typical case)."""
        extra = 0.0 if lag is None else max(lag - self.catchup_lag, 0.0) * self.feed_row_s
        return self.catchup_s + extra

    def round_cost(self, *, drafted: int, candidates: int, lag: int | None = None) -> float:
        """What one round of the loop costs: draft steps, verify, catch-up and bookkeeping."""
        catchup = self.catchup(lag) if drafted else 0.0
        return self.round_s + catchup + drafted * self.draft_s + self.verify(candidates)

    def verify(self, candidates: int) -> float:
        """Cost of verifying ``candidates`` (beyond the profile: extrapolated linearly)."""
        if candidates < len(self.verify_s):
            return self.verify_s[candidates]
        last, prev = self.verify_s[-1], self.verify_s[-2] if len(self.verify_s) > 1 else 0.0
        return last + (candidates - len(self.verify_s) + 1) * max(last - prev, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyProfile:
        return cls(
            device=str(data["device"]),
            draft_s=float(data["draft_s"]),
            verify_s=[float(x) for x in data["verify_s"]],
            context_tokens=int(data.get("context_tokens", 128)),
            step_s=None if data.get("step_s") is None else float(data["step_s"]),
            round_s=float(data.get("round_s", 0.0)),
            catchup_s=float(data.get("catchup_s", 0.0)),
            catchup_lag=float(data.get("catchup_lag", 0.0)),
            feed_row_s=float(data.get("feed_row_s", 0.0)),
            stats_s=float(data.get("stats_s", 0.0)),
        )
