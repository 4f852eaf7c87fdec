"""Cold start: with prepared models, ``uag generate`` runs without importing Transformers (its
import and tokenizer classes were 2.7 s of a 6.2 s one-token start), and the cold-start
harness builds each checkout's cache from links to the converted models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.coldstart import build_cache
from tests.tiny import gguf_like_gemma, q8_0_like, tiny_llama
from uag.kernels.native import native_unavailable
from uag.paths import cache_root
from uag.runtime import tokcache
from uag.runtime.fasttok import FastTokenizer
from uag.runtime.models import convert_gguf

HEAVY = ("transformers", "jinja2", "onnxruntime", "scipy", "datasets", "pandas")
"""Packages the first token of a greedy, non-chat generate with a rule policy never needs."""
PROBE = f"""
import json, sys
from uag.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""


def _checkpoint(directory: Path, model) -> str:
    """``model`` saved with SmolLM2's tokenizer files (copied: the converted model's own)."""
    model.save_pretrained(directory)
    smol = convert_gguf("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol / name, directory / name)
    return str(directory)


@pytest.mark.skipif(native_unavailable() is not None, reason="native kernel unavailable")
def test_generate_from_prepared_models_imports_no_transformers(tmp_path, monkeypatch):
    """Two tiny checkpoints inside a fresh cache (a Gemma target whose weights lie on GGUF's
    Q8_0 grid, as a prepared target's head needs, and a Llama assistant; SmolLM2's tokenizer),
    prepared by a first one-token generate; a second one loads the prepared files and the
    FastTokenizer, and ``sys.modules`` holds none of ``HEAVY`` at its end."""
    cache = build_cache(tmp_path / "cache", source=cache_root())  # compiled kernels linked in
    monkeypatch.setenv("UAG_CACHE", str(cache))
    monkeypatch.setattr(tokcache, "_LOADED", {})
    vocab = len(FastTokenizer.from_dir(convert_gguf("smollm2-135m")))
    target = gguf_like_gemma(vocab)
    with torch.no_grad():
        embed = target.model.embed_tokens.weight  # tied: the head's exact blocks too
        gen = torch.Generator().manual_seed(0)
        embed.copy_(q8_0_like(*embed.shape, steps=127, top=4e-3, generator=gen))
    refs = {
        "target": _checkpoint(cache / "target", target),
        "assistant": _checkpoint(cache / "assistant", tiny_llama(vocab)),
    }
    argv = [
        *("generate", "--target", refs["target"], "--assistant", refs["assistant"]),
        *("--no-assistant-int8", "--policy", "static+lookup", "--kernels", "native"),
        *("--prompt", "def f(x):", "--max-new-tokens", "1", "--json"),
    ]
    env = {**os.environ, "UAG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    # The first run prepares both models (Transformers loads them then). Prepared files are
    # keyed by uag's source, so on a checkout being edited a later run may prepare again:
    # the run judged is the first that did not.
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", PROBE, *argv],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        if "preparing" not in done.stderr:
            break
    assert "preparing" not in done.stderr, done.stderr
    assert list(cache.glob("*/uag-prepared-target-*.pt")), "the target was not prepared"
    lines = done.stdout.strip().splitlines()
    assert json.loads(lines[-2])["new_tokens"] == 1
    assert json.loads(lines[-1]) == {"code": 0, "heavy": []}


def test_each_builds_cache_links_the_converted_models_and_not_uags_files(tmp_path):
    source = tmp_path / "source"
    checkpoint = source / "models" / "m"
    checkpoint.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (checkpoint / name).write_text(name)
    (checkpoint / "uag-prepared-target-abc.pt").write_text("build-specific")
    (source / "models" / "partial").mkdir()  # a conversion under way: no config.json yet
    (source / "kernels").mkdir()
    (source / "kernels" / "skinny-1.so").write_text("so")
    built = build_cache(tmp_path / "old", source=source)
    again = build_cache(tmp_path / "old", source=source)  # idempotent
    assert again == built
    linked = sorted(p.name for p in (built / "models" / "m").iterdir())
    assert linked == ["config.json", "model.safetensors", "tokenizer.json"]
    assert all((built / "models" / "m" / n).is_symlink() for n in linked)
    assert (built / "models" / "m" / "config.json").read_text() == "config.json"
    assert not (built / "models" / "partial").exists()
    assert (built / "kernels" / "skinny-1.so").read_text() == "so"
