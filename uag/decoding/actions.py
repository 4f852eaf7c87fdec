"""What a round verifies, as a choice made per round: a plain step, a copy, or an assistant draft.

Why: the fixed rule (``LookupFirst``) copies whenever prompt lookup matches, with a length from
a table, and lets the stop policy decide only how far the assistant drafts. A plan that chooses
*what* to verify each round needs the choices named and executable:

* ``Step()``: no candidates, the target's own next token;
* ``Copy(length=L)``: the first ``L`` tokens of prompt lookup's continuation (none when the last
  tokens did not occur before: then a plain step);
* ``Draft(lookahead=k)``: the assistant's greedy draft of up to ``k`` tokens, no early stop
  (it ends sooner only where the assistant drafts its EOS, or at the room left), bridged into
  target ids.

Not here: a copy extended by assistant drafts. The assistant drafter syncs to the target's
accepted text and bridges relative to the target's ids; drafting after a copy needs both to
take the copied, not yet verified, tokens as given (a speculative prefix through ``sync`` and
``candidates``), which today's drafters do not have.

An ``ActionSet`` names each action with a stable string (``step``, ``copy:3``, ``draft:4``)
that a controller's metadata carries. An ``ActionChoice`` executes one action per round with
today's drafters: it is both the loop's ``DrafterChoice`` and the assistant's stop policy (its
budget is the round's lookahead), and ``speculate`` takes it as the ``policy`` (it makes the
choice: ``choice(assistant=..., lookup=...)``). Pass ``lookup=copy_lookup()``, so a copy's
length is the action's and not lookup's table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from uag.decoding.drafters import AssistantDrafter, LookupDrafter
from uag.decoding.lookup import PromptLookup
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.decoding.round import MAX_CANDIDATES, Drafter, Session
from uag.errors import UagError


@dataclass(frozen=True)
class Step:
    """A plain target step: no candidates."""

    @property
    def name(self) -> str:
        return "step"


@dataclass(frozen=True)
class Copy:
    """Verify the first ``length`` tokens of prompt lookup's continuation."""

    length: int

    def __post_init__(self) -> None:
        _in_range("copy length", self.length)

    @property
    def name(self) -> str:
        return f"copy:{self.length}"


@dataclass(frozen=True)
class Draft:
    """Verify the assistant's greedy draft of up to ``lookahead`` tokens (no early stop)."""

    lookahead: int

    def __post_init__(self) -> None:
        _in_range("lookahead", self.lookahead)

    @property
    def name(self) -> str:
        return f"draft:{self.lookahead}"


Action = Step | Copy | Draft


def _in_range(what: str, value: int) -> None:
    if not 1 <= value <= MAX_CANDIDATES:
        raise UagError(f"{what} must be 1..{MAX_CANDIDATES} (the verify cap), got {value}")


def parse_action(name: str) -> Action:
    """The action named ``name`` (``Action.name``'s inverse)."""
    kind, _, arg = name.partition(":")
    if kind == "step" and not arg:
        return Step()
    if kind in ("copy", "draft") and arg.isdigit():
        return Copy(length=int(arg)) if kind == "copy" else Draft(lookahead=int(arg))
    raise UagError(f"unknown action {name!r}: use step, copy:L or draft:K")


@dataclass(frozen=True)
class ActionSet:
    """The actions a plan chooses among, in a fixed order (a controller's output index)."""

    actions: tuple[Action, ...]

    def __post_init__(self) -> None:
        if not self.actions:
            raise UagError("an action set needs at least one action")
        if len(set(self.actions)) != len(self.actions):
            raise UagError(f"repeated actions in {', '.join(self.names)}")

    @classmethod
    def standard(cls, *, max_copy: int, max_draft: int) -> ActionSet:
        """``step``, ``copy:1..max_copy``, ``draft:1..max_draft`` (0: none of that kind)."""
        return cls(
            (
                Step(),
                *(Copy(length=n) for n in range(1, max_copy + 1)),
                *(Draft(lookahead=k) for k in range(1, max_draft + 1)),
            )
        )

    @classmethod
    def from_names(cls, names: Sequence[str]) -> ActionSet:
        return cls(tuple(parse_action(n) for n in names))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.actions)

    @property
    def max_lookahead(self) -> int:
        """The longest draft (0: no drafts)."""
        return max((a.lookahead for a in self.actions if isinstance(a, Draft)), default=0)

    def index(self, action: Action) -> int:
        return self.actions.index(action)

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)


def copy_lookup(*, max_ngram: int = 4, min_ngram: int = 1) -> PromptLookup:
    """Prompt lookup whose continuation is as long as a verify allows, whatever the match's
    length: the copy's length is then the action's alone."""
    return PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, max_tokens=(MAX_CANDIDATES,))


class ActionChoice:
    """Executes ``next_action(session)`` each round with today's drafters.

    Both sides of the loop's contract: the ``DrafterChoice`` (``choose`` returns the drafter the
    round's action needs, the copy cut to its length) and the assistant's ``StopPolicy`` (its
    budget is the round's lookahead; it never stops early). Give it to ``speculate`` as
    ``policy``: the loop then asks it for the choice (``choice``). ``taken`` lists the actions
    of the rounds so far; ``watch``, when set, is called at each round's start, before the
    action is chosen, with the drafters as they are then (counterfactual labelling reads them).
    """

    name = "actions"
    needs_features: ClassVar[bool] = False
    timed_as: ClassVar[str] = "policy"
    """The loop times the choice as the policy's decision (``uag.decoding.round.choose``)."""

    def __init__(self) -> None:
        self.assistant: AssistantDrafter | None = None
        self.lookup: LookupDrafter | None = None
        self.taken: list[Action] = []
        self.watch: Callable[[Session], None] | None = None
        self._lookahead = 0

    def next_action(self, session: Session) -> Action:
        raise NotImplementedError

    # --- the choice -----------------------------------------------------------------------

    def choice(
        self, *, assistant: AssistantDrafter | None, lookup: LookupDrafter | None
    ) -> ActionChoice:
        """Bind the drafters ``speculate`` built (``uag.decoding.speculative``)."""
        if assistant is not None and assistant.policy is not self:
            raise ValueError("the assistant drafter must run under this choice as its policy")
        if lookup is not None and min(lookup.lookup.max_tokens) < MAX_CANDIDATES:
            raise ValueError("a copy's length is the action's: use lookup=copy_lookup()")
        self.assistant, self.lookup = assistant, lookup
        self.taken = []
        return self

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        return tuple(d for d in (self.lookup, self.assistant) if d is not None)

    def choose(self, session: Session) -> Drafter | None:
        if self.watch is not None:
            self.watch(session)
        action = self.next_action(session)
        self.taken.append(action)
        return self.drafter_for(action)

    def drafter_for(self, action: Action) -> Drafter | None:
        """The drafter that proposes ``action``'s candidates this round (None: a plain step)."""
        if isinstance(action, Step):
            return None
        if isinstance(action, Copy):
            if self.lookup is None:
                raise ValueError(f"{action.name} needs prompt lookup (lookup=copy_lookup())")
            self.lookup.cap = action.length
            return self.lookup
        if self.assistant is None:
            raise ValueError(f"{action.name} needs the assistant")
        self._lookahead = action.lookahead
        return self.assistant

    # --- the stop policy ------------------------------------------------------------------

    def reset(self) -> None:
        self._lookahead = 0

    def budget(self, ctx: DraftContext) -> int:
        return self._lookahead

    def stop(self, step: DraftStep) -> bool:
        return False

    def update(self, outcome: IterationOutcome) -> None:
        pass


class ScriptedChoice(ActionChoice):
    """Round ``i`` takes ``actions[i]``; rounds past the script take ``then`` (tests, exploring,
    and forcing an action at a chosen round)."""

    def __init__(self, actions: Sequence[Action], *, then: Action = Step()) -> None:
        super().__init__()
        self.actions, self.then = tuple(actions), then

    def next_action(self, session: Session) -> Action:
        i = len(session.records)
        return self.actions[i] if i < len(self.actions) else self.then


class PlannedChoice(ActionChoice):
    """Each round takes ``plan(session)``: a rule, or a learned controller's choice."""

    def __init__(self, plan: Callable[[Session], Action]) -> None:
        super().__init__()
        self.plan = plan

    def next_action(self, session: Session) -> Action:
        return self.plan(session)
