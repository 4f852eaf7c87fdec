"""Prompt lookup's copy lengths, chosen for this machine by exact replay (``uag calibrate``).

Why: how many tokens lookup copies after a match (``PromptLookup.max_tokens``, by match length)
trades a longer verify against more tokens per round, and what a verify costs by row count is
the machine's. The built-in lengths (3, 5, 11) were searched against a 2-core Xeon's verify
costs (8 rows ~1.45x one row); on a 2-core Zen 4 (8 rows ~2.2x one row) (2, 3, 5) measured 1.58x
target-alone against their 1.49x on 16 training prompts. So the search runs on the machine it
serves: record target-alone runs on training prompts (``uag.harness.dryrun.record_trace``), measure the
latency profile, replay lookup alone through the real loop with candidate lengths
(``uag.harness.dryrun.replay``: its rounds are the loop's by construction; only time is priced, by that
profile) and keep the lengths replay prices fastest (coordinate ascent over the three). The
result lives under ``$UAG_CACHE/calibration``, keyed by this CPU, the target and the kernels'
build; ``uag generate`` and ``uag bench`` use it when it is there and say so on stderr. The
lengths are searched for lookup alone and then serve every ``+lookup`` policy too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from controllers.rules import NoDraftPolicy
from uag.api import encode_prompt, render_prompt
from uag.decoding.lookup import PromptLookup
from uag.decoding.profile import LatencyProfile
from uag.decoding.round import MAX_CANDIDATES
from uag.errors import UagError
from uag.harness import dryrun
from uag.harness.jobs import RunConfig
from uag.harness.latency import measure_pair_profile
from uag.kernels import native
from uag.paths import cache_root

DEFAULT_PROMPTS = "humaneval:train+mixed:train"
"""What ``uag calibrate`` replays unless told otherwise: training prompts (bench's are test)."""
SWEEPS = 3
"""Coordinate-ascent sweeps at most (it stops at the first sweep that changes nothing)."""


@dataclass
class CalibrateConfig(RunConfig):
    """``uag calibrate``: which prompts to replay, on which pair. It writes only the calibration
    file (``calibration_path``), so ``out`` is unused."""

    prompts: str = DEFAULT_PROMPTS
    out: Path = Path(".")
    limit: int | None = 15


@dataclass(frozen=True)
class LookupCalibration:
    """Copy lengths by match length for this machine, and what replay priced them at."""

    lengths: tuple[int, ...]
    predicted: float
    """Replay's speed-up of lookup alone over the target alone with ``lengths``."""
    default_predicted: float
    """The same with ``PromptLookup``'s built-in lengths."""
    machine: str
    prompts: int
    max_new_tokens: int


def machine_id() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else what ``platform`` knows) and torch's
    thread count: what a verify's price by row count depends on besides the code."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return f"{name}, {torch.get_num_threads()} threads"


def calibration_path(pair: Any, *, machine: str | None = None) -> Path:
    """Where the calibration for ``pair``'s target on this machine lives (a new kernels build,
    another CPU or thread count, target, kernels or device is another file). Lookup alone never
    runs the assistant, so the lengths are the target's: any assistant, int8 or not, uses them
    (a calibration without ``--assistant-int8`` serves ``generate --controller`` too)."""
    lib = native._library()[0] if pair.kernels == "native" else None
    build = Path(getattr(lib, "_name", "")).name
    key = json.dumps(
        [
            machine or machine_id(),
            pair.target.ref,
            pair.kernels,
            str(pair.target.device),
            build,
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"lookup-{digest}.json"


def search_lengths(
    score: Callable[[tuple[int, ...]], float], start: tuple[int, ...], *, most: int
) -> tuple[tuple[int, ...], float]:
    """The lengths ``score`` rates highest, by coordinate ascent from ``start``: each entry in
    turn tried at every value 1..``most`` with the others held, kept at its best (a tie keeps
    the current value), for up to ``SWEEPS`` sweeps. Each distinct tuple is scored once."""
    seen: dict[tuple[int, ...], float] = {}

    def rate(lengths: tuple[int, ...]) -> float:
        if lengths not in seen:
            seen[lengths] = score(lengths)
        return seen[lengths]

    best = tuple(start)
    for _ in range(SWEEPS):
        changed = False
        for i in range(len(best)):
            for value in range(1, most + 1):
                candidate = best[:i] + (value,) + best[i + 1 :]
                if rate(candidate) > rate(best):
                    best, changed = candidate, True
        if not changed:
            break
    return best, rate(best)


def calibrate_lookup(
    pair: Any,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    chat: bool = False,
    profile: LatencyProfile | None = None,
    progress: Callable[[str], None] | None = None,
) -> LookupCalibration:
    """Measure, record and search (module docstring); ``prompts`` are ``uag.harness.prompts.Prompt``s.
    ``profile`` prices the replays instead of one measured now (tests: costs chosen at will)."""
    if not prompts:
        raise UagError("calibration needs at least one prompt")
    say = progress or (lambda _: None)
    if profile is None:
        say("measuring the latency profile (verify costs for 0-11 candidates)")
        profile = measure_pair_profile(pair, max_candidates=MAX_CANDIDATES)
    prices = profile
    traces: list[dryrun.TargetTrace] = []
    assistant_ids: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        say(f"recording the target alone on prompt {i + 1}/{len(prompts)} ({prompt.id})")
        target_ids, a_ids = encode_prompt(pair, render_prompt(pair, prompt.text, chat=chat))
        traces.append(dryrun.record_trace(pair, target_ids, max_new_tokens))
        assistant_ids.append(a_ids)

    @functools.cache  # the built-in lengths are scored in the search and again for the report
    def score(lengths: tuple[int, ...]) -> float:
        runs = [
            dryrun.replay(
                pair,
                trace,
                NoDraftPolicy(),
                prompt_assistant_ids=a_ids,
                profile=prices,
                lookup=PromptLookup(max_tokens=lengths),
            )
            for trace, a_ids in zip(traces, assistant_ids, strict=True)
        ]
        return dryrun.predicted_speedup(runs, traces, prices, timed_policy=False)

    say("searching copy lengths by exact replay")
    default = PromptLookup().max_tokens
    lengths, predicted = search_lengths(score, default, most=MAX_CANDIDATES)
    return LookupCalibration(
        lengths=lengths,
        predicted=predicted,
        default_predicted=score(default),
        machine=machine_id(),
        prompts=len(prompts),
        max_new_tokens=max_new_tokens,
    )


def save(calibration: LookupCalibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(calibration), indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


def load(path: Path) -> LookupCalibration | None:
    """The calibration at ``path``, None when there is none; a damaged file is an error."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["lengths"] = tuple(int(n) for n in data["lengths"])
        calibration = LookupCalibration(**data)
        PromptLookup(max_tokens=calibration.lengths)  # lengths it accepts
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UagError(
            f"calibration file {path} is damaged ({exc}): run uag calibrate again or delete it"
        ) from exc
    return calibration


def lookup_lengths(pair: Any, *, quiet: bool = False) -> tuple[int, ...] | None:
    """This machine's calibrated copy lengths for ``pair`` (saying so on stderr), or None."""
    path = calibration_path(pair)
    calibration = load(path)
    if calibration is None:
        return None
    if not quiet:
        print(
            f"uag: prompt lookup copies {'/'.join(map(str, calibration.lengths))} tokens after a "
            f"1/2/3+-token match, as uag calibrate chose on this machine ({path})",
            file=sys.stderr,
        )
    return calibration.lengths
