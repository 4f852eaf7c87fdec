"""The round's one question, asked of one protocol: what does the target verify next?

A ``Plan`` answers each round with an ``Action`` (``uag.decoding.actions``): a plain step, a
copy of ``L`` tokens from a copy source, or an assistant draft of up to ``K`` tokens under the
plan's own stop rule. Every way uag runs a round is a plan: the target alone through the round
(``controllers.plans.TargetOnlyPlan``), a hand-written stop policy with or without prompt lookup
first (``controllers.plans.RulePlan``: static-K, heuristic, confidence, entropy, lookup alone, the
hybrid rule), the bandit (``controllers.bandit``), the learned plan
(``controllers.learned_plan``) and the replay oracle (``uag.harness.plan_collect``).

Why one protocol: before it, a plan rode in the stop policy's slot and the loop recognised it by
type and attributes; each new source of candidates (a suffix index shared across requests)
would have meant another special case. Here the round asks ``next_action`` and runs the answer
(``PlanRunner``); what a plan knows of the round is the ``Session`` and the ``Sources`` it was
given at ``begin``.

A draft's stop rule is part of the plan (``budget`` / ``stop`` / ``update``, the
``uag.decoding.policy.StopPolicy`` methods): the assistant drafts ``min(K, budget(ctx))``
tokens, asking ``stop`` after each. A plan that decides the whole draft up front takes
``FixedDrafts``' rule: no cap of its own, never stops early.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from uag.decoding.actions import Action, Copy, Draft, Step
from uag.decoding.drafters import AssistantDrafter, LookupDrafter, Match
from uag.decoding.lookup import PromptLookup
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.decoding.round import Drafter, Session
from uag.errors import UagError

NO_CAP = sys.maxsize
"""``budget`` of a plan whose drafts are as long as its action says (``FixedDrafts``)."""


@dataclass
class Sources:
    """What a round can draw candidates from in this generation (None: not in this run)."""

    lookup: LookupDrafter | None = None
    """Prompt lookup: what followed the last target tokens where they occurred before."""
    assistant: AssistantDrafter | None = None
    """The assistant model, drafting under the plan's stop rule."""

    def match(self, session: Session) -> Match:
        """Prompt lookup's continuation at this round start (none without lookup)."""
        return self.lookup.match_info(session) if self.lookup is not None else Match([])

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        return tuple(d for d in (self.lookup, self.assistant) if d is not None)


class Plan(Protocol):
    """Chooses every round's action. An instance holds per-generation state: ``begin`` resets it.

    ``lookup`` is the prompt lookup it copies from (None: it never copies; its length table
    sets a copy's length where the plan copies the whole match). ``needs_features``: its stop
    rule reads target statistics or per-step re-encodings (they cost a little, so the round
    computes them only when asked)."""

    name: str
    lookup: PromptLookup | None

    @property
    def needs_features(self) -> bool: ...

    def begin(self, sources: Sources) -> None:
        """A new generation over ``sources``."""

    def next_action(self, session: Session) -> Action:
        """This round's action, from what is known at its start."""

    def budget(self, ctx: DraftContext) -> int:
        """A draft's length cap once the assistant is synced (``ctx``); 0: draft nothing."""

    def stop(self, step: DraftStep) -> bool:
        """Stop drafting after ``step`` (it is still verified)?"""

    def update(self, outcome: IterationOutcome) -> None:
        """How a round the assistant drafted in went."""


class FixedDrafts:
    """The stop rule of a plan that fixes each draft's length in its action: no cap of its own,
    never stops early, learns nothing from outcomes."""

    needs_features = False

    def budget(self, ctx: DraftContext) -> int:
        return NO_CAP

    def stop(self, step: DraftStep) -> bool:
        return False

    def update(self, outcome: IterationOutcome) -> None:
        pass


class ChoosingPlan(FixedDrafts):
    """Base of the plans that choose among named actions (learned, oracle, scripted).

    ``taken`` lists the actions of this generation's rounds; ``watch``, when set, is called at
    each round start before the action is chosen, with the session and the sources as they
    are then (counterfactual labelling reads them)."""

    name = "actions"

    def __init__(self, *, lookup: PromptLookup | None = None) -> None:
        self.lookup = lookup
        self.sources = Sources()
        self.taken: list[Action] = []
        self.watch: Callable[[Session, Sources], None] | None = None

    def begin(self, sources: Sources) -> None:
        self.sources = sources
        self.taken = []

    def next_action(self, session: Session) -> Action:
        if self.watch is not None:
            self.watch(session, self.sources)
        action = self.choose(session)
        self.taken.append(action)
        return action

    def choose(self, session: Session) -> Action:
        raise NotImplementedError


class ScriptedPlan(ChoosingPlan):
    """Round ``i`` takes ``actions[i]``; rounds past the script take ``then`` (tests, exploring,
    and forcing an action at a chosen round)."""

    name = "scripted"

    def __init__(
        self,
        actions: list[Action] | tuple[Action, ...],
        *,
        then: Action | None = None,
        lookup: PromptLookup | None = None,
    ) -> None:
        super().__init__(lookup=lookup)
        self.actions, self.then = tuple(actions), then or Step()

    def choose(self, session: Session) -> Action:
        i = len(session.records)
        return self.actions[i] if i < len(self.actions) else self.then


class FunctionPlan(ChoosingPlan):
    """Each round takes ``rule(session, sources)``: a rule written as a function."""

    name = "function"

    def __init__(
        self,
        rule: Callable[[Session, Sources], Action],
        *,
        lookup: PromptLookup | None = None,
    ) -> None:
        super().__init__(lookup=lookup)
        self.rule = rule

    def choose(self, session: Session) -> Action:
        return self.rule(session, self.sources)


class PlanRunner:
    """Runs a plan's actions with the round's drafters: the loop's ``DrafterChoice``, and the
    stop policy the assistant drafts under (the round's lookahead capped by the plan's rule)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.sources = Sources()
        self._lookahead: int | None = None

    def begin(self, sources: Sources) -> None:
        self.sources = sources
        self.plan.begin(sources)

    # --- the loop's DrafterChoice ---------------------------------------------------------

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        return self.sources.drafters

    def choose(self, session: Session) -> tuple[str, Drafter | None]:
        """The plan's action for this round and the drafter that proposes it (None: a step)."""
        action = self.plan.next_action(session)
        return action.name, self._drafter_for(action)

    def _drafter_for(self, action: Action) -> Drafter | None:
        match action:
            case Step():
                return None
            case Copy(length=length, source=source):
                lookup = self.sources.lookup
                if lookup is None or source != lookup.source:
                    raise UagError(
                        f"plan {self.plan.name} chose {action.name}, but this run has no "
                        f"{source} to copy from"
                    )
                lookup.cap = length
                return lookup
            case Draft(lookahead=lookahead):
                if self.sources.assistant is None:
                    raise UagError(
                        f"plan {self.plan.name} chose {action.name} without an assistant"
                    )
                self._lookahead = lookahead
                return self.sources.assistant
        raise TypeError(f"not an action: {action!r}")

    # --- the assistant's draft rule -------------------------------------------------------

    def reset(self) -> None:
        self._lookahead = None

    def budget(self, ctx: DraftContext) -> int:
        cap = self.plan.budget(ctx)
        return cap if self._lookahead is None else min(self._lookahead, cap)

    def stop(self, step: DraftStep) -> bool:
        return self.plan.stop(step)

    def update(self, outcome: IterationOutcome) -> None:
        self.plan.update(outcome)
