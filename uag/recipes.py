"""The product's defaults for a pair, in one place: which plan runs, how far lookup copies, and
how sampling is set when the user names nothing.

Why here: ``uag.generate(pair, prompt)``, ``uag generate``, ``uag bench``'s default arm and a
server must run the same product. Before this module the CLI assembled it (the shipped plan,
the calibrated lookup) while the library call defaulted to a plain static-3, so a Python user
got a slower product than a CLI user. The CLI now only parses flags and prints what this module
decided.

* ``default_plan(pair)``: the shipped plan where it was trained for the run (the default pair,
  the int8 assistant, uag's native CPU kernels; greedy, or the sampling plan under sampling);
  else the training-free rule ``uag calibrate`` chose for this pair on this machine by exact
  replay (``calibrated_rule``: static-K, with or without lookup first, or lookup alone); else
  ``static-3`` with prompt lookup first, saying that ``uag calibrate`` would choose. Copies use
  this machine's calibrated lengths where ``uag calibrate`` has run (``lookup_lengths``).
* ``plan_from_controller(path, pair)``: a controller file as a plan: a learned plan, or a stop
  controller with calibrated lookup first.
* ``sampling_settings``: each of temperature, top-k and top-p from the caller, else the target's
  ``generation_config``, else the built-in value (as Transformers' ``generate`` does).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from controllers.learned_plan import load_controller
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from controllers.spec import parse_policy
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Plan
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.kernels import native
from uag.paths import cache_root
from uag.runtime import models
from uag.runtime.models import DEFAULT_ASSISTANT, DEFAULT_TARGET

SHIPPED = Path(__file__).parent / "shipped"
SHIPPED_CONTROLLER = SHIPPED / "ctrl.onnx"
"""The greedy plan this checkout ships: ``exports/ctrl.onnx`` through the link in
``uag/shipped``, or its copy inside an installed wheel (found from any directory)."""
SHIPPED_SAMPLING_CONTROLLER = SHIPPED / "ctrl-sampling.onnx"
"""The plan shipped for sampling (``exports/ctrl-sampling.onnx``)."""
FALLBACK_LOOKAHEAD = 3
"""``static-K+lookup``'s K where no shipped plan fits the run."""
BUILT_IN_SAMPLING: dict[str, float | None] = {"temperature": 1.0, "top_k": None, "top_p": 1.0}
"""What sampling uses where neither the caller nor the target's ``generation_config`` says."""


# --- prompt lookup's calibrated lengths ----------------------------------------------------


@dataclass(frozen=True)
class LookupCalibration:
    """Copy lengths by match length for this machine, and what replay priced them at
    (``uag calibrate``, ``uag.harness.calibration``)."""

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
    name = native.cpuinfo().get("model name") or platform.processor() or platform.machine()
    return f"{name}, {torch.get_num_threads()} threads"


def cpu_isa() -> str:
    """The vector extensions uag's kernels choose between, as this CPU reports them
    (``/proc/cpuinfo``'s flags): what a figure measured here depends on besides the model."""
    info = native.cpuinfo()
    if not info:
        return "ISA unknown"
    flags = set(info.get("flags", "").split())
    named = [
        ("amx_tile", "AMX"),
        ("avx512_vnni", "AVX-512 VNNI"),
        ("avx512f", "AVX-512"),
        ("avx_vnni", "AVX-VNNI"),
        ("avx2", "AVX2"),
    ]
    have = [label for flag, label in named if flag in flags]
    if "AVX-512 VNNI" in have:
        have.remove("AVX-512")
    return ", ".join(have) or "no AVX2"


def calibration_path(pair: Any, *, machine: str | None = None) -> Path:
    """Where the calibration for ``pair``'s target on this machine lives (a new kernels build,
    another CPU or thread count, target, kernels or device is another file). Lookup alone never
    runs the assistant, so the lengths are the target's: any assistant, int8 or not, uses them
    (a calibration without ``--assistant-int8`` serves ``generate --controller`` too)."""
    return _calibration_file("lookup", pair, machine, [])


def _calibration_file(kind: str, pair: Any, machine: str | None, more: list[Any]) -> Path:
    """``$UAG_CACHE/calibration/{kind}-{digest}.json``, the digest over what every calibration
    depends on (this CPU and thread count, the target, its kernels, device and the kernels'
    build) and ``more``."""
    lib = native._library()[0] if pair.kernels == "native" else None
    build = Path(getattr(lib, "_name", "")).name
    key = [machine or machine_id(), pair.target.ref, pair.kernels, str(pair.target.device), build]
    digest = hashlib.sha256(json.dumps(key + more).encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{kind}-{digest}.json"


def save_calibration(calibration: LookupCalibration | RuleCalibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(calibration), indent=1) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


def load_calibration(path: Path) -> LookupCalibration | None:
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
    calibration = load_calibration(path)
    if calibration is None:
        return None
    if not quiet:
        print(
            f"uag: prompt lookup copies {'/'.join(map(str, calibration.lengths))} tokens after a "
            f"1/2/3+-token match, as uag calibrate chose on this machine ({path})",
            file=sys.stderr,
        )
    return calibration.lengths


def calibrated_lookup(pair: Any, *, quiet: bool = True) -> PromptLookup:
    """Prompt lookup with this machine's calibrated copy lengths (the built-in ones where
    ``uag calibrate`` has not run)."""
    lengths = lookup_lengths(pair, quiet=quiet)
    return PromptLookup() if lengths is None else PromptLookup(max_tokens=lengths)


# --- the training-free rule ----------------------------------------------------------------


@dataclass(frozen=True)
class RuleCalibration:
    """The fastest training-free rule for a pair on this machine (``uag calibrate``): every
    candidate's speed-up over the target alone by exact replay, priced with the latency
    profile measured then (kept here: this machine's prices for the pair)."""

    rule: str
    """A policy spec (``controllers.spec``): ``static-K``, ``static-K+lookup`` or ``lookup``."""
    predicted: float
    candidates: dict[str, float]
    """Every rule replayed, by spec, and its predicted speed-up."""
    profile: dict[str, Any]
    """``LatencyProfile.to_dict()``: draft step, verify by candidate count, catch-up."""
    machine: str
    prompts: int
    max_new_tokens: int


def rule_path(pair: Any, *, machine: str | None = None) -> Path:
    """Where ``pair``'s calibrated rule lives: unlike the copy lengths, a rule that drafts
    depends on the assistant (its model, precision and draft vocabulary) as well."""
    more = [pair.assistant.ref, bool(pair.assistant_int8), pair.draft_vocab]
    return _calibration_file("rule", pair, machine, more)


def load_rule(path: Path) -> RuleCalibration | None:
    """The calibrated rule at ``path``, None when there is none; a damaged file is an error."""
    if not path.is_file():
        return None
    try:
        rule = RuleCalibration(**json.loads(path.read_text()))
        spec = parse_policy(rule.rule)
        if not spec.is_rule or spec.kind == "bandit":
            raise ValueError(f"{rule.rule!r} is not a training-free rule")
    except (OSError, ValueError, TypeError, UagError) as exc:
        raise UagError(
            f"calibration file {path} is damaged ({exc}): run uag calibrate again or delete it"
        ) from exc
    return rule


# --- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """The plan a run uses and, in one line, why that one."""

    plan: Plan
    why: str


def shipped_controller(*, sampling: bool = False) -> Path:
    """The shipped plan's path (greedy, or ``sampling``'s), beside the package whatever the
    working directory."""
    path = _shipped(sampling)
    if not path.is_file():
        raise UagError(
            f"the shipped controller {path} is missing (an incomplete install?): "
            "give one with --controller PATH.onnx, or another --policy (e.g. static+lookup)"
        )
    return path


def _shipped(sampling: bool) -> Path:
    # Read at call time, so a test can point either name elsewhere.
    return SHIPPED_SAMPLING_CONTROLLER if sampling else SHIPPED_CONTROLLER


def shipped_fits(pair: Any, *, sampling: bool = False) -> bool:
    """Whether the shipped plans were trained for runs of ``pair``: the default pair with the
    int8 assistant on uag's native CPU kernels (float32), greedy or sampling (a plan for each).
    A shipped file missing there is a broken install, refused by ``shipped_controller``."""
    return (
        pair.target.ref == DEFAULT_TARGET
        and pair.assistant.ref == DEFAULT_ASSISTANT
        and bool(pair.assistant_int8)
        and pair.kernels == "native"
    )


def default_plan(pair: Any, *, sampling: bool = False) -> Recipe:
    """The product's plan for ``pair`` (module docstring). Built fresh: a plan holds one
    generation's state, so two runs at once need two plans."""
    if shipped_fits(pair, sampling=sampling):
        path = shipped_controller(sampling=sampling)
        plan = plan_from_controller(path, pair)
        return Recipe(plan, f"the shipped {'sampling ' if sampling else ''}plan ({path.name})")
    path = rule_path(pair)
    rule = None if sampling else load_rule(path)  # chosen by greedy replay
    if rule is not None:
        lengths = lookup_lengths(pair, quiet=True)
        plan = parse_policy(rule.rule).plan(lengths=lengths)
        why = (
            f"{rule.rule}: the fastest rule for this pair on this machine, as uag calibrate "
            f"chose by exact replay ({rule.predicted:.2f}x the target alone; {path})"
        )
        return Recipe(plan, why)
    plan = RulePlan(StaticPolicy(k=FALLBACK_LOOKAHEAD), lookup=calibrated_lookup(pair))
    why = (
        f"{plan.name}: the shipped plan was trained for {DEFAULT_TARGET} <- {DEFAULT_ASSISTANT} "
        "with the int8 assistant on uag's CPU kernels; uag calibrate with this pair chooses the "
        "fastest rule for it on this machine"
    )
    return Recipe(plan, why)


def plan_from_controller(path: Path | str, pair: Any, *, use_cuda: bool = False) -> Plan:
    """A controller file as a plan: a learned plan (it copies with lengths of its own), or a
    stop controller drafting after calibrated prompt lookup."""
    return load_controller(path, use_cuda=use_cuda).as_plan(calibrated_lookup(pair))


# --- sampling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling's settings, resolved: each from the caller, else the target's
    ``generation_config``, else ``BUILT_IN_SAMPLING``."""

    config: SamplingConfig
    source: dict[str, str]
    """Setting → where its value came from, in words."""

    def describe(self) -> str:
        """One line: what sampling used, and where each value came from."""
        c = self.config
        shown = {
            "temperature": f"temperature {c.temperature:g}",
            "top_k": "top-k off" if c.top_k is None else f"top-k {c.top_k}",
            "top_p": "top-p off" if c.top_p >= 1 else f"top-p {c.top_p:g}",
        }
        by_source: dict[str, list[str]] = {}
        for name, text in shown.items():
            by_source.setdefault(self.source[name], []).append(text)
        said = "; ".join(f"{', '.join(texts)} ({where})" for where, texts in by_source.items())
        return f"sampling: {said}; " + ("random seed" if c.seed is None else f"seed {c.seed}")

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the values and their sources."""
        c = self.config
        values = {"temperature": c.temperature, "top_k": c.top_k, "top_p": c.top_p}
        return {**values, "seed": c.seed, "source": dict(self.source)}


def sampling_settings(
    target: str,
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> SamplingSettings:
    """Sampling for ``target`` (a model reference): what is given, else its declared defaults,
    else the built-in ones; ``top_k`` 0 is off, as in a ``generation_config``."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    declared = models.generation_defaults(target)
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, built_in in BUILT_IN_SAMPLING.items():
        if given[name] is not None:
            values[name], source[name] = given[name], "given"
        elif name in declared:
            values[name], source[name] = declared[name], f"{target}'s generation_config"
        else:
            values[name], source[name] = built_in, "built-in default"
    if values["top_k"] == 0:
        values["top_k"] = None
    return SamplingSettings(SamplingConfig(**values, seed=seed), source)
