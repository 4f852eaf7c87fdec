"""train-controller: replay arithmetic, a tiny end-to-end run, ONNX parity and metadata, errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tests.synthetic import PROFILE, write_run
from tests.tiny import one_clean_line
from training import replay
from training.data import load_runs
from training.train import TrainConfig, train
from uag.cli import main
from uag.decoding.features import FEATURE_NAMES, SCHEMA_VERSION
from uag.decoding.profile import LatencyProfile
from uag.errors import UagError


def _iterations(accepted, drafted, target_tokens) -> replay.Iterations:
    tt = np.asarray(target_tokens, dtype=float)
    return replay.Iterations(
        accepted=np.asarray(accepted), drafted=np.asarray(drafted), target_tokens=tt, values={}
    )


def _as_sampling_run(run, *, soft=True):
    """Turn a synthetic greedy run into a sampling one: soft labels beside the outcomes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in run.glob("part-*.parquet"):
        table = pq.read_table(part)
        accepted = table.column("accepted").to_numpy().astype(np.float32)
        if soft:
            table = table.append_column("accept_prob", pa.array(0.1 + 0.8 * accepted))
        pq.write_table(table, part)
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "decoding": "sampling"}))
    return run


def test_sampling_runs_train_on_soft_labels(tmp_path):
    run = _as_sampling_run(write_run(tmp_path / "s", prompts=4))
    data = load_runs([run])
    assert data.targets is not None
    np.testing.assert_allclose(data.targets, 0.1 + 0.8 * data.labels, rtol=1e-6)
    assert set(np.unique(data.labels)) == {0.0, 1.0}  # AUC and metrics stay on outcomes
    out = tmp_path / "s.onnx"
    train(
        TrainConfig(
            data=[run],
            out=out,
            logdir=tmp_path / "tb",
            max_epochs=2,
            hidden=(8,),
            accelerator="cpu",
            devices="1",
            progress=False,
        )
    )
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["decoding"] == "sampling"
    greedy = write_run(tmp_path / "g", prompts=2)
    with pytest.raises(UagError, match="decoding"):
        load_runs([run, greedy])
    with pytest.raises(UagError, match="soft labels"):
        load_runs([run, greedy], allow_mixed=True)


def test_runs_of_other_settings_are_refused_unless_mixing_is_allowed(tmp_path):
    one = write_run(tmp_path / "one", prompts=2)
    other = write_run(tmp_path / "other", prompts=2, seed=1)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "assistant_int8": True}))
    with pytest.raises(UagError, match="assistant_int8.*--allow-mixed"):
        load_runs([one, other])
    assert len(load_runs([one, other], allow_mixed=True).labels) > 0
    # Drafts from another draft vocabulary: other features; runs from before it drafted from all.
    (other / "meta.json").write_text(json.dumps({**meta, "assistant_draft_vocab": 16384}))
    with pytest.raises(UagError, match="assistant_draft_vocab: .* has 0, .* has 16384"):
        load_runs([one, other])
    (other / "meta.json").write_text(json.dumps({**meta, "assistant_draft_vocab": 0}))
    assert len(load_runs([one, other]).labels) > 0
    (other / "meta.json").write_text(json.dumps({**meta, "schema_version": 1}))
    with pytest.raises(UagError, match="schema_version"):  # never mixable
        load_runs([one, other], allow_mixed=True)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda run: (run / "meta.json").write_text("{not json"), "not a readable collect meta"),
        (lambda run: (run / "meta.json").write_text("[1, 2]"), "expected a JSON object"),
        (lambda run: (run / "meta.json").write_text("{}"), "not a uag collect meta file"),
        (lambda run: (run / "part-broken.parquet").write_bytes(b"junk"), "not a readable Parquet"),
        (lambda run: (run / "part-empty.parquet").write_bytes(b""), "is empty"),
    ],
)
def test_a_damaged_run_is_one_clear_line(tmp_path, capsys, damage, message):
    run = write_run(tmp_path / "r", prompts=2)
    damage(run)
    with pytest.raises(UagError, match=message):
        load_runs([run])
    argv = ["train-controller", "--data", str(run), "--out", str(tmp_path / "c.onnx")]
    assert main(argv) == 2
    assert message in one_clean_line(capsys)


def test_replay_arithmetic_static_two_wins():
    profile = LatencyProfile(device="x", draft_s=1.0, verify_s=[10.0, 10.0, 10.0, 13.0, 16.0])
    # Every iteration: the first two drafts are accepted, the rest rejected; one target token each.
    its = _iterations([2, 2], [4, 4], [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    # static-1: (1+1) tokens / (1 + 10) s; static-2: 3 / 12; static-3: 3 / (3 + 13); static-4: 3 / 20
    got = {k: replay.static(its, profile, k).tokens_per_s for k in (1, 2, 3, 4)}
    assert got[1] == pytest.approx(2 / 11) and got[2] == pytest.approx(3 / 12)
    assert got[3] == pytest.approx(3 / 16) and got[4] == pytest.approx(3 / 20)
    assert replay.best_static(its, profile).name == "static-2"
    assert replay.oracle(its, profile).tokens_per_s == pytest.approx(3 / 12)
    # speed-up is throughput times the target-alone step cost
    assert replay.static(its, profile, 2).speedup == pytest.approx(3 / 12 * 10.0)


def test_replay_prices_what_the_loop_pays_around_forwards():
    """Round bookkeeping, the first draft's catch-up and the prefill are priced; target-alone
    runs at its own back-to-back step and pays the target's prefill too."""
    profile = LatencyProfile(
        device="x",
        draft_s=1.0,
        verify_s=[10.0, 10.0, 10.0, 13.0, 16.0],
        step_s=8.0,
        round_s=0.5,
        catchup_s=2.0,
    )
    its = _iterations([2, 2], [4, 4], [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    # static-2: 3 tokens per round for 0.5 + 2 + 2 × 1 + 10 s; target-alone: 8 s per token.
    res = replay.static(its, profile, 2)
    assert res.tokens_per_s == pytest.approx(6 / 29)
    assert res.speedup == pytest.approx(6 * 8.0 / 29)
    # A skipped round pays the bookkeeping and a plain verify, no catch-up.
    skip = replay.simulate(its, np.zeros(2, dtype=int), profile, "skip")
    assert skip.tokens_per_s == pytest.approx(2 / 21)
    # Prefill: both sides pay the target's, only speculation the assistant's.
    pre = replay.Prefill(target_s=20.0, assistant_s=5.0)
    with_pre = replay.static(its, profile, 2, prefill=pre)
    assert with_pre.speedup == pytest.approx((6 * 8.0 + 20.0) / (29 + 25.0))
    assert profile.round_cost(drafted=2, candidates=2) == pytest.approx(14.5)
    # Profiles written before these fields price as before.
    old = LatencyProfile.from_dict({"device": "x", "draft_s": 1.0, "verify_s": [10.0, 10.0]})
    assert old.target_step_s == 10.0 and old.round_s == 0.0 and old.catchup_s == 0.0
    assert LatencyProfile.from_dict(profile.to_dict()) == profile


def test_loop_overheads_come_from_the_measured_rounds():
    from uag.decoding.round import IterationRecord
    from uag.harness.latency import loop_overheads

    def rec(drafted: int, draft: float, verify: float, first: float, whole: float, lag: int = 2):
        return IterationRecord(
            drafted=drafted,
            candidates=drafted,
            accepted_candidates=0,
            emitted=1,
            accepted_drafts=0,
            draft_s=draft,
            verify_s=verify,
            bridge_s=0.0,
            policy_s=0.0,
            first_draft_s=first,
            round_s=whole,
            lag=lag if drafted else 0,
        )

    records = [
        rec(0, 0.0, 50.0, 0.0, 51.0),  # the target's prefill
        rec(2, 40.0, 12.0, 30.0, 60.0),  # the assistant's prefill rides on its first step
        rec(2, 5.0, 12.0, 3.0, 18.0),
        rec(0, 0.0, 10.0, 0.0, 10.5),  # skipped: no draft step to learn from
        rec(3, 7.0, 13.0, 3.5, 21.5, lag=5),
        rec(2, 5.0, 12.0, 2.5, 18.5, lag=1),
        rec(2, 5.0, 12.0, 3.0, 18.5),
    ]
    round_s, catchup_s, lag = loop_overheads(records, draft_s=2.0)
    assert round_s == pytest.approx(1.5)  # median of 1.0, 1.5, 1.5, 1.5
    # measured where the fewest tokens were fed (lag 1: 2.5 against 2.0 per step), not the
    # median first step over every lag (3.0, a lag-2 one) quoted at the median lag
    assert catchup_s == pytest.approx(0.5)
    assert lag == 1
    assert loop_overheads(records[:2], draft_s=2.0) == (0.0, 0.0, 0.0)


def test_replay_threshold_rule_stops_after_low_token():
    profile = LatencyProfile(device="x", draft_s=1.0, verify_s=[10.0, 10.0, 10.0, 10.0])
    its = replay.Iterations(
        accepted=np.array([1]),
        drafted=np.array([3]),
        target_tokens=np.array([[0.0, 1, 2, 3]]),
        values={"prob": np.array([[0.9, 0.2, 0.9]])},
    )
    res = replay.threshold_rule(its, profile, column="prob", threshold=0.4, below=True, name="c")
    assert res.mean_drafted == 2  # the 0.2 token is drafted (and verified), the third is not
    assert res.tokens_per_s == pytest.approx(2 / 12)


def test_train_end_to_end_onnx_parity_and_metadata(tmp_path):
    run = write_run(tmp_path / "run")
    out = tmp_path / "ctrl.onnx"
    summary = train(
        TrainConfig(
            data=[run],
            out=out,
            logdir=tmp_path / "tb",
            max_epochs=8,
            hidden=(16,),
            batch_size=64,
            accelerator="cpu",
            devices="1",
            progress=False,
        )
    )
    assert summary is not None  # one process: it reports
    assert out.exists() and out.stat().st_size < 200_000
    model = onnx.load(str(out))
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["feature_names"]) == list(FEATURE_NAMES)
    assert int(meta["schema_version"]) == SCHEMA_VERSION
    assert 0 < float(meta["threshold"]) < 1
    assert meta["decision"] == "cost" and summary.decision == "cost"
    assert float(meta["rate_factor"]) == pytest.approx(summary.sims["learned"].speedup, abs=2e-3)
    assert json.loads(meta["latency_profile"]) == PROFILE
    assert meta["target"] == "t" and meta["assistant"] == "a" and len(meta["data_hash"]) == 64
    assert meta["decoding"] == "greedy"  # what the data was collected under
    collected = {str(i) for i in load_runs([run]).prompt_ids}  # train and validation prompts
    assert set(json.loads(meta["train_prompt_ids"])) == collected and len(collected) == 12
    data = load_runs([run])
    rate = data.labels.mean()  # the class weighting's odds factor, which the cost rule undoes
    assert float(meta["logit_shift"]) == pytest.approx(np.log((1 - rate) / rate), abs=0.2)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    onnx_p = sess.run(["p_accept"], {"features": data.features[:50]})[0]
    assert onnx_p.shape[0] == 50 and np.all((onnx_p >= 0) & (onnx_p <= 1))
    # The synthetic label depends on 'prob' alone: the MLP must find it.
    assert summary.auc["mlp"] > 0.8
    assert set(summary.sims) >= {"learned", "best_static", "confidence_0.4", "oracle"}
    assert summary.sims["oracle"].tokens_per_s >= summary.sims["learned"].tokens_per_s
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_onnx_parity_failure_is_loud(tmp_path, monkeypatch):
    from training import export as export_mod
    from training.model import ControllerNet

    net = ControllerNet(3, (4,))
    rows = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    export_mod.export_onnx(net, tmp_path / "ok.onnx", metadata={}, check_rows=rows)
    assert (tmp_path / "ok.onnx").exists()
    # Torch now disagrees with what was exported: the check must refuse to write the file.
    original = export_mod.torch.onnx.export

    def export_then_perturb(model, *args, **kwargs):
        original(model, *args, **kwargs)
        with torch.no_grad():
            model.mlp[-1].bias += 1.0

    monkeypatch.setattr(export_mod.torch.onnx, "export", export_then_perturb)
    with pytest.raises(UagError, match="ONNX export disagrees"):
        export_mod.export_onnx(net, tmp_path / "bad.onnx", metadata={}, check_rows=rows)
    assert not (tmp_path / "bad.onnx").exists()


def test_bad_training_input(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train-controller", "--data", str(empty), "--out", str(tmp_path / "c.onnx")]) == 2
    assert "meta.json" in one_clean_line(capsys)
    single = write_run(tmp_path / "single", single_class=True, prompts=3)
    assert main(["train-controller", "--data", str(single), "--out", str(tmp_path / "c.onnx")]) == 2
    assert "single label class" in one_clean_line(capsys)
    a = write_run(tmp_path / "a", prompts=3)
    b = write_run(tmp_path / "b", prompts=3, feature_names=tuple(reversed(FEATURE_NAMES)))
    assert (
        main(["train-controller", "--data", str(a), str(b), "--out", str(tmp_path / "c.onnx")]) == 2
    )
    assert "disagree on feature_names" in one_clean_line(capsys)


def test_replay_gate_skips_iterations():
    profile = LatencyProfile(device="x", draft_s=1.0, verify_s=[10.0, 12.0, 14.0])
    # Iteration 0: nothing accepted (drafting wastes time); iteration 1: both drafts accepted.
    its = replay.Iterations(
        accepted=np.array([0, 2]),
        drafted=np.array([2, 2]),
        target_tokens=np.array([[0.0, 1, 2], [0.0, 1, 2]]),
        values={"score": np.array([[0.9, 0.9], [0.9, 0.9]])},
        gate=np.array([0.1, 0.9]),
    )
    never = replay.learned(its, profile, stop_below=0.5, gate_below=0.0)
    gated = replay.learned(its, profile, stop_below=0.5, gate_below=0.5)
    assert never.tokens_per_s == pytest.approx((1 + 3) / (16 + 16))
    assert gated.tokens_per_s == pytest.approx((1 + 3) / (10 + 16))
    t, g, best = replay.best_learned(its, profile)
    assert 0.1 < g <= 0.9 and best.tokens_per_s == pytest.approx(gated.tokens_per_s)
    t, g, best = replay.best_learned(its, profile, gate=False)  # --no-gate: never skips
    assert g == 0.0 and best.tokens_per_s == pytest.approx(never.tokens_per_s)


def test_build_iterations_carries_gate_scores(tmp_path):
    data = load_runs([write_run(tmp_path / "r", prompts=2)])
    gate = np.where(data.columns["position"] == 1, 0.25, np.nan)
    its = replay.build_iterations(data, np.full(len(data.labels), 0.5), gate)
    assert its.gate is not None and np.all(its.gate == 0.25)


def test_shared_order_batches_split_the_single_process_batches():
    """Each global batch is the single-process batch, dealt out across processes; every epoch a
    new order, the same in every process; a last batch under half a batch joins the one before."""
    from training.datamodule import SharedOrderBatches

    for size, batch, world in ((103, 10, 2), (101, 10, 3), (7, 10, 2)):
        one = SharedOrderBatches(size, batch_size=batch, shuffle=True, seed=3)
        ranks = [
            SharedOrderBatches(size, batch_size=batch, shuffle=True, seed=3, rank=r, world=world)
            for r in range(world)
        ]
        for _ in range(2):  # two epochs
            single = list(one)
            shares = [list(r) for r in ranks]
            assert all(len(s) == len(single) == len(one) for s in shares)
            for b, rows in enumerate(single):
                assert sorted(sum((s[b] for s in shares), [])) == sorted(rows)
                assert all(s[b] for s in shares)  # no process gets an empty batch
            assert sorted(sum(single, [])) == list(range(size))
        assert list(one) != single  # the third epoch's order differs from the second's
    with pytest.raises(UagError, match="too small for 8 processes"):
        SharedOrderBatches(100, batch_size=10, shuffle=True, seed=0, rank=0, world=8)


@pytest.mark.slow  # 14 s: two processes; one-process training stays in CI
def test_ddp_training_equals_one_process(tmp_path):
    """``--devices 2 --strategy ddp`` on CPU (gloo): one export, from the first process, whose
    thresholds and validation figures equal a single-process run's up to float noise."""
    import subprocess
    import sys

    run = write_run(tmp_path / "run", prompts=16)
    common = dict(data=[run], max_epochs=3, hidden=(16,), batch_size=64, accelerator="cpu")
    single = train(
        TrainConfig(out=tmp_path / "one.onnx", logdir=tmp_path / "tb1", progress=False, **common)
    )
    assert single is not None
    argv = [
        sys.executable, "-m", "uag", "train-controller", "--data", str(run),
        "--out", str(tmp_path / "ddp" / "ctrl.onnx"), "--logdir", str(tmp_path / "tb2"),
        "--max-epochs", "3", "--hidden", "16", "--batch-size", "64",
        "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("wrote ") == 1  # the first process reports and exports, once
    assert [p.name for p in (tmp_path / "ddp").iterdir()] == ["ctrl.onnx"]
    events = list((tmp_path / "tb2").rglob("events.out.tfevents.*"))
    assert {e.parent.name for e in events} == {"version_0"}  # one run, logged
    assert len({e.name.split(".")[-2] for e in events}) == 1  # by one process
    metas = [
        {m.key: m.value for m in onnx.load(str(path)).metadata_props}
        for path in (tmp_path / "one.onnx", tmp_path / "ddp" / "ctrl.onnx")
    ]
    assert metas[0]["threshold"] == metas[1]["threshold"]
    assert metas[0]["gate_threshold"] == metas[1]["gate_threshold"]
    for key in ("val_auc", "sim_speedup"):
        a, b = (json.loads(m[key]) for m in metas)
        assert a.keys() == b.keys()
        assert all(abs(a[k] - b[k]) < 1e-4 for k in a), (a, b)
    x = load_runs([run]).features[:300]
    p1, p2 = (
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            ["p_accept"], {"features": x}
        )[0]
        for path in (tmp_path / "one.onnx", tmp_path / "ddp" / "ctrl.onnx")
    )
    np.testing.assert_allclose(p1, p2, atol=1e-5)


def test_replay_uses_only_full_drafts_of_on_policy_runs(tmp_path):
    """Rounds that stopped where their controller did look like short drafts to replay: only
    explored rounds (or every round of a fixed-lookahead run) are replayed."""
    from training.data import replayable

    data = load_runs([write_run(tmp_path / "run")])
    assert replayable(data) is data  # a fixed-lookahead run (no 'explored' column): all rows
    explored = (data.columns["iteration"] % 2).astype(np.int8)
    data.columns["explored"] = explored
    kept = replayable(data)
    assert len(kept.labels) == int(explored.sum()) and kept.columns["explored"].all()
    data.columns["explored"] = np.zeros_like(explored)
    with pytest.raises(UagError, match="no explored rounds"):
        replayable(data)


def test_cost_rule_drafts_when_tokens_are_worth_their_price():
    """The cost decision weighs expected tokens against draft and verify time at rate R."""
    from controllers.cost import CostRule

    flat = CostRule(draft_s=1.0, verify_s=(10.0,) * 7, rate_factor=1.0, max_lookahead=6)
    # R = 0.1 tokens/s: one more draft (1 s) must bring > 0.1 expected tokens.
    assert flat.worth_drafting(survival=1.0, hazard=0.2, drafted=0, candidates=0)
    assert not flat.worth_drafting(survival=1.0, hazard=0.05, drafted=0, candidates=0)
    # Survival carries: after two likely tokens, a third is worth it; after an unlikely one not.
    assert flat.worth_drafting(survival=0.8, hazard=0.9, drafted=2, candidates=2)
    assert not flat.worth_drafting(survival=0.08, hazard=0.5, drafted=2, candidates=2)
    # A steep verify (each candidate +5 s) prices the same draft out ...
    steep = CostRule(
        draft_s=1.0,
        verify_s=(10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0),
        rate_factor=1.0,
        max_lookahead=6,
    )
    assert not steep.worth_drafting(survival=1.0, hazard=0.4, drafted=0, candidates=0)
    # ... and a higher rate (a better policy's time is worth more) drafts less.
    assert flat.worth_drafting(survival=1.0, hazard=0.3, drafted=0, candidates=0)
    richer = CostRule(draft_s=1.0, verify_s=(10.0,) * 7, rate_factor=4.0, max_lookahead=6)
    assert not richer.worth_drafting(survival=1.0, hazard=0.3, drafted=0, candidates=0)
    # The budget is a hard cap, and the first candidate's price is looked past: with a costly
    # first candidate and cheap later ones, a run of likely tokens is still worth drafting.
    assert not flat.worth_drafting(survival=1.0, hazard=1.0, drafted=6, candidates=6)
    kink = CostRule(
        draft_s=0.1,
        verify_s=(10.0, 20.0, 20.1, 20.2, 20.3, 20.4, 20.5),
        rate_factor=1.0,
        max_lookahead=6,
    )
    one_alone = kink.rate * (0.1 + 10.0) < 0.6  # 0.6 tokens against 10.1 s at 0.1 tokens/s
    three = kink.rate * (0.3 + 10.2) < 0.6 + 0.36 + 0.216
    assert not one_alone and three
    assert kink.worth_drafting(survival=1.0, hazard=0.6, drafted=0, candidates=0)


def test_cost_rule_prices_the_catchup_and_reads_the_profile():
    from controllers.cost import CostRule

    plain = CostRule(draft_s=1.0, verify_s=(10.0,) * 7, rate_factor=1.0, max_lookahead=1)
    # One draft at 0.1 tokens/s: worth it above 0.1 expected tokens, above 0.3 with 2 s catch-up.
    lagging = CostRule.from_profile(
        {"draft_s": 1.0, "verify_s": [10.0] * 7, "catchup_s": 2.0, "step_s": 5.0},
        rate_factor=0.5,
        max_lookahead=1,
    )
    assert lagging.rate == pytest.approx(plain.rate) and lagging.catchup_s == 2.0
    assert plain.worth_drafting(survival=1.0, hazard=0.2, drafted=0, candidates=0)
    assert not lagging.worth_drafting(survival=1.0, hazard=0.2, drafted=0, candidates=0)
    assert lagging.worth_drafting(survival=1.0, hazard=0.35, drafted=0, candidates=0)
    # Later drafts in a round pay no catch-up.
    more = CostRule.from_profile(
        {"draft_s": 1.0, "verify_s": [10.0] * 7, "catchup_s": 2.0}, rate_factor=1.0, max_lookahead=3
    )
    assert more.worth_drafting(survival=1.0, hazard=0.2, drafted=1, candidates=1)


def test_cost_rule_prices_a_long_lag_by_the_row():
    """A first draft step that feeds more than the measured lag pays each extra row: a gate
    that drafts at the typical lag skips at a long one (after copied rounds)."""
    from controllers.cost import CostRule

    profile = {"draft_s": 1.0, "verify_s": [10.0] * 7, "catchup_s": 2.0, "catchup_lag": 2.0}
    rule = CostRule.from_profile({**profile, "feed_row_s": 0.5}, rate_factor=1.0, max_lookahead=1)
    assert rule.catchup(None) == rule.catchup(1) == rule.catchup(2) == 2.0
    assert rule.catchup(6) == pytest.approx(4.0)
    # at 0.1 tokens/s one draft is worth it above 0.3 expected tokens, above 0.5 at lag 6
    assert rule.worth_drafting(survival=1.0, hazard=0.4, drafted=0, candidates=0, lag=2)
    assert not rule.worth_drafting(survival=1.0, hazard=0.4, drafted=0, candidates=0, lag=6)
    assert rule.worth_drafting(survival=1.0, hazard=0.55, drafted=0, candidates=0, lag=6)
    # a profile measured before rows were priced: the lag costs nothing extra
    old = CostRule.from_profile(profile, rate_factor=1.0, max_lookahead=1)
    assert old.catchup(30) == 2.0


def test_cost_rule_rate_mixes_in_the_copied_rounds():
    """R without copies is κ's; copies cheaper per token than κ's rate raise it (so a draft
    must win more), dearer ones lower it, and the prior keeps one early copy from swinging it."""
    from controllers.cost import COPY_PRIOR_TOKENS, CostRule

    rule = CostRule.from_profile(
        {"draft_s": 1.0, "verify_s": [10.0, 11.0, 12.0, 13.0], "round_s": 1.0, "stats_s": 0.5},
        rate_factor=1.0,
        max_lookahead=4,
    )
    assert rule.rate == pytest.approx(0.1)
    assert rule.rate_with_copies(generated=50, copies=0, copied=0, copy_emitted=0) == rule.rate
    # 10 copied rounds of 3 candidates, 4 tokens each: 13.5 s a round, ~0.3 tokens/s
    cheap = rule.rate_with_copies(generated=60, copies=10, copied=30, copy_emitted=40)
    own = COPY_PRIOR_TOKENS + 20
    assert cheap == pytest.approx((own + 40) / (own / 0.1 + 10 * (1.0 + 13.0 - 0.5)))
    assert cheap > 1.5 * rule.rate
    dear = rule.rate_with_copies(generated=60, copies=10, copied=30, copy_emitted=10)
    assert dear < rule.rate
    one = rule.rate_with_copies(generated=5, copies=1, copied=3, copy_emitted=4)
    assert rule.rate < one < 1.3 * rule.rate
    # a gate that drafts at κ's rate skips at the copies' rate
    # (one draft: 2 s for 0.25 expected tokens; more drafts are worth less)
    assert rule.worth_drafting(survival=1.0, hazard=0.25, drafted=0, candidates=0)
    assert not rule.worth_drafting(survival=1.0, hazard=0.25, drafted=0, candidates=0, rate=cheap)


def test_cost_rule_undoes_the_class_weighting():
    from controllers.cost import CostRule

    rule = CostRule(
        draft_s=1.0,
        verify_s=(10.0,),
        rate_factor=1.0,
        max_lookahead=4,
        logit_shift=float(np.log(3.0)),
    )
    # odds 3:1 learned under weight 3 are odds 1:1
    assert rule.probability(0.75) == pytest.approx(0.5)
    assert rule.probability(0.5) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        CostRule(draft_s=1.0, verify_s=(), rate_factor=1.0, max_lookahead=4)


def test_replay_of_the_cost_rule_follows_the_runtime_state_and_its_fixed_point():
    """Replay's cost stops are the runtime ``CostState``'s, step by step; the rate it settles on
    is the speed-up it replays (Dinkelbach's fixed point)."""
    from controllers.cost import CostState

    profile = LatencyProfile(device="x", draft_s=1.0, verify_s=[10.0, 11.0, 12.0, 13.0, 14.0])
    rng = np.random.default_rng(0)
    n, L = 200, 4
    hazards = rng.uniform(0.2, 1.0, (n, L))
    scores = hazards.cumprod(axis=1)  # calibrated: P(the first j drafts are all accepted)
    accepted = (rng.uniform(0, 1, (n, L)) < hazards).cumprod(axis=1).sum(axis=1)
    tt = np.tile(np.arange(L + 1, dtype=float), (n, 1))
    gate = hazards[:, 0]
    its = replay.Iterations(
        accepted=accepted,
        drafted=np.full(n, L),
        target_tokens=tt,
        values={"score": scores},
        gate=gate,
    )
    rule = replay.cost_rule(profile, rate_factor=1.2, max_lookahead=L, logit_shift=0.0)
    stops = replay.cost_stops(its, rule, gate=True)
    for i in range(n):  # the loop's view: budget, then stop() after each drafted token
        state = CostState(rule)
        if not state.start(float(gate[i])):
            assert stops[i] == 0
            continue
        j = 1
        while j < L and state.keep_going(
            score=float(scores[i, j - 1]), position=j, candidates=float(j)
        ):
            j += 1
        assert min(stops[i], L) == j
    assert 0 < (stops == 0).sum() < n and len(set(stops.tolist())) >= 3  # all kinds of decisions
    kappa, result = replay.rate_fixed_point(
        its, profile, max_lookahead=L, logit_shift=0.0, gate=True
    )
    assert kappa == pytest.approx(result.speedup, abs=2e-3)
    assert result.tokens_per_s > replay.best_static(its, profile).tokens_per_s  # calibrated scores


def test_report_split_is_held_out_from_training_and_tuning(tmp_path):
    """``--report-fraction``: train, tune and report prompts are disjoint; κ is the tune
    prompts' fixed point, and the reported figures are that κ (and the other tuned parameters)
    replayed on the report prompts, recomputed here from the exported file."""
    from training.data import replayable, split_by_prompt
    from uag.decoding.features import to_gate_rows

    run = write_run(tmp_path / "run", prompts=16)
    data = load_runs([run])
    train_set, tune, report = split_by_prompt(data, val_fraction=0.25, report_fraction=0.25, seed=0)
    assert report is not None
    sets = [set(s.prompt_ids.tolist()) for s in (train_set, tune, report)]
    assert all(sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert sum(len(s) for s in sets) == 16
    out = tmp_path / "ctrl.onnx"
    summary = train(
        TrainConfig(
            data=[run], out=out, logdir=tmp_path / "tb", max_epochs=6, hidden=(16,),
            batch_size=64, accelerator="cpu", devices="1", progress=False, report_fraction=0.25,
        )
    )  # fmt: skip
    assert summary is not None and summary.reported == "report"
    assert "tune" in summary.table() and "report ROC-AUC" in summary.table()
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["figures_on"] == "report"
    assert set(json.loads(meta["report_prompt_ids"])) == sets[2]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])

    def iterations(part):
        held = replayable(part)
        score = sess.run(["p_accept"], {"features": held.features})[0].reshape(-1)
        gate = sess.run(["p_accept"], {"features": to_gate_rows(held.features)})[0].reshape(-1)
        return replay.build_iterations(held, score, gate)

    profile, shift = tune.profile, float(meta["logit_shift"])
    lookahead, kappa = int(meta["max_lookahead"]), float(meta["rate_factor"])
    on_tune, _ = replay.rate_fixed_point(
        iterations(tune), profile, max_lookahead=lookahead, logit_shift=shift, gate=True
    )
    assert kappa == pytest.approx(on_tune, abs=2e-3)  # chosen on the tune prompts
    rule = replay.cost_rule(profile, rate_factor=kappa, max_lookahead=lookahead, logit_shift=shift)
    on_report = replay.learned_by_cost(iterations(report), profile, rule, gate=True)
    assert summary.sims["learned"].speedup == pytest.approx(on_report.speedup, abs=2e-3)
    assert json.loads(meta["sim_speedup"])["learned"] == pytest.approx(on_report.speedup, abs=1e-3)
    stop, skip = float(meta["threshold"]), float(meta["gate_threshold"])
    assert (stop, skip) == pytest.approx(
        replay.best_learned(iterations(tune), profile)[:2], abs=1e-6
    )
    by_threshold = replay.learned(iterations(report), profile, stop_below=stop, gate_below=skip)
    assert by_threshold.mean_drafted > 0  # a rule that drafts (here the cost rule may not)
    assert summary.sims["learned_other_rule"].speedup == pytest.approx(
        by_threshold.speedup, abs=1e-6
    )
    assert summary.sims["learned_other_rule"].speedup != pytest.approx(
        replay.learned(iterations(tune), profile, stop_below=stop, gate_below=skip).speedup,
        abs=1e-6,
    )  # the tune prompts' figure is another number: the report one is not it
    with pytest.raises(UagError, match="report-fraction"):
        TrainConfig(data=[run], val_fraction=0.5, report_fraction=0.5)


def test_decision_rows_end_at_each_rounds_first_rejection(tmp_path):
    """The decision-relevant rows: every accepted draft of a round, then its first rejection;
    the rejected rows after it (trivially predictable) are left out."""
    from training.data import decision_rows

    data = load_runs([write_run(tmp_path / "run")])
    keep = decision_rows(data)
    position, accepted = data.columns["position"], data.columns["iter_accepted_drafts"]
    assert keep.any() and not keep.all()
    assert (data.labels[keep & (position <= accepted)] == 1).all()
    assert (data.labels[keep & (position == accepted + 1)] == 0).all()
    assert (data.labels[~keep] == 0).all() and (position[~keep] > accepted[~keep] + 1).all()
