"""Prepared models (``uag.runtime.prepared``): built once, memory-mapped after, and the same model."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.tiny import one_row_vs_chunked_logits, tiny_gemma
from uag.api import make_pair
from uag.kernels import native
from uag.runtime import prepared
from uag.runtime.models import load_model
from uag.runtime.runner import CachedLM

pytestmark = pytest.mark.skipif(
    native.native_unavailable() is not None, reason="native kernel unavailable"
)


def _snap_to_q8_0(model) -> None:
    """Round every weight matrix onto GGUF's Q8_0 grid (an fp16 scale times integers in
    [-127, 127] per block of 32), as a converted GGUF checkpoint holds it: the form whose
    exact blocks let the target's head and embedding be stored compactly."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() != 2 or param.shape[1] % 32:
                continue
            blocks = param.view(param.shape[0], -1, 32)
            scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(1e-6)
            blocks.copy_((blocks / scale).round().clamp(-127, 127) * scale)


@pytest.fixture(scope="module")
def cache_root_dir(tmp_path_factory, tokenizers, tiny_dirs):
    """A ``$UAG_CACHE`` holding two converted-like checkpoints (prepared files are only kept
    beside checkpoints inside it): a tiny Gemma on the Q8_0 grid and a random-weight one."""
    root = tmp_path_factory.mktemp("uag-cache")
    model = tiny_gemma(len(tokenizers[0]))
    _snap_to_q8_0(model)
    model.save_pretrained(root / "target")
    tokenizers[0].save_pretrained(root / "target")
    shutil.copytree(tiny_dirs[0], root / "random-target")
    shutil.copytree(tiny_dirs[1], root / "assistant")
    return root


@pytest.fixture()
def cache(cache_root_dir, monkeypatch):
    """That cache, with no prepared file in it yet."""
    monkeypatch.setenv("UAG_CACHE", str(cache_root_dir))
    monkeypatch.delenv("UAG_PREPARED_CACHE", raising=False)
    for path in cache_root_dir.glob("*/uag-prepared-*"):
        path.unlink()
    return cache_root_dir


@pytest.fixture()
def q8_dirs(cache):
    """(the Q8_0-grid tiny Gemma target, the tiny Llama assistant), both inside the cache."""
    return str(cache / "target"), str(cache / "assistant")


def _files(cache) -> list[str]:
    return sorted(p.name for p in cache.glob("*/uag-prepared-*"))


def test_prepared_pair_equals_the_converted_pair(q8_dirs, cache, monkeypatch, capsys):
    """The first load builds and saves both models (saying so); the second maps the files
    without building anything; both give bitwise the logits and exactly the tokens of the pair
    converted in process (``make_pair`` on the Transformers models)."""
    target, assistant = q8_dirs
    first = uag.load_pair(target, assistant, kernels="native", assistant_int8=False)
    said = capsys.readouterr().err
    assert said.count("uag: preparing") == 2 and "as target" in said and "as assistant" in said
    assert first.target.model is None and first.target_lm.model is None
    assert len(_files(cache)) == 2
    assert first.target_lm._greedy.fast.exact is not None  # the head held as exact blocks

    def refuse(*args, **kwargs):
        raise AssertionError("a prepared file was built again instead of read")

    monkeypatch.setattr(prepared, "_build", refuse)
    second = uag.load_pair(target, assistant, kernels="native", assistant_int8=False)
    monkeypatch.undo()
    assert "preparing" not in capsys.readouterr().err
    converted = make_pair(load_model(target), load_model(assistant), kernels="native")
    assert converted.target.model is not None

    ids = second.target.tokenizer(NASTY_PROMPTS["python_deep_indent"] * 2)["input_ids"][:40]
    logits = []
    for pair in (first, second, converted):
        lm = pair.target_lm.twin()
        lm.reset(ids, rollback=False)
        logits.append(lm.full_logits(lm.forward()))
        assert pair.target_lm.row_invariant
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[2])
    stock = CachedLM(load_model(target).model, lean=False)  # Transformers' own forward
    stock.reset(ids, rollback=False)
    # exact.c rounds activations to 2^-14 of their block's largest (measured: <= 1.6e-4 here)
    torch.testing.assert_close(logits[1], stock.logits(stock.forward()), rtol=1e-4, atol=1e-3)

    prompt = NASTY_PROMPTS["emoji_run"]
    outs = [
        uag.generate(p, prompt, plan=policy and RulePlan(policy), max_new_tokens=12)
        for p in (second, converted)
        for policy in (None, StaticPolicy(k=4))
    ]
    assert all(o.token_ids == outs[0].token_ids for o in outs)


def test_int8_assistant_prepares_its_own_file(q8_dirs, cache):
    target, assistant = q8_dirs
    pair = uag.load_pair(target, assistant, kernels="native", assistant_int8=True)
    assert pair.assistant_int8 and any("assistant-int8" in f for f in _files(cache))
    ref = uag.generate(pair, "def f(x):", plan=None, max_new_tokens=8)
    out = uag.generate(pair, "def f(x):", plan=RulePlan(StaticPolicy(k=3)), max_new_tokens=8)
    assert out.token_ids == ref.token_ids


def test_prepared_rows_stay_invariant(q8_dirs, cache):
    pair = uag.load_pair(*q8_dirs, kernels="native")
    ids = pair.target.tokenizer(NASTY_PROMPTS["cjk"] * 3)["input_ids"]
    alone, chunked = one_row_vs_chunked_logits(pair.target_lm, ids[:12], ids[12:40])
    assert torch.equal(alone, chunked)


def test_a_changed_checkpoint_or_a_damaged_file_is_built_again(q8_dirs, cache):
    target, _ = q8_dirs
    first = prepared.load(target, role="target")
    assert first is not None
    (old,) = _files(cache)
    config = os.path.join(target, "config.json")
    stat = os.stat(config)
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert prepared.load(target, role="target") is not None
    (new,) = _files(cache)  # the stale file is gone
    assert new != old
    (cache / "target" / new).write_bytes(b"not a torch file")
    again = prepared.load(target, role="target")
    assert again is not None and isinstance(again[1], prepared.Prepared)
    assert _files(cache) == [new]


@pytest.mark.slow  # 20 s; what is prepared is checked in CI
def test_what_is_not_prepared(q8_dirs, tiny_dirs, cache, monkeypatch):
    """A head without a compact exact form (remembered, so later starts skip the attempt), a
    user's own directory, a hub id, and the switch: all load the usual way."""
    random_target = str(cache / "random-target")
    assert prepared.load(random_target, role="target") is None
    assert _files(cache) == [n for n in _files(cache) if n.endswith(".none")] != []

    def refuse(*args, **kwargs):
        raise AssertionError("tried to prepare a model already found unpreparable")

    monkeypatch.setattr(prepared, "_build", refuse)
    assert prepared.load(random_target, role="target") is None
    assert prepared.load(tiny_dirs[0], role="target") is None  # outside $UAG_CACHE
    assert prepared.load("some-org/some-model", role="target") is None
    monkeypatch.undo()
    monkeypatch.setenv("UAG_CACHE", str(cache))
    monkeypatch.setenv("UAG_PREPARED_CACHE", "0")
    assert prepared.load(q8_dirs[0], role="target") is None
    pair = uag.load_pair(*q8_dirs, kernels="native")  # still loads, converted in process
    assert pair.target.model is not None
    assert not [n for n in _files(cache) if n.endswith(".pt")]
    with pytest.raises(ValueError, match="unknown role"):
        prepared.load(q8_dirs[0], role="draft")


def test_a_cache_that_cannot_be_written_still_runs(q8_dirs, cache, monkeypatch):
    """A full or read-only disk (torch's writer raises RuntimeError, the OS OSError): the model is
    prepared in memory and used, nothing half-written is left behind."""

    def full_disk(*args, **kwargs):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(prepared.torch, "save", full_disk)
    pair = uag.load_pair(*q8_dirs, kernels="native")
    assert pair.target.model is None  # prepared, just not saved
    assert _files(cache) == [] and not list(cache.glob("*/*.tmp"))
    out = uag.generate(pair, "def f(x):", plan=RulePlan(StaticPolicy(k=2)), max_new_tokens=6)
    assert out.token_ids == uag.generate(pair, "def f(x):", plan=None, max_new_tokens=6).token_ids
