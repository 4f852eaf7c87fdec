"""The fixed plans: the target alone through the round, and a stop policy with prompt lookup first.

``RulePlan`` is every hand-written arm of ``controllers.spec``'s grammar: ``static-K``,
``heuristic``, ``confidence``, ``entropy`` and a stop controller (``learned`` on a stop-policy
file), each alone or ``+lookup`` / ``+lookup-N`` (the hybrid rule: its lookup finds only matches
of ``N`` tokens or more), and ``lookup`` alone (no stop policy: a round without a match is a
plain step). Its rule: copy prompt lookup's continuation whenever the last target tokens
occurred before (the lookup's own table sets the copy's length), else let the assistant draft
under the stop policy. ``TargetOnlyPlan`` takes a plain step every round: the target alone,
through the same round as every other plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from uag.decoding.actions import Action, Copy, Draft, Step
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import FixedDrafts, Sources
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome, StopPolicy
from uag.decoding.round import Session


class TargetOnlyPlan(FixedDrafts):
    """Every round a plain target step (``target-only`` as a plan)."""

    name = "target-only"
    lookup: PromptLookup | None = None

    def begin(self, sources: Sources) -> None:
        pass

    def next_action(self, session: Session) -> Action:
        return Step()


@dataclass
class RulePlan:
    """Prompt lookup's copy when it matches, else the assistant under ``rule`` (module
    docstring). ``rule`` None: never drafts (``lookup`` alone)."""

    rule: StopPolicy | None = None
    lookup: PromptLookup | None = None
    name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.name = arm_name(self.rule, self.lookup)
        self._sources = Sources()

    @property
    def needs_features(self) -> bool:
        return self.rule is not None and self.rule.needs_features

    def begin(self, sources: Sources) -> None:
        self._sources = sources
        if self.rule is not None:
            self.rule.reset()

    def next_action(self, session: Session) -> Action:
        if not session.target.cached:
            return Step()  # the prompt's own pass: what the target alone does first
        if self._sources.lookup is not None:
            copied = self._sources.lookup.match(session)
            if copied:
                return Copy(length=len(copied))
        if self.rule is None or self._sources.assistant is None:
            return Step()
        return Draft()  # as far as the rule's budget and stop allow

    def budget(self, ctx: DraftContext) -> int:
        return self.rule.budget(ctx) if self.rule is not None else 0

    def stop(self, step: DraftStep) -> bool:
        return self.rule.stop(step) if self.rule is not None else True

    def update(self, outcome: IterationOutcome) -> None:
        if self.rule is not None:
            self.rule.update(outcome)


def arm_name(rule: StopPolicy | None, lookup: PromptLookup | None) -> str:
    """The arm's name in ``controllers.spec``'s grammar: ``static-3+lookup``, ``lookup``,
    ``entropy-1.5+lookup-3``..."""
    if rule is None:
        return "lookup" if lookup is not None else "target-only"
    if lookup is None:
        return rule.name
    hybrid = "" if lookup.min_ngram == 1 else f"-{lookup.min_ngram}"  # +lookup-N
    return f"{rule.name}+lookup{hybrid}"
