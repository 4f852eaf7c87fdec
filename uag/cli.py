"""The ``uag`` command line: wiring only.

Each subcommand parses its flags, calls a library function, and prints. Known problems
(:class:`UagError`) become one line on stderr and exit code 2; anything else is a bug and prints
one line too, with the full traceback only when ``UAG_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import secrets
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from tqdm import tqdm

from controllers.learned import LearnedPolicy
from controllers.learned_plan import LearnedPlan, load_controller
from controllers.spec import PolicySpec, parse_policy
from training.config import TrainConfig
from uag import api, recipes
from uag.decoding.lookup import PromptLookup
from uag.decoding.plan import Plan
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.harness import calibration, launcher
from uag.harness.bench import (
    DEFAULT_POLICIES,
    SAMPLING_POLICIES,
    BenchConfig,
    run_bench,
    write_report,
)
from uag.harness.calibration import CalibrateConfig
from uag.harness.collect import CollectConfig, collect, collect_for_plan, parse_shard
from uag.harness.jobs import RunConfig, load_pair_of
from uag.harness.prompts import load_prompts, refuse_held_out
from uag.kernels.choice import KERNEL_CHOICES, resolve_kernels
from uag.paths import cache_root
from uag.runtime import models, prepared
from uag.runtime.draft_vocab import DEFAULT_DRAFT_VOCAB, GRANULE
from uag.runtime.models import DEFAULT_ASSISTANT, DEFAULT_TARGET, resolve_device
from uag.runtime.prepared import ROLES as PREPARED_ROLES
from uag.serve.config import ServeConfig

Config = TypeVar("Config")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (``--help`` still shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class Command:
    """One subcommand: how to add its flags and what to run."""

    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def default_of(cls: type, name: str) -> Any:
    """The default of config field ``name``: the one place a flag's default is written."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no default for {name!r}")


def _add_config_flag(p: Any, flag: str, config: type, **kwargs: Any) -> None:
    """Add ``flag`` with the default of the ``config`` field it sets (``--max-epochs`` sets
    ``max_epochs``): the flag names its field once, and its default stays the config's."""
    p.add_argument(flag, default=default_of(config, flag[2:].replace("-", "_")), **kwargs)


def config_from_args(cls: type[Config], args: argparse.Namespace, **given: Any) -> Config:
    """``cls`` (a config dataclass) from the parsed flags named like its fields, plus ``given``
    (values the command derives: shards, sampling): flag → field is written once, here, not
    once per command (``tests/test_cli.py`` checks every flag has a field or is declared
    command-line only, and that the defaults agree)."""
    names = {f.name for f in fields(cls) if f.init}  # type: ignore[arg-type]
    values = {k: v for k, v in vars(args).items() if k in names}
    return cls(**{**values, **given})


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _finite(flag: str) -> Any:
    """An argparse type: a finite float (``nan`` and ``inf`` parse as floats, and mean nothing
    here); each flag's range is checked where its value is used."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number, got {value!r}")
        return number

    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default=None,
        help="target model: embedded name, .gguf, local dir or hub id (default: the one a "
        f"--controller was trained for, else {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--assistant",
        default=None,
        help="assistant (draft) model, same kinds of reference (default: the one a --controller "
        f"was trained for, else {DEFAULT_ASSISTANT})",
    )
    _add_config_flag(
        p,
        "--device",
        RunConfig,
        help="auto (CUDA when present), cpu or cuda (default: %(default)s)",
    )
    _add_config_flag(
        p,
        "--dtype",
        RunConfig,
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16",
    )
    p.add_argument(
        "--assistant-int8",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="int8 activations for the assistant's linear layers (CPU, native kernels: weights "
        "that lie on GGUF Q4_1's grid, as SmolLM2's do, stay 4-bit; others int8 per row): "
        "cheaper drafts, same output, greedy or sampled; --no-assistant-int8 keeps it in "
        "float32 (default: as a --controller was trained where it can run, else on wherever "
        "it can run: on for CPU float32, off on CUDA and in bfloat16/float16, where the int8 "
        "kernels do not run)",
    )
    _add_config_flag(
        p,
        "--kernels",
        RunConfig,
        choices=list(KERNEL_CHOICES),
        help="linear kernels on a float32 CPU: auto picks native (uag's own AVX2 kernel, built "
        "once with the C compiler: each weight read once per step, bitwise equal per row "
        "whatever the row count), else onednn (oneDNN packed, also row-count invariant), else "
        "plain (F.linear; GPUs; near-ties are then recomputed) (default: %(default)s)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="greedy drafts come from the assistant's first N ids only (rounded up to a multiple "
        f"of {GRANULE}; ids are numbered roughly by frequency): its head costs a fraction, and a "
        "token it cannot propose costs acceptance, never the output; 0: every id (default: as a "
        f"--controller was trained, else {DEFAULT_DRAFT_VOCAB} where the head can be cut: "
        "native kernels or a plain linear head)",
    )


def settle_model_args(args: argparse.Namespace, controller: Any = None) -> str | None:
    """Fill the model flags the user left out: from the controller's training contract when
    one is given (the settings its thresholds were chosen for), else the defaults. Returns the
    note to print once the models load (never silently; not before an error)."""
    adopted = []
    info = getattr(controller, "info", None)
    # The int8 assistant wherever it can run (CPU float32): the same default for generate and
    # collect, so a controller collects its features and latencies with the assistant it runs
    # with. A controller trained with it, run on CUDA, gets the float assistant (and warns).
    int8 = api.resolve_assistant_int8(None, device=args.device, dtype=args.dtype)
    for flag, attr, default in (
        ("--target", "target", DEFAULT_TARGET),
        ("--assistant", "assistant", DEFAULT_ASSISTANT),
        ("--assistant-int8", "assistant_int8", int8),
    ):
        if getattr(args, attr) is not None:
            continue
        trained = getattr(info, attr, None) if info is not None else None
        if attr == "assistant_int8" and trained and not int8:
            trained = None
        if trained is not None and trained != "?":
            setattr(args, attr, trained)
            if trained != default:
                adopted.append(
                    f"{flag} {trained}"
                    if attr != "assistant_int8"
                    else (flag if trained else "--no-assistant-int8")
                )
        else:
            setattr(args, attr, default)
    trained_vocab = getattr(info, "draft_vocab", None) if info is not None else None
    if getattr(args, "draft_vocab", None) is None and trained_vocab is not None:
        args.draft_vocab = trained_vocab  # None where its file does not say: the default
        if trained_vocab != DEFAULT_DRAFT_VOCAB:
            adopted.append(f"--draft-vocab {trained_vocab}")
    if not adopted:
        return None
    return (
        f"uag: controller {controller.path.name} was trained with {', '.join(adopted)}: "
        "using that (pass the flag to override)"
    )


SHIPPED_CONTROLLER = recipes.SHIPPED_CONTROLLER
SHIPPED_SAMPLING_CONTROLLER = recipes.SHIPPED_SAMPLING_CONTROLLER


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="the prompt text (one prompt: batch size 1)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file (whole file)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the target's chat template"
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=128,
        help="target tokens to generate at most (default: %(default)s)",
    )
    _add_plan_args(p)
    p.add_argument(
        "--compare-target-only",
        action="store_true",
        help="also run the target alone (each arm twice, alternating, fastest kept), check the outputs are token-identical and report the speed-up",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object as the last stdout line (no streaming)",
    )
    _add_sampling_args(p)


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    """Which plan runs: ``--policy``, ``--controller`` and the rules' two knobs."""
    p.add_argument(
        "--policy",
        metavar="SPEC",
        default=None,
        help="how far to draft each round: static[-K], heuristic[-K], confidence[-T], "
        "entropy[-T], learned (--controller's, else the shipped controller) or target-only; "
        "ending in +lookup (e.g. learned+lookup), each round first tries prompt lookup: when "
        "the last target tokens occurred before, what followed them is verified instead of "
        "drafting; +lookup-N (e.g. static-2+lookup-3) copies only after a match of N tokens "
        "or more, else the assistant drafts (the hybrid rule); bandit picks each round's arm "
        "(plain step, copy, static-1/2/4) by UCB1 on its tokens per second, per prompt; lookup "
        "alone uses no assistant drafts. The same names as uag bench "
        "--policies (default, or 'default': the product's plan, as uag.generate runs it: the "
        "shipped plan (learned+lookup) for the default pair with the int8 assistant on uag's "
        "CPU kernels, greedy or --sample; learned+lookup with --controller; else the rule uag "
        "calibrate chose for the pair on this machine, else static-3+lookup; lookup copies the "
        "lengths uag calibrate chose on this machine, where it has run)",
    )
    p.add_argument(
        "--controller",
        type=Path,
        default=None,
        help="ONNX controller from uag train-controller for the learned policy (default: the "
        "shipped one, where --policy is learned or its default)",
    )
    p.add_argument(
        "--lookahead",
        type=_positive_int,
        default=None,
        help="static: tokens per draft (default 3); heuristic: starting value (5); confidence/entropy: cap (20)",
    )
    p.add_argument(
        "--threshold",
        type=_finite("--threshold"),
        default=None,
        help="confidence: stop below this probability (0.4); entropy: stop above this many nats (1.5)",
    )


def _add_sampling_args(
    p: argparse.ArgumentParser, *, bench: bool = False, collect: bool = False
) -> None:
    s = p.add_argument_group(
        "sampling",
        "--sample draws from the target's distribution instead of taking its argmax; speculative "
        "sampling (token-level intersection) keeps that distribution exactly, whatever the "
        "assistant and the lookahead"
        + (
            ". In bench every arm of a round gets the same seed (round r: seed + r) and the "
            "identity check becomes a paired check of the target's log-probability of the "
            "samples against target-only sampling"
            if bench
            else ". In collect every drafted token also gets a soft label, accept_prob: the "
            "probability its draft prefix is accepted given the drafts (train-controller learns "
            "from it); each prompt is seeded by --seed (default 0) and its id"
            if collect
            else ""
        ),
    )
    s.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    model = "(default: the target's generation_config, else {})"
    s.add_argument(
        "--temperature", type=_finite("--temperature"), default=None, help="> 0 " + model.format(1)
    )
    s.add_argument(
        "--top-p",
        type=_finite("--top-p"),
        default=None,
        help="nucleus mass in (0, 1] " + model.format("1: off"),
    )
    s.add_argument(
        "--top-k",
        type=_integer("--top-k", low=0),
        default=None,
        help="keep the k most probable; 0: off " + model.format("off"),
    )
    s.add_argument(
        "--seed",
        type=_integer("--seed", low=0, high=2**63 - 1),
        default=None,
        help="seeds the run (default: random)",
    )


def _integer(flag: str, *, low: int | None = None, high: int | None = None) -> Any:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {value!r}") from None
        if low is not None and number < low:
            raise argparse.ArgumentTypeError(f"{flag} must be at least {low}, got {number}")
        if high is not None and number > high:
            raise argparse.ArgumentTypeError(f"{flag} must be at most {high}, got {number}")
        return number

    return parse


Sampling = recipes.SamplingSettings


def sampling_config(args: argparse.Namespace) -> Sampling | None:
    """``--sample`` and its flags resolved against the target's own defaults (``args.target``
    settled), or None for greedy decoding: the one place ``generate``, ``bench`` and
    ``collect`` build their sampling from."""
    given = [f for f in ("temperature", "top_p", "top_k", "seed") if getattr(args, f) is not None]
    if not args.sample:
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise UagError(f"{flags} only apply with --sample")
        return None
    return recipes.sampling_settings(
        args.target,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        path = args.prompt_file
        if not path.is_file():
            raise UagError(f"prompt file not found: {path}")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise UagError(
                f"prompt file {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                f"offset {err.start})"
            ) from None
        except OSError as err:
            raise UagError(f"cannot read prompt file {path}: {err.strerror}") from None
        if not text.strip():
            raise UagError(f"prompt file is empty: {args.prompt_file}")
        return text
    if len(args.prompt) != 1:
        raise UagError(
            f"got {len(args.prompt)} prompts: uag generates one prompt at a time (batch size 1)"
        )
    return api.check_prompt(args.prompt[0])  # before the models load


def _stats_line(result: Any, sampling: Sampling | None = None) -> str:
    split = result.time_split()
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in split.items())
    return (
        f"[{result.policy}] {result.new_tokens} new tokens, {result.target_forwards} target forwards "
        f"({result.tokens_per_forward:.2f} tokens/forward), acceptance {result.acceptance_rate:.0%}, "
        f"{result.wasted_drafts} drafted tokens wasted, "
        + (
            f"lookup: {result.copied_accepted} of {result.copied_tokens} copied tokens accepted, "
            if result.copied_tokens
            else ""
        )
        + f"{result.tokens_per_second:.2f} tokens/s, "
        f"{result.seconds:.2f}s ({parts})"
        + ("" if sampling is None else f"; {sampling.describe()}")
    )


def run_generate(args: argparse.Namespace) -> int:
    """``uag generate``: the flags resolved, the pair loaded, the plan from ``uag.recipes``
    (or the one asked for), then the run, compared with the target alone when asked."""
    prompt = _read_prompt(args)
    if args.sample and args.compare_target_only:
        raise UagError(
            "--compare-target-only checks token identity, which sampled outputs do not have "
            "(they match the target in distribution; tests/test_sampling.py checks that)"
        )
    request = _plan_request(args)
    adopted = settle_model_args(args, request.controller)
    sampling = sampling_config(args)
    if sampling is not None and sampling.config.seed is None:  # drawn here to be reported
        sampling = replace(sampling, config=replace(sampling.config, seed=secrets.randbits(63)))
    pair = load_pair_of(args)
    if adopted:
        print(adopted, file=sys.stderr)
    plan = request.resolve(pair, args, sampling=sampling is not None)
    run = GenerateRun(
        pair=pair,
        prompt=prompt,
        plan=plan,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        sampling=None if sampling is None else sampling.config,
    )
    if args.compare_target_only:
        result, reference, identical = run.compared(stream=None if args.json else _stream)
    else:
        result, reference, identical = run.once(stream=None if args.json else _stream), None, True
    return _print_generate(
        args, result, reference, identical=identical, sampling=sampling, why=request.why
    )


@dataclass
class PlanRequest:
    """What ``--policy`` / ``--controller`` asked for, checked before any model loads: the
    spec (None: the product's default plan) and the controller file, loaded (a bad file fails
    in a second, not after the models)."""

    spec: PolicySpec | None
    controller: LearnedPlan | LearnedPolicy | None = None
    why: str | None = None
    """Once ``resolve`` took the product's default plan: which one and why, in one line."""

    def resolve(self, pair: api.Pair, args: argparse.Namespace, *, sampling: bool) -> Plan | None:
        """The plan to run on the loaded ``pair`` (None: the target alone)."""
        if self.controller is not None:
            self.controller.warn_if_foreign(
                target=args.target,
                assistant=args.assistant,
                assistant_int8=args.assistant_int8,
                device=pair.target.device.type,
                decoding="sampling" if sampling else "greedy",
                draft_vocab=pair.draft_vocab,
            )
            lookup = self.spec.make_lookup(recipes.lookup_lengths(pair)) if self.spec else None
            return self.controller.as_plan(lookup)
        if self.spec is None or self.spec.kind == "default":
            recipe = pair.default_plan(sampling=sampling)
            self.why = f"uag: {'sampling' if sampling else 'greedy'} plan: {recipe.why}"
            return recipe.plan
        if self.spec.kind == "target-only":
            return None
        return self.spec.plan(
            lookahead=args.lookahead,
            threshold=args.threshold,
            lengths=recipes.lookup_lengths(pair) if self.spec.lookup else None,
        )


def _plan_request(args: argparse.Namespace) -> PlanRequest:
    """``--policy`` and ``--controller`` as one request (``PlanRequest``); without either, the
    product's default plan (``uag.recipes.default_plan``, once the pair is loaded)."""
    if args.policy is None and args.controller is None:
        if args.lookahead is not None or args.threshold is not None:
            raise UagError("--lookahead and --threshold go with a --policy that takes them")
        return PlanRequest(spec=None)
    spec = parse_policy(args.policy or "learned+lookup")
    if spec.kind == "learned" and spec.path is not None:
        if args.controller is not None:
            raise UagError(f"the controller is given twice: --policy {spec} and --controller")
        args.controller = spec.path
    if args.controller is not None and spec.kind != "learned":
        raise UagError(f"--controller goes with the learned policy, not --policy {spec}")
    if spec.kind in ("transformers", "oracle"):
        raise UagError(f"{spec} is an arm of uag bench, not a policy to generate with")
    if spec.kind == "default" and (args.lookahead is not None or args.threshold is not None):
        raise UagError("--lookahead and --threshold go with a --policy that takes them")
    if spec.kind != "learned":
        if spec.is_rule:  # a flag the rule does not take fails now, not after the models load
            spec.plan(lookahead=args.lookahead, threshold=args.threshold)
        return PlanRequest(spec=spec)
    path = args.controller or recipes.shipped_controller(sampling=args.sample)
    use_cuda = resolve_device(args.device).type == "cuda"
    return PlanRequest(spec=spec, controller=load_controller(path, use_cuda=use_cuda))


def _stream(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


@dataclass
class GenerateRun:
    """One ``uag generate`` run's settings: ``once`` runs it, ``compared`` also runs the target
    alone and checks the tokens."""

    pair: api.Pair
    prompt: str
    plan: Plan | None
    max_new_tokens: int
    chat: bool
    sampling: SamplingConfig | None

    def generate(
        self, plan: Plan | None, *, tokens: int | None = None, stream: Any = None
    ) -> api.GenerationResult:
        return api.generate(
            self.pair,
            self.prompt,
            plan=plan,
            max_new_tokens=tokens or self.max_new_tokens,
            chat=self.chat,
            sampling=self.sampling,
            on_text=stream,
        )

    def once(self, *, stream: Any) -> api.GenerationResult:
        return self.generate(self.plan, stream=stream)

    def compared(self, *, stream: Any) -> tuple[api.GenerationResult, api.GenerationResult, bool]:
        """``(the plan's run, the target alone's, identical)``: each arm warmed up outside the
        measured runs (allocator, thread pools, kernels), then run twice, alternating, and the
        faster of each kept (a single run of a few seconds moves by several percent on a shared
        CPU)."""
        self.generate(None, tokens=4)
        self.generate(self.plan, tokens=4)
        reference = self.generate(None)
        result = self.generate(self.plan, stream=stream)
        ref2, res2 = self.generate(None), self.generate(self.plan)
        identical = all(r.token_ids == reference.token_ids for r in (ref2, result, res2))
        return (
            min(result, res2, key=lambda r: r.seconds),
            min(reference, ref2, key=lambda r: r.seconds),
            identical,
        )


def _print_generate(
    args: argparse.Namespace,
    result: api.GenerationResult,
    reference: api.GenerationResult | None,
    *,
    identical: bool,
    sampling: Sampling | None,
    why: str | None = None,
) -> int:
    """The stats line (or ``--json``'s object); exit 1 when the compared outputs differ.
    ``why``: which default plan ran and why (``--json``: its ``plan_why``)."""
    summary = result.summary()
    if why:
        summary["plan_why"] = why.split(": ", 2)[-1]
    if sampling is not None:
        summary["sampling"] = sampling.summary()
    if reference is not None:
        summary["identical"] = identical
        summary["target_only_seconds"] = round(reference.seconds, 4)
        summary["speedup"] = (
            round(reference.seconds / result.seconds, 4) if result.seconds else None
        )
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print()
        if why:
            print(why, file=sys.stderr)
        print(_stats_line(result, sampling))
        if reference is not None:
            verdict = "token-identical" if identical else "DIFFERENT (a bug: please report)"
            print(
                f"[target-only] {reference.new_tokens} tokens in {reference.seconds:.2f}s; "
                f"outputs {verdict}; speed-up {summary['speedup']:.2f}x"
            )
    return 0 if reference is None or identical else 1


def _add_models_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_cmd", metavar="{list,prepare}", parser_class=_Parser)
    sub.add_parser("list", help="list embedded models and whether each is converted (default)")
    prep = sub.add_parser(
        "prepare", help="convert embedded models or .gguf files into the cache now"
    )
    prep.add_argument("names", nargs="+", help="embedded names or .gguf paths")
    prep.add_argument(
        "--as",
        dest="roles",
        action="append",
        choices=PREPARED_ROLES,
        help="also build the prepared model (uag/prepared.py: what later starts memory-map, "
        "native kernels only) for this role; repeatable (default: target for the default "
        "target, both assistant roles for the default assistant, target for anything else)",
    )


def _default_roles(name: str) -> tuple[str, ...]:
    return ("assistant", "assistant-int8") if name == DEFAULT_ASSISTANT else ("target",)


def run_models(args: argparse.Namespace) -> int:
    if getattr(args, "models_cmd", None) == "prepare":
        for name in args.names:
            if name not in models.EMBEDDED and not name.endswith(".gguf"):
                raise UagError(
                    f"cannot prepare {name!r}: give an embedded name ({', '.join(models.EMBEDDED)}) or a .gguf file"
                )
            models.check_reference(name)  # a missing file or package: before any work
        native = resolve_kernels("auto", torch.device("cpu"), torch.float32) == "native"
        for name in tqdm(args.names, desc="preparing models", unit="model"):
            path = models.convert_gguf(name, log=tqdm.write)
            tqdm.write(f"{name}: converted at {path}")
            if not native:
                continue  # prepared models are for the native kernels only
            for role in args.roles or _default_roles(name):
                found = prepared.load(name, role=role, log=tqdm.write)
                tqdm.write(
                    f"{name}: prepared as {role}"
                    if found is not None
                    else f"{name}: cannot be prepared as {role} (it loads the usual way)"
                )
        return 0
    print(f"cache: {cache_root()}  (set UAG_CACHE to move it)")
    for name, entry in models.EMBEDDED.items():
        print(_model_line(name, entry))
    return 0


def _model_line(name: str, entry: models.EmbeddedModel) -> str:
    """One embedded model: its role, its GGUF's size, and how far it is from running."""
    if models.is_cached(name):
        state = "converted"
        roles = prepared.prepared_roles(models.converted_dir(name))
        if roles:
            state += f", prepared as {', '.join(roles)}"
    elif entry.installed():
        state = f"installed, not converted yet (uag models prepare {name})"
    else:
        state = f"not installed ({entry.missing_hint()})"
    size = f"{entry.size / 1e9:.2f} GB" if entry.size else "-"
    return f"{name:20s} {entry.role:9s} {size:>8s}  {state}"


def _add_prompt_set_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``RunConfig`` every prompt-set job (collect, bench) takes."""
    p.add_argument(
        "--prompts",
        required=True,
        help="humaneval[:train|:test], a set in data/prompts (e.g. mixed, mixed:train), or a "
        "local .jsonl/.json/.csv/.parquet file; join several with +",
    )
    _add_config_flag(
        p,
        "--text-column",
        RunConfig,
        help="column holding the prompt text in local files (default: %(default)s)",
    )
    p.add_argument(
        "--limit", type=_positive_int, default=None, help="use at most this many prompts"
    )
    _add_config_flag(
        p,
        "--max-new-tokens",
        RunConfig,
        type=_positive_int,
        help="target tokens per prompt (default: %(default)s)",
    )
    p.add_argument("--chat", action="store_true", help="wrap prompts in the target's chat template")


def _add_collect_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_prompt_set_args(p)
    _add_config_flag(
        p,
        "--max-lookahead",
        CollectConfig,
        type=_integer("--max-lookahead"),
        help="tokens drafted every iteration; drafting never stops earlier (default: %(default)s)",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="output directory (Parquet parts + meta.json)"
    )
    state = p.add_mutually_exclusive_group()
    state.add_argument(
        "--resume", action="store_true", help="continue a run in --out, skipping finished prompts"
    )
    state.add_argument("--overwrite", action="store_true", help="replace a run in --out")
    p.add_argument(
        "--shard",
        default=None,
        help="i/n: take prompts whose index %% n == i (one process or GPU per shard, same --out; "
        "default 0/1, or RANK/WORLD_SIZE under torchrun or another launcher, which also puts "
        "each rank on cuda:LOCAL_RANK when GPUs exist)",
    )
    p.add_argument(
        "--logdir",
        type=Path,
        default=None,
        help="TensorBoard log directory (default: runs/collect/<out name>)",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="re-measure the latency profile even when resuming (new machine, faster code)",
    )
    p.add_argument(
        "--controller",
        type=Path,
        default=None,
        help="collect on-policy: follow this ONNX controller (and adopt its pair and precision "
        "unless given) instead of drafting --max-lookahead tokens every round",
    )
    _add_config_flag(
        p,
        "--explore",
        CollectConfig,
        type=_finite("--explore"),
        help="with --controller: chance per round of drafting the full --max-lookahead anyway, "
        "so every position gets labels on the states the controller meets; rows log "
        "'explored' and 'propensity'; with --plan: chance per round of a random action instead "
        "of the oracle plan's (default: %(default)s)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="collect for a round's plan: at every round start the features known then and "
        "what each action (step, copy:1..15, draft:1..--max-lookahead) would yield, exactly, "
        "by replay of the recorded target run (greedy); the behaviour is the oracle plan, or "
        "--controller's plan (on-policy), with --explore random rounds. uag train-controller on "
        "it exports a plan controller",
    )
    _add_sampling_args(p, collect=True)


def run_collect(args: argparse.Namespace) -> int:
    if args.plan:
        if args.controller is not None and not isinstance(
            load_controller(args.controller), LearnedPlan
        ):  # its contract, checked before the models load
            raise UagError(
                f"--plan follows a plan controller; {args.controller} is a stop controller"
            )
        settle_model_args(args)
        shard = parse_shard(args.shard) if args.shard is not None else (0, 1)
        sampling = sampling_config(args)
        cfg = config_from_args(
            CollectConfig,
            args,
            shard=shard,
            sampling=None if sampling is None else sampling.config,
        )
        written, rounds = collect_for_plan(cfg)
        print(f"collected {rounds} labelled rounds from {written} prompts into {cfg.out}")
        print(f"train it: uag train-controller --data {cfg.out} --out exports/ctrl.onnx")
        return 0
    learned = None
    if args.controller is not None:
        learned = LearnedPolicy(args.controller)  # its contract, checked before any work
    adopted = settle_model_args(args, learned)
    if adopted:
        print(adopted, file=sys.stderr)
    sampling = sampling_config(args)
    launch = launcher.from_env()
    shard = parse_shard(args.shard) if args.shard is not None else (0, 1)
    if launch is not None:
        if args.shard is not None and shard != launch.shard:
            raise UagError(
                f"--shard {args.shard} contradicts the launcher's RANK={launch.rank} "
                f"WORLD_SIZE={launch.world_size}: leave --shard out under a launcher"
            )
        if args.overwrite and not launch.coordinated:
            raise UagError(
                "--overwrite under a launcher needs MASTER_ADDR and MASTER_PORT (so rank 0 can "
                "clear the run before the others start): clear --out first, or use torchrun"
            )
        shard = launch.shard
        args.device = launch.device(args.device)
    cfg = config_from_args(
        CollectConfig,
        args,
        shard=shard,
        launched=launch is not None and launch.coordinated,
        logdir=(args.logdir or Path("runs") / "collect" / args.out.name)
        / ("" if launch is None else f"rank{launch.rank}"),
        sampling=None if sampling is None else sampling.config,
    )
    s = collect(cfg)
    print(
        f"collected {s.rows} drafted tokens from {s.prompts_done} prompts "
        f"({s.prompts_skipped} already done) into {s.out}; acceptance {s.acceptance_rate:.1%}; "
        f"logging overhead {s.logging_overhead:.1%} of loop time"
    )
    if s.rows:
        print(
            "acceptance by draft position: "
            + " ".join(f"{r:.2f}" for r in s.acceptance_by_position)
        )
    if sampling is not None and cfg.sampling is not None:  # its seed as the run resolved it
        print(replace(sampling, config=cfg.sampling).describe())
    print(f"meta: {s.meta_path}")
    print(f"TensorBoard: tensorboard --logdir {s.logdir}")
    return 0


def _hidden(value: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected widths like 32,32, got {value!r}") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"widths must be positive, got {value!r}")
    return widths


def _add_train_args(p: argparse.ArgumentParser) -> None:
    """``uag train-controller``'s flags, group by group (``--help`` lists them in this order)."""
    _add_train_io_args(p)
    _add_train_fit_args(p)
    _add_train_lightning_args(p)
    _add_train_choice_args(p)


def _add_train_io_args(p: argparse.ArgumentParser) -> None:
    """What training reads (collected runs) and writes (the ONNX file, TensorBoard logs)."""
    p.add_argument(
        "--data",
        type=Path,
        nargs="+",
        required=True,
        help="one or more uag collect output directories (same schema); uag collect --plan "
        "directories train a plan (the round's action) instead of a stop controller",
    )
    _add_config_flag(
        p, "--out", TrainConfig, type=Path, help="ONNX file to write (default: %(default)s)"
    )
    _add_config_flag(
        p,
        "--logdir",
        TrainConfig,
        type=Path,
        help="TensorBoard log directory (default: %(default)s)",
    )


def _add_config_flags(
    p: argparse.ArgumentParser, config: type, rows: tuple[tuple[str, Any, str], ...]
) -> None:
    """``_add_config_flag`` over a table of ``(flag, type or None, help)`` rows."""
    for flag, kind, text in rows:
        _add_config_flag(p, flag, config, help=text, **({"type": kind} if kind else {}))


def _add_train_fit_args(p: argparse.ArgumentParser) -> None:
    """The model and its fit: size, seed, held-out share, batches and learning rate."""
    _add_config_flags(p, TrainConfig, (
        ("--max-epochs", _positive_int, "training epochs (default: %(default)s)"),
        ("--hidden", _hidden, "MLP hidden widths, comma-separated (default: 32,32)"),
        ("--seed", _integer("--seed", low=0, high=2**32 - 1),
         "seed for the prompt split and training (default: %(default)s)"),
        ("--report-fraction", _finite("--report-fraction"),
         "share of the prompts held out from training and from choosing thresholds and "
         "kappa, on which the summary and the ONNX metadata report AUC and simulated speed-ups "
         "(0: none, and those figures are the validation prompts', where the choices were made) "
         "(default: %(default)s)"),
        ("--batch-size", _positive_int, "rows per training batch (default: %(default)s)"),
        ("--lr", _finite("--lr"), "AdamW learning rate (default: %(default)s)"),
    ))  # fmt: skip


def _add_train_lightning_args(p: argparse.ArgumentParser) -> None:
    """Where Lightning trains: passed through to its ``Trainer`` as given."""
    _add_config_flags(p, TrainConfig, (
        ("--accelerator", None, "Lightning accelerator: auto, cpu, gpu (default: %(default)s)"),
        ("--devices", None, "Lightning devices, e.g. 1, 4 or auto (default: %(default)s)"),
        ("--strategy", None,
         "Lightning strategy, e.g. ddp for several processes (GPUs, or CPU processes over "
         "gloo with --accelerator cpu --devices N): each takes a share of every batch, so the "
         "controller equals a one-process run's up to float noise; the first process exports "
         "(default: %(default)s)"),
        ("--num-nodes", _positive_int,
         "machines for multi-node training (default: %(default)s)"),
    ))  # fmt: skip


def _add_train_choice_args(p: argparse.ArgumentParser) -> None:
    """How the trained controller's choices are tuned, judged and allowed to mix data."""
    p.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="plan data: choose R and report per round on the collected round starts instead of "
        "by whole-run exact replay on the tune and report prompts (which loads the pair)",
    )
    p.add_argument(
        "--no-gate",
        dest="gate",
        action="store_false",
        help="never skip drafting a round (gate threshold 0): only the stop rule is learned "
        "(the shipped controller: its gate measured no faster on held-out prompts and costs "
        "one more controller call per round)",
    )
    p.add_argument(
        "--allow-mixed",
        action="store_true",
        help="train on --data runs of different pairs, assistant precision, decoding mode or "
        "latency device (refused by default: their acceptance and latencies differ)",
    )
    _add_config_flag(
        p,
        "--decision",
        TrainConfig,
        choices=("cost", "threshold"),
        help="how the controller decides: cost (draft on while the expected accepted tokens are "
        "worth their draft and verify time under the collected latency profile; no threshold "
        "is tuned) or threshold (stop and skip below scores tuned by replay on the validation "
        "prompts) (default: %(default)s)",
    )


def run_train(args: argparse.Namespace) -> int:
    # Lightning and scikit-learn take seconds to import: only `uag train-controller` pays.
    from training.plan import is_plan_collection, train_plan
    from training.train import train

    cfg = config_from_args(TrainConfig, args)
    if any(is_plan_collection(d) for d in cfg.data):
        from uag.harness.plan_replay import replayer

        plan = train_plan(cfg, replayer=replayer)
        print(plan.table())
        print(f"TensorBoard: tensorboard --logdir {cfg.logdir}   (this run: {plan.log_dir})")
        return 0
    summary = train(cfg)
    if summary is None:
        return 0  # another process of a multi-process run reports
    print(summary.table())
    print(f"wrote {summary.out} (onnxruntime vs torch max |diff| {summary.onnx_max_abs_diff:.2e})")
    print(f"TensorBoard: tensorboard --logdir {cfg.logdir}   (this run: {summary.log_dir})")
    return 0


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_prompt_set_args(p)
    p.add_argument(
        "--controller", type=Path, default=None, help="ONNX controller for the 'learned' policy"
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated: target-only, static[-K], heuristic[-K], confidence[-T], "
        "entropy[-T] (the same names as uag generate --policy), transformers, learned "
        "(--controller's), learned:PATH.onnx (another controller, to compare two in one run), "
        "lookup (prompt lookup, no assistant), any drafting policy + lookup (static-3+lookup), "
        "the hybrid rule +lookup-N (static-2+lookup-3: copy only after a match of N >= 2 tokens, "
        "else draft), bandit (UCB1 per prompt over step, copy and static-1/2/4; no replay "
        "prediction), "
        "oracle (simulated; it also makes the run predict every uag greedy arm by exact replay, "
        "printed beside its measurement) "
        f"(default: {DEFAULT_POLICIES}; with --sample: "
        f"{SAMPLING_POLICIES})",
    )
    _add_config_flag(
        p,
        "--repeats",
        BenchConfig,
        type=_positive_int,
        help="runs per prompt and policy (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/bench"),
        help="where results.json, results.md, speedup.png and TensorBoard events go (default: %(default)s)",
    )
    _add_sampling_args(p, bench=True)


def run_bench_cmd(args: argparse.Namespace) -> int:
    if args.policies is None:
        args.policies = SAMPLING_POLICIES if args.sample else DEFAULT_POLICIES
    if "learned" in args.policies and args.controller is None:
        # The shipped controller (greedy, or the sampling plan under --sample), beside the
        # package whatever the working directory.
        shipped = recipes.SHIPPED_SAMPLING_CONTROLLER if args.sample else recipes.SHIPPED_CONTROLLER
        args.controller = shipped if shipped.is_file() else None
    # One pair for every arm: the defaults, not the controller's settings (its arm warns when
    # they differ from what it was trained with).
    settle_model_args(args)
    sampling = sampling_config(args)
    cfg = config_from_args(
        BenchConfig, args, sampling=None if sampling is None else sampling.config
    )
    report = run_bench(cfg)
    write_report(report, args.out)
    print(report.markdown())
    if sampling is not None:  # round 0's seed as the run drew it
        seed = report.config["sampling"]["seed"]
        print(replace(sampling, config=replace(sampling.config, seed=seed)).describe())
    print(f"{report.prompts} prompts, machine: {report.machine}")
    print(
        f"wrote {args.out}/results.json, results.md, speedup.png; TensorBoard: tensorboard --logdir {args.out}/tensorboard"
    )
    unsound = [p.name for p in report.policies if not p.sound]
    if sampling is not None and "transformers" in unsound:
        # Not uag's to fix, and the reason that arm is there: report it, do not fail on it.
        unsound.remove("transformers")
        print(
            "uag: note: Transformers' speculative sampling fails the distribution check on this pair",
            file=sys.stderr,
        )
    if unsound:
        what = "sample another distribution than" if sampling else "outputs differ from"
        print(f"uag: error: {what} target-only: {', '.join(unsound)}", file=sys.stderr)
        return 1
    return 0


def _add_calibrate_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_config_flag(
        p,
        "--prompts",
        CalibrateConfig,
        help="prompts to replay (the forms uag bench takes; default: %(default)s: training "
        "prompts, so a bench on the test ones stays held-out)",
    )
    _add_config_flag(
        p,
        "--limit",
        CalibrateConfig,
        type=_positive_int,
        help="at most this many prompts of each set (default: %(default)s)",
    )
    _add_config_flag(
        p,
        "--max-new-tokens",
        CalibrateConfig,
        type=_positive_int,
        help="target tokens per recorded run (default: %(default)s)",
    )


def run_calibrate(args: argparse.Namespace) -> int:
    adopted = settle_model_args(args)
    cfg = config_from_args(calibration.CalibrateConfig, args)
    prompts = load_prompts(cfg.prompts, limit=cfg.limit)
    refuse_held_out(prompts, command="uag calibrate")
    pair = cfg.load_pair()
    if adopted:
        print(adopted, file=sys.stderr)
    bar = tqdm(total=len(prompts) + 2 + len(calibration.RULES), desc="calibrate", unit="step")

    def progress(what: str) -> None:
        bar.set_postfix_str(what[:60])
        bar.update(1)

    rec = calibration.record(pair, prompts, max_new_tokens=cfg.max_new_tokens, progress=progress)
    bar.set_postfix_str("searching copy lengths by exact replay")
    lookup = calibration.search_lookup(pair, rec)
    rule = calibration.choose_rule(pair, rec, lengths=lookup.lengths, progress=progress)
    bar.update(1)
    bar.close()
    lookup_file, rule_file = recipes.calibration_path(pair), recipes.rule_path(pair)
    recipes.save_calibration(lookup, lookup_file)
    recipes.save_calibration(rule, rule_file)
    shown = "/".join(map(str, lookup.lengths))
    built_in = "/".join(map(str, PromptLookup().max_tokens))
    print(
        f"prompt lookup copies {shown} tokens after a 1/2/3+-token match on this machine "
        f"({lookup.machine}): replay predicts lookup alone at {lookup.predicted:.2f}x the target "
        f"alone on {lookup.prompts} prompts, the built-in {built_in} at "
        f"{lookup.default_predicted:.2f}x"
    )
    runners_up = sorted(rule.candidates.items(), key=lambda kv: -kv[1])[1:4]
    print(
        f"fastest rule for this pair: {rule.rule} at {rule.predicted:.2f}x the target alone "
        f"(then {', '.join(f'{name} {v:.2f}x' for name, v in runners_up)})"
    )
    print(
        f"wrote {lookup_file} and {rule_file}: uag generate and uag bench copy with these "
        "lengths, and a pair without a trained plan runs this rule by default"
    )
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_plan_args(p)
    p.set_defaults(sample=False)  # the plan for sampled requests is resolved beside the greedy one
    p.add_argument(
        "--prefix-cache",
        type=_integer("--prefix-cache", low=0),
        default=8192,
        metavar="POSITIONS",
        help="cached positions each model keeps of earlier requests: a request starts from the "
        "longest prefix it shares with one of them, e.g. a chat's history (Gemma 3 270M ~36 KB "
        "a position, Qwen2.5 1.5B ~57 KB); 0 starts every request from an empty cache (exact "
        "either way: kept only where every row is computed on its own) (default: %(default)s)",
    )
    _add_config_flags(p, ServeConfig, (
        ("--host", None, "address to listen on (default: %(default)s; another than loopback "
         "without --api-key prints a warning)"),
        ("--port", _integer("--port", low=0, high=65535),
         "port to listen on, 0 for any free one (default: %(default)s)"),
        ("--api-key", None, "require 'Authorization: Bearer KEY' on every route but /health "
         "(default: none)"),
        ("--queue", _positive_int, "requests that may wait while one generates; more are "
         "answered 429 (default: %(default)s)"),
        ("--max-tokens", _positive_int, "the most tokens one request may ask for, and a chat "
         "request's default (default: %(default)s)"),
        ("--max-body", _positive_int, "request bodies over this many bytes are answered 413 "
         "(default: %(default)s)"),
    ))  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    """``uag serve``: the port taken first (a busy port fails in a second, not after the
    models load), then the pair and its plans, then requests until SIGTERM or Ctrl-C."""
    config = config_from_args(ServeConfig, args)
    try:
        from uag.serve.app import is_loopback, listen, run
        from uag.serve.engine import Engine
        from uag.serve.metrics import Metrics
    except ImportError as err:
        raise UagError(
            f"uag serve needs FastAPI and uvicorn ({err.name} is missing): pip install 'uag[serve]'"
        ) from None
    if not is_loopback(config.host) and config.api_key is None:
        print(
            f"uag serve: warning: listening on {config.host} without --api-key: anyone who can "
            "reach this port can use the models",
            file=sys.stderr,
        )
    request = _plan_request(args)
    adopted = settle_model_args(args, request.controller)
    sock = listen(config.host, config.port)
    pair = load_pair_of(args)
    if adopted:
        print(adopted, file=sys.stderr)
    if args.prefix_cache:
        kept = pair.keep_prefixes(args.prefix_cache)
        print(
            f"uag serve: prefix reuse (up to {args.prefix_cache} cached positions a model) for "
            f"{' and '.join(kept) or 'neither model'}",
            file=sys.stderr,
        )
    plans = {mode: request.resolve(pair, args, sampling=mode) for mode in (False, True)}
    engine = Engine(pair=pair, plans=plans.__getitem__, queue_size=config.queue, metrics=Metrics())
    return run(engine=engine, model_id=args.target, config=config, sock=sock)


# One row per subcommand: its name, its --help line, how to add its flags, what to run.
COMMANDS: dict[str, Command] = {
    name: Command(help=text, add_args=add_args, run=run)
    for name, text, add_args, run in (
        ("generate", "generate text with cross-tokenizer speculative decoding",
         _add_generate_args, run_generate),
        ("collect", "log draft confidences and acceptance outcomes into a Parquet dataset",
         _add_collect_args, run_collect),
        ("train-controller", "train the stop controller on collected data and export it to ONNX",
         _add_train_args, run_train),
        ("bench", "compare policies side by side on the same prompts (speed-ups, equality checked)",
         _add_bench_args, run_bench_cmd),
        ("calibrate", "choose copy lengths and the fastest rule for this pair on this machine by exact replay",
         _add_calibrate_args, run_calibrate),
        ("models", "list embedded models or convert them ahead of time",
         _add_models_args, run_models),
        ("serve", "serve the pair over an OpenAI-compatible HTTP API (completions and chat, "
         "streaming)", _add_serve_args, run_serve),
    )
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="uag",
        description=(
            "Lossless cross-tokenizer speculative decoding (Universal Assisted Generation): a small "
            "assistant drafts, the target verifies, the output is exactly the target's greedy output."
        ),
        epilog="Errors print one line; set UAG_DEBUG=1 for full tracebacks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        cmd.add_args(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        if argv is None:
            # The process ends next: without this, Python's last collection walks every object
            # the run made (tokenizers' vocabularies, the bridge's tables): ~0.3 s of a
            # one-token ``uag generate``, for memory the exit frees anyway. Only for the command
            # line (``argv`` None): a caller's process goes on and keeps collecting as usual.
            gc.freeze()


def _main(argv: Sequence[str] | None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except UagError as err:
        print(f"uag: error: {err}", file=sys.stderr)
        if os.environ.get("UAG_DEBUG") == "1":
            traceback.print_exc()
        return 2
    except KeyboardInterrupt:
        print("uag: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug, not bad input: still one line unless debugging
        if os.environ.get("UAG_DEBUG") == "1":
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        print(
            f"uag: internal error: {type(err).__name__}: {first} (set UAG_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
