"""The data track as executor steps: miniature -> tokenizer -> tokenize -> mixture, and the K40 dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marin.execution import ExecutorMainConfig, executor_main

pytestmark = pytest.mark.usefixtures("ray_local")


def test_pipeline_through_executor_main(tmp_path):
    from experiments.defaults import (
        default_k40_miniature,
        default_mixture,
        default_mixture_report,
        default_tokenize,
        default_tokenizer,
    )

    corpus = default_k40_miniature("data/k40_mini", total_bytes=80_000, seed=2, domains=("council", "law"))
    tok = default_tokenizer("tokenizers/mini_bpe", corpus, vocab_size=700)
    store = default_tokenize("tokenized/k40_mini", corpus, tok)

    def probe(weights):  # stands in for a training step: it embeds the MixtureConfig the same way
        return default_mixture_report("mixture/mini", default_mixture([store], domain_weights=weights, seed=4))

    prefix = str(tmp_path / "prefix")
    p1 = probe({"council": 3, "law": 1})
    res = executor_main(ExecutorMainConfig(prefix=prefix, progress=False), steps=[p1], description="data track")
    assert sorted(res.outcome.values()) == ["succeeded"] * 4, res.errors
    store_path = res.plan.planned(store).output_path
    assert Path(store_path, "manifest.json").exists()
    out = json.loads(Path(res.plan.planned(p1).output_path, "mixture_report.json").read_text())
    assert out["stores"] == [store_path]  # the placeholder inside the nested MixtureConfig was resolved
    assert out["vocab_size"] <= 700
    assert out["stages"][0]["domain_shares"] == pytest.approx({"council": 0.75, "law": 0.25})

    # a new mixture is a new probe step over the same (cached) store: nothing is re-tokenized
    p2 = probe({"council": 1, "law": 1})
    res2 = executor_main(ExecutorMainConfig(prefix=prefix, progress=False), steps=[p2])
    assert res2.plan.planned(store).output_path == store_path
    assert res2.plan.planned(p2).output_path != res.plan.planned(p1).output_path
    assert sorted(res2.outcome.values()) == ["cached"] * 3 + ["succeeded"]


def test_harrier_k40_dry_run_needs_no_network(tmp_path, offline_k40):
    import importlib

    import experiments.harrier_k40 as hk

    hk = importlib.reload(hk)
    steps = list(hk.tokenized.values())
    assert len(steps) == 40
    assert sorted(steps[0].config.input.sources.value) == [f"council/q{i}" for i in range(1, 6)]
    res = executor_main(ExecutorMainConfig(prefix=str(tmp_path), dry_run=True, progress=False), steps=steps)
    # 40 tokenize steps, the tokenizer, the corpus-wide dedup and decontamination, the task it protects
    assert len(res.outcome) == 44 and set(res.outcome.values()) == {"dry_run"}
    assert hk.deduped.config.input.sources.value == hk.SOURCES and len(hk.SOURCES) == 200
    mix = hk.harrier_k40_mixture()
    assert len(mix.stores) == 40
