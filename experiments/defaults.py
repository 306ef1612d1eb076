"""Default step builders that experiment files compose.

Each builder returns an :class:`marin.execution.ExecutorStep` (``default_mixture`` a config that a
training step embeds); experiment files chain them. Read this file top to bottom to learn what a
default pipeline does: data (corpus -> tokenizer -> token store -> mixture), training, health and
review, the scaling ladder, evaluation. Every builder follows one rule, declared on the config
dataclasses themselves (:mod:`marin.execution.versioning`) and applied by ``versioned_config``: a
field is versioned (part of the output path) unless its class marks it live, with the reason (what
an operator may change on a live run); the table is in docs/training.md ("What is versioned").

Importing this module is cheap (no JAX, no Ray): the step functions import their heavy libraries
when they run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from marin.data.corpus_steps import CorpusInput, split_glob
from marin.data.decontaminate import DecontaminateConfig, decontaminate
from marin.data.dedup import DedupConfig, dedup
from marin.data.domains import DomainAssignConfig, DomainFitConfig, Embedding, assign_domains, fit_domains
from marin.data.layout import K40BuildConfig, build_k40_layout
from marin.data.mixture import MixtureConfig, MixtureStage
from marin.data.mixture_report import MixtureReportConfig, mixture_report
from marin.data.order import CURRENT_ORDER
from marin.data.quality import (
    QualityExamplesConfig,
    QualityTrainConfig,
    default_quality_features,
    train_quality,
    write_quality_examples,
)
from marin.data.raw_text import FlattenConfig, flatten_corpus
from marin.data.synthetic import PlantedFaults, SyntheticK40Config, generate_k40_miniature
from marin.data.tokenize import TokenizeConfig, tokenize
from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer
from marin.evaluation.multiple_choice import DomainTaskConfig, write_domain_task
from marin.evaluation.sets import EvalSet, mixture_validation_sets
from marin.execution import ExecutorStep, output_path_of, this_output_path, versioned
from marin.execution.plan import plain_config
from marin.execution.versioning import versioned_config
from marin.inference.evaluate import EvalConfig, evaluate
from marin.inference.harness import HarnessConfig, harness_eval, task_files_fingerprint
from marin.models.config import MoEConfig
from marin.monitoring.health import HealthReportConfig, health_report_step
from marin.pools import PoolSpec, as_pool
from marin.review.report import ReportConfig, report_step
from marin.scaling.isoflop import IsoFlopFitConfig, IsoFlopRun, RecipeSpace, isoflop_fit_step
from marin.scaling.ladder import LadderFitConfig, RungRun, ladder_fit_step
from marin.training.config import (
    CheckpointPolicy,
    Cutover,
    InitFrom,
    ParallelismConfig,
    StallRule,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    TrainEvalConfig,
)
from marin.training.gate import GateConfig, GateThresholds, check_gate
from marin.training.optimizers import OptimizerConfig
from marin.training.planning import StepDoesNotFit, check_train_config_fits, check_train_config_storage
from marin.training.steps import gate as gate_step
from marin.training.steps import train

StepOrPath = ExecutorStep | str
"""An upstream step (its output directory becomes a dependency) or a plain path (versioned as-is)."""

# --- data track (default_tokenize and friends) -------------------------------------------------
# A data pipeline is: corpus (a K40-layout root, or the miniature generator) -> tokenizer (trained
# or a tokenizer.json path) -> tokenize (one token store per step) -> a MixtureConfig that the
# training step embeds. Every config field is versioned (it may change what is written) except the
# placeholders and the fields the config class marks live.


def _data_input(x: StepOrPath) -> Any:
    """A step becomes output_path_of(step); a plain path string is versioned as-is."""
    return output_path_of(x) if isinstance(x, ExecutorStep) else versioned(str(x))


def _eval_set_input(x: StepOrPath) -> Any:
    """An evaluation set as a data step reads it: a task step is its ``task.jsonl``, any other step or
    path as :func:`_data_input` gives it."""
    if isinstance(x, ExecutorStep) and x.fn is write_domain_task:
        return output_path_of(x, "task.jsonl")
    return _data_input(x)


def _step(name: str, fn: Any, config: Any, description: str, *, num_cpus: float = 1,
          infra_retries: int | None = None) -> ExecutorStep:
    """A builder's step: ``config`` versioned by its class's rule (``versioned_config``), run by ``fn``
    in a task holding ``num_cpus`` (0 for a step that only waits on the device pool it launches);
    ``infra_retries``: the step's own resubmissions after an infrastructure failure, where it resumes
    from its own outputs (None: the executor's default)."""
    return ExecutorStep(name=name, fn=fn, config=versioned_config(config), description=description,
                        resources={"num_cpus": num_cpus}, infra_retries=infra_retries)


def default_k40_miniature(
    name: str = "data/k40_miniature",
    total_bytes: int = 4_000_000,
    seed: int = 0,
    domains: Sequence[str] | None = None,
    files_per_source: int = 1,
    *,
    exact_duplicates: int = 0,
    near_duplicates: int = 0,
    contaminated: int = 0,
    contaminate_from: StepOrPath | None = None,
) -> ExecutorStep:
    """A deterministic K40-shaped corpus (40 domains x 5 quality buckets) of about ``total_bytes``.

    Args:
        name: step name (the output directory is ``{prefix}/{name}-{hash}``).
        total_bytes: approximate size of the generated text.
        seed: generator seed; the same seed gives byte-identical files.
        domains: K40 domain names to generate (default: all 40).
        files_per_source: files per (domain, quality bucket) source.
        exact_duplicates, near_duplicates, contaminated: known faults to plant, each in its own
            document (:class:`PlantedFaults`); the manifest's ``planted`` entry lists them.
        contaminate_from: the evaluation set or task (a :func:`default_domain_task` step or a path)
            whose texts the contaminated documents carry.
    """
    planting = exact_duplicates or near_duplicates or contaminated
    plant = PlantedFaults(exact_duplicates, near_duplicates, contaminated,
                          None if contaminate_from is None else _eval_set_input(contaminate_from)) if planting else None
    return _step(name, generate_k40_miniature, SyntheticK40Config(
        output_path=this_output_path(),
        total_bytes=total_bytes,
        seed=seed,
        domains=None if domains is None else tuple(domains),
        files_per_source=files_per_source,
        plant=plant,
    ), f"K40-shaped miniature corpus, ~{total_bytes:,} bytes, seed {seed}"
       + (f", {exact_duplicates} exact and {near_duplicates} near duplicates and {contaminated} contaminated "
          "documents planted" if planting else ""))


def default_dedup(
    name: str,
    corpus: StepOrPath,
    *,
    input: CorpusInput | None = None,
    exact: bool = True,
    fuzzy: bool = True,
    shingle_size: int = 5,
    bands: int = 20,
    rows: int = 5,
    threshold: float = 0.7,
    seed: int = 1,
    scope: str = "corpus",
) -> ExecutorStep:
    """Remove exact and near-duplicate documents from ``corpus``; the output is a corpus in the same
    layout (same files and formats, fewer records) that :func:`default_tokenize` reads unchanged, and
    ``dedup_manifest.json`` (see docs/data.md, "Deduplication").

    Args:
        name: step name.
        corpus: a corpus step or a path (K40 layout: one directory per domain/bucket).
        input: what is read (sources, text field, size limit, corrupt-input policy) and how the work
            is spread (:class:`CorpusInput`; None: its defaults).
        exact, fuzzy, shingle_size, bands, rows, threshold, seed, scope: the algorithm, as
            :class:`DedupConfig` documents its fields (MinHash with ``bands * rows`` permutations).
    """
    return _step(name, dedup, DedupConfig(
        input_path=_data_input(corpus),
        output_path=this_output_path(),
        input=input or CorpusInput(),
        exact=exact,
        fuzzy=fuzzy,
        shingle_size=shingle_size,
        num_perm=bands * rows,
        bands=bands,
        rows=rows,
        threshold=threshold,
        seed=seed,
        scope=scope,
    ), f"dedup {name}: exact + MinHash LSH {bands}x{rows} over {shingle_size}-word shingles "
       f"(Jaccard >= {threshold}, verified)")


def default_decontamination_sets() -> dict[str, ExecutorStep]:
    """What the scaling experiments evaluate on that is not held out of the training corpus itself:
    the IsoFLOP experiment's multiple-choice task (the ladder and the quickstart evaluate on the
    mixture's held-out split, which is part of the corpus by construction)."""
    return {"k40_domains": default_domain_task("tiny-isoflop/task", DECONTAMINATION_TASK_DOMAINS,
                                               questions_per_domain=16, n_choices=4, seed=0)}


DECONTAMINATION_TASK_DOMAINS = ("council", "infra", "web_code", "science", "law", "medicine", "finance", "news")
"""The domains of the IsoFLOP experiment's task (experiments/tiny_isoflop.py, TASK_DOMAINS)."""


def _against_sets(against: Mapping[str, StepOrPath] | Sequence[StepOrPath]) -> dict[str, StepOrPath]:
    """``{name: evaluation set}`` from a mapping, or from a list (a step is named by its name, a path
    by itself); anything else, or one name twice, is refused with what to pass instead."""
    if isinstance(against, Mapping):
        return dict(against)
    if isinstance(against, (str, bytes)) or not isinstance(against, Sequence):
        raise TypeError(f"against= takes a list of evaluation sets (steps or paths) or a {{name: set}} mapping, "
                        f"got {type(against).__name__} {against!r:.80}")
    sets: dict[str, StepOrPath] = {}
    for x in against:
        if not isinstance(x, (ExecutorStep, str)):
            raise TypeError(f"against=[...]: each evaluation set is a step or a path, got {type(x).__name__} "
                            f"{x!r:.80}; pass a {{name: set}} mapping to name them yourself")
        key = x.name if isinstance(x, ExecutorStep) else x
        if key in sets:
            raise ValueError(f"against=[...]: {key!r} is given twice")
        sets[key] = x
    return sets


def default_decontaminate(
    name: str,
    corpus: StepOrPath,
    against: Mapping[str, StepOrPath] | Sequence[StepOrPath] | None = None,
    *,
    ngram: int = 13,
    mode: str = "remove",
    input: CorpusInput | None = None,
) -> ExecutorStep:
    """Remove training documents of ``corpus`` that share a word ``ngram``-gram with an evaluation set
    or task (or, with ``mode="cut"``, cut the matching words out); the output is a corpus in the same
    layout and ``decontamination_manifest.json`` with the matches per evaluation set.

    Args:
        name: step name.
        corpus: a corpus step (e.g. a :func:`default_dedup`) or a path.
        against: the evaluation sets: ``{name: set}``, or a list of sets (a step is named by its
            name, a path by itself); a set is a :func:`default_domain_task` step, an eval-set step or
            a path of jsonl / parquet documents (``input.text_field``) or task questions (prompt +
            correct answer). None: the scaling experiments' task (:func:`default_decontamination_sets`).
        ngram: words per n-gram (13, as GPT-3's decontamination).
        mode: ``"remove"`` or ``"cut"``.
        input: what is read and how the work is spread (:class:`CorpusInput`), as for :func:`default_dedup`.
    """
    sets = default_decontamination_sets() if against is None else _against_sets(against)
    return _step(name, decontaminate, DecontaminateConfig(
        input_path=_data_input(corpus),
        output_path=this_output_path(),
        against={k: _eval_set_input(v) for k, v in sets.items()},
        input=input or CorpusInput(),
        ngram=ngram,
        mode=mode,
    ), f"decontaminate {name} against {', '.join(sets)} ({ngram}-grams, {mode})")


# --- the K40 layout from raw text: domains by clustering, quality buckets by a classifier --------
# raw corpus -> domain fit -> domain assign -> (with a quality classifier) k40 layout -> default_tokenize.
# Changing K or the embedding moves the fit and everything after it; changing the classifier's example
# sets moves the classifier and the layout; the dedup and decontamination before them stay.


def default_raw_text(name: str, corpus: StepOrPath, files: int = 4, seed: int = 0) -> ExecutorStep:
    """Every record of ``corpus`` (a K40-layout corpus, e.g. :func:`default_k40_miniature`) shuffled into
    ``files`` flat files: raw text whose domains and buckets are no longer in its paths."""
    return _step(name, flatten_corpus, FlattenConfig(input_path=_data_input(corpus), output_path=this_output_path(),
                                                     files=files, seed=seed),
                 f"{name}: the records of a corpus shuffled into {files} flat files")


def default_domain_fit(
    name: str,
    corpus: StepOrPath,
    *,
    k: int = 40,
    sample_documents: int = 100_000,
    embedding: Embedding | None = None,
    n_init: int = 4,
    seed: int = 0,
    input: CorpusInput | None = None,
) -> ExecutorStep:
    """Fit ``k`` semantic domains (k-means centroids) on a sample of ``corpus``'s document embeddings;
    the output names each domain by its top terms (docs/data.md, "The K40 layout from raw text").

    Args:
        embedding: how documents become vectors (:class:`Embedding`; None: hashed n-gram TF-IDF with a
            randomized SVD, no download); your own model by import path, ``Embedding(model="pkg.mod:fn")``.
        input: what is read and how the work is spread (:class:`CorpusInput`), as for :func:`default_dedup`.
    """
    embedding = embedding or Embedding()
    return _step(name, fit_domains, DomainFitConfig(
        input_path=_data_input(corpus), output_path=this_output_path(), input=input or CorpusInput(), k=k,
        sample_documents=sample_documents, embedding=embedding, n_init=n_init, seed=seed,
    ), f"domain fit {name}: k={k} on {sample_documents:,} documents, {embedding.model}")


def default_domain_assign(name: str, corpus: StepOrPath, fit: ExecutorStep, *,
                          input: CorpusInput | None = None) -> ExecutorStep:
    """Label every document of ``corpus`` with its nearest domain of ``fit`` (a :func:`default_domain_fit`);
    versioned by the fit, so a new fit is a new assignment."""
    return _step(name, assign_domains, DomainAssignConfig(
        input_path=_data_input(corpus), fit_path=output_path_of(fit), output_path=this_output_path(),
        input=input or CorpusInput(),
    ), f"domain assign {name}")


def default_quality_examples(name: str, per_domain: int = 10, seed: int = 0,
                             domains: Sequence[str] | None = None) -> ExecutorStep:
    """A generated example pair for the miniature corpus: clean text (positive) and text as noisy as its
    lowest bucket (negative), ``per_domain`` documents per domain each; pass the step as both sets of
    :func:`default_quality_classifier`."""
    return _step(name, write_quality_examples, QualityExamplesConfig(
        output_path=this_output_path(), per_domain=per_domain, domains=None if domains is None else tuple(domains),
        seed=seed), f"generated quality examples, {per_domain} per domain and side")


def _example_set(x: StepOrPath, side: str) -> Any:
    """An example set: a generated pair's own side, another step's output, or a path (versioned as is)."""
    if isinstance(x, ExecutorStep) and x.fn is write_quality_examples:
        return output_path_of(x, side)
    return _data_input(x)


def default_quality_classifier(
    name: str,
    positive: Sequence[StepOrPath],
    negative: Sequence[StepOrPath],
    *,
    text_field: str = "text",
    C: float = 1.0,
    max_examples: int = 200_000,
    seed: int = 0,
) -> ExecutorStep:
    """Train a quality classifier (logistic regression on hashed character n-grams) of ``positive``
    (high quality text) against ``negative`` examples: steps or paths of jsonl / parquet documents (a
    :func:`default_quality_examples` step gives its own side to each)."""
    if isinstance(positive, (str, ExecutorStep)) or isinstance(negative, (str, ExecutorStep)):
        raise TypeError("positive= and negative= take lists of example sets (steps or paths), e.g. positive=[step]")
    return _step(name, train_quality, QualityTrainConfig(
        output_path=this_output_path(), positive=tuple(_example_set(x, "positive") for x in positive),
        negative=tuple(_example_set(x, "negative") for x in negative), text_field=text_field,
        features=default_quality_features(), C=C, max_examples=max_examples, seed=seed,
    ), f"quality classifier {name}: {len(positive)} positive, {len(negative)} negative example set(s)")


def default_k40_layout(
    name: str,
    corpus: StepOrPath,
    assignment: ExecutorStep,
    classifier: ExecutorStep,
    *,
    tokenizer: StepOrPath | None = None,
    bucketing: str = "per_domain",
    output_format: str = "jsonl.gz",
    input: CorpusInput | None = None,
) -> ExecutorStep:
    """Score every document of ``corpus`` with ``classifier``, bucket it into q1..q5 by score quantiles
    (per domain or global) and write it under ``{domain}/{bucket}/`` with ``k40_manifest.json``: the
    layout :func:`default_tokenize` and the mixtures read. ``corpus`` and ``input`` must be what
    ``assignment`` (a :func:`default_domain_assign`) read; ``tokenizer``: count tokens per source."""
    return _step(name, build_k40_layout, K40BuildConfig(
        input_path=_data_input(corpus), assignment_path=output_path_of(assignment),
        classifier_path=output_path_of(classifier), output_path=this_output_path(), input=input or CorpusInput(),
        bucketing=bucketing, tokenizer=None if tokenizer is None else _data_input(tokenizer),
        output_format=output_format,
    ), f"k40 layout {name}: quality buckets {bucketing}")


_TOKENIZER_READS = ("text_field", "on_corrupt", "max_corrupt_fraction")
"""The fields of a :class:`CorpusInput` that the tokenizer trainer reads (the rest say which files and
documents a per-file corpus step takes, or how it spreads its work)."""


def _tokenizer_input(input: CorpusInput | None) -> dict[str, Any]:
    """The fields of ``input`` the tokenizer trainer reads. It samples every document file under its
    corpus in one process, so the execution options do not apply (live: ignored); ``sources``,
    ``max_doc_bytes`` and ``allow_empty`` would change what it learns from, and it has none of them:
    refused when set, in one line, rather than dropped."""
    input = input or CorpusInput()
    default = CorpusInput()
    unread = [f"{f}={getattr(input, f)!r}" for f in ("sources", "max_doc_bytes", "allow_empty")
              if getattr(input, f) != getattr(default, f)]
    if unread:
        small = "; allow_small_vocab=True lets a corpus too small for vocab_size succeed" if input.allow_empty else ""
        raise ValueError(f"default_tokenizer reads {', '.join(_TOKENIZER_READS)} of input=, not {', '.join(unread)}: "
                         "it samples every document file under its corpus; pass a corpus path holding only what it "
                         f"should learn from and input= without them{small}")
    return {f: getattr(input, f) for f in _TOKENIZER_READS}


def default_tokenizer(
    name: str,
    corpus: StepOrPath,
    vocab_size: int = 8192,
    max_bytes: int = 50_000_000,
    min_frequency: int = 2,
    *,
    input: CorpusInput | None = None,
    allow_small_vocab: bool = False,
) -> ExecutorStep:
    """Train a byte-level BPE tokenizer (``tokenizer.json`` in the step output) on ``corpus``.

    Args:
        name: step name.
        corpus: a corpus step or a directory of jsonl / jsonl.gz / jsonl.zst / parquet files.
        vocab_size: vocabulary size, special tokens included.
        max_bytes: text sampled for training, at most.
        min_frequency: merges rarer than this are not learned.
        input: the same :class:`CorpusInput` as the corpus's tokenize step; the trainer reads its
            ``text_field`` and corrupt-input policy (skipped files are listed in ``tokenizer_info.json``).
        allow_small_vocab: let a corpus too small to learn ``vocab_size`` entries succeed with a
            smaller vocabulary (not versioned: it decides whether the step fails, not what it writes).
    """
    return _step(name, train_tokenizer, TrainTokenizerConfig(
        input_path=_data_input(corpus),
        output_path=this_output_path(),
        vocab_size=vocab_size,
        max_bytes=max_bytes,
        min_frequency=min_frequency,
        allow_small_vocab=allow_small_vocab,
        **_tokenizer_input(input),
    ), f"byte-level BPE, vocab {vocab_size}")


def default_tokenize(
    name: str,
    source: StepOrPath,
    tokenizer: StepOrPath,
    input: CorpusInput | None = None,
    shard_max_tokens: int = 64 * 1024 * 1024,
) -> ExecutorStep:
    """Tokenize the documents under ``source`` into a token store (shards of uint32 ids + manifest).

    Args:
        name: step name.
        source: a corpus step or a path.
        tokenizer: a tokenizer step or a path to ``tokenizer.json`` (or its directory).
        input: what is read (one source per directory of ``source`` unless ``sources`` names them)
            and how the work is spread (:class:`CorpusInput`; None: its defaults), as for
            :func:`default_dedup`.
        shard_max_tokens: tokens per shard file, at most.
    """
    return _step(name, tokenize, TokenizeConfig(
        input_path=_data_input(source),
        tokenizer=_data_input(tokenizer),
        output_path=this_output_path(),
        input=input or CorpusInput(),
        shard_max_tokens=shard_max_tokens,
    ), f"tokenize {name}")


def default_mixture(
    tokenized: Sequence[StepOrPath],
    domain_weights: Mapping[str, float] | None = None,
    quality_weights: Mapping[str, float] | None = None,
    stages: Sequence[MixtureStage] = (),
    seed: int = 0,
    validation_fraction: float = 0.01,
    validation_max_documents: int = 1000,
    domain_quality_weights: Mapping[str, Mapping[str, float]] | None = None,
    order: str = CURRENT_ORDER,
) -> MixtureConfig:
    """A :class:`marin.data.mixture.MixtureConfig` over token stores, for a training step's config.

    Placeholders inside it are resolved by the executor; the weights are versioned, so changing the
    mixture changes the training step's hash, never the stores'.

    Args:
        tokenized: tokenize steps (or store paths).
        domain_weights: relative weight per domain; a domain left out gets weight 0 (None: uniform).
        quality_weights: relative weight per quality bucket (``q1`` .. ``q5``).
        stages: later stages with other weights (e.g. quality-weighted from 30% of the run).
        seed: sampling seed.
        validation_fraction: share of each source's documents held out for evaluation.
        validation_max_documents: held-out documents per source, at most.
        domain_quality_weights: per-domain quality weights, overriding ``quality_weights``.
        order: the data order (``marin.data.order``): every training token once per epoch of its source
            (``"without_replacement_v1"``, the default), or the legacy ``"with_replacement"``.
    """
    return versioned_config(MixtureConfig(
        stores=tuple(_data_input(t) for t in tokenized),
        domain_weights=None if domain_weights is None else dict(domain_weights),
        quality_weights=None if quality_weights is None else dict(quality_weights),
        domain_quality_weights={d: dict(w) for d, w in (domain_quality_weights or {}).items()},
        stages=tuple(stages),
        seed=seed,
        validation_fraction=validation_fraction,
        validation_max_documents=validation_max_documents,
        order=order,
    ))


def default_mixture_report(name: str, mixture: MixtureConfig, total_tokens: int | None = None,
                           total_steps: int | None = None) -> ExecutorStep:
    """A step writing ``mixture_report.json``: effective shares per stage, held-out sizes, epochs.

    Args:
        name: step name.
        mixture: a ``default_mixture`` config.
        total_tokens: planned training tokens; with it the report shows expected epochs per source.
        total_steps: the run's steps; places stages that start at fractions of the run.
    """
    return _step(name, mixture_report, MixtureReportConfig(mixture, this_output_path(), total_tokens, total_steps),
                 "effective token shares of a mixture")


# --- training track (default_train and friends) ------------------------------------------------
# A training step embeds a MixtureConfig (from default_mixture) and runs marin.training.steps.train
# on a device pool (marin.pools.POOLS). What defines the run is versioned: model, data,
# seed, batch and the original schedule. What an operator may change on a live run is not: the
# horizon re-plans (lr_replans), the transport switch step, the pool, checkpoint cadence and
# telemetry, so changing them keeps the output path and the step resumes from its checkpoints.


def default_train(
    name: str,
    *,
    mixture: MixtureConfig | SyntheticDataConfig,
    model: MoEConfig | str = "tiny-ep",
    preset: str | None = None,
    pool: str | PoolSpec = "local-cpu",
    seed: int = 0,
    train_steps: int = 100,
    tokens_per_step: int = 4096,
    seq_len_phases: Sequence[tuple[float, int]] = ((0.0, 64),),
    optimizer: OptimizerConfig | None = None,
    checkpoint: CheckpointPolicy | None = None,
    stall: StallRule | None = None,
    evaluation: TrainEvalConfig | None = None,
    telemetry: TelemetryConfig | None = None,
    parallelism: ParallelismConfig | None = None,
    init_from: InitFrom | None = None,
    cutovers: Sequence[Cutover] = (),
    description: str | None = None,
    memory_check: str = "error",
) -> ExecutorStep:
    """A training step: ``model`` on ``mixture``, one :class:`TrainConfig` built from these arguments
    (a group left out, e.g. ``checkpoint``, keeps its class's defaults).

    The step's version follows the rule TrainConfig declares field by field (see its definition and
    docs/training.md, "What is versioned"): the resolved model (every ``MoEConfig`` field), so editing
    a preset re-runs the steps that use it, the data, the seed, the batch, the original schedule and
    the optimizer are versioned; what an operator may change on a live run (the pool, horizon
    re-plans, the transport switch, checkpoint cadence, the stall watchdog, telemetry, in-training
    evaluation, how the work is spread) is not, so changing it keeps the output path and its
    checkpoints.

    Args:
        name: step name.
        mixture: a ``default_mixture`` config (or a ``SyntheticDataConfig`` for tests).
        model: a :class:`MoEConfig` (e.g. a ladder rung's, or ``get_preset("tiny", z_loss_weight=...)``)
            or the name of a preset of ``marin.models.config.PRESETS``; ``max_seq_len`` is raised to
            the longest sequence phase.
        preset: the preset the model derives from (versioned; read by ``marin plan`` and the report);
            a preset name given as ``model`` is its own.
        pool: the device pool (``marin.pools``): a pool's name or a ``PoolSpec``; live.
        seed: initialisation and data-order seed.
        train_steps, tokens_per_step, seq_len_phases: the horizon as planned, the batch in tokens, and
            ``(start fraction, seq_len)`` phases at that batch.
        optimizer: the optimizer and the LR schedule (``AdamWConfig``, the default, or ``MuonHConfig``:
            marin.training.optimizers; ``lr_replans`` is live).
        checkpoint: when state is saved and kept, the temporary tier, the preemption grace
            (:class:`~marin.training.checkpoint.CheckpointPolicy`).
        stall: the pool launcher's stall watchdog (:class:`~marin.pools.stall.StallRule`).
        evaluation: in-training evaluation (:class:`TrainEvalConfig`): ``every_steps=``, ``sets=`` (see
            :func:`default_eval_suite`) and ``tasks={name: a default_domain_task step or a jsonl
            path}``, multiple-choice tasks scored at each eval as :func:`default_eval` scores them
            (a step is a dependency).
        telemetry: metrics, W&B project and run name, progress lines (:class:`TelemetryConfig`).
        parallelism: microbatches, parameter sharding, remat and context parallelism by sequence
            length, the EP transport by step (:class:`ParallelismConfig`).
        init_from: ``branch_from(step, N)`` starts from another training step's committed checkpoint
            instead of a fresh state (the source's version and the checkpoint step become part of
            this step's version).
        cutovers: the gates the run's live changes rest on (:class:`Cutover`: the step, the gate's
            directory, the candidate); live. A cutover whose gate failed is refused when the run
            starts, unless forced (docs/training.md, "Changing a live run").
        description: a line for ``marin status`` and the report.
        memory_check: ``"error"``, ``"warn"`` or ``"off"``: what to do at declaration time when the
            planner says a phase of the run does not fit its pool's device memory.
    """
    if isinstance(model, str):
        preset = preset or model  # a preset name given as model is its own preset
    if evaluation is not None and evaluation.tasks:
        evaluation = dataclasses.replace(evaluation, tasks=_task_paths(evaluation.tasks))
    groups = {g: v for g, v in (("optimizer", optimizer), ("checkpoint", checkpoint), ("stall", stall),
                                ("evaluation", evaluation), ("telemetry", telemetry),
                                ("parallelism", parallelism)) if v is not None}  # None: the group's defaults
    config = TrainConfig(output_path=this_output_path(), data=mixture, model=model, preset=preset, pool=pool,
                         seed=seed, train_steps=train_steps, tokens_per_step=tokens_per_step,
                         seq_len_phases=seq_len_phases, init_from=init_from, cutovers=tuple(cutovers), **groups)
    _check_train_memory(memory_check, config)
    check_train_config_storage(config)  # checkpoint.storage_quota: refused when the file is read, not at 220 TiB
    return ExecutorStep(
        name=name,
        fn=train,
        config=versioned_config(config),
        description=description or (f"train {preset or f'd{config.model.d_model}'} for {config.train_steps} steps "
                                    f"x {config.tokens_per_step} tokens on {config.pool.name}"),
        # The step's own task only waits on the pool's placement group; it must not hold a CPU the
        # pool's hosts need.
        resources={"num_cpus": 0},
        # it resumes from its checkpoints: an infrastructure failure is retried where its pool says so,
        # and a stop signal to the driver leaves it the grace period for a final checkpoint
        infra_retries=config.pool.infra_retries,
        stop_grace_s=config.checkpoint.preemption_grace_s,
    )


def branch_from(source: ExecutorStep, step: int, *, optimizer: bool = True, data_position: bool = True,
                wait_for_source: bool = False) -> InitFrom:
    """``init_from`` for :func:`default_train`: start at ``source``'s committed checkpoint of ``step``,
    resharded onto the new run's pool. The source is a dependency (its version is part of the new
    step's, and it must have succeeded, so the checkpoint exists) and ``step`` is versioned.

    ``optimizer``: take the optimizer's state too (only from a source trained with the same optimizer).
    ``data_position``: continue the source's data stream,
    step counter and LR schedule (a cooldown side branch: the same schedule with ``lr_replans=((step,
    step + cooldown_steps),)`` decays to the final LR over the cooldown; a longer horizon: a larger
    ``train_steps``); False starts at step 0 of the new run's own schedule with the source's weights.
    ``wait_for_source``: start only after the source step succeeded (continuing a finished run); by
    default the branch may run while the source still trains (a side branch of a live run), and the
    checkpoint must be committed when it starts.
    """
    if not isinstance(source, ExecutorStep):
        raise TypeError(f"branch_from needs the source training step (an ExecutorStep), got {type(source).__name__}")
    if int(step) <= 0:
        raise ValueError(f"branch_from: step must be a positive checkpoint step, got {step}")
    run = output_path_of(source)
    # versioned by TrainConfig's rule (init_from is by_field): the run through the source's hash
    return InitFrom(run=run if wait_for_source else run.nonblocking(), step=int(step), optimizer=bool(optimizer),
                    data_position=bool(data_position))


def default_gate(name: str, run: ExecutorStep, at_step: int, candidates: Mapping[str, Mapping[str, Any]], *,
                 steps: int = 200, pool: str | PoolSpec | None = None, thresholds: GateThresholds | None = None,
                 checkpoint_every: int | None = None, confidence: float = 0.95, wait_for_run: bool = False,
                 description: str | None = None) -> ExecutorStep:
    """A paired gate of the live training step ``run`` before a change: restore its committed
    checkpoint ``at_step`` (weights, AdamW state, data position) and train the run's own settings
    (the control) and each candidate for ``steps`` steps from that same state on identical batches;
    ``gate.json`` holds each arm's step time, MFU, drops, loss, grad norm and peak memory, the paired
    loss difference with its confidence interval and the verdict against ``thresholds``
    (:class:`~marin.training.gate.GateThresholds`); ``gate.png`` plots the arms.

    Args:
        name: step name.
        run: the ``default_train`` step to gate (it may still be training: the gate needs only its
            committed checkpoint ``at_step``, which it pins so the run's retention keeps it).
        at_step: the checkpoint the arms start from.
        candidates: label -> changes, e.g. ``{"ragged": {"transport": "ragged_capacity"},
            "mb4": {"parallelism.microbatches": 4}}``: a live field (``group.field``), the transport from
            ``at_step`` on, and for a modelling question an optimizer or model field or
            ``seq_len_phases``. A change a restored state cannot take (one that changes the batches or
            the shape of the weights, or rewrites what ran before ``at_step``) is refused here, in one line.
        steps: the window each arm trains.
        pool: where the arms run (None: the run's pool); a smaller pool of the run's device kind is
            allowed and said in gate.json.
        checkpoint_every: the arms' checkpoint cadence, so a killed gate resumes (None: twice a window).
        confidence: of the paired loss difference's interval.
        wait_for_run: start only after ``run`` succeeded (a gate of a finished run, e.g. a rehearsal);
            by default the gate runs beside the live run, whose checkpoint must be committed then.

    Nothing of the run's output is written but the pins on the gated checkpoint, released with the
    verdict. The step's version names the run's (through
    its hash), the checkpoint step, the candidates, the window, the pool and the thresholds.
    """
    if not isinstance(run, ExecutorStep):
        raise TypeError(f"default_gate needs the training step to gate (an ExecutorStep), got {type(run).__name__}")
    source = output_path_of(run)
    config = GateConfig(run=source if wait_for_run else source.nonblocking(), output_path=this_output_path(),
                        at_step=int(at_step),
                        candidates={str(k): dict(v) for k, v in candidates.items()}, steps=int(steps), pool=pool,
                        thresholds=thresholds or GateThresholds(), checkpoint_every=checkpoint_every,
                        confidence=confidence)
    run_config = plain_config(run.config)
    check_gate(config, run_config)  # refused when the file is read, before anything runs
    return ExecutorStep(
        name=name,
        fn=gate_step,
        config=versioned_config(config),
        description=description or (f"gate {run.name} at step {at_step}: {', '.join(config.candidates)} vs control, "
                                    f"{steps} steps"),
        resources={"num_cpus": 0},  # as a training step: its task only waits on the pool's placement group
        infra_retries=as_pool(pool if pool is not None else run_config.pool).infra_retries,
    )


def _check_train_memory(mode: str, config: TrainConfig) -> None:
    """Plan-time memory check of a training step (marin.training.planning): a step that cannot fit
    its pool fails when the experiment file is read (dry runs included), not on 176 hosts."""
    if mode not in ("error", "warn", "off"):
        raise ValueError(f"memory_check must be 'error', 'warn' or 'off', got {mode!r}")
    if mode == "off":
        return
    try:
        check_train_config_fits(config)
    except StepDoesNotFit as e:
        if mode == "error":
            raise
        warnings.warn(str(e), stacklevel=3)


# --- review (health of a run against healthy ranges and the ladder's prediction; the HTML report) ---


def default_health_report(name: str, train_step: ExecutorStep, total_steps: int | None = None,
                          fit: ExecutorStep | None = None, plan_mfu: float | None = None,
                          plan_tokens_per_s: float | None = None) -> ExecutorStep:
    """A step writing ``health.json`` for ``train_step``: loss falling, drops < 8%, grad-norm peak.

    Args:
        name: step name.
        train_step: the ``default_train`` step to judge.
        total_steps: the run's horizon (fractions of the run are measured against it).
        fit: a ``default_ladder_fit`` step; with it, each window of the run is also judged against
            the ladder's predicted band (clear / watch / act).
        plan_mfu: planned MFU; measured MFU well below it is flagged.
        plan_tokens_per_s: planned throughput; measured throughput well below it is flagged.
    """
    return _step(name, health_report_step, HealthReportConfig(
        run_path=output_path_of(train_step), output_path=this_output_path(), total_steps=total_steps,
        fit_path=None if fit is None else output_path_of(fit), plan_mfu=plan_mfu,
        plan_tokens_per_s=plan_tokens_per_s), f"health of {train_step.name}")


def default_report(name: str, steps: Sequence[ExecutorStep], description: str | None = None) -> ExecutorStep:
    """A step writing ``report.html`` (the ``marin report`` page) for ``steps`` and everything they read.

    It depends on every step it reports, so it runs after them and is made again whenever one of
    them changes (their hashes are part of its version).

    Args:
        name: step name.
        steps: the steps to report (their dependencies are included).
        description: a line for the report's header.
    """
    return _step(name, report_step, ReportConfig(name=name, step_paths=[output_path_of(s) for s in steps],
                                                 output_path=this_output_path(), description=description),
                 f"report of {', '.join(s.name for s in steps)}")


# --- scaling ladder (fit the rungs, predict the target) -------------------------------------------


def _rung_run(name: str, train_step: ExecutorStep, eval_step: ExecutorStep | None = None, *,
              with_outputs: bool = True) -> RungRun:
    """What a ladder fit needs to know about a training step: its model and schedule (read from the
    step's config at declaration time) and, ``with_outputs``, where its outputs are. A target read
    without outputs is not a dependency of the fit. The model is the one the step trains, not the
    preset's name (RungRun versions it as one value)."""
    c = plain_config(train_step.config)  # the TrainConfig as built, before the rule marked its fields
    return RungRun(
        name=name,
        model=c.model,
        train_steps=c.train_steps,
        tokens_per_step=c.tokens_per_step,
        seq_len_phases=c.seq_len_phases,
        warmup_steps=c.optimizer.warmup_steps,
        run_path=output_path_of(train_step) if with_outputs else None,
        eval_path=output_path_of(eval_step) if with_outputs and eval_step is not None else None,
    )


def default_ladder_fit(
    name: str,
    rungs: Sequence[tuple[ExecutorStep, ExecutorStep | None]],
    target: ExecutorStep,
    *,
    validation: tuple[ExecutorStep, ExecutorStep | None] | None = None,
    fractions: Sequence[float] = (0.03, 0.1, 0.3, 0.5, 1.0),
    n_boot: int = 400,
    max_validation_rel_error: float | None = None,
) -> ExecutorStep:
    """A step writing ``fit.json`` and plots: scaling laws over the rungs that predict ``target``.

    Args:
        name: step name.
        rungs: ``(train_step, eval_step or None)`` pairs; bits per byte is fitted when every rung has
            an eval step, training loss otherwise.
        target: a training step, read for its model and schedule only (it need not have run).
        validation: a ``(train_step, eval_step or None)`` pair that is never fitted; adds
            ``validation_rel_error`` to ``fit.json``.
        fractions: fractions of each run at which the law is also fitted (the predicted trajectory).
        n_boot: bootstrap resamples for the parameters' uncertainty.
        max_validation_rel_error: fail the step when the validation rung is predicted worse than this.
    """
    runs = tuple(_rung_run(t.name.rsplit("/", 1)[-1], t, e) for t, e in rungs)
    val = None if validation is None else _rung_run(validation[0].name.rsplit("/", 1)[-1], *validation)
    return _step(name, ladder_fit_step, LadderFitConfig(
        rungs=runs,
        target=_rung_run(target.name.rsplit("/", 1)[-1], target, with_outputs=False),
        output_path=this_output_path(),
        validation=val,
        fractions=tuple(float(f) for f in fractions),
        n_boot=n_boot,
        max_validation_rel_error=max_validation_rel_error,
    ), f"ladder fit over {len(runs)} rungs -> {target.name}")


def _isoflop_run(budget: float, train_step: ExecutorStep, eval_step: ExecutorStep | None) -> IsoFlopRun:
    """An IsoFLOP fit's view of a training step: the model and schedule as the ladder fit reads them."""
    r = _rung_run(train_step.name.rsplit("/", 1)[-1], train_step, eval_step)
    return IsoFlopRun(name=r.name, budget=float(budget), model=r.model, train_steps=r.train_steps,
                      tokens_per_step=r.tokens_per_step, seq_len_phases=r.seq_len_phases, run_path=r.run_path,
                      eval_path=r.eval_path)


def default_isoflop_fit(
    name: str,
    runs: Sequence[tuple[float, ExecutorStep, ExecutorStep | None]],
    *,
    recipe: RecipeSpace | None = None,
    next_budget: float | None = None,
    validation: tuple[float, ExecutorStep, ExecutorStep | None] | None = None,
    n_boot: int = 200,
    max_validation_rel_error: float | None = None,
) -> ExecutorStep:
    """A step writing ``isoflop.json`` and plots: IsoFLOP parabolas, the compute-optimal frontier, the
    loss surface L(N, D), the law chosen for predictions and task-accuracy fits
    (:mod:`marin.scaling.isoflop`).

    Args:
        name: step name.
        runs: ``(budget, train_step, eval_step or None)`` per run; at least 3 sizes per budget and 2
            budgets. bpb is fitted when every run has an eval step, training loss otherwise.
        recipe: the widths, depth rule, batch and shape a compute-optimal run may have; with
            ``next_budget`` the document names the compute-optimal rung there (``next``).
        next_budget: the compute of the next run to plan.
        validation: a ``(budget, train_step, eval_step)`` run never fitted; compared with the
            chosen law's prediction (``validation``, ``validation_rel_error``).
        n_boot: bootstrap resamples of the loss surface.
        max_validation_rel_error: fail the step (after writing) when the validation run misses by more.
    """
    iso_runs = tuple(_isoflop_run(b, t, e) for b, t, e in runs)
    return _step(name, isoflop_fit_step, IsoFlopFitConfig(
        runs=iso_runs,
        output_path=this_output_path(),
        recipe=recipe,
        next_budget=None if next_budget is None else float(next_budget),
        validation=None if validation is None else _isoflop_run(*validation),
        n_boot=n_boot,
        max_validation_rel_error=max_validation_rel_error,
    ), f"IsoFLOP fit over {len(iso_runs)} runs at {len({b for b, _, _ in runs})} budgets")


# --- evaluation (bits per byte of held-out text; see docs/evaluation.md) ----------------------------
# Multiple-choice tasks are jsonl files (marin.evaluation.multiple_choice); default_domain_task writes
# one from the K40 miniature's domain languages, so a tiny ladder has a task its models can learn.


def default_domain_task(name: str, domains: Sequence[str], questions_per_domain: int = 16, n_choices: int = 4,
                        seed: int = 0, start: int = 50_000) -> ExecutorStep:
    """A step writing ``task.jsonl``: continue a passage in its own domain's language.

    Args:
        name: step name.
        domains: K40 domains whose languages the questions use (at least ``n_choices``).
        questions_per_domain: questions whose gold passage is in each domain.
        n_choices: choices per question (the gold passage and passages of other domains).
        seed: the corpus's seed (it defines the domain languages).
        start: first document index; beyond the training corpus's documents, so no question was trained on.
    """
    return _step(name, write_domain_task, DomainTaskConfig(
        output_path=this_output_path(), domains=tuple(domains), questions_per_domain=questions_per_domain,
        n_choices=n_choices, seed=seed, start=start), f"domain-continuation task over {len(domains)} K40 domains")


def _task_paths(tasks: Mapping[str, StepOrPath] | None) -> dict[str, Any]:
    """Task paths for an eval or training config: a step becomes its ``task.jsonl`` (a dependency,
    versioned by its hash); a plain path stays a path (an eval config versions it as a value, as
    before steps were accepted; a training config's ``eval_tasks`` are telemetry, not versioned)."""
    return {k: output_path_of(t, "task.jsonl") if isinstance(t, ExecutorStep) else str(t)
            for k, t in (tasks or {}).items()}


def default_eval_suite(suite: Mapping[str, str], tokenizer: StepOrPath, input: CorpusInput | None = None,
                       prefix: str = "eval") -> tuple[EvalSet, ...]:
    """A Paloma-style suite in one line, each set tokenized once with the run's tokenizer.

    Args:
        suite: ``{set name: path, directory or glob}`` of jsonl / jsonl.gz / jsonl.zst / parquet files
            on any fsspec path.
        tokenizer: the run's tokenizer (a step or a path).
        input: how each set is read (:class:`CorpusInput`: the text field, the corrupt-input policy ...);
            its ``sources`` are the suite's, one per set.
        prefix: tokenize steps are named ``{prefix}/{set name}``.
    """
    input = input or CorpusInput()
    if input.sources is not None:
        raise ValueError(f"default_eval_suite: each set's files are its suite entry; pass input= without sources "
                         f"(got sources={input.sources!r:.80})")
    out = []
    for name, path in suite.items():
        base, loc = split_glob(str(path))
        step = default_tokenize(f"{prefix}/{name}", base, tokenizer, dataclasses.replace(input, sources={name: loc}))
        # only the name is marked here (EvalSet's other fields stay plain): default_eval versions every
        # field by EvalSet's rule, and a training step's in-training sets keep the version they had
        out.append(EvalSet(name=versioned(name), store=output_path_of(step)))
    return tuple(out)


def default_validation_sets(mixture: MixtureConfig, name: str = "val") -> tuple[EvalSet, ...]:
    """The held-out split of a ``default_mixture`` as eval sets, one per domain (``{name}/{domain}``)."""
    return mixture_validation_sets(mixture, name)


def _pool_infra_retries(pool: PoolSpec | None, train_step: ExecutorStep) -> int | None:
    """An evaluation's infrastructure retries: those of the pool it runs on (``pool``, else the
    training step's); None when neither has one."""
    spec = pool or getattr(train_step.config, "pool", None)
    return spec.infra_retries if spec is not None else None


def default_eval(
    name: str,
    train_step: ExecutorStep,
    eval_sets: Sequence[EvalSet] = (),
    checkpoint: str | int = "latest",
    pool: str | PoolSpec | None = None,
    *,
    held_out: bool = False,
    seq_len: int | None = None,
    stride: int | None = None,
    tasks: Mapping[str, StepOrPath] | None = None,
) -> ExecutorStep:
    """A step writing ``eval.json``: bits per byte of ``train_step``'s committed checkpoint(s).

    Args:
        name: step name.
        train_step: the ``default_train`` step whose checkpoints are evaluated.
        eval_sets: named eval sets (see :func:`default_eval_suite`).
        checkpoint: ``"latest"``, a step number, or ``"all"`` (every retained checkpoint; ``eval.json``
            then also holds ``checkpoints``, one record each in step order).
        pool: the device pool (a name or a PoolSpec); None runs on the training step's pool.
        held_out: also evaluate the training mixture's held-out split (one set per domain).
        seq_len: window length (default: the run's longest training sequence).
        stride: overlapping windows, so every token has at least ``seq_len - stride`` tokens of
            context (default: disjoint windows).
        tasks: multiple-choice tasks ``{name: jsonl path or a default_domain_task step}``, scored as
            accuracy, byte-normalised accuracy and task loss (``gold_bpb``) under ``"tasks"`` in
            ``eval.json``.
    """
    pool = as_pool(pool) if pool is not None else None  # a name is resolved here, once; the spec travels
    if not (checkpoint in ("latest", "all") or isinstance(checkpoint, int)):
        raise ValueError(f"checkpoint must be 'latest', 'all' or a step number, got {checkpoint!r}")
    sets = tuple(eval_sets)
    if not sets and not held_out and not tasks:
        raise ValueError(f"default_eval {name!r}: nothing to evaluate; pass eval_sets, held_out=True or tasks")
    # Like training, the step's own task only waits on the pool it launches.
    return _step(name, evaluate, EvalConfig(
        run_path=output_path_of(train_step),
        output_path=this_output_path(),
        sets=sets,
        checkpoint=checkpoint,
        held_out=held_out,
        pool=pool,
        seq_len=seq_len,
        stride=stride,
        tasks=_task_paths(tasks),
    ), f"evaluate {train_step.name} ({checkpoint} checkpoint)", num_cpus=0,
        infra_retries=_pool_infra_retries(pool, train_step))


def default_harness_eval(
    name: str,
    train_step: ExecutorStep,
    tasks: Sequence[str],
    include_path: str | None = None,
    checkpoint: int | None = None,
    pool: str | PoolSpec | None = None,
    *,
    limit: int | None = None,
) -> ExecutorStep:
    """A step writing ``harness.json``: EleutherAI lm-evaluation-harness ``tasks`` on ``train_step``'s
    checkpoint, through marin's lm_eval model class (its results appear in the report).

    Args:
        name: step name.
        train_step: the ``default_train`` step whose checkpoint is evaluated.
        tasks: lm_eval task names, defined by YAML files under ``include_path`` (local data files:
            no hub access needed).
        include_path: directory of task YAML files; their content is part of the step's version.
        checkpoint: a committed step number (None: the latest).
        pool: a single-host pool, a name or a PoolSpec (None: the training step's).
        limit: at most this many documents per task.
    """
    pool = as_pool(pool) if pool is not None else None  # a name is resolved here, once; the spec travels
    if not tasks:
        raise ValueError(f"default_harness_eval {name!r}: pass at least one task name")
    if include_path is not None:
        from marin.evaluation.harness import check_tasks

        check_tasks(list(tasks), include_path)
    return _step(name, harness_eval, HarnessConfig(
        run_path=output_path_of(train_step),
        output_path=this_output_path(),
        tasks=tuple(tasks),
        include_path=include_path,
        task_files=task_files_fingerprint(include_path),
        checkpoint=checkpoint,
        limit=limit,
        pool=pool,
    ), f"lm-evaluation-harness {', '.join(tasks)} on {train_step.name}",
        infra_retries=_pool_infra_retries(pool, train_step))
