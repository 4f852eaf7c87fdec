"""Whole-run exact replay of a plan on a collection's prompts (the harness floor: it loads the
pair the collection ran, which training must not): what ``uag train-controller`` tunes a greedy
plan's R with and reports on the report prompts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from training.plan import PlanData
from uag.decoding.lookup import PromptLookup


def replayer(data: PlanData) -> Callable[..., dict[str, float]]:
    """``replay(onnx, prompt_ids, *, grid)`` on ``data``'s pair, loaded once."""
    pair = load_collection_pair(data)

    def replay(onnx: Path, prompt_ids: list[str], *, grid: Sequence[float]) -> dict[str, float]:
        return replay_figures(onnx, data, prompt_ids, grid=grid, pair=pair)

    return replay


def replay_figures(
    onnx: Path,
    data: PlanData,
    prompt_ids: list[str],
    *,
    grid: Sequence[float],
    pair: Any,
) -> dict[str, float]:
    """Whole-run exact replay (``uag.harness.dryrun``) on ``prompt_ids``: speed-up over the
    target alone, priced by the collection's profile, of prompt lookup alone and of the plan at
    each R of ``grid`` (``learned@R``), every round the real loop's. Greedy only."""
    from controllers.learned_plan import LearnedPlan
    from controllers.plans import RulePlan
    from uag.api import encode_prompt, render_prompt
    from uag.harness import dryrun

    settings = data.meta.get("settings", {})
    tokens = int(settings.get("max_new_tokens", 128))
    profile = data.profile
    recorded = []
    for prompt_id in prompt_ids:
        text = data.texts[prompt_id]
        target_ids, assistant_ids = encode_prompt(
            pair, render_prompt(pair, text, chat=bool(settings.get("chat", False)))
        )
        recorded.append((dryrun.record_trace(pair, target_ids, tokens), assistant_ids))
    traces = [t for t, _ in recorded]

    def speed(make: Any) -> float:
        runs = [
            dryrun.replay(pair, t, make(), prompt_assistant_ids=a, profile=profile)
            for t, a in recorded
        ]
        return dryrun.predicted_speedup(runs, traces, profile, timed_policy=False)

    out = {"lookup": speed(lambda: RulePlan(None, lookup=PromptLookup()))}
    first = LearnedPlan(onnx)
    for factor in grid:

        def make(factor: float = factor) -> LearnedPlan:
            plan = LearnedPlan(onnx, session=first.session)
            plan.rate = factor / profile.target_step_s
            return plan

        out[f"learned@{factor:g}"] = speed(make)
    return out


def load_collection_pair(data: PlanData) -> Any:
    """The pair a collection ran (its settings), for whole-run replay."""
    from uag.api import load_pair

    settings = data.meta.get("settings", {})
    return load_pair(
        settings.get("target", "gemma-3-270m"),
        settings.get("assistant", "smollm2-135m"),
        assistant_int8=settings.get("assistant_int8"),
        kernels=settings.get("kernels", "auto"),
        draft_vocab=settings.get("draft_vocab"),
    )
