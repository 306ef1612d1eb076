"""The equal-loss compute multiplier between two fitted laws (an optimizer comparison's summary)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from marin.scaling.fit import compute_multiplier, compute_to_reach, fit_power_law


def test_compute_to_reach_inverts_the_law():
    c = compute_to_reach(1.5, 40.0, 0.3, 2.0)
    assert 1.5 + 40.0 * c ** -0.3 == pytest.approx(2.0, rel=1e-12)
    assert math.isnan(compute_to_reach(1.5, 40.0, 0.3, 1.5))  # the floor is never reached
    assert math.isnan(compute_to_reach(1.5, 40.0, 0.3, 1.0))


def test_a_law_shifted_by_a_factor_of_compute_is_that_multiplier_at_every_scale():
    c = np.array([1e9, 4e9, 1.6e10, 6.4e10])
    base = fit_power_law(c, 10.0 * c ** -0.2, form="pure")
    other = fit_power_law(c, 10.0 * (2.5 * c) ** -0.2, form="pure")  # the same loss at 1/2.5 of the compute
    for at in (1e9, 3e10, 1e12):
        m = compute_multiplier(base, other, at)
        assert m["multiplier"] == pytest.approx(2.5, rel=1e-9)
        # exact points: every bootstrap law is the fitted one, so the interval is the point
        assert m["low"] == pytest.approx(2.5, rel=1e-6) and m["high"] == pytest.approx(2.5, rel=1e-6)
    assert compute_multiplier(other, base, 1e10)["multiplier"] == pytest.approx(1 / 2.5, rel=1e-9)


def test_noisy_points_give_an_interval_around_the_multiplier():
    rng = np.random.default_rng(0)
    c = np.geomspace(1e9, 1e11, 5)
    base = fit_power_law(c, 10.0 * c ** -0.2 * np.exp(rng.normal(0, 0.01, 5)), form="pure")
    other = fit_power_law(c, 10.0 * (1.5 * c) ** -0.2 * np.exp(rng.normal(0, 0.01, 5)), form="pure")
    m = compute_multiplier(base, other, 1e10)
    assert m["low"] < m["multiplier"] < m["high"] and m["pairs"] >= 10
    assert m["low"] < 1.5 < m["high"]
