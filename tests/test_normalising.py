"""Normalising tokenizers across the bridge (issue 59 item 1): Qwen2's tokenizer applies NFC
before it splits text, so ``"cafe\\u0301"`` encodes to the bytes of ``"café"``.

Without a download: toy byte-level BPE tokenizers with Qwen2's normaliser (``NFC``), an
``NFKC`` one and a lowercasing one (refused, with its name), each as target and as assistant,
against one that normalises nothing. Greedy output stays the target's own token for token on
prompts that are not in normal form (decomposed accents, Hangul jamo, ligatures, compatibility
characters) and on the project's nasty text; the assistant's side keeps spelling the target's
text byte for byte even where the target writes text its normaliser would change; sampling
keeps the target's distribution (the exact-enumeration check of ``tests/test_sampling.py``)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import normalizers

import uag
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from tests.nasty import NASTY_PROMPTS
from tests.toy import _TEXT_A, _TEXT_B, byte_bpe, toy_pair
from uag.decoding.assistant_text import AssistantText
from uag.decoding.bridge import Bridge, Normaliser, TokenText
from uag.decoding.lookup import PromptLookup
from uag.errors import UagError

NOT_NORMAL = {
    "decomposed": "Le cafe\u0301 de\u0301ja\u0300 vu: re\u0301sume\u0301, nai\u0308ve",
    "jamo": "\u1112\u1161\u11ab\u1100\u1173\u11af \u1100\u1161 \u1102\u1161 \u1103\u1161",
    "ligatures": "\ufb01nd the \ufb02ow of \ufb00ects \u2460\u2461 \uff21\uff22\uff23 \u00bd",
    "mixed": "cafe\u0301 café \u1100\u1161 가 \ufb01 fi e\u0301e\u0301e\u0301",
}
CORPUS = _TEXT_A + _TEXT_B + list(NOT_NORMAL.values()) * 10


def _tokenizer(normalizer=None, vocab: int = 300):
    return byte_bpe(CORPUS, vocab, normalizer=normalizer)


@pytest.fixture(scope="module")
def plain():
    return _tokenizer(vocab=290)


@pytest.fixture(scope="module")
def nfc():
    return _tokenizer(normalizers.NFC())


def test_the_normaliser_is_read_from_the_tokenizer(plain, nfc):
    assert Normaliser.of(plain).forms == ()
    assert Normaliser.of(nfc).forms == ("NFC",)
    seq = _tokenizer(normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")]))
    assert Normaliser.of(seq) == Normaliser(forms=("NFKC",), others=())
    assert Normaliser.of(nfc)("cafe\u0301") == "café"


def test_a_normalising_tokenizer_is_bridged_and_spells_its_normal_form(nfc):
    side = TokenText(nfc, len(nfc))  # refused before: its bytes are not the text's
    ids, consumed = side.continuation(tail=b"Le ", new="cafe\u0301".encode())
    assert side.bytes_of(ids) == "café".encode() and consumed == len("cafe\u0301".encode())
    exact, _ = side.continuation(tail=b"Le ", new="cafe\u0301".encode(), exact=True)
    assert side.bytes_of(exact) == "cafe\u0301".encode()  # byte for byte, where asked


def test_new_text_that_recomposes_the_tails_last_letter_is_encoded_alone(nfc):
    """``e`` then ``\\u0301``: NFC of the whole changes the tail, so no cut at its end exists."""
    side = TokenText(nfc, len(nfc))
    ids, _ = side.continuation(tail=b"cafe", new="\u0301 noir".encode())
    assert side.bytes_of(ids) == Normaliser.of(nfc)("\u0301 noir").encode()


@pytest.mark.parametrize(
    ("steps", "name"),
    [
        ([normalizers.NFC(), normalizers.Lowercase()], "NFC\\+Lowercase"),
        ([normalizers.NFD(), normalizers.StripAccents()], "NFD\\+StripAccents"),
    ],
)
def test_a_normaliser_beyond_normal_forms_is_refused_with_its_name(steps, name):
    tok = _tokenizer(normalizers.Sequence(steps))
    with pytest.raises(UagError, match=f"normaliser \\({name}\\) changes text beyond"):
        TokenText(tok, len(tok))


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_the_assistant_tracks_the_targets_text_byte_for_byte(plain, form):
    """A normalising assistant fed target text it would normalise keeps its offsets exact."""
    normalising = _tokenizer(getattr(normalizers, form)())
    bridge = Bridge.for_tokenizers(
        target=plain,
        assistant=normalising,
        target_vocab=len(plain),
        assistant_vocab=len(normalising),
    )
    pair = toy_pair(tokenizers=(plain, normalising))
    lm = pair.assistant_lm
    lm.reset(normalising("Say:", add_special_tokens=False)["input_ids"], rollback=False)
    text = AssistantText(lm, bridge)
    target_text = b""
    for piece in ("cafe", "\u0301 ", "\ufb01n ", "\u1100\u1161", "\u11a8 ok"):
        target_text += piece.encode()
        text.sync(bridge, target_text)
        assert bytes(text.data) == text.lead + target_text


def _pairs(plain, nfc):
    return {
        "nfc-target": toy_pair(tokenizers=(nfc, plain), attention=True, ascii_only=False),
        "nfc-assistant": toy_pair(tokenizers=(plain, nfc), attention=True, ascii_only=False),
    }


@pytest.fixture(scope="module")
def pairs(plain, nfc):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _pairs(plain, nfc)
    torch.set_num_threads(before)


PROMPTS = {**NOT_NORMAL, **{k: NASTY_PROMPTS[k] for k in ("unicode_mix", "crlf", "cjk")}}


@pytest.mark.parametrize("side", ["nfc-target", "nfc-assistant"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_is_the_targets_own_output_with_a_normalising_side(pairs, side, name):
    pair = pairs[side]
    prompt = PROMPTS[name]
    ref = uag.generate(pair, prompt, plan=None, max_new_tokens=24)
    for plan in (RulePlan(StaticPolicy(k=4)), RulePlan(StaticPolicy(k=2), lookup=PromptLookup())):
        out = uag.generate(pair, prompt, plan=plan, max_new_tokens=24)
        assert out.token_ids == ref.token_ids, (side, name, plan.name)


def _real_sides(tokenizers) -> dict[str, TokenText]:
    gemma, smol = tokenizers
    return {"gemma-3": TokenText(gemma, len(gemma)), "smollm2": TokenText(smol, len(smol))}


def _check_real_side(side: TokenText) -> None:
    """The target's way (candidates: normal form) and the assistant's (exact) on text out of
    normal form, after a tail and alone."""
    for text in NOT_NORMAL.values():
        new = text.encode()
        ids, consumed = side.continuation(tail=b"x = 1\n# ", new=new)
        assert consumed == len(new)
        assert side.bytes_of(ids) in (side.normalise(text).encode(), b" " + new)
        exact, _ = side.continuation(tail=b"x = 1\n# ", new=new, exact=True)
        assert side.bytes_of(exact) == new


def test_the_embedded_tokenizers_bridge_text_out_of_normal_form(tokenizers):
    for name, side in _real_sides(tokenizers).items():
        assert side.normalise.forms == (), name  # neither normalises: they spell text as given
        _check_real_side(side)


@pytest.mark.slow
def test_qwen2s_tokenizer_is_bridged_with_its_nfc(tokenizers):
    """Qwen2.5's own tokenizer (from the embedded 0.5B's GGUF, ``uag[qwen]``), as Transformers
    loads its converted checkpoint: NFC first. As target (candidates in NFC) and as assistant
    (spelling the target's text exactly), beside Gemma 3 and SmolLM2."""
    from uag.runtime import models
    from uag.runtime.tokcache import load_tokenizer

    entry = models.EMBEDDED["qwen2.5-coder-0.5b"]
    if not entry.installed() and not models.is_cached(entry.name):
        pytest.skip(f"Qwen2.5's parts are not installed ({entry.missing_hint()})")
    qwen = load_tokenizer(str(models.convert_gguf(entry.name)))
    side = TokenText(qwen, len(qwen))
    assert side.normalise.forms == ("NFC",)
    _check_real_side(side)
    for other in _real_sides(tokenizers).values():
        for target, assistant in ((side, other), (other, side)):
            bridge = Bridge(target=target, assistant=assistant)
            assert not bridge.shared_vocabulary
