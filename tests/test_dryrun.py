"""Exact replay (``uag.harness.dryrun``): the loop's rounds for any policy, from a target-alone record."""

from __future__ import annotations

import dataclasses
import statistics
from typing import ClassVar

import pytest

import uag
from controllers.learned import LearnedPolicy
from controllers.plans import RulePlan
from controllers.rules import ConfidencePolicy, StaticPolicy
from tests.test_controller import COST, _export
from tests.toy import toy_pair
from uag.api import encode_prompt, render_prompt
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.decoding.profile import LatencyProfile
from uag.harness import dryrun

PROMPTS = ("def add(a, b):\n", "the cat sat on", "print('hi')\r\nfor i in range(10):\n\t")
ROUND_FIELDS = ("drafted", "candidates", "accepted_candidates", "emitted", "accepted_drafts")


PAIR: list = []


@pytest.fixture(scope="module")
def pair():
    PAIR[:] = [toy_pair(noise=0.3)]
    return PAIR[0]


class _TargetGated:
    """Drafts 3 after a token the target was sure of, else skips; stops drafting where the
    target's entropy at the last token is above a bound: decisions made of target statistics."""

    name = "target-gated"
    needs_features: ClassVar[bool] = True

    def __init__(self, sure: float, calm: float) -> None:
        self.sure, self.calm = sure, calm

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        return 3 if ctx.target_prob > self.sure else 0

    def stop(self, step: DraftStep) -> bool:
        return step.context.target_entropy > self.calm

    def update(self, outcome: IterationOutcome) -> None:
        pass


def _rounds(records):
    return [tuple(getattr(r, f) for f in ROUND_FIELDS) for r in records]


def _policies(tmp_path):
    _export(tmp_path / "t.onnx", threshold=0.5, gate=0.4)
    _export(tmp_path / "c.onnx", extra=COST)
    # thresholds at the toy target's medians, so both branches are taken
    trace = dryrun.record_trace(PAIR[0], _ids(PAIR[0], PROMPTS[0])[0], 24)
    sure, calm = statistics.median(trace.probs), statistics.median(trace.entropies)
    return {
        "target-gated": lambda: _TargetGated(sure, calm),
        "static-1": lambda: StaticPolicy(k=1),
        "static-4": lambda: StaticPolicy(k=4),
        "confidence": lambda: ConfidencePolicy(threshold=0.6),
        # decisions that read the target's probability and entropy of its last token
        "learned-threshold": lambda: LearnedPolicy(tmp_path / "t.onnx"),
        "learned-cost": lambda: LearnedPolicy(tmp_path / "c.onnx"),
    }


def test_replayed_rounds_are_the_loops_rounds(pair, tmp_path):
    """Counterfactual labels equal what the loop emits: for every policy and prompt, the
    replay's rounds (drafted, candidates, accepted, emitted) are the real loop's, one by one,
    with skipped rounds, early stops and rejections among them."""
    profile = LatencyProfile(device="cpu:test", draft_s=0.01, verify_s=(0.05, 0.06))
    seen = set()
    for name, make in _policies(tmp_path).items():
        for prompt in PROMPTS:
            trace = dryrun.record_trace(pair, _ids(pair, prompt)[0], 24)
            live = uag.generate(pair, prompt, plan=RulePlan(make()), max_new_tokens=24)
            assert tuple(live.token_ids) == trace.ids
            run = dryrun.replay(
                pair,
                trace,
                RulePlan(make()),
                prompt_assistant_ids=_ids(pair, prompt)[1],
                profile=profile,
            )
            assert _rounds(run.records) == _rounds(live.iterations), (name, prompt)
            seen.update(
                (r.drafted == 0, r.accepted_candidates < r.candidates) for r in run.records[1:]
            )
    assert (False, True) in seen and (False, False) in seen  # rejections and full acceptances
    assert (True, False) in seen  # and skipped rounds


def test_replay_reads_the_targets_statistics_from_the_record(pair, tmp_path):
    """Decisions made of the target's statistics see the record's: a record whose statistics
    are off by one position gives other rounds (so the test above can fail there)."""
    make = _policies(tmp_path)["target-gated"]
    profile = LatencyProfile(device="cpu:test", draft_s=0.01, verify_s=(0.05, 0.06))
    differ = 0
    for prompt in PROMPTS:  # (a prompt whose text repeats may keep its rounds)
        target_ids, assistant_ids = _ids(pair, prompt)
        trace = dryrun.record_trace(pair, target_ids, 24)
        good = dryrun.replay(
            pair, trace, RulePlan(make()), prompt_assistant_ids=assistant_ids, profile=profile
        )
        late = dataclasses.replace(
            trace, probs=(1.0, *trace.probs[:-1]), entropies=(0.0, *trace.entropies[:-1])
        )
        bad = dryrun.replay(
            pair, late, RulePlan(make()), prompt_assistant_ids=assistant_ids, profile=profile
        )
        differ += _rounds(bad.records) != _rounds(good.records)
    assert differ >= 2


def test_pricing_adds_the_profiles_prices_round_by_round():
    profile = LatencyProfile(
        device="cpu:test", draft_s=0.01, verify_s=(0.05, 0.06, 0.07), round_s=0.002, catchup_s=0.003
    )
    rec = dryrun.IterationRecord  # the loop's own record type

    def r(drafted: int, candidates: int, policy_s: float = 0.0) -> dryrun.IterationRecord:
        return rec(drafted, candidates, 0, 1, 0, 0.0, 0.0, 0.0, policy_s)

    records = [r(0, 0, 9.0), r(2, 2), r(0, 0), r(1, 5, 0.004)]  # round 0's policy time: unpriced
    # the first drafting round feeds the assistant its prompt: measured in assistant_prefill_s
    records[1] = dataclasses.replace(records[1], lag=40)
    run = dryrun.ReplayRun(records=records, assistant_prefill_s=0.1)
    trace = dryrun.TargetTrace((1, 2), (3, 4, 5, 6, 7), (0.5,) * 5, (1.0,) * 5, prefill_s=0.2)
    rounds = (0.002 + 0.003 + 0.02 + 0.07) + (0.002 + 0.05)
    rounds += 0.002 + 0.003 + 0.01 + 0.07 + 3 * 0.01 + 0.004  # extrapolated verify, policy time
    assert dryrun.priced_seconds(run, trace, profile) == pytest.approx(0.2 + 0.1 + rounds)
    assert dryrun.alone_seconds(trace, profile) == pytest.approx(0.2 + 4 * 0.05)
    assert dryrun.predicted_speedup([run], [trace], profile) == pytest.approx(
        (0.2 + 4 * 0.05) / (0.3 + rounds)
    )
    profile = dataclasses.replace(profile, stats_s=0.001)  # in every verify price: static skips
    static = dryrun.ReplayRun(records=records, assistant_prefill_s=0.1, reads_features=False)
    assert dryrun.priced_seconds(static, trace, profile) == pytest.approx(0.3 + rounds - 0.003)
    assert dryrun.priced_seconds(run, trace, profile) == pytest.approx(0.3 + rounds)
    # a copied round reads no statistics; a drafting round feeding 5 tokens pays 3 rows more
    profile = dataclasses.replace(profile, catchup_lag=2.0, feed_row_s=0.001)
    records[2] = dataclasses.replace(records[2], candidates=1, lookup=True)
    records[3] = dataclasses.replace(records[3], lag=5)
    run = dryrun.ReplayRun(records=records, assistant_prefill_s=0.1)
    copied = 0.002 + 0.06 - 0.001
    assert dryrun.priced_seconds(run, trace, profile) == pytest.approx(
        0.3 + rounds - (0.002 + 0.05) + copied + 0.003
    )


def _ids(pair, prompt: str) -> tuple[list[int], list[int]]:
    return encode_prompt(pair, render_prompt(pair, prompt, chat=False))
