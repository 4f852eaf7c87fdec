"""uag collect: exact labels, the runtime's own features, crash-safe resume, clean errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import uag
from controllers.plans import RulePlan
from tests.tiny import one_clean_line, same_tokenizer_pair
from uag.cli import main
from uag.decoding.features import FEATURE_NAMES, feature_row
from uag.decoding.policy import DraftContext, DraftStep, IterationOutcome
from uag.decoding.round import IterationRecord
from uag.errors import UagError
from uag.harness.collect import CollectConfig, collect, part_path, rows_for_prompt
from uag.harness.prompts import Prompt, load_prompts


def _read_dir(out):
    tables = [pq.read_table(p).to_pandas() for p in sorted(out.glob("part-*.parquet"))]
    import pandas as pd

    return pd.concat(tables, ignore_index=True)


def _step(position: int) -> DraftStep:
    ctx = DraftContext(
        iteration=0,
        generated=0,
        remaining=9,
        prev_drafted=0,
        prev_accepted=0,
        drafted_total=0,
        accepted_total=0,
        target_prob=float("nan"),
        target_entropy=float("nan"),
    )
    return DraftStep(
        position=position,
        token_id=position,
        token_bytes=b"x",
        prob=0.5,
        entropy=1.0,
        margin=0.1,
        cum_logprob=-1.0,
        min_prob=0.5,
        target_tokens=position,
        context=ctx,
    )


def test_labels_and_oracle_from_records():
    rec = lambda drafted, accepted: IterationRecord(  # noqa: E731
        drafted=drafted,
        candidates=drafted,
        accepted_candidates=accepted,
        emitted=accepted + 1,
        accepted_drafts=accepted,
        draft_s=0.1,
        verify_s=0.2,
        bridge_s=0.0,
        policy_s=0.0,
        steps=tuple(_step(p) for p in range(1, drafted + 1)),
    )
    cols = rows_for_prompt(Prompt("p", "t"), [rec(4, 2), rec(3, 0), rec(2, 2)])
    assert cols["accepted"].tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert cols["iteration"].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert cols["iter_accepted_drafts"].tolist() == [2, 2, 2, 2, 0, 0, 0, 2, 2]
    assert set(FEATURE_NAMES) <= set(cols)


def test_loop_labels_match_output_text(tokenizers):
    """Recompute every label from the final output: draft 1..i's bytes lie within the text the
    target accepted in that iteration."""
    pair = same_tokenizer_pair(tokenizers, noise=0.05)
    res = uag.generate(
        pair,
        "def f(x):\n    return",
        plan=RulePlan(uag_static(5)),
        max_new_tokens=60,
        keep_steps=True,
    )
    table = pair.bridge.target.table
    out_bytes = [table[t] for t in res.token_ids]
    start, seen_accept, seen_reject = 0, False, False
    for rec in res.iterations:
        accepted_text = b"".join(out_bytes[start : start + rec.emitted])
        draft = b""
        for step in rec.steps:
            draft += step.token_bytes
            label = step.position <= rec.accepted_drafts
            assert label == accepted_text.startswith(draft)
            seen_accept |= label
            seen_reject |= not label
        start += rec.emitted
    assert seen_accept and seen_reject


def uag_static(k):
    from controllers.rules import StaticPolicy

    return StaticPolicy(k=k)


@dataclass
class RecordingPolicy:
    """Static lookahead that records the feature rows the runtime computes at each stop()."""

    k: int
    name: str = "recording"
    needs_features: ClassVar[bool] = True
    rows: list[np.ndarray] = field(default_factory=list)

    def reset(self) -> None:
        pass

    def budget(self, ctx: DraftContext) -> int:
        return self.k

    def stop(self, step: DraftStep) -> bool:
        self.rows.append(feature_row(step))
        return False

    def update(self, outcome: IterationOutcome) -> None:
        pass


def test_collector_features_equal_runtime_features(tiny_dirs, tmp_path):
    target_dir, assistant_dir = tiny_dirs
    prompt_file = tmp_path / "p.jsonl"
    prompt_file.write_text(json.dumps({"id": "a", "text": "Hello there, how are"}) + "\n")
    out = tmp_path / "run"
    collect(
        CollectConfig(
            prompts=str(prompt_file),
            out=out,
            target=target_dir,
            assistant=assistant_dir,
            max_lookahead=4,
            max_new_tokens=20,
            profile_repeats=1,
        ),
        progress=False,
    )
    df = _read_dir(out)
    pair = uag.load_pair(target_dir, assistant_dir)
    policy = RecordingPolicy(k=4)
    uag.generate(pair, "Hello there, how are", plan=RulePlan(policy), max_new_tokens=20)
    runtime = np.stack(policy.rows)
    collected = df[list(FEATURE_NAMES)].to_numpy(dtype=np.float32)
    assert collected.shape == runtime.shape and len(runtime) > 0
    np.testing.assert_array_equal(collected, runtime)


@pytest.mark.slow  # 49 s; resume and its refusals stay in CI (test_resume_refuses_...)
def test_torchrun_kill_9_then_resume(tiny_dirs, tmp_path):
    """Two CPU ranks under torchrun shard the prompts by RANK/WORLD_SIZE into one directory;
    killed with SIGKILL mid-run (the launcher and every worker, as a dying node would be) and started
    again the same way, the run ends with every prompt's part exactly once."""
    from uag.harness.collect import meta_path, part_path
    from uag.harness.prompts import load_prompts

    target_dir, assistant_dir = tiny_dirs
    out = tmp_path / "run"
    n = 24
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(29500 + os.getpid() % 1000), "-m", "uag", "collect",
        "--target", target_dir, "--assistant", assistant_dir, "--device", "cpu",
        "--prompts", "mixed", "--limit", str(n), "--max-new-tokens", "12", "--max-lookahead", "4",
        "--out", str(out), "--logdir", str(tmp_path / "tb"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while (
        len(list(out.glob("part-*.parquet"))) < 4 and time.time() < deadline and proc.poll() is None
    ):
        time.sleep(0.05)
    assert proc.poll() is None, "collect finished before it could be killed"
    # torchrun starts each worker in a session of its own: SIGKILL the whole tree at once.
    import psutil

    for victim in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        victim.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # let the kernel reap the workers before counting
    partial = len(list(out.glob("part-*.parquet")))
    assert 4 <= partial < n
    # Started again without --resume it is refused; with --resume both ranks finish the rest.
    refused = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert refused.returncode != 0
    assert "pass --resume to continue it" in refused.stderr
    done = subprocess.run([*argv, "--resume"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    skipped = [
        int(line.split("(")[1].split()[0])
        for line in done.stdout.splitlines()
        if "already done" in line
    ]
    assert (
        len(skipped) == 2 and sum(skipped) == partial
    )  # each rank skipped its own finished prompts
    prompts = load_prompts("mixed", limit=n)
    assert sorted(p.name for p in out.glob("part-*.parquet")) == sorted(
        part_path(out, p.id).name for p in prompts
    )  # every prompt's part, nothing else
    for prompt in prompts:  # each part holds its own prompt's rows, and each iteration once
        table = pq.read_table(part_path(out, prompt.id)).to_pandas()
        assert set(table["prompt_id"]) <= {prompt.id}
        assert not table.duplicated(["iteration", "position"]).any()
    assert {m.name for m in out.glob("meta*.json")} == {"meta-0of2.json", "meta-1of2.json"}
    assert meta_path(out, (1, 2)).exists() and not list(out.glob(".*tmp"))
    # One dataset, as train-controller and `datasets` read it: both ranks' parts.
    import datasets

    merged = datasets.load_dataset(
        "parquet",
        data_files=str(out / "part-*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf"),
    )
    assert merged.num_rows == len(_read_dir(out))
    # --overwrite under torchrun clears the whole run (rank 0 first, the other waits) and redoes it.
    again = subprocess.run(
        [*argv, "--overwrite", "--limit", "4"], capture_output=True, text=True, env=env
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(list(out.glob("part-*.parquet"))) == 4


def test_launcher_environment_is_read_strictly(tiny_dirs, tmp_path, capsys, monkeypatch):
    from uag.harness import launcher

    assert launcher.from_env({}) is None
    assert launcher.from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    got = launcher.from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert got is not None and got.shard == (3, 4) and got.local_rank == 1 and not got.coordinated
    assert got.device("cpu") == "cpu"
    with pytest.raises(UagError, match="RANK=4 outside"):
        launcher.from_env({"WORLD_SIZE": "4", "RANK": "4"})
    with pytest.raises(UagError, match="expected an integer"):
        launcher.from_env({"WORLD_SIZE": "two", "RANK": "0"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    base = ["collect", "--target", tiny_dirs[0], "--assistant", tiny_dirs[1], "--prompts", "mixed"]
    assert main([*base, "--out", str(tmp_path / "o"), "--shard", "0/2"]) == 2
    assert "contradicts the launcher's RANK=1" in one_clean_line(capsys)
    assert main([*base, "--out", str(tmp_path / "o"), "--overwrite"]) == 2
    assert "needs MASTER_ADDR" in one_clean_line(capsys)


def test_bad_collect_input(tmp_path, capsys, tiny_dirs):
    base = ["collect", "--target", tiny_dirs[0], "--assistant", tiny_dirs[1]]
    assert (
        main([*base, "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "not found" in one_clean_line(capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([*base, "--prompts", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "empty" in one_clean_line(capsys)
    csv = tmp_path / "p.csv"
    csv.write_text("id,question\n1,hello\n")
    assert main([*base, "--prompts", str(csv), "--out", str(tmp_path / "o")]) == 2
    assert "no column 'text'" in one_clean_line(capsys)
    assert (
        main([*base, "--prompts", "mixed", "--max-lookahead", "0", "--out", str(tmp_path / "o")])
        == 2
    )
    assert "--max-lookahead" in one_clean_line(capsys)
    assert main([*base, "--prompts", "nonsense-source", "--out", str(tmp_path / "o")]) == 2
    assert "unknown prompt source" in one_clean_line(capsys)
    held = tmp_path / "held"
    held.mkdir()
    (held / "meta.json").write_text("{}")
    assert main([*base, "--prompts", "mixed", "--out", str(held)]) == 2
    assert "--resume" in one_clean_line(capsys)


def _small_run(tiny_dirs, **changes) -> CollectConfig:
    """A two-prompt collect on the tiny pair (what the contract tests vary is in ``changes``)."""
    base = dict(
        prompts="mixed",
        limit=2,
        target=tiny_dirs[0],
        assistant=tiny_dirs[1],
        max_lookahead=3,
        profile_repeats=1,
    )
    return CollectConfig(**{**base, **changes})


def test_resume_refuses_other_settings_and_overwrite_clears_the_whole_run(tiny_dirs, tmp_path):
    out = tmp_path / "run"

    def cfg(**changes):
        return _small_run(tiny_dirs, **{"out": out, "max_new_tokens": 4, **changes})

    collect(cfg(shard=(0, 2)), progress=False)
    collect(cfg(shard=(1, 2)), progress=False)
    assert len(list(out.glob("part-*.parquet"))) == 2  # shards split the prompts, share DIR
    assert {m.name for m in out.glob("meta*.json")} == {"meta-0of2.json", "meta-1of2.json"}
    for changes, key in (
        ({"max_lookahead": 4}, "other settings.*max_lookahead 3 there, 4 here"),
        ({"max_new_tokens": 5}, "max_new_tokens"),
        ({"chat": True}, "chat"),
        ({"assistant_int8": not cfg().assistant_int8}, "assistant_int8"),
    ):
        with pytest.raises(UagError, match=key):
            collect(cfg(shard=(0, 2), resume=True, **changes), progress=False)
    with pytest.raises(UagError, match="max_new_tokens"):  # a new shard may not mix in either
        collect(cfg(shard=(2, 3), max_new_tokens=5), progress=False)
    # a writer killed mid-file left its temporary copies: a resume removes its own shard's
    first, second = (part_path(out, p.id).name for p in load_prompts("mixed", limit=2))
    ours = [out / f".{first}.99999999.tmp", out / ".meta-0of2.json.99999999.tmp"]
    theirs = [out / f".{second}.99999999.tmp"]  # shard 1's: it may be writing it right now
    for tmp in ours + theirs:
        tmp.write_bytes(b"half a file")
    collect(cfg(shard=(0, 2), resume=True), progress=False)  # shard 0 holds the first prompt
    assert not any(tmp.exists() for tmp in ours) and all(tmp.exists() for tmp in theirs)
    theirs[0].unlink()
    (out / "meta-0of2.json").write_text("{broken")
    with pytest.raises(UagError, match="not a readable collect meta"):
        collect(cfg(shard=(0, 2), resume=True), progress=False)
    # --overwrite (one process, no shard) replaces the whole run: no shard's old file survives.
    summary = collect(cfg(limit=1, overwrite=True), progress=False)
    assert summary.prompts_done == 1
    assert sorted(p.name for p in out.glob("meta*.json")) == ["meta.json"]
    assert len(list(out.glob("part-*.parquet"))) == 1


def test_collect_under_sampling_logs_soft_labels(tiny_dirs, tmp_path):
    from uag.decoding.sampling import SamplingConfig

    out = tmp_path / "sampled"

    def cfg(**changes):
        base = {"out": out, "max_new_tokens": 8, "sampling": SamplingConfig(temperature=1.0)}
        return _small_run(tiny_dirs, **{**base, **changes})

    collect(cfg(), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["decoding"] == "sampling" and meta["sampling"]["seed"] == 0  # seeded by default
    df = _read_dir(out)
    assert len(df) > 0 and df["accept_prob"].between(0, 1).all()
    assert df["accept_rate"].between(0, 1).all()
    for _, it in df.groupby(["prompt_id", "iteration"]):  # a prefix survives less, never more
        probs = it.sort_values("position")["accept_prob"].to_numpy()
        assert (np.diff(probs) <= 1e-7).all()
    # Seeds come from --seed and the prompt id: a second run writes the same rows.
    again = tmp_path / "again"
    collect(cfg(out=again), progress=False)
    pd_cols = ["prompt_id", "iteration", "position", "token_id", "accept_prob"]
    assert (
        _read_dir(again)[pd_cols]
        .sort_values(pd_cols[:3])
        .reset_index(drop=True)
        .equals(df[pd_cols].sort_values(pd_cols[:3]).reset_index(drop=True))
    )
    with pytest.raises(UagError, match="sampling"):
        collect(cfg(resume=True, sampling=SamplingConfig(temperature=0.7)), progress=False)


def test_prompt_ids_without_an_id_column_come_from_the_text(tmp_path):
    from uag.harness.prompts import load_prompts, split_of, text_id

    texts = [f"prompt number {i}: say something" for i in range(12)]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    second.write_text("".join(json.dumps({"text": t}) + "\n" for t in reversed(texts[1:])))
    a = {p.text: p.id for p in load_prompts(str(first))}
    b = {p.text: p.id for p in load_prompts(str(second))}
    assert a[texts[0]] == text_id(texts[0]) and len(set(a.values())) == 12
    assert all(b[t] == a[t] for t in b)  # re-ordered and one row deleted: the same ids
    assert {t for t in b if split_of(b[t]) == "test"} == {t for t in b if split_of(a[t]) == "test"}
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps({"text": "same"}) + "\n" + json.dumps({"text": "same"}) + "\n")
    with pytest.raises(UagError, match="rows 0 and 1 hold the same prompt text"):
        load_prompts(str(twice))


def test_on_policy_collection_follows_the_controller_and_explores(tiny_dirs, tmp_path):
    """``collect --controller C --explore EPS``: rounds that did not explore stop exactly where
    C stops; explored rounds draft the full lookahead; each row's propensity says whether C
    would have drafted it; the run's settings name C and EPS."""
    from controllers.learned import LearnedPolicy
    from tests.test_controller import _export

    # a threshold inside this net's scores on the tiny pair's rows: C stops on ~30 % of them
    probe = tmp_path / "probe"
    collect(
        _small_run(tiny_dirs, out=probe, limit=3, max_lookahead=4, max_new_tokens=16),
        progress=False,
    )
    ctrl = tmp_path / "c.onnx"
    net, _ = _export(ctrl, gate=0.0)
    with torch.no_grad():
        scores = net(torch.from_numpy(_read_dir(probe)[list(FEATURE_NAMES)].to_numpy(np.float32)))
    _export(ctrl, threshold=float(np.quantile(scores.numpy(), 0.3)), gate=0.0)
    out = tmp_path / "run"
    cfg = _small_run(
        tiny_dirs,
        out=out,
        limit=3,
        max_lookahead=4,
        max_new_tokens=16,
        controller=ctrl,
        explore=0.3,
    )
    collect(cfg, progress=False)
    df = _read_dir(out)
    policy = LearnedPolicy(ctrl)
    df["score"] = [policy._score(r) for r in df[list(FEATURE_NAMES)].to_numpy(np.float32)]
    keep = df["score"] >= policy.info.threshold  # C would draft the next token
    df["keep"] = keep
    explored = df["explored"] == 1

    def short(g) -> bool:  # a draft the loop cut: too little room left, or the assistant's EOS
        generated = round(float(np.expm1(g["generated"].iloc[0])))  # the feature is log1p
        return generated + len(g) + 1 >= 16 or len(g) < g["iter_drafted"].iloc[0]

    assert explored.any() and (~explored).any()
    assert set(df.loc[~explored, "propensity"]) == {1.0}
    stops = continues = 0
    for _, g in df.groupby(["prompt_id", "iteration"]):
        g = g.sort_values("position")
        would = np.concatenate([[True], np.cumprod(g["keep"].to_numpy()[:-1]).astype(bool)])
        if g["explored"].iloc[0]:
            assert np.allclose(g["propensity"], np.where(would, 1.0, 0.3))
            assert len(g) == 4 or short(g)
            continue
        assert g["keep"].iloc[:-1].all()  # C continued after every token but the last
        final = g["keep"].iloc[-1]
        assert not final or len(g) == 4 or short(g)
        stops += not final
        continues += len(g) - 1
    assert stops and continues  # both decisions were exercised
    meta = json.loads((out / "meta.json").read_text())
    assert meta["explore"] == 0.3 and len(meta["controller"]) == 16
    with pytest.raises(UagError, match="explore 0.3 there, 0.5 here"):
        collect(replace(cfg, resume=True, explore=0.5), progress=False)
    with pytest.raises(UagError, match="--explore goes with --controller"):
        _small_run(tiny_dirs, out=out, explore=0.2)
