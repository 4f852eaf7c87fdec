"""Re-pricing: the same recorded runs replayed under another machine's prices (simulated).

Why: on this CPU an assistant step costs a third of a target step and each verify row ~5 % of
one, so copies win and drafts rarely pay. On a GPU with a 1–8B target a draft step costs a tenth
or a thirtieth of a target step and a verify costs about the same for 1–16 rows: the best plan
there is another one. Exact replay (``uag.harness.dryrun``) makes every greedy arm's rounds
without the target; pricing them with a synthetic profile says what each arm would cost there.
The learned plan's network estimates tokens, not seconds, so re-pricing it is its cost rule
rebuilt for those prices (the profile its choice prices with, and Dinkelbach's R iterated to
its own replayed rate there); the fixed arms are what they are; the oracle plan is rebuilt too.

Every figure here is **simulated**: rounds are exact, their prices are the synthetic profile's.

    python -m scripts.reprice --controller exports/ctrl.onnx \\
        --prompts humaneval:test+mixed:test --limit 15 --out runs/reprice.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from controllers.learned_plan import LearnedPlan
from controllers.spec import parse_policy
from uag.decoding.profile import LatencyProfile
from uag.harness import dryrun
from uag.harness.jobs import RunConfig
from uag.harness.plan_collect import OraclePlan, default_actions
from uag.harness.prompts import load_prompts

FIXED_ARMS = (
    "lookup",
    "static-1",
    "static-2",
    "static-4",
    "static-2+lookup",
    "static-4+lookup",
    "static-6+lookup",
    "static-2+lookup-3",
)
DRAFT_FRACTIONS = (3, 10, 30)
FLAT_ROW = 0.02
"""A verify row's cost beyond the first, as a share of a target step, at the synthetic prices
(a GPU's verify is nearly flat in its rows)."""


def synthetic_profile(base: LatencyProfile, *, draft_fraction: float) -> LatencyProfile:
    """``base``'s target step and bookkeeping; an assistant step (and a catch-up row) costing
    ``1 / draft_fraction`` of a target step; a verify of ``m`` candidates costing
    ``(1 + FLAT_ROW · m)`` target steps."""
    step = base.target_step_s
    return replace(
        base,
        device=f"synthetic: draft 1/{draft_fraction:g} of a step, flat verify",
        draft_s=step / draft_fraction,
        feed_row_s=step / draft_fraction / 4,
        catchup_s=0.0,
        verify_s=[step * (1 + FLAT_ROW * m) for m in range(len(base.verify_s))],
        stats_s=0.0,
    )


@dataclass(frozen=True)
class Recorded:
    """One prompt's target-alone record and the assistant's prompt ids."""

    trace: dryrun.TargetTrace
    assistant_ids: list[int]


def _speedup(
    pair: Any,
    recorded: Sequence[Recorded],
    profile: LatencyProfile,
    make: Callable[[Recorded], Any],
) -> float:
    """Replay's speed-up of the plan ``make(prompt)`` over the prompts at ``profile``."""
    runs = [
        dryrun.replay(pair, r.trace, make(r), prompt_assistant_ids=r.assistant_ids, profile=profile)
        for r in recorded
    ]
    traces = [r.trace for r in recorded]
    return dryrun.predicted_speedup(runs, traces, profile, timed_policy=False)


def _fixed(name: str) -> Callable[[Recorded], Any]:
    spec = parse_policy(name)
    return lambda r: spec.plan()


def reprice_row(
    pair: Any,
    recorded: Sequence[Recorded],
    profile: LatencyProfile,
    *,
    controller: Path,
    iterations: int = 2,
) -> dict[str, float]:
    """Every arm's simulated speed-up over target-alone at ``profile``'s prices."""
    out: dict[str, float] = {}
    for name in FIXED_ARMS:
        out[name] = _speedup(pair, recorded, profile, _fixed(name))
    base = LearnedPlan(controller)
    rate = base.info.rate_factor / profile.target_step_s
    for _ in range(iterations):  # Dinkelbach: R → the plan's own rate at these prices

        def make_plan(r: Recorded, rate: float = rate) -> LearnedPlan:
            plan = LearnedPlan(controller, session=base.session)
            plan.profile, plan.rate = profile, rate
            return plan

        out["learned (re-priced)"] = _speedup(pair, recorded, profile, make_plan)
        rate = out["learned (re-priced)"] / profile.target_step_s
    actions = default_actions()
    rate = 2.0 / profile.target_step_s
    for _ in range(iterations):

        def make_oracle(r: Recorded, rate: float = rate) -> OraclePlan:
            return OraclePlan(
                trace=r.trace, actions=actions, profile=profile, rate=rate, eos=pair.target.eos_ids
            )

        out["oracle-plan"] = _speedup(pair, recorded, profile, make_oracle)
        rate = out["oracle-plan"] / profile.target_step_s
    return out


def reprice_table(
    pair: Any,
    recorded: Sequence[Recorded],
    base: LatencyProfile,
    *,
    controller: Path,
    fractions: Sequence[float] = DRAFT_FRACTIONS,
) -> list[dict[str, Any]]:
    """One row per price point: this machine's measured profile, then each synthetic one."""
    rows = [
        {
            "prices": f"measured ({base.device})",
            **reprice_row(pair, recorded, base, controller=controller),
        }
    ]
    for f in fractions:
        profile = synthetic_profile(base, draft_fraction=f)
        rows.append(
            {
                "prices": profile.device,
                **reprice_row(pair, recorded, profile, controller=controller),
            }
        )
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table, each learned figure beside the best fixed arm's (all simulated)."""
    arms = [k for k in rows[0] if k != "prices"]
    lines = [
        "| prices (simulated) | " + " | ".join(arms) + " | learned / best fixed |",
        "|---|" + "---|" * (len(arms) + 1),
    ]
    for row in rows:
        best = max(row[a] for a in FIXED_ARMS)
        cells = " | ".join(f"{row[a]:.2f}x" for a in arms)
        lines.append(f"| {row['prices']} | {cells} | {row['learned (re-priced)'] / best:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.reprice",
        description="Replay recorded greedy runs under synthetic prices (draft 1/3, 1/10, 1/30 "
        "of a target step, a flat verify): every fixed arm, the re-priced learned plan and the "
        "oracle plan; simulated figures.",
    )
    parser.add_argument("--controller", type=Path, required=True, help="a plan controller (.onnx)")
    parser.add_argument("--prompts", default="humaneval:test+mixed:test")
    parser.add_argument("--limit", type=int, default=15)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("runs/reprice.json"))
    args = parser.parse_args(argv)
    from uag.api import encode_prompt, render_prompt

    cfg = RunConfig(prompts=args.prompts, out=args.out.parent, limit=args.limit)
    pair = cfg.load_pair()
    recorded = []
    for p in load_prompts(args.prompts, limit=args.limit):
        target_ids, assistant_ids = encode_prompt(pair, render_prompt(pair, p.text, chat=False))
        trace = dryrun.record_trace(pair, target_ids, args.max_new_tokens)
        recorded.append(Recorded(trace=trace, assistant_ids=assistant_ids))
    # The plan's own profile (measured when its data was collected): the same prices it was
    # trained at, and no timing taken on a machine that may be busy now.
    base = LearnedPlan(args.controller).profile
    rows = reprice_table(pair, recorded, base, controller=args.controller)
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompts": len(recorded), "rows": rows}, indent=1))
    print(f"{len(recorded)} prompts, {args.max_new_tokens} tokens; every figure simulated")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
