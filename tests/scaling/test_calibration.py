"""Predict-then-verify on synthetic ladders with known truth: the law-selection rule, and the 95% band
covering about 95% of 200 simulated validation points."""

from __future__ import annotations

import math

import numpy as np
import pytest

from marin.scaling.fit import (
    FitError,
    fit_accuracy_sigmoid,
    fit_power_law,
    fit_selected_law,
    select_law,
)


def _coverage(truth, c, c_val, noise, trials=200, seed=0, additive=False):
    """Share of validation points (truth at c_val plus fresh noise) inside the selected law's band."""
    rng = np.random.default_rng(seed)
    hits, forms = 0, {}
    for _ in range(trials):
        if additive:
            y, yv = truth(c) + noise * rng.standard_normal(len(c)), truth(c_val) + noise * rng.standard_normal()
        else:
            y = truth(c) * np.exp(noise * rng.standard_normal(len(c)))
            yv = truth(c_val) * math.exp(noise * rng.standard_normal())
        f = fit_selected_law(c, y, n_boot=0)
        forms[f.form] = forms.get(f.form, 0) + 1
        lo, hi = f.band(c_val)
        hits += lo <= yv <= hi
    return hits / trials, forms


def test_band_covers_95_percent_on_a_pure_power_law_ladder():
    """Four rungs of a straight line in log-log with 1% scatter, validation at 2x the largest rung."""
    c = np.logspace(10, 12, 4)
    rate, forms = _coverage(lambda x: 50.0 * x ** -0.1, c, 2e12, 0.01)
    assert forms == {"pure": 200}  # four points: the saturating law cannot be tested by leaving one out
    # binomial sd of a 95% rate over 200 trials is 1.5 points: 0.91-0.99 is within about 2.5 sd
    assert 0.91 <= rate <= 0.99, rate


@pytest.mark.slow  # 27 s; the band's coverage core: the pure power-law ladder above
def test_band_covers_95_percent_on_a_saturating_ladder():
    """Six rungs of E + A C^-alpha with additive scatter; the rule picks the law, the band covers."""
    c = np.logspace(10, 12, 6)
    rate, forms = _coverage(lambda x: 1.8 + 2e3 * x ** -0.25, c, 2e12, 0.003, additive=True)
    assert forms.get("saturating", 0) > 150, forms
    assert 0.91 <= rate <= 0.99, rate


def test_the_old_normal_band_under_covers_where_student_t_does_not():
    """The reason for Student's t: with 2 residual degrees of freedom, +/- 1.96 s misses far more often."""
    rng = np.random.default_rng(3)
    c = np.logspace(10, 12, 4)
    inside_t = inside_z = 0
    for _ in range(200):
        y = 50.0 * c ** -0.1 * np.exp(0.01 * rng.standard_normal(4))
        yv = 50.0 * 2e12 ** -0.1 * math.exp(0.01 * rng.standard_normal())
        f = fit_power_law(c, y, n_boot=0, form="pure")
        lo, hi = f.band(2e12)
        inside_t += lo <= yv <= hi
        inside_z += abs(math.log(yv / f.predict(2e12))) <= 1.96 * f.log_resid_std
    assert inside_t / 200 >= 0.91 and inside_z / 200 < inside_t / 200 - 0.04


def test_selection_rule():
    c = np.logspace(10, 12, 4)
    out = select_law(c, 50.0 * c ** -0.1)
    assert out["form"] == "pure" and out["scores"]["saturating"] is None and "fewer than 4" in out["why"]
    c6 = np.logspace(10, 12, 6)
    sat = select_law(c6, 1.8 + 2e3 * c6 ** -0.25)
    assert sat["form"] == "saturating" and sat["scores"]["saturating"] < sat["scores"]["pure"]
    pure = select_law(c6, 50.0 * c6 ** -0.1)  # no floor: E on its bound, the saturating law is not eligible
    assert pure["form"] == "pure" and "E on a bound" in pure["why"]
    f = fit_selected_law(c6, 1.8 + 2e3 * c6 ** -0.25, n_boot=10)
    assert f.form == "saturating" and f.why.startswith("selected: leave-largest-out")
    with pytest.raises(FitError, match="at least 2 points"):
        select_law([1e10], [3.0])


def test_accuracy_sigmoid_recovers_its_parameters_and_refuses_bad_input():
    tl = np.linspace(0.8, 2.4, 9)
    acc = 0.25 + 0.75 / (1 + np.exp(3.0 * (tl - 1.6)))
    f = fit_accuracy_sigmoid(tl, acc, 0.25)
    assert f.k == pytest.approx(3.0, rel=1e-3) and f.L0 == pytest.approx(1.6, rel=1e-3) and f.resid_std < 1e-6
    assert f.predict(1.6) == pytest.approx(0.625) and "within" in f.why
    with pytest.raises(FitError, match="at least 3 points"):
        fit_accuracy_sigmoid([1.0, 2.0], [0.5, 0.3], 0.25)
    with pytest.raises(FitError, match="accuracies in \\[0, 1\\]"):
        fit_accuracy_sigmoid([1.0, 2.0, 3.0], [0.5, 1.3, 0.3], 0.25)
    with pytest.raises(FitError, match="same task loss"):
        fit_accuracy_sigmoid([1.0, 1.0, 1.0], [0.5, 0.4, 0.3], 0.25)


@pytest.mark.slow
def test_surface_band_coverage_on_an_isoflop_grid():
    """3 budgets x 4 sizes of a known surface with 1% scatter; 200 validation runs at 2x the largest
    budget, 20 tokens per parameter (200 surface fits: 515 s measured at a load average of about 20)."""
    from marin.scaling.fit import fit_loss_surface

    def law(n, d):
        return 1.69 + 406.4 / n ** 0.34 + 410.7 / d ** 0.28

    n = np.concatenate([np.sqrt(c / 120) * np.logspace(-0.6, 0.6, 4) for c in (1e18, 1e19, 1e20)])
    d = np.repeat((1e18, 1e19, 1e20), 4) / (6 * n)
    vn = math.sqrt(2e20 / 120)
    vd = 2e20 / (6 * vn)
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(200):
        f = fit_loss_surface(n, d, law(n, d) * np.exp(0.01 * rng.standard_normal(len(n))), n_boot=0)
        lo, hi = f.band(vn, vd)
        hits += lo <= law(vn, vd) * math.exp(0.01 * rng.standard_normal()) <= hi
    # Huber (almost L1) fitting with a least-squares interval: about 93-95% measured; allow 2.5 sd
    assert 0.90 <= hits / 200 <= 0.99, hits / 200
