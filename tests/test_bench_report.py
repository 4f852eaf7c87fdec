"""`uag bench --out` writes a dated report a docs page can cite: date, commit, machine, command."""

import json
import re
import sys
from datetime import datetime, timezone

from uag.harness import bench
from uag.harness.bench import BenchReport, PolicyResult, write_report


def _report() -> BenchReport:
    target = PolicyResult("target-only", runs=2, identical_runs=2, speedup_vs_target=1.0)
    static = PolicyResult(
        "static-2", runs=2, identical_runs=2, speedup_vs_target=1.1, interval=(1.0, 1.2)
    )
    return BenchReport(
        policies=[target, static],
        machine="x86_64 test-cpu, 2 threads",
        prompts=2,
        config={"max_new_tokens": 8, "lookup_lengths": [3, 5, 11], "draft_vocab_used": 128},
    )


def test_report_carries_date_commit_machine_and_command(tmp_path):
    when = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    command = "uag bench --prompts mixed --limit 2 --out 'runs/my bench'"
    write_report(_report(), tmp_path, command=command, now=when)
    run = json.loads((tmp_path / "results.json").read_text())["run"]
    assert run["date_utc"] == "2025-01-02T03:04:05Z"
    assert run["machine"] == "x86_64 test-cpu, 2 threads"
    assert run["command"] == command
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", run["commit"])
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# uag bench, 2025-01-02T03:04:05Z\n")
    for line in (f"command: `{command}`", f"commit: `{run['commit']}`", "machine: x86_64 test-cpu"):
        assert line in md
    assert "drafts from the first 128 ids" in md and "| static-2 | 1.10x |" in md
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_report_defaults_to_this_process_and_never_fails_on_git(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/.venv/bin/uag", "bench", "--limit", "2"])

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench.subprocess, "run", no_git)
    write_report(_report(), tmp_path)
    run = json.loads((tmp_path / "results.json").read_text())["run"]
    assert run["command"] == "uag bench --limit 2"
    assert run["commit"] == "unknown"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", run["date_utc"])
    assert "commit: `unknown`" in (tmp_path / "results.md").read_text()


def test_the_learned_arm_is_compared_with_every_fixed_arm_paired_by_prompt():
    """learned against each measured arm but target-only and the simulated ones: the ratio of
    their times and a paired interval over prompts that contains it (and lies above 1 when
    learned is faster on every prompt): tokens per second, the time ratio when the tokens agree."""
    per_prompt = {"target-only": [2.0, 4.0, 3.0, 5.0], "lookup": [1.2, 2.2, 1.8, 3.0]}
    per_prompt["learned"] = [t / 1.1 for t in per_prompt["lookup"]]
    tokens = [128, 100, 128, 64]
    arms = [
        PolicyResult(
            name,
            runs=4,
            identical_runs=4,
            seconds=sum(s),
            per_prompt_seconds=s,
            tokens=sum(tokens),
            per_prompt_tokens=tokens,
        )
        for name, s in per_prompt.items()
    ]
    oracle = PolicyResult("oracle-plan", simulated=True, speedup_vs_target=2.5)
    report = BenchReport(policies=[*arms, oracle], machine="test", prompts=4, config={})
    [(mine, other, ratio, (low, high))] = report.comparisons()
    assert (mine, other) == ("learned", "lookup")
    assert abs(ratio - 1.1) < 1e-9 and low > 1.0 and low - 1e-9 <= ratio <= high + 1e-9
    assert report.to_json()["learned_vs_fixed"][0]["vs"] == "lookup"
    assert "| learned | lookup | 1.100x |" in report.markdown()


def test_a_sampled_arm_that_emits_fewer_tokens_is_not_counted_faster():
    """Sampled runs of one prompt differ in length: the comparison is tokens per second. An arm
    as fast per token as lookup whose runs drew an end-of-sequence earlier takes less time yet
    compares at 1.0x (a time ratio would call it 1.25x)."""
    seconds = {"lookup": [2.0, 4.0, 3.0], "learned": [1.6, 3.2, 2.4]}
    tokens = {"lookup": [100, 120, 110], "learned": [80, 96, 88]}
    arms = [
        PolicyResult(
            name,
            runs=3,
            seconds=sum(seconds[name]),
            per_prompt_seconds=seconds[name],
            tokens=sum(tokens[name]),
            per_prompt_tokens=tokens[name],
        )
        for name in ("lookup", "learned")
    ]
    report = BenchReport(policies=arms, machine="test", prompts=3, config={})
    [(_, _, ratio, (low, high))] = report.comparisons()
    assert abs(ratio - 1.0) < 1e-9 and abs(low - 1.0) < 1e-9 and abs(high - 1.0) < 1e-9


def test_the_default_arm_is_compared_with_every_fixed_arm_too():
    """``default`` (the product's plan) is a plan arm: compared with lookup and static-2, not
    with a learned arm; per-prompt figures reach results.json for any later pairing."""
    seconds = {
        "target-only": [2.0, 4.0],
        "default": [1.0, 2.0],
        "lookup": [1.1, 2.2],
        "learned": [1.2, 2.4],
    }
    arms = [
        PolicyResult(
            name,
            runs=2,
            seconds=sum(s),
            per_prompt_seconds=s,
            tokens=20,
            per_prompt_tokens=[10, 10],
        )
        for name, s in seconds.items()
    ]
    report = BenchReport(policies=arms, machine="test", prompts=2, config={})
    pairs = {(a, b): r for a, b, r, _ in report.comparisons()}
    assert set(pairs) == {("default", "lookup"), ("learned", "lookup")}
    assert abs(pairs[("default", "lookup")] - 1.1) < 1e-9
    row = report.to_json()["policies"][1]
    assert row["per_prompt_seconds"] == [1.0, 2.0] and row["per_prompt_tokens"] == [10, 10]


def test_the_machine_line_names_the_cpu_and_its_vector_extensions():
    from uag import recipes

    isa = recipes.cpu_isa()
    assert isa and "threads" in recipes.machine_id()
    assert any(name in isa for name in ("AVX2", "AVX-512", "AMX", "no AVX2", "ISA unknown"))
