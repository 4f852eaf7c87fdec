"""The learned controller at run time and uag bench's honesty checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import uag
from controllers.learned import LearnedPolicy
from controllers.plans import RulePlan
from tests.tiny import one_clean_line
from training.export import export_onnx
from training.model import ControllerNet
from uag.cli import main
from uag.decoding.features import FEATURE_NAMES, SCHEMA_VERSION, gate_row
from uag.decoding.policy import DraftContext
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.harness.bench import ArmRun, BenchConfig, bootstrap_interval, rotated, run_bench

PROFILE = {"device": "cpu:test", "draft_s": 0.03, "verify_s": [0.08, 0.1]}


def _export(
    path, *, names=FEATURE_NAMES, schema=SCHEMA_VERSION, threshold=0.5, gate=0.3, seed=0, extra=None
):
    torch.manual_seed(seed)
    net = ControllerNet(len(FEATURE_NAMES), (8,))
    rows = np.random.default_rng(seed).normal(size=(64, len(FEATURE_NAMES))).astype(np.float32)
    net.set_normalisation(rows)
    meta = {
        "feature_names": list(names),
        "schema_version": str(schema),
        "threshold": str(threshold),
        "gate_threshold": str(gate),
        "max_lookahead": "4",
        "target": "gemma-3-270m",
        "assistant": "smollm2-135m",
        "assistant_int8": "false",
        "latency_profile": PROFILE,
        **(extra or {}),
    }
    export_onnx(net, path, metadata=meta, check_rows=rows)
    return net, rows


def test_onnx_policy_decides_like_torch(tmp_path):
    net, rows = _export(tmp_path / "c.onnx", threshold=0.5)
    policy = LearnedPolicy(tmp_path / "c.onnx")
    with torch.no_grad():
        want = (net(torch.from_numpy(rows)) < 0.5).numpy()
    got = np.array([policy._score(r) < policy.info.threshold for r in rows])
    assert (got == want).all()
    assert 0 < want.sum() < len(want)  # both decisions occur, so the comparison means something


def test_gate_can_skip_drafting(tmp_path):
    _export(tmp_path / "c.onnx", gate=1.0)  # every probability is below 1: always skip
    policy = LearnedPolicy(tmp_path / "c.onnx")
    ctx = DraftContext(
        iteration=3,
        generated=10,
        remaining=50,
        prev_drafted=2,
        prev_accepted=1,
        drafted_total=8,
        accepted_total=3,
        target_prob=0.9,
        target_entropy=0.4,
    )
    assert policy.budget(ctx) == 0
    assert gate_row(ctx)[FEATURE_NAMES.index("prob")] == 0.0
    assert gate_row(ctx)[FEATURE_NAMES.index("target_prob")] == pytest.approx(0.9)
    _export(tmp_path / "never.onnx", gate=0.0)
    assert LearnedPolicy(tmp_path / "never.onnx").budget(ctx) == 4


def test_schema_mismatch_and_corrupt_file_are_refused(tmp_path):
    _export(tmp_path / "old.onnx", schema=SCHEMA_VERSION + 1)
    with pytest.raises(UagError, match="feature schema"):
        LearnedPolicy(tmp_path / "old.onnx")
    _export(tmp_path / "names.onnx", names=tuple(reversed(FEATURE_NAMES)))
    with pytest.raises(UagError, match="feature schema"):
        LearnedPolicy(tmp_path / "names.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00not an onnx file" * 10)
    with pytest.raises(UagError, match="not a valid ONNX"):
        LearnedPolicy(tmp_path / "junk.onnx")
    with pytest.raises(UagError, match="not found"):
        LearnedPolicy(tmp_path / "missing.onnx")


def test_learned_policy_is_lossless_in_the_loop(tmp_path, tiny_dirs):
    _export(tmp_path / "c.onnx", threshold=0.5, gate=0.4)
    pair = uag.load_pair(*tiny_dirs)
    policy = LearnedPolicy(tmp_path / "c.onnx")
    ref = uag.generate(pair, "Once upon a time", plan=None, max_new_tokens=30)
    out = uag.generate(pair, "Once upon a time", plan=RulePlan(policy), max_new_tokens=30)
    assert out.token_ids == ref.token_ids
    assert policy.decisions > 0


COST = {
    "decision": "cost",
    "rate_factor": "1.1",
    "logit_shift": "0.2",
    "gate": "true",
    # cheap drafts: a token is worth drafting above ~0.14 expected acceptance
    "latency_profile": {"device": "cpu:test", "draft_s": 0.005, "verify_s": [0.08, 0.085, 0.09]},
}


def test_copied_rounds_raise_the_bar_even_for_a_controller_without_a_gate(tmp_path):
    """A cost controller exported without a gate drafts every round of a run without copies;
    once prompt lookup's cheap copied rounds dominate, the rate its decisions price time at
    rises and the same round is skipped (drafting would cost more than it wins)."""
    extra = {
        "decision": "cost",
        "rate_factor": "1.1",
        "logit_shift": "-20",  # every score reads as a certain acceptance
        "gate": "false",
        "latency_profile": {
            "device": "cpu:test",
            "draft_s": 0.06,
            "verify_s": [0.08, 0.082, 0.084, 0.086],
        },
    }
    _export(tmp_path / "c.onnx", extra=extra)
    policy = LearnedPolicy(tmp_path / "c.onnx")
    assert not policy.info.gate

    def ctx(**copies: int) -> DraftContext:
        return DraftContext(
            iteration=120,
            generated=400,
            remaining=100,
            prev_drafted=2,
            prev_accepted=2,
            drafted_total=40,
            accepted_total=30,
            target_prob=0.9,
            target_entropy=0.4,
            lag=1,
            **copies,
        )

    assert policy.budget(ctx()) == 4
    # 95 copied rounds of 3 candidates, 4 tokens each: ~46 tokens/s against κ's 13.75
    assert policy.budget(ctx(copies=95, copied=285, copy_emitted=380)) == 0
    assert policy.budget(ctx(copies=2, copied=6, copy_emitted=8)) == 4  # a few: still drafts


def test_cost_decision_controller_in_the_loop_and_in_bench(tmp_path, tiny_dirs, capsys):
    """A controller that decides by cost: lossless in the loop, drafting where its prices say
    so, and bench prints replay's prediction for it beside the
    measurement."""
    _export(tmp_path / "c.onnx", extra=COST)
    policy = LearnedPolicy(tmp_path / "c.onnx")
    assert policy.info.decision == "cost" and policy.info.gate
    pair = uag.load_pair(*tiny_dirs)
    ref = uag.generate(pair, "Once upon a time", plan=None, max_new_tokens=30)
    out = uag.generate(pair, "Once upon a time", plan=RulePlan(policy), max_new_tokens=30)
    assert out.token_ids == ref.token_ids
    drafted = [r.drafted for r in out.iterations]
    assert policy.decisions > 0 and max(drafted) >= 1
    cfg = BenchConfig(
        prompts="mixed",
        limit=2,
        out=tmp_path,
        target=tiny_dirs[0],
        assistant=tiny_dirs[1],
        max_new_tokens=12,
        controller=tmp_path / "c.onnx",
        policies="target-only,learned,oracle",
        progress=False,
    )
    report = run_bench(cfg)
    assert "not held-out" not in capsys.readouterr().err  # no training prompts recorded in it
    by_name = {p.name: p for p in report.policies}
    assert by_name["learned"].identical and by_name["learned"].predicted is not None
    # exact replay makes the rounds the arm made (one run per prompt: repeats 1)
    assert by_name["learned"].predicted_forwards == by_name["learned"].target_forwards
    learned = by_name["learned"]  # a budget per round and a stop per drafted token, timed
    assert learned.decisions > learned.drafted > 0
    assert learned.as_row()["controller_us_per_decision"] > 0
    assert by_name["target-only"].as_row()["controller_us_per_decision"] is None
    assert "µs / decision" in report.markdown()
    # replay's prices: a slice after each of the 2 prompts, topped up to 7 rounds at the end
    assert report.profile is not None
    assert (report.profile["slices"], report.profile["rounds"]) == (3, 7)
    bad = {**COST, "decision": "guess"}
    _export(tmp_path / "bad.onnx", extra=bad)
    with pytest.raises(UagError, match="lacks uag metadata"):
        LearnedPolicy(tmp_path / "bad.onnx")


def test_bad_controller_input(tmp_path, capsys):
    (tmp_path / "junk.onnx").write_bytes(b"garbage")
    for path, message in (
        (tmp_path / "none.onnx", "not found"),
        (tmp_path / "junk.onnx", "not a valid ONNX"),
    ):
        assert main(["generate", "--prompt", "x", "--controller", str(path)]) == 2
        assert message in one_clean_line(capsys)
    _export(tmp_path / "old.onnx", schema=SCHEMA_VERSION + 1)
    assert main(["generate", "--prompt", "x", "--controller", str(tmp_path / "old.onnx")]) == 2
    assert "feature schema" in one_clean_line(capsys)


def test_bad_bench_input(tmp_path, capsys, tiny_dirs):
    base = [
        "bench",
        "--target",
        tiny_dirs[0],
        "--assistant",
        tiny_dirs[1],
        "--out",
        str(tmp_path / "b"),
    ]
    assert main([*base, "--prompts", "mixed", "--policies", "static-2,warp-speed"]) == 2
    assert "unknown policy" in one_clean_line(capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([*base, "--prompts", str(empty)]) == 2
    assert "empty" in one_clean_line(capsys)
    assert (
        main(
            [
                *base,
                "--prompts",
                "mixed",
                "--policies",
                "learned",
                "--controller",
                str(tmp_path / "no.onnx"),
            ]
        )
        == 2
    )
    assert "not found" in one_clean_line(capsys)
    assert main([*base, "--prompts", "mixed", "--policies", f"learned:{tmp_path / 'b.onnx'}"]) == 2
    assert "controller not found" in one_clean_line(capsys)  # the second controller's arm
    assert main([*base, "--prompts", "mixed", "--policies", "learned:x.txt"]) == 2
    assert "learned:PATH.onnx" in one_clean_line(capsys)


def test_bench_catches_a_broken_policy(tmp_path, tiny_dirs):
    def broken(prompt: str, n: int, seed: int | None) -> ArmRun:
        res = uag.generate(pair, prompt, plan=None, max_new_tokens=n)
        ids = res.token_ids[:-1] + [(res.token_ids[-1] + 1) % 100]  # one wrong token at the end
        return ArmRun(ids=ids, seconds=res.seconds, target_forwards=res.new_tokens)

    pair = uag.load_pair(*tiny_dirs)
    cfg = BenchConfig(
        prompts="mixed",
        limit=2,
        out=tmp_path,
        target=tiny_dirs[0],
        assistant=tiny_dirs[1],
        max_new_tokens=12,
        policies="target-only,static-2,static-2+lookup,oracle",
        progress=False,
    )
    report = run_bench(cfg, extra_arms={"broken": broken})
    by_name = {p.name: p for p in report.policies}
    assert by_name["static-2"].identical and by_name["static-2+lookup"].identical
    assert by_name["static-2+lookup"].predicted is not None  # replayed with its lookup
    assert by_name["static-2"].as_row()["lookup_acceptance"] is None
    assert by_name["static-2+lookup"].copied >= by_name["static-2+lookup"].copied_accepted
    assert not by_name["broken"].identical
    assert by_name["oracle"].simulated and by_name["oracle"].interval is None
    # The oracle drafts exactly what is accepted: no stop rule replays faster (it may still lose
    # to the target alone, which pays no round bookkeeping and no assistant prefill).
    assert by_name["oracle"].speedup_vs_target > 0
    assert by_name["target-only"].interval == (1.0, 1.0)
    # Replay's prediction beside the measurement: static-2 and the oracle are replayable.
    assert by_name["static-2"].predicted is not None and by_name["static-2"].predicted > 0
    assert by_name["target-only"].predicted is None and by_name["broken"].predicted is None
    assert by_name["static-2"].predicted <= by_name["oracle"].speedup_vs_target + 1e-9
    assert "replay predicts" in report.markdown()
    assert "add the `oracle` arm" not in report.markdown()  # it is here: the column is filled
    for res in report.policies:
        if not res.simulated:  # paired per prompt: the point estimate lies inside its interval
            assert res.interval is not None and len(res.per_prompt_seconds) == 2
            assert res.interval[0] <= res.speedup_vs_target <= res.interval[1]
    row = report.to_json()["policies"][0]
    assert set(row) >= {
        "name",
        "speedup_vs_target",
        "identical",
        "tokens_per_target_forward",
        "acceptance_rate",
        "seconds",
    }
    assert json.loads(json.dumps(report.to_json())) == report.to_json()  # plain JSON types


def test_bench_sampling_checks_the_distribution(tmp_path, tiny_dirs):
    """Under --sample the identity check becomes the paired log-probability check: exact
    speculative sampling passes it, an arm that samples another distribution fails it."""
    seeds: list[int | None] = []

    def greedy(prompt: str, n: int, seed: int | None) -> ArmRun:
        seeds.append(seed)  # ignores the sampling settings: argmax is not a sample of p
        res = uag.generate(pair, prompt, plan=None, max_new_tokens=n)
        return ArmRun(ids=res.token_ids, seconds=res.seconds, target_forwards=res.new_tokens)

    pair = uag.load_pair(*tiny_dirs)
    cfg = BenchConfig(
        prompts="mixed",
        limit=3,
        repeats=2,
        out=tmp_path,
        target=tiny_dirs[0],
        assistant=tiny_dirs[1],
        max_new_tokens=10,
        policies="target-only,static-2",
        sampling=SamplingConfig(temperature=1.0, seed=11),
        progress=False,
    )
    report = run_bench(cfg, extra_arms={"greedy": greedy})
    by_name = {p.name: p for p in report.policies}
    assert seeds == [11] + list(range(11, 17))  # warm-up, then round r runs with seed + r
    static, wrong = by_name["static-2"].check, by_name["greedy"].check
    assert static is not None and wrong is not None and static.pairs == wrong.pairs == 6
    assert static.consistent and by_name["static-2"].sound
    assert not wrong.consistent and wrong.mean > 0  # the argmax is likelier than a sample
    # The PIT test needs no reference: every token of every run against the target's exact
    # distribution. Exact arms (target-only included) pass; the argmax arm fails on its own.
    for name in ("target-only", "static-2"):
        uni = by_name[name].uniformity
        assert uni is not None and uni.samples == by_name[name].tokens and uni.consistent
    greedy_uni = by_name["greedy"].uniformity
    assert greedy_uni is not None and not greedy_uni.consistent
    # The excess log-probability, also without a reference: centred for exact arms, far above
    # zero for the argmax.
    for name in ("target-only", "static-2"):
        excess = by_name[name].excess
        assert excess is not None and excess.tokens == by_name[name].tokens and excess.consistent
    greedy_excess = by_name["greedy"].excess
    assert greedy_excess is not None and greedy_excess.z > 5 and not greedy_excess.consistent
    assert not by_name["greedy"].sound and by_name["target-only"].sound
    assert by_name["static-2"].drafted > 0
    row = {r["name"]: r for r in report.to_json()["policies"]}["static-2"]
    assert row["identical"] is None and row["same_distribution"] is True
    assert row["pit_uniformity"]["consistent"] is True
    assert "same distribution" in report.markdown() and "**NO**" in report.markdown()
    with pytest.raises(UagError, match="oracle"):
        run_bench(BenchConfig(**{**cfg.__dict__, "policies": "target-only,oracle"}))


def test_paired_check_needs_evidence_and_refuses_impossible_samples():
    from uag.harness.distribution import paired_check

    base = [-1.0, -2.0, -0.5, -1.5, -3.0, -1.2, -0.8, -2.2]
    same = paired_check(
        base, [b + d for b, d in zip(base, [0.1, -0.1, 0.05, -0.05] * 2, strict=True)]
    )
    assert same.consistent and abs(same.mean) < 1e-12
    shifted = paired_check(
        base, [b - 0.3 + d for b, d in zip(base, [0.01, -0.01] * 4, strict=True)]
    )
    assert not shifted.consistent and shifted.mean < 0
    # Two pairs estimate their spread too poorly for a verdict (Student's t, 1 d.o.f.).
    assert paired_check([0.0, 0.0], [-0.7, -0.75]).consistent
    impossible = paired_check(base, [*base[:-1], float("-inf")])  # a token outside top-p
    assert not impossible.consistent


def test_arm_order_rotates_every_round():
    names = ["target-only", "static-1", "learned"]
    firsts = [rotated(names, r)[0] for r in range(3)]
    assert sorted(firsts) == sorted(names)  # each arm goes first once in three rounds
    assert all(sorted(rotated(names, r)) == sorted(names) for r in range(5))


def test_bootstrap_interval_is_paired_by_prompt():
    # Every prompt agrees on 2x: no doubt about the ratio, however different the prompts' lengths.
    assert bootstrap_interval([2.0, 8.0, 20.0], [1.0, 4.0, 10.0]) == (2.0, 2.0)
    # Prompts that disagree: a real interval around the ratio of totals, reproducible.
    base, arm = [1.0, 1.0, 1.0, 1.0], [0.5, 0.8, 1.0, 1.25]
    low, high = bootstrap_interval(base, arm)
    assert low < sum(base) / sum(arm) < high
    assert (low, high) == bootstrap_interval(base, arm)
    # Tokens per second: an arm twice as fast per token that emitted half the tokens is 2x.
    assert bootstrap_interval(
        [2.0, 8.0], [0.5, 2.0], base_tokens=[100, 200], arm_tokens=[50, 100]
    ) == (2.0, 2.0)


def test_foreign_pair_device_or_decoding_is_named(tmp_path, capsys):
    _export(tmp_path / "c.onnx")
    policy = LearnedPolicy(tmp_path / "c.onnx")
    assert policy.info.decoding == "greedy"  # recorded by newer exports, the default for older
    home = dict(target="gemma-3-270m", assistant="smollm2-135m", assistant_int8=False, device="cpu")
    assert policy.warn_if_foreign(**home) == []
    assert policy.warn_if_foreign(**home, decoding="sampling") == [
        "trained on greedy decoding, running sampling"
    ]
    assert "its thresholds may not fit (the output is unaffected)" in capsys.readouterr().err
    notes = policy.warn_if_foreign(**{**home, "assistant_int8": True, "device": "cuda"})
    assert len(notes) == 2
    # Files from before the draft vocabulary was recorded make no claim about it.
    assert policy.info.draft_vocab is None
    assert policy.warn_if_foreign(**home, draft_vocab=16384) == []
    _export(tmp_path / "d.onnx", extra={"draft_vocab": "16384"})
    policy = LearnedPolicy(tmp_path / "d.onnx")
    assert policy.info.draft_vocab == 16384
    assert policy.warn_if_foreign(**home, draft_vocab=16384) == []
    assert policy.warn_if_foreign(**home, draft_vocab=0) == [
        "trained with draft vocabulary 16384, running all"
    ]


def test_features_mean_the_same_under_any_policy():
    """Schema 2: what earlier rounds drafted and accepted (which depends on the policy that ran
    them) never reaches a feature row, and ``generated`` stops at the collected horizon."""
    from uag.decoding.features import GENERATED_HORIZON, feature_row
    from uag.decoding.policy import DraftStep

    def row(**changes: float) -> np.ndarray:
        fields = dict(
            iteration=4, generated=20, remaining=100, prev_drafted=6, prev_accepted=1,
            drafted_total=24, accepted_total=6, target_prob=0.9, target_entropy=0.3,
        )  # fmt: skip
        ctx = DraftContext(**{**fields, **changes})  # type: ignore[arg-type]
        return feature_row(DraftStep(
            position=2, token_id=7, token_bytes=b"(", prob=0.8, entropy=0.5, margin=0.6,
            cum_logprob=-0.3, min_prob=0.8, target_tokens=2, context=ctx,
        ))  # fmt: skip

    base = row()
    assert np.array_equal(base, row(prev_drafted=1, prev_accepted=1, accepted_total=20))
    assert np.array_equal(row(generated=GENERATED_HORIZON), row(generated=10 * GENERATED_HORIZON))
    assert not np.array_equal(base, row(target_prob=0.2))  # what the target says does count


def test_repeat_length_finds_the_longest_repeated_suffix():
    """Schema 3's ``repeat``: the longest of 3/6/12/24 bytes of the text's end seen earlier in
    it (overlaps count, the end itself does not), on code, prose and CJK bytes; its feature
    moves the row, and the gate row (before any draft) blanks it."""
    from uag.decoding.features import feature_row, repeat_length, to_gate_rows
    from uag.decoding.policy import DraftStep

    assert repeat_length(b"") == repeat_length(b"abc") == 0
    assert repeat_length(b"the quick brown fox") == 0
    assert repeat_length(b"xyz-xyz") == 3
    assert repeat_length(b"aaaa") == 3  # an overlapping earlier occurrence counts
    assert repeat_length(b"hello world, hello world") == 6  # " hello world" is new
    assert repeat_length(b"0123456789abcdefghijklmn|0123456789abcdefghijklmn") == 24
    assert repeat_length("日本語のテキスト、日本語のテキスト".encode()) == 24
    assert repeat_length(bytearray(b"    return x\n    return x")) == 12

    def row(repeat: int) -> np.ndarray:
        ctx = DraftContext(
            iteration=1, generated=5, remaining=50, prev_drafted=0, prev_accepted=0,
            drafted_total=0, accepted_total=0, target_prob=0.5, target_entropy=1.0,
        )  # fmt: skip
        return feature_row(DraftStep(
            position=1, token_id=7, token_bytes=b"x", prob=0.5, entropy=1.0, margin=0.2,
            cum_logprob=-0.7, min_prob=0.5, target_tokens=1, context=ctx, repeat=repeat,
        ))  # fmt: skip

    column = FEATURE_NAMES.index("repeat")
    assert row(0)[column] == 0.0 and row(24)[column] > row(3)[column] > 0.0
    assert np.array_equal(to_gate_rows(row(24)[None]), to_gate_rows(row(0)[None]))


def test_the_previous_stop_controller_loads_and_decides_sensibly():
    """exports/ctrl-stop.onnx (the stop controller shipped before the plans, still a
    ``learned:PATH`` arm) as users get it: its contract matches this code, it rates a confident
    draft above a hopeless one, keeps drafting after the confident one and stops after the
    hopeless one. (The schema-1 controller stopped after both: it read a confident draft after
    a short, fully accepted round as ~0.67, below its 0.82 threshold.)"""
    from pathlib import Path

    from uag.decoding.policy import DraftStep

    shipped = Path(__file__).resolve().parents[1] / "exports" / "ctrl-stop.onnx"
    policy = LearnedPolicy(shipped)
    assert policy.info.feature_names == list(FEATURE_NAMES)
    assert policy.info.schema_version == SCHEMA_VERSION
    from uag.harness.prompts import load_prompts

    # trained on :train prompts only, so every bench of :test prompts in the README is held-out
    held_out = [p.id for p in load_prompts("humaneval:test+mixed:test")]
    assert len(policy.info.train_prompts) == 120 and policy.warn_if_trained_on(held_out) == []
    train = [p.id for p in load_prompts("humaneval:train")]
    assert set(policy.info.train_prompts) & set(train)
    assert 0 < policy.info.threshold < 1
    ctx = DraftContext(
        iteration=4, generated=20, remaining=100, prev_drafted=3, prev_accepted=3,
        drafted_total=12, accepted_total=9, target_prob=0.95, target_entropy=0.2,
    )  # fmt: skip

    def step(prob: float) -> DraftStep:
        return DraftStep(
            position=1, token_id=42, token_bytes=b" the", prob=prob, entropy=0.1 if prob > 0.5 else 4.0,
            margin=prob - 0.01, cum_logprob=float(np.log(prob)), min_prob=prob, target_tokens=1,
            context=ctx,
        )  # fmt: skip

    from uag.decoding.features import feature_row

    assert policy.budget(ctx) >= 1
    confident, hopeless = (policy._score(feature_row(step(p))) for p in (0.99, 0.02))
    assert confident > hopeless + 0.2
    assert policy.stop(step(0.02))
    assert policy.budget(ctx) >= 1  # a new round (the cost rule carries survival within one)
    assert not policy.stop(step(0.99))


def test_bench_warns_when_a_prompt_was_in_the_controllers_training_data(tmp_path, capsys):
    from uag.harness.prompts import load_prompts

    ids = [p.id for p in load_prompts("mixed", limit=3)]
    _export(tmp_path / "c.onnx", extra={"train_prompt_ids": json.dumps([ids[1], "elsewhere"])})
    policy = LearnedPolicy(tmp_path / "c.onnx")
    assert policy.info.train_prompts == frozenset({ids[1], "elsewhere"})
    assert policy.warn_if_trained_on(ids) == [ids[1]]
    err = capsys.readouterr().err
    assert f"trained on 1 of these 3 prompts ({ids[1]})" in err and "not held-out" in err
    assert policy.warn_if_trained_on([ids[0], ids[2]]) == []
    assert capsys.readouterr().err == ""
    _export(tmp_path / "old.onnx")  # exported before the ids were recorded: nothing to say
    assert LearnedPolicy(tmp_path / "old.onnx").warn_if_trained_on(ids) == []


@pytest.mark.parametrize(
    ("name", "decoding"), [("ctrl.onnx", "greedy"), ("ctrl-sampling.onnx", "sampling")]
)
def test_the_shipped_plans_keep_their_contract(name, decoding):
    """exports/ctrl.onnx (greedy) and exports/ctrl-sampling.onnx as users get them: plans over
    this code's features and an action set it runs, trained on ``:train`` prompts only (so a
    bench of ``:test`` prompts is held-out), their figures measured on report prompts they
    were neither trained nor tuned on."""
    from pathlib import Path

    from controllers.learned_plan import LearnedPlan, load_controller
    from uag.decoding.actions import Copy, Step
    from uag.harness.prompts import load_prompts

    path = Path(__file__).resolve().parents[1] / "exports" / name
    plan = load_controller(path)
    assert isinstance(plan, LearnedPlan) and plan.info.decoding == decoding
    assert Step() in plan.actions and Copy(length=15) in plan.actions
    held_out = [p.id for p in load_prompts("humaneval:test+mixed:test")]
    assert plan.info.train_prompts and plan.warn_if_trained_on(held_out) == []
    report = json.loads(plan.info.raw["report_prompt_ids"])
    assert report and not set(report) & plan.info.train_prompts
    assert plan.info.raw["figures_on"] == "report"
    assert plan.rate > 0
