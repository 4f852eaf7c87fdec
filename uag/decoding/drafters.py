"""Drafters behind one protocol (``uag.decoding.round.Drafter``), and the rule choosing them.

* ``LookupDrafter`` copies what followed the last target tokens when they occurred before
  (prompt lookup): free candidates, nothing drafted.
* ``AssistantDrafter`` runs the assistant: sync it to the accepted text, draft token by token
  under a stop policy, bridge the drafted text into target ids. How it draws a token is its
  ``DraftDistribution``: ``GreedyDraft`` (the argmax; the text is re-encoded for the target) or
  ``SampledDraft`` (a sample from its distribution restricted to tokens that are exactly one
  target token, so ``q`` lives on the target's vocabulary).

Which of them proposes a round is the plan's choice (``uag.decoding.plan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from uag.decoding.assistant_text import AssistantText
from uag.decoding.bridge import Bridge, ends_on_char_boundary
from uag.decoding.features import repeat_length
from uag.decoding.lookup import PromptLookup
from uag.decoding.policy import DraftContext, DraftRule, DraftStep
from uag.decoding.round import MAX_CANDIDATES, Proposal, Session, Settled
from uag.decoding.sampling import (
    Intersection,
    SamplingConfig,
    TargetQ,
    categorical,
    processed_probs,
    uniform,
)
from uag.decoding.stopwatch import Stopwatch
from uag.runtime.runner import CachedLM


@dataclass(frozen=True)
class Match:
    """Prompt lookup's continuation for the target's ids at one round start."""

    ids: list[int]
    """The copied continuation ([] when the last tokens did not occur before)."""
    ngram: int = 0
    """Length of the matched tail (0: none): a longer match predicts a longer right copy."""
    source: int = -1
    """Position in the target's ids where the continuation began (-1: none)."""
    occurrences: tuple[int, ...] = ()
    """Where the matched tail's recent earlier occurrences continued, oldest first (``source``
    last): the plan reads whether they agree with the copy."""
    count: int = 0
    """How many earlier occurrences the matched tail has."""


class LookupDrafter:
    """Prompt lookup as a drafter: the match for this round is looked up once (``match``).

    ``cap``: copy at most this many of the match's tokens (None: all of them). Set per round by
    a choice that decides the copy's length itself (``uag.decoding.actions``); a match is the
    same list cut shorter, so ``match`` stays the round's whole continuation."""

    source = "lookup"
    """The name a ``Copy`` action gives this source (``uag.decoding.actions.LOOKUP``)."""

    def __init__(self, lookup: PromptLookup, *, cap: int | None = None) -> None:
        self.lookup = lookup
        self.cap = cap
        self._match: tuple[int, Match] = (-1, Match([]))

    def reset(self, session: Session) -> None:
        self.lookup.reset()
        self._match = (-1, Match([]))

    def match(self, session: Session) -> list[int]:
        """The copied continuation for the target's ids as they are now ([] when none). Not
        before the prompt is prefilled: the first round is the one target-alone makes."""
        return self.match_info(session).ids

    def match_info(self, session: Session) -> Match:
        """``match`` with the matched tail's length and where the continuation came from."""
        at = len(session.target.ids)
        if self._match[0] != at:
            room = session.room
            found = Match([])
            if session.target.cached and room > 1:
                ids, ngram = self.lookup.propose(
                    session.target.ids, limit=min(room - 1, MAX_CANDIDATES)
                )
                if ids:
                    found = Match(
                        ids,
                        ngram=ngram,
                        source=self.lookup.last_source,
                        occurrences=self.lookup.last_occurrences,
                        count=self.lookup.last_count,
                    )
            self._match = (at, found)
        return self._match[1]

    def propose(self, session: Session, *, clock: Stopwatch) -> Proposal:
        with clock("bridge"):
            return Proposal(candidates=self.match(session)[: self.cap], copied=True)

    def settle(self, session: Session, done: Settled, *, clock: Stopwatch) -> int:
        if done.chosen:
            with clock("policy"):
                session.history.note_copy(
                    candidates=len(done.proposal.candidates), emitted=len(done.emitted)
                )
        return 0


@dataclass(frozen=True)
class Pick:
    """One drafted assistant token and what its distribution said."""

    token: int
    prob: float
    margin: float
    """Top-1 minus top-2 probability."""
    entropy: float
    respelled: int
    """Bytes at its start that spell healed text again."""
    target: int = -1
    """The target id it stands for (sampling); -1 when its text is re-encoded (greedy)."""
    q: tuple[torch.Tensor, Intersection] | None = None
    """Sampling: the restricted distribution it was drawn from."""


class DraftDistribution(Protocol):
    """How the assistant draws a token and how its drafts become target candidates."""

    recodes: bool
    """Candidates come from re-encoding the drafted text (per step, when features are read)."""

    def spells(self) -> Callable[[bytes], bool] | None:
        """For healing: whether a draft can spell given bytes (None: the sync's default)."""

    def max_steps(self, budget: int, room: int) -> int: ...

    def pick(self, assistant: CachedLM, heal: bytes) -> Pick | None:
        """The next drafted token (None: drafting ends here)."""

    def candidates(
        self, session: Session, text: AssistantText, picks: Sequence[Pick]
    ) -> tuple[list[int], list[TargetQ] | None]: ...


class GreedyDraft:
    """The assistant's argmax; its drafted text is re-encoded into target ids."""

    recodes = True

    def __init__(self, *, bridge: Bridge, assistant_eos: frozenset[int]) -> None:
        self.bridge, self.assistant_eos = bridge, assistant_eos

    def spells(self) -> Callable[[bytes], bool] | None:
        return None

    def max_steps(self, budget: int, room: int) -> int:
        return min(budget, room - 1)  # assistant tokens; the candidates are cut to the verify cap

    def pick(self, assistant: CachedLM, heal: bytes) -> Pick | None:
        hidden = assistant.forward()
        among = self.bridge.assistant.fitting(heal, below=assistant.draft_limit) if heal else None
        tok, p1, p2, entropy = assistant.draft(hidden, among=among)
        if tok in self.assistant_eos:
            return None  # the assistant thinks the text ends here; the target decides that itself
        respelled = min(len(self.bridge.assistant.table[tok]), len(heal))
        return Pick(token=tok, prob=p1, margin=p1 - p2, entropy=entropy, respelled=respelled)

    def candidates(
        self, session: Session, text: AssistantText, picks: Sequence[Pick]
    ) -> tuple[list[int], list[TargetQ] | None]:
        """Target ids for the drafted text past the target's own text (whole characters)."""
        drafted = text.generated
        if drafted[: len(session.text)] != session.text:
            return [], None  # the assistant lags inside a character the target has not finished
        bridge = self.bridge
        ids, _ = bridge.target.continuation(
            tail=bridge.tail(bridge.target, session.target.ids),
            new=bytes(drafted[len(session.text) :]),
        )
        return ids[: min(session.room - 1, MAX_CANDIDATES)], None


class SampledDraft:
    """A sample of the assistant's processed distribution restricted to the intersection: each
    drafted token stands for exactly one target token (after healing, the one after the healed
    text: ``Intersection.healed``)."""

    recodes = False

    def __init__(
        self, *, intersection: Intersection, sampling: SamplingConfig, gen: torch.Generator
    ) -> None:
        self.intersection, self.sampling, self.gen = intersection, sampling, gen

    def spells(self) -> Callable[[bytes], bool] | None:
        return self.intersection.can_heal

    def max_steps(self, budget: int, room: int) -> int:
        return min(budget, room - 1, MAX_CANDIDATES)

    def pick(self, assistant: CachedLM, heal: bytes) -> Pick | None:
        logits = assistant.logits(assistant.forward()[-1:])
        among = self.intersection
        if heal:  # its distribution given that its token spells ``heal`` first, processed
            among = self.intersection.healed(heal)
            logits = logits.masked_fill(among.to_target < 0, -math.inf)
        q = among.restrict(processed_probs(logits, self.sampling)[0])
        if q is None:
            return None
        aid = categorical(q, uniform(self.gen))
        top = torch.topk(q, 2).values
        return Pick(
            token=aid,
            prob=float(q[aid]),
            margin=float(top[0] - top[1]),
            entropy=float(-(q * torch.log(q.clamp_min(1e-30))).sum()),
            respelled=len(heal),  # a healed id spells all of it, then one target token
            target=int(among.to_target[aid]),
            q=(q, among),
        )

    def candidates(
        self, session: Session, text: AssistantText, picks: Sequence[Pick]
    ) -> tuple[list[int], list[TargetQ] | None]:
        vocab = session.target.vocab_size
        q_rows = [TargetQ(p.q[0], p.q[1], vocab) for p in picks if p.q is not None]
        return [p.target for p in picks], q_rows


class AssistantDrafter:
    """The assistant model: synced to the accepted text, drafting until its stop policy says
    stop, its drafts bridged into target candidates."""

    def __init__(
        self,
        *,
        assistant: CachedLM,
        prompt_ids: Sequence[int],
        policy: DraftRule,
        draw: DraftDistribution,
    ) -> None:
        self.assistant, self.prompt_ids, self.policy, self.draw = (
            assistant,
            prompt_ids,
            policy,
            draw,
        )
        self.text: AssistantText | None = None
        self._committed = 0
        self._recoded: list[int] | None = None

    def reset(self, session: Session) -> None:
        self.policy.reset()
        self.assistant.reset(self.prompt_ids, rollback=True)
        self.text = AssistantText(self.assistant, session.bridge)

    def _text(self) -> AssistantText:
        if self.text is None:
            raise RuntimeError("AssistantDrafter used before reset()")
        return self.text

    def propose(self, session: Session, *, clock: Stopwatch) -> Proposal:
        text, assistant, room = self._text(), self.assistant, session.room
        with clock("bridge"):  # only whole characters can be re-encoded
            heal = text.sync(session.bridge, session.text, heal=True, spells=self.draw.spells())
        healed = len(heal)
        with clock("verify"):  # the target's statistics count as verify time
            target_prob, target_entropy = session.verifier.target_stats()
        ctx = session.history.context(
            iteration=len(session.records),
            generated=session.generated,
            remaining=room,
            target_prob=target_prob,
            target_entropy=target_entropy,
            lag=len(assistant.ids) - assistant.cached,
        )
        # The first round prefills the prompt alone, exactly as target-alone does.
        ready = ends_on_char_boundary(session.text) and room > 1 and session.target.cached > 0
        with clock("policy"):
            budget = self.policy.budget(ctx) if ready else 0
        if assistant.cached == len(assistant.ids):
            budget = 0  # nothing new to feed: no fresh logits to draft from (rare)
        self._committed = text.count
        picks, steps, first_draft_s = self._draft(session, ctx, heal, budget, clock=clock)
        with clock("bridge"):
            if not picks:
                candidates, q_rows = [], None
            elif self._recoded is not None:  # the last step's own re-encoding (features on)
                candidates, q_rows = self._recoded, None
            else:
                candidates, q_rows = self.draw.candidates(session, text, picks)
        return Proposal(
            candidates=candidates,
            q_rows=q_rows,
            drafted=len(picks),
            steps=steps,
            first_draft_s=first_draft_s,
            lag=ctx.lag if picks else 0,
            healed=healed,
        )

    def _draft(
        self, session: Session, ctx: DraftContext, heal: bytes, budget: int, *, clock: Stopwatch
    ) -> tuple[list[Pick], list[DraftStep], float]:
        """Draft up to ``budget`` tokens, asking the policy after each: ``(picks, steps, the
        first step's seconds)``."""
        text, table = self._text(), session.bridge.assistant.table
        picks: list[Pick] = []
        steps: list[DraftStep] = []
        first_draft_s = 0.0
        cum_logprob, min_prob = 0.0, 1.0
        self._recoded = None
        for position in range(1, self.draw.max_steps(budget, session.room) + 1):
            with clock("draft"):
                pick = self.draw.pick(self.assistant, heal)
            if position == 1:
                first_draft_s = clock.seconds["draft"]
            if pick is None:
                break
            heal = heal[pick.respelled :]
            cum_logprob += math.log(max(pick.prob, 1e-30))
            min_prob = min(min_prob, pick.prob)
            text.append([pick.token])
            picks.append(pick)
            target_tokens = 1 if pick.target >= 0 else -1
            if session.rich and self.draw.recodes:  # with features on: each step's re-encoding
                with clock("bridge"):
                    self._recoded, _ = self.draw.candidates(session, text, picks)
                target_tokens = len(self._recoded)
            step = DraftStep(
                position=position,
                token_id=pick.token,
                token_bytes=table[pick.token],
                prob=pick.prob,
                entropy=pick.entropy,
                margin=pick.margin,
                cum_logprob=cum_logprob,
                min_prob=min_prob,
                target_tokens=target_tokens,
                context=ctx,
                repeat=repeat_length(session.prompt_bytes + text.generated) if session.rich else 0,
                respelled=pick.respelled,
            )
            steps.append(step)
            with clock("policy"):
                if self.policy.stop(step):
                    break
        return picks, steps, first_draft_s

    def settle(self, session: Session, done: Settled, *, clock: Stopwatch) -> int:
        """Keep the drafted tokens whose text the target accepted (the rest are dropped, the
        cache rolled back); a round it drafted in tells its policy how that went."""
        text = self._text()
        committed = self._committed if done.chosen else text.count
        with clock("bridge"):
            accepted = max(text.keep_prefix_of(session.text) - committed, 0)
        drafted = done.proposal.drafted if done.chosen else 0
        outcome = session.history.note_draft(drafted=drafted, accepted=accepted)
        if done.chosen:
            with clock("policy"):
                self.policy.update(outcome)
        return accepted
