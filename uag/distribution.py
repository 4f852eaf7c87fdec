"""Is an arm's sampling distributed as the target's own? A paired log-probability check.

Why this check: sampled outputs have no identity to compare, and a chi-square over whole
sequences is hopeless on a 262k-token vocabulary. What any distortion of the sampling rule
moves is how probable the target finds the samples: accepting drafts too readily pulls the
output toward the assistant's preferences (lower target log-probability), greedy-like rules push
it up. So each run's samples are scored by the target's own processed distribution (the one
``uag.sampling`` samples from), as the mean log-probability per generated token, and the arm is
compared with target-only sampling on the same prompt and seed: the per-pair differences have
mean zero when the arm is exact. Pairing by prompt removes most of the spread (prompts differ
far more from one another than two samples of one prompt do).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from uag.sampling import SamplingConfig, processed_probs

FLAG_P = 0.001
"""Two-sided p-value below which an arm is flagged (with a handful of arms per run, an exact arm
is flagged about once in a few hundred runs)."""
SCORE_ROWS = 8
"""Positions scored per target forward (row-count invariant kernels cover up to 16)."""


@dataclass(frozen=True)
class LogprobCheck:
    """Paired differences ``arm − target-only`` of the mean log-probability per token."""

    pairs: int
    mean: float
    stderr: float

    @property
    def interval(self) -> tuple[float, float]:
        """95 % interval of the mean difference (Student's t)."""
        half = _t_quantile(0.975, self.pairs) * self.stderr
        return (self.mean - half, self.mean + half)

    @property
    def t(self) -> float:
        """The paired t statistic."""
        if self.stderr > 0:
            return self.mean / self.stderr
        return 0.0 if self.mean == 0 else math.copysign(math.inf, self.mean)

    @property
    def critical(self) -> float:
        """|t| beyond which the difference is significant at ``FLAG_P`` (Student's t with
        pairs − 1 degrees of freedom: a few pairs estimate their spread poorly)."""
        return _t_quantile(1 - FLAG_P / 2, self.pairs)

    @property
    def consistent(self) -> bool:
        """No evidence the arm samples from another distribution (|t| ≤ ``critical``)."""
        return self.pairs >= 2 and math.isfinite(self.mean) and abs(self.t) <= self.critical


def _t_quantile(q: float, pairs: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, max(pairs - 1, 1)))


def paired_check(base: Sequence[float], arm: Sequence[float]) -> LogprobCheck:
    """Compare per-run mean log-probabilities, run i of ``arm`` with run i of ``base``."""
    if len(base) != len(arm):
        raise ValueError(f"unpaired runs: {len(base)} vs {len(arm)}")
    diffs = [a - b for a, b in zip(arm, base, strict=True)]
    n = len(diffs)
    if not all(math.isfinite(d) for d in diffs):
        # A sample the target cannot produce (outside top-k/top-p): a different distribution.
        return LogprobCheck(pairs=n, mean=-math.inf, stderr=math.inf)
    mean = statistics.fmean(diffs) if diffs else 0.0
    stderr = statistics.stdev(diffs) / math.sqrt(n) if n >= 2 else math.inf
    return LogprobCheck(pairs=n, mean=mean, stderr=stderr)


@torch.inference_mode()
def mean_logprob(
    pair: Any, prompt_ids: Sequence[int], new_ids: Sequence[int], sampling: SamplingConfig
) -> float:
    """Mean over ``new_ids`` of log p(token | everything before it), ``p`` the target's
    processed distribution (``-inf`` for a token outside it, e.g. cut by top-p)."""
    if not new_ids:
        return math.nan
    target = pair.target_lm
    target.reset(list(prompt_ids), rollback=False)
    rows = [target.full_logits(target.forward()[-1:])]  # predicts new_ids[0]
    for start in range(0, len(new_ids) - 1, SCORE_ROWS):
        target.ids.extend(new_ids[start : start + SCORE_ROWS])
        rows.append(target.full_logits(target.forward()))
    logits = torch.cat(rows)[: len(new_ids)]
    total = 0.0
    for row, token in zip(logits, new_ids, strict=True):
        p = float(processed_probs(row[None], sampling)[0, token])
        total += math.log(p) if p > 0 else -math.inf
    return total / len(new_ids)
