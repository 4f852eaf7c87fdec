"""The one small protocol between the speculative loop and a stop policy.

The loop asks three things, nothing more:

* ``budget(ctx)`` before drafting: how many assistant tokens at most this iteration (0 = skip
  drafting; the target then takes one plain step);
* ``stop(step)`` after each drafted token: stop drafting now? (the drafted token is still verified);
* ``update(record)`` after verification: what happened, for policies that adapt.

Policies never see tokenizers or models; they see numbers the loop already has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable


@dataclass(frozen=True)
class DraftContext:
    """What is known before drafting starts in an iteration."""

    iteration: int
    """0-based iteration index within this generation."""
    generated: int
    """Target tokens generated so far."""
    remaining: int
    """Target tokens still allowed before max_new_tokens."""
    prev_drafted: int
    """Assistant tokens drafted in the most recent iteration that drafted (0 at the start)."""
    prev_accepted: int
    """Of those, how many the target accepted."""
    drafted_total: int
    """Assistant tokens drafted in this sequence before this iteration."""
    accepted_total: int
    """Of those, how many the target accepted."""
    target_prob: float
    """Target's probability of the last token it emitted (NaN before the first verify)."""
    target_entropy: float
    """Entropy (nats) of the target's distribution for that token (NaN before the first verify)."""
    lag: int = 0
    """Assistant tokens its first draft step would feed: the accepted text it has not seen,
    re-encoded (1 when it is in step; more after rounds it did not draft in, such as copied
    ones). Each costs a row of that forward (``controllers.cost``)."""
    copies: int = 0
    """Rounds so far whose candidates prompt lookup copied (the policy was not asked)."""
    copied: int = 0
    """Candidates those rounds verified."""
    copy_emitted: int = 0
    """Target tokens those rounds emitted (part of ``generated``)."""


@dataclass(frozen=True)
class DraftStep:
    """One drafted assistant token, with everything known at run time when it was drafted.

    Feature extraction (``uag.decoding.features``) reads only this, both in ``uag collect`` and at run time.
    """

    position: int
    """1-based position of this token in the current draft."""
    token_id: int
    token_bytes: bytes
    """The drafted token's text, as UTF-8 bytes (may be part of a character)."""
    prob: float
    """Assistant probability of the drafted (argmax) token."""
    entropy: float
    """Entropy (nats) of the assistant's next-token distribution."""
    margin: float
    """Top-1 minus top-2 probability."""
    cum_logprob: float
    """Sum of log-probabilities of the draft so far, this token included."""
    min_prob: float
    """Smallest drafted-token probability in the draft so far."""
    target_tokens: int
    """Target tokens the draft's text re-encodes to so far (-1 when not computed)."""
    context: DraftContext
    """The iteration this step belongs to."""
    repeat: int = 0
    """How much of the text ending with this token already occurs earlier in the prompt and the
    text before it, in bytes (``uag.decoding.features.repeat_length``: 0, 3, 6, 12 or 24); 0 when the loop
    does not compute features."""
    respelled: int = 0
    """Bytes at the start of this token that spell text the target already emitted: the
    assistant's last token was taken back and drafted again (token healing, ``uag.decoding.assistant_text``),
    so they are accepted whatever comes next."""


@dataclass(frozen=True)
class IterationOutcome:
    """What verification decided, fed back to adaptive policies."""

    drafted: int
    accepted: int
    """Drafted assistant tokens whose text the target accepted."""


class DraftRule(Protocol):
    """What the assistant drafter asks while it drafts: how far (``budget``), whether to stop
    after each token, and (``update``) how the draft fared."""

    def reset(self) -> None: ...

    def budget(self, ctx: DraftContext) -> int: ...

    def stop(self, step: DraftStep) -> bool: ...

    def update(self, outcome: IterationOutcome) -> None: ...


@runtime_checkable
class StopPolicy(DraftRule, Protocol):
    """Decides how far the assistant drafts: a plan's stop rule (``controllers.plans.RulePlan``).
    Instances hold per-sequence state: ``reset()`` it."""

    name: str
    needs_features: ClassVar[bool]
    """True when ``stop`` reads target statistics or draft re-encoding counts (they cost a little)."""
