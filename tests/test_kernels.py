"""Fast kernels: same numbers as F.linear, row-count invariance, the fallback, and the near-tie guard."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.tiny import (
    cross_pair,
    integer_products_excess,
    one_row_vs_chunked_logits,
    q4_k_like,
    q8_0_like,
    same_tokenizer_pair,
)
from uag.decoding.verifiers import TIE_BOUND
from uag.errors import UagError
from uag.kernels import choice as kernels
from uag.kernels import native
from uag.runtime.runner import HeadOutput

needs_onednn = pytest.mark.skipif(
    not kernels.fast_kernels_available(), reason="oneDNN packed linear unavailable here"
)
needs_native = pytest.mark.skipif(
    native.native_unavailable() is not None, reason=f"native kernel: {native.native_unavailable()}"
)
FAST_MODES = [
    pytest.param("native", marks=needs_native),
    pytest.param("onednn", marks=needs_onednn),
]


@needs_onednn
@pytest.mark.parametrize("shape", [(48, 40), (1024, 640), (640, 2048), (3, 7)])
def test_packed_linear_matches_f_linear(shape):
    torch.manual_seed(0)
    linear = nn.Linear(shape[1], shape[0])
    packed = kernels.PackedLinear(linear)
    x = torch.randn(2, 5, shape[1])
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-5)
    assert packed.invariance in ("invariant", "pad-single-row")


@needs_onednn
def test_packed_single_row_padding_is_bitwise_like_a_larger_call():
    torch.manual_seed(0)
    layer = kernels.PackedLinear(nn.Linear(64, 96))
    layer.invariance = "pad-single-row"  # force the padded path: must equal row 0 of 2..16 rows
    x = torch.randn(16, 64)
    full = layer(x)
    assert torch.equal(layer(x[:1]), full[:1])


@pytest.mark.parametrize("mode", FAST_MODES)
def test_tiny_target_is_row_invariant_bitwise(tokenizers, mode):
    pair = cross_pair(tokenizers, kernels=mode)
    assert pair.kernels == mode and pair.target_lm.row_invariant
    ids = pair.target.tokenizer("def f(x):\n    return x * 2\n")["input_ids"]
    alone, chunked = one_row_vs_chunked_logits(pair.target_lm, ids[:5], ids[5:] * 3)
    assert torch.equal(alone, chunked)


def test_plain_kernels_are_claimed_invariant_only_as_checked(tokenizers):
    """Plain float32 products round a row differently with the row count here; the load-time
    check (``uag.runtime.invariance``) finds it and pads every short forward to one shape, and
    then a row's logits are the same bits however many rows share its forward."""
    pair = cross_pair(tokenizers, kernels="plain")
    lm = pair.target_lm
    assert pair.kernels == "plain" and lm.invariance is not None
    assert lm.row_invariant == lm.invariance.invariant
    if lm.row_invariant:
        ids = pair.target.tokenizer("def f(x):\n    return x * 2\n")["input_ids"]
        alone, chunked = one_row_vs_chunked_logits(lm, ids[:5], ids[5:] * 3)
        assert torch.equal(alone, chunked)
    for prompt in ("def f(x):\n    return", "Hello 😀 你好\r\n"):
        ref = uag.generate(pair, prompt, plan=None, max_new_tokens=24)
        out = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=6)), max_new_tokens=24)
        assert out.token_ids == ref.token_ids


@needs_native
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("shape", [(48, 40), (1024, 640), (640, 2048), (3, 7), (261, 67)])
def test_native_linear_matches_f_linear_and_is_row_invariant(shape, int8):
    torch.manual_seed(0)
    linear = nn.Linear(shape[1], shape[0])
    layer = native.NativeLinear(linear, int8=int8)
    x = torch.randn(2, 9, shape[1])
    out = layer(x)
    ref = torch.nn.functional.linear(x, layer.dequantized(), linear.bias)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if not int8:
        torch.testing.assert_close(out, linear(x), rtol=1e-4, atol=1e-4)
    rows = x.reshape(-1, shape[1])
    full = layer(rows)
    for start in range(rows.shape[0]):
        for count in (1, 2, 3, 5, 16):
            part = rows[start : start + count]
            assert torch.equal(layer(part), full[start : start + count])
    assert torch.equal(layer(rows[::2]), full[::2])  # a strided input is made contiguous first


@needs_native
def test_native_int8_rounds_like_symmetric_per_channel():
    torch.manual_seed(0)
    linear = nn.Linear(64, 12, bias=False)
    layer = native.NativeLinear(linear, int8=True)
    q, scales = native.symmetric_int8(linear.weight.detach())
    torch.testing.assert_close(layer.dequantized(), q.float() * scales[:, None])
    assert (layer.dequantized() - linear.weight).abs().max() <= scales.max() / 2 + 1e-7
    # the C rounding (start-up speed) gives exactly torch's: half to even, the same clamp
    w = torch.randn(40, 96) * torch.rand(40, 1) * 3
    w[3] = 0.0
    w[5, :4] = torch.tensor([0.5, -0.5, 1.5, 127.0]) * (w[5].abs().max() / 127.0)  # exact halves
    ref_scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    ref = torch.round(w / ref_scales[:, None]).clamp(-127, 127).to(torch.int8)
    q, scales = native.symmetric_int8(w)
    assert torch.equal(q, ref) and torch.equal(scales, ref_scales)


@needs_native
@pytest.mark.parametrize("int8", [False, True])
def test_fused_native_linears_equal_their_parts_bitwise(int8):
    torch.manual_seed(0)
    parts = [native.NativeLinear(nn.Linear(40, n), int8=int8) for n in (24, 8, 8)]
    x = torch.randn(5, 40)
    before = [p(x) for p in parts]
    fused = native.fuse(parts)
    assert fused is not None
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    for p, expected in zip(parts, before, strict=True):  # the parts now view the fused weight
        assert torch.equal(p(x), expected)
        assert (
            p.weight_ilv.untyped_storage().data_ptr()
            == fused.weight_ilv.untyped_storage().data_ptr()
        )
    odd = native.NativeLinear(nn.Linear(40, 6))  # 6 outputs: padded, so not fusable
    assert native.fuse([parts[0], odd]) is None
    assert native.fuse([nn.Linear(40, 8), nn.Linear(40, 8)]) is None


@needs_native
def test_parts_in_different_exact_forms_fuse_as_integers_row_invariant():
    """Qwen2's q and k are Q4_K (exact blocks of 32 once merged) and v is Q6_K (blocks of 16):
    fused, all three are held as exact integers under one form (blocks of 16 with a base), not
    widened to fp32. Every row count and path gives the same bits, the parts (views of the
    fused weight) give its slices, and the sums stay within exact.c's bound of the float64
    product (its activation grid, then a few float roundings)."""
    import copy

    q, k = _q4k_like_linear(64, 1024, seed=1), _q4k_like_linear(16, 1024, seed=2)
    v, _, _ = _integer_form("q6_k")
    parts = [native.NativeLinear(m) for m in (q, k, v)]
    if not all(p.to_integer() for p in copy.deepcopy(parts)):
        pytest.skip("exact.c's fast paths (AVX-512 VNNI) unavailable here")
    for p in parts:
        p.to_integer()
    assert {(p.x8_block, p.x8_affine) for p in parts} == {(32, True), (16, False)}
    fused = native.fuse(parts)
    assert fused is not None and fused.format is native.Format.EXACT
    assert (fused.x8_block, fused.x8_affine) == (16, True)
    x = torch.randn(17, 1024, generator=torch.Generator().manual_seed(4))
    runs = []
    try:
        for amx, vnni in ((0, 0), (0, 1), (1, 1)):
            fused.lib.uag_set_amx(amx)
            fused.lib.uag_set_avx512vnni(vnni)
            runs.append([fused(x[:m]) for m in range(1, 18)])
    finally:
        fused.lib.uag_set_amx(1)
        fused.lib.uag_set_avx512vnni(1)
    full = runs[0][-1]
    assert all(torch.equal(y, full[:m]) for outs in runs for m, y in enumerate(outs, start=1))
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), full)
    w = torch.cat([m.weight for m in (q, k, v)])
    b = torch.cat([m.bias for m in (q, k, v)])
    assert integer_products_excess(full, x, w, b, block=16) <= 3


def _gguf_like_linear(out: int, width: int, *, steps: int, seed: int = 0) -> nn.Linear:
    """A linear whose weight is as GGUF's Q8_0 (``steps`` 127) or Q5_0 (16) de-quantises."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(width, out)
    with torch.no_grad():
        linear.weight.copy_(q8_0_like(out, width, steps=steps, top=0.01, generator=gen))
    return linear


@needs_native
@pytest.mark.parametrize("steps", [127, 16])
@pytest.mark.parametrize("shape", [(48, 64), (261, 640), (3, 32)])
def test_block_int8_is_bitwise_the_fp32_kernel(shape, steps):
    """Weights that are exactly fp16 scale × small integer are held as int8 + scales and give
    bitwise the fp32 kernel's rows at every row count, from ~28 % of the bytes."""
    linear = _gguf_like_linear(*shape, steps=steps)
    blocked = native.NativeLinear(linear)
    plain = native.NativeLinear(linear, exact_blocks=False)
    assert blocked.blocked and not plain.blocked
    assert torch.equal(blocked.dequantized(), linear.weight)
    rows = torch.randn(16, shape[1])
    full = blocked(rows)
    assert torch.equal(full, plain(rows))
    for count in range(1, 10):
        for start in (0, 3):
            assert torch.equal(blocked(rows[start : start + count]), full[start : start + count])


@needs_native
@pytest.mark.parametrize("levels", [16, 64])
@pytest.mark.parametrize("shape", [(48, 64), (261, 1024), (3, 16)])
def test_block_affine_is_bitwise_the_fp32_kernel(shape, levels):
    """Weights as GGUF's Q4_K (16 levels) or Q6_K (64) de-quantise, exact scale · q − base per
    block, are held as uint8 + block parameters and give bitwise the fp32 kernel's rows at every
    row count, from 1.5 of fp32's 4 bytes per weight."""
    gen = torch.Generator().manual_seed(levels)
    linear = nn.Linear(shape[1], shape[0])
    with torch.no_grad():
        linear.weight.copy_(native.affine_like_weight(*shape, levels=levels, generator=gen))
    exact = native.NativeLinear(linear)
    plain = native.NativeLinear(linear, exact_blocks=False)
    assert exact.exact_format == "block_affine" and not plain.blocked
    assert exact.weight_ilv.dtype == torch.uint8
    assert torch.equal(exact.dequantized(), linear.weight)
    rows = torch.randn(16, shape[1])
    full = exact(rows)
    assert torch.equal(full, plain(rows))
    for count in range(1, 10):
        for start in (0, 3):
            assert torch.equal(exact(rows[start : start + count]), full[start : start + count])


@needs_native
def test_block_affine_refuses_a_weight_it_cannot_reproduce():
    gen = torch.Generator().manual_seed(0)
    weight = native.affine_like_weight(16, 64, levels=16, generator=gen)
    assert native.block_affine(weight) is not None
    weight[5, 40] = torch.nextafter(weight[5, 40], torch.tensor(1.0))  # one ulp off its grid
    assert native.block_affine(weight) is None
    assert native.block_affine(torch.randn(8, 64)) is None  # random fp32: no such form
    assert native.block_affine(torch.randn(8, 40)) is None  # 40 inputs: not whole blocks
    flat = native.block_affine(torch.full((8, 32), -0.25))  # one value per block: scale 0
    assert (
        flat is not None
        and not flat[0].any()
        and torch.equal(flat[1][..., 1], torch.full((8, 2), -0.25))
    )


@needs_native
def test_block_int8_refuses_a_weight_it_cannot_reproduce():
    linear = _gguf_like_linear(16, 64, steps=127)
    with torch.no_grad():  # one weight one ulp off its block's grid: no exact int8 form
        linear.weight[5, 40] = torch.nextafter(linear.weight[5, 40], torch.tensor(1.0))
    assert native.block_int8(linear.weight.detach()) is None
    assert not native.NativeLinear(linear).blocked
    assert native.block_int8(torch.randn(8, 48)) is None  # 48 inputs: not whole blocks
    zeros = native.block_int8(torch.zeros(8, 64))  # all-zero blocks: scale 0
    assert zeros is not None and not zeros[0].any() and not zeros[1].any()


@needs_native
def test_fusing_block_int8_with_fp32_parts_keeps_every_bit():
    x = torch.randn(5, 64)
    parts = [
        native.NativeLinear(_gguf_like_linear(24, 64, steps=16)),
        native.NativeLinear(nn.Linear(64, 8)),  # random fp32: stays fp32
    ]
    assert [p.blocked for p in parts] == [True, False]
    before = [p(x) for p in parts]
    fused = native.fuse(parts)
    assert fused is not None and not fused.blocked
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    both = native.fuse([native.NativeLinear(_gguf_like_linear(n, 64, steps=127)) for n in (8, 16)])
    assert both is not None and both.exact_format == "block_int8"
    gen = torch.Generator().manual_seed(1)
    affine = nn.Linear(64, 16)
    with torch.no_grad():
        affine.weight.copy_(native.affine_like_weight(16, 64, levels=64, generator=gen))
    mixed = [native.NativeLinear(_gguf_like_linear(24, 64, steps=16)), native.NativeLinear(affine)]
    assert [p.exact_format for p in mixed] == ["block_int8", "block_affine"]
    before = [p(x) for p in mixed]
    fused = native.fuse(mixed)  # two exact storages: one product needs one, so fp32
    assert fused is not None and not fused.blocked
    assert torch.equal(fused(x), torch.cat(before, dim=-1))


def _near_tie_head(seed: int = 0) -> tuple[nn.Linear, torch.Tensor, int, int]:
    """A head where rows ``a`` and ``b`` are near-identical winners for input row 0: ``b`` wins
    in fp32, the int8 logits rank ``a`` strictly higher, and ``a``'s exact logit beats ``b``'s
    int8 one, so screening without its error bound emits ``a`` (found by a seeded search over
    perturbations of ``b`` about one int8 step wide)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, generator=gen)
    base = torch.randn(500, 64, generator=gen) * 0.05
    a, b = 7, 300
    base[a] = x[0] / x[0].norm() * 3.0
    for _ in range(1000):
        weight = base.clone()
        weight[b] = base[a] + torch.randn(64, generator=gen) * 3e-3
        head = nn.Linear(64, 500, bias=False)
        with torch.no_grad():
            head.weight.copy_(weight)
        exact = native.NativeLinear(head)(x[:1])[0]
        int8 = native.NativeLinear(head, int8=True)(x[:1])[0]
        if exact[b] > exact[a] > int8[b] and int8[a] > int8[b]:
            return head, x, a, b
    raise AssertionError("no near-tie found")


@needs_native
def test_screened_head_argmax_is_exact_at_a_near_tie_int8_gets_wrong():
    from uag.kernels.screened import ScreenedHead

    head, x, a, b = _near_tie_head()
    exact = native.NativeLinear(head)(x)
    assert int(exact[0].argmax()) == b
    int8_only = native.NativeLinear(head, int8=True)(x)
    assert int(int8_only[0].argmax()) == a  # screening alone would emit the wrong token
    screened = ScreenedHead(head)
    logits = screened(x)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert screened.greedy(x)[0] == exact.argmax(-1).tolist()  # the argmax from the candidates
    assert logits[0, b] == exact[0, b] and logits[0, a] == exact[0, a]  # both computed exactly
    for row in range(3):  # each row alone: the same values (row-count invariant)
        assert torch.equal(screened(x[row : row + 1])[0], logits[row])
    screened.row_bound = torch.zeros_like(screened.row_bound)  # no error bound: wrong token
    screened.row_l1 = torch.zeros_like(screened.row_l1)
    screened.row_l1_out = torch.zeros_like(screened.row_l1_out)
    screened.ABSOLUTE_SLACK = 0.0
    assert int(screened(x)[0].argmax()) == a
    assert screened.greedy(x)[0][0] == a


@needs_native
def test_screened_head_matches_fp32_on_random_heads():
    from uag.kernels.screened import ScreenedHead

    torch.manual_seed(0)
    for trial in range(20):
        head = nn.Linear(96, 2000, bias=trial % 2 == 0)
        x = torch.randn(5, 96) * (1 + trial)
        exact = native.NativeLinear(head)(x)
        ids, logits = ScreenedHead(head).greedy(x)
        top = exact.argmax(-1)
        assert ids == top.tolist()
        assert torch.equal(logits.argmax(-1), top)
        assert torch.equal(logits[torch.arange(5), top], exact[torch.arange(5), top])


@needs_native
@pytest.mark.parametrize("outliers", [0, 4])
def test_screened_head_bound_holds_with_and_without_exact_channels(outliers):
    """Every approximate logit lies within its bound of the fp32 one, on inputs with a few huge
    channels (like Gemma 3's); and the bound's activation term is needed (without it, fails)."""
    from uag.kernels.screened import ScreenedHead

    torch.manual_seed(1)
    head = nn.Linear(96, 3000, bias=True)
    x = torch.randn(7, 96)
    x[:, [5, 17, 60, 61]] *= 25.0  # outlier channels
    screened = ScreenedHead(head)
    if outliers:
        screened.calibrate(x)
        assert set(screened.outliers.tolist()) >= {5, 17, 60, 61}
    exact = native.NativeLinear(head)(x)
    approx, missed = screened.approximate(x)
    norms = x.abs().sum(dim=-1)
    gap = (approx - exact).abs()
    assert (gap <= screened.bounds(norms, missed)).all()
    # each activation term is needed: without it the bound fails somewhere
    assert (gap > (screened.row_bound * norms[:, None] + screened.ABSOLUTE_SLACK)).any()
    if outliers:
        no_outlier_term = missed.clone()
        no_outlier_term[:, 1] = 0.0
        assert (gap > screened.bounds(norms, no_outlier_term)).any()
    ids, _ = screened.greedy(x)
    assert ids == exact.argmax(-1).tolist()
    if outliers:  # exact channels leave fewer candidates than 7 bits across the outliers
        plain = ScreenedHead(head)
        plain.greedy(x)
        assert screened.last_candidates <= plain.last_candidates
    before = screened.last_candidates
    approx2, missed2 = screened.approximate(x, levels=2)  # the second level: a far tighter bound
    assert ((approx2 - exact).abs() <= screened.bounds(norms, missed2)).all()
    assert (missed2[:, 0] < missed[:, 0] / 50).all()
    screened.RESCREEN = 0  # every row screened again with two levels: same ids, fewer candidates
    assert screened.greedy(x)[0] == ids
    assert screened.last_candidates <= before


def test_native_refused_with_its_reason(monkeypatch):
    monkeypatch.setenv("UAG_KERNELS", "onednn")
    native._library.cache_clear()
    try:
        assert native.native_unavailable() == "UAG_KERNELS=onednn"
        with pytest.raises(UagError, match="--kernels native is unavailable: UAG_KERNELS=onednn"):
            kernels.resolve_kernels("native", torch.device("cpu"), torch.float32)
        expected = "onednn" if kernels.fast_kernels_available() else "plain"
        assert kernels.resolve_kernels("auto", torch.device("cpu"), torch.float32) == expected
    finally:
        monkeypatch.delenv("UAG_KERNELS")
        native._library.cache_clear()
    with pytest.raises(UagError, match="runs on float32 CPUs"):
        kernels.resolve_kernels("native", torch.device("cpu"), torch.bfloat16)


def test_onednn_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv("UAG_KERNELS", "plain")
    kernels.fast_kernels_available.cache_clear()
    native._library.cache_clear()
    try:
        assert kernels.resolve_kernels("auto", torch.device("cpu"), torch.float32) == "plain"
        with pytest.raises(UagError, match="--kernels onednn needs"):
            kernels.resolve_kernels("onednn", torch.device("cpu"), torch.float32)
    finally:
        monkeypatch.delenv("UAG_KERNELS")
        kernels.fast_kernels_available.cache_clear()
        native._library.cache_clear()
    with pytest.raises(UagError, match="unknown kernels"):
        kernels.resolve_kernels("fast", torch.device("cpu"), torch.float32)
    assert kernels.resolve_kernels("auto", torch.device("cpu"), torch.bfloat16) == "plain"


@pytest.mark.parametrize("backend", ["native", "fbgemm", "int8pack"])
def test_int8_assistant_close_and_silent(backend):
    if backend == "fbgemm" and kernels.int8_backend() != "fbgemm":
        pytest.skip("fbgemm's quantised ops are not in this torch build")
    if backend == "native" and native.native_unavailable() is not None:
        pytest.skip(f"native kernel: {native.native_unavailable()}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(3, 64)
    ref = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecation warning here fails the test
        quantised = kernels.quantize_int8(model, backend=backend)
        out = quantised(x)
    assert not any(type(m) is nn.Linear for m in quantised.modules())
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


class _RowCountDependentHead:
    """A greedy head that rounds differently with the row count, as some kernels do.

    Token ``loser`` is made to tie token ``winner`` within 1e-3 (under ``TIE_BOUND``): alone, a
    row picks ``winner``; among several rows it picks ``loser``. Without the guard, verification
    would emit ``loser`` where target-alone emits ``winner``.
    """

    def __init__(self, inner, *, winner: int, loser: int) -> None:
        self.inner, self.winner, self.loser = inner, winner, loser

    def __call__(self, hidden: torch.Tensor) -> HeadOutput:
        logits = self.inner(hidden).logits.clone()
        nudge = 1e-3 if hidden.shape[0] > 1 else -1e-3
        logits[:, self.loser] = logits[:, self.winner] + nudge
        return HeadOutput(logits.argmax(dim=-1).tolist(), logits)


def test_guard_recomputes_forced_near_ties(tokenizers):
    assert TIE_BOUND > 1e-3
    pair = same_tokenizer_pair(tokenizers, noise=0.02, kernels="plain")
    prompt = "def f(x):\n    return"
    plain = uag.generate(pair, prompt, plan=None, max_new_tokens=40)
    later = plain.token_ids[1:]  # the first token comes from the prefill, multi-row in both modes
    winner = max(set(later), key=later.count)  # an often-chosen token
    loser = (winner + 1) % pair.target_lm.vocab_size
    lm = pair.target_lm
    lm.set_pad_rows(0)  # a path that failed the load-time check (uag.runtime.invariance)
    lm.row_invariant = False
    lm._greedy = _RowCountDependentHead(lm._greedy, winner=winner, loser=loser)
    ref = uag.generate(pair, prompt, plan=None, max_new_tokens=40)
    assert winner in ref.token_ids[1:]

    guarded = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=40)
    assert guarded.token_ids == ref.token_ids
    assert sum(r.recomputed for r in guarded.iterations) > 0

    lm.row_invariant = True  # claim invariance falsely: the guard is off, and the output breaks
    unguarded = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=40)
    assert unguarded.token_ids != ref.token_ids


@needs_native
@pytest.mark.parametrize("shape", [(48, 64), (264, 576), (8, 32)])
def test_q4_holds_q4_1_weights_exactly_and_stays_close(shape):
    """A Q4_1-like weight (SmolLM2's GGUF) is held as 4-bit blocks that reproduce every weight;
    the product with int8 activations per block of 32 is close to F.linear and row invariant."""
    out, width = shape
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    linear = nn.Linear(width, out)
    with torch.no_grad():
        linear.weight.copy_(native.q4_like_weight(out, width, generator=gen))
    layer = native.NativeLinear(linear, int8=True, dynamic=True, q4=True)
    assert layer.q4 and "4-bit" in repr(layer)
    torch.testing.assert_close(layer.dequantized(), linear.weight.detach(), rtol=0, atol=1e-6)
    x = torch.randn(11, width, generator=gen)
    full = layer(x)
    ref = linear(x)
    assert (full - ref).norm() < 0.01 * ref.norm()  # 8-bit activations per block of 32
    rows = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(rows, full)
    assert torch.equal(layer(x[3:9]), full[3:9])


@needs_native
@pytest.mark.parametrize(("q4", "width"), [(True, 128), (False, 128), (False, 132)])
def test_avx2_vnni_and_avx512_paths_give_the_same_bits(q4, width):
    """q4.c and q8.c sum exactly in int32 on every instruction set (AVX2, AVX-VNNI, AVX-512
    VNNI and AMX for several rows): the same floats out, for every row count and for the screened head's
    two-level product with its bound, so nothing downstream depends on the CPU. Rows 1-17 cross
    every switch between AVX-512 forms (q4: tiles alone up to 2 rows, then pairs; q8: vectors
    alone up to 9 product rows, then pairs with an odd last vector alone); width 132 gives q8 an
    odd number of quads (the lone vector's last quad)."""
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    linear = nn.Linear(width, 40)  # K = 128, a multiple of 64: AMX takes 6+ rows
    if q4:
        with torch.no_grad():
            linear.weight.copy_(native.q4_like_weight(40, width, generator=gen))
    layer = native.NativeLinear(linear, int8=True, dynamic=True, q4=q4)
    assert layer.q4 == q4
    x = torch.randn(17, layer.padded_in, generator=gen)
    lib = layer.lib

    def outputs() -> list[torch.Tensor]:
        outs = [layer(x[:m]) for m in range(1, 18)]
        if not q4:  # the screening product: two levels, outlier rows and the bounds
            y, bound, bound_o = torch.empty(17, layer.padded_out), torch.empty(17), torch.empty(17)
            rest, outliers = x.clone(), torch.zeros_like(x)
            outliers[:, [122, 125]], rest[:, [122, 125]] = 30 * x[:, [122, 125]], 0.0
            quads = range(30, 32)  # channels 120-127: the run the outlier tile takes
            wsum = layer.weight_ilv[:, 30:32].sum(dim=(1, 3), dtype=torch.int32).reshape(-1)
            layer.product_q8(
                rest,
                y,
                levels=2,
                bound=bound,
                outliers=(outliers, quads, wsum),
                bound_outliers=bound_o,
            )
            outs += [y, bound, bound_o]
        return outs

    try:
        lib.uag_set_vnni(0)
        lib.uag_set_avx512vnni(0)
        lib.uag_set_amx(0)
        reference = outputs()
        vnni = lib.uag_set_vnni(1)
        for got, want in zip(outputs(), reference, strict=True):
            assert torch.equal(got, want)
        wide = lib.uag_set_avx512vnni(1)
        for got, want in zip(outputs(), reference, strict=True):
            assert torch.equal(got, want)
        amx = lib.uag_set_amx(1)
        for got, want in zip(outputs(), reference, strict=True):
            assert torch.equal(got, want)
    finally:
        lib.uag_set_vnni(1)
        lib.uag_set_avx512vnni(1)
        lib.uag_set_amx(1)
    if not (vnni and wide and amx):
        pytest.skip(
            "AVX-VNNI, AVX-512 VNNI or AMX unavailable here (CPU, kernel or compiler): "
            "not every path ran"
        )


@needs_native
def test_q4_refuses_weights_off_the_grid_and_falls_back_to_int8():
    torch.manual_seed(0)
    layer = native.NativeLinear(nn.Linear(64, 16), int8=True, dynamic=True, q4=True)
    assert not layer.q4 and "int8 dynamic" in repr(layer)
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 16)
    with torch.no_grad():
        linear.weight.copy_(native.q4_like_weight(16, 64, generator=gen))
        linear.weight[5, 40] += 1e-3  # one weight between two levels of its block
    assert not native.NativeLinear(linear, int8=True, dynamic=True, q4=True).q4
    with torch.no_grad():  # on a grid, but its steps and minima are no half floats
        linear.weight.copy_(native.q4_like_weight(16, 64, generator=gen) * (1 + 2**-9))
    assert not native.NativeLinear(linear, int8=True, dynamic=True, q4=True).q4


@needs_native
def test_fused_q4_linears_equal_their_parts_bitwise():
    gen = torch.Generator().manual_seed(4)
    parts = []
    for n in (24, 8, 16):
        linear = nn.Linear(64, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(native.q4_like_weight(n, 64, generator=gen))
        parts.append(native.NativeLinear(linear, int8=True, dynamic=True, q4=True))
    x = torch.randn(5, 64, generator=gen)
    before = [p(x) for p in parts]
    fused = native.fuse(parts)
    assert fused is not None and fused.q4
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    for p, expected in zip(parts, before, strict=True):
        assert torch.equal(p(x), expected)


@needs_native
@pytest.mark.parametrize("form", ["fp32", "int8", "block_int8", "block_affine"])
def test_avx512_and_avx2_paths_give_the_same_bits(form):
    """skinny.c's AVX-512 path keeps every output's chain of multiply-adds: the same bits as the
    AVX2 path for every row count (136 outputs: one row's 16-vector tile and a narrower rest,
    several rows' 4-vector tiles and a rest), so verification stays lossless on either."""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    if form == "block_int8":
        linear = _gguf_like_linear(136, 128, steps=16, seed=6)
    else:
        linear = nn.Linear(128, 136)
        if form == "block_affine":
            with torch.no_grad():
                linear.weight.copy_(native.affine_like_weight(136, 128, levels=16, generator=gen))
    layer = native.NativeLinear(linear, int8=form == "int8")
    assert layer.exact_format == (form if form.startswith("block") else "")
    x = torch.randn(16, 128, generator=gen)
    lib = layer.lib
    try:
        lib.uag_set_avx512(0)
        plain = [layer(x[:m]) for m in range(1, 17)]
        wide = lib.uag_set_avx512(1)
        for m in range(1, 17):
            assert torch.equal(layer(x[:m]), plain[m - 1]), m
    finally:
        lib.uag_set_avx512(1)
    if not wide:
        pytest.skip("this CPU has no AVX-512: only the AVX2 path ran")


@needs_native
@pytest.mark.parametrize("case", ["random", "spike", "tied", "short", "wide"])
def test_draft_stats_match_torch(case):
    """The C pass a draft step reads (argmax, top-2 probabilities, entropy) against torch in
    float64; the lowest id wins a tie, as argmax's."""
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    size = {"short": 13, "wide": 262_147}.get(case, 49_152)
    logits = torch.randn(size, generator=g) * 4
    if case == "spike":
        logits[777] += 60.0  # p1 ~ 1, p2 ~ e^-50: the entropy lives in the far tail
    if case == "tied":
        logits[:] = 0.25
        logits[[5, 9]] = 3.0
    tok, p1, p2, entropy = native.draft_stats(logits)
    probs = torch.softmax(logits.double(), dim=-1)
    top = torch.topk(probs, 2).values.tolist()
    expect = float(-(probs * torch.log(probs.clamp_min(1e-300))).sum())
    assert tok == int(probs.argmax()) == (5 if case == "tied" else tok)
    assert p1 == pytest.approx(top[0], rel=1e-6)
    assert p2 == pytest.approx(top[1], rel=1e-5, abs=1e-30)
    assert entropy == pytest.approx(expect, rel=1e-5, abs=1e-9)


def test_draft_stats_fall_back_to_torch_without_the_kernels(monkeypatch):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(native, "_library", lambda: (None, "test"))
    tok, p1, p2, entropy = native.draft_stats(logits)
    probs = torch.softmax(logits, dim=-1)
    assert tok == int(probs.argmax()) and p1 == pytest.approx(float(probs.max()))
    assert entropy == pytest.approx(float(-(probs * probs.log()).sum()), rel=1e-5)


@needs_native
@pytest.mark.parametrize("form", ["block_int8", "block_affine", "fp32"])
@pytest.mark.parametrize("scale", [1.0, 25.298221])
def test_gathered_rows_in_c_are_torchs_bits(form, scale):
    """An embedding lookup / the screened head's candidate rows: the C gather gives bitwise what
    the torch formula does (and, unscaled, the weight itself)."""
    gen = torch.Generator().manual_seed(11)
    if form == "block_int8":
        linear = _gguf_like_linear(261, 640, steps=127)
    else:
        linear = nn.Linear(64, 261)
        with torch.no_grad():
            linear.weight.copy_(
                native.affine_like_weight(261, 64, levels=16, generator=gen)
                if form == "block_affine"
                else torch.randn(261, 64, generator=gen)
            )
    layer = native.NativeLinear(linear)
    assert layer.exact_format == ("" if form == "fp32" else form)
    ids = torch.tensor([0, 260, 7, 8, 7, 133])
    fast = layer.rows(ids, scale=scale)
    layer.lib = None  # the torch formula
    slow = layer.rows(ids, scale=scale)
    assert torch.equal(fast, slow)
    assert torch.equal(fast, linear.weight[ids] * torch.tensor(scale))


@needs_native
def test_lean_rope_rows_depend_on_the_position_only(tokenizers):
    """The rotary rows come from one table, grown in blocks: a position's rows are the same
    bits whichever forward asks, before and after the table grows, and equal the direct
    computation's values."""
    pair = cross_pair(tokenizers, kernels="native")
    rope = pair.target_lm.lean.rope
    rope._table = None
    first = rope(torch.arange(60, 70), torch.float32)  # grows across a block boundary
    later = rope(torch.arange(0, 200), torch.float32)  # grows again, doubling
    for kind, (cos, sin) in first.items():
        assert torch.equal(later[kind][0][60:70], cos) and torch.equal(later[kind][1][60:70], sin)
        direct = rope._compute(torch.arange(60, 70))[kind]
        assert torch.allclose(cos, direct[0], atol=1e-6) and torch.allclose(
            sin, direct[1], atol=1e-6
        )
        one = rope(torch.arange(65, 66), torch.float32)[kind]
        assert torch.equal(one[0], cos[5:6]) and one[0].is_contiguous()


@needs_native
def test_lean_final_norm_in_c_is_rowwise_and_close_to_torch(tokenizers):
    pair = cross_pair(tokenizers, kernels="native")
    lean = pair.assistant_lm.lean
    x = torch.randn(5, lean.final_norm.shape[0]) * 3
    y = lean.native.norm(x, lean.final_norm)
    assert torch.allclose(y, lean.final_norm(x), rtol=1e-5, atol=1e-6)
    for i in range(5):
        assert torch.equal(
            lean.native.norm(x[i : i + 1].contiguous(), lean.final_norm), y[i : i + 1]
        )


@needs_native
@pytest.mark.parametrize("form", ["block_int8", "block_affine"])
def test_screened_heads_exact_step_in_c_is_the_torch_paths(form, monkeypatch):
    """Heads held in exact blocks (Gemma's is block int8) take the C exact step: the same ids
    and logits as the torch path, the full product's values at the winners, and an exact tie
    between two identical rows goes to the lower id."""
    from uag.kernels.screened import ScreenedHead

    gen = torch.Generator().manual_seed(5)
    if form == "block_int8":
        head = _gguf_like_linear(2000, 128, steps=127, seed=5)
    else:
        head = nn.Linear(128, 2000)
        with torch.no_grad():
            head.weight.copy_(native.affine_like_weight(2000, 128, levels=16, generator=gen))
    with torch.no_grad():
        head.weight[5] *= 8  # exact (a power of two): row 5 now wins for x = its own direction
        head.weight[1500] = head.weight[5]  # a tie whenever row 5 wins
        if head.bias is not None:
            head.bias[1500] = head.bias[5]
    x = torch.randn(6, 128, generator=gen) * 3
    x[2] = head.weight[5] * 40  # row 2: ids 5 and 1500 tie at the top
    screened = ScreenedHead(head)
    assert screened.exact is not None and screened.exact.exact_format == form
    ids, logits = screened.greedy(x)
    full = native.NativeLinear(head)(x)
    assert ids == full.argmax(-1).tolist() and ids[2] == 5
    assert full[2, 5] == full[2, 1500]
    rows = torch.arange(6)
    assert torch.equal(logits[rows, ids], full[rows, ids])
    monkeypatch.setattr(ScreenedHead, "_c_head", lambda self: None)  # step by step
    stepwise = screened.greedy(x)
    monkeypatch.setattr(ScreenedHead, "_exact_in_c", lambda *args: None)  # exact step in torch
    again, torch_logits = screened.greedy(x)
    assert again == ids and torch.equal(torch_logits, logits)
    assert stepwise[0] == ids and torch.equal(stepwise[1], logits)


@needs_native
def test_screened_head_in_one_c_call_is_the_step_by_step_path(monkeypatch):
    """``uag_screened_greedy`` (norms, channel order, outlier channels, the int8 product, the
    screen, the exact step and the argmax in one C call) gives the step-by-step path's ids,
    logits and candidate count bitwise: with and without outlier channels, each row alone as
    in a batch, rows that need a second activation level (handed back to Python), and after
    the tensors it points into are replaced (``set_outliers``) or moved (huge pages)."""
    from uag.kernels import hugepages
    from uag.kernels.screened import ScreenedHead

    head = _gguf_like_linear(3000, 128, steps=127, seed=7)
    head.bias = None  # Gemma's has none, and a bias would keep the flat row below from flat
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 128, generator=gen)
    x[:, [3, 40, 77]] *= 20.0  # outlier channels, as Gemma's
    x[4] *= 1e-5  # a flat row: logits far under the bound's slack, every id a candidate
    fp32 = native.NativeLinear(head, exact_blocks=False)(x).argmax(-1).tolist()
    screened = ScreenedHead(head)
    handed_back = []
    decide = ScreenedHead._decide
    monkeypatch.setattr(
        ScreenedHead, "_decide", lambda self, *a: handed_back.append(1) or decide(self, *a)
    )

    def both(rows: torch.Tensor) -> tuple[list[int], bool]:
        handed_back.clear()
        ids, logits = screened.greedy(rows)
        count, in_c = screened.last_candidates, not handed_back
        with monkeypatch.context() as step_by_step:
            step_by_step.setattr(ScreenedHead, "_c_head", lambda self: None)
            again, torch_logits = screened.greedy(rows)
        assert again == ids and torch.equal(torch_logits, logits)
        assert screened.last_candidates == count
        return ids, in_c

    assert screened._c_head() is not None
    for setup in ("plain", "outliers", "rescreen", "moved"):
        if setup == "outliers":
            screened.calibrate(x)  # new order and outlier tensors: the C struct is rebuilt
            assert set(screened.outliers.tolist()) >= {3, 40, 77}
        if setup == "rescreen":
            screened.RESCREEN = 64  # the flat row: more than 64 candidates
        if setup == "moved":
            screened.RESCREEN = ScreenedHead.RESCREEN
            before = screened._c_head()
            hugepages.move(screened.streamed())
            assert screened._c_head() is not before or not hugepages.available()
        ids, in_c = both(x)
        assert ids == fp32
        assert in_c == (setup != "rescreen")  # a wide row hands the call back to Python
        for row in range(len(x)):  # each row alone: the same id (row-count invariant)
            assert both(x[row : row + 1])[0] == [fp32[row]]


@pytest.mark.parametrize("form", ["block_int8", "fp32"])
def test_full_head_sampling_reads_includes_the_bias(form):
    """The full head sampling reads (``ScreenedHead.full_head``) is the head's logits, bias
    included, whichever form holds the weight (the exact blocks, their ``exact.c`` copy, an
    fp32 copy): those forms hold the weight alone, and a head with a bias was sampled without
    it."""
    from uag.kernels.screened import ScreenedHead

    if form == "block_int8":
        head = _gguf_like_linear(512, 64, steps=127, seed=3)
    else:
        head = nn.Linear(64, 512)
    with torch.no_grad():
        head.bias.mul_(50)  # large enough to move the distribution
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    screened = ScreenedHead(head)
    assert (screened.exact is not None) == (form == "block_int8")
    full = screened.full_head()(x).double()
    if form == "block_int8":  # exact.c's grid where the CPU has AVX-512 VNNI
        assert integer_products_excess(full, x, head.weight, head.bias, block=32) <= 8
        return
    w = head.weight.double()
    reference = x.double() @ w.T + head.bias.double()
    scale = x.double().abs() @ w.abs().T + head.bias.double().abs()
    assert ((full - reference).abs() <= 8 * 2.0**-24 * scale + 1e-6).all()


def _q4k_like_linear(out: int, width: int, *, seed: int = 0) -> nn.Linear:
    """A weight as GGUF's Q4_K de-quantises; one block's second half holds only even steps, so
    its 16-wide blocks read twice the scale of their neighbour (``to_integer`` must still join
    them)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, width), generator=gen).float()
    q[0, 16:32] = torch.randint(0, 8, (16,), generator=gen).float() * 2
    q[0, 16], q[0, 17] = 0.0, 14.0
    linear = nn.Linear(width, out)
    with torch.no_grad():
        linear.weight.copy_(q4_k_like(q, generator=gen))
    return linear


def _integer_form(form: str) -> tuple[nn.Linear, int, bool]:
    """(linear, the block width and affinity ``to_integer`` should choose) for one GGUF form."""
    gen = torch.Generator().manual_seed(5)
    if form in ("q8_0", "q5_0"):
        return _gguf_like_linear(48, 640, steps=127 if form == "q8_0" else 16), 32, False
    if form == "q4_k":
        return _q4k_like_linear(48, 1024), 32, True
    linear = nn.Linear(1024, 48)
    with torch.no_grad():
        levels = 64 if form == "q6_k" else 16
        linear.weight.copy_(native.affine_like_weight(48, 1024, levels=levels, generator=gen))
    return linear, 16, form == "k16"


@needs_native
def test_integer_products_round_activations_to_each_blocks_own_grid():
    """``exact.c`` holds an activation as 15-bit integers on its block's own power-of-two grid
    (step 2^(e - 14), e the exponent of the block's largest |x|, at least the row's largest
    less 64): through a weight of 0.5 on the diagonal every output is exactly half its input
    on that grid, on every path. Why each block: one outlier channel must not coarsen the
    rest of its row (a grid per row fails this test), nor a far smaller block vanish."""
    linear = nn.Linear(96, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(0.5 * torch.eye(96))
    layer = native.NativeLinear(linear)
    if not layer.to_integer(anywhere=True):
        pytest.skip("exact.c's layout does not hold this weight here")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=gen)
    x[0, 3] = 900.0  # an outlier in block 0 only
    x[1, 40:64] *= 1e-30  # a block ~2^100 under its row's largest: held to 2^-64 of it
    x[2, 70] = 2.0**-3 * (1 + 2.0**-20)  # a value the grid rounds
    x[3] = 0.0
    x64 = x.double()
    top = x64.abs().reshape(5, 3, 32).amax(-1)
    e = torch.frexp(top)[1].double()  # top < 2^e
    e = torch.maximum(e, e.amax(-1, keepdim=True) - 64).repeat_interleave(32, dim=-1)
    step = torch.pow(2.0, e - 14)
    expected = 0.5 * torch.round(x64 / step) * step  # round half to even, as the kernel
    lib = layer.lib
    try:
        for amx, vnni in ((0, 0), (0, 1), (1, 1)):
            lib.uag_set_amx(amx)
            lib.uag_set_avx512vnni(vnni)
            assert torch.equal(layer(x).double(), expected.float().double())
    finally:
        lib.uag_set_amx(1)
        lib.uag_set_avx512vnni(1)


@needs_native
@pytest.mark.parametrize("form", ["q8_0", "q5_0", "q4_k", "q6_k", "k16"])
def test_integer_products_give_the_same_bits_on_every_path_and_row_count(form):
    """exact.c sums exact integers, so AMX, AVX-512 VNNI and the scalar reference give the same
    bits for every row count; the result is within its activation grid (2^-14 of each block's
    largest value) and 3 fp32 roundings (of sum |x| |w|) of the float64 product, for rows with
    an outlier channel, a zero row (the bias, exactly), a row near fp32's smallest normal and
    one far above 1; the outlier channel coarsens only its own block (a grid per row would
    not meet the bound); a non-finite row is NaN and leaves the others alone."""
    import copy

    linear, block, affine = _integer_form(form)
    blocked = native.NativeLinear(linear)
    layer = copy.deepcopy(blocked)
    if not layer.to_integer():
        pytest.skip("exact.c's fast paths (AVX-512 VNNI) unavailable here")
    assert (layer.x8_block, layer.x8_affine) == (block, affine)
    assert torch.allclose(layer.dequantized(), linear.weight, rtol=1e-6, atol=1e-9)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(17, linear.in_features, generator=gen)
    x[:, 5] *= 30.0
    x[3] = 0.0
    x[4] *= 1e-36
    x[6] *= 1e20
    lib = layer.lib
    runs = []
    try:
        for amx, vnni in ((0, 0), (0, 1), (1, 1)):
            lib.uag_set_amx(amx)
            lib.uag_set_avx512vnni(vnni)
            runs.append([layer(x[:m]) for m in range(1, 18)])
    finally:
        lib.uag_set_amx(1)
        lib.uag_set_avx512vnni(1)
    full = runs[0][-1]
    for outs in runs:
        for m, y in enumerate(outs, start=1):
            assert torch.equal(y, full[:m])
    assert torch.equal(full[3], linear.bias.detach())
    assert integer_products_excess(full, x, linear.weight, linear.bias, block=block) <= 3
    x[7, 9] = float("nan")
    broken = layer(x)
    assert torch.isnan(broken[7]).all() and torch.equal(broken[8:], full[8:])


@needs_native
@pytest.mark.parametrize(
    ("form", "bits"), [("q8_0", 8), ("q5_0", 5), ("q4_k", 5), ("q6_k", 6), ("k16", 4)]
)
def test_packed_integers_are_the_int8_layouts_bit_for_bit(form, bits, monkeypatch):
    """``pack`` stores exact.c's integers at the fewest bits their range needs (Q5_0's at 5,
    Q6_K's at 6, Q4_K's at 5 once halves of different bases merge; Q8_0's stay int8) and reads
    the same integers back, so every path and row count gives the int8 layout's bits from
    fewer bytes; with ``UAG_PACKED_BODY=0`` nothing is packed, unset only 4-bit widths."""
    import copy

    from uag.kernels.formats import exact_integers, packed_block_bytes

    linear, block, _ = _integer_form(form)
    if form == "q5_0":  # GGUF's Q5_0 integers: -16..15 (the helper's reach 16)
        gen = torch.Generator().manual_seed(6)
        q = torch.randint(-16, 16, (48, 640), generator=gen).float()
        q[:, ::32] = -16.0
        scales = (torch.rand(48, 20, generator=gen) * 0.01 + 1e-4).half().float()
        with torch.no_grad():
            linear.weight.copy_(q * scales.repeat_interleave(32, dim=1))
    int8 = native.NativeLinear(linear)
    assert int8.to_integer(anywhere=True)
    packed = copy.deepcopy(int8)
    monkeypatch.setenv("UAG_PACKED_BODY", "0")
    assert not packed.pack()
    monkeypatch.delenv("UAG_PACKED_BODY")
    if bits == 4:  # the default packs only what exact.c unpacks in registers
        assert copy.deepcopy(int8).pack()
    else:
        assert not copy.deepcopy(int8).pack()
    monkeypatch.setenv("UAG_PACKED_BODY", "1")
    assert packed.pack() == (bits < 8)
    assert packed.x8_bits == bits
    assert torch.equal(exact_integers(packed), int8.weight_ilv)
    assert torch.equal(packed.dequantized(), int8.dequantized())
    groups, blocks = linear.out_features // 16, linear.in_features // block
    assert packed.weight_ilv.nbytes == groups * blocks * packed_block_bytes(block, bits)
    assert packed.weight_ilv.nbytes * 8 == int8.weight_ilv.nbytes * bits
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(17, linear.in_features, generator=gen)
    x[:, 3] *= 40.0
    lib = packed.lib
    try:
        for amx, vnni in ((0, 0), (0, 1), (1, 1)):
            lib.uag_set_amx(amx)
            lib.uag_set_avx512vnni(vnni)
            for m in (1, 2, 3, 5, 9, 17):
                assert torch.equal(packed(x[:m]), int8(x[:m]))
    finally:
        lib.uag_set_amx(1)
        lib.uag_set_avx512vnni(1)


@needs_native
def test_blocks_stored_negated_with_their_scales_give_the_same_bits():
    """``_lean_negative``'s premise: negating a block's integers and its scale negates the exact
    sum and the scale together, and IEEE rounding is symmetric, so every path and row count
    gives the same bits (zero rows included: no -0.0 appears)."""
    import copy

    linear, _, _ = _integer_form("q5_0")
    layer = native.NativeLinear(linear)
    assert layer.to_integer(anywhere=True)
    negated = copy.deepcopy(layer)
    negated.weight_ilv = (-layer.weight_ilv.to(torch.int16)).to(torch.int8)
    negated.block_scales = -layer.block_scales
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, linear.in_features, generator=gen)
    x[2] = 0.0
    lib = layer.lib
    try:
        for amx, vnni in ((0, 0), (0, 1), (1, 1)):
            lib.uag_set_amx(amx)
            lib.uag_set_avx512vnni(vnni)
            for m in (1, 3, 9):
                a, b = negated(x[:m]), layer(x[:m])
                assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
    finally:
        lib.uag_set_amx(1)
        lib.uag_set_avx512vnni(1)


@needs_native
def test_fuse_packs_the_joined_layer_and_its_parts_view_it(monkeypatch):
    """Parts of different ranges (6 and 4 bits alone) are fused first and packed as one, at the
    width the widest needs; the parts are views of the packed weight, with the same results."""
    monkeypatch.setenv("UAG_PACKED_BODY", "1")
    parts = [native.NativeLinear(_gguf_like_linear(32, 640, steps=s, seed=s)) for s in (16, 4)]
    for p in parts:
        assert p.to_integer(anywhere=True)
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([p(x) for p in parts], dim=-1)
    fused = native.fuse(parts)
    assert fused is not None and fused.x8_bits == 6
    assert all(p.x8_bits == 6 and p.x8_offset == fused.x8_offset for p in parts)
    assert parts[1].weight_ilv.data_ptr() > fused.weight_ilv.data_ptr()
    assert parts[1].weight_ilv.untyped_storage().data_ptr() == fused.weight_ilv.data_ptr()
    assert torch.equal(fused(x), alone)
    assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), alone)


@needs_native
@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
@pytest.mark.parametrize("packed", ["0", "1"])
def test_gguf_like_target_runs_exact_integer_layers_row_invariant_and_lossless(
    tokenizers, packed, family, monkeypatch
):
    """A target whose layers are GGUF-like blocks (Gemma 3's structure, or Qwen2's with q/k/v
    biases) runs them on exact.c (where the CPU has AVX-512 VNNI), in the int8 layout or
    packed: one position alone and among 1–9 give bitwise the same logits, and greedy UAG at
    lookahead 6 is token-for-token target-alone on every nasty prompt."""
    from tests.tiny import gguf_like_pair

    monkeypatch.setenv("UAG_PACKED_BODY", packed)
    pair = gguf_like_pair(tokenizers, kernels="native", family=family)
    assert pair.target_lm.lean is not None  # the lean body, not Transformers' forward
    if not pair.target_lm.lean.layers[0].qkv.lib.uag_x8_available():
        pytest.skip("exact.c's fast paths (AVX-512 VNNI) unavailable here")
    for layer in pair.target_lm.lean.layers:
        products = (layer.qkv, layer.o, layer.gate_up, layer.down)
        assert all(m.integer for m in products)
        assert any(m.x8_bits < 8 for m in products) == (packed == "1")
    ids = pair.target.tokenizer("def f(x):\n    return x * 2\n")["input_ids"]
    alone, chunked = one_row_vs_chunked_logits(pair.target_lm, ids[:5], ids[5:] * 3)
    assert torch.equal(alone, chunked)
    accepted = 0
    for prompt in NASTY_PROMPTS.values():
        ref = uag.generate(pair, prompt, plan=None, max_new_tokens=24)
        out = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=6)), max_new_tokens=24)
        assert out.token_ids == ref.token_ids
        accepted += sum(r.accepted_candidates for r in out.iterations)
    assert accepted > 0  # verification accepted drafts, so multi-row forwards decided tokens


@needs_native
def test_a_wrong_unpack_refuses_packing_but_leaves_the_default_paths(monkeypatch, capsys):
    """The packed body's SIMD unpacking is checked before anything is packed: where it
    disagrees with its definition, ``UAG_PACKED_BODY=1`` is a clear error, the default keeps
    the int8 layout and says so on stderr, and the build's self-test still passes."""
    from uag.errors import UagError

    lib = native._library()[0]
    monkeypatch.setattr(lib, "uag_x8_unpack_check", lambda: 0)
    native._packing_unavailable.cache_clear()
    try:
        assert native._self_test(lib) is None
        monkeypatch.delenv("UAG_PACKED_BODY", raising=False)
        native._say_unpacked.cache_clear()
        assert not native.packed_body()
        assert "the body stays int8" in capsys.readouterr().err
        monkeypatch.setenv("UAG_PACKED_BODY", "1")
        with pytest.raises(UagError, match="UAG_PACKED_BODY=1 cannot be used here: .*unpacking"):
            native.packed_body()
    finally:
        native._packing_unavailable.cache_clear()


@needs_native
@pytest.mark.parametrize(
    "tied", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["own-head", "tied-head"]
)
def test_qwen2_lean_native_forward_is_transformers_forward(tokenizers, tied):
    """Qwen2 on the lean body and the native kernels (its q/k/v biases carried by the fused
    product) gives Transformers' own logits within float noise, for a head of its own (1.5B)
    or tied to the embedding (0.5B): a body that dropped a bias, or rotated with another base,
    is far off. The argmax agrees on every position."""
    import copy

    from tests.tiny import gguf_like, tiny_qwen2
    from uag.api import make_pair
    from uag.runtime.models import wrap_model
    from uag.runtime.runner import CachedLM

    gemma_tok, _ = tokenizers
    model = gguf_like(tiny_qwen2(len(gemma_tok), tied=tied))
    reference = CachedLM(copy.deepcopy(model), lean=False)  # stock Transformers, fp32
    pair = make_pair(
        wrap_model(model, gemma_tok, ref="tiny-qwen2"),
        wrap_model(copy.deepcopy(model), gemma_tok, ref="tiny-qwen2-copy"),
        kernels="native",
    )
    assert pair.target_lm.lean is not None and pair.target_lm.row_invariant
    ids = gemma_tok("def f(x):\n    return x * 2  # café 😀\n")["input_ids"] * 3
    outs = []
    for lm in (pair.target_lm, reference):
        lm.reset(ids[:20], rollback=True)
        lm.forward()
        lm.ids.extend(ids[20:29])
        outs.append(lm.logits(lm.forward()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=2e-3)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
