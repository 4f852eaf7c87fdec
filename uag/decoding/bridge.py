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

A tokenizer that normalises text before splitting it (Qwen2's NFC, NFKC elsewhere) spells the
*normalised* text: ``"cafe\u0301"`` encodes to the bytes of ``"café"``. The bridge reads the
normaliser from the tokenizer (``Normaliser``) and takes it into account on each side:

* the target's side (candidates) encodes drafted text the target's way, normalised: a candidate
  is a guess the target verifies against its own ids, so losslessness never depends on it;
* the assistant's side must spell the target's accepted text exactly (its byte offsets track
  the target's), so text the normaliser would change goes in as the assistant's single-byte
  tokens (``spell``) where its vocabulary has them.

Only Unicode normal forms (and the space markers SentencePiece-style tokenizers write, which the
byte table undoes) can be bridged this way; a normaliser that lowercases or strips text is
refused with its name, because no encoding of the drafted text spells it.

This module knows nothing of models.
"""

from __future__ import annotations

import functools
import json
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from uag.errors import UagError
from uag.runtime.tokcache import token_bytes_table

LOOKBEHIND_TOKENS = 10
"""Tokens of context re-encoded with new text so token boundaries line up (Transformers uses 10)."""

# A probe string covering what breaks bridges: code indentation, CRLF, tabs, runs of spaces,
# digits, accents (precomposed and combining), emoji, CJK, Hangul jamo, compatibility characters.
_PROBE = (
    "def f(x):\r\n\tif x:\n        return 12345678901234 + x  # café cafe\u0301 😀 你好世界 ÅΩ "
    "\u1100\u1161\u11a8 한국어 \ufb01 \u2460 \uff21"
)
UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
SPACE_MARKERS = ("Replace", "Prepend")
"""Normaliser steps that only write spaces as a marker (SentencePiece's ``▁``): the byte table
turns the marker back into a space, which the probe checks."""


@dataclass(frozen=True)
class Normaliser:
    """What a tokenizer does to text before it splits it, as far as the bridge needs: the Unicode
    normal forms it applies, in order (none: it spells text as given)."""

    forms: tuple[str, ...] = ()
    others: tuple[str, ...] = ()
    """Its other steps' types, besides space markers (``Lowercase``, ``Strip``...)."""

    @classmethod
    def of(cls, tokenizer: Any) -> Normaliser:
        """Read from the tokenizer's ``tokenizers`` pipeline (a tokenizer without one is taken
        to spell text as given; the probe in ``TokenText`` checks that)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        spec = json.loads(backend.to_str()).get("normalizer") if backend is not None else None
        forms: list[str] = []
        others: list[str] = []
        for step in _steps(spec):
            kind = str(step.get("type"))
            if kind in UNICODE_FORMS:
                forms.append(kind)
            elif kind not in SPACE_MARKERS:
                others.append(kind)
        return cls(tuple(forms), tuple(others))

    def __call__(self, text: str) -> str:
        for form in self.forms:
            text = unicodedata.normalize(form, text)  # type: ignore[arg-type]
        return text

    def __str__(self) -> str:
        return "+".join((*self.forms, *self.others)) or "none"


def _steps(spec: Any) -> list[dict[str, Any]]:
    """A normaliser's steps, a ``Sequence`` flattened."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get("normalizers", []) for step in _steps(inner)]
    return [spec]


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
        self.normalise = Normaliser.of(self.tokenizer)
        self._byte_ids = _single_byte_ids(self.table)
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

    def spell(self, text: bytes) -> list[int] | None:
        """Ids spelling exactly ``text``, one single-byte token a byte (None: this vocabulary
        lacks one of them). For text a normaliser would change."""
        if self._byte_ids is None:
            return None
        ids = [self._byte_ids[b] for b in text]
        return None if min(ids, default=0) < 0 else ids

    def continuation(
        self, *, tail: bytes, new: bytes, exact: bool = False
    ) -> tuple[list[int], int]:
        """Ids that continue a sequence ending in ``tail`` with the text ``new``, as this
        tokenizer spells it (normalised: ``Normaliser``); ``exact``: spelling ``new`` byte for
        byte, single-byte tokens standing in where the normaliser would change it.

        Returns ``(ids, consumed)``: only the longest complete-UTF-8 prefix of ``new`` is encoded
        (``consumed`` bytes of it); a trailing partial character waits for its other bytes.
        """
        consumed = complete_utf8_prefix(new)
        if consumed == 0:
            return [], 0
        ids = self._after(tail=tail, new_text=new[:consumed].decode("utf-8"))
        if exact and self.bytes_of(ids) != new[:consumed]:
            ids = self.spell(new[:consumed]) or ids
        return ids, consumed

    def _after(self, *, tail: bytes, new_text: str) -> list[int]:
        """``continuation``'s ids: the tail and the new text encoded together and cut at the
        tail's end where the tokenization has a boundary there, else the new text alone."""
        tail = _skip_partial_head(tail)
        tail = tail[: complete_utf8_prefix(tail)]
        if tail:
            head = self.normalise(tail.decode("utf-8"))
            whole = self.normalise(tail.decode("utf-8") + new_text)
            if whole.startswith(head):  # else the new text recomposes the tail's last letter
                ids = self.encode(whole)
                # Walk the encoded tokens' bytes to the exact end of the tail; a normaliser
                # that adds a leading space shows up as extra bytes in front.
                extra = len(self.bytes_of(ids)) - len(whole.encode("utf-8"))
                boundary = len(head.encode("utf-8")) + max(extra, 0)
                offset = 0
                for k, tok in enumerate(ids):
                    if offset == boundary:
                        return ids[k:]
                    if offset > boundary:
                        break
                    offset += len(self.table[tok])
        return self.encode(new_text)

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
        ids, _ = self.continuation(tail=tail, new=new, exact=True)
        return 0, ids

    def _check(self) -> None:
        """Refuse tokenizers whose tokens' bytes do not concatenate back to the text they
        encode, normalised as their normaliser says (``Normaliser``)."""
        expected = self.normalise(_PROBE).encode("utf-8")
        got = self.bytes_of(self.encode(_PROBE))
        if got in (expected, b" " + expected):
            return
        name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
        if self.normalise.others:
            raise UagError(
                f"tokenizer {name!r} is not supported by the byte bridge: its normaliser "
                f"({self.normalise}) changes text beyond Unicode normal forms, so no encoding "
                "spells the text another tokenizer drafts"
            )
        raise UagError(
            f"tokenizer {name!r} is not supported by the byte bridge: its tokens' bytes do not "
            f"concatenate back to the text it encodes (normaliser: {self.normalise})"
        )


def _single_byte_ids(table: list[bytes]) -> list[int] | None:
    """Byte value → an id spelling that one byte (-1: none); None when no id spells one byte."""
    ids = [-1] * 256
    for i, piece in enumerate(table):
        if len(piece) == 1 and ids[piece[0]] < 0:
            ids[piece[0]] = i
    return ids if max(ids) >= 0 else None


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
