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
scatters like the old ones): ``pred +/- z * sqrt(sd_boot**2 + s**2)``, z = 1.96 (about 95%).

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
    """Bootstrap parameters, shape [n_boot, 3] as (E, a, alpha) with a = A * c_ref**-alpha."""

    def predict(self, c: float | np.ndarray) -> float | np.ndarray:
        return _law(np.asarray(c, dtype=float) / self.c_ref, self.E, self.A * self.c_ref ** -self.alpha, self.alpha)

    def band(self, c: float, z: float = Z_95) -> tuple[float, float]:
        """``(low, high)`` for a new point at compute ``c`` (see module docstring)."""
        preds = (
            _law(c / self.c_ref, self.boot[:, 0], self.boot[:, 1], self.boot[:, 2]) if len(self.boot) else np.array([])
        )
        sd_boot = float(np.std(preds)) if preds.size > 1 else 0.0
        half = z * math.sqrt(sd_boot ** 2 + self.resid_std ** 2)
        mid = float(self.predict(c))
        return mid - half, mid + half

    def to_json(self) -> dict[str, Any]:
        return {"form": self.form, "why": self.why, "E": self.E, "A": self.A, "alpha": self.alpha,
                "E_std": self.E_std, "A_std": self.A_std, "alpha_std": self.alpha_std, "r2": self.r2,
                "resid_std": self.resid_std, "n": self.n, "c_ref": self.c_ref}


def _law(x, E, a, alpha):
    return E + a * np.power(x, -alpha)


def _fit_saturating(x: np.ndarray, y: np.ndarray, start: np.ndarray | None = None) -> tuple[np.ndarray, float, bool]:
    """Best bounded (E, a, alpha) from a few starts (or from ``start`` alone, for bootstrap refits
    near a known optimum); returns (params, SS_res, E on a bound)."""
    from scipy.optimize import least_squares

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

    return PowerLawFit(
        form=form, why=why, E=float(p[0]), A=float(p[1] * c_ref ** p[2]), alpha=float(p[2]),
        E_std=sd(boot_arr[:, 0]) if len(boot_arr) else float("nan"), A_std=sd(a_flops),
        alpha_std=sd(boot_arr[:, 2]) if len(boot_arr) else float("nan"),
        r2=r2, resid_std=resid_std, n=n, c_ref=c_ref, boot=boot_arr,
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
