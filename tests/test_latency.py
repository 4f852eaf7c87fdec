"""The latency profile measured in slices: what ``uag bench`` spreads over its timed runs."""

from __future__ import annotations

import itertools
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
    assert profile.verify_s == list(itertools.accumulate(
        (statistics.median(sampler.times[f"verify{m}"]) for m in range(4)), max
    ))  # fmt: skip
    # a longer pass measured below a shorter one (drift) is priced at the shorter one's
    sampler.times["verify1"], sampler.times["verify2"] = [0.010] * 3, [0.008] * 3
    sampler.times["verify3"] = [0.012] * 3
    assert sampler.profile().verify_s[1:] == [0.010, 0.010, 0.012]
    assert profile.step_s == statistics.median(sampler.times["step"])
    # the bench's end of run tops the slices up to ``repeats`` timed rounds, at least one more
    full = measure_pair_profile(pair, max_candidates=3, repeats=5, sampler=sampler)
    assert (sampler.slices, sampler.rounds) == (3, 5)
    assert full.draft_s == statistics.median(sampler.times["draft"])
    measure_pair_profile(pair, max_candidates=3, repeats=5, sampler=sampler)
    assert sampler.rounds == 6


def test_a_sampling_profile_times_what_sampling_verifies(tiny_dirs):
    """Under sampling the verify reads every row's full logits and the first row's processed
    distribution, and no target statistics (priced 0)."""
    from uag.decoding.sampling import SamplingConfig

    pair = uag.load_pair(*tiny_dirs)
    sampler = pair_sampler(pair, max_candidates=2, sampling=SamplingConfig(top_k=4))
    sampler.sample(rounds=1)
    profile = sampler.profile()
    assert profile.stats_s == 0.0 and len(profile.verify_s) == 3
    assert profile.verify_s == sorted(profile.verify_s)
