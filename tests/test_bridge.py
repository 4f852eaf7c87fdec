"""The byte bridge: token bytes are exact, continuations line up, partial characters wait."""

from __future__ import annotations

import pytest

from tests.nasty import NASTY_PROMPTS
from uag.decoding.bridge import Bridge, TokenText, complete_utf8_prefix, ends_on_char_boundary
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


def test_tokenizer_cache_round_trip(tokenizers, tmp_path, monkeypatch):
    """A checkpoint inside $UAG_CACHE loads Transformers' tokenizer (``fast=False``; the fast
    one: tests/test_fast_tokenizer.py) from a pickle the second time, with
    the same encodings, decodings and byte table; an edited tokenizer is rebuilt; a directory
    outside the cache is never written to."""
    from uag.runtime import tokcache
    from uag.runtime.tokcache import token_bytes_table

    monkeypatch.setenv("UAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("UAG_TOKENIZER_CACHE", raising=False)
    tok0 = tokenizers[1]  # SmolLM2's (byte-level BPE): Gemma's takes ~10x longer to save
    inside = tmp_path / "cache" / "models" / "g"
    tok0.save_pretrained(inside)
    first = tokcache.load_tokenizer(str(inside), fast=False)
    entries = list(inside.glob("uag-tokenizer-*.pkl"))
    assert len(entries) == 1
    assert tokcache.load_tokenizer(str(inside), fast=False) is first  # this process keeps it
    tokcache._LOADED.clear()  # a new process: from the pickle
    second = tokcache.load_tokenizer(str(inside), fast=False)
    assert second is not first
    assert getattr(second, tokcache.TABLE_ATTR) == token_bytes_table(tok0, len(tok0))
    text = "def f(x):\r\n\tif x:  # café 😀 你好\n        return 12345678901234"
    ids = tok0(text)["input_ids"]
    for tok in (first, second):
        assert tok(text)["input_ids"] == ids and tok.decode(ids) == tok0.decode(ids)
    assert token_bytes_table(second, len(tok0) + 5)[-5:] == [b""] * 5  # padding rows
    config = inside / "tokenizer_config.json"
    config.write_text(config.read_text())  # touched: a new key, the stale entry goes
    import os

    os.utime(config, ns=(0, 0))
    tokcache.load_tokenizer(str(inside), fast=False)
    now = list(inside.glob("uag-tokenizer-*.pkl"))
    assert len(now) == 1 and now != entries
    outside = tmp_path / "mine"
    tok0.save_pretrained(outside)
    tokcache.load_tokenizer(str(outside), fast=False)
    assert not list(outside.glob("uag-tokenizer-*")) and not list(tmp_path.glob("cache/token*"))


def test_resync_encodes_a_merged_boundary_again(sides):
    """SmolLM2 spells ``\\n`` + ``    return`` as ``\\n···`` + ``·return``: after a tail ending in
    ``\\n`` the newline is taken back and encoded with what follows, the text kept exactly;
    where nothing merges it is ``continuation`` (nothing dropped), on either side."""
    _, smol = sides
    tail = smol.encode('    """\n')
    drop, ids = smol.resync(tail_ids=tail, new=b"    return x")
    assert drop == 1
    assert smol.bytes_of(tail[:-drop] + ids) == smol.bytes_of(tail) + b"    return x"
    assert ids == smol.encode('    """\n    return x')[len(tail) - drop :]
    for side in sides:
        tail = side.encode("say hello")
        drop, ids = side.resync(tail_ids=tail, new=b" world")
        assert drop == 0 and ids == side.continuation(tail=b"say hello", new=b" world")[0]
        drop, ids = side.resync(tail_ids=tail, new="😀".encode()[:2])
        assert (drop, ids) == (0, [])  # half a character waits, as in ``continuation``


def test_fitting_tokens_spell_the_healed_text_first(sides):
    """Token healing's choices after ``\\n    ``: the tokens that begin with it and those that
    are its prefixes, nothing else, under the draft vocabulary's limit."""
    _, smol = sides
    text = b"\n    "
    ids = smol.fitting(text, below=8192)
    pieces = {smol.table[i] for i in ids}
    assert b"\n" in pieces and b"\n   " in pieces and b"\n    " in pieces
    assert all(i < 8192 for i in ids)
    assert all(text.startswith(smol.table[i]) or smol.table[i].startswith(text) for i in ids)
    fits = [i for i in range(8192) if text.startswith(smol.table[i]) and smol.table[i]]
    assert set(fits) <= set(ids)
    assert smol.encode(" return")[0] not in ids
    assert smol.fitting(text, below=8192) is ids  # cached


def test_shared_vocabulary_is_detected(tokenizers):
    gemma_tok, smol_tok = tokenizers
    assert Bridge.for_tokenizers(
        target=gemma_tok,
        assistant=gemma_tok,
        target_vocab=len(gemma_tok),
        assistant_vocab=len(gemma_tok),
    ).shared_vocabulary
    assert not Bridge.for_tokenizers(
        target=gemma_tok,
        assistant=smol_tok,
        target_vocab=len(gemma_tok),
        assistant_vocab=len(smol_tok),
    ).shared_vocabulary
