"""Where uag keeps what it builds once: converted checkpoints, prepared models, tokenizers,
compiled kernels and calibrations, all under one cache directory. Ground floor: imports nothing
of uag, so every floor (the kernels' build included) can ask."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted GGUF checkpoints live (``$UAG_CACHE`` or ``~/.cache/uag``)."""
    return Path(os.environ.get("UAG_CACHE", Path.home() / ".cache" / "uag")).expanduser()


def unwritable(path: Path, *, directory: bool) -> str | None:
    """Why ``path`` cannot be written as a directory (``directory``) or a file, judged before
    any work starts (a run that fails at its last step wastes the run); None where it can, as
    far as looking beforehand tells."""
    if path.exists():
        if directory and not path.is_dir():
            return f"{path} is a file, not a directory"
        if not directory and path.is_dir():
            return f"{path} is a directory, not a file"
        return None
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{path} cannot be created: {parent} is a file"
            if not os.access(parent, os.W_OK):
                return f"{path} cannot be created: {parent} is not writable"
            return None
    return None


class locked:
    """An exclusive ``flock`` on ``path`` for the ``with`` block (released when the process
    dies, so a crash never leaves the cache locked): two processes that build the same cache entry
    at once take turns, and the second finds the first one's work."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
