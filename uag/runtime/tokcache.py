"""Tokenizers loaded once, then from a cache: the tokenizer with its byte table, pickled.

Why: building Gemma 3's tokenizer from its 33 MB ``tokenizer.json`` takes Transformers ~5.5 s
(Python parses the JSON, then converts it), and the bridge then decodes all 262,144 tokens into
bytes (~1.5 s), on every start of every command. Unpickling the finished tokenizer costs what
the Rust parser alone does (~2.5 s for Gemma, ~0.6 s for SmolLM2), and the byte table rides
along. Only checkpoints inside ``$UAG_CACHE`` are cached (the converted GGUF models: uag's own
files, so a pickle there is trusted as the code in ``site-packages`` is; a user's checkpoint
directory is never written to), as ``uag-tokenizer-<key>.pkl`` beside the tokenizer files. The
key covers every tokenizer file's size and modification time and the versions that shape the
objects, so an edited or re-converted tokenizer is rebuilt (and the stale entry removed). Set
``UAG_TOKENIZER_CACHE=0`` to bypass it.

Within one process every local checkpoint's tokenizer is also kept by the same key, so loading
the same pair again (the Python API, bench's stock copy, a test suite) reuses it: uag never
modifies a tokenizer, and one whose vocabulary changed no longer matches its byte table's
length, which ``token_bytes_table`` checks.

Where it can, ``load_tokenizer`` skips Transformers altogether: ``uag.runtime.fasttok``'s
``FastTokenizer`` stands for the Transformers tokenizer of a directory whose tokenizer it can
represent exactly (its module doc says when not), built from ``tokenizer.json`` by the
``tokenizers`` library (Gemma: ~1 s, no Transformers import); inside ``$UAG_CACHE`` from a
compact copy of ``tokenizer.json`` (``uag-fast-<key>.json``) and with its byte table kept as
``uag-bytes-<key>.pkl`` (the same trust rule and key, less Transformers' version). Code that
hands the tokenizer to Transformers (its ``generate``) loads with ``fast=False``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

from uag.paths import cache_root

_LOADED: dict[str, Any] = {}
"""This process's tokenizers by directory and key."""
TABLE_ATTR = "_uag_bytes_table"
"""Where a cached tokenizer carries its byte table (``token_bytes_table``)."""
FORMAT = 1
"""Bumped whenever what is pickled, or how the byte table is computed, changes."""
_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
)


def _key(source: Path, *, fast: bool = False) -> str | None:
    """A key for the tokenizer in directory ``source``, or None when it has no tokenizer.json;
    ``fast``: for the ``FastTokenizer``'s byte table (Transformers' version plays no part)."""
    import tokenizers

    if not (source / "tokenizer.json").is_file():
        return None
    if fast:
        from uag.runtime.fasttok import COMPACT_FORMAT

        shaped_by = f"fast|{tokenizers.__version__}|compact {COMPACT_FORMAT}"
    else:
        # Transformers takes seconds to import and the CLI imports this module (through
        # uag.runtime.models) at start-up: only loading its tokenizer pays.
        import transformers

        shaped_by = f"{transformers.__version__}|{tokenizers.__version__}"
    digest = hashlib.sha256()
    digest.update(f"{FORMAT}|{shaped_by}|".encode())
    for name in _FILES:
        path = source / name
        if path.is_file():
            stat = path.stat()
            digest.update(f"|{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


WHY_NOT_FAST: dict[str, str] = {}
"""Per directory this process loaded Transformers' tokenizer for although ``fast`` was asked:
why the ``FastTokenizer`` could not stand for it (``fasttok.NotRepresentable``)."""


def load_tokenizer(source: str, *, fast: bool = True) -> Any:
    """The tokenizer of ``source`` (a local directory or a hub id).

    ``fast`` (the default): uag's ``FastTokenizer`` where ``source`` is a local directory it
    can represent exactly (``uag.runtime.fasttok``; never with ``UAG_FAST_TOKENIZER=0``), with
    its byte table from the cache inside ``$UAG_CACHE``; otherwise, or with ``fast`` False
    (code that hands the tokenizer to Transformers), ``AutoTokenizer.from_pretrained(source)``,
    from the pickle cache when ``source`` is a checkpoint inside ``$UAG_CACHE`` seen before
    (its byte table then attached as ``TABLE_ATTR``)."""
    directory = Path(source).resolve()
    if fast and directory.is_dir() and os.environ.get("UAG_FAST_TOKENIZER", "1") != "0":
        from uag.runtime.fasttok import NotRepresentable

        try:
            return _load_fast(source, directory)
        except NotRepresentable as why:  # correct, only slower: Transformers' own
            WHY_NOT_FAST[str(directory)] = str(why)
    # Transformers: deferred, as in _key.
    from transformers import AutoTokenizer

    key = _key(directory) if directory.is_dir() else None
    if key is None or os.environ.get("UAG_TOKENIZER_CACHE", "1") == "0":
        return AutoTokenizer.from_pretrained(source)
    memo = f"{directory}\0{key}"
    if memo not in _LOADED:
        _LOADED[memo] = _load(source, directory, key, cache_root())
    return _LOADED[memo]


def _load_fast(source: str, directory: Path) -> Any:
    """``FastTokenizer.from_dir`` once per process and key. Inside ``$UAG_CACHE``, from
    ``uag-fast-<key>.json`` (``fasttok.compact_tokenizer_json``: the same object, read ~25 %
    quicker) and with its byte table from ``uag-bytes-<key>.pkl``, both written the first time
    (a stale key's removed)."""
    from uag.runtime.fasttok import FastTokenizer, compact_tokenizer_json

    if os.environ.get("UAG_TOKENIZER_CACHE", "1") == "0":
        return FastTokenizer.from_dir(source)
    key = _key(directory, fast=True)
    memo = f"fast\0{directory}\0{key}"
    if memo in _LOADED:
        return _LOADED[memo]
    if not directory.is_relative_to(cache_root().resolve()):
        _LOADED[memo] = FastTokenizer.from_dir(source)  # never written to: not uag's directory
        return _LOADED[memo]
    compact = directory / f"uag-fast-{key}.json"
    if not compact.is_file():
        FastTokenizer.from_dir(source)  # refuses (NotRepresentable) before any work
        _replace(directory, "uag-fast-*.json")
        _write_text(compact, compact_tokenizer_json(directory / "tokenizer.json"))
    tokenizer = FastTokenizer.from_dir(source, backend_file=compact if compact.is_file() else None)
    path = directory / f"uag-bytes-{key}.pkl"
    table = _read_pickle(path)
    if isinstance(table, list) and len(table) == len(tokenizer):
        setattr(tokenizer, TABLE_ATTR, table)
    else:
        token_bytes_table(tokenizer, len(tokenizer))  # kept on the tokenizer (TABLE_ATTR)
        _replace(directory, "uag-bytes-*.pkl")
        _write_pickle(path, getattr(tokenizer, TABLE_ATTR))
    _LOADED[memo] = tokenizer
    return tokenizer


def _replace(directory: Path, pattern: str) -> None:
    """Remove a stale key's entries before writing the new one's (a read-only cache: kept)."""
    for stale in directory.glob(pattern):
        with contextlib.suppress(OSError):
            stale.unlink()


def _write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # atomic, as _write_pickle
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _read_pickle(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            return pickle.load(f)
    except Exception:  # a damaged or foreign entry: rebuilt by the caller  # noqa: BLE001
        path.unlink(missing_ok=True)
        return None


def _write_pickle(path: Path, value: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)  # atomic: concurrent starts (torchrun ranks) never read half
    except OSError:
        Path(tmp).unlink(missing_ok=True)  # a read-only cache: run without it


def _load(source: str, directory: Path, key: str, root: Path) -> Any:
    """The tokenizer of ``directory``: from its pickle when inside ``root`` and seen before."""
    # Transformers: deferred, as in _key.
    from transformers import AutoTokenizer

    if not directory.is_relative_to(root.resolve()):
        return AutoTokenizer.from_pretrained(source)  # never written to: not uag's directory
    path = directory / f"uag-tokenizer-{key}.pkl"
    found = _read_pickle(path)
    if found is not None:
        return found
    tokenizer = AutoTokenizer.from_pretrained(source)
    setattr(tokenizer, TABLE_ATTR, token_bytes_table(tokenizer, len(tokenizer)))
    for stale in directory.glob("uag-tokenizer-*.pkl"):
        stale.unlink(missing_ok=True)
    _write_pickle(path, tokenizer)
    return tokenizer


# The bytes behind token ids: what the byte bridge (``uag.decoding.bridge``) compares across
# vocabularies, and what a cached tokenizer carries.

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte ↔ printable-character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def token_bytes_table(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """The bytes each token id stands for (special tokens: their literal text).

    Handles byte-level BPE (GPT-2, SmolLM2, Llama 3) and SentencePiece with byte fallback
    (Gemma, Llama 2). Ids past the tokenizer's vocabulary (padding rows of an embedding
    matrix) map to empty bytes. The table is kept on the tokenizer (``TABLE_ATTR``: pickled
    with converted models' tokenizers), and reused while the vocabulary's length is unchanged.
    """
    n = max(len(tokenizer), vocab_size)
    cached = getattr(tokenizer, TABLE_ATTR, None)
    if cached is not None and len(cached) == len(tokenizer):
        return [*cached, *(b"" for _ in range(n - len(cached)))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.decoder.__getstate__()) if backend and backend.decoder else {}
    byte_level = "ByteLevel" in json.dumps(decoder)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    unmap = {ch: b for b, ch in _bytes_to_unicode().items()}
    table: list[bytes] = []
    for i, piece in enumerate(pieces):
        if piece is None:
            table.append(b"")
        elif i in added:
            table.append(piece.encode("utf-8"))
        elif byte_level:
            try:
                table.append(bytes(unmap[ch] for ch in piece))
            except KeyError:
                table.append(piece.encode("utf-8"))
        else:
            m = _BYTE_FALLBACK.fullmatch(piece)
            table.append(bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode())
    with contextlib.suppress(AttributeError, TypeError):  # kept for the next bridge over it
        setattr(tokenizer, TABLE_ATTR, list(table))
    table.extend(b"" for _ in range(n - len(table)))
    return table
