"""Is an arm's sampling distributed as the target's own? A paired log-probability check.

Why this check: sampled outputs have no identity to compare, and a chi-square over whole
sequences is hopeless on a 262k-token vocabulary. What any distortion of the sampling rule
moves is how probable the target finds the samples: accepting drafts too readily pulls the
output toward the assistant's preferences (lower target log-probability), greedy-like rules push
it up. So each run's samples are scored by the target's own processed distribution (the one
``uag.decoding.sampling`` samples from), as the mean log-probability per generated token, and the arm is
compared with target-only sampling on the same prompt and seed: the per-pair differences have
mean zero when the arm is exact. Pairing by prompt removes most of the spread (prompts differ
far more from one another than two samples of one prompt do).

The paired check compares two arms and averages a whole run into one number; a second check
tests every sampled token on its own against the target's exact distribution, and needs no
reference arm: the randomised probability integral transform (PIT). Order the vocabulary by
descending probability (ties by id); a token ``x`` drawn from ``p`` maps to
``u = F(x−) + U·p(x)`` with ``F(x−)`` the mass ahead of it and ``U`` uniform, and ``u`` is then
exactly uniform on (0, 1). If every emitted token is drawn from the target's distribution given
everything before it (what lossless sampling means), the ``u`` of all tokens of all runs are
independent uniforms; a Kolmogorov–Smirnov test on them can fail for any distortion, in either
direction: tokens the target ranks lower push ``u`` up, greedy-like rules push it down.

The PIT is blind to the tail: a rule that emitted a near-impossible token once in a hundred
would move ``u`` for 1 % of the tokens but the mean log-probability by a lot. A third check
looks at exactly that, with no reference arm either: for a token drawn from ``p_t`` the excess
``log p_t(x) + H(p_t)`` has mean zero and a variance known from ``p_t`` itself
(``Var log p_t``), so their sum over every token of every run, divided by the square root of
the summed variances, is a z-score (a martingale: each term has mean zero given the past).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from uag.decoding.sampling import SamplingConfig, processed_probs

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
    # SciPy is slow to import, and the CLI imports this module (through bench) at start-up.
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


@dataclass(frozen=True)
class UniformityCheck:
    """Kolmogorov–Smirnov test of PIT values (``pit_value``) against the uniform distribution."""

    samples: int
    statistic: float
    """The KS distance D (NaN when a sample is impossible under the target)."""
    p_value: float

    @property
    def consistent(self) -> bool:
        """No evidence against uniformity at ``FLAG_P`` (and every sample possible)."""
        return math.isfinite(self.statistic) and self.p_value >= FLAG_P


def pit_value(probs: torch.Tensor, token: int, u: float) -> float:
    """Randomised PIT of ``token`` under ``probs`` ([V], descending-probability order, ties by
    id): uniform on (0, 1) when ``token`` is a draw from ``probs``; NaN when ``probs[token]`` is 0
    (no draw from ``probs`` could be that token)."""
    px = probs[token]
    if float(px) <= 0.0:
        return math.nan
    ahead = probs[probs > px].sum() + probs[:token][probs[:token] == px].sum()
    return float(ahead) + u * float(px)


def uniformity_check(values: Sequence[float]) -> UniformityCheck:
    """One-sample KS test of ``values`` against Uniform(0, 1)."""
    # SciPy: deferred, as in _t_quantile.
    from scipy.stats import kstest

    if not values or not all(math.isfinite(v) for v in values):
        return UniformityCheck(samples=len(values), statistic=math.nan, p_value=0.0)
    res = kstest(list(values), "uniform")
    return UniformityCheck(
        samples=len(values), statistic=float(res.statistic), p_value=float(res.pvalue)
    )


@dataclass(frozen=True)
class ExcessCheck:
    """Summed ``log p(x) + H(p)`` over sampled tokens against its exact standard deviation."""

    tokens: int
    excess: float
    """Σ (log p_t(x_t) + H(p_t)): zero on average for draws from the target (``-inf``: a token
    it cannot produce)."""
    variance: float
    """Σ Var_{x ~ p_t}[log p_t(x)]."""

    @property
    def mean(self) -> float:
        """Excess log-probability per token (negative: the samples are less probable)."""
        return self.excess / self.tokens if self.tokens else 0.0

    @property
    def z(self) -> float:
        if not math.isfinite(self.excess):
            return -math.inf
        return self.excess / math.sqrt(self.variance) if self.variance > 0 else 0.0

    @property
    def consistent(self) -> bool:
        """|z| within the two-sided ``FLAG_P`` bound of the normal distribution."""
        # SciPy: deferred, as in _t_quantile.
        from scipy.stats import norm

        return math.isfinite(self.z) and abs(self.z) <= float(norm.ppf(1 - FLAG_P / 2))


def logprob_moments(probs: torch.Tensor) -> tuple[float, float]:
    """``(H, Var log p)`` of ``probs`` ([V]): the mean of ``-log p(x)`` and the variance of
    ``log p(x)`` for ``x ~ probs``."""
    p = probs[probs > 0]
    logp = torch.log(p)
    entropy = float(-(p * logp).sum())
    second = float((p * logp * logp).sum())
    return entropy, max(second - entropy * entropy, 0.0)


@dataclass(frozen=True)
class ScoredRun:
    """A sampled run under the target's processed distribution."""

    mean_logprob: float
    """Mean log p per generated token (``-inf``: a token the target cannot produce)."""
    pit: tuple[float, ...]
    """One PIT value per generated token (``pit_value``)."""
    excess: float = 0.0
    """Σ (log p(x) + H(p)) over the run's tokens (``ExcessCheck``)."""
    variance: float = 0.0
    """Σ Var log p over the run's tokens."""


@torch.inference_mode()
def score_run(
    pair: Any,
    prompt_ids: Sequence[int],
    new_ids: Sequence[int],
    sampling: SamplingConfig,
    *,
    seed: int,
) -> ScoredRun:
    """Score ``new_ids`` (sampled after ``prompt_ids``) token by token under the target's
    processed distribution; ``seed`` drives the PIT's uniforms (a fixed stream, independent of
    the run's own, so scoring is reproducible)."""
    if not new_ids:
        return ScoredRun(mean_logprob=math.nan, pit=())
    gen = torch.Generator().manual_seed(seed)
    total, excess, variance, pit = 0.0, 0.0, 0.0, []
    for row, token in zip(_target_rows(pair, prompt_ids, new_ids), new_ids, strict=True):
        probs = processed_probs(row[None], sampling)[0]
        p = float(probs[token])
        logp = math.log(p) if p > 0 else -math.inf
        entropy, var = logprob_moments(probs)
        total += logp
        excess += logp + entropy
        variance += var
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        pit.append(pit_value(probs, token, u))
    return ScoredRun(
        mean_logprob=total / len(new_ids), pit=tuple(pit), excess=excess, variance=variance
    )


def _target_rows(pair: Any, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> torch.Tensor:
    """The target's full logits ``[len(new_ids), V]``: row i predicts ``new_ids[i]``."""
    target = pair.target_lm
    target.reset(list(prompt_ids), rollback=False)
    rows = [target.full_logits(target.forward()[-1:])]  # predicts new_ids[0]
    for start in range(0, len(new_ids) - 1, SCORE_ROWS):
        target.ids.extend(new_ids[start : start + SCORE_ROWS])
        rows.append(target.full_logits(target.forward()))
    return torch.cat(rows)[: len(new_ids)]
