"""What drafting and verifying cost on this machine: the latency profile.

A learned controller trades draft work against target passes, so it needs the prices: one
assistant draft step, and one target verification of ``m`` candidates (``m + 1`` positions) for
every ``m`` it may meet. They are measured on the real models at a fixed context of real text
(``PROFILE_TEXT``: the screened head's cost depends on how peaked the distribution is, and
arbitrary ids give flat ones that no real run meets), as medians of repeats after a warm-up, and
travel with the collected data and the exported controller.

Measured as the loop meets them, not in isolation: in the loop a draft step follows a target
pass and a verify follows draft steps, each evicting the other model's data from the caches, so
every timed draft is preceded by an untimed target pass and every timed verify by an untimed
draft step (in collected runs the loop paid 7-10 % more than back-to-back timings). Every
operation is timed once per round with the order rotated, so drift spreads evenly (timed in
blocks, later candidate counts read up to 30 % high). The target-alone
step is measured back to back, as target-alone decoding runs. What the isolated forwards leave
out (the round's bookkeeping, and the catch-up rows the first draft of a round feeds) is taken
from a short real run of the loop (``measure_loop``).
"""

from __future__ import annotations

import itertools
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from uag import api
from uag.decoding.profile import PROFILE_CONTEXT, LatencyProfile
from uag.decoding.sampling import SamplingConfig, processed_probs
from uag.runtime.runner import CachedLM

PROFILE_TEXT = (
    "from typing import List\n\n\n"
    "def separate_paren_groups(paren_string: str) -> List[str]:\n"
    '    """ Input to this function is a string containing multiple groups of nested '
    "parentheses. Your goal is to separate those group into separate strings and return the "
    "list of those.\n    Separate groups are balanced (each open brace is properly closed) and "
    "not nested within each other\n    Ignore any spaces in the input string.\n"
    "    >>> separate_paren_groups('( ) (( )) (( )( ))')\n    ['()', '(())', '(()())']\n"
    '    """\n    result = []\n    current_string = []\n    current_depth = 0\n\n'
    "    for c in paren_string:\n        if c == '(':\n            current_depth += 1\n"
    "            current_string.append(c)\n        elif c == ')':\n"
    "            current_depth -= 1\n            current_string.append(c)\n\n"
    "            if current_depth == 0:\n"
    "                result.append(''.join(current_string))\n"
    "                current_string.clear()\n\n    return result\n"
)
"""Real text (HumanEval/1 and its solution) for the profile's context and fed positions."""


FEED_ROWS = 9
"""Rows of the forward that prices ``feed_row_s``: a draft step catching up on 8 tokens."""


def text_ids(tokenizer: Any, count: int) -> list[int]:
    """``count`` token ids of ``PROFILE_TEXT`` (repeated as needed) under ``tokenizer``."""
    ids: list[int] = tokenizer(PROFILE_TEXT, add_special_tokens=False)["input_ids"]
    return (ids * (count // len(ids) + 1))[:count]


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()}:{torch.get_num_threads()}threads"


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ProfileSampler:
    """Measures the profile's prices in slices that can be spread over a long run.

    Why: these CPUs drift by several percent over minutes, so prices taken at one moment of a
    30-minute bench price arms timed across the whole run with that moment's machine. ``uag
    bench`` takes a slice after every prompt, as the arms are sampled, and prices replay with the
    medians of all of them: drift reaches prices and arms alike. (On the run that introduced it,
    replay's error barely moved: that error was pricing, fixed in ``uag.harness.dryrun`` and
    ``loop_overheads``; but no run's prices now hang on one moment.) Each slice sets the
    context again (the loop between slices moves the caches), runs ``rounds`` rounds of every
    operation with the order rotated, and the first slice warms every operation up first.
    """

    def __init__(
        self,
        *,
        target: CachedLM,
        assistant: CachedLM,
        target_tokenizer: Any,
        assistant_tokenizer: Any,
        max_candidates: int,
        sampling: SamplingConfig | None = None,
    ) -> None:
        self.target, self.assistant = target, assistant
        self.sampling = sampling
        self.max_candidates = max_candidates
        self.target_ids = text_ids(target_tokenizer, PROFILE_CONTEXT + max_candidates + 1)
        self.assistant_ids = text_ids(assistant_tokenizer, PROFILE_CONTEXT + FEED_ROWS)
        self.stats_times: list[float] = []  # inside each timed verify: its statistics part
        # Every operation once per round, the order rotated each round (drift over the run
        # spreads over all of them instead of biasing the last ones); each timed call after its
        # untimed predecessor as in the loop: a verify after a draft step, a draft step after a
        # draft step (a round's later drafts; its first follows the verify, with colder caches
        # and the catch-up rows: ``measure_loop``'s ``catchup_s``), the target-alone step back
        # to back.
        draft, verify = self._draft, self._verify
        self.ops: list[tuple[str, Any, Any]] = [("draft", draft, draft)]
        self.ops += [("feed", lambda: draft(FEED_ROWS), draft)]
        self.ops += [
            (f"verify{m}", lambda m=m: verify(m), draft) for m in range(max_candidates + 1)
        ]
        self.ops += [("step", lambda: verify(0, stats=False), lambda: verify(0, stats=False))]
        self.times: dict[str, list[float]] = {name: [] for name, _, _ in self.ops}
        self.rounds = 0
        self.slices = 0

    def _draft(self, rows: int = 1) -> None:
        a = self.assistant
        a.ids.extend(self.assistant_ids[PROFILE_CONTEXT : PROFILE_CONTEXT + rows])
        hidden = a.forward()
        a.draft(hidden)  # what a draft step computes
        a.truncate(PROFILE_CONTEXT)

    def _verify(self, m: int, *, stats: bool = True) -> None:
        t = self.target
        t.ids.extend(self.target_ids[PROFILE_CONTEXT : PROFILE_CONTEXT + m + 1])
        hidden = t.forward()
        if self.sampling is not None:
            # What sampling's verify computes: every row's full logits (the head read whole),
            # the first row's processed distribution (always reached; later rows are reached
            # per accepted token, as a target-alone step reaches one per token).
            processed_probs(t.full_logits(hidden)[:1], self.sampling)
            if stats:
                self.stats_times.append(0.0)  # sampling reads no target statistics
            t.truncate(PROFILE_CONTEXT)
            return
        head = t.greedy(hidden)
        if stats:  # what a learned controller's round reads; target-alone decoding does not
            start = time.perf_counter()
            head.stats(0)
            self.stats_times.append(time.perf_counter() - start)
        t.truncate(PROFILE_CONTEXT)

    def sample(self, rounds: int) -> None:
        """One slice: ``rounds`` timed rounds of every operation (the first slice: one untimed
        round before them)."""
        self.assistant.reset(self.assistant_ids[:PROFILE_CONTEXT], rollback=True)
        self.assistant.forward()
        self.target.reset(self.target_ids[:PROFILE_CONTEXT], rollback=True)
        self.target.forward()
        device = self.target.device
        warm = self.slices == 0
        self.slices += 1
        for i in range(rounds + int(warm)):
            timed = i > 0 or not warm
            shift = self.rounds % len(self.ops)
            stats_before = len(self.stats_times)
            for name, fn, before in self.ops[shift:] + self.ops[:shift]:
                before()
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                if timed:
                    self.times[name].append(time.perf_counter() - start)
            if timed:
                self.rounds += 1
            else:
                del self.stats_times[stats_before:]

    def profile(self) -> LatencyProfile:
        """The medians of every timed round so far."""
        if not self.rounds:
            raise ValueError("no profile round has been timed yet")
        times = self.times
        draft_s = statistics.median(times["draft"])
        medians = [statistics.median(times[f"verify{m}"]) for m in range(self.max_candidates + 1)]
        # A pass over more rows does more work: a median under a shorter pass's is drift
        # between the timed calls (a sampling profile measured 1 row 14.1 ms, 2 rows 13.8 ms,
        # which priced copying one token below a plain step), so each price is at least the
        # one before it.
        verify_s = list(itertools.accumulate(medians, max))
        feed_row_s = (statistics.median(times["feed"]) - draft_s) / (FEED_ROWS - 1)
        return LatencyProfile(
            device=describe_device(self.target.device),
            draft_s=draft_s,
            verify_s=verify_s,
            step_s=statistics.median(times["step"]),
            stats_s=statistics.median(self.stats_times),
            feed_row_s=max(feed_row_s, 0.0),
        )


def loop_overheads(records: Sequence[Any], *, draft_s: float) -> tuple[float, float, float]:
    """``(round_s, catchup_s, catchup_lag)`` from a measured run's ``IterationRecord``s, leaving
    out the first two rounds (the target's and the assistant's prefill): the median overhead per
    drafting round, and what a round's first draft step costs beyond ``draft_s`` in the rounds
    that fed the fewest tokens (``catchup_lag``, 1 in practice), so that ``catchup(lag)`` adds
    ``feed_row_s`` per further token on a base measured at that same lag. (A median over every
    lag, quoted at the median lag, priced lag-2 rounds one row too dear: where most rounds feed
    two tokens, the median first step is a two-token one.)"""
    rounds = [r for r in records[1:] if r.drafted][1:]
    if not rounds:
        return 0.0, 0.0, 0.0
    round_s = statistics.median(r.round_s - r.draft_s - r.verify_s for r in rounds)
    lag = min(r.lag for r in rounds)
    catchup_s = statistics.median(r.first_draft_s for r in rounds if r.lag == lag) - draft_s
    return max(round_s, 0.0), max(catchup_s, 0.0), float(lag)


def measure_loop(pair: Any, profile: LatencyProfile, *, tokens: int = 48) -> LatencyProfile:
    """``profile`` with ``round_s`` and ``catchup_s`` from a real run of the loop (lookahead 2,
    ``tokens`` new tokens after ``PROFILE_TEXT``; a first run warms up)."""
    prompt = PROFILE_TEXT.split("    result = []")[0]  # HumanEval/1: the model writes the rest
    records: list[Any] = []
    for _ in range(2):
        out = api.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=2)), max_new_tokens=tokens)
        records = list(out.iterations)
    round_s, catchup_s, lag = loop_overheads(records, draft_s=profile.draft_s)
    return replace(profile, round_s=round_s, catchup_s=catchup_s, catchup_lag=lag)


def pair_sampler(
    pair: Any, *, max_candidates: int, sampling: SamplingConfig | None = None
) -> ProfileSampler:
    """A ``ProfileSampler`` on a loaded pair's models (``sampling``: verify and step as
    speculative sampling computes them)."""
    return ProfileSampler(
        sampling=sampling,
        target=pair.target_lm,
        assistant=pair.assistant_lm,
        target_tokenizer=pair.target.tokenizer,
        assistant_tokenizer=pair.assistant.tokenizer,
        max_candidates=max_candidates,
    )


def measure_pair_profile(
    pair: Any,
    *,
    max_candidates: int,
    repeats: int = 7,
    sampler: ProfileSampler | None = None,
    sampling: SamplingConfig | None = None,
) -> LatencyProfile:
    """The full profile of a loaded pair: isolated prices (``ProfileSampler``) and the loop's
    own overheads (``measure_loop``). With ``sampler`` (slices taken earlier in the run), its
    rounds are topped up to ``repeats`` and the prices are the medians over all of them.
    ``sampling``: the target's prices under speculative sampling, whose verify reads the whole
    head for every row (a greedy verify screens it): a plan priced with greedy verifies copies
    too eagerly under sampling (measured in the loop at T 1.0: a 4-row verify 1.60x a step,
    where greedy prices said 1.35x)."""
    if sampler is None:
        sampler = pair_sampler(pair, max_candidates=max_candidates, sampling=sampling)
    sampler.sample(rounds=max(repeats - sampler.rounds, 1))
    return measure_loop(pair, sampler.profile())


@dataclass(frozen=True)
class VerifyCost:
    """Median milliseconds of one target forward over ``rows`` positions, split body / head."""

    rows: int
    body_ms: float
    head_ms: float

    @property
    def total_ms(self) -> float:
        return self.body_ms + self.head_ms


def measure_verify_costs(
    target: CachedLM, tokenizer: Any, *, max_rows: int = 9, context: int = 110, repeats: int = 7
) -> list[VerifyCost]:
    """Body and greedy-head cost of a forward over 1..``max_rows`` positions at ``context`` tokens
    of ``PROFILE_TEXT``.

    What a verify of ``rows - 1`` candidates costs; a memory-bound forward costs about the same
    for every row count here. Medians of ``repeats`` after one warm-up each.
    """
    ids = text_ids(tokenizer, context + max_rows)
    target.reset(ids[:context], rollback=True)
    target.forward()
    counts = list(range(1, max_rows + 1))
    body: dict[int, list[float]] = {rows: [] for rows in counts}
    head: dict[int, list[float]] = {rows: [] for rows in counts}
    for i in range(repeats + 1):
        # Row counts interleaved, order rotated per round: drift over the run (these CPUs move
        # by several percent) spreads over every row count instead of biasing the late ones.
        shift = i % len(counts)
        for rows in counts[shift:] + counts[:shift]:
            target.ids.extend(ids[context : context + rows])
            t0 = time.perf_counter()
            hidden = target.forward()
            _sync(target.device)
            t1 = time.perf_counter()
            target.greedy(hidden)
            _sync(target.device)
            t2 = time.perf_counter()
            target.truncate(context)
            if i > 0:  # round 0 warms every shape up
                body[rows].append(t1 - t0)
                head[rows].append(t2 - t1)
    return [
        VerifyCost(
            rows=rows,
            body_ms=statistics.median(body[rows]) * 1e3,
            head_ms=statistics.median(head[rows]) * 1e3,
        )
        for rows in counts
    ]
