"""The report's scaling sections: IsoFLOP parabolas, the loss surface's iso-loss contours with the
runs as points, and the predicted vs actual table of a validation run (loss, bpb, task accuracy)."""

from __future__ import annotations

import math
import re

import numpy as np

from marin.review.sections import isoflop_section, validation_table
from marin.scaling.isoflop import isoflop_document


def _doc():
    def law(n, d):
        return 1.2 + 60 / n ** 0.3 + 300 / d ** 0.3

    runs = []
    for c in (1e11, 2.5e11, 6e11):
        for n in np.sqrt(c / 60) * np.logspace(-0.5, 0.5, 4):
            d = c / (6 * n)
            tl = 0.6 * law(n, d)
            runs.append({"name": f"c{c:g}-{n:.0f}", "budget": c, "flops": c, "n": float(n), "d": float(d),
                         "loss": law(n, d), "bpb": 0.8 * law(n, d),
                         "tasks": {"k40": {"acc": 0.25 + 0.75 / (1 + math.exp(4 * (tl - 1.5))), "gold_bpb": tl,
                                           "chance": 0.25}}})
    vn, vd = math.sqrt(1.2e12 / 60), 1.2e12 / (6 * math.sqrt(1.2e12 / 60))
    val = {"name": "val", "budget": 1.2e12, "flops": 1.2e12, "n": vn, "d": vd, "loss": law(vn, vd),
           "bpb": 0.8 * law(vn, vd) * 1.01, "tasks": {"k40": {"acc": 0.5, "gold_bpb": 0.6 * law(vn, vd)}}}
    return isoflop_document(runs, validation=val, n_boot=10)


def test_isoflop_section_draws_parabolas_contours_and_the_validation_table():
    doc = _doc()
    html = isoflop_section(doc)
    assert html.count('class="plot"') == 2
    parabolas, contours = html.split('<svg class="plot"')[1:3]
    assert parabolas.count("<polyline") == 3 and parabolas.count("<circle") == 12 + 3 + 1  # runs, optima, validation
    assert contours.count("<polyline") >= 3 and contours.count("<circle") == 12 + 3 + 1
    assert "frontier: N_opt ∝ C^" in html and "law for predictions: <b>" in html
    table = html.split("predicted vs actual (validation)")[1]
    rows = re.findall(r"<tr><td>([^<]+)<td", table)
    assert rows == ["loss", "bpb", "k40 accuracy"]
    assert "points" in table and re.search(r"<td class=num>-?\d", table)
    # the bpb row: actual 1% above the law, so the error is about -1% and the band decides "inside"
    v = doc["validation"]["metrics"]["bpb"]
    assert f"{100 * v['rel_error']:.4g}" in table.replace("−", "-") or f"{100 * v['rel_error']:.3g}" in table


def test_validation_table_marks_a_miss_outside_the_band():
    out = validation_table({"name": "d96", "flops": 2e12, "metrics": {
        "bpb": {"predicted": 2.934, "low": 2.818, "high": 3.049, "actual": 2.758, "rel_error": 0.064, "inside": False}},
        "tasks": {}})
    assert "<b>no</b>" in out and "2.934" in out and "6.4%" in out and "d96" in out
