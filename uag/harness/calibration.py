"""Prompt lookup's copy lengths, chosen for this machine by exact replay (``uag calibrate``).

The file it writes is read by ``uag.recipes`` (``lookup_lengths``), which every run consults.

Why: how many tokens lookup copies after a match (``PromptLookup.max_tokens``, by match length)
trades a longer verify against more tokens per round, and what a verify costs by row count is
the machine's. The built-in lengths (3, 5, 11) were searched against a 2-core Xeon's verify
costs (8 rows ~1.45x one row); on a 2-core Zen 4 (8 rows ~2.2x one row) (2, 3, 5) measured 1.58x
target-alone against their 1.49x on 16 training prompts. So the search runs on the machine it
serves: record target-alone runs on training prompts (``uag.harness.dryrun.record_trace``), measure the
latency profile, replay lookup alone through the real loop with candidate lengths
(``uag.harness.dryrun.replay``: its rounds are the loop's by construction; only time is priced, by that
profile) and keep the lengths replay prices fastest (coordinate ascent over the three). The
result lives under ``$UAG_CACHE/calibration``, keyed by this CPU, the target and the kernels'
build; ``uag generate`` and ``uag bench`` use it when it is there and say so on stderr. The
lengths are searched for lookup alone and then serve every ``+lookup`` policy too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from controllers.plans import RulePlan
from controllers.spec import parse_policy
from uag.api import encode_prompt
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Plan
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import MAX_CANDIDATES
from uag.errors import UagError
from uag.harness import dryrun
from uag.harness.jobs import RunConfig
from uag.harness.latency import measure_pair_profile
from uag.harness.prompts import as_text
from uag.recipes import LookupCalibration, RuleCalibration, machine_id

DEFAULT_PROMPTS = "humaneval:train+mixed:train"
"""What ``uag calibrate`` replays unless told otherwise: training prompts (bench's are test)."""
MAX_DRAFT = 8
"""The longest static draft ``choose_rule`` tries."""
SWEEPS = 3
"""Coordinate-ascent sweeps at most (it stops at the first sweep that changes nothing)."""


@dataclass
class CalibrateConfig(RunConfig):
    """``uag calibrate``: which prompts to replay, on which pair. It writes only the calibration
    file (``calibration_path``), so ``out`` is unused."""

    prompts: str = DEFAULT_PROMPTS
    out: Path = Path(".")
    limit: int | None = 15


def search_lengths(
    score: Callable[[tuple[int, ...]], float], start: tuple[int, ...], *, most: int
) -> tuple[tuple[int, ...], float]:
    """The lengths ``score`` rates highest, by coordinate ascent from ``start``: each entry in
    turn tried at every value 1..``most`` with the others held, kept at its best (a tie keeps
    the current value), for up to ``SWEEPS`` sweeps. Each distinct tuple is scored once."""
    seen: dict[tuple[int, ...], float] = {}

    def rate(lengths: tuple[int, ...]) -> float:
        if lengths not in seen:
            seen[lengths] = score(lengths)
        return seen[lengths]

    best = tuple(start)
    for _ in range(SWEEPS):
        changed = False
        for i in range(len(best)):
            for value in range(1, most + 1):
                candidate = best[:i] + (value,) + best[i + 1 :]
                if rate(candidate) > rate(best):
                    best, changed = candidate, True
        if not changed:
            break
    return best, rate(best)


@dataclass
class Recorded:
    """What every search replays: the target alone recorded on each prompt, the prompts as the
    assistant encodes them, and the latency profile that prices every replay."""

    traces: list[dryrun.TargetTrace]
    assistant_ids: list[list[int]]
    profile: LatencyProfile
    max_new_tokens: int


def record(
    pair: Any,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    chat: bool = False,
    profile: LatencyProfile | None = None,
    progress: Callable[[str], None] | None = None,
) -> Recorded:
    """Measure the profile (unless given: tests choose costs at will) and record the target
    alone on ``prompts`` (``uag.harness.prompts.Prompt``s)."""
    if not prompts:
        raise UagError("calibration needs at least one prompt")
    say = progress or (lambda _: None)
    if profile is None:
        say("measuring the latency profile (verify costs for 0-11 candidates)")
        profile = measure_pair_profile(pair, max_candidates=MAX_CANDIDATES)
    traces: list[dryrun.TargetTrace] = []
    assistant_ids: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        say(f"recording the target alone on prompt {i + 1}/{len(prompts)} ({prompt.id})")
        target_ids, a_ids = encode_prompt(pair, as_text(pair, prompt, chat=chat))
        traces.append(dryrun.record_trace(pair, target_ids, max_new_tokens))
        assistant_ids.append(a_ids)
    return Recorded(traces, assistant_ids, profile, max_new_tokens)


def replayed_speedup(pair: Any, rec: Recorded, plan: Callable[[], Plan]) -> float:
    """Exact replay's speed-up of ``plan`` (a fresh one per prompt) over the target alone, on
    the recorded prompts, leaving out timed decisions (so a search is repeatable)."""
    runs = [
        dryrun.replay(pair, trace, plan(), prompt_assistant_ids=a_ids, profile=rec.profile)
        for trace, a_ids in zip(rec.traces, rec.assistant_ids, strict=True)
    ]
    return dryrun.predicted_speedup(runs, rec.traces, rec.profile, timed_policy=False)


def search_lookup(pair: Any, rec: Recorded) -> LookupCalibration:
    """Prompt lookup's copy lengths, searched by replaying lookup alone (module docstring)."""

    @functools.cache  # the built-in lengths are scored in the search and again for the report
    def score(lengths: tuple[int, ...]) -> float:
        return replayed_speedup(
            pair, rec, lambda: RulePlan(None, lookup=PromptLookup(max_tokens=lengths))
        )

    default = PromptLookup().max_tokens
    lengths, predicted = search_lengths(score, default, most=MAX_CANDIDATES)
    return LookupCalibration(
        lengths=lengths,
        predicted=predicted,
        default_predicted=score(default),
        machine=machine_id(),
        prompts=len(rec.traces),
        max_new_tokens=rec.max_new_tokens,
    )


RULES = ("lookup",) + tuple(
    f"static-{k}{suffix}" for suffix in ("", "+lookup") for k in range(1, MAX_DRAFT + 1)
)
"""The training-free rules ``choose_rule`` replays: lookup alone, and static-K for K = 1..8
with and without lookup first."""


def choose_rule(
    pair: Any,
    rec: Recorded,
    *,
    lengths: tuple[int, ...],
    rules: Sequence[str] = RULES,
    progress: Callable[[str], None] | None = None,
) -> RuleCalibration:
    """The fastest of ``rules`` for ``pair`` by exact replay (lookup copying ``lengths``); a
    tie keeps the earlier rule. What a pair without a trained plan runs by default.
    ``progress`` hears each rule as it is replayed."""
    scores: dict[str, float] = {}
    for rule in rules:
        if progress is not None:
            progress(f"replaying {rule}")
        plan = partial(parse_policy(rule).plan, lengths=lengths)
        scores[rule] = replayed_speedup(pair, rec, plan)
    best = max(scores, key=lambda rule: (scores[rule], -rules.index(rule)))
    return RuleCalibration(
        rule=best,
        predicted=scores[best],
        candidates={rule: round(v, 4) for rule, v in scores.items()},
        profile=rec.profile.to_dict(),
        machine=machine_id(),
        prompts=len(rec.traces),
        max_new_tokens=rec.max_new_tokens,
    )
