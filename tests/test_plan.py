"""A round's plan: pricing, the choice's contract (features, actions), the trainer's labels, and
the plan running lossless in the real loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from controllers.learned_plan import LearnedPlan, load_controller
from controllers.plan import best_action, plan_choice, row_prices
from tests.toy import toy_pair
from training.export import export_onnx
from training.plan import PlanData, PlanNet, copy_targets
from uag.api import encode_prompt, render_prompt, speculate_on
from uag.decoding.actions import ActionSet, Copy, Draft, Step
from uag.decoding.drafters import Match
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan_features import (
    PLAN_FEATURE_NAMES,
    PLAN_SCHEMA_VERSION,
    occurrence_features,
    plan_row,
    round_state,
)
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import MAX_CANDIDATES, Generation
from uag.decoding.speculative import target_alone
from uag.errors import UagError

ACTIONS = ActionSet.standard(max_copy=4, max_draft=2)
PROFILE = LatencyProfile(
    device="cpu:test",
    draft_s=0.004,
    verify_s=[0.013 + 0.001 * m for m in range(16)],
    step_s=0.013,
    round_s=0.0005,
    feed_row_s=0.0005,
)
F = len(PLAN_FEATURE_NAMES)


def _row(**values: float) -> np.ndarray:
    row = np.zeros(F, dtype=np.float32)
    row[PLAN_FEATURE_NAMES.index("room")] = 16
    row[PLAN_FEATURE_NAMES.index("draft_ratio")] = 1.0
    for name, value in values.items():
        row[PLAN_FEATURE_NAMES.index(name)] = value
    return row


def test_prices_refuse_a_copy_longer_than_the_match_and_drafts_without_the_assistant():
    prices = row_prices(_row(match_tokens=2), actions=ACTIONS, profile=PROFILE)
    by_name = dict(zip(ACTIONS.names, prices, strict=True))
    assert np.isfinite([by_name["copy:1"], by_name["copy:2"]]).all()
    assert np.isinf([by_name["copy:3"], by_name["copy:4"]]).all()
    assert by_name["copy:2"] > by_name["copy:1"] > by_name["step"]  # a verify row costs
    no_assistant = row_prices(_row(), actions=ACTIONS, profile=PROFILE, drafts=False)
    assert np.isinf(no_assistant[ACTIONS.index(Draft(lookahead=1))])
    # the catch-up: a draft after 20 unfed tokens costs 20 feed rows more than after none
    lagging = row_prices(_row(lag=np.log1p(20)), actions=ACTIONS, profile=PROFILE)
    fresh = row_prices(_row(), actions=ACTIONS, profile=PROFILE)
    d1 = ACTIONS.index(Draft(lookahead=1))
    assert lagging[d1] - fresh[d1] == pytest.approx(20 * PROFILE.feed_row_s)


def test_the_choice_weighs_tokens_against_time_at_the_rate():
    prices = np.array([0.013, 0.016, 0.03])
    expected = np.array([1.0, 1.5, 3.0])
    # tokens per second of each: 77, 94, 100; the extra tokens cost 0.5/0.003 = 167/s and
    # 2/0.017 = 118/s: a rate below both buys the draft, between them only the copy
    assert best_action(expected, prices, rate=100.0) == 2
    assert best_action(expected, prices, rate=150.0) == 1
    assert best_action(expected, prices, rate=200.0) == 0
    # the room left caps what any action can yield: with one token of room, the step
    row = _row(room=1)
    assert plan_choice(expected, row, prices=prices, rate=10.0) == 0


def test_copy_labels_are_the_run_of_the_whole_match():
    """Per copy position j: labelled right when the first j copied tokens were, masked past the
    first wrong one and past the match."""
    actions = ActionSet.standard(max_copy=4, max_draft=0)
    emitted = np.array(
        [
            [1, 2, 3, 3, 3],  # match of 4, run 2: copy:3 and copy:4 emit 2 + 1
            [1, 1, 1, 1, 1],  # no match: copies are steps
            [1, 2, 2, 2, 2],  # match of 1, accepted
        ],
        dtype=np.float32,
    )
    features = np.stack([_row(match_tokens=4), _row(match_tokens=0), _row(match_tokens=1)])
    data = PlanData(
        actions=actions,
        profile=PROFILE,
        meta={},
        features=features,
        emitted=emitted,
        candidates=np.zeros_like(emitted, dtype=np.int32),
        draft_steps=np.zeros_like(emitted, dtype=np.int32),
        lag=np.zeros_like(emitted, dtype=np.int32),
        prompt=np.zeros(3, dtype=np.int32),
    )
    label, mask = copy_targets(data, 4)
    np.testing.assert_array_equal(label[0], [1, 1, 0, 0])
    np.testing.assert_array_equal(mask[0], [1, 1, 1, 0])
    np.testing.assert_array_equal(mask[1], [0, 0, 0, 0])
    np.testing.assert_array_equal(label[2], [1, 0, 0, 0])
    np.testing.assert_array_equal(mask[2], [1, 0, 0, 0])


def _export_plan(path, *, actions=ACTIONS, bias=None, changes=None):
    torch.manual_seed(0)
    net = PlanNet(F, actions, hidden=(8,))
    rows = np.random.default_rng(0).normal(size=(32, F)).astype(np.float32)
    net.set_normalisation(rows)
    if bias is not None:  # every copy hazard certain: a copy is predicted right to its end
        with torch.no_grad():
            net.copy_head.weight.zero_()
            net.copy_head.bias.fill_(bias)
    meta = {
        "kind": "plan",
        "plan_schema_version": str(PLAN_SCHEMA_VERSION),
        "feature_names": list(PLAN_FEATURE_NAMES),
        "actions": list(actions.names),
        "rate_factor": "1.5",
        "decoding": "greedy",
        "target": "tiny",
        "assistant": "tiny",
        "latency_profile": PROFILE.to_dict(),
        **(changes or {}),
    }
    export_onnx(net, path, metadata=meta, check_rows=rows, output_name="expected_tokens")
    return net


def test_a_plan_file_is_read_as_a_plan(tmp_path):
    _export_plan(tmp_path / "p.onnx")
    plan = load_controller(tmp_path / "p.onnx")
    assert isinstance(plan, LearnedPlan)
    assert plan.actions == ACTIONS and plan.info.rate_factor == 1.5


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"feature_names": list(PLAN_FEATURE_NAMES[:-1]) + ["other"]}, "feature schema"),
        ({"plan_schema_version": str(PLAN_SCHEMA_VERSION + 1)}, "feature schema"),
        (
            {"actions": ["step", "copy:1", "leap:2", "copy:3", "copy:4", "draft:1", "draft:2"]},
            "action set",
        ),
        ({"actions": ["step", "copy:1", "copy:2", "copy:3", "copy:4", "draft:1"]}, "action set"),
        (
            {"actions": ["step", "copy:1", "copy:2", "copy:3", "copy:4", "draft:1", "draft:99"]},
            "action set",
        ),
    ],
)
def test_the_choice_refuses_another_schema_or_action_set(tmp_path, change, says):
    _export_plan(tmp_path / "p.onnx", changes=change)
    with pytest.raises(UagError, match=says) as err:
        load_controller(tmp_path / "p.onnx")
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def toy():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield toy_pair(noise=0.05, attention=True)
    torch.set_num_threads(before)


def _run(pair, prompt, plan, *, tokens=24):
    target_ids, assistant_ids = encode_prompt(pair, render_prompt(pair, prompt, chat=False))
    return speculate_on(
        pair,
        target_ids=target_ids,
        assistant_ids=assistant_ids,
        plan=plan,
        max_new_tokens=tokens,
    )


@pytest.mark.parametrize("bias", [-8.0, 8.0])
def test_a_learned_plan_runs_lossless_in_the_loop(toy, tmp_path, bias):
    """Copies predicted always wrong (bias −8): no copy; always right (+8): it copies whenever
    a match allows. Either way the output is the target's own, token for token."""
    _export_plan(tmp_path / "p.onnx", bias=bias)
    plan = LearnedPlan(tmp_path / "p.onnx")
    prompt = "abc abc abc abc abc abc"
    target_ids, _ = encode_prompt(toy, render_prompt(toy, prompt, chat=False))
    alone = target_alone(
        Generation(
            target=toy.target_lm, eos=toy.target.eos_ids, prompt_ids=target_ids, max_new_tokens=24
        )
    )
    out = _run(toy, prompt, plan)
    assert out.ids == alone.ids
    copies = [a for a in plan.taken if isinstance(a, Copy)]
    if bias > 0:
        assert copies, plan.taken
    else:
        assert not copies, plan.taken
    assert all(isinstance(a, Step | Copy | Draft) for a in plan.taken)
    assert plan.decisions == len(out.iterations)


class _AlwaysAsks(LearnedPlan):
    """The plan with every round's feature row and network call, never the no-choice skip."""

    def choose(self, session):
        if not session.records:
            self._prompt_bytes = session.bridge.target.bytes_of(session.prompt_ids)
        row = plan_row(
            session,
            match=self.sources.match(session),
            state=round_state(session),
            prompt_bytes=self._prompt_bytes,
        )
        return self.decide(row, drafts=self.sources.assistant is not None)


def test_a_copy_or_step_plan_skips_only_rounds_with_nothing_to_copy(toy, tmp_path):
    """A plan without drafts (the sampling plan's set) at a round with no match can only step:
    it takes the step without asking the network, and every choice of the run is the one the
    network-asking plan makes."""
    _export_plan(tmp_path / "p.onnx", actions=ActionSet.standard(max_copy=4, max_draft=0))
    prompt = "abc abc abc x7 abc abc"
    runs = {}
    for kind in (LearnedPlan, _AlwaysAsks):
        plan = kind(tmp_path / "p.onnx")
        out = _run(toy, prompt, plan)
        runs[kind] = (out.ids, list(plan.taken), plan.decisions, len(out.iterations))
    ids, taken, decisions, rounds = runs[LearnedPlan]
    assert (ids, taken) == runs[_AlwaysAsks][:2]
    assert runs[_AlwaysAsks][2] == rounds  # the full plan asked every round
    assert 0 < decisions < rounds  # rounds with a match asked; rounds with none did not
    assert any(isinstance(a, Copy) for a in taken) and any(isinstance(a, Step) for a in taken)


def test_a_learned_plan_copies_as_far_as_a_verify_allows(toy, tmp_path):
    """A plan's copy length is its action's: its own lookup's table never cuts it."""
    _export_plan(tmp_path / "p.onnx")
    plan = LearnedPlan(tmp_path / "p.onnx")
    assert plan.lookup is not None and min(plan.lookup.max_tokens) == MAX_CANDIDATES
    assert plan.as_plan(PromptLookup()) is plan  # an offered lookup does not replace it


def test_sampling_labels_are_the_accept_probabilities_of_the_copy(toy):
    """Under sampling a copy of ``L`` emits ``1 + Σ_{j≤L} Π_{i≤j} p_i(c_i)`` on average. The
    labeller reads the ``p_i`` from a fork of the run's target; here they are recomputed from
    scratch (a fresh sequence fed the round's prefix and the whole match), so a fork that
    shares or shifts the run's cache would disagree."""
    from uag.decoding.lookup import PromptLookup
    from uag.decoding.sampling import SamplingConfig, processed_probs
    from uag.harness.plan_collect import OraclePlan, SamplingLabeller

    actions = ActionSet.standard(max_copy=4, max_draft=0)
    sampling = SamplingConfig(temperature=0.8, seed=3)
    labeller = SamplingLabeller(actions=actions, sampling=sampling)
    plan = OraclePlan(actions=actions, profile=PROFILE, rate=50.0, labeller=labeller)
    prompt = "abc abc abc abc abc abc"
    target_ids, assistant_ids = encode_prompt(toy, render_prompt(toy, prompt, chat=False))
    out = speculate_on(
        toy,
        target_ids=target_ids,
        assistant_ids=assistant_ids,
        plan=plan,
        max_new_tokens=24,
        sampling=sampling,
    )
    checked = 0
    fresh = toy.target_lm.twin()
    for labelled in labeller.rounds:
        if not labelled["match"] or labelled["round"] == 0:
            continue
        prefix = list(target_ids) + out.ids[: labelled["generated"]]
        match, _ = PromptLookup(max_tokens=(15,)).propose(
            prefix, limit=min(labelled["room"] - 1, 15)
        )
        assert len(match) == labelled["match"]
        fresh.reset(prefix + match, rollback=False)
        rows = fresh.full_logits(fresh.forward()[-(len(match) + 1) :])
        probs = processed_probs(rows, sampling)
        survival, want = 1.0, [1.0]
        for j, tok in enumerate(match):
            survival *= float(probs[j, tok])
            want.append(want[-1] + survival)
        for length in range(1, 5):
            got = labelled["outcomes"][actions.index(Copy(length=length))].emitted
            expect = min(want[min(length, len(match))], labelled["room"])
            assert got == pytest.approx(expect, rel=1e-5, abs=1e-6), (labelled["round"], length)
        checked += 1
    assert checked >= 2


def test_repricing_prices_the_same_rounds_at_each_price_point(toy, tmp_path):
    """Re-pricing (``python -m uag.harness.reprice``): the synthetic profile is what it says
    (a draft at 1/f of a step, a nearly flat verify), every arm is replayed at every price
    point, and the same rounds are cheaper where drafts are."""
    from scripts import reprice
    from uag.harness import dryrun

    _export_plan(tmp_path / "p.onnx", bias=8.0)
    cheap = reprice.synthetic_profile(PROFILE, draft_fraction=10)
    assert cheap.draft_s == pytest.approx(PROFILE.target_step_s / 10)
    assert cheap.verify_s[15] == pytest.approx(cheap.verify_s[0] * (1 + 15 * reprice.FLAT_ROW))
    recorded = []
    for prompt in ("abc abc abc abc", "the cat sat on the mat"):
        target_ids, assistant_ids = encode_prompt(toy, render_prompt(toy, prompt, chat=False))
        trace = dryrun.record_trace(toy, target_ids, 16)
        recorded.append(reprice.Recorded(trace=trace, assistant_ids=assistant_ids))
    rows = reprice.reprice_table(
        toy, recorded, PROFILE, controller=tmp_path / "p.onnx", fractions=(3, 30)
    )
    assert [row["prices"].startswith("measured") for row in rows] == [True, False, False]
    for row in rows:
        arms = {*reprice.FIXED_ARMS, "learned (re-priced)", "oracle-plan"}
        assert arms <= row.keys() and all(row[a] > 0 for a in arms)
    assert rows[2]["static-2"] > rows[1]["static-2"]
    assert "learned / best fixed" in reprice.markdown(rows)


def test_cached_prices_equal_each_action_priced_on_its_own():
    """The run-time pricer (computed once per run) prices every round as ``action_price``
    would, action by action: copies by their rows, drafts by steps, candidates and catch-up."""
    from controllers.plan import action_price

    for match, lag, ratio in [(0, 0, 1.0), (3, 7, 1.5), (4, 40, 0.5)]:
        row = _row(match_tokens=match, lag=np.log1p(lag), draft_ratio=ratio)
        got = row_prices(row, actions=ACTIONS, profile=PROFILE)
        for i, a in enumerate(ACTIONS):
            if isinstance(a, Copy):
                want = (
                    action_price(PROFILE, candidates=a.length, draft_steps=0, lag=0)
                    if a.length <= match
                    else np.inf
                )
            elif isinstance(a, Draft):
                want = action_price(
                    PROFILE,
                    candidates=max(round(a.lookahead * ratio), 1),
                    draft_steps=a.lookahead,
                    lag=lag,
                )
            else:
                want = action_price(PROFILE, candidates=0, draft_steps=0, lag=0)
            assert got[i] == want, (a, match, lag, ratio)


def test_occurrence_features_read_how_settled_the_matched_pattern_is():
    """The tail ``(1,)`` occurred three times before, followed by 2, 3 and 2; the copy follows
    the latest (2). The occurrence whose context agrees furthest back ("7 1" against the
    present "7 1") was followed by 3: the pattern is not settled, and the features say so."""
    #      0  1  2  3  4  5  6  7  8  9
    ids = [7, 1, 3, 5, 1, 2, 9, 1, 2, 7, 1]
    lookup = PromptLookup(max_ngram=1, max_tokens=(3,))
    copy, n = lookup.propose(ids, limit=3)
    assert (copy, n) == ([2, 7, 1], 1)
    match = Match(
        copy,
        ngram=n,
        source=lookup.last_source,
        occurrences=lookup.last_occurrences,
        count=lookup.last_count,
    )
    assert match.occurrences == (2, 5, 8)
    count, agree, best_context, best_agrees = occurrence_features(ids, match)
    assert count == pytest.approx(np.log1p(3))
    assert agree == pytest.approx(2 / 3)  # two of three were followed by the copy's 2
    assert best_context == pytest.approx(np.log1p(2))  # "7 1" agrees with the present "7 1"
    assert best_agrees == 0.0  # ...and was followed by 3, not the copy's 2
    assert occurrence_features(ids, Match([])) == (0.0, 0.0, 0.0, 0.0)
