"""Paths other than the native kernels: the load-time row-count check, and greedy identity on it.

Two forced cases, each run twice: as the code stood before the check (rows trusted or guarded
by the float32 bound alone, no padding), where speculative output must *differ* from
target-alone (so the test can fail), and as it stands, where it must be identical:

- bfloat16 on the plain path with linears that round differently with the row count, as a
  GPU's one-row GEMV and its split-K GEMM do (this CPU's own bf16 products do not);
- oneDNN in float32 with an MLP width that is not a multiple of 32 (its vectorised activation
  rounds a row's tail differently with the row count), which the old check, looking at the
  linears only, called invariant.

Near-ties are forced by giving the target's most chosen tokens twins in the head whose logits
differ from theirs by a few units in the last place: which of the two wins is then decided by
the last bits of the hidden state.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.tiny import noisy_copy, tiny_gemma
from uag.api import make_pair
from uag.decoding import verifiers
from uag.kernels.choice import ROWWISE_MAX_ROWS, fast_kernels_available, is_row_invariant
from uag.runtime import invariance
from uag.runtime.models import wrap_model

PROMPTS = [
    "def f(x):\n    return",
    "Le café coûte 3,50 € 😀 你好，世界。",
    "12345678901234567890 +",
    "\r\n\tif (a) {\r\n\t\tb();<start_of_turn>user\nhi",
]
TOKENS = 24


def _split_k(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` as a GPU computes it: one row in one pass (GEMV), several rows with the
    width split in two halves, each rounded to the dtype, then added (split-K GEMM)."""
    if x.reshape(-1, x.shape[-1]).shape[0] == 1:
        return F.linear(x, self.weight, self.bias)
    half = x.shape[-1] // 2
    out = F.linear(x[..., :half], self.weight[:, :half]) + F.linear(
        x[..., half:], self.weight[:, half:]
    )
    return out if self.bias is None else out + self.bias


def _twin_heads(model: nn.Module, tokens: list[int]) -> None:
    """Give each token a twin: the next id's head row becomes a copy of its row plus noise of
    about two units in the last place of its logits (the head is tied to the embedding; only
    the twins' rows change), so which of the two wins depends on the logits' last bits."""
    weight = model.get_output_embeddings().weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tok in tokens:
            row = weight[tok].float()
            noise = torch.randn(row.shape[0], generator=gen) * row.norm() / row.shape[0] ** 0.5
            eps = torch.finfo(weight.dtype).eps
            weight[(tok + 1) % weight.shape[0]] = (row + noise * eps).to(weight.dtype)


def _pair(tokenizers, *, dtype: torch.dtype, kernels: str, width: int, split_k: bool):
    """A tiny Gemma target in ``dtype`` on ``kernels`` (its linears rounding GPU-like with
    ``split_k``) ← a float32 noisy copy, with the twins of the tokens its target-alone runs
    choose most."""
    gemma_tok, _ = tokenizers
    model = tiny_gemma(len(gemma_tok))
    if width != model.config.intermediate_size:
        model = _with_mlp_width(model, width)
    assistant = noisy_copy(model, scale=0.02)  # float32: bf16 products are slow on a CPU
    model = model.to(dtype)
    if split_k:
        for layer in model.model.layers:
            for linear in layer.modules():
                if isinstance(linear, nn.Linear):
                    linear.forward = types.MethodType(_split_k, linear)
    # The tokens to twin are counted on the plain path and twinned before the real pair is
    # made: oneDNN packs its own copy of the head at load, which a later edit would not reach.
    counting = make_pair(
        wrap_model(model, gemma_tok, ref="tiny-gemma-count"),
        wrap_model(assistant, gemma_tok, ref="tiny-gemma-noisy-count"),
        kernels="plain",
    )
    counts: dict[int, int] = {}
    for prompt in PROMPTS:
        for tok in uag.generate(counting, prompt, plan=None, max_new_tokens=TOKENS).token_ids:
            counts[tok] = counts.get(tok, 0) + 1
    _twin_heads(model, sorted(counts, key=counts.__getitem__, reverse=True)[:8])
    return make_pair(
        wrap_model(model, gemma_tok, ref="tiny-gemma"),
        wrap_model(assistant, gemma_tok, ref="tiny-gemma-noisy"),
        kernels=kernels,
    )


def _with_mlp_width(model: nn.Module, width: int) -> nn.Module:
    """``tiny_gemma`` rebuilt with another MLP width (same seed)."""
    from transformers import Gemma3ForCausalLM

    config = model.config
    config.intermediate_size = width
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).float()


def _outputs(pair) -> list[tuple[list[int], list[int]]]:
    """(target-alone, speculative with lookahead 6) token ids per prompt."""
    return [
        (
            uag.generate(pair, p, plan=None, max_new_tokens=TOKENS).token_ids,
            uag.generate(
                pair, p, plan=RulePlan(StaticPolicy(k=6)), max_new_tokens=TOKENS
            ).token_ids,
        )
        for p in PROMPTS
    ]


def _as_before(pair, monkeypatch, *, trusted: bool) -> None:
    """The pair as the code stood before the whole-forward check: no padding; rows trusted
    (oneDNN's linears-only check) or guarded by the float32 bound in every dtype."""
    lm = pair.target_lm
    lm.set_pad_rows(0)
    lm.row_invariant = trusted
    monkeypatch.setattr(verifiers, "tie_bound", lambda logits: verifiers.TIE_BOUND)


@pytest.mark.slow  # 15 s; the real pair in bf16 on the plain path stays in CI
def test_bf16_plain_path_with_gpu_like_rounding(tokenizers, monkeypatch):
    pair = _pair(tokenizers, dtype=torch.bfloat16, kernels="plain", width=64, split_k=True)
    lm = pair.target_lm
    report = lm.invariance
    assert report.invariant and report.padded, report  # one shape: split-K on every forward
    assert "differs" in report.detail  # unpadded, a row computed alone differs
    now = _outputs(pair)
    assert all(alone == spec for alone, spec in now)

    _as_before(pair, monkeypatch, trusted=False)
    assert invariance.compare_rows(lm) is not None
    before = _outputs(pair)
    assert any(alone != spec for alone, spec in before), "no near-tie flipped: the test is blunt"


@pytest.mark.slow  # 12 s; a oneDNN fallback edge
@pytest.mark.skipif(not fast_kernels_available(), reason="oneDNN is not in this torch build")
def test_onednn_with_a_width_not_a_multiple_of_32(tokenizers, monkeypatch):
    pair = _pair(tokenizers, dtype=torch.float32, kernels="onednn", width=72, split_k=False)
    lm = pair.target_lm
    model = pair.target.model
    assert is_row_invariant(model, rowwise_attention=True)  # the old check: linears only
    report = lm.invariance
    assert report.invariant and report.padded, report
    assert "differs" in report.detail
    now = _outputs(pair)
    assert all(alone == spec for alone, spec in now)

    # As before: the rows differ bitwise and were trusted, and a near-tie flips the output.
    _as_before(pair, monkeypatch, trusted=True)
    assert invariance.compare_rows(lm) is not None
    before = _outputs(pair)
    assert any(alone != spec for alone, spec in before), "no near-tie flipped: the test is blunt"


def test_a_path_failing_the_check_keeps_the_guard(tokenizers, capsys):
    """Rows that differ padded or not leave ``row_invariant`` off, so the verifier guards
    near-ties, with the bound grown to the dtype's rounding at the logits' size."""
    pair = _failing_pair(tokenizers)
    lm = pair.target_lm
    report = lm.invariance
    assert not report.invariant and not lm.row_invariant and lm.pad_rows == 0, report
    assert "padded" in report.detail
    err = capsys.readouterr().err
    assert "recomputes near-ties" in err and len(err.strip().splitlines()) == 1, err
    logits = torch.full((10,), 26.0, dtype=torch.bfloat16)
    assert verifiers.tie_bound(logits) == pytest.approx(8 * 2**-7 * 26)
    assert verifiers.tie_bound(logits.float()) == verifiers.TIE_BOUND


def _failing_pair(tokenizers):
    """A tiny Gemma on the plain path whose linears split by ``_row_parity_split``: a path
    that fails the load-time check padded or not."""
    gemma_tok, _ = tokenizers
    model = tiny_gemma(len(gemma_tok))
    for layer in model.model.layers:
        for linear in layer.modules():
            if isinstance(linear, nn.Linear):
                linear.forward = types.MethodType(_row_parity_split, linear)
    return make_pair(
        wrap_model(model, gemma_tok, ref="t"),
        wrap_model(model, gemma_tok, ref="a"),
        kernels="plain",
    )


def _row_parity_split(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A kernel no padding can fix: the split depends on which rows are real (odd row counts
    of the whole call split, even ones do not), so row 0 of a padded call still depends on
    the row count of the real call through its neighbours' values being zero or not."""
    rows = x.reshape(-1, x.shape[-1])
    real = int((rows.abs().sum(-1) > 0).sum())
    if real % 2 == 0:
        return F.linear(x, self.weight, self.bias)
    return _split_k(self, x)


def test_padding_is_one_shape_for_every_short_forward(tokenizers):
    """With padding on, every forward of up to ``ROWWISE_MAX_ROWS`` rows reaches the linears
    with exactly that many rows, and its real rows come back alone."""
    gemma_tok, _ = tokenizers
    model = tiny_gemma(len(gemma_tok))
    seen: list[int] = []
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    pair = make_pair(
        wrap_model(model, gemma_tok, ref="t"),
        wrap_model(model, gemma_tok, ref="a"),
        kernels="plain",
    )
    lm = pair.target_lm
    lm.set_pad_rows(ROWWISE_MAX_ROWS)
    lm.reset(list(range(30, 60)), rollback=True)
    lm.forward()
    seen.clear()
    for rows in (1, 3, ROWWISE_MAX_ROWS):
        lm.ids.extend(range(100, 100 + rows))
        assert lm.forward().shape[0] == rows
    assert set(seen) == {ROWWISE_MAX_ROWS}


def test_the_check_reads_the_sampling_logits_too(tokenizers):
    """Sampling verifies with ``full_logits`` rows: a path whose sampling head rounds a row
    differently with the row count (its greedy head and hidden states invariant) is caught, so
    sampling on a checked path reads the same probabilities as target-alone sampling."""
    gemma_tok, _ = tokenizers
    model = tiny_gemma(len(gemma_tok))
    pair = make_pair(
        wrap_model(model, gemma_tok, ref="t"),
        wrap_model(model, gemma_tok, ref="a"),
        kernels="plain",
    )
    lm = pair.target_lm
    assert lm.row_invariant and invariance.compare_rows(lm) is None
    full = lm.full_logits
    lm.full_logits = lambda hidden: full(hidden) + (1e-6 if hidden.shape[0] > 1 else 0.0)
    found = invariance.compare_rows(lm)
    assert found is not None and found.startswith("sampling logits"), found


def test_the_recompute_feeds_the_rounds_positions_alone(tokenizers):
    """On a path that fails the check, a near-tie's recompute equals target-alone's logits
    bitwise (given the cache before the round): the positions the tied row attends to are fed
    again one row at a time, not left with the keys and values the verify wrote. Fails when
    only the tied position is re-fed."""
    pair = _failing_pair(tokenizers)
    lm = pair.target_lm
    assert not lm.row_invariant
    prompt, tokens, row = list(range(40, 52)), [300, 301, 302, 303, 304, 305], 3
    lm.reset(prompt, rollback=True)  # target-alone: the prompt, then one row per step
    lm.forward()
    alone = []
    for tok in tokens:
        lm.ids.append(tok)
        alone.append(lm.greedy(lm.forward()[-1:]).logits[0].clone())
    lm.reset(prompt, rollback=True)  # a round: the pending token and 5 candidates at once
    lm.forward()
    lm.ids.append(tokens[0])
    base = len(lm.ids)
    lm.ids.extend(tokens[1:])
    together = lm.greedy(lm.forward()).logits
    assert not torch.equal(together[row], alone[row])  # the verify rounds differently
    recomputed = verifiers._recompute_alone(lm, row=row, base=base)
    assert lm.ids == [*prompt, *tokens[: row + 1]]
    assert torch.equal(recomputed.logits[0], alone[row])
