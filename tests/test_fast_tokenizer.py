"""uag's FastTokenizer (``uag.runtime.fasttok``) against Transformers' AutoTokenizer on both
embedded tokenizers: the same ids, text, special tokens, byte table and chat template, on text
built to break tokenizers; and Transformers' own tokenizer, with the reason kept, wherever the
FastTokenizer cannot stand for it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.nasty import NASTY_PROMPTS
from uag.runtime import tokcache
from uag.runtime.fasttok import FastTokenizer, NotRepresentable
from uag.runtime.models import convert_gguf
from uag.runtime.tokcache import TABLE_ATTR, load_tokenizer, token_bytes_table

NAMES = ("gemma-3-270m", "smollm2-135m")
TEXTS = [
    *NASTY_PROMPTS.values(),
    "",
    " ",
    "  leading and trailing  ",
    "\n\n\n",
    "\r\n\r\n\tx\r",
    "    def f(x):\n        return x  # four, eight spaces\n\t\ttabs\n",
    "123456789012345678901234567890 0.000001 1e-300 -42 ７８９",
    "<bos><eos><pad><|im_start|><|im_end|><|endoftext|><start_of_turn><end_of_turn>",
    "<bos>text<eos> mid<|im_end|>word <start_of_turn>user\nhi<end_of_turn>\n",
    "<0x0A> <unk> ▁ Ġ Ċ â€™ literal pieces",
    "\x00\x01\x07\x1b[31m control \x7f\u200b\u200d\ufeff zero-width",
    "ﬁ ﬂ Ｆｕｌｌｗｉｄｔｈ ㈱ ½ ℌ normalisation bait",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \U0010fffd planes",
    "한국어 텍스트와 ไทย และ עברית",
]


@pytest.fixture(scope="module", params=NAMES)
def both(request):
    """(Transformers' tokenizer, the FastTokenizer) of one embedded model's directory; the
    former as uag loads it for Transformers (``fast=False``: AutoTokenizer's object, from
    tokcache's pickle when seen before, which is several seconds faster for Gemma)."""
    directory = convert_gguf(request.param)
    hf = load_tokenizer(str(directory), fast=False)
    assert type(hf).__module__.startswith("transformers.")
    fast = load_tokenizer(str(directory))  # as uag runs it: from the compact copy in the cache
    assert isinstance(fast, FastTokenizer)
    assert list(directory.glob("uag-fast-*.json"))
    return hf, fast


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_same_ids_for_every_text(both, add_special_tokens):
    hf, fast = both
    for text in TEXTS:
        want = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert fast(text, add_special_tokens=add_special_tokens)["input_ids"] == want, text
        assert fast.encode(text, add_special_tokens=add_special_tokens) == want, text


def test_the_same_text_for_every_decode(both):
    hf, fast = both
    rng = random.Random(0)
    specials = sorted(hf.all_special_ids)
    cases = [hf(text)["input_ids"] for text in TEXTS]
    # Random ids, special ids among them: byte-fallback pieces cut mid-character included.
    cases += [
        [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] + rng.sample(specials, 2)
        for _ in range(100)
    ]
    for ids in cases:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), ids


def test_the_same_vocabulary_tokens_and_special_tokens(both):
    hf, fast = both
    assert len(fast) == len(hf)
    assert fast.vocab_size == hf.vocab_size
    assert fast.get_vocab() == hf.get_vocab()
    ids = list(range(0, len(hf), 7)) + [len(hf) + 5]
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert fast.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert fast.convert_tokens_to_ids(["<eos>", "hello", "<|im_end|>"]) == (
        hf.convert_tokens_to_ids(["<eos>", "hello", "<|im_end|>"])
    )
    assert fast.special_tokens_map == hf.special_tokens_map
    assert fast.all_special_tokens == hf.all_special_tokens
    assert fast.all_special_ids == hf.all_special_ids
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(fast, name) == getattr(hf, name), name
        assert getattr(fast, f"{name}_id") == getattr(hf, f"{name}_id"), name
    want = {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}
    assert {i: (t.content, t.special) for i, t in fast.added_tokens_decoder.items()} == want


def test_the_same_byte_table(both):
    hf, fast = both
    fresh = FastTokenizer(fast.backend_tokenizer, name_or_path="x", special={})  # no cached table
    want = token_bytes_table(hf, len(hf) + 3)
    assert token_bytes_table(fresh, len(fast) + 3) == want
    assert token_bytes_table(fast, len(fast) + 3) == want  # the cached one


def test_the_compact_json_keeps_merges_with_a_space_as_pairs(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from uag.runtime.fasttok import compact_tokenizer_json

    vocab = {"a": 0, "b": 1, " ": 2, "a ": 3, "a b": 4, "ab": 5}
    for merges, as_strings in (([("a", " "), ("a ", "b")], False), ([("a", "b")], True)):
        path = tmp_path / "tokenizer.json"
        Tokenizer(BPE(vocab=vocab, merges=merges)).save(str(path))
        compact = compact_tokenizer_json(path)
        assert isinstance(json.loads(compact)["model"]["merges"][0], str) is as_strings
        assert Tokenizer.from_str(compact).to_str() == Tokenizer.from_file(str(path)).to_str()


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_same_chat_template_text(both, generation_prompt):
    hf, fast = both
    assert fast.chat_template == hf.chat_template
    conversations = [
        [{"role": "user", "content": text}] for text in list(NASTY_PROMPTS.values())[:12]
    ]
    conversations += [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  padded\r\n question  "},
            {"role": "assistant", "content": "<eos> an answer 😀"},
            {"role": "user", "content": "again", "name": None},
        ],
    ]
    for messages in conversations:
        got = fast.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        want = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert got == want, messages
        assert (
            fast(got, add_special_tokens=False)["input_ids"]
            == hf(want, add_special_tokens=False)["input_ids"]
        )


def test_a_chat_template_error_is_the_templates_own(both):
    _, fast = both
    with pytest.raises(ValueError, match="tokenize=False"):
        fast.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)
    broken = FastTokenizer(
        fast.backend_tokenizer,
        name_or_path=fast.name_or_path,
        special=fast.special_tokens_map,
        chat_template="{{ raise_exception('no system role') }}",
    )
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no system role"):
        broken.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_load_tokenizer_gives_the_fast_one_with_its_cached_byte_table(tmp_path, monkeypatch):
    """Inside the cache the byte table is written once and read back by the next process (a
    fresh memo stands for it); a second load in one process is the same object."""
    source = convert_gguf("smollm2-135m")
    copy = tmp_path / "models" / "smol"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("*.safetensors", "uag-*"))
    monkeypatch.setenv("UAG_CACHE", str(tmp_path))
    monkeypatch.setattr(tokcache, "_LOADED", {})
    first = load_tokenizer(str(copy))
    assert isinstance(first, FastTokenizer)
    assert load_tokenizer(str(copy)) is first
    written = list(copy.glob("uag-bytes-*.pkl"))
    assert len(written) == 1 and len(list(copy.glob("uag-fast-*.json"))) == 1
    monkeypatch.setattr(tokcache, "_LOADED", {})
    again = load_tokenizer(str(copy))
    assert again is not first
    assert getattr(again, TABLE_ATTR) == getattr(first, TABLE_ATTR)
    assert len(getattr(again, TABLE_ATTR)) == len(again)


def _edit(tmp_path: Path, name: str, change) -> Path:
    """A copy of SmolLM2's tokenizer files with ``change(directory, config)`` applied."""
    source = convert_gguf("smollm2-135m")
    copy = tmp_path / name
    copy.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / file, copy / file)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    change(copy, config)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


def _set(key, value):
    return lambda directory, config: config.__setitem__(key, value)


def _unadd_eos(directory: Path, config: dict) -> None:
    data = json.loads((directory / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|im_end|>"]
    (directory / "tokenizer.json").write_text(json.dumps(data))
    config.pop("added_tokens_decoder", None)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d, c: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
        (_set("tokenizer_class", "LlamaTokenizer"), "tokenizer_class 'LlamaTokenizer'"),
        (_set("add_bos_token", True), "sets add_bos_token"),
        (_set("clean_up_tokenization_spaces", True), "sets clean_up_tokenization_spaces"),
        (_set("extra_special_tokens", {"image_token": "<x>"}), "model-specific"),
        (_set("eos_token", "<|not-a-token|>"), "not an added token"),
        (_unadd_eos, "not an added token"),
        (
            lambda d, c: (d / "chat_template.jinja").write_text(
                "{% generation %}x{% endgeneration %}"
            ),
            "generation",
        ),
        (
            lambda d, c: (
                (d / "chat_template.jinja").unlink(),
                c.__setitem__("chat_template", [{"name": "default", "template": "x"}]),
            ),
            "named chat templates",
        ),
    ],
)
def test_what_it_cannot_represent_is_refused_with_the_reason(tmp_path, change, why):
    directory = _edit(tmp_path, "edited", change)
    with pytest.raises(NotRepresentable, match=why):
        FastTokenizer.from_dir(directory)


def test_a_refused_directory_loads_transformers_tokenizer_and_says_why(tmp_path):
    directory = _edit(tmp_path, "edited", _set("add_bos_token", True))
    loaded = load_tokenizer(str(directory))
    assert not isinstance(loaded, FastTokenizer)
    assert "add_bos_token" in tokcache.WHY_NOT_FAST[str(directory.resolve())]
