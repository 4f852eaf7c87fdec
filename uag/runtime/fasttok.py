"""A tokenizer on the ``tokenizers`` library's own object: what uag uses of one, without
Transformers' tokenizer classes.

Why: a one-token ``uag generate`` spent 2.7 s of its 6.2 s importing Transformers (~1.2 s, its
tokenizer classes pull in most of the package) and unpickling Transformers' Gemma tokenizer.
Transformers 5's tokenizer for a checkpoint with a ``tokenizer.json`` *is* the Rust object that
``tokenizers.Tokenizer.from_file`` builds from that file, plus a Python layer; the part of that
layer uag calls is small, and is reproduced here:

* ``tok(text, add_special_tokens=...)["input_ids"]``, ``decode(ids, skip_special_tokens=...)``,
  ``convert_ids_to_tokens``, ``convert_tokens_to_ids``, ``get_vocab``, ``len(tok)``,
  ``vocab_size``, ``added_tokens_decoder``, ``backend_tokenizer`` (the byte tables of
  ``uag.runtime.tokcache``);
* the named special tokens (``bos_token``, ``eos_token_id``, ``pad_token_id``...),
  ``special_tokens_map``, ``all_special_tokens`` / ``all_special_ids`` (sampling's
  ``special_ids``, the streamer's skipped ids, every model's stop tokens), read from
  ``tokenizer_config.json`` and ``special_tokens_map.json`` as Transformers reads them;
* ``chat_template`` (``chat_template.jinja``, else the config's string) and
  ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``, rendered with
  the same sandboxed jinja2 environment Transformers builds (trim_blocks, lstrip_blocks,
  loopcontrols, its ``tojson``, ``raise_exception``, ``strftime_now``) and the same variables.

``tests/test_fast_tokenizer.py`` checks it token for token against ``AutoTokenizer`` on both
embedded tokenizers (Gemma 3's SentencePiece-style BPE, SmolLM2's byte-level BPE).

``from_dir`` refuses (``NotRepresentable``, with the reason; ``uag.runtime.tokcache`` then loads
Transformers' ``AutoTokenizer``) exactly where Transformers' Python layer may do more than this
class, so that the result is never silently different:

* the directory has no ``tokenizer.json`` (slow-only / SentencePiece-only checkpoints; hub ids
  and other non-directories never reach this module);
* ``tokenizer_config.json`` names no ``tokenizer_class`` or one outside ``CHECKED_CLASSES``
  (other classes may rebuild parts of the pipeline at load, e.g. Llama's ``legacy`` and
  ``add_prefix_space``), or loads custom code (``auto_map``);
* the config holds a key outside ``KNOWN_KEYS`` (e.g. ``add_bos_token``, which makes
  Transformers rewrite the post-processor), sets ``clean_up_tokenization_spaces`` or
  ``split_special_tokens`` to anything but false, or declares model-specific named special
  tokens (``extra_special_tokens`` as a mapping);
* its ``added_tokens_decoder`` differs from ``tokenizer.json``'s added tokens, a special token
  is not one of ``tokenizer.json``'s added tokens, ``tokenizer.json`` has no post-processor
  (Transformers changes the Rust object in these three cases), or the config and
  ``special_tokens_map.json`` name different special tokens;
* the chat template is not one string (named templates, ``additional_chat_templates/``) or
  uses Transformers' ``{% generation %}`` tag.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

CHECKED_CLASSES = frozenset({"GemmaTokenizer", "TokenizersBackend", "PreTrainedTokenizerFast"})
"""``tokenizer_class`` values whose Transformers 5 tokenizer is ``tokenizer.json``'s object as is
(checked: its ``backend_tokenizer.to_str()`` equals the file's; ``PreTrainedTokenizerFast`` is
the same class as ``TokenizersBackend`` in Transformers 5)."""
SPECIAL_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""Transformers' ``SPECIAL_TOKENS_ATTRIBUTES``, in its order (``all_special_tokens`` follows it)."""
KNOWN_KEYS = frozenset(
    {
        *SPECIAL_ATTRIBUTES,
        "added_tokens_decoder",
        "additional_special_tokens",
        "backend",
        "chat_template",
        "clean_up_tokenization_spaces",
        "extra_special_tokens",
        "is_local",
        "local_files_only",
        "model_input_names",
        "model_max_length",
        "name_or_path",
        "padding_side",
        "split_special_tokens",
        "tokenizer_class",
        "truncation_side",
    }
)
"""``tokenizer_config.json`` keys that change nothing this class does (or are handled by it)."""
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class NotRepresentable(Exception):
    """This class cannot stand for the directory's Transformers tokenizer; the message says why."""


class FastTokenizer:
    """What uag uses of a Transformers tokenizer, on ``tokenizers.Tokenizer`` (see the module
    doc). Built by ``from_dir``; never modified after."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        name_or_path: str,
        special: Mapping[str, str],
        extra_special: Sequence[str] = (),
        chat_template: str | None = None,
    ) -> None:
        # Transformers turns truncation and padding off for a plain call (its
        # ``set_truncation_and_padding`` with DO_NOT_TRUNCATE / DO_NOT_PAD), whatever the file says.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.name_or_path = name_or_path
        self.special_tokens_map = {k: special[k] for k in SPECIAL_ATTRIBUTES if k in special}
        self._extra_special = list(extra_special)
        self.chat_template = chat_template
        self._added: dict[int, AddedToken] | None = None

    @classmethod
    def from_dir(cls, directory: str | Path, *, backend_file: Path | None = None) -> FastTokenizer:
        """The tokenizer of a local checkpoint directory, or ``NotRepresentable`` (see the module
        doc for exactly when). ``backend_file``: a file that holds the same Rust object as the
        directory's ``tokenizer.json`` in a form quicker to read (``compact_tokenizer_json``)."""
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise NotRepresentable(f"{root} has no tokenizer.json")
        config = _read_json(root / "tokenizer_config.json")
        _check_config(config)
        special = _named_special(config)
        for key, value in _named_special(_read_json(root / "special_tokens_map.json")).items():
            if special.setdefault(key, value) != value:
                raise NotRepresentable(
                    f"tokenizer_config.json and special_tokens_map.json disagree on {key}"
                )
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if not isinstance(extra, list):
            raise NotRepresentable("extra_special_tokens is not a list (model-specific tokens)")
        backend = Tokenizer.from_file(str(backend_file or root / "tokenizer.json"))
        tok = cls(
            backend,
            name_or_path=str(directory),
            special=special,
            extra_special=[_content(t) for t in extra],
            chat_template=_chat_template(root, config),
        )
        tok._check_tokens(config.get("added_tokens_decoder") or {})
        return tok

    def _check_tokens(self, declared: Mapping[str, Any]) -> None:
        """Refuse where Transformers changes the Rust object at load: added tokens the config
        declares that ``tokenizer.json`` lacks or flags otherwise, special tokens that are not
        added tokens there (Transformers adds them), no post-processor (it writes one)."""
        found = self.added_tokens_decoder
        for index, entry in declared.items():
            have = found.get(int(index))
            if not isinstance(entry, dict) or have is None or _flags(have) != _flags_of(entry):
                raise NotRepresentable(
                    f"added token {index} in tokenizer_config.json differs from tokenizer.json"
                )
        added = {t.content for t in found.values()}
        for token in self.all_special_tokens:
            if token not in added:
                raise NotRepresentable(f"special token {token!r} is not an added token")
        if self._backend.post_processor is None:  # Transformers would write one
            raise NotRepresentable("tokenizer.json has no post-processor")

    # Encoding and decoding: the Rust object's, as Transformers calls it.

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": ..., "attention_mask": ...}`` of one text, as ``tokenizer(text)``."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"FastTokenizer encodes one str, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        """One id's token string (None past the vocabulary), or a list of them."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """One token's id (the unknown token's where absent), or a list of them."""
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        vocab: dict[str, int] = self._backend.get_vocab(with_added_tokens=True)
        return vocab

    def __len__(self) -> int:
        """The vocabulary with the added tokens (Transformers' ``len(tokenizer)``)."""
        size: int = self._backend.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def vocab_size(self) -> int:
        """The vocabulary without the added tokens (Transformers' ``vocab_size``)."""
        size: int = self._backend.get_vocab_size(with_added_tokens=False)
        return size

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        if self._added is None:
            self._added = dict(self._backend.get_added_tokens_decoder())
        return self._added

    # Special tokens.

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens in Transformers' order, then the extra ones, each once."""
        seen: dict[str, None] = {}
        for token in [*self.special_tokens_map.values(), *self._extra_special]:
            seen.setdefault(token, None)
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        ids: list[int] = self.convert_tokens_to_ids(self.all_special_tokens)
        return ids

    def _id(self, attribute: str) -> int | None:
        token = self.special_tokens_map.get(attribute)
        found: int | None = None if token is None else self._backend.token_to_id(token)
        return found

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    # The chat template.

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool,
        add_generation_prompt: bool = False,
        **variables: Any,
    ) -> str:
        """The conversation rendered with the chat template, as Transformers renders it (text
        only: ``tokenize`` must be False, and is required because Transformers' default is
        True). ``variables`` reach the template beside the special tokens, as there."""
        if tokenize:
            raise ValueError("FastTokenizer renders text only: pass tokenize=False, then encode")
        if not self.chat_template:
            raise ValueError(f"{self.name_or_path} has no chat template")
        # Transformers drops the keys whose value is None (templates handle a missing key).
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        rendered: str = _compile(self.chat_template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **variables},
        )
        return rendered

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, len={len(self)})"


COMPACT_FORMAT = 2
"""Bumped whenever ``compact_tokenizer_json`` writes another text (it keys the cached copy)."""


def compact_tokenizer_json(path: Path) -> str:
    """``tokenizer.json`` at ``path`` as the text that builds the very same Rust object fastest:
    no indentation, BPE merges as ``"a b"`` strings (the older form ``tokenizers`` still
    reads) where no merged token holds a space, and the vocabulary's entries in key order.
    Gemma 3's 515k merges then read in ~0.95 s instead of ~1.3 s; the sorted vocabulary takes
    another ~20 % off (0.80 → 0.64 s of CPU): ``tokenizers`` parses the model into a
    ``serde_json`` map, a B-tree, before building its hash map, and 262k keys inserted in order
    keep that tree's path in cache. The vocabulary is a hash map once built, so its order in the
    text changes nothing. Checked here: the text's tokenizer serialises exactly as the file's
    (``to_str``, which writes the vocabulary by id); where it would not, the file's own text is
    returned."""
    original = path.read_text(encoding="utf-8")
    data = json.loads(original)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        model["vocab"] = dict(sorted(vocab.items()))  # code point order: UTF-8's byte order
    merges = model.get("merges")
    if (
        model.get("type") == "BPE"
        and isinstance(merges, list)
        and all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges)
    ):
        model["merges"] = [f"{a} {b}" for a, b in merges]
    compact = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    same = Tokenizer.from_str(compact).to_str() == Tokenizer.from_str(original).to_str()
    return compact if same else original


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    found = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(found, dict):
        raise NotRepresentable(f"{path.name} is not a JSON object")
    return found


def _check_config(config: Mapping[str, Any]) -> None:
    name = config.get("tokenizer_class")
    if name not in CHECKED_CLASSES:
        raise NotRepresentable(f"tokenizer_class {name!r} is not one checked to be tokenizer.json")
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise NotRepresentable(f"tokenizer_config.json sets {', '.join(unknown)}")
    for flag in ("clean_up_tokenization_spaces", "split_special_tokens"):
        if config.get(flag, False) is not False:
            raise NotRepresentable(f"tokenizer_config.json sets {flag}")


def _content(value: Any) -> str:
    """A token as the config writes it: a string or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise NotRepresentable(f"a special token written as {value!r}")


def _named_special(config: Mapping[str, Any]) -> dict[str, str]:
    return {k: _content(config[k]) for k in SPECIAL_ATTRIBUTES if config.get(k) is not None}


def _flags(token: AddedToken) -> tuple[object, ...]:
    return (
        token.content,
        token.special,
        token.lstrip,
        token.rstrip,
        token.normalized,
        token.single_word,
    )


def _flags_of(entry: Mapping[str, Any]) -> tuple[object, ...]:
    return (
        entry.get("content"),
        entry.get("special", False),
        entry.get("lstrip", False),
        entry.get("rstrip", False),
        entry.get("normalized", not entry.get("special", False)),
        entry.get("single_word", False),
    )


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    if (root / "additional_chat_templates").is_dir():
        raise NotRepresentable("named chat templates (additional_chat_templates/)")
    jinja = root / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise NotRepresentable("named chat templates (a list in tokenizer_config.json)")
    if template is not None and _GENERATION_TAG.search(template):
        raise NotRepresentable("a chat template with Transformers' {% generation %} tag")
    return template


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template in Transformers' environment (``chat_template_utils._compile_jinja_template``
    in Transformers 5: the same options, filters and globals; its ``{% generation %}`` tag is
    refused at load instead)."""
    # jinja2: imported here, only --chat pays for it.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Transformers' own: jinja's escapes HTML characters.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
