"""The two-build A/B's arithmetic (``scripts.ab``): a fixed per-worker-slot factor cancels,
a real difference between builds does not, and token mismatches are counted."""

from __future__ import annotations

import math

import pytest

from scripts.ab import Pairing, main, slot_cancelled, table


def _rows(*, build: float, slot: float, prompts: int = 6) -> list[Pairing]:
    """The new build takes ``build`` times the old's time; the worker started second is
    ``slot`` times slower than the first."""
    rows = []
    for half in (0, 1):
        for p in range(prompts):
            base = 1.0 + 0.1 * p
            old = base * (slot if half == 1 else 1.0)  # half 1: the old build started second
            new = base * build * (slot if half == 0 else 1.0)
            rows.append(Pairing(half, p, "a", old, new, same=p != 3, tokens=10))
    return rows


@pytest.mark.parametrize("build", [1.0, 0.9, 1.2])
def test_a_fixed_slot_factor_cancels_and_the_build_difference_stays(build):
    ratios = slot_cancelled(_rows(build=build, slot=1.07), "a")
    assert all(math.isclose(r, build, rel_tol=1e-9) for r in ratios)
    # either half alone would carry the slot factor
    half0 = slot_cancelled([r for r in _rows(build=build, slot=1.07) if r.half == 0], "a")
    assert all(math.isclose(r, build * 1.07) for r in half0)


def test_the_table_reports_the_ratio_and_counts_mismatched_tokens():
    text = table(_rows(build=1.0, slot=1.05), ["a"])
    row = text.splitlines()[-1]
    assert row.startswith("| a | 1.000 (1.000–1.000) | 1.050 | 0.952 |")
    assert row.endswith("| 10/12 |")


def test_repeats_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--old", ".", "--new", ".", "--prompts", "mixed", "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
