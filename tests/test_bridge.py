"""The byte bridge: token bytes are exact, continuations line up, partial characters wait."""

from __future__ import annotations

import pytest

from tests.nasty import NASTY_PROMPTS
from uag.bridge import Bridge, TokenText, complete_utf8_prefix, ends_on_char_boundary
from uag.errors import UagError


@pytest.fixture(scope="module")
def sides(tokenizers):
    gemma_tok, smol_tok = tokenizers
    return TokenText(gemma_tok, len(gemma_tok)), TokenText(smol_tok, len(smol_tok))


@pytest.mark.parametrize("name", sorted(NASTY_PROMPTS))
def test_token_bytes_round_trip(sides, name):
    text = NASTY_PROMPTS[name]
    for side in sides:
        assert side.bytes_of(side.encode(text)) == text.encode("utf-8")


def test_newline_and_space_tokens_are_real_bytes(sides):
    gemma, smol = sides
    # SmolLM2 spells "\n" as "Ċ" in its vocabulary; Gemma has a literal "Ċ" token. Bytes differ.
    assert smol.bytes_of(smol.encode("\n")) == b"\n"
    assert gemma.bytes_of(gemma.encode("Ċ")) == "Ċ".encode()
    assert smol.bytes_of(smol.encode("\n\n   é")) == "\n\n   é".encode()


def test_complete_utf8_prefix():
    emoji = "😀".encode()
    assert complete_utf8_prefix(b"ab" + emoji[:2]) == 2
    assert complete_utf8_prefix(b"ab" + emoji) == 6
    assert complete_utf8_prefix(b"") == 0
    assert ends_on_char_boundary(b"x" + emoji)
    assert not ends_on_char_boundary(b"x" + emoji[:3])
    assert ends_on_char_boundary(b"")


@pytest.mark.parametrize("side_index", [0, 1])
def test_word_split_across_boundary_is_neither_lost_nor_doubled(sides, side_index):
    side = sides[side_index]
    tail = side.bytes_of(side.encode("say hel"))
    ids, consumed = side.continuation(tail=tail, new=b"lo world")
    assert consumed == len(b"lo world")
    assert side.bytes_of(ids) == b"lo world"


@pytest.mark.parametrize("side_index", [0, 1])
def test_partial_character_waits(sides, side_index):
    side = sides[side_index]
    emoji = "🎉".encode()
    ids, consumed = side.continuation(tail=b"party ", new=b"time " + emoji[:2])
    assert consumed == len(b"time ")
    assert side.bytes_of(ids) == b"time "
    ids, consumed = side.continuation(tail=b"party time ", new=emoji)
    assert side.bytes_of(ids) == emoji and consumed == 4


def test_continuation_never_adds_bos(sides):
    gemma, smol = sides
    for side, bos in ((gemma, 2), (smol, 1)):
        for tail in (b"", b"Hello", b"<bos>"):
            ids, _ = side.continuation(tail=tail, new=b" world")
            assert bos not in ids or side.table[bos] in b" world"


def test_alignment_tie_on_repetitive_text(sides):
    """[1,2,3,1,2] then "9 9 9" must give exactly the new text, not re-align into the context."""
    for side in sides:
        tail = side.bytes_of(side.encode("1 2 3 1 2"))
        ids, _ = side.continuation(tail=tail, new=b" 9 9 9")
        assert side.bytes_of(ids) == b" 9 9 9"


def test_bridge_tail_uses_last_tokens(sides):
    gemma, smol = sides
    bridge = Bridge(target=gemma, assistant=smol, lookbehind=2)
    ids = smol.encode("one two three")
    assert bridge.tail(smol, ids) == smol.bytes_of(ids[-2:])


def test_normalising_tokenizer_is_refused():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.normalizer = normalizers.Lowercase()
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    with pytest.raises(UagError, match="not supported by the byte bridge"):
        TokenText(tok, len(tok))
