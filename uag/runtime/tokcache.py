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


def _key(source: Path) -> str | None:
    """A key for the tokenizer in directory ``source``, or None when it has no tokenizer.json."""
    # Transformers takes seconds to import and the CLI imports this module (through
    # uag.runtime.models) at start-up: only loading a tokenizer pays.
    import tokenizers
    import transformers

    if not (source / "tokenizer.json").is_file():
        return None
    digest = hashlib.sha256()
    digest.update(f"{FORMAT}|{transformers.__version__}|{tokenizers.__version__}|".encode())
    for name in _FILES:
        path = source / name
        if path.is_file():
            stat = path.stat()
            digest.update(f"|{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def load_tokenizer(source: str) -> Any:
    """``AutoTokenizer.from_pretrained(source)``, from the cache when ``source`` is a checkpoint
    inside ``$UAG_CACHE`` seen before (its byte table then attached as ``TABLE_ATTR``)."""
    # Transformers: deferred, as in _key.
    from transformers import AutoTokenizer

    directory = Path(source).resolve()
    key = _key(directory) if directory.is_dir() else None
    if key is None or os.environ.get("UAG_TOKENIZER_CACHE", "1") == "0":
        return AutoTokenizer.from_pretrained(source)
    memo = f"{directory}\0{key}"
    if memo not in _LOADED:
        _LOADED[memo] = _load(source, directory, key, cache_root())
    return _LOADED[memo]


def _load(source: str, directory: Path, key: str, root: Path) -> Any:
    """The tokenizer of ``directory``: from its pickle when inside ``root`` and seen before."""
    # Transformers: deferred, as in _key.
    from transformers import AutoTokenizer

    if not directory.is_relative_to(root.resolve()):
        return AutoTokenizer.from_pretrained(source)  # never written to: not uag's directory
    path = directory / f"uag-tokenizer-{key}.pkl"
    if path.is_file():
        try:
            with path.open("rb") as f:
                return pickle.load(f)
        except Exception:  # a damaged or foreign entry: rebuild it below  # noqa: BLE001
            path.unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    setattr(tokenizer, TABLE_ATTR, token_bytes_table(tokenizer, len(tokenizer)))
    for stale in directory.glob("uag-tokenizer-*.pkl"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)  # atomic: concurrent starts (torchrun ranks) never read half
    except OSError:
        Path(tmp).unlink(missing_ok=True)  # a read-only cache: run without it
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
