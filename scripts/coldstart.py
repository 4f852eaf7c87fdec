"""Cold start of two builds side by side: a one-token ``uag generate`` as a new process, with
prepared models, beside the import of torch and Transformers.

    git worktree add /tmp/cold-old 4504b17
    python -m scripts.coldstart --old /tmp/cold-old --new . --repeats 7

Why this shape: a cold start is a whole process (interpreter, imports, loading, exit), so each
run is a fresh ``python -m uag generate`` under the build's checkout (``PYTHONPATH``, as
``scripts.ab`` runs its two builds); the two builds and the import baseline take turns,
in an order rotated every repeat, so that a machine getting busier or quieter moves all three
alike, and each is reported as the median of its repeats.

Each build gets its own cache under ``--work`` (default ``/tmp/uag-coldstart``): prepared
files and tokenizer caches are keyed by the build's source, and two builds sharing one
``$UAG_CACHE`` would replace each other's on every start. The converted checkpoints, the GGUF
files and the compiled kernels are linked in from ``$UAG_CACHE``, not copied or converted
again, and one untimed start per build first prepares its models there (and faults the files
into the page cache: what a user's second start finds).

The baseline, ``import torch, transformers`` and then ``transformers.AutoModelForCausalLM``
and ``transformers.AutoTokenizer``: Transformers 5 imports lazily, so ``import transformers``
alone loads little; touching the two Auto classes loads what anyone starting a Transformers
generate pays before reading a file. The issue's bound is 2x that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from uag.paths import cache_root

GENERATE = ("-m", "uag", "generate", "--prompt", "hi", "--max-new-tokens", "1")
"""One token from the default pair (every other flag at its default); ``--target`` adds that
target with ``--policy target-only`` (issue 59's cold start of the 1.5B)."""
IMPORT = (
    "-c",
    "import torch, transformers; transformers.AutoModelForCausalLM; transformers.AutoTokenizer",
)
IMPORT_ARM = "import torch+transformers"
LIMIT_S = 4.0
"""The issue's bounds: at most 4 s, and at most ``LIMIT_RATIO`` times the import."""
LIMIT_RATIO = 2.0


@dataclass(frozen=True)
class Arm:
    """One thing timed: a command line run in ``cwd`` with ``env``."""

    name: str
    command: tuple[str, ...]
    cwd: Path
    env: dict[str, str]


def build_cache(root: Path, *, source: Path) -> Path:
    """A cache for one build at ``root``: ``source``'s converted checkpoints, GGUF files and
    compiled kernels linked in (uag's own files beside a checkpoint, which depend on the build,
    left out)."""
    for sub in ("gguf", "kernels"):
        if (source / sub).is_dir():
            (root / sub).mkdir(parents=True, exist_ok=True)
            for file in (source / sub).iterdir():
                _link(root / sub / file.name, file)
    models = source / "models"
    for checkpoint in sorted(models.iterdir()) if models.is_dir() else []:
        if not (checkpoint / "config.json").is_file():
            continue
        (root / "models" / checkpoint.name).mkdir(parents=True, exist_ok=True)
        for file in checkpoint.iterdir():
            if file.is_file() and not file.name.startswith("uag-"):
                _link(root / "models" / checkpoint.name / file.name, file)
    return root


def _link(at: Path, to: Path) -> None:
    if at.is_symlink() and at.resolve() == to.resolve():
        return
    at.unlink(missing_ok=True)
    at.symlink_to(to.resolve())


def generate_command(target: str | None) -> tuple[str, ...]:
    """The timed ``uag generate``: ``GENERATE``, on ``target`` alone where one is given."""
    return (
        GENERATE if target is None else (*GENERATE, "--target", target, "--policy", "target-only")
    )


def arms(args: argparse.Namespace) -> list[Arm]:
    """The old and the new build's one-token generate, each on its own cache, and the import."""
    out = []
    command = generate_command(args.target)
    for name, root in (("old", Path(args.old).resolve()), ("new", Path(args.new).resolve())):
        if not (root / "uag" / "cli.py").is_file():
            raise SystemExit(f"coldstart: {root} is not a uag checkout (no uag/cli.py)")
        cache = build_cache(args.work / name, source=args.cache)
        env = dict(os.environ, PYTHONPATH=str(root), UAG_CACHE=str(cache))
        out.append(Arm(name=f"{name} generate", command=command, cwd=root, env=env))
    out.append(Arm(name=IMPORT_ARM, command=IMPORT, cwd=Path.cwd(), env=dict(os.environ)))
    return out


def run(arm: Arm, *, timeout: float = 600) -> float:
    """Wall seconds of one run, as a user's shell times it (process start to exit)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *arm.command],
        cwd=arm.cwd,
        env=arm.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"coldstart: {arm.name} failed (exit {done.returncode}):\n{tail}")
    return seconds


def check_build(arm: Arm) -> None:
    """Refuse a build whose ``uag`` is not its own checkout's (an installed copy first on the
    path would time another build)."""
    found = subprocess.run(
        [sys.executable, "-c", "import uag; print(uag.__file__)"],
        cwd=arm.cwd,
        env=arm.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(arm.cwd):
        raise SystemExit(f"coldstart: {arm.name} imports uag from {found}, not from {arm.cwd}")


def measure(all_arms: list[Arm], *, repeats: int, log: bool = True) -> dict[str, list[float]]:
    """``repeats`` rounds, each running every arm once, the order rotated by one per round."""
    times: dict[str, list[float]] = {a.name: [] for a in all_arms}
    for r in range(repeats):
        k = r % len(all_arms)
        for arm in all_arms[k:] + all_arms[:k]:
            times[arm.name].append(run(arm))
        if log:
            line = ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items())
            print(f"coldstart: round {r + 1}/{repeats}: {line}", file=sys.stderr, flush=True)
    return times


def table(
    times: dict[str, list[float]],
    *,
    load: tuple[float, float] | None = None,
    limit_s: float | None = LIMIT_S,
) -> str:
    """Markdown: per arm the median, min and max wall time and the median's ratio to the
    import's; then whether the new build meets the issue's bounds (``limit_s`` seconds, the
    default pair's; None: only ``LIMIT_RATIO``, as for a larger target), and ``load``, the
    1-minute load average before and after the rounds (on a shared machine the figures are
    only indicative when it is not well under the core count)."""
    base = statistics.median(times[IMPORT_ARM])
    lines = [
        "| run | median s | min s | max s | median / import |",
        "|---|---|---|---|---|",
    ]
    for name, t in times.items():
        med = statistics.median(t)
        lines.append(f"| {name} | {med:.2f} | {min(t):.2f} | {max(t):.2f} | {med / base:.2f} |")
    new = statistics.median(times["new generate"])
    ok = (limit_s is None or new <= limit_s) and new <= LIMIT_RATIO * base
    bounds = f"{LIMIT_RATIO:.0f}x" if limit_s is None else f"{limit_s:.0f} s, {LIMIT_RATIO:.0f}x"
    lines.append("")
    lines.append(
        f"new build: {new:.2f} s median, {new / base:.2f}x the import "
        f"(bounds: {bounds}): {'met' if ok else 'NOT met'}; "
        f"{len(times[IMPORT_ARM])} repeats"
        + ("" if load is None else f"; load average {load[0]:.2f} before, {load[1]:.2f} after")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.coldstart",
        description="cold start of a one-token uag generate for two checkouts, interleaved, "
        "beside the import of torch and Transformers (medians of --repeats rounds)",
    )
    parser.add_argument("--old", required=True, help="the baseline checkout's root")
    parser.add_argument("--new", default=".", help="the checkout to compare (default: .)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument(
        "--target",
        default=None,
        help="time this target alone (--policy target-only), e.g. qwen2.5-coder-1.5b; only the "
        "2x bound applies (default: the default pair, bounds 4 s and 2x)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/uag-coldstart"),
        help="where each build's cache is made (default: /tmp/uag-coldstart)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="the cache holding the converted models (default: $UAG_CACHE or ~/.cache/uag)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.cache = (args.cache or cache_root()).expanduser().resolve()
    args.work = args.work.expanduser().resolve()
    if not (args.cache / "models").is_dir():
        parser.error(f"{args.cache} holds no converted models: run uag models prepare first")
    all_arms = arms(args)
    for arm in all_arms:
        if arm.name != IMPORT_ARM:
            check_build(arm)
        print(f"coldstart: warming up {arm.name} (untimed)", file=sys.stderr, flush=True)
        run(arm, timeout=1800)  # a build's first start prepares its models in its cache
    before = os.getloadavg()[0]
    times = measure(all_arms, repeats=args.repeats)
    limit = LIMIT_S if args.target is None else None
    print(table(times, load=(before, os.getloadavg()[0]), limit_s=limit))


if __name__ == "__main__":
    main()
