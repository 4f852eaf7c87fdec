"""The draft vocabulary: the assistant's head cut to its first ids, drafts lossless whatever it
proposes, and the size recorded wherever features are (collect, the ONNX contract)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.tiny import cross_pair, one_clean_line, q8_0_like, same_tokenizer_pair
from uag.cli import main
from uag.errors import UagError
from uag.kernels import native
from uag.runtime.draft_vocab import DEFAULT_DRAFT_VOCAB, GRANULE, PrefixLinear, draft_head

needs_native = pytest.mark.skipif(
    native.native_unavailable() is not None, reason=f"native kernel: {native.native_unavailable()}"
)


def _layer(kind: str, out: int = 208, width: int = 96) -> native.NativeLinear:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(width, out, bias=kind != "q4")
    with torch.no_grad():
        if kind == "q4":
            linear.weight.copy_(native.q4_like_weight(out, width, generator=gen))
        elif kind in ("blocked", "integer"):
            linear.weight.copy_(q8_0_like(out, width, steps=127, top=4e-4, generator=gen))
        else:
            linear.weight.copy_(torch.randn(out, width, generator=gen))
    if kind == "q4":
        layer = native.NativeLinear(linear, int8=True, dynamic=True, q4=True)
        assert layer.q4
    elif kind in ("blocked", "integer"):
        layer = native.NativeLinear(linear)
        assert layer.exact_format  # held as exact blocks
        if kind == "integer" and not layer.to_integer():
            pytest.skip("exact.c needs AVX-512 VNNI")
    else:
        layer = native.NativeLinear(
            linear, int8=kind in ("int8", "dynamic"), dynamic=kind == "dynamic", exact_blocks=False
        )
    return layer


@needs_native
@pytest.mark.parametrize("kind", ["fp32", "int8", "dynamic", "q4", "blocked", "integer"])
def test_a_prefix_of_a_native_layer_is_bitwise_its_first_outputs(kind):
    layer = _layer(kind)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(4))
    full = layer(x)
    for rows in (16, 64, 192):
        part = layer.prefix(rows)
        for n in (1, 5):
            assert torch.equal(part(x[:n]), full[:n, :rows]), (kind, rows, n)
    assert layer(x).shape == (5, 208)  # the full layer is untouched by its prefixes
    assert torch.equal(layer(x), full)


@needs_native
def test_a_prefix_shares_the_layer_memory_and_refuses_sizes_off_its_blocks():
    layer = _layer("dynamic")
    part = layer.prefix(64)
    assert part.weight_ilv.data_ptr() == layer.weight_ilv.data_ptr()
    for rows in (0, 20, 224):
        with pytest.raises(ValueError, match="multiple of 16"):
            layer.prefix(rows)


def test_draft_head_sizes():
    linear = nn.Linear(8, 1000)
    assert draft_head(linear, None, vocab=1000) == (None, 0)  # the default is not smaller
    assert draft_head(linear, 0, vocab=1000) == (None, 0)
    assert draft_head(linear, 5000, vocab=1000) == (None, 0)
    head, size = draft_head(linear, 100, vocab=1000)
    assert size == 128 and size % GRANULE == 0 and isinstance(head, PrefixLinear)
    x = torch.randn(2, 8)
    assert torch.equal(head(x), linear(x)[:, :128])
    big = nn.Linear(8, 3 * DEFAULT_DRAFT_VOCAB)
    assert draft_head(big, None, vocab=3 * DEFAULT_DRAFT_VOCAB)[1] == DEFAULT_DRAFT_VOCAB
    with pytest.raises(UagError, match="0 \\(every id\\) or a positive size"):
        draft_head(linear, -1, vocab=1000)


def test_a_head_that_cannot_be_cut_keeps_every_id_by_default_and_says_so_when_asked():
    packed = nn.Sequential(nn.Linear(8, 4 * DEFAULT_DRAFT_VOCAB))  # not a kind draft_head cuts
    assert draft_head(packed, None, vocab=4 * DEFAULT_DRAFT_VOCAB) == (None, 0)
    with pytest.raises(UagError, match="cannot be cut; use --draft-vocab 0"):
        draft_head(packed, 256, vocab=4 * DEFAULT_DRAFT_VOCAB)


def test_a_draft_reads_only_the_draft_vocabulary(tokenizers):
    """The drafted id, its probability, runner-up and entropy are those of the softmax over
    the first N logits, exactly what the full head gives those ids."""
    pair = cross_pair(tokenizers)
    lm = pair.assistant_lm.twin()
    assert pair.draft_vocab == DEFAULT_DRAFT_VOCAB == lm.draft_vocab  # SmolLM2's 49,152 ids cut
    lm.set_draft_vocab(64)
    lm.reset([1, 400, 2000, 30000, 70], rollback=False)
    hidden = lm.forward()
    tok, p1, p2, entropy = lm.draft(hidden)
    probs = torch.softmax(lm.logits(hidden[-1:])[0, :64].double(), dim=-1)
    top = torch.topk(probs, 2)
    assert tok == int(top.indices[0]) < 64
    assert (p1, p2) == pytest.approx((float(top.values[0]), float(top.values[1])), rel=1e-5)
    assert entropy == pytest.approx(float(-(probs * probs.log()).sum()), rel=1e-4)
    lm.set_draft_vocab(0)
    assert lm.draft_head is None and lm.draft(hidden)[0] == int(lm.logits(hidden[-1:])[0].argmax())


@pytest.mark.skipif(native._library()[0] is None, reason="native kernels unavailable")
def test_a_native_draft_step_gives_what_the_heads_module_gives(tokenizers):
    """A draft step on a native head writes its logits into a buffer of its own
    (``NativeLinear.into``, padded width) and reads the statistics over the real ids only:
    the same id and the same floats as the module's own forward and ``draft_stats``, at the
    full vocabulary, a cut one and after a forward of several rows."""
    pair = cross_pair(tokenizers, kernels="native")
    lm = pair.assistant_lm.twin()
    lm.reset([1, 400, 2000, 30000, 70], rollback=False)
    hidden = lm.forward()
    for vocab in (0, 64, None):
        lm.set_draft_vocab(vocab)
        head = lm.draft_head if lm.draft_head is not None else lm.head
        assert isinstance(head, native.NativeLinear)
        with torch.inference_mode():
            expected = native.draft_stats(head(hidden[-1:]).float()[0])
        assert lm.draft(hidden) == expected
    lm.truncate(2)
    lm.ids.extend([2000, 30000, 70])
    hidden = lm.forward()  # three rows: the last one drafts
    with torch.inference_mode():
        expected = native.draft_stats(head(hidden[-1:]).float()[0])
    assert hidden.shape[0] == 3 and lm.draft(hidden) == expected


@pytest.mark.skipif(native._library()[0] is None, reason="native kernels unavailable")
@pytest.mark.parametrize("dynamic", [False, True])
def test_statistics_over_a_padded_row_read_the_real_ids_only(dynamic):
    """``NativeLinear.into`` writes a padded row (1001 outputs → a multiple of the kernels'
    tile); ``draft_stats(count=...)`` must read the real outputs alone, as the module's own
    forward gives them: a zero logit in the padding would move the entropy and could win."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 1001, bias=False)
    with torch.no_grad():
        linear.weight[:, 0] = -1.0  # with x[0] = 1, every real logit is below the padding's 0
    layer = native.NativeLinear(linear, int8=dynamic, dynamic=dynamic)
    assert layer.padded_out > layer.out_features
    x = torch.randn(1, 64) * 0.01
    x[0, 0] = 1.0
    y = torch.empty(1, layer.padded_out)
    layer.into(x, y)
    expected = native.draft_stats(layer(x)[0])
    assert native.draft_stats(y, count=layer.out_features) == expected
    assert native.draft_stats(y)[0] >= layer.out_features  # the padding would have won


@pytest.fixture(scope="module")
def cut_pair(tokenizers):
    pair = cross_pair(tokenizers)
    pair.assistant_lm.set_draft_vocab(64)
    return pair


@pytest.mark.parametrize("name", sorted(NASTY_PROMPTS))
def test_lossless_whatever_the_draft_vocabulary_proposes(cut_pair, name):
    """64 ids (single bytes and the like): drafts the target rarely wants, and still exactly
    the target's own output."""
    pair = cut_pair
    prompt = NASTY_PROMPTS[name]
    ref = uag.generate(pair, prompt, plan=None, max_new_tokens=24)
    out = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=24)
    assert out.token_ids == ref.token_ids
    assert sum(r.drafted for r in out.iterations) > 0


def test_a_cut_vocabulary_costs_acceptance_not_output(tokenizers):
    """The assistant identical to the target accepts everything over every id; cut to ids the
    target does not pick, it is rejected, and the output stays the same."""
    pair = same_tokenizer_pair(tokenizers, noise=0.0)
    assert pair.draft_vocab == 0  # what the helper asks for
    ref = uag.generate(pair, "The", plan=None, max_new_tokens=30)
    full = uag.generate(pair, "The", plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=30)
    assert full.acceptance_rate == 1.0
    chosen = set(ref.token_ids)
    small = min(range(GRANULE, 4096, GRANULE), key=lambda n: sum(t < n for t in chosen))
    pair.assistant_lm.set_draft_vocab(small)
    cut = uag.generate(pair, "The", plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=30)
    assert cut.token_ids == ref.token_ids
    assert cut.acceptance_rate < full.acceptance_rate


def test_a_bad_draft_vocabulary_is_one_line(capsys):
    assert main(["generate", "--prompt", "x", "--draft-vocab", "-3"]) == 2
    assert "--draft-vocab must be 0 (every id) or a positive size" in one_clean_line(capsys)


def test_a_controller_brings_the_draft_vocabulary_it_was_trained_with(tmp_path):
    from controllers.learned import LearnedPolicy
    from tests.test_controller import _export
    from uag.cli import build_parser, settle_model_args

    parser = build_parser()
    _export(tmp_path / "all.onnx", extra={"draft_vocab": "0"})
    trained_on_all = LearnedPolicy(tmp_path / "all.onnx")
    args = parser.parse_args(["generate", "--prompt", "x"])
    note = settle_model_args(args, trained_on_all)
    assert args.draft_vocab == 0 and note is not None and "--draft-vocab 0" in note
    args = parser.parse_args(["generate", "--prompt", "x", "--draft-vocab", "512"])
    settle_model_args(args, trained_on_all)
    assert args.draft_vocab == 512  # a flag given wins
    _export(tmp_path / "older.onnx")  # exported before the size was recorded
    args = parser.parse_args(["generate", "--prompt", "x"])
    settle_model_args(args, LearnedPolicy(tmp_path / "older.onnx"))
    assert args.draft_vocab is None  # the default
    from controllers.learned_plan import LearnedPlan

    shipped = LearnedPlan("exports/ctrl.onnx")  # trained on the default size, and says so
    args = parser.parse_args(["generate", "--prompt", "x"])
    settle_model_args(args, shipped)
    assert args.draft_vocab == DEFAULT_DRAFT_VOCAB
