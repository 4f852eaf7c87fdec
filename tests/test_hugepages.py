"""Streamed weights in huge pages (uag.kernels.hugepages): same bits, same tokens, advised memory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.tiny import cross_pair
from uag.kernels import hugepages, native

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages")
needs_native = pytest.mark.skipif(
    native.native_unavailable() is not None, reason="native kernels unavailable"
)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_move_keeps_every_bit_and_advises_the_region():
    shared = torch.randn(300_000)
    owner = SimpleNamespace(
        a=shared,
        b=torch.arange(1000, dtype=torch.int32).reshape(10, 100),
        same=shared,  # one tensor under two names: moved once, both names see the copy
        none=None,
        empty=torch.empty(0),
        strided=torch.arange(20.0)[::2],  # not contiguous: not a block of bytes, stays
    )
    before = {name: getattr(owner, name).clone() for name in ("a", "b")}
    strided = owner.strided
    moved = hugepages.move([(owner, n) for n in ("a", "b", "same", "none", "empty", "strided")])
    assert moved >= (300_000 * 4 + 1000 * 4)
    for name, value in before.items():
        now = getattr(owner, name)
        assert torch.equal(now, value) and now.dtype == value.dtype and now.shape == value.shape
        assert now.data_ptr() % hugepages.ALIGN == 0
        assert "hg" in _vm_flags(now.data_ptr())  # madvise(MADV_HUGEPAGE) took
    assert owner.same is owner.a and owner.a.data_ptr() != shared.data_ptr()
    assert owner.none is None and owner.empty.numel() == 0 and owner.strided is strided


@needs_thp
def test_a_process_may_exit_with_a_move_under_way():
    """``uag models prepare`` reads a prepared model (which starts moving its weights) and
    exits: the process must end cleanly, not abort inside the copy (it did, with a daemon
    thread: "terminate called without an active exception", exit 134 on every run here)."""
    import subprocess
    import sys

    script = (
        "import types, torch\n"
        "from uag.kernels import hugepages\n"
        "owner = types.SimpleNamespace(w=torch.ones(100_000_000))\n"
        "hugepages.Move([(owner, 'w')])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
    assert "terminate" not in done.stderr


def test_move_does_nothing_when_turned_off(monkeypatch):
    monkeypatch.setenv("UAG_HUGE_PAGES", "0")
    owner = SimpleNamespace(a=torch.randn(1000))
    kept = owner.a
    assert hugepages.move([(owner, "a")]) == 0 and owner.a is kept


@needs_native
@needs_thp
def test_pair_in_huge_pages_decodes_the_same_tokens(tokenizers, monkeypatch):
    monkeypatch.setenv("UAG_HUGE_PAGES", "0")
    plain = cross_pair(tokenizers, kernels="native")
    monkeypatch.setenv("UAG_HUGE_PAGES", "1")
    huge = cross_pair(tokenizers, kernels="native")
    for lm in (huge.target_lm, huge.assistant_lm):  # the body's C structs were re-pointed
        assert lm.lean is not None and lm.lean.native is not None
        moved = [getattr(o, n) for o, n in lm.lean.streamed()]
        moved = [t for t in moved if isinstance(t, torch.Tensor) and t.numel()]
        assert moved and all("hg" in _vm_flags(t.data_ptr()) for t in moved)
        first = lm.lean.layers[0]
        assert lm.lean.native.structs[0].qkv.weight == first.qkv.weight_ilv.data_ptr()
    for prompt in ("def f(x):\n    return", "Hello 😀 你好\r\n  x = 10**20"):
        ref = uag.generate(plain, prompt, plan=None, max_new_tokens=24)
        for pair in (plain, huge):
            out = uag.generate(pair, prompt, plan=RulePlan(StaticPolicy(k=4)), max_new_tokens=24)
            assert out.token_ids == ref.token_ids
        alone = uag.generate(huge, prompt, plan=None, max_new_tokens=24)
        assert alone.token_ids == ref.token_ids


@needs_native
@needs_thp
def test_full_head_moves_on_first_use_and_only_once(tokenizers, monkeypatch):
    """Sampling reads the full head every step: it moves when first built, gives the same
    logits, and a second move of what already moved does nothing."""
    monkeypatch.setenv("UAG_HUGE_PAGES", "0")
    plain = cross_pair(tokenizers, kernels="native")
    monkeypatch.setenv("UAG_HUGE_PAGES", "1")
    huge = cross_pair(tokenizers, kernels="native")
    ids = huge.target.tokenizer("def f(x):\n    return x")["input_ids"]
    rows = []
    for pair in (plain, huge):
        lm = pair.target_lm
        lm.reset(ids, rollback=False)
        rows.append(lm.full_logits(lm.forward()))
    assert torch.equal(rows[0], rows[1])
    full = huge.target_lm._full
    weight = full.weight_ilv
    assert "hg" in _vm_flags(weight.data_ptr())
    assert hugepages.move(full.streamed()) == 0 and full.weight_ilv is weight
