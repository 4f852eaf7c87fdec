"""``uag bench``: every policy side by side on the same prompts, in one run, outputs checked.

Honesty rules: one warm-up per arm (not timed); arms interleaved prompt by prompt (and repeat by
repeat), their order rotated every round, so machine drift and position effects hit them alike;
speed reported as ratios to ``target-only`` over the same prompts, with a 95 % bootstrap interval
over prompts (these cores drift by several percent: a ratio without an interval says too
little); every arm's greedy tokens compared with ``target-only``'s. ``oracle`` is not run:
it is simulated by replay over a long-lookahead pass on the same prompts in the same run, with
the latency profile measured in this run (a slice after every prompt, the medians of all: drift
reaches the prices as it reaches the arms), and is marked simulated. The same run predicts every
uag greedy arm (static-K, the rules, learned) by *exact replay* (``uag.harness.dryrun``): the real loop
with the arm's own policy against a recorded target-alone run, so its rounds are the loop's and
only their prices come from the profile; the prediction is printed beside the measurement, so
the profile's error shows in every run.

With ``sampling`` (``uag bench --sample``) every arm of a round runs with the same seed, and the
identity check becomes ``uag.harness.distribution``'s two checks: the paired log-probability check against
target-only sampling, which flags an arm whose samples the target finds more or less probable
than its own, and a PIT uniformity test of every sampled token against the target's exact
distribution (target-only included: it checks the scorer too).
The oracle (a greedy replay) is not available there.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import secrets
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime, timezone
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from controllers.learned_plan import load_controller
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from controllers.spec import parse_policy, parse_policy_list
from training import replay
from training.data import from_columns
from training.replay import Prefill
from uag import api, recipes
from uag.api import encode_prompt, render_prompt
from uag.decoding.features import FEATURE_NAMES, SCHEMA_VERSION
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Plan
from uag.decoding.round import MAX_CANDIDATES
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.harness import dryrun
from uag.harness.collect import rows_for_prompt
from uag.harness.distribution import (
    ExcessCheck,
    LogprobCheck,
    UniformityCheck,
    paired_check,
    score_run,
    uniformity_check,
)
from uag.harness.jobs import RunConfig
from uag.harness.latency import measure_pair_profile, pair_sampler
from uag.harness.plan_collect import OraclePlan
from uag.harness.prompts import Prompt, as_text, load_prompts
from uag.recipes import lookup_lengths

DEFAULT_POLICIES = "target-only,static-1,static-2,static-4,heuristic,confidence-0.4,entropy,transformers,learned,oracle"
SAMPLING_POLICIES = "target-only,static-1,static-2,lookup,static-2+lookup,transformers,learned"
"""The default arms under ``--sample`` (the oracle replays greedy runs; ``learned`` is the shipped
sampling plan)."""
ORACLE_LOOKAHEAD = 6


@dataclass
class BenchConfig(RunConfig):
    """Which policies to compare, on which prompts and pair."""

    controller: Path | None = None
    policies: str = DEFAULT_POLICIES
    repeats: int = 1
    progress: bool = True
    sampling: SamplingConfig | None = None
    """Sample instead of greedy decoding; its seed (or a fresh one) seeds round 0, round r uses
    seed + r for every arm."""


@dataclass(kw_only=True)
class LoopCounts:
    """What uag's loop counts in a run (0 for an arm that is not uag's): one run's
    (``ArmRun``) and, summed field by field, all of an arm's runs' (``PolicyResult.add``);
    declared once so that the sum cannot miss a count."""

    drafted: int = 0
    accepted: int = 0
    policy_seconds: float = 0.0
    decisions: int = 0
    """Controller calls: one budget per round plus one stop per drafted token."""
    copied: int = 0
    """Candidates prompt lookup copied, and below, how many the target accepted."""
    copied_accepted: int = 0


@dataclass
class ArmRun(LoopCounts):
    """One arm on one prompt."""

    ids: list[int]
    seconds: float
    target_forwards: int


@dataclass
class PolicyResult(LoopCounts):
    name: str
    simulated: bool = False
    seconds: float = 0.0
    tokens: int = 0
    target_forwards: int = 0
    runs: int = 0
    identical_runs: int = 0
    speedup_vs_target: float = 0.0
    per_prompt_seconds: list[float] = field(default_factory=list)
    """Seconds per prompt (all its repeats): what the paired ratios and the interval use."""
    per_prompt_tokens: list[int] = field(default_factory=list)
    """Tokens per prompt (all its repeats): sampled runs of one prompt differ in length (an
    end-of-sequence drawn early), so speed is tokens per second, not time per run."""
    interval: tuple[float, float] | None = None
    """95 % bootstrap interval of ``speedup_vs_target`` over prompts (None: simulated)."""
    logprobs: list[float] = field(default_factory=list)
    """Sampling: each run's mean target log-probability per generated token, in run order."""
    check: LogprobCheck | None = None
    """Sampling: the paired check of ``logprobs`` against target-only's."""
    pit: list[float] = field(default_factory=list)
    """Sampling: every generated token's PIT value under the target (``uag.harness.distribution``)."""
    uniformity: UniformityCheck | None = None
    """Sampling: the KS test of ``pit`` against the uniform distribution."""
    scored: list[tuple[float, float]] = field(default_factory=list)
    """Sampling: per run, Σ (log p + H) and Σ Var log p over its tokens."""
    excess: ExcessCheck | None = None
    """Sampling: the z-test of the summed excess log-probability (``uag.harness.distribution``)."""
    predicted: float | None = None
    """Exact replay's speed-up for this arm over the same prompts, priced by the latency profile
    measured in this run (None: not a uag greedy arm, or no oracle pass)."""
    predicted_seconds: float | None = None
    """Exact replay's priced seconds for one pass over the prompts (the measurement: ``seconds``
    over the repeats; target-only: replay's price for the target alone)."""
    predicted_forwards: int | None = None
    """Target forwards (rounds) of the exact replay over the prompts, once each: every repeat of
    the arm makes these same rounds."""

    @property
    def identical(self) -> bool:
        return self.identical_runs == self.runs

    def add(self, run: ArmRun, *, identical: bool) -> None:
        """One more timed run of this arm, on the prompt whose totals are the last of
        ``per_prompt_seconds`` and ``per_prompt_tokens``; ``identical``: its tokens are
        target-only's of the same round."""
        self.per_prompt_seconds[-1] += run.seconds
        self.per_prompt_tokens[-1] += len(run.ids)
        self.seconds += run.seconds
        self.tokens += len(run.ids)
        self.target_forwards += run.target_forwards
        for count in fields(LoopCounts):
            setattr(self, count.name, getattr(self, count.name) + getattr(run, count.name))
        self.runs += 1
        self.identical_runs += int(identical)

    @property
    def sound(self) -> bool:
        """Greedy: every output identical to target-only's; sampling: the distribution check
        finds no difference and every token passes the PIT test (simulated arms: unchecked)."""
        if self.simulated:
            return True
        if self.check is None:
            return self.identical
        return all(c is None or c.consistent for c in (self.check, self.uniformity, self.excess))

    def as_row(self) -> dict[str, Any]:
        sampled = self.check is not None
        return {
            "name": self.name,
            "simulated": self.simulated,
            "speedup_vs_target": round(self.speedup_vs_target, 4),
            "speedup_interval_95": [round(v, 4) for v in self.interval] if self.interval else None,
            "identical": self.identical if not (self.simulated or sampled) else None,
            # sampling: runs equal to target-only's of the same seed (copies and steps only)
            "identical_runs": self.identical_runs if sampled else None,
            "same_distribution": self.check.consistent if self.check is not None else None,
            "mean_logprob": round(statistics.fmean(self.logprobs), 4) if self.logprobs else None,
            "logprob_diff_vs_target": _diff_row(self.check),
            "pit_uniformity": None
            if self.uniformity is None
            else {
                "tokens": self.uniformity.samples,
                "ks_statistic": _finite_or_none(self.uniformity.statistic, 5),
                "p_value": round(self.uniformity.p_value, 5),
                "consistent": self.uniformity.consistent,
            },
            "excess_logprob": None
            if self.excess is None
            else {
                "tokens": self.excess.tokens,
                "per_token": _finite_or_none(self.excess.mean, 5),
                "z": _finite_or_none(self.excess.z, 3),
                "consistent": self.excess.consistent,
                "per_run": [[round(e, 4), round(v, 4)] for e, v in self.scored],
            },
            "tokens_per_target_forward": round(self.tokens / self.target_forwards, 4)
            if self.target_forwards
            else None,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "lookup_acceptance": round(self.copied_accepted / self.copied, 4)
            if self.copied
            else None,
            "seconds": round(self.seconds, 3),
            "tokens": self.tokens,
            "controller_share": round(self.policy_seconds / self.seconds, 5)
            if self.seconds and self.policy_seconds
            else None,
            "controller_us_per_decision": round(1e6 * self.policy_seconds / self.decisions, 1)
            if self.decisions and self.policy_seconds
            else None,
            "replay_predicted": None if self.predicted is None else round(self.predicted, 4),
            "replay_target_forwards": self.predicted_forwards,
            "replay_seconds": None
            if self.predicted_seconds is None
            else round(self.predicted_seconds, 3),
            "per_prompt_seconds": [round(t, 4) for t in self.per_prompt_seconds],
            "per_prompt_tokens": list(self.per_prompt_tokens),
        }


def _finite_or_none(value: float, digits: int) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def _diff_row(check: LogprobCheck | None) -> dict[str, Any] | None:
    if check is None:
        return None
    low, high = check.interval
    finite = all(math.isfinite(v) for v in (check.mean, low, high))
    return {
        "pairs": check.pairs,
        "mean": round(check.mean, 4) if finite else None,
        "interval_95": [round(low, 4), round(high, 4)] if finite else None,
        "t": round(check.t, 2) if finite else None,
    }


def _check_cell(p: PolicyResult) -> str:
    if p.simulated:
        return "simulated"
    if p.check is None:
        return "yes" if p.identical else f"**NO** ({p.identical_runs}/{p.runs})"
    pit = ""
    if p.uniformity is not None:
        pit = f"PIT p {p.uniformity.p_value:.3f} over {p.uniformity.samples} tokens"
    if p.excess is not None:
        pit += f"; excess log p {p.excess.mean:+.4f} / token, z {p.excess.z:+.2f}"
    if p.name == "target-only":
        verdict = "yes" if p.sound else "**NO**"
        return f"{verdict}: reference; {pit}" if pit else "reference"
    c = p.check
    if not math.isfinite(c.mean):
        return "**NO** (samples the target cannot produce)"
    low, high = c.interval
    verdict = "yes" if p.sound else "**NO**"
    same = f"{p.identical_runs}/{p.runs} runs target-only's tokens"
    return f"{verdict} (Δ {c.mean:+.3f} [{low:+.3f}, {high:+.3f}]; {pit}; {same})"


@dataclass
class BenchReport:
    policies: list[PolicyResult]
    machine: str
    prompts: int
    config: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    """The latency profile replay priced with (measured in slices across this run)."""
    categories: list[str] = field(default_factory=list)
    """Each prompt's category, in the order of every arm's ``per_prompt_seconds``."""

    def by_category(self) -> dict[str, dict[str, tuple[float, tuple[float, float], int]]]:
        """Each measured arm against target-only within each prompt category and over all
        (``"all"``): ``{arm: {category: (speed-up, 95 % interval paired by prompt, prompts)}}``.
        Empty when the prompts carry fewer than two categories."""
        named = sorted(set(self.categories) - {""})
        if len(named) < 2:
            return {}
        base = next(p for p in self.policies if p.name == "target-only")
        groups = {"all": list(range(len(self.categories)))} | {
            c: [i for i, mine in enumerate(self.categories) if mine == c] for c in named
        }
        out: dict[str, dict[str, tuple[float, tuple[float, float], int]]] = {}
        for arm in self.policies:
            if arm.simulated or not arm.seconds or arm is base:
                continue
            out[arm.name] = {c: _subset_ratio(base, arm, idx) for c, idx in groups.items()}
        return out

    def comparisons(self) -> list[tuple[str, str, float, tuple[float, float]]]:
        """Each plan arm (a learned one, or ``default``: the product's) against every other
        measured arm but target-only and the other plan arms: (plan, other, tokens-per-second
        ratio plan / other, its 95 % paired bootstrap interval over prompts). Greedy arms emit
        the same tokens, so it is the time ratio other / plan."""
        measured = [p for p in self.policies if not p.simulated and p.seconds]
        planned = [p for p in measured if p.name.startswith("learned") or p.name == "default"]
        out = []
        for mine in planned:
            for other in measured:
                if other.name == "target-only" or other in planned:
                    continue
                ratio = rate_ratio(mine, other)
                interval = bootstrap_interval(
                    other.per_prompt_seconds,
                    mine.per_prompt_seconds,
                    base_tokens=other.per_prompt_tokens,
                    arm_tokens=mine.per_prompt_tokens,
                )
                out.append((mine.name, other.name, ratio, interval))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "learned_vs_fixed": [
                {
                    "learned": a,
                    "vs": b,
                    "speedup": round(r, 4),
                    "interval_95": [round(v, 4) for v in ci],
                }
                for a, b, r, ci in self.comparisons()
            ],
            "policies": [p.as_row() for p in self.policies],
            "machine": self.machine,
            "prompts": self.prompts,
            "config": self.config,
            "profile": self.profile,
            "by_category": {
                arm: {
                    c: {
                        "speedup": round(r, 4),
                        "interval_95": [round(v, 4) for v in ci],
                        "prompts": n,
                    }
                    for c, (r, ci, n) in cells.items()
                }
                for arm, cells in self.by_category().items()
            },
        }

    def markdown(self) -> str:
        sampled = any(p.check is not None for p in self.policies)
        check = (
            "same distribution (Δ log p / token, 95 %; PIT; excess log p)"
            if sampled
            else "identical"
        )
        lines = [
            f"| policy | speed-up vs target-only | 95 % interval | replay predicts | {check} | tokens / target forward | acceptance (drafts, copies) | controller time |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in self.policies:
            row = p.as_row()
            ident = _check_cell(p)
            tpf = (
                f"{row['tokens_per_target_forward']:.2f}"
                if row["tokens_per_target_forward"]
                else "-"
            )
            rates = []
            if row["acceptance_rate"] is not None:
                rates.append(f"{row['acceptance_rate']:.0%}")
            if row["lookup_acceptance"] is not None:
                rates.append(f"copies {row['lookup_acceptance']:.0%}")
            acc = ", ".join(rates) or "-"
            share = f"{row['controller_share']:.2%}" if row["controller_share"] else "-"
            if row["controller_us_per_decision"]:
                share += f" ({row['controller_us_per_decision']:.0f} µs / decision)"
            ci = f"{p.interval[0]:.2f}–{p.interval[1]:.2f}x" if p.interval else "-"
            sim = f"{p.predicted:.2f}x" if p.predicted is not None else "-"
            lines.append(
                f"| {p.name}{' (simulated)' if p.simulated else ''} | {p.speedup_vs_target:.2f}x | {ci} | {sim} | {ident} | {tpf} | {acc} | {share} |"
            )
        if not sampled and not any(p.simulated for p in self.policies):
            # An empty column otherwise reads as "replay cannot predict these arms".
            lines += ["", NO_REPLAY_NOTE]
        lines += self._category_table()
        pairs = self.comparisons()
        if pairs:
            lines += [
                "",
                "| plan arm | vs | speed-up (the plan's tokens/s / the other's) | 95 % interval (paired by prompt) |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {a} | {b} | {r:.3f}x | {ci[0]:.3f}–{ci[1]:.3f}x |" for a, b, r, ci in pairs
            ]
        return "\n".join(lines)

    def _category_table(self) -> list[str]:
        """Speed-up vs target-only per prompt category (with its 95 % interval), one row per
        measured arm; nothing when the prompts carry no categories."""
        cells = self.by_category()
        if not cells:
            return []
        groups = list(next(iter(cells.values())))
        counts = next(iter(cells.values()))
        head = " | ".join(f"{c} ({counts[c][2]})" for c in groups)
        lines = ["", f"| speed-up vs target-only, by category (prompts) | {head} |"]
        lines.append("|---" * (len(groups) + 1) + "|")
        for arm, row in cells.items():
            shown = [f"{r:.2f}x ({ci[0]:.2f}–{ci[1]:.2f})" for r, ci, _ in row.values()]
            lines.append(f"| {arm} | " + " | ".join(shown) + " |")
        return lines


def _subset_ratio(
    base: PolicyResult, arm: PolicyResult, idx: list[int]
) -> tuple[float, tuple[float, float], int]:
    """``arm``'s tokens per second over ``base``'s on the prompts ``idx`` (every repeat), and
    the 95 % interval when those prompts are resampled."""
    b_s = [base.per_prompt_seconds[i] for i in idx]
    a_s = [arm.per_prompt_seconds[i] for i in idx]
    b_t = [base.per_prompt_tokens[i] for i in idx]
    a_t = [arm.per_prompt_tokens[i] for i in idx]
    ratio = (sum(a_t) / sum(a_s)) / (sum(b_t) / sum(b_s)) if sum(a_s) and sum(b_s) else 0.0
    interval = bootstrap_interval(b_s, a_s, base_tokens=b_t, arm_tokens=a_t)
    return ratio, interval, len(idx)


NO_REPLAY_NOTE = (
    "replay predicts: add the `oracle` arm for these figures (its long-lookahead pass is what "
    "replay prices static-K, learned and the oracle from)"
)
"""Under a greedy table without the oracle arm, whose replay column is then empty."""


Arm = Callable[[str, int, int | None], ArmRun]
"""``(prompt, max new tokens, seed) → ArmRun``; the seed is None for greedy runs."""


def rotated(names: list[str], shift: int) -> list[str]:
    """``names`` starting at position ``shift`` (mod its length): the arm order of one round."""
    k = shift % len(names) if names else 0
    return names[k:] + names[:k]


def rate_ratio(arm: PolicyResult, base: PolicyResult) -> float:
    """``arm``'s tokens per second over ``base``'s, over all their runs."""
    if not arm.seconds or not base.seconds or not base.tokens:
        return 0.0
    return (arm.tokens / arm.seconds) / (base.tokens / base.seconds)


def bootstrap_interval(
    base: list[float],
    arm: list[float],
    *,
    base_tokens: list[int] | None = None,
    arm_tokens: list[int] | None = None,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """95 % percentile interval of the arm's tokens per second over the base's,
    ``(Σ arm_tokens / Σ arm) / (Σ base_tokens / Σ base)``, when prompts are resampled (no
    token counts: the same tokens, so ``sum(base) / sum(arm)``).

    Paired by prompt: a resample keeps each prompt's two times together, so the spread is the
    prompts' disagreement about the ratio, not how much longer some prompts are than others.
    """
    b, a = np.asarray(base, dtype=float), np.asarray(arm, dtype=float)
    tb = np.ones_like(b) if base_tokens is None else np.asarray(base_tokens, dtype=float)
    ta = tb if arm_tokens is None else np.asarray(arm_tokens, dtype=float)
    pick = np.random.default_rng(seed).integers(0, len(b), size=(resamples, len(b)))
    ratios = (ta[pick].sum(axis=1) / a[pick].sum(axis=1)) / (
        tb[pick].sum(axis=1) / b[pick].sum(axis=1)
    )
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def parse_policies(text: str) -> list[str]:
    """``--policies`` → arm names (``controllers.spec``'s grammar), target-only first."""
    return [str(s) for s in parse_policy_list(text)]


ArmPlan = Callable[[], Plan]
"""A uag speculative arm's plan factory (a fresh plan per run; exact replay runs the same)."""


def _uag_arm(
    pair: Any,
    make_plan: ArmPlan | None,
    *,
    chat: bool,
    sampling: SamplingConfig | None = None,
) -> Arm:
    def run(prompt: str, n: int, seed: int | None) -> ArmRun:
        res = api.generate(
            pair,
            prompt,
            plan=make_plan() if make_plan else None,
            max_new_tokens=n,
            chat=chat,
            sampling=None if sampling is None else replace(sampling, seed=seed),
        )
        return ArmRun(
            ids=res.token_ids,
            seconds=res.seconds,
            target_forwards=res.target_forwards,
            drafted=res.drafted_tokens,
            accepted=res.accepted_drafts,
            policy_seconds=res.time_split()["policy"],
            decisions=len(res.iterations) + res.drafted_tokens,
            copied=res.copied_tokens,
            copied_accepted=res.copied_accepted,
        )

    return run


def transformers_generate(
    pair: Any,
    prompt: str,
    n: int,
    *,
    chat: bool = False,
    assisted: bool = False,
    sampling: SamplingConfig | None = None,
    assistant_model: Any = None,
) -> list[int]:
    """Transformers ``generate()`` on the pair's target (with the assistant when ``assisted``,
    through its UAG path; sampling: its token-level-intersection path), same prompt ids and stop
    tokens as uag uses. ``assistant_model`` replaces the pair's assistant (sampling prunes the
    assistant's head in place, so it needs a copy of its own)."""
    ids, _ = _encoded(pair, prompt, chat=chat)
    input_ids = torch.tensor([ids], device=pair.target.device)
    tok = pair.target.tokenizer
    extra: dict[str, Any] = {}
    if assisted:
        extra = {
            "assistant_model": assistant_model or pair.assistant.model,
            "tokenizer": tok,
            "assistant_tokenizer": pair.assistant.tokenizer,
        }
    if sampling is not None:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        extra.update(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,  # 0: off (Transformers' default would be 50)
        )
    try:
        out = pair.target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=n,
            do_sample=sampling is not None,
            eos_token_id=sorted(pair.target.eos_ids),
            pad_token_id=tok.pad_token_id,
            **extra,
        )
    except (RuntimeError, ValueError, IndexError) as exc:
        # Its code, not ours: say whose failure it is and how to go on without it.
        # Transformers is slow to import and the CLI imports this module at start-up (this arm
        # has loaded it already).
        import transformers

        what = "assisted generation" if assisted else "generate()"
        tested = _tested_transformers()
        raise UagError(
            f"Transformers {transformers.__version__}'s own {what} failed on this pair "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); uag is tested with "
            f"{tested} (pip install '{tested}'), or leave out the transformers arm"
        ) from exc
    return out[0, len(ids) :].tolist()


def _tested_transformers() -> str:
    """The Transformers range uag declares (pyproject.toml, read from the installed metadata so
    that there is one place to change it)."""
    try:
        found = [r for r in metadata.requires("uag") or [] if r.startswith("transformers")]
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        found = []
    return found[0].split(";")[0].strip() if found else "the transformers range in pyproject.toml"


def _transformers_arm(pair: Any, *, chat: bool, sampling: SamplingConfig | None = None) -> Arm:
    """Transformers' own assisted generation on the same pair, with its defaults."""
    # Its sampling path prunes the assistant's head in place: give it a copy of its own.
    assistant = copy.deepcopy(pair.assistant.model) if sampling is not None else None

    def run(prompt: str, n: int, seed: int | None) -> ArmRun:
        start = time.perf_counter()
        new = transformers_generate(
            pair,
            prompt,
            n,
            chat=chat,
            assisted=True,
            sampling=None if sampling is None else replace(sampling, seed=seed),
            assistant_model=assistant,
        )
        return ArmRun(ids=new, seconds=time.perf_counter() - start, target_forwards=0)

    return run


def build_arms(
    names: list[str],
    pair: Any,
    cfg: BenchConfig,
    *,
    prompt_ids: list[str] | None = None,
    policies: dict[str, ArmPlan] | None = None,
    lookup_lengths: tuple[int, ...] | None = None,
) -> dict[str, Arm]:
    """The arms ``names`` on ``pair``; a learned arm warns when its controller was trained on
    any of ``prompt_ids`` (the prompts about to be benched). ``policies`` receives each uag
    speculative arm's plan factory (what exact replay runs; not the bandit's). ``+lookup``
    arms (the hybrid ``+lookup-N`` and ``bandit`` too) copy ``lookup_lengths`` (``uag
    calibrate``; None: the built-in lengths)."""
    arms: dict[str, Arm] = {}
    for name in names:
        spec = parse_policy(name)
        if spec.kind == "oracle":
            continue
        factory: ArmPlan | None
        lookup = partial(spec.make_lookup, lookup_lengths)
        if spec.kind == "target-only":
            factory = None
        elif spec.kind == "default":  # the product's plan, reused run after run (begin resets it)
            recipe = recipes.default_plan(pair, sampling=cfg.sampling is not None)
            factory = partial(_the_plan, recipe.plan)
        elif spec.is_rule:
            factory = partial(spec.plan, lengths=lookup_lengths)
        elif spec.kind == "learned":  # spec.path: another controller beside --controller's
            controller = cfg.controller if spec.path is None else spec.path
            factory = _learned_factory(
                pair, replace(cfg, controller=controller), lookup, prompt_ids
            )
        elif spec.kind == "transformers":
            # Transformers' own path runs on unmodified models: uag's copies have packed kernels.
            # Its sampling path prunes the assistant's head, which needs a float weight: no int8.
            int8 = cfg.assistant_int8 and cfg.sampling is None
            stock = (
                pair
                if pair.kernels == "plain" and int8 == cfg.assistant_int8
                else replace(cfg, kernels="plain", assistant_int8=int8).load_pair()
            )
            arms[name] = _transformers_arm(stock, chat=cfg.chat, sampling=cfg.sampling)
            continue
        else:  # parse_policies rejects anything else
            raise UagError(f"unknown policy {name!r}")
        arms[name] = _uag_arm(pair, factory, chat=cfg.chat, sampling=cfg.sampling)
        # The bandit picks its arms by each round's wall time, which exact replay does not
        # reproduce (its target forward is a lookup): it would predict other rounds than it runs.
        if factory is not None and policies is not None and spec.kind != "bandit":
            policies[name] = factory
    return arms


def _the_plan(plan: Plan) -> Plan:
    """``plan`` itself: the factory of an arm that reuses one plan (its ``begin`` resets it)."""
    return plan


def _learned_factory(
    pair: Any,
    cfg: BenchConfig,
    lookup: Callable[[], PromptLookup | None],
    prompt_ids: list[str] | None,
) -> ArmPlan:
    """The learned arm's plan factory: a plan file chooses every round's action and copies as
    far as a verify allows (``controllers.learned_plan``), a stop controller drafts after the
    arm's ``lookup`` (``+lookup``)."""
    if cfg.controller is None:
        raise UagError("policy 'learned' needs --controller PATH.onnx")
    learned = load_controller(cfg.controller, use_cuda=pair.target.device.type == "cuda")
    learned.warn_if_foreign_to(cfg, device=pair.target.device.type, draft_vocab=pair.draft_vocab)
    learned.warn_if_trained_on(prompt_ids or [])
    return lambda: learned.as_plan(lookup())


def _replay_pass(
    pair: Any, prompts: list[Any], cfg: BenchConfig, sampler: Any
) -> tuple[Any, Any, Any]:
    """A long-lookahead pass over the same prompts, as collected rows, the latency profile
    (``sampler``'s slices from across the timed runs, topped up now) and the prefill the pass
    paid (``training.replay.Prefill``): what replay needs to predict the oracle, static-K and
    learned arms over whole runs."""
    # Every verify size the loop sends is measured, not extrapolated: lookup copies up to 11.
    profile = measure_pair_profile(pair, max_candidates=MAX_CANDIDATES, sampler=sampler)
    parts = []
    target_prefill = assistant_prefill = 0.0
    for p in prompts:
        out = api.generate(
            pair,
            p.text,
            plan=RulePlan(StaticPolicy(k=ORACLE_LOOKAHEAD)),
            max_new_tokens=budget(p, cfg),
            chat=cfg.chat,
            keep_steps=True,
        )
        cols = rows_for_prompt(p, out.iterations)
        if len(cols["accepted"]):
            parts.append(cols)
        # Round 0 is the target's prompt pass; the first drafting round's first step also
        # feeds the assistant its prompt.
        target_prefill += out.iterations[0].verify_s if out.iterations else 0.0
        first = next((r for r in out.iterations if r.drafted), None)
        if first is not None:
            assistant_prefill += max(first.first_draft_s - profile.draft_s - profile.catchup_s, 0)
    prefill = Prefill(target_s=target_prefill, assistant_s=assistant_prefill)
    if not parts:
        return None, profile, prefill
    meta = {
        "feature_names": list(FEATURE_NAMES),
        "schema_version": SCHEMA_VERSION,
        "latency_profile": profile.to_dict(),
    }
    return from_columns(parts, meta), profile, prefill


def _predict_oracle(data: Any, profile: Any, prefill: Any) -> float:
    """Replay's oracle speed-up: each round of the long-lookahead pass cut at its accepted
    count (1.0 when the pass drafted nothing)."""
    if data is None:
        return 1.0
    return replay.oracle(replay.build_iterations(data), profile, prefill=prefill).speedup


def _exact_predictions(
    pair: Any,
    prompts: list[Any],
    cfg: BenchConfig,
    policies: dict[str, ArmPlan],
    profile: Any,
) -> dict[str, tuple[float, int, float]]:
    """Exact replay per uag arm (``uag.harness.dryrun``): one recorded target-alone run per prompt,
    then each arm's policy through the real loop against it; (speed-up, target forwards,
    seconds), priced by ``profile``; "target-only" holds the target alone's price."""
    traces: list[dryrun.TargetTrace] = []
    encoded: list[list[int]] = []
    runs: dict[str, list[dryrun.ReplayRun]] = {name: [] for name in policies}
    for p in prompts:
        target_ids, assistant_ids = _encoded(pair, p.text, chat=cfg.chat)
        trace = dryrun.record_trace(pair, target_ids, budget(p, cfg))
        traces.append(trace)
        encoded.append(assistant_ids)
        for name, make_plan in policies.items():
            runs[name].append(
                dryrun.replay(
                    pair, trace, make_plan(), prompt_assistant_ids=assistant_ids, profile=profile
                )
            )
    out = {
        name: (
            dryrun.predicted_speedup(r, traces, profile),
            sum(len(run.records) for run in r),
            sum(dryrun.priced_seconds(run, t, profile) for run, t in zip(r, traces, strict=True)),
        )
        for name, r in runs.items()
    }
    alone = sum(dryrun.alone_seconds(t, profile) for t in traces)
    out["target-only"] = (1.0, sum(len(t.ids) for t in traces), alone)
    out[PLAN_ORACLE] = _plan_oracle(pair, traces, encoded, profile)
    return out


PLAN_ORACLE = "oracle-plan"
"""The simulated arm that knows each round's every outcome over the plan's action space."""


def _plan_oracle(
    pair: Any,
    traces: list[dryrun.TargetTrace],
    assistant_ids: list[list[int]],
    profile: Any,
    *,
    iterations: int = 2,
) -> tuple[float, int, float]:
    """Exact replay of ``OraclePlan`` over step, copy:1..15 and draft:1..8 (each round's action
    the best by its exact outcome there, Dinkelbach's R iterated to the plan's own rate):
    (speed-up, target forwards, seconds)."""
    from uag.harness.plan_collect import default_actions  # the collection's action set

    actions = default_actions()
    rate, result = 2.0 / profile.target_step_s, (1.0, 0, 0.0)
    for _ in range(iterations):
        runs = [
            dryrun.replay(
                pair,
                trace,
                OraclePlan(
                    trace=trace,
                    actions=actions,
                    profile=profile,
                    rate=rate,
                    eos=pair.target.eos_ids,
                ),
                prompt_assistant_ids=ids,
                profile=profile,
            )
            for trace, ids in zip(traces, assistant_ids, strict=True)
        ]
        speedup = dryrun.predicted_speedup(runs, traces, profile, timed_policy=False)
        seconds = sum(
            dryrun.priced_seconds(r, t, profile, timed_policy=False)
            for r, t in zip(runs, traces, strict=True)
        )
        result = (speedup, sum(len(r.records) for r in runs), seconds)
        rate = speedup / profile.target_step_s
    return result


def run_bench(cfg: BenchConfig, *, extra_arms: dict[str, Arm] | None = None) -> BenchReport:
    """Run the benchmark; ``extra_arms`` lets tests add an arm (e.g. a deliberately broken one).

    In phases: the seed settled, the arms set up and warmed, every arm timed round by round,
    each compared with target-only, then (with the oracle arm) replay's predictions."""
    if cfg.repeats < 1:
        raise UagError(f"--repeats must be at least 1, got {cfg.repeats}")
    names = parse_policies(cfg.policies)
    cfg = _seeded(cfg, names=names)
    bench = _set_up(cfg, names=names, extra_arms=extra_arms)
    run_cfg = bench.cfg
    results = {name: PolicyResult(name) for name in bench.arms}
    for arm in bench.arms.values():  # warm-up: kernels, allocator, thread pools; not timed
        arm(bench.prompts[0].text, 4, _first_seed(cfg))
    # Replay's prices are sampled across the timed runs, a slice after every prompt, as the
    # arms are: one measurement at one moment misprices a run these CPUs drift through.
    sampler = pair_sampler(bench.pair, max_candidates=MAX_CANDIDATES) if "oracle" in names else None
    _time_arms(bench, cfg=run_cfg, results=results, sampler=sampler)
    _compare_with_target(results, sampled=cfg.sampling is not None)
    ordered = [results[n] for n in bench.arms]
    profile = None
    if sampler is not None:  # one long-lookahead pass: the oracle, and what replay predicts
        profile = _replay_arms(bench, cfg=run_cfg, ordered=ordered, sampler=sampler)
    return _report(bench, cfg=cfg, ordered=ordered, profile=profile)


@dataclass
class _Bench:
    """What every timed round runs on, set up once before any is timed."""

    prompts: list[Prompt]
    pair: Any
    arms: dict[str, Arm]
    """Every arm by name, in the order of the first round (later rounds rotate it)."""
    policies: dict[str, ArmPlan]
    """Each uag speculative arm's plan factory: what exact replay runs for its prediction."""
    lengths: tuple[int, ...] | None
    """The copy lengths ``+lookup`` arms use (``uag calibrate``'s; None: the built-in ones)."""
    cfg: BenchConfig
    """The configuration the runs use: the prompts are rendered, so ``chat`` is off."""


def _seeded(cfg: BenchConfig, *, names: list[str]) -> BenchConfig:
    """``cfg`` with round 0's seed drawn now when sampling without one, so the report records
    the seed the run used (greedy: ``cfg`` as it is). Refuses the oracle under sampling: it
    replays greedy runs."""
    sampling = cfg.sampling
    if sampling is not None and "oracle" in names:
        raise UagError("policy 'oracle' is a replay of greedy runs: leave it out with --sample")
    if sampling is None:
        return cfg
    seed0 = sampling.seed if sampling.seed is not None else secrets.randbits(31)
    return replace(cfg, sampling=replace(sampling, seed=seed0))  # recorded in the report


def _first_seed(cfg: BenchConfig) -> int | None:
    """Round 0's seed (``_seeded``'s), or None for greedy runs; round r runs with seed + r."""
    return None if cfg.sampling is None else cfg.sampling.seed


def _set_up(cfg: BenchConfig, *, names: list[str], extra_arms: dict[str, Arm] | None) -> _Bench:
    """The prompts, the pair and the arms on it (``extra_arms`` after the named ones). The
    calibrated copy lengths are looked up only when an arm copies (it may print a note)."""
    loaded = load_prompts(cfg.prompts, text_column=cfg.text_column, limit=cfg.limit)
    pair = cfg.load_pair()
    # Rendered once (conversations and --chat through the target's template): every arm and
    # replay read the same text, and nothing downstream wraps it again.
    prompts = [replace(p, text=as_text(pair, p, chat=cfg.chat), messages=None) for p in loaded]
    cfg = replace(cfg, chat=False)
    policies: dict[str, ArmPlan] = {}
    lengths = None
    if any(parse_policy(name).lookup for name in names):
        lengths = lookup_lengths(pair, quiet=not cfg.progress)
    arms = build_arms(
        names,
        pair,
        cfg,
        prompt_ids=[p.id for p in prompts],
        policies=policies,
        lookup_lengths=lengths,
    )
    arms.update(extra_arms or {})
    return _Bench(
        prompts=prompts, pair=pair, arms=arms, policies=policies, lengths=lengths, cfg=cfg
    )


def _time_arms(
    bench: _Bench, *, cfg: BenchConfig, results: dict[str, PolicyResult], sampler: Any
) -> None:
    """Every arm on every prompt, ``cfg.repeats`` times, into ``results``. Each round runs
    every arm once with the same seed, in an order rotated round by round, so machine drift
    and position effects hit the arms alike; ``sampler`` (the oracle's latency profile, or
    None) takes a slice after every prompt, so drift reaches replay's prices too."""
    total = len(bench.prompts) * cfg.repeats * len(bench.arms)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not cfg.progress)
    order = list(bench.arms)
    seed0 = _first_seed(cfg)
    rounds = 0
    for prompt in bench.prompts:
        for res in results.values():
            res.per_prompt_seconds.append(0.0)
            res.per_prompt_tokens.append(0)
        for _ in range(cfg.repeats):
            runs: dict[str, ArmRun] = {}
            seed = None if seed0 is None else seed0 + rounds  # the same for every arm
            for name in rotated(order, rounds):  # each prompt runs every arm, order rotated
                runs[name] = bench.arms[name](prompt.text, budget(prompt, cfg), seed)
                bar.update(1)
                bar.set_postfix(prompt=prompt.id[:20], arm=name)
            rounds += 1
            reference = runs["target-only"].ids
            if cfg.sampling is not None:  # scored after the timed runs, outside them
                _score_round(bench.pair, prompt, runs=runs, results=results, cfg=cfg, rounds=rounds)
            for name, run in runs.items():
                results[name].add(run, identical=run.ids == reference)
        if sampler is not None:
            sampler.sample(rounds=1)
    bar.close()


def _score_round(
    pair: Any,
    prompt: Prompt,
    *,
    runs: dict[str, ArmRun],
    results: dict[str, PolicyResult],
    cfg: BenchConfig,
    rounds: int,
) -> None:
    """Sampling: each arm's samples of this round scored under the target's distribution (its
    mean log-probability, PIT values and excess log-probability), what the distribution checks
    test; the PIT's uniforms are seeded by the round and the arm, so scoring is reproducible."""
    assert cfg.sampling is not None
    prompt_ids, _ = _encoded(pair, prompt.text, chat=cfg.chat)
    for arm_index, (name, run) in enumerate(runs.items()):
        scored = score_run(pair, prompt_ids, run.ids, cfg.sampling, seed=rounds * 1009 + arm_index)
        results[name].logprobs.append(scored.mean_logprob)
        results[name].pit.extend(scored.pit)
        results[name].scored.append((scored.excess, scored.variance))


def _compare_with_target(results: dict[str, PolicyResult], *, sampled: bool) -> None:
    """Each arm against target-only: its speed-up with a 95 % interval paired by prompt and,
    ``sampled``, the distribution checks (paired log-probability, PIT uniformity, excess)."""
    base = results["target-only"]
    for res in results.values():
        res.speedup_vs_target = rate_ratio(res, base)
        if res.seconds:
            res.interval = bootstrap_interval(
                base.per_prompt_seconds,
                res.per_prompt_seconds,
                base_tokens=base.per_prompt_tokens,
                arm_tokens=res.per_prompt_tokens,
            )
        if sampled:
            res.check = paired_check(base.logprobs, res.logprobs)
            res.uniformity = uniformity_check(res.pit)
            res.excess = ExcessCheck(
                tokens=len(res.pit),
                excess=sum(e for e, _ in res.scored),
                variance=sum(v for _, v in res.scored),
            )


def _replay_arms(
    bench: _Bench, *, cfg: BenchConfig, ordered: list[PolicyResult], sampler: Any
) -> dict[str, Any]:
    """The oracle arm's pass: each measured uag arm gets exact replay's prediction, and the
    simulated arms (the oracle, the plan oracle) join ``ordered``. Returns the latency profile
    replay priced with, with how many slices and timed rounds its medians are over."""
    data, profile, prefill = _replay_pass(bench.pair, bench.prompts, cfg, sampler)
    predicted = _exact_predictions(bench.pair, bench.prompts, cfg, bench.policies, profile)
    for res in ordered:
        if res.name == "target-only" and res.name in predicted:
            res.predicted_seconds = predicted[res.name][2]
        elif res.name in predicted:
            res.predicted, res.predicted_forwards, res.predicted_seconds = predicted[res.name]
    measured = profile.to_dict() | {"slices": sampler.slices, "rounds": sampler.rounds}
    oracle = _predict_oracle(data, profile, prefill)
    ordered.append(PolicyResult("oracle", simulated=True, speedup_vs_target=oracle or 1.0))
    ordered.append(
        PolicyResult(PLAN_ORACLE, simulated=True, speedup_vs_target=predicted[PLAN_ORACLE][0])
    )
    return measured


def _report(
    bench: _Bench,
    *,
    cfg: BenchConfig,
    ordered: list[PolicyResult],
    profile: dict[str, Any] | None,
) -> BenchReport:
    """The report: the arms in order, the machine, and the settings as run (the copy lengths
    and the draft vocabulary the pair used, beside what was asked)."""
    pair = bench.pair
    machine = (
        f"{recipes.machine_id()} ({platform.machine()}, {recipes.cpu_isa()}), torch "
        f"{torch.__version__}, device {pair.target.device}"
    )
    config = {
        k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k != "progress"
    }
    config["lookup_lengths"] = list(bench.lengths or PromptLookup().max_tokens)
    config["draft_vocab_used"] = pair.draft_vocab  # ``draft_vocab`` is what was asked (None)
    return BenchReport(
        policies=ordered,
        machine=machine,
        prompts=len(bench.prompts),
        config=config,
        profile=profile,
        categories=[p.category for p in bench.prompts],
    )


def budget(prompt: Prompt, cfg: BenchConfig) -> int:
    """New tokens for ``prompt``: its own budget where its set gives one, else the run's."""
    return prompt.max_new_tokens or cfg.max_new_tokens


def _encoded(pair: Any, prompt: str, *, chat: bool) -> tuple[list[int], list[int]]:
    """The prompt as uag's loop sees it: (target ids, assistant ids)."""
    return encode_prompt(pair, render_prompt(pair, prompt, chat=chat))


def _git_commit() -> str:
    """The checkout's commit (``+dirty`` when tracked files changed), or ``unknown``: never fails."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _command_line(argv: list[str]) -> str:
    """``argv`` as a shell line; the entry point (``.venv/bin/uag``, ``uag/__main__.py``) as ``uag``."""
    if not argv:
        return "unknown"
    first = Path(argv[0])
    prog = "uag" if first.name == "uag" or first.parent.name == "uag" else argv[0]
    return shlex.join([prog, *argv[1:]])


def write_report(
    report: BenchReport, out: Path, *, command: str | None = None, now: datetime | None = None
) -> None:
    """A dated report under ``out``: results.json, results.md, speedup.png and TensorBoard scalars.

    Both files carry the date (UTC), the git commit (``unknown`` outside a checkout), the machine
    and the command line (``command``; default: this process's own), so a page can cite the
    file instead of copying its table."""
    # Matplotlib and TensorBoard take seconds to import: only a report pays.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.utils.tensorboard import SummaryWriter

    when = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    run = {
        "date_utc": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _git_commit(),
        "machine": report.machine,
        "command": command if command is not None else _command_line(sys.argv),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"run": run, **report.to_json()}, indent=2))
    lengths = "/".join(str(n) for n in report.config.get("lookup_lengths", []))
    vocab = report.config.get("draft_vocab_used")
    header = (
        f"# uag bench, {run['date_utc']}\n\n"
        f"- command: `{run['command']}`\n"
        f"- commit: `{run['commit']}`\n"
        f"- machine: {run['machine']}\n"
        f"- {report.prompts} prompts, {report.config.get('max_new_tokens')} new tokens, "
        f"lookup copies {lengths or '-'}, "
        f"drafts from {'every id' if not vocab else f'the first {vocab:,} ids'}\n\n"
    )
    (out / "results.md").write_text(header + report.markdown() + "\n")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [p.name + (" (sim)" if p.simulated else "") for p in report.policies]
    values = [p.speedup_vs_target for p in report.policies]
    colors = [
        "#999" if p.simulated else ("#c33" if not p.sound else "#36c") for p in report.policies
    ]
    ax.bar(names, values, color=colors)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speed-up vs target-only")
    ax.set_title(f"uag bench, {run['date_utc']}, {run['commit'][:12]}: {report.prompts} prompts")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)
    writer = SummaryWriter(log_dir=str(out / "tensorboard"))
    for i, p in enumerate(report.policies):
        writer.add_scalar(f"bench/speedup_vs_target/{p.name}", p.speedup_vs_target, i)
    writer.add_text("bench/results", report.markdown())
    writer.close()
