"""The latency profile measured in slices: what ``uag bench`` spreads over its timed runs."""

from __future__ import annotations

import statistics

import pytest

import uag
from uag.harness.latency import measure_pair_profile, pair_sampler


def test_profile_slices_accumulate_and_the_prices_are_the_medians_of_all(tiny_dirs):
    pair = uag.load_pair(*tiny_dirs)
    sampler = pair_sampler(pair, max_candidates=3)
    with pytest.raises(ValueError, match="no profile round"):
        sampler.profile()
    sampler.sample(rounds=2)  # the first slice warms up untimed, then times 2 rounds
    assert (sampler.slices, sampler.rounds) == (1, 2)
    assert all(len(t) == 2 for t in sampler.times.values())
    assert len(sampler.stats_times) == 2 * 4  # verify0..3 read the statistics; the step does not
    sampler.sample(rounds=1)  # later slices: no warm-up round
    assert (sampler.slices, sampler.rounds) == (2, 3)
    assert all(len(t) == 3 for t in sampler.times.values())
    # a slow slice moves the prices by its share of the rounds: medians over every slice
    sampler.times["draft"] = [0.001, 0.002, 0.009]
    profile = sampler.profile()
    assert profile.draft_s == 0.002
    assert len(profile.verify_s) == 4
    assert profile.verify_s[3] == statistics.median(sampler.times["verify3"])
    assert profile.step_s == statistics.median(sampler.times["step"])
    # the bench's end of run tops the slices up to ``repeats`` timed rounds, at least one more
    full = measure_pair_profile(pair, max_candidates=3, repeats=5, sampler=sampler)
    assert (sampler.slices, sampler.rounds) == (3, 5)
    assert full.draft_s == statistics.median(sampler.times["draft"])
    measure_pair_profile(pair, max_candidates=3, repeats=5, sampler=sampler)
    assert sampler.rounds == 6
