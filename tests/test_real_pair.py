"""The real cross-tokenizer pair (Gemma 3 270M ← SmolLM2 135M): lossless where it matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import uag
from controllers.plans import RulePlan
from controllers.rules import ConfidencePolicy, HeuristicPolicy, StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.tiny import (
    integer_products_excess,
    logits_after_crop_and_fresh,
    one_row_vs_chunked_logits,
)
from uag.decoding.verifiers import TIE_BOUND
from uag.kernels import choice as kernels
from uag.kernels import native
from uag.runtime.models import load_model
from uag.runtime.runner import CachedLM

pytestmark = pytest.mark.real


NASTY_CI_PROMPTS = (
    "combining_accents",
    "cjk",
    "crlf",
    "emoji_run",
    "long_digits",
    "python_deep_indent",
    "special_token_text",
    "unicode_mix",
)
"""The nasty prompts CI runs on the real pair (each kind of trap once; ``-m slow`` runs all)."""


def _ci_or_slow(names: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(n, marks=() if n in names else pytest.mark.slow) for n in sorted(NASTY_PROMPTS)
    ]


@pytest.mark.parametrize("name", _ci_or_slow(NASTY_CI_PROMPTS))
def test_lossless_on_nasty_prompts(real_pair, name):
    prompt = NASTY_PROMPTS[name]
    ref = uag.generate(real_pair, prompt, plan=None, max_new_tokens=16)
    out = uag.generate(real_pair, prompt, plan=RulePlan(StaticPolicy(k=6)), max_new_tokens=16)
    assert out.token_ids == ref.token_ids, (out.text, ref.text)


BF16_CI_PROMPTS = ("emoji_run",)


@pytest.fixture(scope="module")
def bf16_plain_pair():
    """The embedded pair in bfloat16 on the plain path (a GPU's arithmetic, on this CPU)."""
    return uag.load_pair(kernels="plain", dtype="bfloat16")


@pytest.mark.parametrize("name", _ci_or_slow(BF16_CI_PROMPTS))
def test_lossless_in_bf16_on_the_plain_path(bf16_plain_pair, name):
    """``--kernels plain --dtype bfloat16``, lookahead 6: the load-time check
    (``uag.runtime.invariance``) settles the path row-count invariant, padded or not, or the
    guard stays on; either way the output is the target's own (all prompts with -m slow)."""
    pair = bf16_plain_pair
    assert pair.kernels == "plain" and pair.target_lm.invariance is not None
    prompt = NASTY_PROMPTS[name]
    ref = uag.generate(pair, prompt, plan=None, max_new_tokens=16)
    out = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=6)), max_new_tokens=16)
    assert out.token_ids == ref.token_ids, (out.text, ref.text)


def _sample_ids(pair) -> list[int]:
    text = "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)\n\n# 日本語 ✓ 😀\r\n"
    return pair.target.tokenizer(text * 6)["input_ids"]


@pytest.mark.skipif(
    kernels.resolve_kernels("auto", torch.device("cpu"), torch.float32) == "plain",
    reason="neither the native kernel nor oneDNN is usable here",
)
def test_real_target_rows_are_bitwise_invariant(real_pair):
    """A position's logits are the same bits whether it is verified among 2–9 positions or
    computed alone as target-alone does: greedy UAG is lossless by construction here."""
    assert real_pair.kernels in ("native", "onednn") and real_pair.target_lm.row_invariant
    if real_pair.kernels == "native":  # Gemma's Q5_0/Q8_0 and Q4_K/Q6_K projections held exact
        for layer in real_pair.target_lm.lean.layers:
            assert layer.qkv.exact_format == layer.gate_up.exact_format == "block_int8"
            assert layer.o.exact_format == layer.down.exact_format == "block_affine"
    ids = _sample_ids(real_pair)
    alone, chunked = one_row_vs_chunked_logits(real_pair.target_lm, ids[:40], ids[40:100])
    assert torch.equal(alone, chunked)


@pytest.mark.skipif(
    native.native_unavailable() is not None or not native._library()[0].uag_x8_available(),
    reason="exact.c's fast paths (AVX-512 VNNI) do not run here: the body stays on skinny.c",
)
def test_real_kquant_projections_read_the_files_own_blocks_factored(real_pair):
    """Gemma's Q4_K / Q6_K projections (o, down) reach ``exact.c`` with the GGUF's own integers
    and parameters (``uag.runtime.kquants``), factored into a unit per 256 inputs times int8
    multipliers; its Q5_0 / Q8_0 ones (a scale per 32, no shared unit) stay plain."""
    for layer in real_pair.target_lm.lean.layers:
        assert layer.o.x8_span == layer.down.x8_span == 256
        assert layer.qkv.x8_span == layer.gate_up.x8_span == 0


@pytest.mark.skipif(native.native_unavailable() is not None, reason="native kernel unavailable")
def test_real_screened_head_is_the_fp32_argmax(real_pair, plain_target):
    """Gemma's int8-screened head picks exactly the fp32 head's token at every position of real
    text (and computes that token's logit exactly), with only a few dozen exact rows per position;
    its exact blocks (no fp32 copy kept) give the fp32 head's logits bitwise, and the full head
    sampling reads is within exact.c's activation grid and 4 roundings (of sum |x||w|) of the
    exact product."""
    from uag.kernels.screened import ScreenedHead

    lm = real_pair.target_lm
    screened = lm._greedy.fast
    assert isinstance(screened, ScreenedHead)
    assert screened.exact is not None and screened.weight is None
    ids = _sample_ids(real_pair)
    lm.reset(ids, rollback=False)
    hidden = lm.forward()  # [n, h]: every position of the sample
    fp32_head = plain_target.model.get_output_embeddings()  # the checkpoint's own fp32 weight
    full = native.NativeLinear(fp32_head, exact_blocks=False)(hidden)
    assert torch.equal(screened.exact(hidden), full)
    sampling = screened.full_head()  # exact.c's integer sums where the CPU runs it: not bitwise
    assert torch.equal(lm.full_logits(hidden), sampling(hidden))  # what sampling reads
    if not native.integer_products():  # no AVX-512 VNNI: the exact blocks on skinny.c
        assert torch.equal(sampling(hidden), full)  # bitwise the fp32 kernel's chain
        return
    block = screened.full_head().x8_block  # exact.c's activation grid, then float roundings
    assert (
        integer_products_excess(sampling(hidden), hidden, fp32_head.weight, None, block=block) <= 4
    )
    top = full.argmax(-1)
    default = screened.RESCREEN
    try:  # the default, and rows with > 256 candidates narrowed by a second level
        for rescreen in (default, 256):
            screened.RESCREEN = rescreen
            logits = screened(hidden)
            assert torch.equal(logits.argmax(-1), top)
            rows = torch.arange(len(top))
            assert torch.equal(logits[rows, top], full[rows, top])
    finally:
        screened.RESCREEN = default
    assert screened.last_candidates < 32 * len(top)  # the bounds are tight: ~21 per position


@pytest.fixture(scope="module")
def plain_target():
    """A second, unmodified copy of the real target (stock linears)."""
    return load_model("gemma-3-270m")


@pytest.mark.slow  # 70 s; the bf16 plain-path runs above exercise the guard in CI
def test_plain_kernel_row_differences_are_far_under_the_guard_bound(real_pair, plain_target):
    """With non-invariant kernels the loop recomputes positions whose top-2 margin is under
    TIE_BOUND; that is safe only while row-count differences stay far below it."""
    lm = CachedLM(plain_target.model, greedy_head=True)
    assert not lm.row_invariant
    ids = _sample_ids(real_pair)
    alone, chunked = one_row_vs_chunked_logits(lm, ids[:40], ids[40:80])
    diff = float((alone - chunked).abs().max())
    assert 2 * diff < TIE_BOUND / 10, diff


def test_real_lean_forward_matches_transformers(real_pair, plain_target):
    """The lean forward on the real target (past its 512-token sliding window) gives
    Transformers' own logits within float noise."""
    ids = _sample_ids(real_pair) * 6
    assert len(ids) > 600
    outs = []
    for lean in (True, False):
        lm = CachedLM(plain_target.model, lean=lean)
        lm.reset(ids[:560], rollback=True)
        lm.forward()
        lm.ids.extend(ids[560:565])
        outs.append(lm.logits(lm.forward()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=2e-3)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_lossless_with_chat_template(real_pair):
    prompt = "Write a Python function that reverses a string."
    ref = uag.generate(real_pair, prompt, plan=None, max_new_tokens=24, chat=True)
    out = uag.generate(
        real_pair, prompt, plan=RulePlan(ConfidencePolicy()), max_new_tokens=24, chat=True
    )
    assert out.token_ids == ref.token_ids
    assert ref.prompt_tokens > 10
    ids = real_pair.target_lm.ids
    assert ids[0] == 2 and 2 not in ids[1:]  # one BOS, even though the template writes "<bos>"


def test_pair_actually_agrees(real_pair):
    """Sanity: on easy code the assistant's drafts are accepted often (the bridge lines up)."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return"
    out = uag.generate(real_pair, prompt, plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=24)
    assert out.acceptance_rate > 0.3
    assert out.tokens_per_forward > 1.3


def test_long_prompt_past_sliding_window(real_pair):
    """Over 600 prompt tokens: Gemma 3's 512-token sliding layers must roll back on rejection."""
    prompt = "\n\n".join(NASTY_PROMPTS[k] for k in sorted(NASTY_PROMPTS)) + "\n\nSummary:"
    ref = uag.generate(real_pair, prompt, plan=None, max_new_tokens=24)
    assert ref.prompt_tokens > 600
    out = uag.generate(
        real_pair, prompt, plan=RulePlan(HeuristicPolicy(start=4)), max_new_tokens=24
    )
    assert out.token_ids == ref.token_ids
    assert any(r.accepted_candidates < r.candidates for r in out.iterations)


def test_gemma_logits_after_crop_equal_fresh_prefill(real_pair, plain_target):
    """Past the sliding window, a rolled-back cache gives a fresh prefill's logits: on the
    pair's prepared target (native kernels, no Transformers model) and on the stock one."""
    ids = real_pair.target.tokenizer(" ".join(["word"] * 620))["input_ids"]
    for model in (real_pair.target_lm, plain_target.model):
        after, expected = logits_after_crop_and_fresh(model, ids, [1000, 2000, 3000], 4000)
        torch.testing.assert_close(after, expected, rtol=1e-3, atol=1e-3)


def test_eos_ids_are_each_models_own(real_pair):
    assert 1 in real_pair.target.eos_ids  # Gemma <eos>
    assert 1 not in real_pair.assistant.eos_ids  # SmolLM2 id 1 is <|im_start|>, not an EOS
    assert 2 in real_pair.assistant.eos_ids  # SmolLM2 <|im_end|>


def test_cli_generate_compare_json():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "uag.cli",
            "generate",
            "--prompt",
            "The three primary colors are",
            "--max-new-tokens",
            "12",
            "--compare-target-only",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["identical"] is True
    assert result["policy"] == "learned"  # the default: the shipped plan
    assert result["new_tokens"] == 12
    for key in (
        "text",
        "target_forwards",
        "drafted_tokens",
        "accepted_tokens",
        "seconds",
        "target_only_seconds",
        "speedup",
    ):
        assert key in result


@pytest.mark.parametrize(
    "name",
    [*(pytest.param(n, marks=pytest.mark.slow) for n in ("python_deep_indent", "cjk")), "crlf"],
)
def test_default_generate_is_the_target_alone(name, capsys):
    """``uag generate`` with no policy or precision flag (the shipped controller's
    the learned plan, the int8 assistant on CPU) emits the target's own tokens."""
    from uag.cli import main

    argv = ["generate", "--prompt", NASTY_PROMPTS[name], "--max-new-tokens", "16"]
    assert main([*argv, "--compare-target-only", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["identical"] is True and result["policy"] == "learned"
    assert "warning" not in captured.err  # the controller runs where it was trained


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_policy",
    [
        lambda: StaticPolicy(k=2),
        lambda: StaticPolicy(k=5),
        lambda: HeuristicPolicy(),
        lambda: ConfidencePolicy(),
    ],
)
def test_lossless_long_generations(real_pair, make_policy):
    for name in sorted(NASTY_PROMPTS):
        ref = uag.generate(real_pair, NASTY_PROMPTS[name], plan=None, max_new_tokens=64)
        out = uag.generate(
            real_pair, NASTY_PROMPTS[name], plan=RulePlan(make_policy()), max_new_tokens=64
        )
        assert out.token_ids == ref.token_ids, name


@pytest.mark.slow
def test_lossless_with_float_assistant():
    """``real_pair`` (``load_pair()``'s default on CPU) drafts with the int8 assistant; the
    float one, ``--no-assistant-int8``, is lossless too."""
    pair = uag.load_pair(assistant_int8=False)
    assert not pair.assistant_int8
    for name in ("python_deep_indent", "unicode_mix", "crlf", "long_digits"):
        ref = uag.generate(pair, NASTY_PROMPTS[name], plan=None, max_new_tokens=32)
        out = uag.generate(
            pair, NASTY_PROMPTS[name], plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=32
        )
        assert out.token_ids == ref.token_ids, name


def test_exact_replay_makes_the_loops_rounds_on_the_real_pair(real_pair):
    """``uag.harness.dryrun`` on the real cross-tokenizer pair: for a static lookahead, the stop
    controller (which reads the target's statistics) and the shipped plan (copies of its own
    lengths, steps and drafts), the replayed rounds are the loop's."""
    from pathlib import Path

    from controllers.learned import LearnedPolicy
    from controllers.learned_plan import LearnedPlan
    from uag.api import encode_prompt, render_prompt
    from uag.decoding.profile import LatencyProfile
    from uag.harness import dryrun

    exports = Path(__file__).resolve().parents[1] / "exports"
    shipped = exports / "ctrl-stop.onnx"
    profile = LatencyProfile(device="cpu:test", draft_s=0.005, verify_s=[0.016, 0.017])
    fields = ("drafted", "candidates", "accepted_candidates", "emitted", "accepted_drafts")
    for name in ("python_deep_indent", "unicode_mix", "crlf"):
        prompt = NASTY_PROMPTS[name]
        target_ids, assistant_ids = encode_prompt(
            real_pair, render_prompt(real_pair, prompt, chat=False)
        )
        trace = dryrun.record_trace(real_pair, target_ids, 24)
        for make in (
            lambda: RulePlan(StaticPolicy(k=3)),
            lambda: RulePlan(LearnedPolicy(shipped)),
            lambda: LearnedPlan(exports / "ctrl.onnx"),
        ):
            live = uag.generate(real_pair, prompt, plan=make(), max_new_tokens=24)
            run = dryrun.replay(
                real_pair, trace, make(), prompt_assistant_ids=assistant_ids, profile=profile
            )
            assert tuple(live.token_ids) == trace.ids
            rounds = [[getattr(r, f) for f in fields] for r in run.records]
            assert rounds == [[getattr(r, f) for f in fields] for r in live.iterations], name


@pytest.mark.slow  # loads the target a second time as a float assistant (~60 s)
def test_shipped_controller_keeps_drafting_when_every_draft_is_accepted():
    """Issue 9's lock-in: the schema-1 controller read a short, fully accepted round as a reason
    to stop, and froze into skipping. With the target as its own assistant every draft is
    accepted (over every id: ``draft_vocab=0``); the shipped controller must keep drafting in
    every round, on code, prose and CJK."""
    from pathlib import Path

    from controllers.learned import LearnedPolicy

    pair = uag.load_pair(
        target="gemma-3-270m", assistant="gemma-3-270m", draft_vocab=0, assistant_int8=False
    )  # the float assistant: the target's own logits, so every draft is accepted
    policy = LearnedPolicy(Path(__file__).resolve().parents[1] / "exports" / "ctrl-stop.onnx")
    for name in ("python_deep_indent", "prose", "cjk"):
        out = uag.generate(pair, NASTY_PROMPTS[name], plan=RulePlan(policy), max_new_tokens=48)
        rounds, room = [], 48
        for r in out.iterations:
            if room > 1 and r is not out.iterations[0]:  # round 0: the prompt; room 1: no draft
                rounds.append(r)
            room -= r.emitted
        assert rounds and all(r.drafted >= 1 for r in rounds), (name, [r.drafted for r in rounds])
        assert sum(r.accepted_drafts for r in rounds) == sum(r.drafted for r in rounds), name


def test_shipped_plan_keeps_copying_when_every_copy_is_accepted(real_pair):
    """Issue 9's lock-in, extended to the plan's actions: a controller whose own successes
    read as a reason to stop freezes into the plain step. Exact replay against a fabricated
    record whose continuation is the prompt again, token for token (so every copy of the
    match is right): once a copy has been accepted whole, the shipped plan must not freeze:
    every later copy accepted, never two plain steps in a row, copies that do not shrink while
    they keep being right, and on the longest repetition copies as far as a verify allows.
    (The schema-4 plan weighs how often the matched tail occurred before: on a repetition a
    few tokens old it copies short and may take one step; the schema-3 plan copied 15 at once.
    Drafts: on this machine's prices the plan drafts in few rounds; the stop controller's test
    above covers drafting on.)"""
    from pathlib import Path

    from controllers.learned_plan import LearnedPlan
    from uag.api import encode_prompt, render_prompt
    from uag.decoding.actions import Copy, Step
    from uag.decoding.profile import LatencyProfile
    from uag.decoding.round import MAX_CANDIDATES
    from uag.harness import dryrun

    plan_file = Path(__file__).resolve().parents[1] / "exports" / "ctrl.onnx"
    profile = LatencyProfile(device="cpu:test", draft_s=0.005, verify_s=[0.016, 0.017])
    for name in ("python_deep_indent", "prose", "cjk"):
        target_ids, assistant_ids = encode_prompt(
            real_pair, render_prompt(real_pair, NASTY_PROMPTS[name], chat=False)
        )
        again = tuple(target_ids[1:])[:64]  # the prompt once more (after its BOS)
        trace = dryrun.TargetTrace(
            prompt_ids=tuple(target_ids),
            ids=again,
            probs=(0.9,) * len(again),
            entropies=(0.5,) * len(again),
            prefill_s=0.0,
        )
        plan = LearnedPlan(plan_file)
        run = dryrun.replay(
            real_pair, trace, plan, prompt_assistant_ids=assistant_ids, profile=profile
        )
        records = run.records
        first_full = next(
            i for i, r in enumerate(records) if r.lookup and r.accepted_candidates == r.candidates
        )
        later = list(zip(plan.taken[first_full + 1 :], records[first_full + 1 :], strict=True))
        assert later, name
        taken = [a.name for a in plan.taken]
        for action, record in later:
            assert isinstance(action, Copy | Step), (name, taken)
            assert record.accepted_candidates == record.candidates, name
        kinds = [isinstance(a, Step) for a, _ in later]
        assert not any(a and b for a, b in zip(kinds, kinds[1:], strict=False)), (name, taken)
        assert not kinds[-1], (name, taken)  # it ends copying
        lengths = [a.length for a, _ in later[:-1] if isinstance(a, Copy)]  # the last: room
        assert lengths == sorted(lengths), (name, taken)
        if name == "python_deep_indent":  # the longest repetition (64 tokens)
            assert max(lengths) >= MAX_CANDIDATES - 1, (name, taken)
