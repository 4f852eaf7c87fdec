"""Shared fixtures: real tokenizers and models come from the embedded GGUF packages.

The first run converts the GGUF files into ``$UAG_CACHE`` (about 90 s on 2 cores); every later
load in the same run, or in later runs with the same cache, takes seconds.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each (and in the commands they start). Two threads
    # per worker spin-wait for a core the other worker holds: tiny-model tests ran 3-6x slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(torch.get_num_threads(), 1))


@pytest.fixture(scope="session")
def tokenizers():
    """(target, assistant) real tokenizers: Gemma 3 (SentencePiece) and SmolLM2 (byte-level BPE)."""
    from transformers import AutoTokenizer

    from uag.runtime.models import convert_gguf

    names = ["gemma-3-270m", "smollm2-135m"]
    # Under pytest-xdist the second worker, which meets these tests first (see below), converts
    # the longer one (Gemma, ~50 s) and the first worker the other (~27 s) when it gets here:
    # on an empty cache the two conversions run side by side.
    for name in names[::-1] if os.environ.get("PYTEST_XDIST_WORKER") == "gw0" else names:
        convert_gguf(name)
    return tuple(AutoTokenizer.from_pretrained(str(convert_gguf(name))) for name in names)


@pytest.fixture(scope="session")
def real_pair():
    """The embedded default pair, loaded once per test session."""
    import uag

    return uag.load_pair()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizers):
    """Tiny target/assistant checkpoints on disk, so CLI commands can load them by path."""
    from tests.tiny import tiny_gemma, tiny_llama

    root = tmp_path_factory.mktemp("tiny-models")
    gemma_tok, smol_tok = tokenizers
    dirs = []
    for name, model, tok in (
        ("target", tiny_gemma(len(gemma_tok)), gemma_tok),
        ("assistant", tiny_llama(len(smol_tok)), smol_tok),
    ):
        path = root / name
        model.save_pretrained(path)
        tok.save_pretrained(path)
        dirs.append(str(path))
    return tuple(dirs)


@pytest.fixture(scope="module")
def cross(tokenizers):
    """Tiny Gemma target ← tiny Llama assistant (``tests.tiny.cross_pair``), one per module."""
    from tests.tiny import cross_pair

    return cross_pair(tokenizers)


@pytest.fixture(scope="module")
def similar(tokenizers):
    """Tiny Gemma target ← a noisy copy of itself (``tests.tiny.same_tokenizer_pair``)."""
    from tests.tiny import same_tokenizer_pair

    return same_tokenizer_pair(tokenizers, noise=0.05)


MODEL_FIXTURES = frozenset({"tokenizers", "real_pair", "tiny_dirs", "cross", "similar"})
"""Fixtures that need the embedded GGUFs converted (~1 min on an empty cache)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that need no converted model first, the rest after (each group in its own order).
    pytest-xdist hands each worker a contiguous half at the start: the second worker then
    converts the models straight away while the first runs tests that need none, instead of
    both waiting on the conversion at once. The same order in every process (xdist checks)."""
    items.sort(
        key=lambda item: (
            bool(MODEL_FIXTURES & set(getattr(item, "fixturenames", ())))
            or item.get_closest_marker("real") is not None
        )
    )
