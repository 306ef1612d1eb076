"""IsoFLOP parabolas, the frontier's exponents, the compute-optimal rung, and the fit step, on runs
whose losses follow a known surface (no training needed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from marin.models.config import count_params, get_preset
from marin.scaling.fit import FitError, fit_loss_surface
from marin.scaling.isoflop import (
    IsoFlopFitConfig,
    IsoFlopRun,
    RecipeSpace,
    choose_law,
    fit_parabolas,
    frontier,
    isoflop_fit_step,
    predict_optimal_config,
)
from marin.scaling.recipe import RunShape, run_flops, rung_model

E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28


def _law(n, d):
    return E + A / n ** ALPHA + B / d ** BETA


def _grid(budgets=(1e18, 1e19, 1e20), sizes=5, noise=0.0, seed=0):
    n = np.concatenate([np.sqrt(c / 120) * np.logspace(-0.6, 0.6, sizes) for c in budgets])
    c = np.repeat(budgets, sizes)
    d = c / (6 * n)
    rng = np.random.default_rng(seed)
    return c, n, d, _law(n, d) * np.exp(noise * rng.standard_normal(len(n)))


def test_parabola_minimum_and_frontier_exponents_match_the_surface():
    c, n, d, loss = _grid(budgets=(1e18, 1e19, 1e20, 1e21), sizes=7)
    parabolas = fit_parabolas(c, n, d, loss)
    for p in parabolas:
        # the true optimum of the law along C = 6 N D, by brute force
        nn = np.sqrt(p.budget / 120) * np.logspace(-0.6, 0.6, 20001)
        truth = nn[np.argmin(_law(nn, p.budget / (6 * nn)))]
        assert math.log(p.n_opt / truth) == pytest.approx(0, abs=0.1)  # a parabola only approximates the valley
        assert p.d_opt * p.n_opt * 6 == pytest.approx(p.budget, rel=1e-6) and "inside" in p.why
    f = frontier(parabolas)
    assert f["a"] == pytest.approx(BETA / (ALPHA + BETA), abs=0.03)
    assert f["a_plus_b"] == pytest.approx(1.0, abs=1e-6)  # exact under C = 6 N D


def test_exponents_agree_with_the_surface_within_their_uncertainty():
    from marin.scaling.isoflop import compare_exponents

    c, n, d, loss = _grid(budgets=(1e18, 1e19, 1e20, 1e21), sizes=5, noise=0.003)
    f = frontier(fit_parabolas(c, n, d, loss))
    s = fit_loss_surface(n, d, loss, n_boot=40)
    cmp = compare_exponents(f, s)
    one = cmp["beta_over_alpha_plus_beta"]
    assert one["disagree"] is False and np.isfinite(one["combined_std"]) and f["a_std"] > 0
    # a frontier pushed off by 0.2 in its exponent is flagged
    assert compare_exponents({**f, "a": f["a"] + 0.2, "a_std": 0.01}, s)["beta_over_alpha_plus_beta"]["disagree"]


def test_bad_budgets_are_a_clear_error():
    c, n, d, loss = _grid(sizes=4)
    with pytest.raises(FitError, match=r"budget 1e\+18 has 2 model size\(s\); a parabola in log N needs at least 3"):
        keep = ~((c == 1e18) & (n > np.median(n[c == 1e18])))
        fit_parabolas(c[keep], n[keep], d[keep], loss[keep])
    with pytest.raises(FitError, match="at least 2 budgets"):
        m = c == 1e19
        fit_parabolas(c[m], n[m], d[m], loss[m])
    with pytest.raises(FitError, match="opens downward"):
        fit_parabolas(c, n, d, np.where(c == 1e20, 5.0 - 0.01 * (np.log(n) - 20) ** 2, loss))
    with pytest.raises(FitError, match="loss must be finite and positive"):
        fit_parabolas(c, n, d, np.where(np.arange(len(c)) == 2, -1.0, loss))


def test_a_minimum_outside_the_sizes_tried_says_so():
    c, n, d, loss = _grid(sizes=5)
    m = c == 1e20
    n[m] = np.sqrt(1e20 / 120) * np.logspace(-1.8, -0.9, 5)  # every size of one budget far below its optimum
    d[m] = 1e20 / (6 * n[m])
    loss[m] = _law(n[m], d[m])
    ps = fit_parabolas(c, n, d, loss)
    assert [("outside the sizes tried" in p.why) for p in ps] == [False, False, True]


def test_the_law_contest_runs_on_the_budgets_below_the_largest():
    c, n, d, loss = _grid(sizes=4, noise=0.002)
    out = choose_law(c, n, d, loss)
    assert out["law"] in ("surface", "pure") and out["scores"]["saturating"] is None
    assert "saturating: 2 budget(s) left" in out["why"]


TARGET = get_preset("tiny", n_experts=8, top_k=2, transport="local", max_seq_len=128, head_dim=8, n_heads=8,
                    n_kv_heads=4)
SHAPE = RunShape(seq_len_phases=((0.0, 64),), warmup_fraction=0.05)
RECIPE = RecipeSpace(target=TARGET, shape=SHAPE, batch_sequences=64, widths=tuple(range(16, 129, 8)),
                     depths=tuple((w, 2) for w in range(16, 129, 8)))


def test_predict_optimal_config_picks_the_recipes_best_width():
    c, n, d, loss = _grid(sizes=5)
    s = fit_loss_surface(n, d, loss, n_boot=0)
    # rescale the law's units so the optimum falls among the tiny recipe's widths
    best = predict_optimal_config(s, 1e12, RECIPE)
    preds = dict(best.candidates)
    assert best.rung.model.d_model == min(preds, key=preds.get) and best.predicted == min(preds.values())
    assert best.low <= best.predicted <= best.high
    assert best.rung.flops == pytest.approx(1e12, rel=0.01) and best.n == count_params(best.rung.model)["active_params"]
    assert best.rung.model.n_heads == best.rung.model.d_model // 8  # the recipe's ratios are kept
    with pytest.raises(FitError, match="no width"):
        predict_optimal_config(s, 1e3, RECIPE)


def _write_run(root, name, model, steps, loss, bpb, task=None):
    d = root / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": loss + 0.5 * (steps - s) / steps})
                                               for s in range(1, steps + 1)) + "\n")
    e = root / f"{name}-eval"
    e.mkdir()
    (e / "eval.json").write_text(json.dumps({"macro_bpb": bpb, **({"tasks": task} if task else {})}))
    return str(d), str(e)


def test_the_step_writes_isoflop_json_plots_and_checks_a_validation_run(tmp_path):
    """Runs of the tiny recipe whose final loss follows a surface in (active params, tokens)."""
    def law(nn, dd):
        return 1.2 + 60 / nn ** 0.3 + 300 / dd ** 0.3

    def acc_of(tl):
        return 0.25 + 0.75 / (1 + math.exp(4 * (tl - 1.5)))

    runs = []
    for budget, widths in ((1e11, (16, 24, 32, 48)), (2.5e11, (16, 24, 32, 48)), (6e11, (24, 32, 48, 64))):
        for w in widths:
            rung = RECIPE.rung(w, budget)
            nn, dd = count_params(rung.model)["active_params"], rung.tokens
            tl = 0.6 * law(nn, dd)
            paths = _write_run(tmp_path, f"b{budget:g}-d{w}", rung.model, rung.train_steps, law(nn, dd),
                               0.8 * law(nn, dd), {"k40": {"acc": acc_of(tl), "gold_bpb": tl, "chance": 0.25}})
            runs.append(IsoFlopRun(f"b{budget:g}-d{w}", budget, rung.model, rung.train_steps, rung.tokens_per_step,
                                   SHAPE.seq_len_phases, *paths))
    vr = RECIPE.rung(40, 1.2e12)
    vn, vd = count_params(vr.model)["active_params"], vr.tokens
    vpaths = _write_run(tmp_path, "val", vr.model, vr.train_steps, law(vn, vd), 0.8 * law(vn, vd),
                        {"k40": {"acc": acc_of(0.6 * law(vn, vd)), "gold_bpb": 0.6 * law(vn, vd), "chance": 0.25}})
    val = IsoFlopRun("val", 1.2e12, vr.model, vr.train_steps, vr.tokens_per_step, SHAPE.seq_len_phases, *vpaths)
    out = tmp_path / "fit"
    out.mkdir()
    res = isoflop_fit_step(IsoFlopFitConfig(runs=tuple(runs), output_path=str(out), recipe=RECIPE,
                                            next_budget=1.2e12, validation=val, n_boot=20,
                                            max_validation_rel_error=0.02))
    doc = json.loads((out / "isoflop.json").read_text())
    assert doc["metric"] == "bpb" and res["validation_rel_error"] == doc["validation_rel_error"]
    assert len(doc["metrics"]["bpb"]["parabolas"]) == 3 and set(doc["metrics"]) == {"loss", "bpb"}
    assert doc["metrics"]["bpb"]["selection"]["law"] in ("surface", "pure")
    v = doc["validation"]["metrics"]["bpb"]
    assert abs(v["rel_error"]) < 0.02 and v["inside"] and v["low"] < v["predicted"] < v["high"]
    t = doc["validation"]["tasks"]["k40"]
    assert abs(t["acc_error_points"]) < 3 and t["acc_low"] <= t["acc"] <= t["acc_high"]
    assert doc["next"]["config"]["width"] in RECIPE.widths and doc["next"]["config"]["flops"] == pytest.approx(
        1.2e12, rel=0.01)
    assert "k40" in doc["next"]["tasks"] and "surface_slope_under_flops_model" in doc["metrics"]["bpb"]["exponents"]
    assert sorted(doc["plots"]) == ["isoflop.png", "surface.png"]
    assert all((out / p).read_bytes()[:4] == b"\x89PNG" for p in doc["plots"])
    assert run_flops(vr.model, vr.train_steps, vr.tokens_per_step, SHAPE.seq_len_phases) == pytest.approx(
        doc["validation"]["flops"])
    assert rung_model(TARGET, 40, 2) == vr.model and "NaN" not in (out / "isoflop.json").read_text()
