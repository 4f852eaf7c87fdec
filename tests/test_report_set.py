"""The frozen report set (issue 60): held out by construction, categories and budgets carried
per prompt, and ``uag bench`` reporting per category with intervals."""

from __future__ import annotations

import json
import unicodedata

import pytest

from uag.errors import UagError
from uag.harness.bench import ArmRun, BenchConfig, BenchReport, PolicyResult, run_bench
from uag.harness.prompts import load_prompts, refuse_held_out

CATEGORIES = {
    "code-completion",
    "code-edit",
    "chat",
    "prose",
    "multilingual",
    "structured",
    "math",
    "long",
    "multi-turn",
}


def _scripts(text: str) -> set[str]:
    """The non-Latin scripts a text is written in, by the first word of each letter's name."""
    names = (unicodedata.name(c, "") for c in text if c.isalpha() and ord(c) > 0x24F)
    return {n.split()[0] for n in names if n}


def test_the_report_set_is_frozen_held_out_and_covers_every_category():
    prompts = load_prompts("report")
    assert len(prompts) >= 60
    assert all(p.held_out for p in prompts)
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    assert set(by_cat) == CATEGORIES
    assert min(len(v) for v in by_cat.values()) >= 6
    assert all((p.max_new_tokens or 0) >= 256 for p in by_cat["long"])
    scripts = set().union(*(_scripts(p.text) for p in by_cat["multilingual"]))
    assert len(scripts & {"CJK", "HIRAGANA", "KATAKANA", "CYRILLIC", "ARABIC", "DEVANAGARI",
                          "HANGUL", "GREEK"}) >= 4, scripts  # fmt: skip
    for p in by_cat["multi-turn"]:
        assert p.messages is not None and p.messages[-1][0] == "user"
        assert sum(role == "user" for role, _ in p.messages) >= 3
    # Nothing a plan was ever trained or tuned on: no text shared with the collectable sets.
    seen = {p.text.strip() for p in load_prompts("mixed") + load_prompts("humaneval")}
    assert not [p.id for p in prompts if p.text.strip() in seen]


def test_collect_refuses_the_report_set_and_splits_do_not_leak_it():
    for source in ("report", "report:train", "mixed:train+report:test"):
        with pytest.raises(UagError, match="held-out report set"):
            refuse_held_out(load_prompts(source), command="uag collect")
    refuse_held_out(load_prompts("mixed:train"), command="uag collect")  # the others pass


def test_a_prompt_file_carries_categories_budgets_and_conversations(tmp_path):
    rows = [
        {"id": "a", "category": "x", "text": "def f():", "max_new_tokens": 3},
        {"id": "b", "category": "y", "messages": [{"role": "user", "content": "Hi there"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_prompts(str(path))
    assert (a.category, a.max_new_tokens, a.messages, a.held_out) == ("x", 3, None, False)
    assert b.messages == (("user", "Hi there"),) and b.max_new_tokens is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "text": "x", "max_new_tokens": 0}) + "\n")
    with pytest.raises(UagError, match="max_new_tokens must be a positive integer"):
        load_prompts(str(bad))


def test_bench_honours_each_prompts_budget_and_reports_by_category(tmp_path, tiny_dirs):
    import uag

    rows = [
        {"id": "c1", "category": "code", "text": "def add(a, b):", "max_new_tokens": 3},
        {"id": "c2", "category": "code", "text": "for i in range(10):"},
        {"id": "p1", "category": "prose", "text": "Once upon a time"},
        {"id": "m1", "category": "prose", "messages": [{"role": "user", "content": "Hello!"}]},
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pair = uag.load_pair(*tiny_dirs)
    asked: list[tuple[str, int]] = []

    def alone(prompt: str, n: int, seed: int | None) -> ArmRun:
        asked.append((prompt, n))
        res = uag.generate(pair, prompt, plan=None, max_new_tokens=n)
        return ArmRun(ids=res.token_ids, seconds=res.seconds, target_forwards=res.new_tokens)

    cfg = BenchConfig(
        prompts=str(path),
        out=tmp_path / "b",
        target=tiny_dirs[0],
        assistant=tiny_dirs[1],
        max_new_tokens=7,
        policies="target-only,static-2",
        progress=False,
    )
    report = run_bench(cfg, extra_arms={"alone": alone})
    timed = asked[1:]  # after the warm-up
    assert [n for _, n in timed] == [3, 7, 7, 7]
    assert timed[3][0] == uag.api.render_chat(pair, [{"role": "user", "content": "Hello!"}])
    cells = report.by_category()
    assert set(cells) == {"static-2", "alone"}
    assert [(c, n) for c, (_, _, n) in cells["alone"].items()] == [
        ("all", 4),
        ("code", 2),
        ("prose", 2),
    ]
    overall = next(p for p in report.policies if p.name == "alone").speedup_vs_target
    assert cells["alone"]["all"][0] == pytest.approx(overall)
    assert "by category" in report.markdown()
    assert report.to_json()["by_category"]["alone"]["code"]["prompts"] == 2


def test_category_ratios_come_from_their_own_prompts_only():
    """A category's ratio and interval use its prompts alone: an arm twice as fast on code and
    as fast on prose reads 2x and 1x there (a table computed over all prompts would not)."""
    base_s, arm_s = [2.0, 2.0, 3.0, 3.0], [1.0, 1.0, 3.0, 3.0]
    tokens = [10, 10, 10, 10]

    def result(name, seconds):
        return PolicyResult(
            name,
            runs=4,
            seconds=sum(seconds),
            per_prompt_seconds=seconds,
            tokens=sum(tokens),
            per_prompt_tokens=tokens,
        )

    report = BenchReport(
        policies=[result("target-only", base_s), result("arm", arm_s)],
        machine="test",
        prompts=4,
        categories=["code", "code", "prose", "prose"],
    )
    cells = report.by_category()["arm"]
    assert cells["code"][0] == pytest.approx(2.0) and cells["code"][1] == pytest.approx((2, 2))
    assert cells["prose"][0] == pytest.approx(1.0)
    assert cells["all"][0] == pytest.approx(10 / 8)
    assert BenchReport(policies=report.policies, machine="t", prompts=4).by_category() == {}
