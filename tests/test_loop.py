"""The speculative loop with tiny random models: lossless under every policy and edge case."""

from __future__ import annotations

import warnings

import pytest
import torch

import uag
from controllers.plans import RulePlan
from controllers.rules import ConfidencePolicy, EntropyPolicy, HeuristicPolicy, StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.tiny import (
    feed_both_and_compare,
    logits_after_crop_and_fresh,
    one_row_vs_chunked_logits,
    same_tokenizer_pair,
    tiny_gemma,
    tiny_llama,
)
from uag.errors import UagError
from uag.kernels import choice as kernels
from uag.kernels import native
from uag.runtime.runner import CachedLM

POLICIES = [
    lambda: StaticPolicy(k=1),
    lambda: StaticPolicy(k=4),
    lambda: HeuristicPolicy(start=2),
    lambda: ConfidencePolicy(threshold=0.4, max_lookahead=6),
    lambda: EntropyPolicy(threshold=1.5, max_lookahead=6),
]


@pytest.mark.parametrize("name", sorted(NASTY_PROMPTS))
def test_cross_tokenizer_lossless_on_nasty_prompts(cross, name):
    prompt = NASTY_PROMPTS[name]
    ref = uag.generate(cross, prompt, plan=None, max_new_tokens=24)
    out = uag.generate(cross, prompt, plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=24)
    assert out.token_ids == ref.token_ids
    assert out.text == ref.text


@pytest.mark.parametrize("make_policy", POLICIES)
def test_lossless_with_partial_acceptance(similar, make_policy):
    for prompt in ("def f(x):\n    return", "Hello 😀 你好", "9 9 9 9 9"):
        ref = uag.generate(similar, prompt, plan=None, max_new_tokens=40)
        out = uag.generate(similar, prompt, plan=RulePlan(make_policy()), max_new_tokens=40)
        assert out.token_ids == ref.token_ids


def test_noisy_pair_exercises_accept_and_reject(similar):
    out = uag.generate(
        similar, "def f(x):\n    return", plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=60
    )
    accepted = [r.accepted_candidates for r in out.iterations]
    assert any(a == r.candidates and a > 0 for a, r in zip(accepted, out.iterations, strict=True))
    assert any(a < r.candidates for a, r in zip(accepted, out.iterations, strict=True))
    assert out.target_forwards < out.new_tokens  # drafting saved target passes


def test_exact_assistant_accepts_everything(tokenizers):
    pair = same_tokenizer_pair(tokenizers, noise=0.0)
    ref = uag.generate(pair, "The", plan=None, max_new_tokens=30)
    out = uag.generate(pair, "The", plan=RulePlan(StaticPolicy(k=5)), max_new_tokens=30)
    assert out.token_ids == ref.token_ids
    assert out.acceptance_rate == 1.0
    assert out.target_forwards == 6  # the prompt prefilled alone, then 5 drafted + 1 bonus per pass


def test_sliding_window_crop_past_window(tokenizers):
    """Window 8, 60 tokens with rejections: crops beyond the window must roll back exactly."""
    pair = same_tokenizer_pair(tokenizers, noise=0.5)
    prompt = "x " * 20
    ref = uag.generate(pair, prompt, plan=None, max_new_tokens=60)
    out = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=60)
    assert out.token_ids == ref.token_ids
    assert any(r.accepted_candidates < r.candidates for r in out.iterations)


@pytest.mark.parametrize("lean", [True, False])
def test_crop_semantics(tokenizers, lean):
    model = tiny_gemma(len(tokenizers[0]))
    lm = CachedLM(model, lean=lean)
    assert (lm.lean is not None) == lean
    lm.reset(list(range(10, 30)), rollback=True)
    lm.forward()
    assert lm.cache.get_seq_length() == 20
    if not lean:
        with pytest.raises((ValueError, RuntimeError)):
            lm.cache.crop(3)  # positive counts are refused by Transformers 5 (every layer kind)
    lm.truncate(17)
    assert lm.cache.get_seq_length() == 17 and lm.cached == 17 and len(lm.ids) == 17


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_lean_forward_matches_transformers(tokenizers, family):
    """The lean forward reproduces Transformers' on the same weights: a 40-token prefill past
    Gemma's sliding window (8), then chunks of 1-20 rows (row-wise and block attention), a
    rollback, and a re-feed."""
    vocab = len(tokenizers[0])
    model = tiny_gemma(vocab, sliding_window=8) if family == "gemma" else tiny_llama(vocab)
    lean, ref = CachedLM(model), CachedLM(model, lean=False)
    assert lean.lean is not None and ref.lean is None
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (120,), generator=gen).tolist()
    feed_both_and_compare(
        lean, ref, ids, prefill=40, chunks=(1, 3, 20, 1, 9, 17, 2), reject=5, tol=1e-5
    )


def test_logits_after_crop_equal_fresh_prefill(tokenizers):
    model = tiny_gemma(len(tokenizers[0]), sliding_window=8)
    ids = list(range(100, 140))
    after_crop, expected = logits_after_crop_and_fresh(model, ids, [5, 6, 7, 8, 9], 77)
    torch.testing.assert_close(after_crop, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_lean_forward_in_bfloat16_is_silent_and_agrees(tokenizers, family):
    """The dtype GPUs run (bf16): the lean forward warns nothing and stays close to
    Transformers' (bf16 rounding differs between the two by design, so the bound is loose)."""
    vocab = len(tokenizers[0])
    model = tiny_gemma(vocab) if family == "gemma" else tiny_llama(vocab)
    model = model.to(torch.bfloat16)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lean in (True, False):
            lm = CachedLM(model, lean=lean)
            lm.reset(list(range(5, 40)), rollback=True)
            lm.forward()
            lm.ids.extend([7, 8, 9])
            outs.append(lm.logits(lm.forward()))
    assert outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)


@pytest.mark.skipif(native.native_unavailable() is not None, reason="native kernel unavailable")
@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_native_layers_match_the_torch_path(tokenizers, family):
    """``layer.c`` (every layer in one call) against the lean torch path on the same native linears:
    equal within float noise through prefill, chunks of 1-16 rows past the sliding window, and
    a rollback; and each row's logits bitwise the same whatever the chunking."""
    vocab = len(tokenizers[0])
    model = tiny_gemma(vocab, sliding_window=8) if family == "gemma" else tiny_llama(vocab)
    kernels.swap_linears(model, "native", head=True)
    fast, torch_path = CachedLM(model), CachedLM(model)
    torch_path.lean.native = None
    assert fast.lean.native is not None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (90,), generator=gen).tolist()
    # A 12-token prefill: also native (≤ 16 rows).
    feed_both_and_compare(
        fast, torch_path, ids, prefill=12, chunks=(1, 16, 3, 9, 1, 5), reject=4, tol=3e-2
    )
    alone, chunked = one_row_vs_chunked_logits(fast, ids[:10], ids[10:60])
    assert torch.equal(alone, chunked)


@pytest.mark.skipif(native.native_unavailable() is not None, reason="native kernel unavailable")
@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_half_kv_cache_for_the_assistant(tokenizers, family):
    """``LeanBody.half_kv`` (the assistant's keys and values at half the bytes): ``layer.c`` and
    the torch path read the same half floats (equal within float noise through prefill, chunks
    past the sliding window and a rollback), each row is bitwise the same whatever the chunking,
    the logits stay close to a float cache's without equalling them, and a forward over a cache
    of the other dtype is refused."""
    vocab = len(tokenizers[0])
    model = tiny_gemma(vocab, sliding_window=8) if family == "gemma" else tiny_llama(vocab)
    kernels.swap_linears(model, "native", head=True)
    half, torch_half, full = CachedLM(model), CachedLM(model), CachedLM(model)
    assert half.lean.half_kv()
    torch_half.lean.native = None
    torch_half.lean.kv_dtype = torch.float16
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (90,), generator=gen).tolist()
    feed_both_and_compare(
        half, torch_half, ids, prefill=12, chunks=(1, 16, 3, 9, 1, 5), reject=4, tol=1e-3
    )
    assert half.cache.keys[0].dtype == torch_half.cache.keys[0].dtype == torch.float16
    alone, chunked = one_row_vs_chunked_logits(half, ids[:10], ids[10:60])
    assert torch.equal(alone, chunked)
    outs = []
    for lm in (half, full):
        lm.reset(ids[:30], rollback=False)
        lm.forward()
        lm.ids.extend(ids[30:33])
        outs.append(lm.logits(lm.forward()))
    assert full.cache.keys[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=0.02, atol=0.02)
    assert not torch.equal(outs[0], outs[1])
    half.reset(ids[:3], rollback=False)
    half.cache = full.lean.new_cache()  # float keys and values under half-float layers
    with pytest.raises(RuntimeError, match="cache dtype"):
        half.forward()


def test_pair_caches_the_assistant_in_half_floats_and_the_target_in_floats(cross):
    uag.generate(cross, "Hello world", plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=12)
    if cross.assistant_lm.lean is None or cross.assistant_lm.lean.native is None:
        pytest.skip("the assistant runs without the native layers here")
    assert cross.assistant_lm.cache.keys[0].dtype == torch.float16
    assert cross.assistant_lm.lean.prompts_native
    assert cross.target_lm.lean is not None
    assert cross.target_lm.cache.keys[0].dtype == torch.float32
    assert cross.target_lm.lean.prompts_native  # both models' prompts run on layer.c


@pytest.mark.parametrize("which", ["similar", "cross"])
def test_each_draft_step_knows_how_much_of_its_text_repeats(which, request):
    """The ``repeat`` feature as the loop computes it: for every drafted token, the longest
    repeated suffix of the prompt's text, the target's text before the round and the draft so
    far (recomputed here from the result); a repetitive prompt gives some non-zero ones."""
    from uag.api import encode_prompt
    from uag.decoding.features import repeat_length

    pair = request.getfixturevalue(which)
    prompt = "one two three, one two three, one two three, one two"
    r = uag.generate(
        pair, prompt, plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=40, keep_steps=True
    )
    prompt_bytes = pair.bridge.target.bytes_of(encode_prompt(pair, prompt)[0])
    done, seen = 0, []
    for it in r.iterations:
        before, draft = pair.bridge.target.bytes_of(r.token_ids[:done]), b""
        healed = sum(step.respelled for step in it.steps)  # drafted again: not counted twice
        before = before[: len(before) - healed]
        for step in it.steps:
            draft += step.token_bytes
            assert step.repeat == repeat_length(prompt_bytes + before + draft)
            seen.append(step.repeat)
        done += it.emitted
    assert seen and max(seen) > 0


@pytest.mark.skipif(native.native_unavailable() is not None, reason="native kernel unavailable")
def test_native_layers_follow_their_cache_across_growth_and_twins(tokenizers):
    """The body's one C call takes each layer's key/value addresses from a table kept for the
    cache in use (``NativeLayers._addresses``): two sequences on one body, alternating step by
    step, each with a cache that grows (its tensors replaced) mid-decode, give bitwise what
    each gives alone with room reserved up front."""
    vocab = len(tokenizers[0])
    model = tiny_llama(vocab)
    kernels.swap_linears(model, "native", head=True)
    a = CachedLM(model)
    assert a.lean is not None and a.lean.native is not None
    b = a.twin()
    gen = torch.Generator().manual_seed(3)
    ids_a, ids_b = (torch.randint(3, vocab, (300,), generator=gen).tolist() for _ in range(2))

    def alone(ids: list[int]) -> torch.Tensor:
        lm = a.twin()
        lm.reset(ids[:1], rollback=False)
        lm.cache.reserve(len(ids))
        rows = [lm.forward()]
        for tok in ids[1:]:
            lm.ids.append(tok)
            rows.append(lm.forward())
        return torch.cat(rows)

    expected_a, expected_b = alone(ids_a), alone(ids_b)
    a.reset(ids_a[:1], rollback=False)
    b.reset(ids_b[:1], rollback=False)
    rows_a, rows_b = [a.forward()], [b.forward()]
    start = a.cache.capacity
    for tok_a, tok_b in zip(ids_a[1:], ids_b[1:], strict=True):
        a.ids.append(tok_a)
        rows_a.append(a.forward())
        b.ids.append(tok_b)
        rows_b.append(b.forward())
    assert start < 300 <= a.cache.capacity  # grew mid-decode
    assert torch.equal(torch.cat(rows_a), expected_a)
    assert torch.equal(torch.cat(rows_b), expected_b)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_prompts_on_the_native_layers_match_the_decode_steps(tokenizers, family):
    """``LeanBody.native_prompts``: a 70-token prompt runs on ``layer.c`` in pieces (here of 24
    rows) and every row's hidden state and cached key is bitwise what feeding the tokens one per
    forward gives, so a prompt and the steps after it come from one computation (and a prefix's
    states can be kept for the next request); the torch path rounds differently."""
    vocab = len(tokenizers[0])
    model = tiny_gemma(vocab, sliding_window=8) if family == "gemma" else tiny_llama(vocab)
    kernels.swap_linears(model, "native", head=True)
    whole, steps, torch_path = CachedLM(model), CachedLM(model), CachedLM(model)
    if whole.lean is None or whole.lean.native is None:
        pytest.skip("no native layers here")
    for lm in (whole, steps, torch_path):
        assert lm.lean.half_kv()
    assert whole.lean.native_prompts() and not torch_path.lean.prompts_native
    whole.lean.attach_native()  # as after a move into huge pages: the modes stay
    assert whole.lean.prompts_native and whole.lean.native.kv_half
    whole.lean.PROMPT_ROWS = 24
    ids = torch.randint(3, vocab, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    whole.reset(ids, rollback=False)
    torch_path.reset(ids, rollback=False)
    steps.reset(ids[:1], rollback=False)
    rows = [steps.forward()]
    for tok in ids[1:]:
        steps.ids.append(tok)
        rows.append(steps.forward())
    got = whole.forward()
    assert got.shape[0] == 70 and torch.equal(got, torch.cat(rows))
    assert torch.equal(whole.cache.keys[0][:, :70], steps.cache.keys[0][:, :70])
    other = torch_path.forward()
    torch.testing.assert_close(other, got, rtol=1e-3, atol=1e-3)
    assert not torch.equal(other, got)


def test_eos_mid_block_ends_generation(tokenizers):
    pair = same_tokenizer_pair(tokenizers, noise=0.0)
    ref = uag.generate(pair, "The", plan=None, max_new_tokens=30)
    stop_at = ref.token_ids[7]
    first = ref.token_ids.index(stop_at)
    pair.target.eos_ids = frozenset({stop_at})
    ref_eos = uag.generate(pair, "The", plan=None, max_new_tokens=30)
    out = uag.generate(pair, "The", plan=RulePlan(StaticPolicy(k=5)), max_new_tokens=30)
    assert ref_eos.token_ids == ref.token_ids[: first + 1]
    assert out.token_ids == ref_eos.token_ids
    assert out.stop_reason == "eos"


def test_max_new_tokens_is_exact(similar):
    for n in (1, 2, 7):
        out = uag.generate(similar, "abc", plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=n)
        assert out.new_tokens == n


def test_no_bos_inside_either_context(cross):
    uag.generate(cross, "Hello world", plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=40)
    target_ids = cross.target_lm.ids
    assert target_ids[0] == 2 and 2 not in target_ids[1:]
    bos = cross.assistant.tokenizer.bos_token_id
    assert bos not in cross.assistant_lm.ids


def test_confidence_rule_boundary(similar):
    """Threshold 1.0: every token is below it, so each draft stops after exactly one token,
    which is still verified. Threshold 0.0: never stops before the cap."""
    always = uag.generate(
        similar,
        "def",
        plan=RulePlan(ConfidencePolicy(threshold=1.0, max_lookahead=5)),
        max_new_tokens=20,
    )
    assert all(r.drafted <= 1 for r in always.iterations)
    assert any(r.candidates >= 1 for r in always.iterations)
    never = uag.generate(
        similar,
        "def",
        plan=RulePlan(ConfidencePolicy(threshold=0.0, max_lookahead=5)),
        max_new_tokens=40,
    )
    assert max(r.drafted for r in never.iterations) == 5


def test_heuristic_schedule():
    from uag.decoding.policy import IterationOutcome

    h = HeuristicPolicy(start=3)
    h.update(IterationOutcome(drafted=3, accepted=3))
    assert h.k == 5
    h.update(IterationOutcome(drafted=5, accepted=1))
    assert h.k == 4
    for _ in range(10):
        h.update(IterationOutcome(drafted=1, accepted=0))
    assert h.k == 1
    h.reset()
    assert h.k == 3


def test_records_add_up(similar):
    out = uag.generate(similar, "abc", plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=25)
    assert sum(r.emitted for r in out.iterations) == out.new_tokens
    assert all(r.accepted_drafts <= r.drafted for r in out.iterations)
    assert all(r.accepted_candidates <= r.candidates for r in out.iterations)
    split = out.time_split()
    assert split["draft"] > 0 and split["verify"] > 0


def test_streaming_text_matches_result(cross):
    pieces: list[str] = []
    out = uag.generate(
        cross, "Hi 😀", plan=RulePlan(StaticPolicy(k=2)), max_new_tokens=30, on_text=pieces.append
    )
    streamed = "".join(pieces)
    # Streaming holds back partial characters: what it printed must be exactly the one-shot
    # decoding of all the emitted text (specials skipped), invalid byte runs included.
    tok, table = cross.target.tokenizer, cross.bridge.target.table
    special = set(tok.all_special_ids)  # what decode(skip_special_tokens=True) drops
    special |= {i for i, t in tok.added_tokens_decoder.items() if t.special}  # (<unusedN>)
    data = b"".join(table[i] for i in out.token_ids if i not in special)
    assert streamed == data.decode("utf-8", errors="replace")


def test_bad_api_input(cross):
    with pytest.raises(UagError, match="batch size 2"):
        uag.generate(cross, ["a", "b"], max_new_tokens=4)
    with pytest.raises(UagError, match="max_new_tokens"):
        uag.generate(cross, "a", max_new_tokens=0)
    with pytest.raises(UagError, match="empty"):
        uag.generate(cross, "", max_new_tokens=3)
    with pytest.raises(UagError, match="lookahead"):
        StaticPolicy(k=0)


@pytest.mark.skipif(native.native_unavailable() is not None, reason="native kernel unavailable")
def test_native_layers_run_a_q4_assistant(tokenizers):
    """An assistant whose weights lie on Q4_1's grid (SmolLM2's GGUF) runs its body on ``q4.c``
    inside ``layer.c`` (kind 5): the same as the lean torch path over the same linears, and each
    row's logits bitwise the same whatever the chunking. "The same" within one int8 step of an
    activation: q4.c rounds each row to int8, and where torch's norm and layer.c's differ in the
    last bit (AVX2 builds: torch's reductions run in another order), a value on a rounding
    boundary moves a step (measured on a Zen 3 without AVX-512: a few rows' logits 0.005-0.009
    apart, the rest within 3e-7)."""
    vocab = len(tokenizers[0])
    model = tiny_llama(vocab)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for lin in model.model.layers.modules():
            if isinstance(lin, torch.nn.Linear):
                lin.weight.copy_(native.q4_like_weight(*lin.weight.shape, generator=gen))
    kernels.quantize_int8(model, backend="native")
    held = [m for m in model.modules() if isinstance(m, native.NativeLinear)]
    assert sum(m.q4 for m in held) == 2 * 7  # q, k, v, o, gate, up, down per layer; head int8
    fast, torch_path = CachedLM(model), CachedLM(model)
    torch_path.lean.native = None
    assert fast.lean.native is not None
    ids = torch.randint(3, vocab, (90,), generator=gen).tolist()
    feed_both_and_compare(
        fast, torch_path, ids, prefill=12, chunks=(1, 16, 3, 9, 1, 5), reject=4, tol=3e-2
    )
    alone, chunked = one_row_vs_chunked_logits(fast, ids[:10], ids[10:60])
    assert torch.equal(alone, chunked)


@pytest.mark.parametrize("fed", [False, True])
def test_the_assistant_heals_text_that_ends_in_whitespace(cross, fed):
    """A prompt ending in a newline, then the target's indentation: SmolLM2 spells
    ``\n····`` + ``·return``, so the assistant keeps ``\n···`` and takes the last space back;
    its ids plus that space still spell the prompt and the target's text, at least one id
    waits to be fed (``fed``: the prompt was cached), and a draft among ``fitting`` ids starts
    with the space."""
    from uag.api import encode_prompt
    from uag.decoding.assistant_text import AssistantText

    a, side = cross.assistant_lm, cross.bridge.assistant
    prompt = encode_prompt(cross, "def f():\n")[1]
    a.reset(prompt, rollback=True)
    if fed:
        a.forward()
    text = AssistantText(a, cross.bridge)
    heal = text.sync(cross.bridge, b"    ", heal=True)
    assert heal == b" " and side.table[a.ids[-1]] == b"\n   "
    assert side.bytes_of(a.ids) + heal == side.bytes_of(prompt) + b"    "
    assert text.generated == b"   " and len(a.ids) > a.cached
    tok, *_ = a.draft(a.forward(), among=side.fitting(heal, below=a.draft_limit))
    assert side.table[tok].startswith(b" ")


@pytest.mark.parametrize(
    ("prompt", "healed"), [("def f():\n    x = 1", True), ("Dear Sam,", False)]
)
def test_a_newline_is_healed_after_an_indented_line_only(cross, prompt, healed):
    """After an indented line the next one likely is too (``\n`` then ``···`` is a split
    SmolLM2 never makes), so the newline is taken back; after prose it stays, since the
    assistant would mostly draft it again, a forward that spells nothing new."""
    from uag.api import encode_prompt
    from uag.decoding.assistant_text import AssistantText

    a, side = cross.assistant_lm, cross.bridge.assistant
    ids = encode_prompt(cross, prompt)[1]
    a.reset(ids, rollback=True)
    text = AssistantText(a, cross.bridge)
    heal = text.sync(cross.bridge, b"\n", heal=True)
    assert heal == (b"\n" if healed else b"")
    assert side.bytes_of(a.ids) + heal == side.bytes_of(ids) + b"\n"


def test_a_heal_no_draft_can_spell_is_not_made(cross):
    """``spells`` (sampling: ``Intersection.can_heal``) says whether the next draft can spell
    the bytes a heal takes back; where it says no, nothing is taken back."""
    from uag.api import encode_prompt
    from uag.decoding.assistant_text import AssistantText

    a, side = cross.assistant_lm, cross.bridge.assistant
    prompt = encode_prompt(cross, "def f():\n")[1]
    a.reset(prompt, rollback=True)
    text = AssistantText(a, cross.bridge)
    asked: list[bytes] = []
    heal = text.sync(cross.bridge, b"    ", heal=True, spells=lambda s: bool(asked.append(s)))
    assert heal == b"" and asked == [b" "]
    assert side.bytes_of(a.ids) == side.bytes_of(prompt) + b"    "
    assert side.table[a.ids[-1]] == b"\n    "  # as fed: the whole indentation, not healed


def test_a_shared_vocabulary_keeps_the_targets_split(similar):
    """Both sides with one tokenizer: the assistant is neither re-encoded across the boundary
    nor healed (the target's own ids are its best context)."""
    from uag.api import encode_prompt
    from uag.decoding.assistant_text import AssistantText

    a = similar.assistant_lm
    prompt = encode_prompt(similar, "def f():\n")[1]
    a.reset(prompt, rollback=True)
    text = AssistantText(a, similar.bridge)
    assert text.sync(similar.bridge, b"    ", heal=True) == b""
    assert a.ids[: len(prompt)] == prompt
