"""Where uag keeps what it builds once: converted checkpoints, prepared models, tokenizers,
compiled kernels and calibrations, all under one cache directory. Ground floor: imports nothing
of uag, so every floor (the kernels' build included) can ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted GGUF checkpoints live (``$UAG_CACHE`` or ``~/.cache/uag``)."""
    return Path(os.environ.get("UAG_CACHE", Path.home() / ".cache" / "uag")).expanduser()
