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
from uag.errors import UagError
from uag.features import FEATURE_NAMES, SCHEMA_VERSION
from uag.latency import LatencyProfile


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
    assert json.loads(meta["latency_profile"]) == PROFILE
    assert meta["target"] == "t" and meta["assistant"] == "a" and len(meta["data_hash"]) == 64
    assert meta["decoding"] == "greedy"  # what the data was collected under
    data = load_runs([run])
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
