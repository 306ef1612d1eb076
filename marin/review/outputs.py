"""The table of step outputs: each JSON file a step writes for a person to read, with its title,
its name, what ``marin show --json`` keeps of it and how it renders (HTML in the report, text in
``marin show``).

Every reader goes through :data:`OUTPUTS`: ``marin show`` (its ``content`` and its text), the HTML
report (each step's section and the results gathered at its top), :meth:`marin.review.Step.output`
and the notebook accessors (``step.health()``, ``step.eval_results()``, ...). Adding an output is
one line here: ``StepOutput("name.json", "title", "key", html=renderer)``; the report, ``marin show``
(its text renderer, or the file's top-level values) and ``step.output("key")`` then show it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from marin.review.gate import format_gate, gate_html
from marin.review.sections import (
    checklist_html,
    checklist_text,
    cluster_overview,
    cluster_overview_html,
    cluster_overview_text,
    corpus_filter_section,
    coverage_text,
    domain_fit_html,
    domain_fit_text,
    eval_html,
    eval_text,
    filter_fields,
    filter_text,
    fit_html,
    harness_html,
    has_coverage,
    has_overview,
    is_domain_fit,
    isoflop_section,
    manifest_html,
    mixture_coverage,
    mixture_html,
    mixture_shares,
    mixture_text,
    token_store,
    token_store_text,
    train_summary_html,
)
from marin.training.gate import GATE_FILE


def is_dict(data: Any) -> bool:
    return isinstance(data, dict) and bool(data)


def has_totals(data: Any) -> bool:
    """A manifest that counted what it read (an older or foreign file without totals is not shown)."""
    return isinstance(data, dict) and "totals" in data


def whole(data: Any) -> Any:
    return data


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One kind of file a step writes for a person to read."""

    file: str
    """Its name in the step's directory."""
    title: str
    """What the report's heading and ``marin show`` call it."""
    key: str
    """Its name: ``step.output(key)``, and ``content[key]`` of ``marin show --json`` (two files may
    share one, as dedup's and decontamination's manifests do)."""
    html: Callable[[Any], str] | None = None
    """Its section of the report (None: not in the report)."""
    text: Callable[[Any], str] | None = None
    """Its lines in ``marin show``, given what :attr:`keep` kept (None: its top-level values)."""
    keep: Callable[[Any], Any] = whole
    """What ``marin show --json`` keeps of it (default: all of it)."""
    accept: Callable[[Any], bool] = is_dict
    """Whether the file's JSON is this output at all (a foreign or damaged file is not shown)."""
    result: bool = False
    """Gathered in the report's results at its top, as well as in the step's section."""


OUTPUTS: tuple[StepOutput, ...] = (
    StepOutput("health.json", "health checklist", "health_report", html=checklist_html, text=checklist_text,
               result=True),
    StepOutput("eval.json", "evaluation", "eval", html=eval_html, text=eval_text, result=True),
    StepOutput("fit.json", "ladder fit", "ladder_fit", html=fit_html, result=True),
    StepOutput(GATE_FILE, "paired gate", "gate", html=gate_html, text=format_gate, result=True),
    StepOutput("isoflop.json", "IsoFLOP fit", "isoflop_fit", html=isoflop_section, result=True),
    StepOutput("harness.json", "lm-evaluation-harness", "harness", html=harness_html, result=True),
    StepOutput("mixture_report.json", "mixture", "mixture_shares", html=mixture_html, text=mixture_text,
               keep=mixture_shares),
    # the same file's data coverage: in the report within the mixture's section, in marin show on its own
    StepOutput("mixture_report.json", "data coverage", "mixture_coverage", text=coverage_text,
               keep=mixture_coverage, accept=has_coverage),
    StepOutput("manifest.json", "token store", "token_store", html=manifest_html, text=token_store_text,
               keep=token_store, accept=has_totals),
    StepOutput("dedup_manifest.json", "deduplication", "corpus_filter", html=corpus_filter_section,
               text=filter_text, keep=filter_fields, accept=has_totals),
    StepOutput("decontamination_manifest.json", "decontamination", "corpus_filter", html=corpus_filter_section,
               text=filter_text, keep=filter_fields, accept=has_totals),
    StepOutput("domain_fit.json", "domain fit", "domain_fit", html=domain_fit_html, text=domain_fit_text,
               accept=is_domain_fit),
    StepOutput("k40_manifest.json", "cluster overview", "cluster_overview", html=cluster_overview_html,
               text=cluster_overview_text, keep=cluster_overview, accept=has_overview),
    StepOutput("train_summary.json", "training summary", "train_summary", html=train_summary_html),
)
"""Every step output review reads, in the order the report and ``marin show`` present them."""


def outputs_named(name: str) -> list[StepOutput]:
    """The outputs a file name or a key names (a key may name several files); [] for none."""
    return [o for o in OUTPUTS if name in (o.file, o.key)]
