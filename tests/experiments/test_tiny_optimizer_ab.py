"""The tiny optimizer A/B's analysis (the training is the trainer's; its numbers are in docs/performance.md)."""

from __future__ import annotations

import pytest

from experiments.tiny_optimizer_ab import WIDTHS, compare, final_loss, optimizers, rungs
from marin.training.optimizers import AdamWConfig, MuonHConfig


def test_both_optimizers_train_each_rung_on_the_same_schedule_shape():
    for rung in rungs():
        opts = optimizers(rung)
        assert isinstance(opts["adamw"], AdamWConfig) and isinstance(opts["muonh"], MuonHConfig)
        assert opts["adamw"].warmup_steps == opts["muonh"].warmup_steps == rung.warmup_steps
    assert [r.model.d_model for r in rungs()] == list(WIDTHS)


def test_the_comparison_reads_a_known_multiplier_back():
    c = [1e10, 1e11, 1e12]
    result = compare({"adamw": [(x, 10.0 * x ** -0.15) for x in c],
                      "muonh": [(x, 10.0 * (1.8 * x) ** -0.15) for x in c]})  # MuonH: AdamW's loss at 1/1.8 compute
    assert [p["flops"] for p in result["compute_multiplier"]] == [*c, 1e13]
    for p in result["compute_multiplier"]:
        assert p["multiplier"] == pytest.approx(1.8, rel=1e-9)
    assert result["loss_at_equal_compute"][0]["adamw"] == pytest.approx(10.0 * 1e10 ** -0.15, rel=1e-9)


def test_the_final_loss_is_the_mean_of_the_last_tenth_with_its_standard_error():
    mean, se = final_loss([9.0] * 27 + [1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0) and se == pytest.approx(1.0 / 3 ** 0.5)
