"""The learned controller at run time and uag bench's honesty checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import uag
from controllers.base import DraftContext
from controllers.learned import LearnedPolicy
from tests.tiny import one_clean_line
from training.export import export_onnx
from training.model import ControllerNet
from uag.bench import ArmRun, BenchConfig, run_bench
from uag.cli import main
from uag.errors import UagError
from uag.features import FEATURE_NAMES, SCHEMA_VERSION, gate_row

PROFILE = {"device": "cpu:test", "draft_s": 0.03, "verify_s": [0.08, 0.1]}


def _export(path, *, names=FEATURE_NAMES, schema=SCHEMA_VERSION, threshold=0.5, gate=0.3, seed=0):
    torch.manual_seed(seed)
    net = ControllerNet(len(FEATURE_NAMES), (8,))
    rows = np.random.default_rng(seed).normal(size=(64, len(FEATURE_NAMES))).astype(np.float32)
    net.set_normalisation(rows)
    meta = {
        "feature_names": list(names),
        "schema_version": str(schema),
        "threshold": str(threshold),
        "gate_threshold": str(gate),
        "max_lookahead": "4",
        "target": "gemma-3-270m",
        "assistant": "smollm2-135m",
        "assistant_int8": "false",
        "latency_profile": PROFILE,
    }
    export_onnx(net, path, metadata=meta, check_rows=rows)
    return net, rows


def test_onnx_policy_decides_like_torch(tmp_path):
    net, rows = _export(tmp_path / "c.onnx", threshold=0.5)
    policy = LearnedPolicy(tmp_path / "c.onnx")
    with torch.no_grad():
        want = (net(torch.from_numpy(rows)) < 0.5).numpy()
    got = np.array([policy._score(r) < policy.info.threshold for r in rows])
    assert (got == want).all()
    assert 0 < want.sum() < len(want)  # both decisions occur, so the comparison means something


def test_gate_can_skip_drafting(tmp_path):
    _export(tmp_path / "c.onnx", gate=1.0)  # every probability is below 1: always skip
    policy = LearnedPolicy(tmp_path / "c.onnx")
    ctx = DraftContext(
        iteration=3,
        generated=10,
        remaining=50,
        prev_drafted=2,
        prev_accepted=1,
        drafted_total=8,
        accepted_total=3,
        target_prob=0.9,
        target_entropy=0.4,
    )
    assert policy.budget(ctx) == 0
    assert gate_row(ctx)[FEATURE_NAMES.index("prob")] == 0.0
    assert gate_row(ctx)[FEATURE_NAMES.index("target_prob")] == pytest.approx(0.9)
    _export(tmp_path / "never.onnx", gate=0.0)
    assert LearnedPolicy(tmp_path / "never.onnx").budget(ctx) == 4


def test_schema_mismatch_and_corrupt_file_are_refused(tmp_path):
    _export(tmp_path / "old.onnx", schema=SCHEMA_VERSION + 1)
    with pytest.raises(UagError, match="feature schema"):
        LearnedPolicy(tmp_path / "old.onnx")
    _export(tmp_path / "names.onnx", names=tuple(reversed(FEATURE_NAMES)))
    with pytest.raises(UagError, match="feature schema"):
        LearnedPolicy(tmp_path / "names.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00not an onnx file" * 10)
    with pytest.raises(UagError, match="not a valid ONNX"):
        LearnedPolicy(tmp_path / "junk.onnx")
    with pytest.raises(UagError, match="not found"):
        LearnedPolicy(tmp_path / "missing.onnx")


def test_learned_policy_is_lossless_in_the_loop(tmp_path, tiny_dirs):
    _export(tmp_path / "c.onnx", threshold=0.5, gate=0.4)
    pair = uag.load_pair(*tiny_dirs)
    policy = LearnedPolicy(tmp_path / "c.onnx")
    ref = uag.generate(pair, "Once upon a time", policy=None, max_new_tokens=30)
    out = uag.generate(pair, "Once upon a time", policy=policy, max_new_tokens=30)
    assert out.token_ids == ref.token_ids
    assert policy.decisions > 0


def test_bad_controller_input(tmp_path, capsys):
    (tmp_path / "junk.onnx").write_bytes(b"garbage")
    for path, message in (
        (tmp_path / "none.onnx", "not found"),
        (tmp_path / "junk.onnx", "not a valid ONNX"),
    ):
        assert main(["generate", "--prompt", "x", "--controller", str(path)]) == 2
        assert message in one_clean_line(capsys)
    _export(tmp_path / "old.onnx", schema=SCHEMA_VERSION + 1)
    assert main(["generate", "--prompt", "x", "--controller", str(tmp_path / "old.onnx")]) == 2
    assert "feature schema" in one_clean_line(capsys)


def test_bad_bench_input(tmp_path, capsys, tiny_dirs):
    base = [
        "bench",
        "--target",
        tiny_dirs[0],
        "--assistant",
        tiny_dirs[1],
        "--out",
        str(tmp_path / "b"),
    ]
    assert main([*base, "--prompts", "mixed", "--policies", "static-2,warp-speed"]) == 2
    assert "unknown policy" in one_clean_line(capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([*base, "--prompts", str(empty)]) == 2
    assert "empty" in one_clean_line(capsys)
    assert (
        main(
            [
                *base,
                "--prompts",
                "mixed",
                "--policies",
                "learned",
                "--controller",
                str(tmp_path / "no.onnx"),
            ]
        )
        == 2
    )
    assert "not found" in one_clean_line(capsys)


def test_bench_catches_a_broken_policy(tmp_path, tiny_dirs):
    def broken(prompt: str, n: int) -> ArmRun:
        res = uag.generate(pair, prompt, policy=None, max_new_tokens=n)
        ids = res.token_ids[:-1] + [(res.token_ids[-1] + 1) % 100]  # one wrong token at the end
        return ArmRun(ids=ids, seconds=res.seconds, target_forwards=res.new_tokens)

    pair = uag.load_pair(*tiny_dirs)
    cfg = BenchConfig(
        prompts="mixed",
        limit=2,
        out=tmp_path,
        target=tiny_dirs[0],
        assistant=tiny_dirs[1],
        max_new_tokens=12,
        policies="target-only,static-2,oracle",
        progress=False,
    )
    report = run_bench(cfg, extra_arms={"broken": broken})
    by_name = {p.name: p for p in report.policies}
    assert by_name["static-2"].identical
    assert not by_name["broken"].identical
    assert by_name["oracle"].simulated and by_name["oracle"].speedup_vs_target > 0
    row = report.to_json()["policies"][0]
    assert set(row) >= {
        "name",
        "speedup_vs_target",
        "identical",
        "tokens_per_target_forward",
        "acceptance_rate",
        "seconds",
    }
    assert json.dumps(report.to_json())
