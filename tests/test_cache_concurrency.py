"""Two ``uag models prepare`` processes at once on an empty ``UAG_CACHE`` both succeed, and a
later ``uag generate`` runs from what they left (torchrun ranks and parallel CI jobs start so).

A tiny GGUF (``tests.tiny.write_tiny_gguf``) takes the real models' place: the same steps run
(native kernels compiled into the empty cache, the GGUF converted, the tokenizer cached, the
model prepared as target and as assistant), each written by both processes at once, in ~1 min
on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.tiny import write_tiny_gguf
from uag.kernels.native import native_unavailable


def _uag(*argv: str, env: dict[str, str], cwd) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "uag", *argv],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_prepares_at_once_on_an_empty_cache(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny-llama.gguf")
    cache = tmp_path / "cache"
    env = {**os.environ, "UAG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    # the roles a default generate loads: the target, and the int8 assistant (the CPU default)
    prepare = ["models", "prepare", str(gguf), "--as", "target", "--as", "assistant-int8"]
    both = [_uag(*prepare, env=env, cwd=tmp_path) for _ in range(2)]
    native = native_unavailable() is None
    for proc in both:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "converted at" in out, out
        if native:  # its Q8_0 weights have the exact forms a prepared model keeps
            assert "prepared as target" in out and "prepared as assistant" in out, out
    converted = [p for p in (cache / "models").iterdir() if p.is_dir()]
    assert [p.name.startswith("tiny-llama-") for p in converted] == [True], converted
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]  # no half-written file

    later = _uag(
        "generate",
        *("--target", str(gguf), "--assistant", str(gguf)),
        *("--prompt", "def f(x):", "--max-new-tokens", "4", "--json"),
        env=env,
        cwd=tmp_path,
    )
    out, err = later.communicate(timeout=300)
    assert later.returncode == 0, err[-3000:]
    assert "converting" not in err and "preparing" not in err  # what the two prepares wrote
    assert json.loads(out.strip().splitlines()[-1])["new_tokens"] >= 1
