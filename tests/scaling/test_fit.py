"""The scaling-law fitter on synthetic data from known parameters."""

from __future__ import annotations

import numpy as np
import pytest

from marin.scaling.fit import (
    FitError,
    fit_power_law,
    leave_largest_out,
    linear_trend,
    trend_predict,
)

E, A, ALPHA = 1.8, 2.0e3, 0.25


def _points(n: int, noise: float, seed: int):
    c = np.logspace(12, 18, n)
    rng = np.random.default_rng(seed)
    return c, (E + A * c ** -ALPHA) * (1 + noise * rng.standard_normal(n))


def test_recovers_known_parameters_within_the_reported_uncertainty():
    hits = 0
    for seed in range(5):
        c, y = _points(10, 0.003, seed)
        f = fit_power_law(c, y, n_boot=200, seed=seed)
        assert f.form == "saturating" and f.r2 > 0.99
        assert np.isfinite([f.E_std, f.A_std, f.alpha_std]).all() and f.E_std > 0
        within = [abs(f.E - E) <= 3 * f.E_std, abs(f.alpha - ALPHA) <= 3 * f.alpha_std,
                  abs(np.log(f.A / A)) <= 3 * f.A_std / f.A]
        hits += all(within)
        assert abs(f.E - E) < 0.05 and abs(f.alpha - ALPHA) < 0.05  # and the values themselves are close
    assert hits >= 4  # 3-sigma intervals: one unlucky seed of five at most


def test_exact_points_are_fitted_exactly_and_predicted():
    c, y = _points(6, 0.0, 0)
    f = fit_power_law(c, y, n_boot=20)
    assert (f.E, f.A, f.alpha) == pytest.approx((E, A, ALPHA), rel=1e-4)
    assert f.predict(1e20) == pytest.approx(E + A * 1e20 ** -ALPHA, rel=1e-6)
    lo, hi = f.band(1e20)
    assert lo <= f.predict(1e20) <= hi
    loo = leave_largest_out(c, y, n_boot=20)
    assert abs(loo["rel_error"]) < 1e-4


def test_falls_back_to_a_pure_power_law_when_e_is_not_identifiable():
    c = np.logspace(10, 14, 5)
    y = 50.0 * c ** -0.1  # no floor: the bounded fit pushes E to 0
    f = fit_power_law(c, y, n_boot=20)
    assert f.form == "pure" and "bound" in f.why and f.E == 0.0
    assert f.alpha == pytest.approx(0.1, rel=1e-6) and f.A == pytest.approx(50.0, rel=1e-6)
    three = fit_power_law(c[:3], y[:3], n_boot=20)
    assert three.form == "pure" and "no degree of freedom" in three.why


def test_bad_points_are_a_clear_error():
    with pytest.raises(FitError, match="at least 2 points"):
        fit_power_law([1e12], [3.0])
    with pytest.raises(FitError, match="finite and positive"):
        fit_power_law([1e12, 2e12], [3.0, float("nan")])
    with pytest.raises(FitError, match="same compute"):
        fit_power_law([1e12, 1e12], [3.0, 2.0])
    with pytest.raises(FitError, match="at least 3 points"):
        leave_largest_out([1e12, 2e12], [3.0, 2.0])


def test_linear_trend_over_decades_of_compute():
    t = linear_trend([12, 13, 14], [0.2, 0.25, 0.3])
    assert t["slope_per_decade"] == pytest.approx(0.05) and trend_predict(t, 15) == pytest.approx(0.35)
    assert linear_trend([12], [0.3])["slope_per_decade"] == 0.0
