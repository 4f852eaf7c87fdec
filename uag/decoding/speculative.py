"""The speculative decoding loop over token ids (greedy, batch size 1).

It knows nothing of tokenizers or files: it moves ids between two ``CachedLM``s, and asks the
``Bridge`` (bytes in, ids out) whenever text crosses from one vocabulary to the other.

One iteration:

1. *sync*: the assistant is brought up to the target's accepted text (re-encoded, look-behind);
2. *draft*: the assistant proposes tokens one at a time, asking the policy after each;
3. *bridge*: the drafted text becomes target candidate ids;
4. *verify*: one target forward over [pending token + candidates]; the longest prefix equal to
   the target's own argmax is accepted, and the target's next token after it (the correction at
   the first mismatch, or the bonus after a full match) is always emitted, so every iteration
   makes progress and the output is exactly what the target alone would produce;
5. *resync*: the assistant keeps the drafted tokens whose text lies inside the accepted text
   (these are the "accepted" labels) and drops the rest, cropping both KV caches.

Equal to target-alone *by construction*, not by luck: a position's logits must not depend on how
many positions share the target forward. The first round prefills the prompt alone (the call
target-alone makes), and every later forward has at most ``ROWWISE_MAX_ROWS`` rows. With the
row-count-invariant kernels of ``uag.kernels.choice`` (CPU) that is enough: bitwise equal. With other
kernels (CUDA, ``--kernels plain``) a row may round differently by up to ~1e-4 in a logit, so a
verified position whose top-2 margin is under ``TIE_BOUND`` is recomputed alone, as
target-alone computes it.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from uag.decoding.bridge import Bridge, ends_on_char_boundary
from uag.decoding.features import repeat_length
from uag.decoding.lookup import PromptLookup
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome, StopPolicy
from uag.kernels.choice import ROWWISE_MAX_ROWS
from uag.runtime.runner import CachedLM, HeadOutput

StopReason = Literal["eos", "max_new_tokens"]
TIE_BOUND = 4e-3
"""Logit margin under which a verified position is recomputed alone (non-invariant kernels).
Row-count differences measured on the real target: ≤ 9e-5 per logit end to end (MKL and oneDNN
linears, fused attention), so a flip needs a margin under ~2e-4; this bound is 20x that."""
MAX_CANDIDATES = ROWWISE_MAX_ROWS - 1
"""Candidates per verify, so a verify never leaves the row-count range kernels are checked on."""
OnTokens = Callable[[list[int]], None]


@dataclass(frozen=True)
class IterationRecord:
    """What one draft → verify round did and what it cost."""

    drafted: int
    """Assistant tokens drafted."""
    candidates: int
    """Target tokens proposed to the verifier (drafted text re-encoded)."""
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
    """The candidates were copied by prompt lookup (``uag.decoding.lookup``): nothing was drafted."""
    lag: int = 0
    """Tokens the assistant was fed by the round's first draft step (``DraftContext.lag``); 0
    when it did not draft."""
    healed: int = 0
    """Bytes of the target's text the assistant gave back at the round's sync for its first
    draft to spell again (token healing, ``_AssistantText.sync``); 0 when not healed."""


@dataclass
class LoopOutput:
    """Generated target ids (prompt excluded) and how the loop got there."""

    ids: list[int]
    stop_reason: StopReason
    seconds: float
    iterations: list[IterationRecord]


def _common_prefix_len(a: bytes | bytearray, b: bytes | bytearray) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: O(n log n) bytes compared, no Python loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _clip(emitted: list[int], *, eos_ids: frozenset[int], room: int) -> tuple[list[int], bool]:
    """Cut ``emitted`` after the first EOS and to ``room`` tokens; say whether EOS was hit."""
    for i, tok in enumerate(emitted[:room]):
        if tok in eos_ids:
            return emitted[: i + 1], True
    return emitted[:room], False


def target_only_generate(
    *,
    target: CachedLM,
    target_eos: frozenset[int],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    on_tokens: OnTokens | None = None,
) -> LoopOutput:
    """Plain greedy decoding with the same forward and head as verification (the reference)."""
    return target_only_loop(
        target=target,
        target_eos=target_eos,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        on_tokens=on_tokens,
        next_token=lambda hidden: target.greedy(hidden).ids[0],
    )


def target_only_loop(
    *,
    target: CachedLM,
    target_eos: frozenset[int],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    on_tokens: OnTokens | None,
    next_token: Callable[[torch.Tensor], int],
) -> LoopOutput:
    """The target alone, one token per forward: ``next_token`` picks it from the last hidden
    state ``[1, h]`` (greedy or sampled)."""
    start_time = time.perf_counter()
    target.reset(prompt_ids, rollback=False)
    start = len(target.ids)
    reason: StopReason = "max_new_tokens"
    while len(target.ids) - start < max_new_tokens:
        tok = next_token(target.forward()[-1:])
        target.ids.append(tok)
        if on_tokens:
            on_tokens([tok])
        if tok in target_eos:
            reason = "eos"
            break
    return LoopOutput(
        ids=target.ids[start:],
        stop_reason=reason,
        seconds=time.perf_counter() - start_time,
        iterations=[],
    )


_HEALED = (b" ", b"\t", b"\n", b"\r")
"""Last bytes after which ``_AssistantText.sync`` heals the assistant's last token."""


def _indented(text: bytes) -> bool:
    """Whether the last line of ``text`` with anything on it starts with a space or a tab."""
    line = text.rstrip(b"\r\n").rsplit(b"\n", 1)[-1]
    return line[:1] in (b" ", b"\t") and bool(line.strip())


class _AssistantText:
    """The assistant's ids from its prompt's last few on, with their cumulative byte offsets.

    The prompt's last ``lookbehind`` tokens are tracked too (``lead``: their bytes), so that a
    sync may encode them again with the text that follows (``TokenText.resync``); ``data``
    holds ``lead`` and then the generated text, ``generated`` the latter alone.
    """

    def __init__(self, lm: CachedLM, bridge: Bridge) -> None:
        self.lm = lm
        self.side = bridge.assistant
        self.lookbehind = bridge.lookbehind
        self.recode = not bridge.shared_vocabulary
        """Re-encode across boundaries and heal (a vocabulary of its own: see ``sync``)."""
        self.start = max(len(lm.ids) - bridge.lookbehind, 0)
        self.data = bytearray()
        self.ends: list[int] = []  # ends[j]: byte length after tracked token j
        for tok in lm.ids[self.start :]:
            self.data += self.side.table[tok]
            self.ends.append(len(self.data))
        self.lead = bytes(self.data)

    @property
    def count(self) -> int:
        return len(self.ends)

    @property
    def generated(self) -> bytes:
        """The assistant's text after its prompt (drafts included)."""
        return bytes(self.data[len(self.lead) :])

    def append(self, ids: Sequence[int]) -> None:
        for tok in ids:
            self.data += self.side.table[tok]
            self.ends.append(len(self.data))
        self.lm.ids.extend(ids)

    def _keep(self, keep: int) -> None:
        """Keep the first ``keep`` tracked tokens (the cache rolls back with them)."""
        del self.ends[keep:]
        del self.data[self.ends[-1] if self.ends else 0 :]
        self.lm.truncate(self.start + keep)

    def sync(
        self,
        bridge: Bridge,
        text: bytes | bytearray,
        *,
        heal: bool = False,
        spells: Callable[[bytes], bool] | None = None,
    ) -> bytes:
        """Feed the assistant the target text it has not seen (whole characters only), its
        last tokens encoded again with it where the tokenizer merges across the boundary.

        ``heal``: where the text now ends in whitespace, take its last character (a newline:
        its last token, and only after an indented line) back and return those bytes, which
        the next draft must spell before anything new (greedy: ``fitting``; sampling:
        ``uag.decoding.sampling.Intersection.healed``): token healing. Why: a
        byte-level BPE joins whitespace to what follows (``\n···`` + ``·return``), so a text
        that stops after it ends on a split the assistant rarely saw. On 12 held-out prompts
        (static-2), rounds whose assistant text ended in a space or a tab had their first draft
        accepted 21 % of the time, after a newline 0 %, the other rounds 84 %; they were 23 %
        of the rounds. Returns b"" when nothing is healed. Not where both sides share a
        vocabulary: there the assistant sees the target's own split. ``spells``: whether the
        next draft can spell those bytes (default: some draft id starts with them or with a
        prefix of them; sampling needs one id spelling them and then one target token).
        """
        new = (self.lead + text)[len(self.data) :]
        tail = self.lm.ids[-self.lookbehind :]
        if not self.recode:  # the same ids as the target: its own split is the best context
            self.append(self.side.continuation(tail=self.side.bytes_of(tail), new=new)[0])
            return b""
        self._feed(new)
        if not heal or not self.ends:
            return b""
        last = self.side.table[self.lm.ids[-1]]
        if last[-1:] not in _HEALED:
            return b""
        # A run of spaces or tabs keeps all but its last character (a byte-level BPE gives that
        # one to the next word: ``\n···`` + ``·return``), so the one drafted token that spells
        # it again also carries new text.
        if last.endswith((b"\n", b"\r")):
            # Healed whole, and only after an indented line: code, where the next line is
            # likely indented too. After prose the assistant mostly drafts the newline again,
            # a forward that spells no new text (measured: static-2 lost ~4 % on `mixed`).
            if not _indented(bytes(self.data[: len(self.data) - len(last)])):
                return b""
            spell = last
        else:
            spell = last[-1:]
        if spells is None:
            if self.side.fitting(spell, below=self.lm.draft_limit).size == 0:
                return b""
        elif not spells(spell):
            return b""
        keep = self.count - 1
        rest = last[: len(last) - len(spell)]
        if not rest and self.start + keep <= self.lm.cached:  # the logits before it are gone
            if keep == 0:
                return b""
            keep -= 1  # so the token before it is fed again
        again = self.lm.ids[self.start + keep : -1]
        self._keep(keep)
        self.append(again)
        if rest:
            self._feed(rest)
        return spell

    def _feed(self, new: bytes) -> None:
        """Append ``new``, the tail tokens a merge crosses encoded again with it."""
        drop, ids = self.side.resync(tail_ids=self.lm.ids[-self.lookbehind :], new=new)
        if drop:
            self._keep(self.count - drop)
        self.append(ids)

    def keep_prefix_of(self, text: bytes | bytearray) -> int:
        """Keep the longest token prefix whose bytes are a prefix of ``lead + text``; return
        its length in tokens (``lead``'s included)."""
        keep = bisect.bisect_right(self.ends, _common_prefix_len(self.data, self.lead + text))
        self._keep(keep)
        return keep


def _commit(target: CachedLM, *, base: int, accepted: int, emitted: list[int]) -> int:
    """After a verify from ``base``: keep the accepted candidates cached, append the rest of
    ``emitted`` (uncached); return how many emitted tokens were already in the cache."""
    in_cache = min(accepted, len(emitted))
    target.truncate(base + in_cache)
    target.ids.extend(emitted[in_cache:])
    return in_cache


@dataclass
class _Agreement:
    """How the two models have agreed so far, and what prompt lookup's rounds verified and
    emitted (``note_copy``): what each round's ``DraftContext`` reports."""

    prev: IterationOutcome = IterationOutcome(drafted=0, accepted=0)
    """The last round that drafted: a skipped round says nothing about agreement, and
    forgetting would lock a gate that skips once into skipping."""
    drafted_total: int = 0
    accepted_total: int = 0
    copies: int = 0
    copied: int = 0
    copy_emitted: int = 0

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
            drafted_total=self.drafted_total,
            accepted_total=self.accepted_total,
            target_prob=target_prob,
            target_entropy=target_entropy,
            lag=lag,
            copies=self.copies,
            copied=self.copied,
            copy_emitted=self.copy_emitted,
        )

    def settle(
        self, a_text: _AssistantText, text: bytes | bytearray, *, committed: int, drafted: int
    ) -> IterationOutcome:
        """Resync: keep the drafted tokens whose text the target accepted; record the round."""
        accepted = max(a_text.keep_prefix_of(text) - committed, 0)
        outcome = IterationOutcome(drafted=drafted, accepted=accepted)
        if drafted:
            self.prev = outcome
        self.drafted_total += drafted
        self.accepted_total += accepted
        return outcome

    def note_copy(self, *, candidates: int, emitted: int) -> None:
        """A round verified prompt lookup's copy: the policy was not asked, but what such rounds
        cost and yield changes what its own rounds are worth (``controllers.cost``)."""
        self.copies += 1
        self.copied += candidates
        self.copy_emitted += emitted


def _candidates(
    bridge: Bridge, target: CachedLM, text: bytearray, assistant_text: bytes, room: int
) -> list[int]:
    """Target ids for the drafted text past the target's own text (whole characters only)."""
    if assistant_text[: len(text)] != text:
        return []  # the assistant lags inside a character the target has not finished
    ids, _ = bridge.target.continuation(
        tail=bridge.tail(bridge.target, target.ids), new=bytes(assistant_text[len(text) :])
    )
    return ids[: min(room - 1, MAX_CANDIDATES)]


def _first_near_tie(head: HeadOutput, *, upto: int) -> int | None:
    """The first head row in ``0..upto`` whose top-2 logit margin is under ``TIE_BOUND``."""
    return next((row for row in range(upto + 1) if head.margin(row) < TIE_BOUND), None)


def _recompute_alone(target: CachedLM, *, row: int, base: int) -> HeadOutput:
    """The target's choice after verified row ``row``, computed in a one-row forward.

    ``base`` is ``len(target.ids)`` before the candidates were appended, so row ``row`` fed id
    ``base - 1 + row``. The cache keeps everything before it; the id is fed again alone.
    """
    fed = target.ids[base - 1 + row]
    target.truncate(base - 1 + row)
    target.ids.append(fed)
    return target.greedy(target.forward()[-1:])


def speculative_generate(
    *,
    target: CachedLM,
    assistant: CachedLM,
    bridge: Bridge,
    target_eos: frozenset[int],
    assistant_eos: frozenset[int],
    prompt_target_ids: Sequence[int],
    prompt_assistant_ids: Sequence[int],
    policy: StopPolicy,
    max_new_tokens: int,
    on_tokens: OnTokens | None = None,
    keep_steps: bool = False,
    lookup: PromptLookup | None = None,
) -> LoopOutput:
    """Greedy UAG: token-for-token what ``target_only_generate`` returns, in fewer target passes.

    With ``lookup``, a round whose last target tokens occurred before verifies the copied
    continuation instead of drafting (the policy is not asked; the assistant catches up later).
    """
    clock = time.perf_counter
    start_time = clock()
    policy.reset()
    target.reset(prompt_target_ids, rollback=True)
    assistant.reset(prompt_assistant_ids, rollback=True)
    t_start = len(target.ids)
    text = bytearray()  # the target's generated text, as bytes
    a_text = _AssistantText(assistant, bridge)
    records: list[IterationRecord] = []
    reason: StopReason = "max_new_tokens"
    agreement = _Agreement()
    target_prob = target_entropy = math.nan
    # The head row that chose the last emitted token, its statistics not yet read: computed
    # (~0.6 ms) only when a round asks the policy, not after every copied round.
    last_row: tuple[HeadOutput, int] | None = None
    # Target statistics and per-step re-encoding counts cost a little: only when someone reads them.
    rich = keep_steps or policy.needs_features
    # the prompt's text, for the ``repeat`` feature (only when features are read)
    prompt_bytes = bridge.target.bytes_of(prompt_target_ids) if rich else b""
    if lookup is not None:
        lookup.reset()

    while (room := max_new_tokens - (len(target.ids) - t_start)) > 0:
        # 0. prompt lookup: a copied continuation, when the last target tokens occurred before.
        round_start = t0 = clock()
        proposal: list[int] = []
        if lookup is not None and target.cached and room > 1:
            proposal, _ = lookup.propose(target.ids, limit=min(room - 1, MAX_CANDIDATES))
        # 1. sync the assistant to the accepted text (only whole characters can be re-encoded).
        heal = b""  # text the first drafts must spell again (``_AssistantText.sync``)
        if not proposal:
            heal = a_text.sync(bridge, text, heal=True)
        healed = len(heal)
        text_complete = ends_on_char_boundary(text)
        bridge_s = clock() - t0

        # 2. draft.
        stats_s = 0.0  # the target's statistics, read here, count as this round's verify time
        if last_row is not None and not proposal:
            t0 = clock()
            target_prob, target_entropy = last_row[0].stats(last_row[1])
            last_row = None
            stats_s = clock() - t0
        ctx = agreement.context(
            iteration=len(records),
            generated=len(target.ids) - t_start,
            remaining=room,
            target_prob=target_prob,
            target_entropy=target_entropy,
            lag=len(assistant.ids) - assistant.cached,
        )
        t0 = clock()
        # The first round prefills the prompt alone, exactly as target-alone does.
        drafting = text_complete and room > 1 and target.cached and not proposal
        budget = policy.budget(ctx) if drafting else 0
        policy_s = clock() - t0
        if assistant.cached == len(assistant.ids):
            budget = 0  # nothing new to feed: no fresh logits to draft from (rare)
        committed = a_text.count
        steps: list[DraftStep] = []
        draft_s = first_draft_s = 0.0
        cum_logprob, min_prob = 0.0, 1.0
        drafted_ids: list[int] | None = None  # ``_candidates`` of the drafted text, when known
        for position in range(1, min(budget, room - 1) + 1):
            t0 = clock()
            hidden = assistant.forward()
            among = bridge.assistant.fitting(heal, below=assistant.draft_limit) if heal else None
            tok, p1, p2, entropy = assistant.draft(hidden, among=among)
            draft_s += clock() - t0
            if position == 1:
                first_draft_s = draft_s
            if tok in assistant_eos:
                break  # the assistant thinks the text ends here; the target decides that itself
            respelled = min(len(bridge.assistant.table[tok]), len(heal))
            heal = heal[respelled:]
            cum_logprob += math.log(max(p1, 1e-30))
            min_prob = min(min_prob, p1)
            a_text.append([tok])
            target_tokens = -1
            drafted = a_text.generated if rich else b""  # one copy for both features
            if rich:
                t0 = clock()
                drafted_ids = _candidates(bridge, target, text, drafted, room)
                target_tokens = len(drafted_ids)
                bridge_s += clock() - t0
            step = DraftStep(
                position=position,
                token_id=tok,
                token_bytes=bridge.assistant.table[tok],
                prob=p1,
                entropy=entropy,
                margin=p1 - p2,
                cum_logprob=cum_logprob,
                min_prob=min_prob,
                target_tokens=target_tokens,
                context=ctx,
                repeat=repeat_length(prompt_bytes + drafted) if rich else 0,
                respelled=respelled,
            )
            steps.append(step)
            t0 = clock()
            halt = policy.stop(step)
            policy_s += clock() - t0
            if halt:
                break

        # 3. drafted text → target candidates (after the target's own text, whole characters):
        # with features on, the last step's own re-encoding (nothing was appended since: an EOS
        # draft is not kept), a tokenizer call fewer per round (~0.35 ms, caches cold).
        t0 = clock()
        if proposal:
            candidates = proposal
        elif not steps:
            candidates = []
        elif drafted_ids is not None:
            candidates = drafted_ids
        else:
            candidates = _candidates(bridge, target, text, a_text.generated, room)
        bridge_s += clock() - t0

        # 4. verify: one forward over the pending token(s) and all candidates.
        t0 = clock()
        base = len(target.ids)
        target.ids.extend(candidates)
        hidden = target.forward()
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
        emitted, hit_eos = _clip(
            candidates[:accepted] + [preds[accepted]], eos_ids=target_eos, room=room
        )
        in_cache = _commit(target, base=base, accepted=accepted, emitted=emitted)
        if rich:  # the target's view of the last token it emitted: a feature for the next round
            last = len(emitted) - 1  # head row that chose the last emitted token
            last_row = (alone, 0) if alone is not None and last == accepted else (head, last)
        verify_s = clock() - t0 + stats_s
        text += bridge.target.bytes_of(emitted)
        if on_tokens:
            on_tokens(emitted)

        # 5. resync: keep the drafted tokens whose text the target accepted.
        t0 = clock()
        outcome = agreement.settle(a_text, text, committed=committed, drafted=len(steps))
        bridge_s += clock() - t0
        t0 = clock()
        if proposal:  # the policy was not asked this round
            agreement.note_copy(candidates=len(candidates), emitted=len(emitted))
        else:
            policy.update(outcome)
        policy_s += clock() - t0
        records.append(
            IterationRecord(
                drafted=len(steps),
                candidates=len(candidates),
                accepted_candidates=in_cache,
                emitted=len(emitted),
                accepted_drafts=outcome.accepted,
                draft_s=draft_s,
                verify_s=verify_s,
                bridge_s=bridge_s,
                policy_s=policy_s,
                steps=tuple(steps) if keep_steps else (),
                recomputed=int(alone is not None),
                first_draft_s=first_draft_s,
                round_s=clock() - round_start,
                lookup=bool(proposal),
                lag=ctx.lag if steps else 0,
                healed=healed,
            )
        )
        if hit_eos:
            reason = "eos"
            break

    return LoopOutput(
        ids=target.ids[t_start:],
        stop_reason=reason,
        seconds=clock() - start_time,
        iterations=records,
    )
