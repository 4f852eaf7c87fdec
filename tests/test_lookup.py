"""Prompt lookup: what it proposes, and that the loop stays lossless when it drafts."""

from __future__ import annotations

import random

import pytest

import uag
from controllers.plans import RulePlan
from controllers.rules import NoDraftPolicy, StaticPolicy
from controllers.spec import PolicySpec, parse_policy
from tests.nasty import NASTY_PROMPTS
from tests.tiny import same_tokenizer_pair
from uag.decoding.lookup import RECENT_OCCURRENCES, PromptLookup
from uag.errors import UagError


def brute_force(ids: list[int], *, max_ngram: int, min_ngram: int, limit: int):
    """The definition, by scanning: longest tail first, its latest earlier occurrence."""
    end = len(ids)
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        for start in range(end - 1, n - 1, -1):  # start: where the continuation begins
            if ids[start - n : start] == ids[end - n :]:
                out: list[int] = []
                for i in range(limit):
                    j = start + i
                    out.append(ids[j] if j < end else out[j - end])
                return out, n
    return [], 0


def test_latest_occurrence_of_the_longest_tail():
    lk = PromptLookup(max_ngram=3, min_ngram=1, max_tokens=(4,))
    #        0  1  2  3  4  5  6  7  8  9
    ids = [5, 1, 2, 9, 1, 2, 7, 8, 3, 1]
    # tail (3, 1) never occurred before; tail (1,) last continued at index 5 (after "9 1")
    assert lk.propose(ids, limit=4) == ([2, 7, 8, 3], 1)
    ids += [2]  # tail (3, 1, 2) is new, (1, 2) last continued at index 6
    assert lk.propose(ids, limit=4) == ([7, 8, 3, 1], 2)


def test_nothing_matches_and_limits():
    lk = PromptLookup(max_ngram=3, min_ngram=2, max_tokens=(3,))
    assert lk.propose([1, 2, 3, 4], limit=5) == ([], 0)  # no 2-gram repeats
    lk.reset()
    assert lk.propose([1, 2, 3, 1, 2], limit=5) == ([3, 1, 2], 2)  # max_tokens caps it
    lk.reset()
    assert lk.propose([1, 2, 3, 1, 2], limit=1) == ([3], 2)
    lk.reset()
    assert lk.propose([1, 2, 3, 1, 2], limit=0) == ([], 0)


def test_a_copy_that_runs_into_the_present_repeats_its_period():
    lk = PromptLookup(max_ngram=2, min_ngram=1, max_tokens=(7,))
    assert lk.propose([4, 7, 8, 7, 8], limit=7) == ([7, 8, 7, 8, 7, 8, 7], 2)
    lk.reset()
    assert lk.propose([3, 3], limit=3) == ([3, 3, 3], 1)


def test_the_copy_length_follows_the_match_length():
    lk = PromptLookup(max_ngram=3, min_ngram=1, max_tokens=(1, 2, 4))
    #       a  b  c  d  e  f  g  h
    base = [1, 2, 3, 4, 5, 6, 7, 8]
    assert lk.propose([*base, 5], limit=9) == ([6], 1)  # "5" matched: one token
    lk.reset()
    assert lk.propose([*base, 4, 5], limit=9) == ([6, 7], 2)
    lk.reset()
    assert lk.propose([*base, 3, 4, 5], limit=9) == ([6, 7, 8, 3], 3)
    lk.reset()
    assert lk.propose([*base, 3, 4, 5], limit=2) == ([6, 7], 3)  # the loop's room caps it


def test_incremental_index_equals_the_definition():
    rng = random.Random(0)
    for trial in range(40):
        ids = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        lk = PromptLookup(max_ngram=3, min_ngram=1 + trial % 2, max_tokens=(5,))
        for _ in range(30):  # grow as the loop does: several ids at a time
            assert lk.propose(ids, limit=5) == brute_force(
                ids, max_ngram=3, min_ngram=lk.min_ngram, limit=5
            ), ids
            ids = ids + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_every_earlier_occurrence_of_the_matched_tail_is_reported():
    """``last_occurrences`` / ``last_count``: where every earlier occurrence of the matched tail
    continued (the recent ones, oldest first, the copy's source last), by scanning."""
    rng = random.Random(1)
    for _ in range(40):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        lk = PromptLookup(max_ngram=3, max_tokens=(5,))
        for _ in range(20):
            _, n = lk.propose(ids, limit=5)
            end = len(ids)
            every = [p for p in range(n, end) if n and ids[p - n : p] == ids[end - n :]]
            assert lk.last_count == len(every), ids
            assert lk.last_occurrences == tuple(every[-RECENT_OCCURRENCES:]), ids
            assert lk.last_source == (every[-1] if every else -1)
            ids = ids + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_shrinking_ids_and_bad_settings_are_refused():
    lk = PromptLookup()
    lk.propose([1, 2, 3], limit=2)
    with pytest.raises(ValueError, match="reset"):
        lk.propose([1, 2], limit=2)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_tokens"):
        PromptLookup(max_tokens=(2, 0))


REPEATING = "one two three one two three one two three one two"


@pytest.mark.parametrize("name", sorted(NASTY_PROMPTS))
def test_lookup_is_lossless_on_nasty_prompts(cross, name):
    """Copied candidates go through the same verify: the output is the target's own."""
    prompt = NASTY_PROMPTS[name] + "\n" + NASTY_PROMPTS[name]  # something to copy
    ref = uag.generate(cross, prompt, plan=None, max_new_tokens=24)
    for policy in (StaticPolicy(k=3), NoDraftPolicy()):
        out = uag.generate(
            cross, prompt, plan=RulePlan(policy, lookup=PromptLookup()), max_new_tokens=24
        )
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text


def test_lookup_rounds_draft_nothing_and_save_forwards(tokenizers):
    """An exact assistant on a repeating prompt: lookup rounds copy, assistant rounds draft,
    both are accepted, and every round's record adds up."""
    pair = same_tokenizer_pair(tokenizers, noise=0.0)
    ref = uag.generate(pair, REPEATING, plan=None, max_new_tokens=40)
    out = uag.generate(
        pair, REPEATING, plan=RulePlan(StaticPolicy(k=2), lookup=PromptLookup()), max_new_tokens=40
    )
    assert out.token_ids == ref.token_ids
    assert out.policy == "static-2+lookup"
    looked = [r for r in out.iterations if r.lookup]
    assert looked, "the prompt repeats: some round must copy"
    assert all(r.drafted == 0 and r.candidates > 0 for r in looked)
    assert sum(r.emitted for r in out.iterations) == out.new_tokens
    assert all(r.accepted_candidates <= r.candidates for r in out.iterations)


def test_lookup_alone_never_drafts(cross):
    prompt = "ab ab ab ab ab ab"
    ref = uag.generate(cross, prompt, plan=None, max_new_tokens=30)
    out = uag.generate(cross, prompt, plan=RulePlan(None, lookup=PromptLookup()), max_new_tokens=30)
    assert out.token_ids == ref.token_ids
    assert out.drafted_tokens == 0
    assert out.policy == "lookup"
    assert any(r.lookup for r in out.iterations)
    assert all(r.candidates == 0 for r in out.iterations if not r.lookup)


def test_the_assistant_catches_up_after_lookup_rounds(tokenizers):
    """Rounds that copy leave the assistant behind; the next drafting round feeds it the text
    it missed, so its drafts continue the real text (an exact assistant stays all-accepted)."""
    pair = same_tokenizer_pair(tokenizers, noise=0.0)
    out = uag.generate(
        pair, REPEATING, plan=RulePlan(StaticPolicy(k=3), lookup=PromptLookup()), max_new_tokens=60
    )
    after_lookup = [
        r
        for prev, r in zip(out.iterations[:-1], out.iterations[1:], strict=True)
        if prev.lookup and r.drafted
    ]
    assert after_lookup
    assert all(r.accepted_drafts == r.drafted for r in after_lookup)


def test_a_plan_is_a_plan_object_or_none(cross):
    with pytest.raises(UagError, match="plan must be a Plan, None or 'default'"):
        uag.generate(cross, "a", plan="lookup", max_new_tokens=3)


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("lookup", PolicySpec("lookup", lookup=True)),
        ("static-3+lookup", PolicySpec("static", number=3, lookup=True)),
        ("learned+lookup", PolicySpec("learned", lookup=True)),
        ("confidence-0.6+lookup", PolicySpec("confidence", number=0.6, lookup=True)),
    ],
)
def test_lookup_specs_round_trip(text, spec):
    assert parse_policy(text) == spec
    assert str(spec) == text
    assert parse_policy(str(spec)) == spec


@pytest.mark.parametrize(
    "text",
    [
        "target-only+lookup",
        "lookup+lookup",
        "oracle+lookup",
        "transformers+lookup",
        "lookup-3",
        "static-3+lookup+lookup",
        "static-3+look",
    ],
)
def test_bad_lookup_specs_are_one_clear_error(text):
    with pytest.raises(UagError):
        parse_policy(text)


def test_lookup_spec_builds_a_plan_that_never_drafts():
    spec = parse_policy("lookup")
    plan = spec.plan()
    assert isinstance(plan, RulePlan) and plan.rule is None and plan.name == "lookup"
    assert isinstance(plan.lookup, PromptLookup)
    assert isinstance(spec.build(), NoDraftPolicy)
    assert parse_policy("static-2").make_lookup() is None
    with pytest.raises(UagError, match="lookahead"):
        spec.plan(lookahead=3)


def test_exact_replay_copies_the_same_rounds():
    """Lookup proposals depend only on the target's text, so exact replay (``uag.harness.dryrun``)
    reproduces the loop's rounds with lookup too: copied, drafted, skipped, one by one."""
    from tests.test_dryrun import ROUND_FIELDS, _ids
    from tests.toy import toy_pair
    from uag.decoding.profile import LatencyProfile
    from uag.harness import dryrun

    pair = toy_pair(noise=0.3)
    profile = LatencyProfile(device="cpu:test", draft_s=0.01, verify_s=(0.05, 0.06))
    looked = 0
    for prompt in ("the cat sat on the mat, the cat sat on", "def f(x):\n    x = x\n    x"):
        target_ids, assistant_ids = _ids(pair, prompt)
        trace = dryrun.record_trace(pair, target_ids, 30)
        for rule in (lambda: StaticPolicy(k=2), lambda: None):

            def make(rule=rule):
                return RulePlan(rule(), lookup=PromptLookup())

            live = uag.generate(pair, prompt, plan=make(), max_new_tokens=30)
            run = dryrun.replay(
                pair, trace, make(), prompt_assistant_ids=assistant_ids, profile=profile
            )
            fields = ("lookup", *ROUND_FIELDS)
            assert [tuple(getattr(r, f) for f in fields) for r in run.records] == [
                tuple(getattr(r, f) for f in fields) for r in live.iterations
            ]
            looked += sum(r.lookup for r in run.records)
    assert looked > 0


def test_lookup_arms_in_a_policy_list():
    from controllers.spec import parse_policy_list

    names = [str(s) for s in parse_policy_list("lookup,static+lookup,entropy+lookup,learned")]
    assert names == ["target-only", "lookup", "static-3+lookup", "entropy-1.5+lookup", "learned"]


class _Recorder:
    """Drafts 2 every round it is asked, keeping each round's context."""

    name = "recorder"
    needs_features = True

    def __init__(self) -> None:
        self.seen: list = []

    def reset(self) -> None:
        self.seen.clear()

    def budget(self, ctx) -> int:
        self.seen.append(ctx)
        return 2

    def stop(self, step) -> bool:
        return False

    def update(self, outcome) -> None:
        pass


def test_asked_rounds_see_the_copies_the_lag_and_the_targets_statistics(cross):
    """A round that asks the policy is told what the copied rounds before it verified and
    emitted (what prices its decision), how far the assistant lags, and the target's statistics
    of the last emitted token, also when that token came from a copied round (they are read
    lazily, only for rounds that ask)."""
    from tests.test_dryrun import _ids
    from uag.harness import dryrun

    prompt = "the cat sat on the mat, the cat sat on the mat, the cat"
    trace = dryrun.record_trace(cross, _ids(cross, prompt)[0], 40)
    policy = _Recorder()
    out = uag.generate(
        cross, prompt, plan=RulePlan(policy, lookup=PromptLookup()), max_new_tokens=40
    )
    assert tuple(out.token_ids) == trace.ids
    rounds = out.iterations
    assert policy.seen and any(r.lookup for r in rounds)
    after_copy = 0
    for ctx in policy.seen:
        before = rounds[: ctx.iteration]
        assert ctx.copies == sum(r.lookup for r in before)
        assert ctx.copied == sum(r.candidates for r in before if r.lookup)
        assert ctx.copy_emitted == sum(r.emitted for r in before if r.lookup)
        assert ctx.generated == sum(r.emitted for r in before)
        assert ctx.target_prob == pytest.approx(trace.probs[ctx.generated - 1], rel=1e-5)
        assert ctx.target_entropy == pytest.approx(trace.entropies[ctx.generated - 1], rel=1e-4)
        this = rounds[ctx.iteration]
        assert ctx.lag >= 1 and this.lag == (ctx.lag if this.drafted else 0)
        after_copy += before[-1].lookup
    assert after_copy, "some asked round must follow a copied one"
    assert max(ctx.lag for ctx in policy.seen) > 1  # the copied text, caught up on
