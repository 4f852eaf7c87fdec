"""The speculative round, written once for greedy decoding and for sampling.

One round::

    choose   the plan's action for this round (``uag.decoding.plan``): a plain target step,
             a copy from prompt lookup, or an assistant draft
    propose  the drafter's target-id candidates (the assistant drafts, then its text is bridged
             into target ids; lookup copies them)
    verify   one target forward over the pending token and the candidates; the ``Verifier``
             keeps the prefix the target agrees with and adds the target's own next token
             (greedy: the argmax match; sampling: accept/resample, so every emitted token has
             the target's distribution)
    accept   the emitted tokens join the target's ids, cut at EOS and at max_new_tokens
    settle   every drafter is told what was accepted (the assistant keeps its drafted tokens
             inside the accepted text; policies adapt)
    record   the round's counts and time split (``IterationRecord``)

What differs between greedy and sampling is the ``Verifier`` and the assistant's draft
distribution (``uag.decoding.drafters``), nothing else. Drafters are objects behind one
protocol, so a new drafter (a suffix index, another assistant) needs no change here.

Equal to target-alone *by construction*: the first round's forward prefills the prompt alone
(the call target-alone makes), and no verify has more than ``ROWWISE_MAX_ROWS`` rows, the
range row-count-invariant kernels are checked on (``uag.decoding.verifiers`` guards the rest).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from uag.decoding.bridge import Bridge
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.decoding.sampling import SamplingConfig, TargetQ
from uag.decoding.stopwatch import Stopwatch
from uag.kernels.choice import ROWWISE_MAX_ROWS
from uag.runtime.runner import CachedLM

StopReason = Literal["eos", "max_new_tokens", "halted"]
"""Why a run ended: an end-of-sequence token, the budget, or ``on_tokens`` asked to halt (a
stop string was reached, the client went away)."""
MAX_CANDIDATES = ROWWISE_MAX_ROWS - 1
"""Candidates per verify, so a verify never leaves the row-count range kernels are checked on."""
OnTokens = Callable[[list[int]], "bool | None"]
"""Receives each round's emitted target ids; returning True halts the run after that round
(what was emitted stays emitted: the output is still a prefix of the target's own)."""


@dataclass(frozen=True)
class IterationRecord:
    """What one round did and what it cost."""

    drafted: int
    """Assistant tokens drafted."""
    candidates: int
    """Target tokens proposed to the verifier (drafted text re-encoded, or copied)."""
    accepted_candidates: int
    """Candidate target tokens equal to the target's own choice."""
    emitted: int
    """Target tokens added to the output (accepted candidates + the target's own next token)."""
    accepted_drafts: int
    """Drafted assistant tokens whose text lies inside the accepted text."""
    draft_s: float
    verify_s: float
    bridge_s: float
    policy_s: float
    steps: tuple[DraftStep, ...] = field(default=(), repr=False)
    recomputed: int = 0
    """Verified positions recomputed alone because of a near-tie (non-invariant kernels only)."""
    first_draft_s: float = 0.0
    """The round's first draft step alone: it also feeds the assistant the text it lags by
    (catch-up rows; in the first drafting round, the whole prompt)."""
    round_s: float = 0.0
    """Wall time of the whole round: draft, verify and everything around them."""
    accept_probs: tuple[float, ...] = field(default=(), repr=False)
    """Sampling with ``keep_steps``: per drafted token, the probability given the drafts that
    it and every draft before it are accepted (``uag.decoding.sampling.expected_acceptance``)."""
    accept_rates: tuple[float, ...] = field(default=(), repr=False)
    """Sampling with ``keep_steps``: per drafted token, Σ min(p, q) at its position."""
    lookup: bool = False
    """The candidates were copied by prompt lookup (``uag.decoding.lookup``): nothing was
    drafted."""
    lag: int = 0
    """Tokens the assistant was fed by the round's first draft step (``DraftContext.lag``); 0
    when it did not draft."""
    healed: int = 0
    """Bytes of the target's text the assistant gave back at the round's sync for its first
    draft to spell again (token healing, ``AssistantText.sync``); 0 when not healed."""
    action: str = ""
    """The plan's action for the round, by name (``uag.decoding.actions``: ``step``,
    ``copy:3``, ``draft:4``, ``draft``)."""


@dataclass
class LoopOutput:
    """Generated target ids (prompt excluded) and how the loop got there."""

    ids: list[int]
    stop_reason: StopReason
    seconds: float
    iterations: list[IterationRecord]


@dataclass
class Proposal:
    """What a drafter offers this round's verify."""

    candidates: list[int] = field(default_factory=list)
    """Target ids to verify after the pending token."""
    q_rows: list[TargetQ] | None = None
    """Sampling: the distribution each candidate was drawn from, over target ids. None: the
    candidates were proposed with certainty (a copy), verified as point masses."""
    drafted: int = 0
    """Assistant tokens drafted for them (0 for a copy)."""
    steps: list[DraftStep] = field(default_factory=list)
    first_draft_s: float = 0.0
    lag: int = 0
    healed: int = 0
    copied: bool = False
    """Copied by prompt lookup (``IterationRecord.lookup``)."""


@dataclass(frozen=True)
class Settled:
    """What every drafter is told once a round is committed."""

    proposal: Proposal
    """What the round verified (whichever drafter proposed it)."""
    emitted: list[int]
    """The target tokens the round committed."""
    chosen: bool
    """This drafter proposed the round."""


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided over one verify's rows (before EOS and length cuts)."""

    accepted: int
    """Leading candidates accepted."""
    emitted: list[int]
    """The accepted candidates and the target's own token after them."""
    recomputed: int = 0
    accept_probs: tuple[float, ...] = ()
    accept_rates: tuple[float, ...] = ()


@dataclass
class History:
    """How the drafts of this sequence have fared, and what prompt lookup's rounds verified and
    emitted: what each round's ``DraftContext`` reports."""

    prev: IterationOutcome = IterationOutcome(drafted=0, accepted=0)
    """The last round that drafted: a skipped round says nothing about agreement, and
    forgetting would lock a gate that skips once into skipping."""
    drafts: IterationOutcome = IterationOutcome(drafted=0, accepted=0)
    """Every drafting round so far, summed: the candidates the assistant's drafts proposed and
    the ones the target accepted."""
    copies: int = 0
    copied: int = 0
    copy_emitted: int = 0
    """Prompt lookup's rounds, the candidates they verified and the tokens they emitted
    (``DraftContext``'s fields of those names)."""

    def context(
        self,
        *,
        iteration: int,
        generated: int,
        remaining: int,
        target_prob: float,
        target_entropy: float,
        lag: int = 0,
    ) -> DraftContext:
        return DraftContext(
            iteration=iteration,
            generated=generated,
            remaining=remaining,
            prev_drafted=self.prev.drafted,
            prev_accepted=self.prev.accepted,
            drafted_total=self.drafts.drafted,
            accepted_total=self.drafts.accepted,
            target_prob=target_prob,
            target_entropy=target_entropy,
            lag=lag,
            copies=self.copies,
            copied=self.copied,
            copy_emitted=self.copy_emitted,
        )

    def note_draft(self, *, drafted: int, accepted: int) -> IterationOutcome:
        """A round the assistant drafted in (or was asked and drafted nothing)."""
        outcome = IterationOutcome(drafted=drafted, accepted=accepted)
        if drafted:
            self.prev = outcome
        self.drafts = IterationOutcome(
            drafted=self.drafts.drafted + drafted, accepted=self.drafts.accepted + accepted
        )
        return outcome

    def note_copy(self, *, candidates: int, emitted: int) -> None:
        """A round verified prompt lookup's copy: the policy was not asked, but what such rounds
        cost and yield changes what its own rounds are worth (``controllers.cost``)."""
        self.copies += 1
        self.copied += candidates
        self.copy_emitted += emitted


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What one generation asks, asked alike of the speculative loop (``decode``) and of the
    target-alone reference (``target_only_loop``), so that the two cannot be asked different
    things: the target, its stop ids, the prompt as target ids, the budget, and who hears each
    round's emitted ids."""

    target: CachedLM
    eos: frozenset[int]
    prompt_ids: Sequence[int]
    max_new_tokens: int
    on_tokens: OnTokens | None = None


@dataclass(kw_only=True)
class Session:
    """One generation's state, shared by the round's phases and the drafters."""

    gen: Generation
    bridge: Bridge
    verifier: Verifier
    keep_steps: bool = False
    rich: bool = False
    """Features are read: the target's statistics, per-step re-encodings, the repeat length."""
    start: int = 0
    text: bytearray = field(default_factory=bytearray)
    """The target's generated text, as bytes."""
    prompt_bytes: bytes = b""
    """The prompt's text, for the ``repeat`` feature (only when features are read)."""
    history: History = field(default_factory=History)
    records: list[IterationRecord] = field(default_factory=list)

    @property
    def target(self) -> CachedLM:
        return self.gen.target

    @property
    def prompt_ids(self) -> Sequence[int]:
        return self.gen.prompt_ids

    @property
    def generated(self) -> int:
        return len(self.target.ids) - self.start

    @property
    def room(self) -> int:
        """Target tokens this generation may still emit."""
        return self.gen.max_new_tokens - self.generated


class Drafter(Protocol):
    """Proposes target-id candidates for a round and is told what was accepted."""

    def reset(self, session: Session) -> None: ...

    def propose(self, session: Session, *, clock: Stopwatch) -> Proposal: ...

    def settle(self, session: Session, done: Settled, *, clock: Stopwatch) -> int:
        """``done.emitted`` were committed (their text is in ``session.text``); return how
        many of this drafter's own drafted tokens the target accepted."""


class DrafterChoice(Protocol):
    """Decides which drafter (or none) proposes each round (``uag.decoding.plan.PlanRunner``:
    the plan's action and the drafter that runs it)."""

    @property
    def drafters(self) -> tuple[Drafter, ...]: ...

    def choose(self, session: Session) -> tuple[str, Drafter | None]:
        """``(the round's action name, its drafter)``; None: a plain target step."""


class Verifier(Protocol):
    """Decides which candidates the target keeps, from one forward's rows."""

    @property
    def sampling(self) -> SamplingConfig | None:
        """What it samples with (None: greedy)."""

    def reset(self) -> None: ...

    def judge(
        self, session: Session, *, base: int, hidden: torch.Tensor, proposal: Proposal
    ) -> Verdict: ...

    def committed(self, session: Session, *, emitted: int) -> None:
        """``emitted`` tokens were committed (after EOS and length cuts)."""

    def target_stats(self) -> tuple[float, float]:
        """The target's probability and entropy at the last token it emitted (NaN: unknown)."""


def clip(emitted: list[int], *, eos_ids: frozenset[int], room: int) -> tuple[list[int], bool]:
    """Cut ``emitted`` after the first EOS and to ``room`` tokens; say whether EOS was hit."""
    for i, tok in enumerate(emitted[:room]):
        if tok in eos_ids:
            return emitted[: i + 1], True
    return emitted[:room], False


def commit(target: CachedLM, *, base: int, accepted: int, emitted: list[int]) -> int:
    """After a verify from ``base``: keep the accepted candidates cached, append the rest of
    ``emitted`` (uncached); return how many emitted tokens were already in the cache."""
    in_cache = min(accepted, len(emitted))
    target.truncate(base + in_cache)
    target.ids.extend(emitted[in_cache:])
    return in_cache


def decode(*, session: Session, choice: DrafterChoice) -> LoopOutput:
    """Rounds until EOS or ``max_new_tokens``: the output is the target's own (greedy), or
    distributed as the target's own (sampling)."""
    on_tokens = session.gen.on_tokens
    started = time.perf_counter()
    start(session, choice)
    reason: StopReason = "max_new_tokens"
    while (room := session.room) > 0:
        clock = Stopwatch()
        action, drafter = choose(session, choice, clock=clock)
        proposal = propose(session, drafter, clock=clock)
        base, verdict = verify(session, proposal, clock=clock)
        emitted, in_cache, hit_eos = accept(session, verdict, base=base, room=room, clock=clock)
        halt = bool(on_tokens(emitted)) if on_tokens else False
        accepted = settle(session, choice, drafter, proposal=proposal, emitted=emitted, clock=clock)
        record(
            session,
            proposal,
            verdict,
            emitted=emitted,
            in_cache=in_cache,
            accepted_drafts=accepted,
            action=action,
            clock=clock,
        )
        if hit_eos or halt:
            reason = "eos" if hit_eos else "halted"
            break
    return LoopOutput(
        ids=session.target.ids[session.start :],
        stop_reason=reason,
        seconds=time.perf_counter() - started,
        iterations=session.records,
    )


def start(session: Session, choice: DrafterChoice) -> None:
    """The prompt goes to the target (prefilled by the first round's verify) and drafters."""
    session.target.reset(session.prompt_ids, rollback=True)
    session.start = len(session.target.ids)
    if session.rich:
        session.prompt_bytes = session.bridge.target.bytes_of(session.prompt_ids)
    session.verifier.reset()
    for drafter in choice.drafters:
        drafter.reset(session)


def choose(
    session: Session, choice: DrafterChoice, *, clock: Stopwatch
) -> tuple[str, Drafter | None]:
    """The round's action and drafter, timed as the policy's decision (a rule's lookup match,
    computed once a round, is part of what it decides on)."""
    with clock("policy"):
        return choice.choose(session)


def propose(session: Session, drafter: Drafter | None, *, clock: Stopwatch) -> Proposal:
    """The chosen drafter's candidates; none for a plain target step."""
    return Proposal() if drafter is None else drafter.propose(session, clock=clock)


def verify(session: Session, proposal: Proposal, *, clock: Stopwatch) -> tuple[int, Verdict]:
    """One target forward over the pending token(s) and the candidates, judged by the
    verifier: ``(the target's length before the candidates, verdict)``."""
    target = session.target
    with clock("verify"):
        base = len(target.ids)
        target.ids.extend(proposal.candidates)
        hidden = target.forward()
        return base, session.verifier.judge(session, base=base, hidden=hidden, proposal=proposal)


def accept(
    session: Session, verdict: Verdict, *, base: int, room: int, clock: Stopwatch
) -> tuple[list[int], int, bool]:
    """Commit the verdict, cut at EOS and at ``room``: ``(emitted, emitted tokens already
    cached, hit EOS)``. Counted as verify time (cache bookkeeping of that forward)."""
    with clock("verify"):
        emitted, hit_eos = clip(verdict.emitted, eos_ids=session.gen.eos, room=room)
        in_cache = commit(session.target, base=base, accepted=verdict.accepted, emitted=emitted)
        session.verifier.committed(session, emitted=len(emitted))
    session.text += session.bridge.target.bytes_of(emitted)
    return emitted, in_cache, hit_eos


def settle(
    session: Session,
    choice: DrafterChoice,
    chosen: Drafter | None,
    *,
    proposal: Proposal,
    emitted: list[int],
    clock: Stopwatch,
) -> int:
    """Every drafter learns what the target accepted, whether it proposed or not; return the
    drafted tokens accepted."""
    return sum(
        drafter.settle(session, Settled(proposal, emitted, drafter is chosen), clock=clock)
        for drafter in choice.drafters
    )


def record(
    session: Session,
    proposal: Proposal,
    verdict: Verdict,
    *,
    emitted: list[int],
    in_cache: int,
    accepted_drafts: int,
    action: str,
    clock: Stopwatch,
) -> None:
    """The round's counts and time split join the session's records."""
    seconds = clock.seconds
    session.records.append(
        IterationRecord(
            drafted=proposal.drafted,
            candidates=len(proposal.candidates),
            accepted_candidates=in_cache,
            emitted=len(emitted),
            accepted_drafts=accepted_drafts,
            draft_s=seconds["draft"],
            verify_s=seconds["verify"],
            bridge_s=seconds["bridge"],
            policy_s=seconds["policy"],
            steps=tuple(proposal.steps) if session.keep_steps else (),
            recomputed=verdict.recomputed,
            first_draft_s=proposal.first_draft_s,
            round_s=clock.elapsed(),
            accept_probs=verdict.accept_probs,
            accept_rates=verdict.accept_rates,
            lookup=proposal.copied,
            lag=proposal.lag,
            healed=proposal.healed,
            action=action,
        )
    )


def target_only_loop(gen: Generation, *, next_token: Callable[[torch.Tensor], int]) -> LoopOutput:
    """The reference: the target alone, one token per forward, no round machinery at all.
    ``next_token`` picks it from the last hidden state ``[1, h]`` (greedy or sampled)."""
    start_time = time.perf_counter()
    target = gen.target
    target.reset(gen.prompt_ids, rollback=False)
    first = len(target.ids)
    reason: StopReason = "max_new_tokens"
    while len(target.ids) - first < gen.max_new_tokens:
        tok = next_token(target.forward()[-1:])
        target.ids.append(tok)
        halt = bool(gen.on_tokens([tok])) if gen.on_tokens else False
        if tok in gen.eos or halt:
            reason = "eos" if tok in gen.eos else "halted"
            break
    return LoopOutput(
        ids=target.ids[first:],
        stop_reason=reason,
        seconds=time.perf_counter() - start_time,
        iterations=[],
    )
