"""The cross-tokenizer bridge: token ids ⇄ bytes ⇄ the other tokenizer's ids.

Everything the two models agree on is *bytes of UTF-8 text*. Each token id maps to a fixed byte
string (``TokenText.table``), so the text of a token sequence is the plain concatenation of its
tokens' bytes — no decoder state, no partial-character guesswork. This is what makes acceptance
mapping exact: SmolLM2's byte-level ``Ċ`` is the byte ``\\n`` and Gemma's ``<0x0A>`` byte-fallback
token is the same byte, whatever their vocabulary strings look like (trap 2 in UAG-NOTES.md).

Going the other way, text is re-encoded with a *look-behind window*: the last few tokens' text is
prepended, the whole is encoded, and only the tokens after the exact byte boundary are kept. When
the re-encoding merges a token across that boundary (``hel`` + ``lo`` → ``hello``), the boundary
cannot be kept, so the new text is encoded on its own instead. Special tokens are never added
(no BOS mid-sequence), and only complete UTF-8 characters are ever encoded.

This module knows nothing of models.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from uag.errors import UagError
from uag.runtime.tokcache import token_bytes_table

LOOKBEHIND_TOKENS = 10
"""Tokens of context re-encoded with new text so token boundaries line up (Transformers uses 10)."""

# A probe string covering what breaks bridges: code indentation, CRLF, tabs, runs of spaces,
# digits, accents (precomposed and combining), emoji, CJK.
_PROBE = "def f(x):\r\n\tif x:\n        return 12345678901234 + x  # café cafe\u0301 😀 你好世界 ÅΩ"


def complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that is whole, valid UTF-8."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.start
    return len(data)


def ends_on_char_boundary(data: bytes | bytearray) -> bool:
    """Whether ``data`` (valid UTF-8 up to its end) does not stop inside a character."""
    last = _skip_partial_head(bytes(data[-4:]))
    return complete_utf8_prefix(last) == len(last)


def _skip_partial_head(data: bytes) -> bytes:
    """Drop UTF-8 continuation bytes at the start (a window cut mid-character)."""
    i = 0
    while i < len(data) and i < 4 and (data[i] & 0xC0) == 0x80:
        i += 1
    return data[i:]


@dataclass
class TokenText:
    """One tokenizer's view of text as bytes: id → bytes, and text → ids without special tokens."""

    tokenizer: Any
    vocab_size: int
    table: list[bytes] = field(init=False, repr=False)
    _fitting: dict[tuple[bytes, int], np.ndarray] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        self.table = token_bytes_table(self.tokenizer, self.vocab_size)
        self._check()

    def fitting(self, text: bytes, *, below: int) -> np.ndarray:
        """Ids under ``below`` whose bytes could start a sequence spelling ``text``: those that
        begin with it and its non-empty prefixes (token healing, ``uag.decoding.assistant_text``), as int64
        (a draft step indexes logits with them). Cached: the texts asked about are few (a
        space, a tab, newlines)."""
        key = (text, below)
        if key not in self._fitting:
            self._fitting[key] = np.array(
                [
                    i
                    for i, piece in enumerate(self.table[:below])
                    if piece and (piece.startswith(text) or text.startswith(piece))
                ],
                dtype=np.int64,
            )
        return self._fitting[key]

    def bytes_of(self, ids: Sequence[int]) -> bytes:
        table = self.table
        return b"".join(table[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with no BOS/EOS added (special-token strings still map to their ids)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def continuation(self, *, tail: bytes, new: bytes) -> tuple[list[int], int]:
        """Ids that continue a sequence ending in ``tail`` with the text ``new``.

        Returns ``(ids, consumed)``: only the longest complete-UTF-8 prefix of ``new`` is encoded
        (``consumed`` bytes of it); a trailing partial character waits for its other bytes.
        """
        consumed = complete_utf8_prefix(new)
        if consumed == 0:
            return [], 0
        new_text = new[:consumed].decode("utf-8")
        tail = _skip_partial_head(tail)
        tail = tail[: complete_utf8_prefix(tail)]
        if tail:
            ids = self.encode(tail.decode("utf-8") + new_text)
            # Walk the encoded tokens' bytes to the exact end of the tail; a normaliser that adds
            # a leading space shows up as extra bytes in front.
            extra = len(self.bytes_of(ids)) - len(tail) - consumed
            boundary = len(tail) + max(extra, 0)
            offset = 0
            for k, tok in enumerate(ids):
                if offset == boundary:
                    return ids[k:], consumed
                if offset > boundary:
                    break
                offset += len(self.table[tok])
        return self.encode(new_text), consumed

    def resync(self, *, tail_ids: Sequence[int], new: bytes) -> tuple[int, list[int]]:
        """Continue ``tail_ids`` with the text ``new`` as this tokenizer encodes the whole:
        ``(drop, ids)``, drop the last ``drop`` tail tokens, then append ``ids``.

        Why: where the tokenizer merges text across the boundary, ``continuation`` encodes
        the new text on its own, leaving a split the tokenizer never makes and its model
        rarely saw. A prompt ending in a newline followed by indented code is the common case:
        SmolLM2 spells ``\n`` then ``    return`` as ``\n···`` + ``·return``; fed ``\n``,
        ``····``, the assistant drafted a new top-level line, and the first round's first draft
        was accepted 7 % of the time on 120 training prompts. Here the last tail tokens from the latest point
        where both encodings have a token boundary are encoded again with the new text. Only
        for a side whose cache can be rolled back (the assistant's: the target's ids are its
        output); a tail that is not whole UTF-8, or an encoding that does not give back exactly
        its text, goes through ``continuation``.
        """
        consumed = complete_utf8_prefix(new)
        if consumed == 0:
            return 0, []
        tail_bytes = [self.table[t] for t in tail_ids]
        tail = b"".join(tail_bytes)
        whole = tail + new[:consumed]
        if tail and complete_utf8_prefix(tail) == len(tail) and (tail[0] & 0xC0) != 0x80:
            ids = self.encode(whole.decode("utf-8"))
            if self.bytes_of(ids) == whole:
                kept_at = {0: 0}  # a tail boundary (bytes) -> tail tokens before it (the most)
                end = 0
                for i, piece in enumerate(tail_bytes, start=1):
                    end += len(piece)
                    kept_at[end] = i
                # (index into ids, tail tokens kept) at the latest boundary both encodings share
                offset, best = 0, None
                for k, tok in enumerate(ids):
                    if offset > len(tail):
                        break
                    if offset in kept_at:
                        best = (k, kept_at[offset])
                    offset += len(self.table[tok])
                if best is not None:
                    k, kept = best
                    return len(tail_bytes) - kept, ids[k:]
        ids, _ = self.continuation(tail=tail, new=new)
        return 0, ids

    def _check(self) -> None:
        """Refuse tokenizers whose tokens' bytes do not concatenate back to the text."""
        ids = self.encode(_PROBE)
        got = self.bytes_of(ids)
        if got != _PROBE.encode("utf-8") and got != b" " + _PROBE.encode("utf-8"):
            name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
            raise UagError(
                f"tokenizer {name!r} is not supported by the byte bridge (its tokens' bytes do "
                "not concatenate back to the encoded text; it may normalise text)"
            )


@dataclass
class Bridge:
    """The two sides of a model pair, as seen by the speculative loop."""

    target: TokenText
    assistant: TokenText
    lookbehind: int = LOOKBEHIND_TOKENS

    @classmethod
    def for_tokenizers(
        cls, *, target: Any, assistant: Any, target_vocab: int, assistant_vocab: int
    ) -> Bridge:
        return cls(
            target=TokenText(target, target_vocab), assistant=TokenText(assistant, assistant_vocab)
        )

    @functools.cached_property
    def shared_vocabulary(self) -> bool:
        """Both sides spell every id the same: the target's own ids are the assistant's best
        context, so the assistant is not re-encoded across boundaries nor healed
        (``TokenText.resync``, ``uag.decoding.assistant_text``)."""
        return self.target.table == self.assistant.table

    def tail(self, side: TokenText, ids: Sequence[int]) -> bytes:
        """Bytes of the last ``lookbehind`` tokens of ``ids`` (the re-encoding context)."""
        return side.bytes_of(ids[-self.lookbehind :])
