"""Every built-in plan runs through the same round (``uag.decoding.plan``): one protocol, no
special case. Each run is the target's own output, token for token, and each round did what
the plan's action said; a plan written here, which the package has never heard of, plugs in
the same way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from controllers.learned import LearnedPolicy
from controllers.learned_plan import LearnedPlan
from controllers.plans import RulePlan, TargetOnlyPlan
from controllers.rules import ConfidencePolicy, EntropyPolicy, HeuristicPolicy, StaticPolicy
from controllers.spec import parse_policy
from tests.toy import toy_pair
from uag.api import encode_prompt, render_prompt, speculate_on
from uag.decoding.actions import Action, Copy, Draft, Step, copy_lookup, parse_action
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import FixedDrafts, FunctionPlan, Plan, ScriptedPlan, Sources
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import Generation, Session
from uag.decoding.speculative import target_alone
from uag.harness import dryrun
from uag.harness.plan_collect import OraclePlan, default_actions

EXPORTS = Path(__file__).resolve().parents[1] / "exports"
TOKENS = 28
PROMPTS = ("the cat sat on the mat, the cat sat on", "def add(a, b):\n    return a + b\ndef")
PROFILE = LatencyProfile(device="cpu:test", draft_s=0.002, verify_s=(0.01, 0.011, 0.012, 0.013))


class EveryThird(FixedDrafts):
    """A plan from outside the package: copy, draft two, step, in turn (copy needs a match)."""

    name = "every-third"

    def __init__(self) -> None:
        self.lookup = PromptLookup()
        self.sources = Sources()

    def begin(self, sources: Sources) -> None:
        self.sources = sources

    def next_action(self, session: Session) -> Action:
        turn = len(session.records) % 3
        copied = self.sources.match(session).ids
        if turn == 0 and copied:
            return Copy(length=len(copied))
        return Draft(lookahead=2) if turn == 1 else Step()


def _copy_else_draft(session: Session, sources: Sources) -> Action:
    if not session.target.cached:
        return Step()  # the prompt's pass
    return Copy(length=2) if sources.match(session).ids else Draft(lookahead=1)


def _plans() -> dict[str, Callable[[], Plan]]:
    """A fresh plan of each kind the package ships, and the outsider."""
    return {
        "target-only": TargetOnlyPlan,
        "static-3": lambda: RulePlan(StaticPolicy(k=3)),
        "heuristic": lambda: RulePlan(HeuristicPolicy(start=2)),
        "confidence+lookup": lambda: RulePlan(ConfidencePolicy(0.3), lookup=PromptLookup()),
        "entropy": lambda: RulePlan(EntropyPolicy(threshold=1.0)),
        "lookup": lambda: parse_policy("lookup").plan(),
        "hybrid": lambda: parse_policy("static-2+lookup-3").plan(),
        "bandit": lambda: parse_policy("bandit").plan(),
        "stop-controller": lambda: RulePlan(LearnedPolicy(EXPORTS / "ctrl-stop.onnx")),
        "learned-plan": lambda: LearnedPlan(EXPORTS / "ctrl.onnx"),
        "scripted": lambda: ScriptedPlan(
            [Step(), Draft(lookahead=4), Copy(length=3)], then=Draft(), lookup=copy_lookup()
        ),
        "function": lambda: FunctionPlan(_copy_else_draft, lookup=copy_lookup()),
        "outsider": EveryThird,
    }


@pytest.fixture(scope="module")
def pair():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits for a busy core
    yield toy_pair(noise=0.1, attention=True)
    torch.set_num_threads(before)


def _ids(pair, prompt: str) -> tuple[list[int], list[int]]:
    return encode_prompt(pair, render_prompt(pair, prompt, chat=False))


def _speculate(pair, prompt: str, plan: Plan):
    target_ids, assistant_ids = _ids(pair, prompt)
    return speculate_on(
        pair,
        target_ids=target_ids,
        assistant_ids=assistant_ids,
        plan=plan,
        max_new_tokens=TOKENS,
    )


def _did_what_it_said(record) -> bool:
    """A round's record matches its action's name: a step verifies nothing, a copy copies at
    most its length and drafts nothing, a draft drafts at most its lookahead."""
    action = parse_action(record.action)
    if isinstance(action, Step):
        return record.candidates == 0 and record.drafted == 0 and not record.lookup
    if isinstance(action, Copy):
        return record.lookup and record.drafted == 0 and record.candidates <= action.length
    return not record.lookup and (action.lookahead is None or record.drafted <= action.lookahead)


@pytest.mark.parametrize("name", list(_plans()))
def test_every_plan_runs_through_the_one_round_losslessly(pair, name):
    make = _plans()[name]
    kinds = set()
    for prompt in PROMPTS:
        target_ids, _ = _ids(pair, prompt)
        alone = target_alone(
            Generation(
                target=pair.target_lm,
                eos=pair.target.eos_ids,
                prompt_ids=target_ids,
                max_new_tokens=TOKENS,
            )
        )
        plan = make()
        out = _speculate(pair, prompt, plan)
        assert out.ids == alone.ids, (name, prompt)
        assert all(_did_what_it_said(r) for r in out.iterations), name
        kinds |= {type(parse_action(r.action)) for r in out.iterations}
    assert Step in kinds  # the prompt's own round at least
    if name not in ("target-only", "lookup"):
        assert kinds & {Draft, Copy}, name  # every other plan proposed something somewhere


def test_a_plan_is_reused_across_generations_with_fresh_state(pair):
    """``begin`` resets a plan: the same object run twice gives the same rounds (the bandit's
    rounds follow wall time, so it is checked apart, in tests/test_baselines.py)."""
    for make in (_plans()["heuristic"], _plans()["learned-plan"], _plans()["outsider"]):
        plan = make()
        first = _speculate(pair, PROMPTS[0], plan)
        second = _speculate(pair, PROMPTS[0], plan)
        assert [r.action for r in first.iterations] == [r.action for r in second.iterations]


def test_the_replay_oracle_is_a_plan_too(pair):
    """Exact replay runs the oracle through the same round, against a recorded target run."""
    target_ids, assistant_ids = _ids(pair, PROMPTS[0])
    trace = dryrun.record_trace(pair, target_ids, TOKENS)
    oracle = OraclePlan(
        trace=trace,
        actions=default_actions(),
        profile=PROFILE,
        rate=2.0 / PROFILE.target_step_s,
        eos=pair.target.eos_ids,
    )
    run = dryrun.replay(pair, trace, oracle, prompt_assistant_ids=assistant_ids, profile=PROFILE)
    assert [r.action for r in run.records] == [a.name for a in oracle.taken]
    assert sum(r.emitted for r in run.records) == len(trace.ids)
