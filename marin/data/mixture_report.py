"""The mixture report step: what a mixture will actually sample, written before anyone trains on it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import fsspec

from marin.data.loader import MixtureLoader
from marin.data.mixture import MixtureConfig, MixtureError
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
    """Executor step: effective shares per source and domain for every stage, held-out sizes, epochs."""
    loader = MixtureLoader(config.mixture, total_steps=config.total_steps)
    if loader._stage_starts is None:
        raise MixtureError("the mixture has stages at fractions of the run: give the report total_steps")
    stage_steps = [0] + list(loader._stage_starts)
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
    with fsspec.open(f"{config.output_path.rstrip('/')}/mixture_report.json", "w") as f:
        json.dump(report, f, indent=1)
