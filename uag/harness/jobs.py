"""What every prompt-set job (``collect``, ``bench``, ``calibrate``) is configured with: prompts,
output and the model pair."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from uag.api import Pair, load_pair, resolve_assistant_int8
from uag.errors import UagError
from uag.paths import unwritable
from uag.runtime.models import DEFAULT_ASSISTANT, DEFAULT_TARGET


@dataclass
class RunConfig:
    """What every prompt-set job (collect, bench) needs: prompts, output, and the model pair."""

    prompts: str
    """Prompt source: humaneval[:train|:test], a set in data/prompts, a local file; join with +."""
    out: Path
    target: str = DEFAULT_TARGET
    assistant: str = DEFAULT_ASSISTANT
    text_column: str = "text"
    limit: int | None = None
    max_new_tokens: int = 128
    chat: bool = False
    device: str = "auto"
    dtype: str = "auto"
    assistant_int8: bool | None = None
    """The assistant on 4-bit / int8 weights; None: on wherever it can run (CPU float32), as
    ``uag.api.load_pair`` and every command decide it. Resolved on construction, so a collected
    run's meta and a bench report record what ran."""
    kernels: str = "auto"
    draft_vocab: int | None = None
    """The assistant drafts from its first N ids (``uag.runtime.draft_vocab``); None: the default where
    its head can be cut; 0: every id."""

    def __post_init__(self) -> None:
        self.assistant_int8 = resolve_assistant_int8(
            self.assistant_int8, device=self.device, dtype=self.dtype
        )
        problem = unwritable(Path(self.out), directory=True)
        if problem is not None:
            raise UagError(f"--out: {problem}")

    def load_pair(self) -> Pair:
        return load_pair_of(self)


class PairSettings(Protocol):
    """The settings that name a model pair: a job's config, or ``uag generate``'s flags once
    ``uag.cli.settle_model_args`` has filled them."""

    target: str
    assistant: str
    device: str
    dtype: str
    assistant_int8: bool | None
    kernels: str
    draft_vocab: int | None


def load_pair_of(settings: PairSettings) -> Pair:
    """The pair ``settings`` name: the one place those settings become ``load_pair``'s
    arguments, so every command loads a pair the same way."""
    return load_pair(
        settings.target,
        settings.assistant,
        device=settings.device,
        dtype=settings.dtype,
        assistant_int8=settings.assistant_int8,
        kernels=settings.kernels,
        draft_vocab=settings.draft_vocab,
    )
