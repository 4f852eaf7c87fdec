"""What the target keeps of a round's candidates: greedy argmax match, or speculative sampling.

Both judge the rows of one target forward over the pending token and the candidates; the round
(``uag.decoding.round.verify``) runs that forward and commits what they return.
"""

from __future__ import annotations

import math

import torch

from uag.decoding.round import Proposal, Session, Verdict
from uag.decoding.sampling import (
    PointQ,
    PositionDraws,
    ProcessedRows,
    SamplingConfig,
    TargetQ,
    expected_acceptance,
    verify_draft,
)
from uag.runtime.runner import CachedLM, HeadOutput

TIE_BOUND = 4e-3
"""Least logit margin under which a verified position is recomputed alone, on paths that fail
the load-time row-count check (``uag.runtime.invariance``). float32: differences measured on
the real target are ≤ 9e-5 per logit end to end (MKL and oneDNN linears, fused attention), so a
flip needs a margin under ~2e-4; this bound is 20x that."""
TIE_ULPS = 8
"""In low precision the bound grows with the dtype's rounding at the logits' magnitude: a
position computed alone and among others differed by up to 1.5 units in the last place of its
largest logit in bfloat16 (0.188 at logits ~26, a Gemma-shaped model on the plain path); a
margin under 8 such units is recomputed (``tie_bound``)."""


class GreedyVerifier:
    """Keep the longest candidate prefix equal to the target's own argmax, then the target's
    token after it (the correction at the first mismatch, or the bonus after a full match): the
    output is exactly the target's, and every round makes progress.

    With row-count-invariant kernels (native by construction; any other path that passes the
    load-time check, ``uag.runtime.invariance``) that is bitwise what target-alone computes. On
    a path that fails the check a row may round differently with the row count, so a verified
    position whose top-2 margin is under ``tie_bound`` is recomputed with one-row forwards from
    the round's first position (see docs/lossless.md for what holds).
    """

    sampling: SamplingConfig | None = None
    """Greedy: nothing is sampled."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._head: HeadOutput | None = None
        self._alone: HeadOutput | None = None
        self._accepted = 0
        # The head row that chose the last emitted token, its statistics not yet read: computed
        # (~0.6 ms) only when a round asks for them, not after every copied round.
        self._last_row: tuple[HeadOutput, int] | None = None
        self._stats = (math.nan, math.nan)

    def judge(
        self, session: Session, *, base: int, hidden: torch.Tensor, proposal: Proposal
    ) -> Verdict:
        target, candidates = session.target, proposal.candidates
        head = target.greedy(hidden[-(len(candidates) + 1) :])
        preds = head.ids  # [m + 1]: the target's choice after the pending token and each candidate
        accepted = 0
        while accepted < len(candidates) and candidates[accepted] == preds[accepted]:
            accepted += 1
        alone: HeadOutput | None = None  # the tied row's choice, recomputed in a one-row forward
        if candidates and not target.row_invariant:
            tie = _first_near_tie(head, upto=accepted)
            if tie is not None:  # the candidates before it stand; its choice is recomputed
                accepted = tie
                alone = _recompute_alone(target, row=tie, base=base)
                preds = [*preds[:tie], alone.ids[0]]
        self._head, self._alone, self._accepted = head, alone, accepted
        return Verdict(
            accepted=accepted,
            emitted=[*candidates[:accepted], preds[accepted]],
            recomputed=int(alone is not None),
        )

    def committed(self, session: Session, *, emitted: int) -> None:
        """Keep the head row that chose the last emitted token: the next round's features."""
        if not session.rich or self._head is None:
            return
        last = emitted - 1
        if self._alone is not None and last == self._accepted:
            self._last_row = (self._alone, 0)
        else:
            self._last_row = (self._head, last)

    def target_stats(self) -> tuple[float, float]:
        if self._last_row is not None:
            self._stats = self._last_row[0].stats(self._last_row[1])
            self._last_row = None
        return self._stats


def tie_bound(logits: torch.Tensor) -> float:
    """The margin under which one head row's argmax may differ between a row computed alone and
    among others: ``TIE_BOUND``, or ``TIE_ULPS`` units in the last place of the row's largest
    logit in the logits' own dtype, whichever is larger (bf16: ~1 at logits ~26)."""
    if logits.dtype == torch.float32:
        return TIE_BOUND
    scale = float(logits.abs().max())
    return max(TIE_BOUND, TIE_ULPS * torch.finfo(logits.dtype).eps * scale)


def _first_near_tie(head: HeadOutput, *, upto: int) -> int | None:
    """The first head row in ``0..upto`` whose top-2 logit margin is under its ``tie_bound``."""
    return next(
        (row for row in range(upto + 1) if head.margin(row) < tie_bound(head.logits[row])),
        None,
    )


def _recompute_alone(target: CachedLM, *, row: int, base: int) -> HeadOutput:
    """The target's choice after verified row ``row``, computed as target-alone would.

    ``base`` is ``len(target.ids)`` before the candidates were appended, so rows ``0..row`` fed
    ids ``base - 1 .. base - 1 + row``. Those are fed again one row per forward: the keys and
    values the tied row attends to are then the ones one-row steps write, not the verify's
    (which a path failing the row-count check may round differently). Costs ``row + 1`` one-row
    forwards, only at a near-tie.
    """
    fed = target.ids[base - 1 : base + row]
    target.truncate(base - 1)
    hidden = None
    for token in fed:
        target.ids.append(token)
        hidden = target.forward()
    assert hidden is not None
    return target.greedy(hidden[-1:])


class SamplingVerifier:
    """Speculative sampling's accept/resample rule (``uag.decoding.sampling.verify_draft``) on
    the target's processed distribution: every emitted token is distributed as the target's
    own. A copied candidate is a point mass, kept when it equals its position's own sample
    (``PositionDraws``): a run of copies and steps emits what target-alone sampling emits with
    the same seed."""

    def __init__(
        self, *, sampling: SamplingConfig, gen: torch.Generator, own: PositionDraws
    ) -> None:
        self.sampling, self.gen, self.own = sampling, gen, own

    def reset(self) -> None:
        pass

    def judge(
        self, session: Session, *, base: int, hidden: torch.Tensor, proposal: Proposal
    ) -> Verdict:
        target, draft = session.target, proposal.candidates
        rows = target.full_logits(hidden[-(len(draft) + 1) :])  # [m + 1, V]
        p_row = ProcessedRows(rows, self.sampling)
        q_rows: list[TargetQ] = (
            proposal.q_rows
            if proposal.q_rows is not None
            else [PointQ(t, target.vocab_size) for t in draft]
        )
        emitted, accepted = verify_draft(
            draft=draft,
            q_rows=q_rows,
            p_row=p_row,
            gen=self.gen,
            own=lambda i: self.own(base + i),  # row i decides the token at position base + i
        )
        soft: tuple[float, ...] = ()
        rates: tuple[float, ...] = ()
        if session.keep_steps and proposal.q_rows is not None:
            soft, rates = expected_acceptance(draft, q_rows, p_row)
        return Verdict(accepted=accepted, emitted=emitted, accept_probs=soft, accept_rates=rates)

    def committed(self, session: Session, *, emitted: int) -> None:
        pass

    def target_stats(self) -> tuple[float, float]:
        return (math.nan, math.nan)
