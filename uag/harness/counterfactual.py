"""Counterfactual labels by exact replay: what every action would have yielded in every round.

Why: a plan that chooses each round's action (``uag.decoding.actions``) is trained on what each
action would have given, not just the one taken. For greedy decoding the target's continuation
is fixed, so the outcome of an action at a round start is determined by the state there:

* a step verifies nothing: one token;
* a copy's candidates are prompt lookup's continuation for the target's ids (a function of
  those ids alone), cut to the copy's length;
* a draft's candidates are what the assistant drafts from *its* state at that round: its ids,
  its cache and its text (``AssistantText``), which the rounds before made (what it was fed and
  in which chunks: a catch-up after copies is one multi-row forward, a drafting round's a row
  or two). That state is taken from the run itself: at each round start the assistant is
  forked (its cache copied, nothing fed again) and the fork syncs and drafts exactly as the
  loop would. So the label does not depend on whether a model's rows are independent of how
  many share a forward (native CPU kernels measured so, ``uag.kernels.choice``; other kernels
  need not be).

The behaviour (the plan actually run, on-policy) runs in the real loop against the record
(``dryrun.replay_loop``); the labels are read at each round start before it chooses. Each
round's label for the action taken is checked equal to the loop's own record of that round.
One assistant fork per round drafts the set's longest lookahead: a draft of ``k`` is the same
drafted tokens cut to ``k`` (greedy, no early stop), its candidates re-encoded from those.
Greedy only: a sampling round's outcome is random (issue 42, item 4).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from controllers.rules import StaticPolicy
from uag.decoding.actions import Action, ActionSet, Copy, Draft, copy_lookup
from uag.decoding.assistant_text import AssistantText
from uag.decoding.drafters import AssistantDrafter, GreedyDraft, Pick
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import ChoosingPlan, Sources
from uag.decoding.round import IterationRecord, Session, clip
from uag.decoding.sampling import TargetQ
from uag.decoding.stopwatch import Stopwatch
from uag.harness.dryrun import TargetTrace, replay_loop
from uag.runtime.runner import CachedLM


@dataclass(frozen=True)
class Outcome:
    """What one action yields in one round: the loop's ``IterationRecord`` fields for that round
    had it taken the action, and the counts its price needs."""

    candidates: int
    """Target tokens verified after the pending token."""
    accepted: int
    """Of those, equal to the target's continuation (``IterationRecord.accepted_candidates``)."""
    emitted: int
    """Target tokens the round adds: accepted + 1, cut at EOS and the room left."""
    drafted: int
    """Assistant tokens drafted."""
    accepted_drafts: int
    """Drafted tokens whose text lies inside the emitted text."""
    lag: int
    """Tokens the assistant's first draft step fed (its catch-up); 0 when nothing was drafted
    (``IterationRecord.lag``)."""
    healed: int
    """Bytes the assistant gave back at its sync (``IterationRecord.healed``); 0 unless drafting."""
    copied: bool
    """A copy (``IterationRecord.lookup``)."""
    rows: int
    """Rows of the verify: the pending token(s) (the prompt, in round 0) and the candidates."""
    draft_steps: int
    """Assistant forwards: the drafted tokens, and one more where it drafted its EOS."""


RECORD_FIELDS = {
    "candidates": "candidates",
    "accepted": "accepted_candidates",
    "emitted": "emitted",
    "drafted": "drafted",
    "accepted_drafts": "accepted_drafts",
    "lag": "lag",
    "healed": "healed",
    "copied": "lookup",
}
"""``Outcome`` field → the ``IterationRecord`` field the loop records it in."""


def record_outcome(record: IterationRecord) -> dict[str, Any]:
    """A loop's round as ``Outcome``'s recorded fields (those in ``RECORD_FIELDS``)."""
    return {name: getattr(record, field) for name, field in RECORD_FIELDS.items()}


def recorded(outcome: Outcome) -> dict[str, Any]:
    return {name: getattr(outcome, name) for name in RECORD_FIELDS}


@dataclass(frozen=True)
class RoundLabels:
    """One round start of the behaviour's run and every action's outcome there."""

    round: int
    generated: int
    """Target tokens before the round."""
    room: int
    """Target tokens the generation may still emit."""
    match: int
    """Tokens of prompt lookup's continuation (0: the last tokens did not occur before)."""
    taken: Action
    """The behaviour's action at this round."""
    outcomes: tuple[Outcome, ...]
    """One per action of the set, in its order."""


@dataclass(frozen=True)
class Labels:
    """A prompt's behaviour run and every action's outcome at each of its round starts."""

    actions: ActionSet
    rounds: tuple[RoundLabels, ...]
    records: tuple[IterationRecord, ...]
    """The behaviour's own rounds (the loop's records)."""

    def outcome(self, round: int, action: Action) -> Outcome:
        return self.rounds[round].outcomes[self.actions.index(action)]


def label_run(
    pair: Any,
    trace: TargetTrace,
    behaviour: ChoosingPlan,
    *,
    actions: ActionSet,
    prompt_assistant_ids: Sequence[int],
    lookup: PromptLookup | None = None,
) -> Labels:
    """Run ``behaviour`` on the recorded prompt (exact replay) and label every action of
    ``actions`` at each of its round starts. ``lookup`` becomes the behaviour's and the
    copies' prompt lookup (None: the behaviour's own, else ``copy_lookup()``); ``trace`` must
    be ``record_trace``'s on this pair."""
    if lookup is not None or behaviour.lookup is None:
        behaviour.lookup = lookup if lookup is not None else copy_lookup()
    labeller = Labeller(trace=trace, actions=actions, eos=pair.target.eos_ids)
    behaviour.watch = labeller
    try:
        out = replay_loop(pair, trace, behaviour, prompt_assistant_ids=prompt_assistant_ids)
    finally:
        behaviour.watch = None
    rounds = tuple(
        RoundLabels(**start, taken=taken)
        for start, taken in zip(labeller.rounds, behaviour.taken, strict=True)
    )
    labels = Labels(actions=actions, rounds=rounds, records=tuple(out.iterations))
    for r, (labelled, record) in enumerate(zip(rounds, out.iterations, strict=True)):
        if labelled.taken in actions:
            said = recorded(labels.outcome(r, labelled.taken))
            if said != record_outcome(record):
                raise RuntimeError(f"round {r}: label {said} but the loop {record_outcome(record)}")
    return labels


def undrafted(
    *, candidates: int, accepted: int, emitted: int, copied: bool, pending: int
) -> Outcome:
    """A step's or a copy's outcome (``copied``): the assistant does nothing that round (no
    draft, catch-up or healing), and the verify's rows are the ``pending`` token(s) and the
    candidates. Shared by the exact labels and sampling's expected ones, so they agree on it."""
    return Outcome(
        candidates=candidates,
        accepted=accepted,
        emitted=emitted,
        drafted=0,
        accepted_drafts=0,
        lag=0,
        healed=0,
        copied=copied,
        rows=pending + candidates,
        draft_steps=0,
    )


def round_start(session: Session, *, match: int, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """A labeller's record of one round start (``RoundLabels``' fields but the action taken):
    where the run stood, prompt lookup's match there, and every action's outcome in order."""
    return {
        "round": len(session.records),
        "generated": session.generated,
        "room": session.room,
        "match": match,
        "outcomes": tuple(outcomes),
    }


class Labeller:
    """Called at each round start (``ChoosingPlan.watch``): every action's outcome there."""

    def __init__(self, *, trace: TargetTrace, actions: ActionSet, eos: frozenset[int]) -> None:
        self.trace, self.actions, self.eos = trace, actions, eos
        self.rounds: list[dict[str, Any]] = []

    def __call__(self, session: Session, sources: Sources) -> None:
        pending = len(session.target.ids) - session.target.cached
        match = sources.match(session).ids
        kmax = self.actions.max_lookahead
        drafts = self._drafts(session, sources, kmax=kmax, pending=pending) if kmax else {}
        outcomes = []
        for action in self.actions:
            if isinstance(action, Draft):
                outcomes.append(drafts[action.lookahead or kmax])
                continue
            if isinstance(action, Copy) and sources.lookup is None:
                raise ValueError(f"{action.name} needs prompt lookup")
            candidates = match[: action.length] if isinstance(action, Copy) else []
            accepted, emitted = self._verify(session, candidates)
            outcomes.append(
                undrafted(
                    candidates=len(candidates),
                    accepted=accepted,
                    emitted=len(emitted),
                    copied=isinstance(action, Copy),
                    pending=pending,
                )
            )
        self.rounds.append(round_start(session, match=len(match), outcomes=outcomes))

    def _verify(self, session: Session, candidates: list[int]) -> tuple[int, list[int]]:
        """The greedy verdict, from the record: ``(accepted candidates, emitted tokens)``."""
        ahead = self.trace.ids[session.generated :]
        accepted = 0
        while accepted < len(candidates) and candidates[accepted] == ahead[accepted]:
            accepted += 1
        emitted, _ = clip(list(ahead[: accepted + 1]), eos_ids=self.eos, room=session.room)
        return accepted, emitted

    def _drafts(
        self, session: Session, sources: Sources, *, kmax: int, pending: int
    ) -> dict[int, Outcome]:
        """Every lookahead's outcome ``1..kmax``, from one fork of the assistant drafting
        ``kmax``: a draft of ``k`` drafts the same tokens, cut to ``k``."""
        real = sources.assistant
        if real is None or real.text is None:
            raise ValueError("draft actions need the assistant")
        if not isinstance(real.draw, GreedyDraft):
            raise ValueError("counterfactual labels are greedy only")
        draw = _CountingDraw(real.draw)
        fork = AssistantDrafter(
            assistant=_fork_lm(real.assistant),
            prompt_ids=real.prompt_ids,
            policy=StaticPolicy(k=kmax),  # no early stop, as every Draft
            draw=draw,
        )
        fork.text = text = _copy_text(real.text, fork.assistant)
        proposal = fork.propose(session, clock=Stopwatch())
        drafted = proposal.drafted
        committed = text.count - drafted  # the assistant's tokens before the draft
        out = {}
        for k in range(1, kmax + 1):
            picks = min(k, drafted)
            view = _first_tokens(text, committed + picks)
            candidates = real.draw.candidates(session, view, ())[0] if picks else []
            accepted, emitted = self._verify(session, candidates)
            after = session.text + session.bridge.target.bytes_of(emitted)
            out[k] = Outcome(
                candidates=len(candidates),
                accepted=accepted,
                emitted=len(emitted),
                drafted=picks,
                accepted_drafts=max(view.keep_prefix_of(after) - committed, 0),
                lag=proposal.lag,
                healed=proposal.healed,
                copied=False,
                rows=pending + len(candidates),
                draft_steps=min(draw.max_steps(k, session.room), draw.calls) if draw.calls else 0,
            )
        return out


class _CountingDraw:
    """A greedy draw that counts its picks (the assistant's forwards)."""

    def __init__(self, draw: GreedyDraft) -> None:
        self.draw, self.calls = draw, 0
        self.recodes = draw.recodes

    def spells(self) -> Callable[[bytes], bool] | None:
        return self.draw.spells()

    def max_steps(self, budget: int, room: int) -> int:
        return self.draw.max_steps(budget, room)

    def pick(self, assistant: CachedLM, heal: bytes) -> Pick | None:
        self.calls += 1
        return self.draw.pick(assistant, heal)

    def candidates(
        self, session: Session, text: AssistantText, picks: Sequence[Pick]
    ) -> tuple[list[int], list[TargetQ] | None]:
        return self.draw.candidates(session, text, picks)


def _fork_lm(lm: CachedLM) -> CachedLM:
    """Another sequence on the same model with ``lm``'s ids and a copy of its cache: feeding it
    computes what feeding ``lm`` would, and leaves ``lm`` as it is."""
    fork = lm.twin()
    fork.ids, fork.cached, fork.cache = list(lm.ids), lm.cached, copy.deepcopy(lm.cache)
    return fork


def _copy_text(text: AssistantText, lm: CachedLM) -> AssistantText:
    """``text``'s state over ``lm`` (a fork of its model's sequence, or a bare twin)."""
    out = copy.copy(text)
    out.lm, out.data, out.ends = lm, bytearray(text.data), list(text.ends)
    return out


def _first_tokens(text: AssistantText, count: int) -> AssistantText:
    """``text`` as it was with its first ``count`` tracked tokens, over a bare twin of its
    model (ids only, nothing cached: reading and cutting it feeds nothing)."""
    lm = text.lm.twin()
    lm.ids = text.lm.ids[: text.start + count]
    out = _copy_text(text, lm)
    del out.ends[count:]
    del out.data[out.ends[-1] if out.ends else 0 :]
    return out


def outcome_fields() -> tuple[str, ...]:
    """``Outcome``'s fields, in order (a collection's columns)."""
    return tuple(f.name for f in fields(Outcome))
