"""Staleness bound η: trainer filter, stale-ratio counter, rollout pause rule."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlstream.policy.staleness import StalenessCounter, StalenessFilter, rollout_should_pause

versions = st.integers(min_value=0, max_value=10_000)
etas = st.integers(min_value=0, max_value=64)


# -- StalenessFilter ---------------------------------------------------------


def test_boundary_is_inclusive():
    f = StalenessFilter(eta=2)
    assert f.accepts(10, 10)
    assert f.accepts(10, 8)  # exactly η behind: still accepted
    assert not f.accepts(10, 7)
    assert f.is_stale(10, 7)
    assert not f.is_stale(10, 8)


def test_eta_zero_is_strictly_on_policy():
    f = StalenessFilter(eta=0)
    assert f.accepts(5, 5)
    assert not f.accepts(5, 4)


def test_sample_newer_than_trainer_is_accepted():
    # Trainer restarted from an older checkpoint; samples from later versions remain.
    f = StalenessFilter(eta=0)
    assert f.accepts(3, 7)
    assert not f.is_stale(3, 7)
    assert f.lag(3, 7) == -4


def test_filter_is_frozen_and_validated():
    f = StalenessFilter(eta=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.eta = 2  # type: ignore[misc]
    with pytest.raises(ValueError):
        StalenessFilter(eta=-1)
    with pytest.raises(TypeError):
        StalenessFilter(eta=1.5)  # type: ignore[arg-type]


@given(eta=etas, trainer=versions, sample=versions)
def test_sample_more_than_eta_old_never_accepted(eta, trainer, sample):
    f = StalenessFilter(eta=eta)
    accepted = f.accepts(trainer, sample)
    assert accepted is not f.is_stale(trainer, sample)
    if trainer - sample > eta:
        assert not accepted
    else:
        assert accepted


@given(eta=etas, trainer=versions, sample=versions)
def test_acceptance_monotone_in_eta_and_versions(eta, trainer, sample):
    f, wider = StalenessFilter(eta), StalenessFilter(eta + 1)
    if f.accepts(trainer, sample):
        assert wider.accepts(trainer, sample)  # a larger η never rejects more
        assert f.accepts(trainer, sample + 1)  # a fresher sample stays accepted
        assert f.accepts(trainer - 1, sample)  # an older trainer stays accepting


# -- StalenessCounter --------------------------------------------------------


def test_counter_empty_ratio_is_zero():
    c = StalenessCounter()
    assert (c.accepted, c.stale, c.seen) == (0, 0, 0)
    assert c.stale_ratio == 0.0


def test_counter_arithmetic():
    c = StalenessCounter()
    c.record(True, n=3)
    c.record(False)
    assert (c.accepted, c.stale, c.seen) == (3, 1, 4)
    assert c.stale_ratio == pytest.approx(0.25)
    c.reset()
    assert c.seen == 0 and c.stale_ratio == 0.0
    with pytest.raises(ValueError):
        c.record(True, n=-1)


def test_counter_observe_applies_filter():
    f, c = StalenessFilter(eta=1), StalenessCounter()
    assert c.observe(f, 10, 9) is True
    assert c.observe(f, 10, 8) is False
    assert c.observe(f, 10, 12) is True
    assert (c.accepted, c.stale) == (2, 1)
    assert c.stale_ratio == pytest.approx(1 / 3)


@given(eta=etas, trainer=versions, samples=st.lists(versions, max_size=200))
def test_counter_matches_filter(eta, trainer, samples):
    f, c = StalenessFilter(eta), StalenessCounter()
    accepted = [c.observe(f, trainer, s) for s in samples]
    n_stale = sum(1 for s in samples if trainer - s > eta)
    assert c.stale == n_stale
    assert c.accepted == len(samples) - n_stale == sum(accepted)
    assert c.seen == len(samples)
    assert 0.0 <= c.stale_ratio <= 1.0
    assert c.stale_ratio == (n_stale / len(samples) if samples else 0.0)


# -- rollout_should_pause ----------------------------------------------------


def test_rollout_pause_rule():
    assert not rollout_should_pause(newest_policy=5, rollout_policy=5, eta=0)
    assert rollout_should_pause(newest_policy=6, rollout_policy=5, eta=0)
    assert not rollout_should_pause(newest_policy=7, rollout_policy=5, eta=2)
    assert rollout_should_pause(newest_policy=8, rollout_policy=5, eta=2)
    # Rollout ahead of what it has heard as newest: never pause.
    assert not rollout_should_pause(newest_policy=3, rollout_policy=5, eta=0)
    with pytest.raises(ValueError):
        rollout_should_pause(1, 0, -1)


@given(eta=etas, newest=versions, rollout=versions)
def test_rollout_pauses_exactly_when_its_samples_would_be_stale(eta, newest, rollout):
    # Rollout at version r keeps going exactly while a trainer at the newest
    # version would accept what it produces.
    paused = rollout_should_pause(newest, rollout, eta)
    assert paused == StalenessFilter(eta).is_stale(newest, rollout)
    assert paused == (newest - rollout > eta)
