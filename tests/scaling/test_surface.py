"""The loss surface L(N, D) = E + A/N^alpha + B/D^beta on synthetic data from known parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from marin.scaling.fit import FitError, LossSurfaceFit, fit_loss_surface

# Hoffmann et al.'s fitted values (their Table / eq. 10): E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28
TRUTH = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def _law(n, d, E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28):
    return E + A / n ** alpha + B / d ** beta


def _isoflop_grid(budgets=(1e18, 1e19, 1e20, 1e21), sizes=5):
    """Per budget, sizes spread 1.2 decades around 20 tokens per parameter (C = 6 N D)."""
    n = np.concatenate([np.sqrt(c / 120) * np.logspace(-0.6, 0.6, sizes) for c in budgets])
    c = np.repeat(budgets, sizes)
    return n, c / (6 * n)


def test_the_log_sum_exp_form_is_the_law():
    """The optimiser's parameters (a, b, e, alpha, beta) predict log(E + A N^-alpha + B D^-beta)."""
    theta = [math.log(406.4), math.log(410.7), math.log(1.69), 0.34, 0.28]
    doc = {k: 0.0 for k in ("E", "A", "B", "alpha", "beta", "E_std", "A_std", "B_std", "alpha_std", "beta_std",
                            "exponent_n", "exponent_n_std", "resid_std", "r2", "huber_delta")}
    f = LossSurfaceFit.from_json({**doc, "why": "", "n": 8, "theta": theta, "log_n_fit": [1.0], "log_d_fit": [1.0]})
    n, d = np.array([1e8, 1e10]), np.array([1e9, 2e11])
    assert f.predict(n, d) == pytest.approx(_law(n, d), rel=1e-12)


def test_recovers_known_parameters_within_their_standard_errors():
    n, d = _isoflop_grid()
    hits = 0
    for seed in range(4):
        rng = np.random.default_rng(seed)
        loss = _law(n, d) * np.exp(0.003 * rng.standard_normal(len(n)))
        f = fit_loss_surface(n, d, loss, n_boot=60, seed=seed)
        assert f.why == "every parameter inside its bounds" and f.r2 > 0.99
        stds = {"E": f.E_std, "A": f.A_std, "B": f.B_std, "alpha": f.alpha_std, "beta": f.beta_std}
        assert all(np.isfinite(list(stds.values())))
        hits += all(abs(getattr(f, k) - v) <= 3 * stds[k] for k, v in TRUTH.items())
        assert f.alpha == pytest.approx(0.34, abs=0.05) and f.beta == pytest.approx(0.28, abs=0.05)
        truth_expo = 0.28 / (0.34 + 0.28)
        assert abs(f.exponent_n - truth_expo) <= 3 * f.exponent_n_std + 1e-3
    assert hits >= 3  # 3-sigma: at most one unlucky seed of four


def test_exact_points_predict_and_allocate_like_the_closed_form():
    n, d = _isoflop_grid()
    f = fit_loss_surface(n, d, _law(n, d), n_boot=0)
    assert f.predict(3e9, 6e10) == pytest.approx(_law(3e9, 6e10), rel=1e-4)
    lo, hi = f.band(3e9, 6e10)
    assert lo <= f.predict(3e9, 6e10) <= hi
    # C = 6 N D: N_opt = G (C/6)^(beta/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta))
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    n_opt, d_opt = f.optimal_allocation(1e23)
    assert n_opt == pytest.approx(g * (1e23 / 6) ** (0.28 / 0.62), rel=0.02)
    assert n_opt * d_opt * 6 == pytest.approx(1e23)
    # the numerical optimum under a FLOPs model that is 6 N agrees with the closed form
    n_num, d_num = f.optimal_allocation(1e23, flops_per_token=lambda nn: 6 * nn)
    assert n_num == pytest.approx(n_opt, rel=1e-3) and d_num == pytest.approx(d_opt, rel=1e-3)
    # it is a minimum: nearby allocations of the same compute lose more
    for k in (0.8, 1.25):
        assert f.predict(n_opt * k, d_opt / k) > f.predict(n_opt, d_opt)
    back = LossSurfaceFit.from_json(f.to_json())
    assert back.predict(3e9, 6e10) == pytest.approx(f.predict(3e9, 6e10)) and back.band(3e9, 6e10) == pytest.approx(
        (lo, hi))


def test_a_parameter_on_its_bound_is_named_in_why():
    n, d = _isoflop_grid()
    loss = 3.0 + 0 * n + 1e-9 * np.log(n)  # flat: nothing falls with N or D
    f = fit_loss_surface(n, d, loss * (1 + 1e-4 * np.sin(np.arange(len(n)))), n_boot=0)
    assert "bound" in f.why


def test_bad_input_is_a_clear_error():
    n, d = _isoflop_grid()
    loss = _law(n, d)
    with pytest.raises(FitError, match="5 parameters .* at least 6 runs"):
        fit_loss_surface(n[:5], d[:5], loss[:5])
    with pytest.raises(FitError, match="loss must be finite and positive"):
        fit_loss_surface(n, d, np.where(np.arange(len(n)) == 3, np.nan, loss))
    with pytest.raises(FitError, match="N must be finite and positive"):
        fit_loss_surface(-n, d, loss)
    with pytest.raises(FitError, match="all runs have one model size"):
        fit_loss_surface(np.full(8, 1e8), np.logspace(9, 11, 8), np.linspace(3, 2.5, 8))
    with pytest.raises(FitError, match="same tokens per parameter"):
        nn = np.logspace(7, 9, 8)
        fit_loss_surface(nn, 20 * nn, _law(nn, 20 * nn))
    with pytest.raises(FitError, match="three lists of one length"):
        fit_loss_surface(n, d[:-1], loss)
