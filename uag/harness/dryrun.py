"""Exact replay: the real loop for any greedy plan, the target answered from a recorded run.

Why: replay over collected rounds (``training.replay``) assumes a policy only cuts the
long-lookahead pass's rounds and never moves where rounds start. A policy that stops early
starts its next round elsewhere, after another correction, with another assistant state, other
drafts and other features, so that replay misjudges rounds (static-2 emitted 2.35 tokens per
round there, 2.17 in the loop). Greedy UAG emits exactly the target-alone output whatever the
policy, so once a target-alone run is recorded (its tokens, and the target's probability and
entropy at each: the features the loop reads) the target's choice at every position is known,
and the loop itself can be run against that record: the real assistant drafts, the real bridge
re-encodes, the real policy decides, skips, stale features and catch-up included; only the
target's forward becomes a lookup. Every round (drafted, candidates, accepted, emitted) is the
loop's by construction, tested equal to the loop's own records; only time is priced, from the
latency profile. Cost: the assistant's share of a run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from uag.api import speculate_on
from uag.decoding.plan import Plan
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import Generation, IterationRecord, LoopOutput, target_only_loop
from uag.runtime.runner import CachedLM


@dataclass(frozen=True)
class TargetTrace:
    """A target-alone greedy run: what the exact replay answers the loop's verifies from."""

    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]
    """The generated tokens."""
    probs: tuple[float, ...]
    """Per generated token: the target's probability of it (the head row that chose it)."""
    entropies: tuple[float, ...]
    """Per generated token: the entropy of that row's distribution (nats)."""
    prefill_s: float
    """The prompt pass with its head, as measured (every arm pays it)."""


def record_trace(pair: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> TargetTrace:
    """Run the target alone on ``prompt_ids`` and keep what a replay needs (greedy)."""
    target: CachedLM = pair.target_lm
    probs: list[float] = []
    entropies: list[float] = []
    prefill: list[float] = []
    start = time.perf_counter()

    def next_token(hidden: torch.Tensor) -> int:
        head = target.greedy(hidden)
        if not prefill:
            prefill.append(time.perf_counter() - start)
        p, e = head.stats(0)
        probs.append(p)
        entropies.append(e)
        return head.ids[0]

    gen = Generation(
        target=target, eos=pair.target.eos_ids, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens
    )
    out = target_only_loop(gen, next_token=next_token)
    return TargetTrace(
        prompt_ids=tuple(prompt_ids),
        ids=tuple(out.ids),
        probs=tuple(probs),
        entropies=tuple(entropies),
        prefill_s=prefill[0] if prefill else 0.0,
    )


class _KnownHead:
    """The loop's view of a verify's head rows (``HeadOutput``'s interface)."""

    def __init__(self, target: _KnownTarget, positions: list[int]) -> None:
        self.target = target
        self.positions = positions
        self.ids = [target.choice_after(q) for q in positions]

    def stats(self, row: int) -> tuple[float, float]:
        i = self.positions[row] + 1 - len(self.target.trace.prompt_ids)
        return self.target.trace.probs[i], self.target.trace.entropies[i]

    def margin(self, row: int) -> float:
        return float("inf")  # the record is exact: no near-tie to recompute


class _KnownTarget:
    """``CachedLM``'s interface as the loop uses it; a forward's "hidden states" are the
    positions it fed, and the head answers each from the trace."""

    row_invariant = True

    def __init__(self, trace: TargetTrace) -> None:
        self.trace = trace
        self.full = [*trace.prompt_ids, *trace.ids]
        self.ids: list[int] = []
        self.cached = 0

    def reset(self, ids: Sequence[int], *, rollback: bool) -> None:
        self.ids, self.cached = list(ids), 0

    def forward(self) -> torch.Tensor:
        start, self.cached = self.cached, len(self.ids)
        return torch.arange(start, len(self.ids))

    def greedy(self, hidden: torch.Tensor) -> _KnownHead:
        return _KnownHead(self, [int(q) for q in hidden])

    def truncate(self, keep: int) -> None:
        del self.ids[keep:]
        self.cached = min(self.cached, keep)

    def choice_after(self, q: int) -> int:
        """The target's token after ``ids[: q + 1]``: the record's next token when those ids
        are the record's, else -1 (rows after a rejected candidate; the loop never reads them,
        and -1 equals no candidate)."""
        if q + 1 >= len(self.full) or self.ids[: q + 1] != self.full[: q + 1]:
            return -1
        return self.full[q + 1]


def replay_loop(
    pair: Any,
    trace: TargetTrace,
    plan: Plan,
    *,
    prompt_assistant_ids: Sequence[int],
) -> LoopOutput:
    """The real loop (``speculate``, greedy) on the recorded prompt, its target answered from
    ``trace``: what ``replay`` prices and ``uag.harness.counterfactual`` labels from."""
    return speculate_on(
        pair,
        target_ids=list(trace.prompt_ids),
        assistant_ids=list(prompt_assistant_ids),
        plan=plan,
        max_new_tokens=len(trace.ids),
        target=cast(CachedLM, _KnownTarget(trace)),
    )


@dataclass(frozen=True)
class ReplayRun:
    """One prompt replayed under one plan: the loop's rounds and what they cost."""

    records: list[IterationRecord]
    assistant_prefill_s: float
    """Measured: the first drafting round's first step beyond a draft step and catch-up (it
    feeds the assistant its prompt)."""
    reads_features: bool = True
    """The policy reads features: its rounds pay the target's statistics (``stats_s``)."""


def replay(
    pair: Any,
    trace: TargetTrace,
    plan: Plan,
    *,
    prompt_assistant_ids: Sequence[int],
    profile: LatencyProfile,
) -> ReplayRun:
    """The loop's rounds for ``plan`` on the recorded prompt. The output is the record's by
    construction, so nothing here can tell a record of another target: make it with
    ``record_trace`` on this pair."""
    out = replay_loop(pair, trace, plan, prompt_assistant_ids=prompt_assistant_ids)
    first = next((r for r in out.iterations if r.drafted), None)
    extra = 0.0 if first is None else first.first_draft_s - profile.draft_s - profile.catchup_s
    return ReplayRun(
        records=out.iterations,
        assistant_prefill_s=max(extra, 0.0),
        reads_features=plan.needs_features,
    )


def priced_seconds(
    run: ReplayRun, trace: TargetTrace, profile: LatencyProfile, *, timed_policy: bool = True
) -> float:
    """What the replayed run costs: the prompt passes, then every later round at the
    profile's prices (round 0 is the target's prompt pass, which emits the first token), plus
    the policy's own decisions as the replay timed them (the profile's round overhead is a
    static rule's, ~µs; an ONNX controller takes ~0.2 ms a decision, ~2 % of its run). A policy
    that reads no features skips the target's statistics, which the verify prices include, and
    so does a copied round (the loop reads them only for a round that asks the policy). The
    first drafting round's first step feeds the assistant its prompt: ``assistant_prefill_s``
    holds what that cost, measured, so its lag (the prompt's length) is not priced again per
    token (that double count put ~0.2 s on a 150-token prompt: 3 % of a drafting arm's run).
    ``timed_policy`` False leaves the decisions' timed seconds out: a price that is a function
    of the rounds alone, the same on every call (``uag.harness.calibration`` compares runs by it)."""
    first = next((i for i, r in enumerate(run.records) if r.drafted), None)
    rounds = sum(
        profile.round_cost(
            drafted=r.drafted, candidates=r.candidates, lag=None if i == first else r.lag
        )
        + (r.policy_s if timed_policy else 0.0)
        - (profile.stats_s if r.lookup or not run.reads_features else 0.0)
        for i, r in enumerate(run.records[1:], start=1)
    )
    return trace.prefill_s + run.assistant_prefill_s + rounds


def alone_seconds(trace: TargetTrace, profile: LatencyProfile) -> float:
    """Target-alone at the profile's prices: the prompt pass, then one step per later token."""
    return trace.prefill_s + max(len(trace.ids) - 1, 0) * profile.target_step_s


def predicted_speedup(
    runs: Sequence[ReplayRun],
    traces: Sequence[TargetTrace],
    profile: LatencyProfile,
    *,
    timed_policy: bool = True,
) -> float:
    """Σ target-alone seconds ÷ Σ replayed seconds over prompts (both priced)."""
    alone = sum(alone_seconds(t, profile) for t in traces)
    spent = sum(
        priced_seconds(r, t, profile, timed_policy=timed_policy)
        for r, t in zip(runs, traces, strict=True)
    )
    return alone / spent if spent else 1.0
