"""What a cold start skips or overlaps (issue 43 item 8): the kernels' self-test runs once per
library, CPU and code (keyed, re-run when any of them changes, never recorded when it fails);
the huge-page move copies the same bits by either copy path and leaves clean file pages in the
page cache; the command line freezes the garbage collector before its exit, a caller's
process does not."""

from __future__ import annotations

import gc
import json
import mmap
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from uag.kernels import hugepages, native

x86_avx2 = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64")
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the native kernels' checks run on x86-64 with AVX2 only",
)


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
    """``native._library`` over a fake build in ``tmp_path`` with a counting self-test; the
    real result is cached again afterwards."""
    library = tmp_path / "kernels" / "skinny-0123.so"
    library.parent.mkdir()
    library.write_bytes(b"one build")
    runs: list[str | None] = []
    verdict: dict[str, str | None] = {"problem": None}

    def self_test(lib):
        runs.append(verdict["problem"])
        return verdict["problem"]

    monkeypatch.delenv("UAG_KERNELS", raising=False)
    monkeypatch.setattr(native, "_build", lambda cache: library)
    monkeypatch.setattr(native, "_load", lambda path: SimpleNamespace(path=path))
    monkeypatch.setattr(native, "_self_test", self_test)
    native._library.cache_clear()

    def start() -> str | None:  # a new process: nothing cached in memory
        native._library.cache_clear()
        return native.native_unavailable()

    yield SimpleNamespace(library=library, runs=runs, verdict=verdict, start=start)
    native._library.cache_clear()


@x86_avx2
def test_self_test_runs_once_per_library_and_again_when_the_library_changes(fake_library):
    assert fake_library.start() is None and len(fake_library.runs) == 1
    assert fake_library.start() is None and len(fake_library.runs) == 1  # passed: recorded
    fake_library.library.write_bytes(b"another build")  # same name, other bytes
    assert fake_library.start() is None and len(fake_library.runs) == 2
    assert fake_library.start() is None and len(fake_library.runs) == 2


@x86_avx2
def test_self_test_runs_again_on_another_cpu_or_thread_count(fake_library, monkeypatch):
    assert fake_library.start() is None and len(fake_library.runs) == 1
    identity = native._cpu_identity()
    assert "flags=" in identity and "model name=" in identity
    monkeypatch.setattr(native, "_cpu_identity", lambda: identity.replace("flags=", "flags=vnni "))
    assert fake_library.start() is None and len(fake_library.runs) == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert fake_library.start() is None and len(fake_library.runs) == 3
    finally:
        torch.set_num_threads(threads)


@x86_avx2
def test_a_failed_self_test_is_never_recorded(fake_library):
    fake_library.verdict["problem"] = "the native kernel disagrees with F.linear here"
    for runs in (1, 2):  # refused every time, tested every time
        assert fake_library.start() == "the native kernel disagrees with F.linear here"
        assert len(fake_library.runs) == runs
    assert not list(fake_library.library.parent.glob("*.ok"))
    fake_library.verdict["problem"] = None
    assert fake_library.start() is None and len(fake_library.runs) == 3


def _mapping(address: int) -> tuple[int, int, bool]:
    found = [m for m in hugepages._file_mappings() if m[0] <= address < m[1]]
    assert len(found) == 1
    return found[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_a_file_mapping_is_clean_until_a_page_of_it_is_written(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with path.open("rb") as file:
        view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # private, as torch's mmap
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert view[5] == 5 and _mapping(address)[2]  # read only: every page still the file's
    view[5] = 7  # copy on write: this page is the process's own now
    assert not _mapping(address)[2]
    view.close()


@pytest.fixture(params=["one call", "memmove"])
def copy_path(request, monkeypatch):
    if request.param == "memmove":  # as where process_vm_readv is missing or refused
        monkeypatch.setattr(hugepages, "_process_vm_readv", lambda: None)
    elif hugepages._process_vm_readv() is None:
        pytest.skip("no process_vm_readv here")
    return request.param


@pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages")
def test_move_of_mapped_weights_keeps_every_bit_and_the_file_pages(tmp_path, copy_path):
    """Weights memory-mapped from a file, as a prepared model's are: the copies hold the same
    bits, by either copy path; the originals (dropped from the process) still read the file's
    values."""
    values = torch.randn(3, 700_000)
    path = tmp_path / "weights.pt"
    torch.save({"a": values[0].clone(), "b": values[1:].clone()}, path)
    with path.open("rb") as written:
        os.fsync(written.fileno())  # clean pages, as a prepared file's are on a later start
    mapped = torch.load(path, mmap=True)
    owner = SimpleNamespace(a=mapped["a"], b=mapped["b"])
    originals = (owner.a, owner.b)
    assert hugepages.move([(owner, "a"), (owner, "b")]) >= values.numel() * 4
    assert torch.equal(owner.a, values[0]) and torch.equal(owner.b, values[1:])
    assert owner.a.data_ptr() != originals[0].data_ptr()
    assert _cached_fraction(path) > 0.9  # the next start finds them in memory, not on disk
    assert torch.equal(originals[0], values[0]) and torch.equal(originals[1], values[1:])


def _cached_fraction(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` over a fresh mapping)."""
    import ctypes

    import numpy as np

    size, pages = path.stat().st_size, -(-path.stat().st_size // mmap.PAGESIZE)
    status = (ctypes.c_ubyte * pages)()
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        array = np.frombuffer(view, dtype=np.uint8)  # for its address; nothing is read
        failed = ctypes.CDLL(None).mincore(
            ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(size), status
        )
        del array
    if failed:
        pytest.skip("mincore is refused here")
    return sum(byte & 1 for byte in status) / pages


def test_only_the_command_line_freezes_the_collector_at_exit():
    from uag.cli import main

    before = gc.get_freeze_count()
    assert main([]) == 2  # a caller's process (argv given): prints the help, collects as usual
    assert gc.get_freeze_count() == before
    probe = "import gc, sys\nfrom uag.cli import main\nsys.argv = ['uag']\ncode = main()\n"
    probe += "print(code, gc.get_freeze_count() > 0)\n"
    root = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.split()[-2:] == ["2", "True"]


def test_the_compact_json_lists_the_vocabulary_in_key_order_and_builds_the_same(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from uag.runtime.fasttok import compact_tokenizer_json

    vocab = {"b": 0, "a": 1, "é": 2, "ab": 3, "ba": 4, "z": 5}  # ids not in key order
    path = tmp_path / "tokenizer.json"
    Tokenizer(BPE(vocab=vocab, merges=[("a", "b"), ("b", "a")])).save(str(path))
    compact = compact_tokenizer_json(path)
    written = list(json.loads(compact)["model"]["vocab"])
    assert written == sorted(vocab) and written != list(vocab)
    assert Tokenizer.from_str(compact).to_str() == Tokenizer.from_file(str(path)).to_str()


def test_a_new_compact_format_gives_the_tokenizer_another_cache_key(tmp_path, monkeypatch):
    """An older compact copy is not read as the new one: the format is in the key."""
    from uag.runtime import fasttok, tokcache

    (tmp_path / "tokenizer.json").write_text("{}")
    key = tokcache._key(tmp_path, fast=True)
    monkeypatch.setattr(fasttok, "COMPACT_FORMAT", fasttok.COMPACT_FORMAT + 1)
    assert tokcache._key(tmp_path, fast=True) not in (None, key)


def test_the_cold_start_table_says_the_bounds_verdict_and_the_load():
    from scripts.coldstart import IMPORT_ARM, table

    times = {"old generate": [7.0, 8.0], "new generate": [4.1, 4.3], IMPORT_ARM: [2.0, 2.2]}
    verdict = table(times, load=(0.4, 1.7)).splitlines()[-1]
    assert "NOT met" in verdict and "load average 0.40 before, 1.70 after" in verdict
    times["new generate"] = [3.0, 3.2]
    assert ": met;" in table(times).splitlines()[-1]
    times["new generate"] = [4.1, 4.3]  # a larger target: only the 2x bound
    assert "(bounds: 2x): met;" in table(times, limit_s=None).splitlines()[-1]


def test_the_cold_start_of_a_larger_target_runs_it_alone():
    from scripts.coldstart import GENERATE, generate_command

    assert generate_command(None) == GENERATE
    command = generate_command("qwen2.5-coder-1.5b")
    assert command[: len(GENERATE)] == GENERATE
    assert command[len(GENERATE) :] == ("--target", "qwen2.5-coder-1.5b", "--policy", "target-only")
