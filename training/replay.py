"""Replay: estimate any stop policy's speed from collected iterations and a latency profile.

``uag collect`` drafts ``L`` tokens every iteration and records, per drafted token, its features,
whether it was accepted, and how many target candidates the draft had become. Because acceptance
is monotone within an iteration, what *any* policy would have got there follows from where it
stops, ``j`` (0 ≤ j ≤ L):

* accepted drafts: ``min(j, a)`` where ``a`` is the iteration's accepted count;
* target tokens emitted: the candidates of the accepted prefix plus the one token the target
  always adds, ``tt(min(j, a)) + 1`` (``tt(k)``: target candidates of the first k drafts);
* cost: ``j`` draft steps plus one verification of ``tt(j)`` candidates, plus what the loop
  pays around them (``LatencyProfile.round_cost``: the round's bookkeeping, and the catch-up rows
  its first draft step feeds); a skipped round (``j = 0``) pays a plain step and the bookkeeping.

Throughput is Σ emitted / Σ cost over all iterations (the usual assumption that iterations are
exchangeable: a policy's choices do not change which text comes next, only how it is cut).
Target-alone decoding pays one plain target step per token, so speed-up = throughput × step cost;
given the prefill a run pays before its first round (``Prefill``), both sides pay it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from controllers.cost import CostRule, CostState
from training.data import Collected
from uag.decoding.profile import LatencyProfile


@dataclass(frozen=True)
class Iterations:
    """Collected iterations as padded [I, L] matrices (rows past an iteration's draft: NaN)."""

    accepted: np.ndarray
    """[I] accepted drafts per iteration (the oracle stop point)."""
    drafted: np.ndarray
    """[I] tokens drafted per iteration."""
    target_tokens: np.ndarray
    """[I, L + 1] target candidates of the first k drafts (column 0 is 0)."""
    values: dict[str, np.ndarray]
    """[I, L] per-position values (feature columns, scores)."""
    gate: np.ndarray | None = None
    """[I] pre-draft score per iteration (P(first drafted token accepted) from its gate row)."""

    @property
    def max_len(self) -> int:
        return int(self.target_tokens.shape[1] - 1)


def build_iterations(
    data: Collected, scores: np.ndarray | None = None, gate_scores: np.ndarray | None = None
) -> Iterations:
    """Group rows by (prompt, iteration); ``scores`` (e.g. P(accept)) ride along as ``score``,
    and ``gate_scores`` (per row; read on each iteration's first row) as the iteration's gate."""
    keys = np.char.add(
        np.char.add(data.prompt_ids.astype(str), "\x00"), data.columns["iteration"].astype(str)
    )
    uniq, inv = np.unique(keys, return_inverse=True)
    pos = data.columns["position"].astype(int)
    n_iter, max_len = len(uniq), int(pos.max())
    names = list(data.feature_names)
    values = {n: np.full((n_iter, max_len), np.nan) for n in names}
    for j, n in enumerate(names):
        values[n][inv, pos - 1] = data.features[:, j]
    if scores is not None:
        values["score"] = np.full((n_iter, max_len), np.nan)
        values["score"][inv, pos - 1] = scores
    target_tokens = np.zeros((n_iter, max_len + 1))
    target_tokens[:, 1:] = np.nan
    target_tokens[inv, pos] = data.features[:, names.index("target_tokens")]
    accepted = np.zeros(n_iter, dtype=int)
    accepted[inv] = data.columns["iter_accepted_drafts"].astype(int)
    drafted = np.zeros(n_iter, dtype=int)
    np.maximum.at(drafted, inv, pos)
    # A drafted count shorter than L (assistant EOS) leaves NaN: carry the last count forward.
    for k in range(1, max_len + 1):
        gap = np.isnan(target_tokens[:, k])
        target_tokens[gap, k] = target_tokens[gap, k - 1]
    gate = None
    if gate_scores is not None:
        gate = np.full(n_iter, np.nan)
        first = pos == 1
        gate[inv[first]] = gate_scores[first]
    return Iterations(
        accepted=accepted, drafted=drafted, target_tokens=target_tokens, values=values, gate=gate
    )


@dataclass(frozen=True)
class SimResult:
    name: str
    tokens_per_s: float
    speedup: float
    """Versus target-alone decoding on the same hardware profile."""
    mean_drafted: float
    acceptance: float


@dataclass(frozen=True)
class Prefill:
    """Seconds the replayed runs spent before their first round, summed over prompts."""

    target_s: float = 0.0
    """The target's prompt pass (target-alone pays it too)."""
    assistant_s: float = 0.0
    """The assistant's prompt pass (only speculative runs pay it)."""


def simulate(
    its: Iterations,
    stop_at: np.ndarray,
    profile: LatencyProfile,
    name: str,
    *,
    prefill: Prefill | None = None,
) -> SimResult:
    """Throughput if each iteration had drafted ``stop_at[i]`` tokens (clipped to what was drafted)."""
    j = np.minimum(stop_at.astype(int), its.drafted)
    rows = np.arange(len(j))
    emitted = its.target_tokens[rows, np.minimum(j, its.accepted)] + 1
    verify_table = np.array(
        [profile.verify(m) for m in range(int(np.nanmax(its.target_tokens)) + 1)]
    )
    cost = (
        profile.round_s
        + (j > 0) * profile.catchup_s
        + j * profile.draft_s
        + verify_table[its.target_tokens[rows, j].astype(int)]
    )
    pre = prefill or Prefill()
    seconds = float(cost.sum()) + pre.target_s + pre.assistant_s
    tps = float(emitted.sum()) / seconds
    alone = float(emitted.sum()) * profile.target_step_s + pre.target_s
    drafted = float(j.sum())
    return SimResult(
        name=name,
        tokens_per_s=tps,
        speedup=alone / seconds,
        mean_drafted=drafted / len(j),
        acceptance=float(np.minimum(j, its.accepted).sum() / drafted) if drafted else 0.0,
    )


def first_stop(its: Iterations, stop: np.ndarray) -> np.ndarray:
    """Position after which a rule stops (the stopping token is still verified); L if never."""
    hit = np.nan_to_num(stop.astype(float), nan=0.0) > 0
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, its.max_len)


def static(
    its: Iterations, profile: LatencyProfile, k: int, *, prefill: Prefill | None = None
) -> SimResult:
    return simulate(its, np.full(len(its.accepted), k), profile, f"static-{k}", prefill=prefill)


def oracle(
    its: Iterations, profile: LatencyProfile, *, prefill: Prefill | None = None
) -> SimResult:
    """Drafts exactly the tokens that will be accepted (none when none will): the ceiling."""
    return simulate(its, its.accepted, profile, "oracle", prefill=prefill)


def threshold_rule(
    its: Iterations,
    profile: LatencyProfile,
    *,
    column: str,
    threshold: float,
    below: bool,
    name: str,
) -> SimResult:
    vals = its.values[column]
    stop = vals < threshold if below else vals > threshold
    return simulate(its, first_stop(its, stop), profile, name)


def best_threshold(
    its: Iterations,
    profile: LatencyProfile,
    *,
    column: str,
    below: bool,
    grid: np.ndarray,
    name: Callable[[float], str],
) -> tuple[float, SimResult]:
    """The threshold on ``column`` that maximises simulated throughput."""
    results = [
        (
            float(t),
            threshold_rule(
                its, profile, column=column, threshold=float(t), below=below, name=name(float(t))
            ),
        )
        for t in grid
    ]
    return max(results, key=lambda r: r[1].tokens_per_s)


def best_static_k(its: Iterations, profile: LatencyProfile) -> int:
    """The static lookahead with the most simulated tokens per second."""
    return max(range(1, its.max_len + 1), key=lambda k: static(its, profile, k).tokens_per_s)


def best_static(its: Iterations, profile: LatencyProfile) -> SimResult:
    return static(its, profile, best_static_k(its, profile))


def learned(
    its: Iterations,
    profile: LatencyProfile,
    *,
    stop_below: float,
    gate_below: float,
    prefill: Prefill | None = None,
) -> SimResult:
    """The learned controller: skip drafting when the gate score is below ``gate_below``, else
    draft until a token scores below ``stop_below`` (that token is still verified)."""
    j = first_stop(its, its.values["score"] < stop_below)
    if its.gate is not None:
        j = np.where(np.nan_to_num(its.gate, nan=1.0) < gate_below, 0, j)
    name = f"learned (stop<{stop_below:.2f}, skip<{gate_below:.2f})"
    return simulate(its, j, profile, name, prefill=prefill)


def best_learned(
    its: Iterations,
    profile: LatencyProfile,
    grid: np.ndarray | None = None,
    *,
    gate: bool = True,
) -> tuple[float, float, SimResult]:
    """(stop threshold, gate threshold, result) maximising simulated throughput; ``gate=False``
    keeps the gate threshold at 0 (never skip a round)."""
    grid = PROB_GRID if grid is None else grid
    gates = np.concatenate([[0.0], grid]) if gate and its.gate is not None else np.array([0.0])
    best: tuple[float, float, SimResult] | None = None
    for g in gates:
        for t in grid:
            res = learned(its, profile, stop_below=float(t), gate_below=float(g))
            if best is None or res.tokens_per_s > best[2].tokens_per_s:
                best = (float(t), float(g), res)
    assert best is not None
    return best


def cost_rule(
    profile: LatencyProfile, *, rate_factor: float, max_lookahead: int, logit_shift: float
) -> CostRule:
    """The ``cost`` decision priced with ``profile`` (what the exported controller carries)."""
    return CostRule.from_profile(
        profile.to_dict(),
        rate_factor=rate_factor,
        max_lookahead=max_lookahead,
        logit_shift=logit_shift,
    )


def cost_stops(its: Iterations, rule: CostRule, *, gate: bool) -> np.ndarray:
    """Where the ``cost`` decision stops in each iteration (0: skipped), through the very
    ``CostState`` the runtime policy uses, one iteration at a time."""
    scores, tt = its.values["score"], its.target_tokens
    stops = np.zeros(len(its.accepted), dtype=int)
    state = CostState(rule)
    for i in range(len(stops)):
        g = its.gate[i] if gate and its.gate is not None else np.nan
        if not state.start(None if np.isnan(g) else float(g)):
            continue
        j = 1
        while j < its.drafted[i] and state.keep_going(
            score=float(scores[i, j - 1]), position=j, candidates=float(tt[i, j])
        ):
            j += 1
        stops[i] = j if j < its.drafted[i] else its.max_len
    return stops


def learned_by_cost(
    its: Iterations, profile: LatencyProfile, rule: CostRule, *, gate: bool
) -> SimResult:
    name = f"learned (cost, rate {rule.rate_factor:.2f}x{'' if gate else ', no skip'})"
    return simulate(its, cost_stops(its, rule, gate=gate), profile, name)


def rate_fixed_point(
    its: Iterations,
    profile: LatencyProfile,
    *,
    max_lookahead: int,
    logit_shift: float,
    gate: bool,
    rounds: int = 12,
) -> tuple[float, SimResult]:
    """κ and the result of the ``cost`` decision that prices time at its own simulated rate.

    Dinkelbach's iteration: start at the target-alone rate (κ = 1), simulate, set κ to the
    speed-up found, repeat until it settles. No grid is searched, so nothing is tuned to the
    noise of the prompts it runs on beyond this one number."""
    kappa, result = 1.0, None
    for _ in range(rounds):
        rule = cost_rule(
            profile, rate_factor=kappa, max_lookahead=max_lookahead, logit_shift=logit_shift
        )
        result = learned_by_cost(its, profile, rule, gate=gate)
        if abs(result.speedup - kappa) < 1e-3:
            break
        kappa = max(result.speedup, 1e-3)
    assert result is not None
    return kappa, result


PROB_GRID = np.round(np.linspace(0.02, 0.98, 49), 4)
ENTROPY_GRID = np.round(np.linspace(0.1, 6.0, 60), 4)
