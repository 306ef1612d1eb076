"""The mixture report step: what a mixture will actually sample, written before anyone trains on it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import fsspec

from marin.data.loader import MixtureLoader
from marin.data.mixture import MixtureConfig, MixtureError
from marin.data.order import WITH_REPLACEMENT, coverage, domain_coverage, format_coverage
from marin.execution.versioning import input_field


@dataclass(frozen=True)
class MixtureReportConfig:
    """Write what a mixture will actually sample (``mixture_report.json``) before anyone trains on it."""

    mixture: MixtureConfig
    output_path: str = input_field()
    total_tokens: int | None = None
    """Planned training tokens; with it the report shows expected epochs per source."""
    total_steps: int | None = None
    """The run's steps; needed when stages start at fractions of the run."""


def mixture_report(config: MixtureReportConfig) -> None:
    """Executor step: effective shares per source and domain for every stage, held-out sizes, epochs, and
    (given ``total_tokens``) the data coverage of the run: per source and per domain the epochs read,
    the share of training tokens seen and seen more than once, and a warning past 4 epochs."""
    loader = MixtureLoader(config.mixture, total_steps=config.total_steps)
    stage_steps = loader.stage_starts()
    fractions = [0.0] + [st.start_fraction for st in loader._stages]
    report = {
        "stores": list(config.mixture.stores),
        "tokenizer_identity": loader.tokenizer_identity,
        "vocab_size": loader.vocab_size,
        "total_steps": config.total_steps,
        "stages": [
            {"start_step": s, "start_fraction": f, "domain_shares": loader.effective_domain_shares(s),
             "sources": loader.describe(config.total_tokens, s)}
            for s, f in zip(stage_steps, fractions)
        ],
    }
    if config.total_tokens is not None:
        report["coverage"] = run_coverage(loader, config.total_tokens, config.total_steps)
    with fsspec.open(f"{config.output_path.rstrip('/')}/mixture_report.json", "w") as f:
        json.dump(report, f, indent=1)


def run_coverage(loader: MixtureLoader, total_tokens: int, total_steps: int | None = None) -> dict:
    """What a run of ``total_tokens`` reads of each source and domain (:func:`marin.data.order.coverage`):
    each stage's shares over its part of the run (the stages' steps need ``total_steps`` when there are
    several; within a step the order's row counts follow the shares to one row)."""
    starts = loader.stage_starts()
    if len(starts) > 1 and total_steps is None:
        raise MixtureError("coverage of a mixture with stages needs the run's total_steps")
    horizon = total_steps or 1
    bounds = [min(a, horizon) for a in starts] + [horizon]
    drawn = {n: 0.0 for n in loader.source_names}
    for a, b in zip(bounds[:-1], bounds[1:]):
        for n, share in loader.effective_shares(a).items():
            drawn[n] += share * total_tokens * (b - a) / horizon
    order = loader.order
    sources = coverage({n: int(t) for n, t in zip(loader.source_names, loader.train_tokens)}, drawn, order)
    domains = domain_coverage(sources, order)
    return {"order": order, "total_tokens": int(total_tokens), "sources": sources, "domains": domains,
            "summary": format_coverage(domains, order, f"{len(domains)} domains, {len(sources)} sources"),
            "warnings": [f"{r['source']} is read {r['epochs']:.1f} epochs" for r in sources if r["warning"]],
            "legacy": order == WITH_REPLACEMENT}
