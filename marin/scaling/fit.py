"""Scaling-law fits over ladder rungs: pure functions of (compute, value) points.

The law is ``L(C) = E + A * C**-alpha`` (C: training FLOPs; E: the irreducible loss the fit
extrapolates to; A, alpha: how fast more compute buys loss). It is fitted by bounded nonlinear least
squares on the values themselves (``scipy.optimize.least_squares``, trust-region reflective), with C
divided by a reference compute (the geometric mean of the rungs' C) so the three parameters are of
comparable size. ``A`` is reported for C in FLOPs.

**When E is not identifiable** (fewer than four points, so the three-parameter fit has no degree of
freedom left to test it; or the best bounded fit puts E on a bound, i.e. the points do not bend
towards any floor within range) the fit falls back to a pure power law ``L = A * C**-alpha``
(E = 0), a straight line in log-log coordinates. ``form`` says which one was used and ``why``.

**Uncertainty** comes from a residual bootstrap: the fitted curve plus residuals resampled with
replacement (inflated by sqrt(n / (n - p)) for the p fitted parameters), refitted ``n_boot`` times
with the same form. Parameter standard deviations are the bootstrap's. A prediction's band adds
the bootstrap spread of the prediction and the scatter of the points around the curve (a new rung
scatters like the old ones). The band is the linearised prediction interval of nonlinear least
squares with Student's t: ``pred +/- t(0.975, n - p) * s * sqrt(1 + g (J^T J)^-1 g^T)`` with J the
Jacobian of the fitted values in the parameters, g the prediction's gradient and s the residual
standard deviation (n - p degrees of freedom). For the pure law (a straight line in log-log) this
is the exact prediction interval of linear regression, taken in log space; for the saturating law
it is the usual first-order interval. Student's t, not the normal 1.96, because with four or five
rungs the residual scatter itself is uncertain: the normal quantile under-covers badly there.

:func:`fit_loss_surface` fits the two-variable law ``L(N, D) = E + A / N**alpha + B / D**beta``
(Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", approach 3), and
:func:`select_law` is the rule that chooses between the laws before any validation run is seen.

R^2 is ``1 - SS_res / SS_tot`` on the values. Leave-one-out refits without the largest-C point and
predicts it: the relative error is what extrapolating one rung up would have cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Z_95 = 1.96


class FitError(ValueError):
    """Points a scaling law cannot be fitted to (too few, non-positive, non-finite)."""


@dataclasses.dataclass(frozen=True)
class PowerLawFit:
    """A fitted ``L(C) = E + A * C**-alpha`` (``form == "pure"``: E fixed at 0)."""

    form: str
    why: str
    E: float
    A: float
    alpha: float
    E_std: float
    A_std: float
    alpha_std: float
    r2: float
    resid_std: float
    n: int
    c_ref: float
    boot: np.ndarray = dataclasses.field(repr=False, compare=False)
    log_resid_std: float = float("nan")
    """Residual sd of log values around the fit (n - p degrees of freedom): the pure law's scale."""
    """Bootstrap parameters, shape [n_boot, 3] as (E, a, alpha) with a = A * c_ref**-alpha."""

    def predict(self, c: float | np.ndarray) -> float | np.ndarray:
        return _law(np.asarray(c, dtype=float) / self.c_ref, self.E, self.A * self.c_ref ** -self.alpha, self.alpha)

    x_fit: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    """The fitted points' compute over c_ref (the band's Jacobian is taken there)."""

    def band(self, c: float, level: float = 0.95) -> tuple[float, float]:
        """``(low, high)``: the ``level`` prediction interval for a new point at compute ``c`` (see
        the module docstring). The pure law's interval is computed in log space (where it was fitted)."""
        from scipy.stats import t as student_t  # scipy: the train extra, only when fitting

        mid = float(self.predict(c))
        k = 3 if self.form == "saturating" else 2
        dof = self.n - k
        if dof <= 0 or not len(self.x_fit):
            half = Z_95 * self.resid_std
            return mid - half, mid + half
        q = float(student_t.ppf(0.5 + level / 2, dof))
        x0 = float(c) / self.c_ref
        a = self.A * self.c_ref ** -self.alpha
        if self.form == "pure":
            # log y = log a - alpha log x: linear regression in (1, log x)
            X = np.stack([np.ones_like(self.x_fit), np.log(self.x_fit)], axis=1)
            g = np.array([1.0, math.log(x0)])
            s_log = _pure_log_resid_std(self)
            half = q * s_log * math.sqrt(1.0 + g @ np.linalg.pinv(X.T @ X) @ g)
            return mid * math.exp(-half), mid * math.exp(half)
        J = _sat_jacobian(self.x_fit, a, self.alpha)
        g = _sat_jacobian(np.array([x0]), a, self.alpha)[0]
        half = q * self.resid_std * math.sqrt(1.0 + g @ np.linalg.pinv(J.T @ J) @ g)
        return mid - half, mid + half

    def to_json(self) -> dict[str, Any]:
        return {"form": self.form, "why": self.why, "E": self.E, "A": self.A, "alpha": self.alpha,
                "E_std": self.E_std, "A_std": self.A_std, "alpha_std": self.alpha_std, "r2": self.r2,
                "resid_std": self.resid_std, "n": self.n, "c_ref": self.c_ref}


def within_band(low: float, value: float, high: float) -> bool:
    """``low <= value <= high`` up to the solvers' precision, 1e-6 relative (an exact fit has a band
    of zero width)."""
    tol = 1e-6 * max(abs(low), abs(high), abs(value), 1e-300)
    return bool(low - tol <= value <= high + tol)


def _law(x, E, a, alpha):
    return E + a * np.power(x, -alpha)


def _sat_jacobian(x: np.ndarray, a: float, alpha: float) -> np.ndarray:
    """d/d(E, a, alpha) of E + a x^-alpha, shape [len(x), 3]."""
    xp = np.power(x, -alpha)
    return np.stack([np.ones_like(x), xp, -a * xp * np.log(x)], axis=1)


def _pure_log_resid_std(f: PowerLawFit) -> float:
    """Residual sd of the pure law in log space (what its straight-line fit minimised)."""
    return float(f.log_resid_std)


def _fit_saturating(x: np.ndarray, y: np.ndarray, start: np.ndarray | None = None) -> tuple[np.ndarray, float, bool]:
    """Best bounded (E, a, alpha) from a few starts (or from ``start`` alone, for bootstrap refits
    near a known optimum); returns (params, SS_res, E on a bound)."""
    from scipy.optimize import least_squares  # scipy: the train extra, only when fitting

    e_hi = float(np.min(y)) * (1 - 1e-6)
    starts = []
    for frac in (0.0, 0.3, 0.6, 0.8, 0.9, 0.97) if start is None else ():
        e0 = frac * e_hi
        slope, icpt = np.polyfit(np.log(x), np.log(np.maximum(y - e0, 1e-12)), 1)
        starts.append(np.array([e0, math.exp(icpt), min(max(-slope, 1e-3), 4.9)]))
    if start is not None:
        starts.append(np.array(start, dtype=float))
    best = None
    for p0 in starts:
        p0 = np.clip(p0, [0.0, 1e-12, 1e-4], [e_hi * (1 - 1e-9), np.inf, 5.0])
        try:
            res = least_squares(lambda p: _law(x, *p) - y, p0, bounds=([0.0, 0.0, 1e-4], [e_hi, np.inf, 5.0]),
                                method="trf", x_scale="jac", max_nfev=2000)
        except ValueError:
            continue
        ss = float(np.sum(res.fun ** 2))
        if best is None or ss < best[1]:
            best = (res.x, ss)
    if best is None:
        raise FitError("the saturating fit did not converge from any start")
    p = best[0]
    on_bound = p[0] <= 1e-6 * e_hi or p[0] >= e_hi * (1 - 1e-3)
    return p, best[1], on_bound


def _fit_pure(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares in log-log: log y = log a - alpha log x."""
    slope, icpt = np.polyfit(np.log(x), np.log(y), 1)
    return np.array([0.0, math.exp(icpt), -slope])


def _check_points(c: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    c, y = np.asarray(c, dtype=float), np.asarray(y, dtype=float)
    if c.shape != y.shape or c.ndim != 1:
        raise FitError(f"compute and values must be two lists of one length, got {c.shape} and {y.shape}")
    if len(c) < 2:
        raise FitError(f"a scaling fit needs at least 2 points, got {len(c)}")
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(y))) or np.any(c <= 0) or np.any(y <= 0):
        raise FitError(f"compute and values must be finite and positive, got C={c.tolist()} L={y.tolist()}")
    if len(set(c.tolist())) < 2:
        raise FitError("all points have the same compute; a scaling fit needs at least two budgets")
    return c, y


def fit_power_law(c: Sequence[float], y: Sequence[float], *, n_boot: int = 400, seed: int = 0,
                  form: str | None = None) -> PowerLawFit:
    """Fit ``y = E + A * c**-alpha`` (or the pure power law when E is not identifiable; ``form``
    "saturating" or "pure" forces one). See the module docstring for the method."""
    c, y = _check_points(c, y)
    n = len(c)
    c_ref = float(np.exp(np.mean(np.log(c))))
    x = c / c_ref
    why = ""
    if form is None:
        if n < 4:
            form, why = "pure", f"{n} points leave no degree of freedom to identify E"
        else:
            p, _, on_bound = _fit_saturating(x, y)
            if on_bound:
                form, why = "pure", f"the bounded fit put E on a bound (E={p[0]:.4g}); no floor within range"
            else:
                form, why = "saturating", "E identified inside its bounds"
    elif form not in ("saturating", "pure"):
        raise FitError(f"form must be 'saturating' or 'pure', got {form!r}")
    else:
        why = "form given"

    p = _fit_saturating(x, y)[0] if form == "saturating" else _fit_pure(x, y)

    def fit(yy: np.ndarray) -> np.ndarray:
        return _fit_saturating(x, yy, start=p)[0] if form == "saturating" else _fit_pure(x, yy)

    fitted = _law(x, *p)
    resid = y - fitted
    k = 3 if form == "saturating" else 2
    dof = n - k
    ss_res = float(np.sum(resid ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    resid_std = math.sqrt(ss_res / dof) if dof > 0 else math.sqrt(ss_res / n)
    rng = np.random.default_rng(seed)
    boot = []
    scale = math.sqrt(n / dof) if dof > 0 else 1.0
    centred = (resid - resid.mean()) * scale
    for _ in range(n_boot):
        yy = fitted + rng.choice(centred, size=n, replace=True)
        if np.any(yy <= 0):
            continue
        try:
            boot.append(fit(yy))
        except (FitError, ValueError, np.linalg.LinAlgError):
            continue
    boot_arr = np.array(boot) if boot else np.zeros((0, 3))
    a_flops = boot_arr[:, 1] * c_ref ** boot_arr[:, 2] if len(boot_arr) else np.array([])
    def sd(v: np.ndarray) -> float:
        return float(np.std(v)) if len(v) > 1 else float("nan")

    log_resid = np.log(y) - np.log(np.maximum(fitted, 1e-300))
    log_ss = float(np.sum(log_resid ** 2))
    log_resid_std = math.sqrt(log_ss / dof) if dof > 0 else math.sqrt(log_ss / n)
    return PowerLawFit(
        form=form, why=why, E=float(p[0]), A=float(p[1] * c_ref ** p[2]), alpha=float(p[2]),
        E_std=sd(boot_arr[:, 0]) if len(boot_arr) else float("nan"), A_std=sd(a_flops),
        alpha_std=sd(boot_arr[:, 2]) if len(boot_arr) else float("nan"),
        r2=r2, resid_std=resid_std, n=n, c_ref=c_ref, boot=boot_arr, log_resid_std=log_resid_std, x_fit=x,
    )


def leave_largest_out(c: Sequence[float], y: Sequence[float], **kw) -> dict[str, float]:
    """Refit without the largest-compute point and predict it: ``{"predicted", "actual", "rel_error"}``
    (rel_error = (predicted - actual) / actual)."""
    c, y = _check_points(c, y)
    if len(c) < 3:
        raise FitError("leave-one-out needs at least 3 points (2 to fit, 1 to predict)")
    i = int(np.argmax(c))
    keep = np.arange(len(c)) != i
    f = fit_power_law(c[keep], y[keep], **kw)
    pred = float(f.predict(c[i]))
    return {"predicted": pred, "actual": float(y[i]), "rel_error": (pred - float(y[i])) / float(y[i]),
            "form": f.form}


def linear_trend(log_c: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Straight-line trend of ``y`` against log10(C): slope per decade of compute, intercept and the
    residual sd (a single point gives slope 0). Used for grad-norm peak position and drop fractions,
    which have no physical law to fit, only a drift to extrapolate."""
    x, yy = np.asarray(log_c, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(yy)
    x, yy = x[ok], yy[ok]
    if len(x) == 0:
        return {"slope_per_decade": float("nan"), "intercept": float("nan"), "resid_std": float("nan"), "n": 0}
    if len(x) == 1 or np.ptp(x) == 0:
        return {"slope_per_decade": 0.0, "intercept": float(np.mean(yy)), "resid_std": float(np.std(yy)), "n": len(x)}
    slope, icpt = np.polyfit(x, yy, 1)
    resid = yy - (slope * x + icpt)
    dof = max(1, len(x) - 2)
    return {"slope_per_decade": float(slope), "intercept": float(icpt),
            "resid_std": float(math.sqrt(np.sum(resid ** 2) / dof)), "n": len(x)}


def trend_predict(trend: dict[str, float], log_c: float) -> float:
    return trend["slope_per_decade"] * log_c + trend["intercept"]


# ----------------------------------------------------------------------------------------------
# the loss surface L(N, D) = E + A / N**alpha + B / D**beta (Chinchilla approach 3)

SURFACE_PARAMS = ("a", "b", "e", "alpha", "beta")
"""The optimiser's parameters: A = exp(a), B = exp(b), E = exp(e)."""
SURFACE_BOUNDS = ((-20.0, 80.0), (-20.0, 80.0), (-10.0, None), (0.0, 3.0), (0.0, 3.0))
"""Bounds that keep the fit finite; the upper bound of e is log(min L) (E below every loss)."""
SURFACE_GRID = {"a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0), "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
                "e": (-1.0, -0.5, 0.0, 0.5, 1.0), "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
                "beta": (0.0, 0.5, 1.0, 1.5, 2.0)}
"""Hoffmann et al.'s grid of initial values."""
SURFACE_STARTS = 6
"""L-BFGS runs from this many of the best grid points (the rest of the grid is scored, not optimised)."""


def _lse_terms(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    a, b, e, alpha, beta = theta
    return np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)], axis=-1)


def _surface_log_pred(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    from scipy.special import logsumexp  # scipy: the train extra, only when fitting

    return logsumexp(_lse_terms(theta, log_n, log_d), axis=-1)


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r ** 2, delta * (a - 0.5 * delta))


def _surface_objective(theta, log_n, log_d, log_l, delta):
    """Huber loss of the log-sum-exp prediction against log L, and its gradient."""
    from scipy.special import softmax  # scipy: the train extra, only when fitting

    t = _lse_terms(theta, log_n, log_d)
    w = softmax(t, axis=-1)
    r = np.log(np.sum(np.exp(t - t.max(-1, keepdims=True)), -1)) + t.max(-1) - log_l
    h = np.clip(r, -delta, delta)
    grad = np.array([np.sum(h * w[:, 0]), np.sum(h * w[:, 1]), np.sum(h * w[:, 2]),
                     np.sum(h * w[:, 0] * -log_n), np.sum(h * w[:, 1] * -log_d)])
    return float(np.sum(_huber(r, delta))), grad


def _surface_minimise(log_n, log_d, log_l, delta, starts) -> np.ndarray:
    from scipy.optimize import minimize  # scipy: the train extra, only when fitting

    bounds = list(SURFACE_BOUNDS)
    bounds[2] = (SURFACE_BOUNDS[2][0], float(np.min(log_l)) - 1e-9)
    best = None
    for p0 in starts:
        p0 = np.array([min(max(v, lo if lo is not None else -np.inf), hi if hi is not None else np.inf)
                       for v, (lo, hi) in zip(p0, bounds)])
        res = minimize(_surface_objective, p0, args=(log_n, log_d, log_l, delta), jac=True, method="L-BFGS-B",
                       bounds=bounds, options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
        if np.all(np.isfinite(res.x)) and (best is None or res.fun < best[1]):
            best = (res.x, float(res.fun))
    if best is None:
        raise FitError("the loss-surface fit did not converge from any start")
    return best[0]


def _surface_grid_starts(log_n, log_d, log_l, delta, k: int = SURFACE_STARTS) -> list[np.ndarray]:
    """The ``k`` best points of Hoffmann et al.'s grid by the objective (scored all at once)."""
    grid = np.array(np.meshgrid(*[SURFACE_GRID[p] for p in SURFACE_PARAMS], indexing="ij")).reshape(5, -1).T
    a, b, e, al, be = (grid[:, i:i + 1] for i in range(5))
    t1, t2 = a - al * log_n, b - be * log_d
    m = np.maximum(np.maximum(t1, t2), e)
    r = m + np.log(np.exp(t1 - m) + np.exp(t2 - m) + np.exp(e - m)) - log_l
    score = _huber(r, delta).sum(-1)
    return [grid[i] for i in np.argsort(score)[:k]]


@dataclasses.dataclass(frozen=True)
class LossSurfaceFit:
    """A fitted ``L(N, D) = E + A / N**alpha + B / D**beta``.

    N is the model's parameter count and D its training tokens, in the units the fit was given (the
    ladder uses active non-embedding parameters: see docs/scaling.md). ``*_std`` are bootstrap
    standard deviations; ``why`` says what to distrust (a parameter on a bound, a flat direction)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    E_std: float
    A_std: float
    B_std: float
    alpha_std: float
    beta_std: float
    exponent_n: float
    """beta / (alpha + beta): N_opt grows as C**exponent_n under C proportional to N D."""
    exponent_n_std: float
    why: str
    n: int
    huber_delta: float
    resid_std: float
    """Residual sd of log L (n - 5 degrees of freedom)."""
    r2: float
    theta: np.ndarray = dataclasses.field(repr=False, compare=False)
    log_n_fit: np.ndarray = dataclasses.field(repr=False, compare=False)
    log_d_fit: np.ndarray = dataclasses.field(repr=False, compare=False)
    boot: np.ndarray = dataclasses.field(repr=False, compare=False)
    """Bootstrap optimiser parameters, shape [n_boot, 5] (a, b, e, alpha, beta)."""

    def predict(self, n: float | np.ndarray, d: float | np.ndarray) -> float | np.ndarray:
        ln, ld = np.log(np.asarray(n, dtype=float)), np.log(np.asarray(d, dtype=float))
        out = np.exp(_surface_log_pred(self.theta, np.atleast_1d(ln), np.atleast_1d(ld)))
        return float(out[0]) if np.ndim(n) == 0 and np.ndim(d) == 0 else out.reshape(np.broadcast(ln, ld).shape)

    def band(self, n: float, d: float, level: float = 0.95) -> tuple[float, float]:
        """The ``level`` prediction interval of a new run at (n, d): linearised, in log L, with
        Student's t on n - 5 degrees of freedom (as :meth:`PowerLawFit.band`)."""
        from scipy.stats import t as student_t  # scipy: the train extra, only when fitting

        mid = self.predict(n, d)
        dof = self.n - 5
        J = _surface_jacobian(self.theta, self.log_n_fit, self.log_d_fit)
        g = _surface_jacobian(self.theta, np.array([math.log(n)]), np.array([math.log(d)]))[0]
        q = float(student_t.ppf(0.5 + level / 2, dof)) if dof > 0 else Z_95
        half = q * self.resid_std * math.sqrt(1.0 + float(g @ np.linalg.pinv(J.T @ J) @ g))
        return mid * math.exp(-half), mid * math.exp(half)

    def optimal_allocation(self, flops: float, flops_per_token=None) -> tuple[float, float]:
        """``(n_opt, d_opt)`` minimising L(N, D) at training compute ``flops``.

        The FLOPs model is ``C = flops_per_token(N) * D``; by default ``6 N`` (the dense
        approximation, closed form ``N_opt = G (C/6)**(beta/(alpha+beta))`` with
        ``G = (alpha A / (beta B))**(1/(alpha+beta))``). For MoE rungs pass the project's FLOPs per
        token as a function of the active parameter count N (it adds the output head and attention,
        which dominate at small widths); the optimum is then found numerically over log N."""
        if not (flops > 0 and math.isfinite(flops)):
            raise FitError(f"compute must be finite and positive, got {flops}")
        if flops_per_token is None:
            if self.alpha <= 0 or self.beta <= 0:
                raise FitError(f"no compute-optimal allocation: alpha={self.alpha:.3g}, beta={self.beta:.3g} "
                               "(a zero exponent means loss does not fall with that resource)")
            g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
            n_opt = g * (flops / 6.0) ** (self.beta / (self.alpha + self.beta))
            return float(n_opt), float(flops / (6.0 * n_opt))
        from scipy.optimize import minimize_scalar  # scipy: the train extra, only when fitting

        def loss_at(log_n: float) -> float:
            n = math.exp(log_n)
            return float(self.predict(n, flops / flops_per_token(n)))

        lo, hi = float(np.min(self.log_n_fit)) - 4.0, float(np.max(self.log_n_fit)) + 8.0
        res = minimize_scalar(loss_at, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
        n_opt = math.exp(float(res.x))
        return n_opt, float(flops / flops_per_token(n_opt))

    def to_json(self) -> dict[str, Any]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "E_std": self.E_std, "A_std": self.A_std, "B_std": self.B_std, "alpha_std": self.alpha_std,
                "beta_std": self.beta_std, "exponent_n": self.exponent_n, "exponent_n_std": self.exponent_n_std,
                "why": self.why, "n": self.n, "huber_delta": self.huber_delta, "resid_std": self.resid_std,
                "r2": self.r2, "theta": [float(v) for v in self.theta],
                "log_n_fit": [float(v) for v in self.log_n_fit], "log_d_fit": [float(v) for v in self.log_d_fit]}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> LossSurfaceFit:
        """The fit as ``to_json`` wrote it (enough to predict, band and allocate; no bootstrap)."""
        return LossSurfaceFit(**{k: doc[k] for k in ("E", "A", "B", "alpha", "beta", "E_std", "A_std", "B_std",
                                                      "alpha_std", "beta_std", "exponent_n", "exponent_n_std",
                                                      "why", "n", "huber_delta", "resid_std", "r2")},
                              theta=np.array(doc["theta"]), log_n_fit=np.array(doc["log_n_fit"]),
                              log_d_fit=np.array(doc["log_d_fit"]), boot=np.zeros((0, 5)))


def _surface_jacobian(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """d log L / d(a, b, e, alpha, beta), shape [len(log_n), 5]."""
    from scipy.special import softmax  # scipy: the train extra, only when fitting

    w = softmax(_lse_terms(theta, log_n, log_d), axis=-1)
    return np.stack([w[:, 0], w[:, 1], w[:, 2], -w[:, 0] * log_n, -w[:, 1] * log_d], axis=1)


def _check_surface_points(n, d, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, d, loss = (np.asarray(v, dtype=float) for v in (n, d, loss))
    if not (n.shape == d.shape == loss.shape) or n.ndim != 1:
        raise FitError(f"N, D and loss must be three lists of one length, got {n.shape}, {d.shape}, {loss.shape}")
    if len(n) < 6:
        raise FitError(f"a loss surface has 5 parameters (E, A, B, alpha, beta); it needs at least 6 runs "
                       f"(one residual degree of freedom), got {len(n)}")
    for name, v in (("N", n), ("D", d), ("loss", loss)):
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            raise FitError(f"{name} must be finite and positive, got {v.tolist()}")
    if len(np.unique(n)) < 2:
        raise FitError(f"all runs have one model size (N={n[0]:.4g}); a loss surface needs runs at several sizes")
    if len(np.unique(d)) < 2:
        raise FitError(f"all runs have one token count (D={d[0]:.4g}); a loss surface needs several")
    X = np.stack([np.ones_like(n), np.log(n), np.log(d)], axis=1)
    if np.linalg.matrix_rank(X, tol=1e-8 * max(1.0, float(np.abs(X).max()))) < 3:
        raise FitError("every run has the same tokens per parameter (D proportional to N): N's and D's effects "
                       "cannot be told apart; add runs at other sizes for the same compute (an IsoFLOP grid)")
    return n, d, loss


def fit_loss_surface(n: Sequence[float], d: Sequence[float], loss: Sequence[float], *, huber_delta: float = 1e-3,
                     n_boot: int = 200, seed: int = 0) -> LossSurfaceFit:
    """Fit ``L(N, D) = E + A / N**alpha + B / D**beta`` as Hoffmann et al. (2022) approach 3 do.

    The prediction is written as a log-sum-exp, ``log L = LSE(a - alpha log N, b - beta log D, e)``
    (A = e^a, B = e^b, E = e^e), and the Huber loss (``huber_delta``, 1e-3 as in the paper) of
    ``LSE - log L`` is minimised with L-BFGS (``scipy.optimize.minimize``, L-BFGS-B within
    :data:`SURFACE_BOUNDS`) from the best points of the paper's grid of initial values. Standard
    errors come from a residual bootstrap in log L (residuals resampled with replacement, inflated by
    sqrt(n / (n - 5)), refitted ``n_boot`` times from the optimum). A parameter that ends on a bound
    is named in ``why``."""
    n_arr, d_arr, l_arr = _check_surface_points(n, d, loss)
    if not huber_delta > 0:
        raise FitError(f"huber_delta must be positive, got {huber_delta}")
    ln, ld, ll = np.log(n_arr), np.log(d_arr), np.log(l_arr)
    theta = _surface_minimise(ln, ld, ll, huber_delta, _surface_grid_starts(ln, ld, ll, huber_delta))
    e_hi = float(np.min(ll))
    notes = []
    bounds = list(SURFACE_BOUNDS)
    bounds[2] = (SURFACE_BOUNDS[2][0], e_hi)
    shown = {"a": ("A", math.exp), "b": ("B", math.exp), "e": ("E", math.exp), "alpha": ("alpha", float),
             "beta": ("beta", float)}
    for name, v, (lo, hi) in zip(SURFACE_PARAMS, theta, bounds):
        label, to = shown[name]
        if lo is not None and v <= lo + 1e-6:
            notes.append(f"{label} on its lower bound ({to(lo):.3g})" + (
                ": no floor within range (the points do not bend towards one)" if name == "e" else ""))
        if hi is not None and v >= hi - 1e-6 * max(1.0, abs(hi)):
            notes.append(f"{label} on its upper bound ({to(hi):.4g})" + (
                ": the floor sits at the smallest loss" if name == "e" else ""))
    fitted = _surface_log_pred(theta, ln, ld)
    resid = ll - fitted
    dof = len(ll) - 5
    resid_std = math.sqrt(float(np.sum(resid ** 2)) / dof)
    ss_tot = float(np.sum((l_arr - l_arr.mean()) ** 2))
    r2 = 1.0 - float(np.sum((l_arr - np.exp(fitted)) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    rng = np.random.default_rng(seed)
    centred = (resid - resid.mean()) * math.sqrt(len(ll) / dof)
    boot = []
    for _ in range(n_boot):
        yy = fitted + rng.choice(centred, size=len(ll), replace=True)
        try:
            boot.append(_surface_minimise(ln, ld, yy, huber_delta, [theta]))
        except (FitError, ValueError, np.linalg.LinAlgError):
            continue
    boot_arr = np.array(boot) if boot else np.zeros((0, 5))

    def sd(v: np.ndarray) -> float:
        return float(np.std(v)) if len(v) > 1 else float("nan")

    al, be = float(theta[3]), float(theta[4])
    expo = be / (al + be) if al + be > 0 else float("nan")
    with np.errstate(invalid="ignore", divide="ignore"):
        boot_expo = boot_arr[:, 4] / (boot_arr[:, 3] + boot_arr[:, 4]) if len(boot_arr) else np.zeros(0)
    if len(boot_arr) > 1:
        spread = np.std(boot_arr[:, 3:5], axis=0)
        if np.any(spread > 1.0):
            notes.append(f"exponents poorly determined (bootstrap sd alpha {spread[0]:.2g}, beta {spread[1]:.2g})")
    return LossSurfaceFit(
        E=math.exp(theta[2]), A=math.exp(theta[0]), B=math.exp(theta[1]), alpha=al, beta=be,
        E_std=sd(np.exp(boot_arr[:, 2])) if len(boot_arr) else float("nan"),
        A_std=sd(np.exp(boot_arr[:, 0])) if len(boot_arr) else float("nan"),
        B_std=sd(np.exp(boot_arr[:, 1])) if len(boot_arr) else float("nan"),
        alpha_std=sd(boot_arr[:, 3]) if len(boot_arr) else float("nan"),
        beta_std=sd(boot_arr[:, 4]) if len(boot_arr) else float("nan"),
        exponent_n=expo, exponent_n_std=sd(boot_expo[np.isfinite(boot_expo)]),
        why="; ".join(notes) if notes else "every parameter inside its bounds",
        n=len(ll), huber_delta=huber_delta, resid_std=resid_std, r2=r2, theta=np.asarray(theta, dtype=float),
        log_n_fit=ln, log_d_fit=ld, boot=boot_arr,
    )


# ----------------------------------------------------------------------------------------------
# choosing a law before the validation run is seen

LAWS = ("saturating", "pure")


def select_law(c: Sequence[float], y: Sequence[float], *, n_boot: int = 400, seed: int = 0) -> dict[str, Any]:
    """The rule that chooses between the saturating and the pure law, fixed before any validation run:
    **leave-largest-out extrapolation error**. Each law is refitted without the largest-compute point
    and predicts it; the law with the smaller ``|log(predicted / actual)|`` wins (a tie, within 1e-4,
    goes to the pure law: fewer parameters). A law is eligible only where that test can be run and
    its parameters are identified both on all points and without the largest one: the saturating law
    needs at least 4 points *after* leaving one out (so 5 in all), with E inside its bounds both
    times. Returns ``{"form", "why", "scores"}``; with one eligible law it is chosen without a contest.
    """
    c_arr, y_arr = _check_points(c, y)
    scores: dict[str, float | None] = {}
    notes = []
    i = int(np.argmax(c_arr))
    keep = np.arange(len(c_arr)) != i
    for law in LAWS:
        if law == "saturating":
            if len(c_arr) < 5:
                scores[law] = None
                notes.append(f"saturating: {len(c_arr)} points leave fewer than 4 once the largest is held out "
                             "(E not identifiable there)")
                continue
            full = fit_power_law(c_arr, y_arr, n_boot=0)
            part = fit_power_law(c_arr[keep], y_arr[keep], n_boot=0)
            if full.form != "saturating" or part.form != "saturating":
                scores[law] = None
                notes.append(f"saturating: E on a bound ({full.why if full.form != 'saturating' else part.why})")
                continue
        elif len(c_arr) < 3:
            scores[law] = None
            notes.append(f"pure: {len(c_arr)} points leave none to hold out")
            continue
        part = fit_power_law(c_arr[keep], y_arr[keep], n_boot=0, form=law)
        scores[law] = abs(math.log(float(part.predict(c_arr[i])) / float(y_arr[i])))
    eligible = {k: v for k, v in scores.items() if v is not None}
    if not eligible:
        return {"form": "pure", "why": "no law can be tested by leaving one out; the pure law (fewest parameters)",
                "scores": scores}
    best = min(eligible, key=eligible.get)
    if "pure" in eligible and eligible["pure"] <= eligible[best] + 1e-4:
        best = "pure"
    why = ("leave-largest-out |log error|: " + ", ".join(f"{k} {v:.4f}" for k, v in eligible.items())
           + ("; " + "; ".join(notes) if notes else ""))
    return {"form": best, "why": why, "scores": scores}


def fit_selected_law(c: Sequence[float], y: Sequence[float], *, n_boot: int = 400, seed: int = 0) -> PowerLawFit:
    """:func:`fit_power_law` with the form :func:`select_law` chooses; ``why`` records the contest."""
    choice = select_law(c, y, n_boot=n_boot, seed=seed)
    f = fit_power_law(c, y, n_boot=n_boot, seed=seed, form=choice["form"])
    return dataclasses.replace(f, why=f"selected: {choice['why']}")


# ----------------------------------------------------------------------------------------------
# accuracy against task loss (the second step of Bhagia et al. 2024)


@dataclasses.dataclass(frozen=True)
class SigmoidFit:
    """``acc(L) = chance + (1 - chance) / (1 + exp(k (L - L0)))``: accuracy falls from 1 to chance
    as the task loss L (the correct answer's bits per byte) rises; k > 0 is the steepness, L0 the
    midpoint. The floor and ceiling are fixed (chance and 1), leaving two parameters, so a ladder
    of four or five rungs can fit it; Bhagia et al. fit both as well, with every intermediate
    checkpoint as a point."""

    chance: float
    k: float
    L0: float
    resid_std: float
    n: int
    why: str

    def predict(self, task_loss: float | np.ndarray) -> float | np.ndarray:
        z = np.clip(self.k * (np.asarray(task_loss, dtype=float) - self.L0), -60, 60)
        out = self.chance + (1.0 - self.chance) / (1.0 + np.exp(z))
        return float(out) if np.ndim(out) == 0 else out

    def to_json(self) -> dict[str, Any]:
        return {"chance": self.chance, "k": self.k, "L0": self.L0, "resid_std": self.resid_std, "n": self.n,
                "why": self.why}


def fit_accuracy_sigmoid(task_loss: Sequence[float], acc: Sequence[float], chance: float) -> SigmoidFit:
    """Least-squares fit of :class:`SigmoidFit` to (task loss, accuracy) points."""
    from scipy.optimize import least_squares  # scipy: the train extra, only when fitting

    x, y = np.asarray(task_loss, dtype=float), np.asarray(acc, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise FitError(f"task loss and accuracy must be two lists of one length, got {x.shape} and {y.shape}")
    if len(x) < 3:
        raise FitError(f"the accuracy sigmoid has 2 parameters; it needs at least 3 points, got {len(x)}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x <= 0) or np.any((y < 0) | (y > 1)):
        raise FitError(f"task losses must be finite and positive and accuracies in [0, 1], got {x.tolist()}, "
                       f"{y.tolist()}")
    if not 0 <= chance < 1:
        raise FitError(f"chance must be in [0, 1), got {chance}")
    if np.ptp(x) == 0:
        raise FitError("every point has the same task loss; the sigmoid needs a spread")

    def resid(p):
        return SigmoidFit(chance, p[0], p[1], 0.0, 0, "").predict(x) - y

    best = None
    for k0 in (1.0, 3.0, 10.0, 30.0):
        for l0 in np.quantile(x, (0.1, 0.5, 0.9)):
            r = least_squares(resid, [k0, l0], bounds=([1e-3, 0.0], [1e3, 10 * float(x.max())]))
            if best is None or r.cost < best.cost:
                best = r
    k, l0 = (float(v) for v in best.x)
    notes = []
    if k >= 1e3 * (1 - 1e-6):
        notes.append("k on its upper bound: accuracy jumps within the points' loss range (a step)")
    if not x.min() <= l0 <= x.max():
        notes.append(f"midpoint L0={l0:.3g} outside the points' task losses [{x.min():.3g}, {x.max():.3g}]: "
                     "an extrapolated bend")
    dof = len(x) - 2
    return SigmoidFit(chance, k, l0, math.sqrt(2 * best.cost / dof), len(x),
                      "; ".join(notes) if notes else "midpoint within the points")


def compute_to_reach(E: float, A: float, alpha: float, loss: float) -> float:
    """The compute at which the law ``E + A * c**-alpha`` reaches ``loss`` (NaN when it never does:
    ``loss`` at or below its floor ``E``)."""
    if not (loss > E and A > 0 and alpha > 0):
        return float("nan")
    return float((A / (loss - E)) ** (1.0 / alpha))


def compute_multiplier(base: PowerLawFit, other: PowerLawFit, c: float, *, level: float = 0.68) -> dict[str, float]:
    """How many times less compute ``other`` needs than ``base`` for ``base``'s loss at compute ``c``:
    ``c / c_other``, where ``other``'s law reaches ``base.predict(c)`` at ``c_other`` (above 1:
    ``other`` is cheaper; an optimizer comparison's "effective compute multiplier"). ``low`` and
    ``high`` bound the central ``level`` interval of the same ratio over the two fits' bootstrap laws
    paired at random (NaN with fewer than 10 usable pairs)."""
    mid = c / compute_to_reach(other.E, other.A, other.alpha, float(base.predict(c)))
    pairs = min(len(base.boot), len(other.boot))
    ratios = []
    for (eb, ab, alb), (eo, ao, alo) in zip(base.boot[:pairs], other.boot[:pairs]):
        y = eb + ab * (c / base.c_ref) ** -alb  # boot rows: (E, a, alpha), a = A * c_ref**-alpha
        reach = compute_to_reach(eo, ao * other.c_ref ** alo, alo, y)
        if np.isfinite(reach) and reach > 0:
            ratios.append(c / reach)
    if len(ratios) < 10:
        return {"multiplier": float(mid), "low": float("nan"), "high": float("nan"), "pairs": len(ratios)}
    low, high = np.quantile(ratios, [0.5 - level / 2, 0.5 + level / 2])
    return {"multiplier": float(mid), "low": float(low), "high": float(high), "pairs": len(ratios)}
