"""docs/versioning.md is generated from the configs' field metadata (the one versioning rule).

Regenerate it after changing a config's fields: ``python tests/docs/test_versioning_table.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "versioning.md"

HEADER = """# What is versioned

A step's output path is its name and the hash of its version (docs/architecture.md). Which config
fields enter the version is declared on each config dataclass, field by field
(`marin/execution/versioning.py`), and applied by the executor to every step's config, a builder's
or a plain `ExecutorStep`'s (`versioned_view`): a field is **versioned** unless it is marked **live**
(an operator may change it on a running step without changing what the step writes, so the step
keeps its output path and resumes) or **input** (an upstream step's output, versioned through that
step's hash, or this step's own output). **versioned by field**: a nested config whose own fields
are the version's leaves (`model.n_layers`), so `marin explain` names the one that changed.
**versioned when set**: a field added after steps were recorded (`added_later(default=..., before=...)`),
in the version only when it differs from what those steps did (`before`, the value a record without
the field reads back as; the default unless the table names another), so adding it renames no
recorded step, and a new config whose default is the current behaviour has a hash of its own. **group**: a
nested config that groups fields of its parent by concept (`TrainConfig.optimizer`), each field by
its own class's rule (listed below the parent); in the hash its fields are named as the parent's own
(`peak_lr`, not `optimizer.peak_lr`), so grouping a flat config moved no step's hash. Two versioned
fields with one name in the hash are refused when the experiment is planned.

This page is generated from that metadata (`python tests/docs/test_versioning_table.py`); a test
keeps it equal to the code.
"""


def config_classes() -> list[type]:
    from marin.data.corpus_steps import CorpusInput
    from marin.data.decontaminate import DecontaminateConfig
    from marin.data.dedup import DedupConfig
    from marin.data.domains import DomainAssignConfig, DomainFitConfig, Embedding
    from marin.data.layout import K40BuildConfig
    from marin.data.mixture import MixtureConfig
    from marin.data.mixture_report import MixtureReportConfig
    from marin.data.ngram_features import HashedNgrams
    from marin.data.quality import QualityExamplesConfig, QualityTrainConfig
    from marin.data.raw_text import FlattenConfig
    from marin.data.synthetic import PlantedFaults, SyntheticK40Config
    from marin.data.tokenize import TokenizeConfig
    from marin.data.tokenizer import TrainTokenizerConfig
    from marin.evaluation.multiple_choice import DomainTaskConfig
    from marin.evaluation.sets import EvalSet
    from marin.inference.evaluate import EvalConfig
    from marin.inference.harness import HarnessConfig
    from marin.models.config import MoEConfig
    from marin.monitoring.health import HealthReportConfig
    from marin.review.report import ReportConfig
    from marin.scaling.isoflop import IsoFlopFitConfig
    from marin.scaling.ladder import LadderFitConfig, RungRun
    from marin.training.config import GROUPS, SyntheticDataConfig, TrainConfig
    from marin.training.gate import GateConfig
    from marin.training.optimizers import OPTIMIZERS, OptimizerBase

    groups = [c for g in GROUPS.values() for c in (OPTIMIZERS.values() if g is OptimizerBase else (g,))]
    return [TrainConfig, *groups, MoEConfig, SyntheticDataConfig, SyntheticK40Config, PlantedFaults,
            TrainTokenizerConfig, CorpusInput, DedupConfig, DecontaminateConfig, FlattenConfig, DomainFitConfig,
            Embedding, HashedNgrams, DomainAssignConfig, QualityExamplesConfig, QualityTrainConfig, K40BuildConfig,
            TokenizeConfig, MixtureConfig,
            MixtureReportConfig, EvalConfig, EvalSet,
            DomainTaskConfig, HarnessConfig, HealthReportConfig, LadderFitConfig, RungRun, IsoFlopFitConfig,
            ReportConfig, GateConfig]


def render() -> str:
    from marin.execution.versioning import rule_table

    parts = [HEADER]
    for cls in config_classes():
        rows = rule_table(cls)
        versioned = [name for name, kind, _ in rows if kind == "versioned"]
        parts.append(f"\n## `{cls.__name__}` (`{cls.__module__}`)\n")
        if versioned:
            parts.append("versioned: " + ", ".join(f"`{n}`" for n in versioned) + "\n")
        others = [(n, k, r) for n, k, r in rows if k != "versioned"]
        if others:
            parts.append("\n| field | rule | why |\n|---|---|---|\n")
            parts.extend(f"| `{n}` | {k} | {r} |\n" for n, k, r in others)
    return "".join(parts)


def test_the_versioning_page_is_the_metadata():
    assert DOC.read_text() == render(), "docs/versioning.md is stale: run python tests/docs/test_versioning_table.py"


def test_every_config_of_a_builder_is_on_the_page():
    """A config a builder in experiments/defaults.py constructs is listed (so its rule is documented)."""
    import inspect

    import experiments.defaults as defaults

    source = inspect.getsource(defaults)
    listed = {cls.__name__ for cls in config_classes()}
    built = {name for name in dir(defaults) if name.endswith("Config") and f"{name}(" in source}
    assert built <= listed, built - listed


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    DOC.write_text(render())
