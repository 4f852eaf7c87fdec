"""``uag calibrate``: prompt lookup's copy lengths searched by exact replay against this
machine's verify costs, stored per machine and pair, and used by generate and bench."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.tiny import cross_pair, same_tokenizer_pair
from uag import recipes
from uag.cli import main
from uag.decoding.lookup import PromptLookup
from uag.decoding.profile import LatencyProfile
from uag.errors import UagError
from uag.harness import calibration
from uag.harness.prompts import Prompt

REPEATING = [
    Prompt("loop-0", "ab ab ab ab ab ab ab ab ab ab ab ab"),
    Prompt("loop-1", "def f(x):\n    return x\ndef f(x):\n    return x\ndef f(x):\n"),
    Prompt("loop-2", "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3"),
]


def test_search_finds_the_best_lengths_and_scores_each_once():
    goal = (2, 4, 7)
    calls: list[tuple[int, ...]] = []

    def score(lengths: tuple[int, ...]) -> float:
        calls.append(lengths)
        return -sum((a - b) ** 2 for a, b in zip(lengths, goal, strict=True))

    best, value = calibration.search_lengths(score, (3, 5, 11), most=11)
    assert best == goal and value == 0
    assert len(calls) == len(set(calls))  # every tuple scored once


def test_search_keeps_the_start_when_nothing_is_better():
    best, value = calibration.search_lengths(lambda lengths: 1.0, (3, 5, 11), most=11)
    assert best == (3, 5, 11) and value == 1.0


def _profile(per_candidate: float) -> LatencyProfile:
    """A step of 10 ms; each candidate adds ``per_candidate`` of a step."""
    verify = [0.010 * (1 + per_candidate * m) for m in range(12)]
    return LatencyProfile(device="cpu:test", draft_s=0.002, verify_s=verify, step_s=0.010)


@pytest.mark.parametrize(("per_candidate", "longer"), [(0.0, True), (1.5, False)])
def test_replay_copies_more_when_candidates_are_cheap_and_less_when_dear(
    tokenizers, per_candidate, longer
):
    """Free candidates: a longer copy costs nothing more, so the copies grow (in total: where a
    copy ends moves where the next round starts, so one length need not). Each candidate
    dearer than a step of its own: a copy loses against plain steps even when right, so the
    copies after 1- and 3+-token matches (nearly all matches in these looping runs) shrink to
    one token. Either way replay rates the chosen lengths above the built-in ones, which were
    among the candidates; the price leaves out timed decisions, so the search is repeatable."""
    pair = cross_pair(tokenizers)
    rec = calibration.record(pair, REPEATING, max_new_tokens=24, profile=_profile(per_candidate))
    result = calibration.search_lookup(pair, rec)
    built_in = PromptLookup().max_tokens
    if longer:
        assert sum(result.lengths) > sum(built_in), result
    else:
        assert result.lengths[0] == result.lengths[-1] == 1, result
    assert result.predicted > result.default_predicted > 0
    assert result.prompts == len(REPEATING) and result.max_new_tokens == 24


def test_a_saved_calibration_round_trips_and_a_damaged_one_is_one_clear_error(tmp_path):
    saved = recipes.LookupCalibration(
        lengths=(2, 3, 5),
        predicted=1.58,
        default_predicted=1.49,
        machine="cpu x",
        prompts=30,
        max_new_tokens=128,
    )
    path = tmp_path / "calibration" / "lookup-x.json"
    recipes.save_calibration(saved, path)
    assert recipes.load_calibration(path) == saved
    assert recipes.load_calibration(tmp_path / "none.json") is None
    for damage in ("{", json.dumps({**json.loads(path.read_text()), "lengths": [0, 2, 3]})):
        path.write_text(damage)
        with pytest.raises(UagError, match="damaged.*uag calibrate again"):
            recipes.load_calibration(path)


def test_the_file_is_per_machine_and_target_and_any_assistant_shares_it(tokenizers):
    pair = cross_pair(tokenizers)
    here = recipes.calibration_path(pair, machine="cpu A, 2 threads")
    assert here == recipes.calibration_path(pair, machine="cpu A, 2 threads")
    assert here != recipes.calibration_path(pair, machine="cpu B, 2 threads")
    assert here != recipes.calibration_path(
        cross_pair(tokenizers, kernels="plain"), machine="cpu A, 2 threads"
    )
    # lookup alone never runs the assistant: another assistant finds the same file
    other = replace(pair, assistant=replace(pair.assistant, ref="another"), assistant_int8=True)
    assert recipes.calibration_path(other, machine="cpu A, 2 threads") == here
    assert (
        recipes.calibration_path(
            replace(pair, target=replace(pair.target, ref="another")), machine="cpu A, 2 threads"
        )
        != here
    )


def test_calibrate_writes_the_file_and_generate_copies_its_lengths(
    tiny_dirs, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(recipes, "cache_root", lambda: tmp_path)
    target_dir, assistant_dir = tiny_dirs
    models = ["--target", str(target_dir), "--assistant", str(assistant_dir)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in REPEATING))
    argv = ["calibrate", *models, "--prompts", str(prompts), "--max-new-tokens", "12"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "replay predicts lookup alone" in out and "fastest rule for this pair" in out
    files = list((tmp_path / "calibration").glob("lookup-*.json"))
    assert len(files) == 1 and recipes.load_calibration(files[0]) is not None
    [rule_file] = (tmp_path / "calibration").glob("rule-*.json")
    rule = recipes.load_rule(rule_file)
    assert rule is not None and set(rule.candidates) == set(calibration.RULES)
    # generate without --policy runs the calibrated rule, and says so
    assert main(["generate", *models, "--prompt", REPEATING[1].text, "--json"]) == 0
    said = capsys.readouterr()
    shown = json.loads(said.out.strip().splitlines()[-1])
    assert shown["policy"] == rule.rule
    assert shown["plan_why"].startswith(f"{rule.rule}: the fastest rule for this pair")

    gen = ["generate", *models, "--policy", "lookup", "--prompt", REPEATING[0].text]
    gen += ["--max-new-tokens", "24", "--json", "--compare-target-only"]
    runs = {}
    for lengths in ((1, 1, 1), (11, 11, 11)):
        found = recipes.load_calibration(files[0])
        assert found is not None
        recipes.save_calibration(replace(found, lengths=lengths), files[0])
        assert main(gen) == 0
        captured = capsys.readouterr()
        assert "as uag calibrate chose on this machine" in captured.err
        runs[lengths] = json.loads(captured.out.strip().splitlines()[-1])
        assert runs[lengths]["identical"] is True
    one, eleven = runs[(1, 1, 1)], runs[(11, 11, 11)]
    assert one["text"] == eleven["text"]
    # one token a copy: never more copied than rounds; eleven: fewer rounds for the same text
    assert 0 < one["copied_tokens"] <= one["target_forwards"]
    assert eleven["target_forwards"] < one["target_forwards"]


def _rule_profile(*, draft: float, per_candidate: float) -> LatencyProfile:
    """A step of 10 ms, a draft step of ``draft`` steps, each candidate ``per_candidate``."""
    verify = [0.010 * (1 + per_candidate * m) for m in range(12)]
    return LatencyProfile(device="cpu:test", draft_s=0.010 * draft, verify_s=verify, step_s=0.010)


@pytest.mark.parametrize(("draft", "drafts"), [(0.0, True), (5.0, False)])
def test_the_rule_drafts_when_drafts_are_cheap_and_never_when_dear(tokenizers, draft, drafts):
    """An assistant that mostly agrees with the target, on prompts that do not repeat: with
    free draft steps and candidates the fastest rule drafts (a static-K); at five target steps
    a draft step, no rule that drafts can win and lookup alone is chosen. Every candidate is
    replayed and scored."""
    pair = same_tokenizer_pair(tokenizers, noise=0.05)
    prompts = [Prompt("a", "The weather today is"), Prompt("b", "import numpy as np")]
    profile = _rule_profile(draft=draft, per_candidate=0.0)
    rec = calibration.record(pair, prompts, max_new_tokens=16, profile=profile)
    rule = calibration.choose_rule(pair, rec, lengths=(3, 5, 11))
    assert set(rule.candidates) == set(calibration.RULES)
    assert rule.candidates[rule.rule] == max(rule.candidates.values())
    assert rule.predicted == pytest.approx(rule.candidates[rule.rule], abs=1e-4)
    assert rule.rule.startswith("static-") is drafts, rule
    assert rule.profile["draft_s"] == pytest.approx(0.010 * draft)


def test_a_calibrated_rule_is_the_default_plan_of_its_pair_only(tokenizers, tmp_path, monkeypatch):
    monkeypatch.setattr(recipes, "cache_root", lambda: tmp_path)
    pair = cross_pair(tokenizers)
    assert "uag calibrate with this pair chooses" in recipes.default_plan(pair).why
    saved = recipes.RuleCalibration(
        rule="static-2",
        predicted=1.28,
        candidates={"static-2": 1.28, "lookup": 1.02},
        profile={},
        machine="cpu x",
        prompts=6,
        max_new_tokens=64,
    )
    recipes.save_calibration(saved, recipes.rule_path(pair))
    assert recipes.load_rule(recipes.rule_path(pair)) == saved
    recipe = recipes.default_plan(pair)
    assert recipe.plan.name == "static-2" and "uag calibrate chose" in recipe.why
    assert recipes.default_plan(pair, sampling=True).plan.name == "static-3+lookup"
    other = replace(pair, assistant=replace(pair.assistant, ref="another"))
    assert recipes.rule_path(other) != recipes.rule_path(pair)  # a rule drafts: per assistant
    assert recipes.default_plan(other).plan.name == "static-3+lookup"
    for damage in (
        "{",
        json.dumps({**json.loads(recipes.rule_path(pair).read_text()), "rule": "learned"}),
    ):
        recipes.rule_path(pair).write_text(damage)
        with pytest.raises(UagError, match="damaged.*uag calibrate again"):
            recipes.load_rule(recipes.rule_path(pair))
