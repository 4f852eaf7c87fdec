"""The read-floor table (``scripts.floor``): bytes counted are the bytes the kernels hold."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from scripts import floor
from tests.tiny import cross_pair, gguf_like_gemma, noisy_copy, q8_0_like
from uag.api import make_pair
from uag.runtime.models import wrap_model

pytestmark = pytest.mark.slow  # scripts/floor.py and screen_width: one-off measurement tools


def test_each_storage_is_counted_once():
    class Owner:
        pass

    owner = Owner()
    owner.a = torch.zeros(100)
    owner.b = owner.a  # the same tensor under two names
    owner.c = torch.zeros(7, dtype=torch.int8)
    owner.d = None
    slots = [(owner, "a"), (owner, "b"), (owner, "c"), (owner, "d")]
    assert floor.slot_bytes(slots) == 400 + 7


def test_keys_and_values_read_by_window(tokenizers):
    pair = cross_pair(tokenizers)
    lean = pair.target_lm.lean  # tiny Gemma: one sliding layer (window 8), one full
    assert lean.layer_types == ["sliding_attention", "full_attention"] and lean.window == 8
    per_position = 2 * lean.kv_heads * lean.head_dim * 4
    assert floor.kv_bytes(pair.target_lm, context=3, rows=2) == (5 + 5) * per_position
    assert floor.kv_bytes(pair.target_lm, context=20, rows=1) == (8 + 21) * per_position


def test_target_and_assistant_rows(tokenizers):
    gemma_tok, _ = tokenizers
    model = gguf_like_gemma(len(gemma_tok))
    head = model.get_output_embeddings().weight  # tied to the embedding
    with torch.no_grad():  # Q8_0-like, as Gemma's: candidates read its exact blocks
        head.copy_(q8_0_like(*head.shape, steps=127, top=0.05, generator=torch.Generator()))
    pair = make_pair(
        wrap_model(model, gemma_tok, ref="floor-target"),
        wrap_model(noisy_copy(model, scale=0.05), gemma_tok, ref="floor-assistant"),
    )
    lm = pair.target_lm
    rows = floor.target_floor(pair, bandwidth=1e10, context=12, repeats=1, max_rows=3)
    assert [r.rows for r in rows] == [1, 2, 3]
    body = sum(getattr(o, n).nbytes for o, n in lm.lean.streamed() if getattr(o, n) is not None)
    head = lm._greedy.fast
    assert all(r.bytes.body == body > 0 for r in rows)
    assert all(r.bytes.head == floor.slot_bytes(head.streamed()) > 0 for r in rows)
    row_bytes = floor.slot_bytes(head.exact.streamed()) // head.exact.out_features
    assert all(r.bytes.candidates % row_bytes == 0 and r.bytes.candidates > 0 for r in rows)
    assert rows[0].bytes.kv < rows[2].bytes.kv
    for r in rows:
        assert (
            r.ms > 0 and r.floor_ms == r.bytes.total / 1e10 * 1e3 and r.ratio == r.ms / r.floor_ms
        )

    draft = floor.assistant_floor(pair, bandwidth=1e10, context=12, repeats=2)
    assistant = pair.assistant_lm
    assert draft.bytes.body == floor.slot_bytes(assistant.lean.streamed())
    assert draft.bytes.candidates == 0 and draft.ms > 0
    assert assistant.ids == [] and lm.ids == []  # both left without a sequence


def test_candidates_of_a_head_without_block_form_read_fp32_rows(tokenizers):
    pair = cross_pair(tokenizers)  # random fp32 weights: no exact block form
    head = pair.target_lm._greedy.fast
    assert head.exact is None
    rows = floor.target_floor(pair, bandwidth=1e10, context=12, repeats=1, max_rows=1)
    assert rows[0].bytes.candidates == head.last_candidates * head.in_features * 4 > 0


def test_the_table_has_a_row_per_step(tokenizers):
    table = floor.floor_table(cross_pair(tokenizers), context=12, repeats=1)
    lines = table.splitlines()
    assert "GB/s" in lines[0]
    body = [line for line in lines if line.startswith("| target") or line.startswith("| assistant")]
    assert len(body) == 10 and body[-1].startswith("| assistant | 1 |")


def test_coarser_first_passes_leave_more_candidates(tokenizers):
    """``scripts.screen_width`` on a tiny pair: every row keeps at least its argmax, and a
    coarser per-row format never leaves fewer candidates than a finer one."""
    from scripts import screen_width

    gemma_tok, _ = tokenizers
    model = gguf_like_gemma(len(gemma_tok))
    pair = make_pair(
        wrap_model(model, gemma_tok, ref="width-target"),
        wrap_model(noisy_copy(model, scale=0.05), gemma_tok, ref="width-assistant"),
    )
    hidden = screen_width.decode_hidden(pair, ["def f(x):", "Le café ☕ coûte"], tokens=6)
    assert hidden.shape == (12, model.config.hidden_size)
    found = {w.name: w for w in screen_width.widths(pair, hidden)}
    assert set(found) == {*screen_width.ROW_FORMATS, "4-bit per block of 32"}
    medians = [found[name].median for name in screen_width.ROW_FORMATS]
    means = [found[name].mean for name in screen_width.ROW_FORMATS]
    assert medians[0] >= 1 and medians == sorted(medians) and means == sorted(means)


def test_the_layout_table_times_both_layouts_and_checks_them_equal(tokenizers):
    """``--layout-table`` on the GGUF-like pair: both layouts loaded, a row per row count, the
    hidden states checked bitwise equal; where exact.c runs (AVX-512 VNNI) the packed body
    reads fewer bytes, elsewhere nothing is packed and both bodies are the same size."""
    gemma_tok, _ = tokenizers
    model = gguf_like_gemma(len(gemma_tok))

    def load():  # each layout on its own copy: make_pair swaps the model's linears in place
        return make_pair(
            wrap_model(copy.deepcopy(model), gemma_tok, ref="layout-target"),
            wrap_model(noisy_copy(model, scale=0.05), gemma_tok, ref="layout-assistant"),
        )

    table = floor.layout_table(load, context=12, rounds=2, max_rows=3).splitlines()
    assert "bitwise the same: yes" in table[0]
    assert [line.split(" | ")[0] for line in table[4:]] == ["| 1", "| 2", "| 3"]
    found = re.match(r"body MB: int8 ([\d.]+), packed ([\d.]+) \((\d+) products packed\)", table[0])
    assert found is not None
    int8, packed, products = float(found[1]), float(found[2]), int(found[3])
    assert (packed < int8) == (products > 0) and (packed == int8) == (products == 0)
