"""Prefix reuse (``CachedLM.keep_prefixes``, what ``uag serve`` turns on) keeps exactly the
states a fresh prefill would compute: checked bitwise on the cached keys and values of the
real pair, and on the generated ids of a chat's next turn."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import uag

pytestmark = pytest.mark.real

HISTORY = (
    "User: write a function that adds two numbers\nAssistant: def add(a, b):\n    return a + b\n"
)
NEXT = HISTORY + "User: now one that multiplies them — and 日本語 too\nAssistant:"


@pytest.fixture
def reusing(real_pair) -> Iterator[uag.Pair]:
    kept = real_pair.keep_prefixes(positions=4096)
    assert kept == ["target", "assistant"], kept  # both run every row on its own
    try:
        yield real_pair
    finally:
        for lm in (real_pair.target_lm, real_pair.assistant_lm):
            lm.slots = None
            lm.reset([], rollback=False)


@contextlib.contextmanager
def fresh(*lms) -> Iterator[None]:
    """Within the block, every reset starts from an empty cache."""
    saved = [lm.slots for lm in lms]
    for lm in lms:
        lm.slots = None
    try:
        yield
    finally:
        for lm, slots in zip(lms, saved, strict=True):
            lm.slots = slots


def _states(lm) -> list[torch.Tensor]:
    n = lm.cached
    return [t[:, :n].clone() for t in lm.cache.keys + lm.cache.values]


def _prefill(lm, ids: list[int]) -> list[torch.Tensor]:
    lm.reset(ids, rollback=True)
    lm.forward()
    return _states(lm)


@pytest.mark.parametrize("role", ["target", "assistant"])
def test_kept_states_are_bitwise_a_fresh_prefills(reusing, role) -> None:
    lm = getattr(reusing, f"{role}_lm")
    model = getattr(reusing, role)
    first = list(model.tokenizer(HISTORY)["input_ids"])
    second = list(model.tokenizer(NEXT)["input_ids"])
    assert second[: len(first) - 1] == first[: len(first) - 1]
    _prefill(lm, first)
    for tok in second[len(first) : len(first) + 3]:  # a few decode rows on top, one at a time
        lm.ids.append(tok)
        lm.forward()
    before = list(lm.ids)
    _prefill(lm, list(model.tokenizer("An unrelated prompt in between.")["input_ids"]))
    lm.reset(second, rollback=True)
    shared = next(i for i, (a, b) in enumerate(zip([*before, -1], second, strict=False)) if a != b)
    assert lm.cached == min(shared, len(second) - 1) > len(first) // 2  # the kept sequence's
    lm.forward()
    reused = _states(lm)
    with fresh(lm):
        again = _prefill(lm, second)
    assert all(torch.equal(a, b) for a, b in zip(reused, again, strict=True))


def test_the_next_turn_generates_the_same_tokens(reusing) -> None:
    uag.generate(reusing, HISTORY, max_new_tokens=8)
    uag.generate(reusing, "Another conversation entirely", max_new_tokens=4)
    reused = uag.generate(reusing, NEXT, max_new_tokens=24)
    with fresh(reusing.target_lm, reusing.assistant_lm):
        again = uag.generate(reusing, NEXT, max_new_tokens=24)
    assert reused.token_ids == again.token_ids
