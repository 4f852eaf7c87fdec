"""The training-free baselines of ``uag bench`` (issue 42 item 6): the hybrid rule
``POLICY+lookup-N`` (copy only after a match of N tokens or more, else the assistant drafts) and
the ``bandit`` arm (UCB1 over step, copy and static-K, per prompt)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

import uag
from controllers.bandit import BanditPlan, Ucb1
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from controllers.spec import PolicySpec, parse_policy, parse_policy_list
from uag.api import encode_prompt
from uag.decoding.actions import Copy, Draft, Step
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Sources
from uag.decoding.round import MAX_CANDIDATES, IterationRecord
from uag.errors import UagError

PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
    "the cat sat on the mat, the cat sat on",
)


# --- the grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("static-2+lookup-3", PolicySpec("static", number=2, lookup=True, min_match=3)),
        ("learned+lookup-4", PolicySpec("learned", lookup=True, min_match=4)),
        ("entropy-1.5+lookup-8", PolicySpec("entropy", number=1.5, lookup=True, min_match=8)),
        ("bandit", PolicySpec("bandit", lookup=True)),
    ],
)
def test_baseline_specs_round_trip(text, spec):
    assert parse_policy(text) == spec
    assert str(spec) == text
    assert parse_policy(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("static-2+lookup-1", "from 2 to 8"),
        ("static-2+lookup-9", "from 2 to 8"),
        ("static-2+lookup-x", "from 2 to 8"),
        ("static-2+lookup-", "from 2 to 8"),
        ("static-2+lookup-3+lookup", "goes with a drafting policy"),
        ("lookup+lookup-3", "goes with a drafting policy"),
        ("target-only+lookup-3", "goes with a drafting policy"),
        ("bandit+lookup", "'bandit' has its own"),
        ("bandit-2", "unknown policy"),
    ],
)
def test_bad_baseline_specs_are_one_clear_error(text, message):
    with pytest.raises(UagError) as err:
        parse_policy(text)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_baseline_arms_in_a_policy_list_are_distinct_arms():
    names = [str(s) for s in parse_policy_list("static-2+lookup,static-2+lookup-3,bandit")]
    assert names == ["target-only", "static-2+lookup", "static-2+lookup-3", "bandit"]


def test_the_bandit_spec_builds_a_plan_that_copies_and_refuses_flags():
    spec = parse_policy("bandit")
    plan = spec.plan()
    assert isinstance(plan, BanditPlan) and isinstance(plan.lookup, PromptLookup)
    with pytest.raises(UagError, match="not a stop rule"):
        spec.build()
    for flags in ({"lookahead": 3}, {"threshold": 0.5}):
        with pytest.raises(UagError, match="bandit"):
            spec.plan(**flags)


# --- the hybrid rule --------------------------------------------------------------------------


def test_the_hybrid_lookup_matches_only_n_tokens_or_more():
    """Ids whose tail matches earlier text for exactly 3 tokens, then exactly 2."""
    three = [1, 2, 3, 9, 8, 1, 2, 3]  # [1, 2, 3] occurred before, [8, 1, 2, 3] did not
    two = [5, 2, 3, 9, 8, 1, 2, 3]  # only [2, 3] occurred before
    assert PromptLookup().propose(three, limit=4) == ([9, 8, 1, 2], 3)
    assert PromptLookup().propose(two, limit=4)[1] == 2
    hybrid = parse_policy("static-2+lookup-3")
    assert hybrid.make_lookup().propose(three, limit=4) == ([9, 8, 1, 2], 3)
    assert hybrid.make_lookup().propose(two, limit=4) == ([], 0)
    assert parse_policy("static-2+lookup-4").make_lookup().propose(three, limit=4) == ([], 0)
    # calibrated copy lengths still apply
    assert hybrid.make_lookup((1, 1, 2)).propose(three, limit=4) == ([9, 8], 3)


def test_a_hybrid_longer_than_the_default_index_still_finds_its_match():
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    assert parse_policy("static-2+lookup-5").make_lookup().propose(ids, limit=3) == ([6, 1, 2], 5)
    assert parse_policy("static-2+lookup-6").make_lookup().propose(ids, limit=3) == ([], 0)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_hybrid_copies_exactly_when_the_match_is_long_enough(similar, prompt):
    """Every round after the prompt's: copied when prompt lookup's longest match on the text so
    far is at least 3 tokens, drafted by the assistant (static-2) otherwise; the output is the
    target's."""
    n_new = 40
    ref = uag.generate(similar, prompt, plan=None, max_new_tokens=n_new).token_ids
    out = uag.generate(
        similar,
        prompt,
        plan=RulePlan(StaticPolicy(k=2), lookup=parse_policy("static-2+lookup-3").make_lookup()),
        max_new_tokens=n_new,
    )
    assert out.token_ids == ref
    prompt_ids, _ = encode_prompt(similar, prompt)
    done, matches = out.iterations[0].emitted, []
    for r in out.iterations[1:]:
        limit = min(n_new - done - 1, MAX_CANDIDATES)
        copy, n = PromptLookup().propose(prompt_ids + ref[:done], limit=limit)
        copies = n >= 3 and bool(copy)
        assert r.lookup == copies
        if copies:
            assert r.drafted == 0
        else:  # the assistant's round: its candidates are its drafts' (none when it was not ready)
            assert r.candidates == 0 or r.drafted > 0
        matches.append(n)
        done += r.emitted
    # both sides of the threshold occur: short matches drafted, long ones copied
    assert any(0 < n < 3 for n in matches) and any(n >= 3 for n in matches)


# --- the bandit -------------------------------------------------------------------------------


def test_ucb1_tries_every_arm_once_then_follows_its_index():
    """A scripted reward sequence; the expected choices are UCB1's, worked by hand:
    index = mean / largest reward + √2 · sqrt(ln plays / n)."""
    ucb = Ucb1(arms=3)
    for arm, reward in ((0, 10.0), (1, 20.0), (2, 5.0)):
        assert ucb.select([0, 1, 2]) == arm  # every arm once, in order
        ucb.update(arm, reward)
    # means / 20: 0.5, 1.0, 0.25, equal bonuses: the best mean
    assert ucb.select([0, 1, 2]) == 1
    ucb.update(1, 20.0)
    # plays 4: arm 0 0.5 + √2·sqrt(ln 4) = 2.165; arm 1 1.0 + √2·sqrt(ln 4 / 2) = 2.177
    assert ucb.index(0) == pytest.approx(0.5 + math.sqrt(2 * math.log(4)))
    assert ucb.index(1) == pytest.approx(1.0 + math.sqrt(math.log(4)))
    assert ucb.select([0, 1, 2]) == 1
    ucb.update(1, 0.0)  # arm 1 turns bad: mean 40/3 / 20 = 0.667
    # plays 5: arm 0 0.5 + √2·sqrt(ln 5) = 2.294 beats arm 1 0.667 + √2·sqrt(ln 5 / 3) = 1.704
    assert ucb.select([0, 1, 2]) == 0
    # an unavailable arm is never picked, whatever its index
    assert ucb.select([1, 2]) == 2
    # a new best reward rescales every mean
    ucb.update(2, 100.0)
    assert ucb.scale == 100.0
    assert ucb.index(2) == pytest.approx(105 / 2 / 100 + math.sqrt(2 * math.log(6) / 2))


def test_ucb1_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError):
        Ucb1(arms=0)
    with pytest.raises(ValueError):
        Ucb1(arms=2).select([])
    with pytest.raises(ValueError):
        Ucb1(arms=2).update(0, -1.0)


def _record(emitted: int, seconds: float) -> IterationRecord:
    return IterationRecord(
        drafted=0,
        candidates=0,
        accepted_candidates=0,
        emitted=emitted,
        accepted_drafts=0,
        draft_s=0.0,
        verify_s=seconds,
        bridge_s=0.0,
        policy_s=0.0,
        round_s=seconds,
    )


class _FakeLookup:
    def __init__(self) -> None:
        self.copy: list[int] = []

    def match(self, session) -> list[int]:
        return self.copy


def test_the_bandit_choice_credits_each_rounds_rate_to_the_arm_it_played():
    """Fake rounds: the plan is told each round's outcome through the session's records only,
    and answers with the action of the arm UCB1 names."""
    choice = BanditPlan()
    lookup = _FakeLookup()
    choice.begin(Sources(lookup=lookup, assistant=object()))  # type: ignore[arg-type]
    session = SimpleNamespace(target=SimpleNamespace(cached=0), room=30, records=[])
    assert choice.next_action(session) == Step()  # the prompt's own round: not a bandit round
    session.records.append(_record(1, 5.0))
    session.target.cached = 10
    # rates per arm (tokens / s): step 100, copy 600, static-1 150, static-2 300, static-4 200
    rate = {"step": 100, "copy": 600, "static-1": 150, "static-2": 300, "static-4": 200}
    lookup.copy = [7]  # a match exists: the copy arm is available
    expected = ["step", "copy", "static-1", "static-2", "static-4"]
    for name in expected:
        action = choice.next_action(session)
        assert choice.played[-1] == name
        if name == "step":
            assert action == Step()
        elif name == "copy":
            assert action == Copy(length=1)
        else:
            assert action == Draft(lookahead=int(name[-1]))
        session.records.append(_record(3, 3 / rate[name]))
    # all bonuses equal: the best mean, the copy
    assert choice.next_action(session) == Copy(length=1)
    assert choice.ucb.sums == pytest.approx([100, 600, 150, 300, 200])
    session.records.append(_record(3, 3 / 600))
    # no match this round: the copy arm is unavailable, the best of the rest is static-2
    lookup.copy = []
    assert choice.next_action(session) == Draft(lookahead=2)
    assert choice.played[-1] == "static-2"
    session.records.append(_record(3, 3 / 300))
    # the last token: no room for candidates, a plain step that credits nothing
    session.room = 1
    counts = list(choice.ucb.counts)
    assert choice.next_action(session) == Step()
    assert choice.ucb.counts == [c + (i == 3) for i, c in enumerate(counts)]
    assert len(choice.played) == 7


def test_each_generation_gets_a_fresh_bandit():
    plan = BanditPlan()
    plan.begin(Sources(lookup=_FakeLookup(), assistant=object()))  # type: ignore[arg-type]
    first = plan.ucb
    plan.ucb.update(0, 5.0)
    plan.begin(Sources())
    assert plan.ucb is not first and plan.ucb.counts == [0]
    assert [a.name for a in plan.arms] == ["step"]  # no drafters: only the plain step


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_bandit_arm_outputs_the_targets_tokens(cross, prompt):
    """Whatever arms it plays, greedy output is the target's; each round is the arm it played."""
    n_new = 32
    ref = uag.generate(cross, prompt, plan=None, max_new_tokens=n_new).token_ids
    plan = BanditPlan(lookup=PromptLookup())
    out = uag.generate(cross, prompt, plan=plan, max_new_tokens=n_new)
    assert out.token_ids == ref
    played = plan.played
    assert len(set(played)) >= 4  # every arm is tried before UCB1 ranks them
    for name, r in zip(played, out.iterations[1:], strict=False):
        assert r.lookup == (name == "copy")
        if name == "step":
            assert r.candidates == 0
        if name.startswith("static-"):
            assert r.drafted <= int(name.removeprefix("static-"))
