"""``uag collect``: run UAG with a long, never-stopping draft and log every drafted token.

Output directory layout (one run; several ``--shard i/n`` processes may share it)::

    DIR/meta.json                   (or meta-<i>of<n>.json per shard when n > 1)
    DIR/part-<sha1(prompt id)>.parquet   one file per prompt, written atomically after it finishes

One file per prompt makes a crash or Ctrl-C lose at most the prompt in flight, makes ``--resume``
a matter of checking which files exist, and keeps shards from clashing (their prompts differ).
Read it all with::

    datasets.load_dataset("parquet", data_files="DIR/part-*.parquet", split="train")
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import uag
from controllers.explore import ExplorePolicy, RoundLog
from controllers.learned import LearnedPolicy
from controllers.plans import RulePlan
from controllers.rules import StaticPolicy
from training.data import read_meta
from uag import api
from uag.decoding.features import FEATURE_NAMES, SCHEMA_VERSION, feature_rows
from uag.decoding.round import MAX_CANDIDATES
from uag.decoding.sampling import SamplingConfig
from uag.errors import UagError
from uag.harness.jobs import RunConfig
from uag.harness.latency import measure_pair_profile
from uag.harness.prompts import Prompt, as_text, load_prompts, refuse_held_out
from uag.paths import unwritable
from uag.runtime.models import resolve_device

ITERATION_COLUMNS = (
    "iter_drafted",
    "iter_candidates",
    "iter_accepted_candidates",
    "iter_emitted",
    "iter_accepted_drafts",
    "iter_draft_s",
    "iter_verify_s",
)
"""Per-iteration columns repeated on each of its rows; ``iter_accepted_drafts`` is the oracle
stop point (how many tokens a perfect controller would have drafted this iteration)."""


@dataclass
class CollectConfig(RunConfig):
    """What to collect, from which pair, and where to write it."""

    max_lookahead: int = 10
    """Tokens drafted every iteration (the draft never stops earlier, except at the assistant's EOS)."""
    resume: bool = False
    overwrite: bool = False
    shard: tuple[int, int] = (0, 1)
    """(i, n): this process takes prompts whose index % n == i."""
    launched: bool = False
    """The shards were started together by a launcher that lets them meet (torchrun): with
    ``overwrite``, shard 0 clears the whole run while the others wait at a barrier."""
    logdir: Path | None = None
    profile_repeats: int = 5
    reprofile: bool = False
    """Measure the latency profile again even when resuming (new machine, faster code)."""
    sampling: SamplingConfig | None = None
    """Collect under speculative sampling: rows get a soft label ``accept_prob`` too. Each
    prompt's seed is the run's seed plus a hash of the prompt id (stable under --resume)."""
    controller: Path | None = None
    """Collect on-policy: follow this ONNX controller (``controllers.explore``) instead of
    drafting ``max_lookahead`` tokens every round."""
    explore: float = 0.0
    """With ``controller``: the chance per round of drafting the full lookahead anyway. With
    ``plan``: the chance per round of a uniformly random action instead of the oracle's."""
    plan: bool = False
    """Collect for a round's plan (``uag.harness.plan_collect``): round-start features and every
    action's exact outcome (step, copy:1..15, draft:1..max_lookahead), greedy only."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = None if self.logdir is None else unwritable(self.logdir, directory=True)
        if problem is not None:
            raise UagError(f"--logdir: {problem}")
        if self.max_lookahead < 1:
            raise UagError(f"--max-lookahead must be at least 1, got {self.max_lookahead}")
        if self.max_new_tokens < 1:
            raise UagError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.limit is not None and self.limit < 1:
            raise UagError(f"--limit must be at least 1, got {self.limit}")
        i, n = self.shard
        if not (n >= 1 and 0 <= i < n):
            raise UagError(f"--shard must be i/n with 0 <= i < n, got {i}/{n}")
        if self.resume and self.overwrite:
            raise UagError("--resume and --overwrite contradict each other: pick one")
        if not 0.0 <= self.explore <= 1.0:
            raise UagError(f"--explore must be a probability in [0, 1], got {self.explore}")
        if self.explore and self.controller is None and not self.plan:
            raise UagError(
                "--explore goes with --controller or --plan (it explores around that policy)"
            )
        if self.sampling is not None and self.sampling.seed is None:
            self.sampling = replace(self.sampling, seed=0)  # a collection is reproducible


@dataclass
class CollectSummary:
    """What a collect run did."""

    out: Path
    prompts_total: int
    prompts_done: int
    prompts_skipped: int
    rows: int
    accepted: int
    loop_seconds: float
    logging_seconds: float
    meta_path: Path
    logdir: Path | None = None
    acceptance_by_position: list[float] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.rows if self.rows else 0.0

    @property
    def logging_overhead(self) -> float:
        """Logging time (features, Parquet, TensorBoard) as a share of the loop's time."""
        return self.logging_seconds / self.loop_seconds if self.loop_seconds else 0.0


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UagError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    return i, n


def part_path(out: Path, prompt_id: str) -> Path:
    return out / f"part-{hashlib.sha1(prompt_id.encode()).hexdigest()[:16]}.parquet"


def meta_path(out: Path, shard: tuple[int, int]) -> Path:
    i, n = shard
    return out / ("meta.json" if n == 1 else f"meta-{i}of{n}.json")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def rows_for_prompt(
    prompt: Prompt, iterations: list[Any], rounds: list[RoundLog] | None = None, eps: float = 1.0
) -> dict[str, np.ndarray]:
    """Column arrays for one prompt's drafted tokens (labels from the iteration records).

    ``rounds`` (on-policy collection, ``controllers.explore``): per iteration the assistant
    drafted in (its action a draft: the prompt's own round is a step), whether it explored and
    whether the controller would have drafted each position; rows then carry ``explored`` and
    ``propensity`` = ``eps + (1 - eps) * would_draft``. Without them every round drafted the
    full lookahead: explored 1, propensity 1.
    """
    drafting = [i for i, r in enumerate(iterations) if r.action.startswith("draft")]
    if rounds is not None and len(rounds) != len(drafting):
        raise ValueError(
            f"{len(rounds)} exploration records for {len(drafting)} drafting iterations"
        )
    logs = dict(zip(drafting, rounds, strict=True)) if rounds is not None else {}
    steps = [s for r in iterations for s in r.steps]
    feats = feature_rows(steps)
    columns: dict[str, np.ndarray] = {name: feats[:, j] for j, name in enumerate(FEATURE_NAMES)}
    accepted, iteration, position, token = [], [], [], []
    explored: list[int] = []
    propensity: list[float] = []
    soft: list[float] = []
    rates: list[float] = []
    per_iter: dict[str, list[float]] = {c: [] for c in ITERATION_COLUMNS}
    for it, rec in enumerate(iterations):
        soft += list(rec.accept_probs)
        rates += list(rec.accept_rates)
        log = logs.get(it)
        for j, s in enumerate(rec.steps):
            # Label: the text of drafts 1..i lies inside the accepted text (monotone by construction).
            accepted.append(int(s.position <= rec.accepted_drafts))
            if log is None:  # a fixed-lookahead round: drafted in full, whatever the state
                explored.append(1)
                propensity.append(1.0)
            else:
                explored.append(int(log.explored))
                propensity.append(eps + (1.0 - eps) * log.would_draft[j])
            iteration.append(it)
            position.append(s.position)
            token.append(s.token_id)
            per_iter["iter_drafted"].append(rec.drafted)
            per_iter["iter_candidates"].append(rec.candidates)
            per_iter["iter_accepted_candidates"].append(rec.accepted_candidates)
            per_iter["iter_emitted"].append(rec.emitted)
            per_iter["iter_accepted_drafts"].append(rec.accepted_drafts)
            per_iter["iter_draft_s"].append(rec.draft_s)
            per_iter["iter_verify_s"].append(rec.verify_s)
    columns["accepted"] = np.asarray(accepted, dtype=np.int8)
    if soft:  # sampling: the label's expectation given the draft (uag.decoding.sampling.expected_acceptance)
        if len(soft) != len(accepted):
            raise ValueError(f"{len(soft)} soft labels for {len(accepted)} drafted tokens")
        columns["accept_prob"] = np.asarray(soft, dtype=np.float32)
        columns["accept_rate"] = np.asarray(rates, dtype=np.float32)  # Σ min(p, q)
    columns["explored"] = np.asarray(explored, dtype=np.int8)
    columns["propensity"] = np.asarray(propensity, dtype=np.float32)
    columns["prompt_id"] = np.asarray([prompt.id] * len(accepted), dtype=object)
    columns["iteration"] = np.asarray(iteration, dtype=np.int32)
    columns["position"] = np.asarray(position, dtype=np.int32)
    columns["token_id"] = np.asarray(token, dtype=np.int64)
    for name, values in per_iter.items():
        dtype = np.float32 if name.endswith("_s") else np.int32
        columns[name] = np.asarray(values, dtype=dtype)
    return columns


def write_part(path: Path, columns: dict[str, np.ndarray]) -> None:
    # pyarrow is slow to import, and the CLI imports this module at start-up.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({k: pa.array(v) for k, v in columns.items()})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


RUN_SETTINGS = (
    "schema_version",
    "feature_names",
    "target",
    "assistant",
    "assistant_int8",
    "draft_vocab",
    "decoding",
    "prompt_source",
    "text_column",
    "chat",
    "max_lookahead",
    "max_new_tokens",
    "sampling",
    "controller",
    "explore",
)
"""What one run's rows share: ``--resume`` refuses a run that differs in any of them."""


def file_digest(path: Path) -> str:
    """A controller's identity in run settings: its bytes, not its path."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as err:
        raise UagError(f"cannot read --controller {path}: {err.strerror}") from None


def run_settings(cfg: CollectConfig) -> dict[str, Any]:
    """This run's values of ``RUN_SETTINGS``, as ``meta.json`` records them."""
    return {
        "schema_version": SCHEMA_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "target": cfg.target,
        "assistant": cfg.assistant,
        "assistant_int8": cfg.assistant_int8,
        "draft_vocab": cfg.draft_vocab,
        "decoding": "greedy" if cfg.sampling is None else "sampling",
        "prompt_source": cfg.prompts,
        "text_column": cfg.text_column,
        "chat": cfg.chat,
        "max_lookahead": cfg.max_lookahead,
        "max_new_tokens": cfg.max_new_tokens,
        "sampling": None if cfg.sampling is None else asdict(cfg.sampling),
        "controller": None if cfg.controller is None else file_digest(cfg.controller),
        "explore": None if cfg.controller is None else cfg.explore,
    }


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A prompt's sampling seed: the same whichever shard or resume reaches it."""
    return (seed + int(hashlib.sha1(prompt_id.encode()).hexdigest()[:8], 16)) % 2**63


def _prepare_out(cfg: CollectConfig, mine: list[Prompt], *, clear_all: bool) -> list[Prompt]:
    """Check DIR against --resume/--overwrite and the settings of what it holds; return the
    prompts still to do.

    Shards of one run share DIR (each writes its own prompts' parts and its own meta file), so
    "already holds a run" means this shard's files; ``--overwrite`` with ``clear_all`` (a single
    process, or shard 0 of a launch while the others wait) clears every part and meta file,
    otherwise only this shard's own (the others may be running). Whatever stays must have been
    collected with this run's settings.
    """
    cfg.out.mkdir(parents=True, exist_ok=True)
    meta = meta_path(cfg.out, cfg.shard)
    _remove_stale_temporaries(cfg.out, {part_path(cfg.out, p.id).name for p in mine} | {meta.name})
    own = [part_path(cfg.out, p.id) for p in mine if part_path(cfg.out, p.id).exists()]
    own += [meta] if meta.exists() else []
    if own and not (cfg.resume or cfg.overwrite):
        raise UagError(
            f"{cfg.out} already holds a collect run: pass --resume to continue it or --overwrite to replace it"
        )
    if cfg.overwrite:
        everything = sorted(cfg.out.glob("part-*.parquet")) + sorted(cfg.out.glob("meta*.json"))
        for path in everything if clear_all else own:
            path.unlink()
    want = run_settings(cfg)
    for held in sorted(cfg.out.glob("meta*.json")):
        old = read_meta(held)
        for key in ("sampling", "controller", "explore"):  # runs from before these settings
            old.setdefault(key, None)
        old.setdefault("draft_vocab", 0)  # runs from before it drafted from every id
        differ = [k for k in RUN_SETTINGS if old.get(k, "(missing)") != want[k]]
        if differ:
            what = "; ".join(
                f"{k} {old.get(k, '(missing)')!r} there, {want[k]!r} here" for k in differ
            )
            raise UagError(
                f"cannot add to {cfg.out}: {held.name} was collected with other settings ({what}); "
                "use the same settings or pass --overwrite"
            )
    done = {p.id for p in mine if part_path(cfg.out, p.id).exists()}
    return [p for p in mine if p.id not in done]


def _remove_stale_temporaries(out: Path, names: set[str]) -> None:
    """Delete the temporary copies (``.NAME.PID.tmp``, ``write_part``) of the files ``names``: a
    writer killed mid-file leaves one behind. Only this shard's own names: no other process
    writes them, while another shard of the run may be writing its own right now."""
    for tmp in out.glob(".*.tmp"):
        if tmp.name[1:].rsplit(".", 2)[0] in names:
            tmp.unlink(missing_ok=True)


def _prepare_together(cfg: CollectConfig, mine: list[Prompt]) -> list[Prompt]:
    """``_prepare_out`` for shards a launcher started together: shard 0 clears the whole run
    before any other shard looks at the directory (a gloo barrier, through the launcher's
    ``MASTER_ADDR``/``MASTER_PORT``). If shard 0 fails, the launcher stops the others."""
    dist.init_process_group("gloo")
    try:
        if cfg.shard[0] == 0:
            todo = _prepare_out(cfg, mine, clear_all=True)
            dist.barrier()
        else:
            dist.barrier()
            todo = _prepare_out(cfg, mine, clear_all=False)
    finally:
        dist.destroy_process_group()
    return todo


def collect_for_plan(cfg: CollectConfig, *, progress: bool = True) -> tuple[int, int]:
    """``uag collect --plan``: (prompts written, rounds written) into ``cfg.out``."""
    from uag.harness.plan_collect import PlanCollectConfig, collect_plan

    if cfg.shard != (0, 1):
        raise UagError("--plan runs as one process: leave out --shard")
    prompts = load_prompts(cfg.prompts, text_column=cfg.text_column, limit=cfg.limit)
    refuse_held_out(prompts, command="uag collect")
    pair = cfg.load_pair()
    settings = {
        "target": cfg.target,
        "assistant": cfg.assistant,
        "assistant_int8": cfg.assistant_int8,
        "draft_vocab": pair.draft_vocab,
        "kernels": pair.kernels,
        "chat": cfg.chat,
    }
    same = ("out", "max_new_tokens", "explore", "sampling", "resume", "overwrite")
    plan_cfg = PlanCollectConfig(
        **{name: getattr(cfg, name) for name in same},  # the fields both configs name alike
        max_draft=cfg.max_lookahead,
        follow=cfg.controller,
        settings=settings,
    )
    return collect_plan(
        pair,
        prompts,
        plan_cfg,
        profile=lambda: measure_pair_profile(
            pair, max_candidates=MAX_CANDIDATES, repeats=cfg.profile_repeats, sampling=cfg.sampling
        ),
        encode=lambda prompt: api.encode_prompt(pair, as_text(pair, prompt, chat=cfg.chat)),
        progress=progress,
    )


def collect(cfg: CollectConfig, *, progress: bool = True) -> CollectSummary:
    """Run the collection described by ``cfg`` (see the module docstring for the layout).

    In phases: this shard's prompts and the output directory checked, the pair loaded, the
    meta written (with the latency profile), then prompt by prompt: run, write, tally."""
    shard = _open_shard(cfg)
    pair = cfg.load_pair()
    if shard.learned is not None:
        shard.learned.warn_if_foreign_to(
            cfg, device=pair.target.device.type, draft_vocab=pair.draft_vocab
        )
    meta = meta_path(cfg.out, cfg.shard)
    if not meta.exists() or cfg.reprofile:
        _write_meta(cfg, pair=pair, path=meta)
    writer = _tensorboard(cfg.logdir)
    summary = CollectSummary(
        out=cfg.out,
        prompts_total=len(shard.mine),
        prompts_done=0,
        prompts_skipped=len(shard.mine) - len(shard.todo),
        rows=0,
        accepted=0,
        loop_seconds=0.0,
        logging_seconds=0.0,
        meta_path=meta,
        logdir=cfg.logdir,
    )
    tally = _Tally.up_to(cfg.max_lookahead)
    i, n = cfg.shard
    bar = tqdm(shard.todo, desc=f"collect {i}/{n}", unit="prompt", disable=not progress)
    for prompt in bar:
        run = _run_prompt(cfg, pair=pair, prompt=prompt, learned=shard.learned)
        _log_prompt(cfg, prompt=prompt, run=run, summary=summary, tally=tally, writer=writer)
        bar.set_postfix(acceptance=f"{summary.acceptance_rate:.1%}", rows=summary.rows)
    summary.acceptance_by_position = tally.by_position()
    if writer is not None:
        tally.write(writer, rates=summary.acceptance_by_position)
        writer.close()
    return summary


@dataclass
class _Shard:
    """This process's share of a collect run."""

    mine: list[Prompt]
    """The prompts this shard takes (index % n == i)."""
    todo: list[Prompt]
    """Of those, the ones not already on disk (``--resume``)."""
    learned: LearnedPolicy | None
    """The controller it collects on-policy with (None: the full lookahead every round)."""


def _open_shard(cfg: CollectConfig) -> _Shard:
    """This shard's prompts, and the output directory checked and cleared as asked. The
    controller loads first, so a bad file fails before ``--overwrite`` deletes anything; shards
    a launcher started together let shard 0 clear the whole run before the others look."""
    prompts = load_prompts(cfg.prompts, text_column=cfg.text_column, limit=cfg.limit)
    refuse_held_out(prompts, command="uag collect")
    i, n = cfg.shard
    mine = [p for k, p in enumerate(prompts) if k % n == i]
    learned = None
    if cfg.controller is not None:  # checked before --overwrite clears anything
        learned = LearnedPolicy(cfg.controller, use_cuda=resolve_device(cfg.device).type == "cuda")
    if cfg.launched and cfg.overwrite:
        todo = _prepare_together(cfg, mine)
    else:
        todo = _prepare_out(cfg, mine, clear_all=n == 1)
    return _Shard(mine=mine, todo=todo, learned=learned)


def _write_meta(cfg: CollectConfig, *, pair: Any, path: Path) -> None:
    """The run's meta file: its settings (what ``--resume`` compares), the pair as loaded, the
    latency profile measured now (what training prices rounds with) and the versions."""
    # Transformers takes seconds to import: only a run pays (the CLI imports this module).
    import transformers

    profile = measure_pair_profile(
        pair, max_candidates=cfg.max_lookahead + 1, repeats=cfg.profile_repeats
    )
    record = {
        **run_settings(cfg),
        "kernels": pair.kernels,
        "assistant_draft_vocab": pair.draft_vocab,
        "shard": list(cfg.shard),
        "latency_profile": profile.to_dict(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "uag": uag.__version__,
        },
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
    }
    _atomic_write_bytes(path, json.dumps(record, indent=2).encode())


def _tensorboard(logdir: Path | None) -> Any:
    """A TensorBoard writer into ``logdir``, or None without one."""
    if logdir is None:
        return None
    # TensorBoard's writer is slow to import: only with --logdir.
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(logdir))


@dataclass
class _PromptRun:
    """One prompt through uag's loop."""

    out: api.GenerationResult
    rounds: list[RoundLog] | None
    """The exploring policy's record of each round (None: every round drafted in full)."""
    seconds: float
    """The loop's wall time, what logging's overhead is measured against."""


def _run_prompt(
    cfg: CollectConfig, *, pair: Any, prompt: Prompt, learned: LearnedPolicy | None
) -> _PromptRun:
    """``prompt`` through the loop with its draft steps kept: the full lookahead every round,
    or ``learned``'s choices with exploration. Sampling seeds each prompt by its id, so a
    resumed or sharded run draws what a single run would."""
    start = time.perf_counter()
    sampling = cfg.sampling
    if sampling is not None:
        sampling = replace(sampling, seed=prompt_seed(sampling.seed or 0, prompt.id))
    policy: ExplorePolicy | StaticPolicy = StaticPolicy(k=cfg.max_lookahead)
    if learned is not None:
        policy = ExplorePolicy(
            inner=learned, eps=cfg.explore, lookahead=cfg.max_lookahead, seed=prompt.id
        )
    out = api.generate(
        pair,
        as_text(pair, prompt, chat=cfg.chat),
        plan=RulePlan(policy),
        max_new_tokens=cfg.max_new_tokens,
        keep_steps=True,
        sampling=sampling,
    )
    return _PromptRun(
        out=out,
        rounds=policy.rounds if isinstance(policy, ExplorePolicy) else None,
        seconds=time.perf_counter() - start,
    )


def _log_prompt(
    cfg: CollectConfig,
    *,
    prompt: Prompt,
    run: _PromptRun,
    summary: CollectSummary,
    tally: _Tally,
    writer: Any,
) -> None:
    """``run``'s rows written to the prompt's part file and counted into ``summary``, ``tally``
    and TensorBoard. Logging is timed against the loop so its overhead can be reported
    (target: < 5 %)."""
    start = time.perf_counter()
    columns = rows_for_prompt(prompt, run.out.iterations, rounds=run.rounds, eps=cfg.explore)
    write_part(part_path(cfg.out, prompt.id), columns)
    acc = tally.add(columns)
    summary.prompts_done += 1
    summary.rows += len(acc)
    summary.accepted += int(acc.sum())
    if writer is not None:
        step = summary.prompts_done + summary.prompts_skipped
        writer.add_scalar("collect/acceptance_rate", float(acc.mean()) if len(acc) else 0.0, step)
        writer.add_scalar(
            "collect/tokens_per_target_forward",
            run.out.tokens_per_forward,
            step,
        )
    summary.logging_seconds += time.perf_counter() - start
    summary.loop_seconds += run.seconds


@dataclass
class _Tally:
    """Over every prompt of the run: acceptance by draft position (the summary's) and the
    drafted tokens' probabilities, accepted or rejected (TensorBoard's histograms)."""

    by_pos_total: np.ndarray
    by_pos_accepted: np.ndarray
    probs_acc: list[np.ndarray] = field(default_factory=list)
    probs_rej: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def up_to(cls, max_lookahead: int) -> _Tally:
        """An empty tally for draft positions 1..``max_lookahead`` (index 0 unused)."""
        return cls(
            by_pos_total=np.zeros(max_lookahead + 1), by_pos_accepted=np.zeros(max_lookahead + 1)
        )

    def add(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """One prompt's rows counted; returns their labels (accepted or not) as booleans."""
        acc = columns["accepted"].astype(bool)
        pos = columns["position"]
        np.add.at(self.by_pos_total, pos, 1)
        np.add.at(self.by_pos_accepted, pos[acc], 1)
        self.probs_acc.append(columns["prob"][acc])
        self.probs_rej.append(columns["prob"][~acc])
        return acc

    def by_position(self) -> list[float]:
        """The acceptance rate at each draft position 1..max_lookahead (0.0 where none)."""
        return [
            float(a / t) if t else 0.0
            for a, t in zip(self.by_pos_accepted[1:], self.by_pos_total[1:], strict=True)
        ]

    def write(self, writer: Any, *, rates: list[float]) -> None:
        """``rates`` (``by_position``'s) and the probability histograms into TensorBoard."""
        for p, rate in enumerate(rates, start=1):
            writer.add_scalar("collect/acceptance_by_position", rate, p)
        for tag, parts in (
            ("collect/prob_accepted", self.probs_acc),
            ("collect/prob_rejected", self.probs_rej),
        ):
            values = np.concatenate(parts) if parts else np.zeros(0)
            if values.size:  # TensorBoard refuses an empty histogram
                writer.add_histogram(tag, values, 0)
