"""``TrainConfig``: what ``uag train-controller`` is configured with.

Apart from ``training.train`` (which imports Lightning, ~3 s) so the command line can take its
flags' defaults from here without paying for that import on every command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from uag.errors import UagError
from uag.paths import unwritable


@dataclass
class TrainConfig:
    """How to train a controller (each field is a ``uag train-controller`` flag)."""

    data: list[Path]
    """One or more ``uag collect`` output directories with the same schema."""
    out: Path = Path("exports/ctrl.onnx")
    logdir: Path = Path("runs")
    max_epochs: int = 30
    hidden: tuple[int, ...] = (32, 32)
    seed: int = 0
    batch_size: int = 512
    lr: float = 3e-3
    val_fraction: float = 0.25
    """Share of prompts (not rows) held out for validation and threshold choice (the *tune*
    prompts)."""
    report_fraction: float = 0.0
    """Share of prompts held out from both training and tuning, on which the summary and the
    ONNX metadata report AUC and simulated speed-ups (0: none; figures are then the tune
    prompts', on which the thresholds were chosen)."""
    accelerator: str = "auto"
    devices: str = "auto"
    strategy: str = "auto"
    num_nodes: int = 1
    gate: bool = True
    """Learn a gate that may skip drafting a round; False: only the stop rule (gate 0)."""
    allow_mixed: bool = False
    """Train on runs of different pairs, assistant precision, decoding or latency device."""
    decision: str = "cost"
    """How the exported controller decides: ``cost`` (expected tokens per second under the
    carried latency profile, ``controllers.cost``) or ``threshold`` (score thresholds chosen by
    replay on the validation prompts)."""
    progress: bool = True
    replay: bool = True
    """A plan (``uag collect --plan`` data, greedy): choose R and report by whole-run exact
    replay on the tune and report prompts (loads the collection's pair); False: per round."""

    def __post_init__(self) -> None:
        if self.max_epochs < 1:
            raise UagError(f"--max-epochs must be at least 1, got {self.max_epochs}")
        if not self.hidden or min(self.hidden) < 1:
            raise UagError(f"--hidden must be positive widths like 32,32, got {self.hidden}")
        if not 0 < self.val_fraction < 1:
            raise UagError(f"validation fraction must be in (0, 1), got {self.val_fraction}")
        if not 0 <= self.report_fraction < 1 or self.val_fraction + self.report_fraction >= 1:
            raise UagError(
                f"--report-fraction must be in [0, 1) and leave training prompts beside the "
                f"validation share {self.val_fraction}, got {self.report_fraction}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UagError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.seed < 2**32:
            raise UagError(f"--seed must be from 0 to 2**32 - 1, got {self.seed}")
        for flag, path, directory in (("--out", self.out, False), ("--logdir", self.logdir, True)):
            problem = unwritable(Path(path), directory=directory)
            if problem is not None:
                raise UagError(f"{flag}: {problem}")
        if self.decision not in ("cost", "threshold"):
            raise UagError(f"--decision must be cost or threshold, got {self.decision!r}")
