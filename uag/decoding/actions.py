"""What a round verifies: a plain step, a copy from a source, or an assistant draft.

A ``Plan`` (``uag.decoding.plan``) answers each round with one of these:

* ``Step()``: no candidates, the target's own next token;
* ``Copy(length=L)``: the first ``L`` tokens of a copy source's continuation (prompt lookup's,
  ``source="lookup"``; a round whose last tokens did not occur before copies nothing: a plain
  step);
* ``Draft(lookahead=k)``: the assistant drafts up to ``k`` tokens, bridged into target ids; the
  plan's own stop rule (``Plan.budget`` / ``Plan.stop``) may end it sooner. ``lookahead=None``:
  as far as that rule says (the hand-written stop policies decide the length themselves).

Not here: a copy extended by assistant drafts. The assistant drafter syncs to the target's
accepted text and bridges relative to the target's ids; drafting after a copy needs both to
take the copied, not yet verified, tokens as given (a speculative prefix through ``sync`` and
``candidates``), which today's drafters do not have.

An ``ActionSet`` names each action with a stable string (``step``, ``copy:3``, ``draft:4``)
that a controller's metadata carries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from uag.decoding.lookup import PromptLookup
from uag.decoding.round import MAX_CANDIDATES
from uag.errors import UagError

LOOKUP = "lookup"
"""The copy source every run has: prompt lookup over the prompt and the output so far."""


@dataclass(frozen=True)
class Step:
    """A plain target step: no candidates."""

    @property
    def name(self) -> str:
        return "step"


@dataclass(frozen=True)
class Copy:
    """Verify the first ``length`` tokens of ``source``'s continuation."""

    length: int
    source: str = LOOKUP

    def __post_init__(self) -> None:
        _in_range("copy length", self.length)

    @property
    def name(self) -> str:
        at = "" if self.source == LOOKUP else f"{self.source}:"
        return f"copy:{at}{self.length}"


@dataclass(frozen=True)
class Draft:
    """Verify the assistant's draft of up to ``lookahead`` tokens (None: as many as the plan's
    stop rule allows); the plan's ``stop`` may end it after any drafted token."""

    lookahead: int | None = None

    def __post_init__(self) -> None:
        if self.lookahead is not None and self.lookahead < 1:
            raise UagError(f"lookahead must be at least 1, got {self.lookahead}")

    @property
    def name(self) -> str:
        return "draft" if self.lookahead is None else f"draft:{self.lookahead}"


Action = Step | Copy | Draft


def _in_range(what: str, value: int) -> None:
    if not 1 <= value <= MAX_CANDIDATES:
        raise UagError(f"{what} must be 1..{MAX_CANDIDATES} (the verify cap), got {value}")


def parse_action(name: str) -> Action:
    """The action named ``name`` (``Action.name``'s inverse)."""
    kind, _, arg = name.partition(":")
    source, _, length = arg.rpartition(":")
    if kind == "step" and not arg:
        return Step()
    if kind == "draft" and not arg:
        return Draft()
    if kind == "draft" and arg.isdigit() and int(arg) <= MAX_CANDIDATES:
        return Draft(lookahead=int(arg))
    if kind == "copy" and length.isdigit():
        return Copy(length=int(length), source=source or LOOKUP)
    raise UagError(f"unknown action {name!r}: use step, copy:L, copy:SOURCE:L, draft or draft:K")


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
        return max((a.lookahead or 0 for a in self.actions if isinstance(a, Draft)), default=0)

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
