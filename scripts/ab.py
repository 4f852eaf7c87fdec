"""Two builds of uag, interleaved on the same prompts: same tokens? same speed?

    python -m scripts.ab --old /tmp/old-checkout --new . \\
        --prompts humaneval:test+mixed:test --limit 15 --repeats 2 \\
        --policies target-only,static-2,learned,lookup,learned+lookup

Why this shape: two builds cannot share a process (same module names), so each runs in its
own worker process (``scripts.ab_worker``) and the driver sends every (prompt, arm) to both,
one after the other, alternating which goes first. Measured here, the *process* matters too: of
two identical builds, the one in the worker started second ran 0-8 % slower (memory placement
of its streamed weights, most likely). So the run is made twice with the workers' start order
swapped, and each prompt's ratio is the geometric mean of the two, which cancels a fixed
per-slot factor: ``sqrt((new/old | old first) * (new/old | new first))``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("ab_worker.py")


@dataclass(frozen=True)
class Pairing:
    """One (prompt, arm) run on both builds."""

    half: int
    """0: the old build's worker started first; 1: the new build's."""
    prompt: int
    arm: str
    old_s: float
    new_s: float
    same: bool
    tokens: int


def _worker(root: Path, args: argparse.Namespace) -> subprocess.Popen[str]:
    command = [sys.executable, str(WORKER), "--prompts", args.prompts, "--policies", args.policies]
    if args.limit is not None:
        command += ["--limit", str(args.limit)]
    command += ["--max-new-tokens", str(args.max_new_tokens)]
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.Popen(
        command, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _ask(worker: subprocess.Popen[str], prompt: int, arm: str) -> dict[str, object]:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(json.dumps({"prompt": prompt, "arm": arm}) + "\n")
    worker.stdin.flush()
    answer: dict[str, object] = json.loads(worker.stdout.readline())
    return answer


def run_half(args: argparse.Namespace, *, half: int) -> list[Pairing]:
    """Every prompt and arm on both builds, ``args.repeats`` times, arm order rotated per
    prompt; workers started old then new (``half`` 0) or new then old (1)."""
    roots = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    order = ["old", "new"] if half == 0 else ["new", "old"]
    workers = {build: _worker(roots[build], args) for build in order}
    counts = []
    for build in order:
        stdout = workers[build].stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise SystemExit(f"ab: the {build} build's worker failed to start (see its stderr)")
        counts.append(json.loads(line)["ready"])
    if counts[0] != counts[1]:
        raise SystemExit(f"ab: the builds loaded different prompt counts: {counts}")
    arms = args.policies.split(",")
    rows: list[Pairing] = []
    k = 0
    for _ in range(args.repeats):
        for prompt in range(counts[0]):
            for i, arm in enumerate(arms[k % len(arms) :] + arms[: k % len(arms)]):
                first = ("old", "new") if (k + i) % 2 == 0 else ("new", "old")
                got = {build: _ask(workers[build], prompt, arm) for build in first}
                rows.append(
                    Pairing(
                        half=half,
                        prompt=prompt,
                        arm=arm,
                        old_s=float(got["old"]["seconds"]),  # type: ignore[arg-type]
                        new_s=float(got["new"]["seconds"]),  # type: ignore[arg-type]
                        same=got["old"]["ids"] == got["new"]["ids"],
                        tokens=len(got["new"]["ids"]),  # type: ignore[arg-type]
                    )
                )
            k += 1
            print(f"ab: half {half}, prompt {prompt + 1}/{counts[0]}", file=sys.stderr, flush=True)
    for worker in workers.values():
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()
    return rows


def slot_cancelled(rows: list[Pairing], arm: str) -> list[float]:
    """Per prompt: the geometric mean of new/old time over the two halves (missing half: that
    half alone)."""
    totals: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        if r.arm == arm:
            t = totals.setdefault((r.half, r.prompt), [0.0, 0.0])
            t[0] += r.old_s
            t[1] += r.new_s
    ratios: dict[int, list[float]] = {}
    for (_, prompt), (old, new) in totals.items():
        ratios.setdefault(prompt, []).append(new / old)
    return [math.exp(statistics.fmean(math.log(x) for x in r)) for r in ratios.values()]


def table(rows: list[Pairing], arms: list[str], *, seed: int = 0) -> str:
    """Markdown: per arm the median slot-cancelled new/old time with a 95 % bootstrap interval
    over prompts, each half's own median, and how many runs gave identical tokens."""
    rng = random.Random(seed)
    lines = [
        "| arm | new/old time (median over prompts, 95 % interval) | old first | new first "
        "| identical tokens |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        per = slot_cancelled(rows, arm)
        boots = sorted(statistics.median(rng.choices(per, k=len(per))) for _ in range(4000))
        halves = []
        for half in (0, 1):
            ratios = slot_cancelled([r for r in rows if r.half == half], arm)
            halves.append(f"{statistics.median(ratios):.3f}" if ratios else "-")
        same = [r.same for r in rows if r.arm == arm]
        lines.append(
            f"| {arm} | {statistics.median(per):.3f} ({boots[100]:.3f}–{boots[3899]:.3f}) "
            f"| {halves[0]} | {halves[1]} | {sum(same)}/{len(same)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.ab",
        description="interleaved A/B of two uag checkouts on the same prompts and arms "
        "(tokens compared, time ratios with the worker-slot effect cancelled)",
    )
    parser.add_argument("--old", required=True, help="the baseline checkout's root")
    parser.add_argument("--new", required=True, help="the checkout to compare with it")
    parser.add_argument("--prompts", required=True, help="as uag bench --prompts")
    parser.add_argument("--limit", type=int, default=None, help="as uag bench --limit")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--policies", default="target-only,static-2,learned,lookup,learned+lookup")
    parser.add_argument("--repeats", type=int, default=1, help="per half (default: 1)")
    parser.add_argument("--out", type=Path, default=None, help="write every pairing as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    rows = run_half(args, half=0) + run_half(args, half=1)
    if args.out is not None:
        args.out.write_text(json.dumps([r.__dict__ for r in rows]))
    print(table(rows, args.policies.split(",")))


if __name__ == "__main__":
    main()
