"""Default step builders that experiment files compose.

Each builder returns an :class:`marin.execution.ExecutorStep`; experiment files chain them. Read this
file top to bottom to learn what a default pipeline does.
"""

# --- data track (default_tokenize and friends) -------------------------------------------------
# A data pipeline is: corpus (a K40-layout root, or the miniature generator) -> tokenizer (trained
# or a tokenizer.json path) -> tokenize (one token store per step) -> a MixtureConfig that the
# training step embeds. Every config field is versioned (it may change what is written) except the
# placeholders and the fields listed as unversioned next to each builder.

from collections.abc import Mapping as _Mapping
from collections.abc import Sequence as _Sequence


def _data_input(x):
    """A step becomes output_path_of(step); a plain path string is versioned as-is."""
    from marin.execution import ExecutorStep, output_path_of, versioned

    return output_path_of(x) if isinstance(x, ExecutorStep) else versioned(str(x))


def default_k40_miniature(
    name: str = "data/k40_miniature",
    total_bytes: int = 4_000_000,
    seed: int = 0,
    domains: _Sequence[str] | None = None,
    files_per_source: int = 1,
):
    """A deterministic K40-shaped corpus (40 domains x 5 quality buckets) of about ``total_bytes``."""
    from marin.data.synthetic import SyntheticK40Config, generate_k40_miniature
    from marin.execution import ExecutorStep, this_output_path

    return ExecutorStep(
        name=name,
        fn=generate_k40_miniature,
        config=_versioned_config(SyntheticK40Config(
            output_path=this_output_path(),
            total_bytes=total_bytes,
            seed=seed,
            domains=None if domains is None else tuple(domains),
            files_per_source=files_per_source,
        ), keep=("output_path",)),
        description=f"K40-shaped miniature corpus, ~{total_bytes:,} bytes, seed {seed}",
        resources={"num_cpus": 1},
    )


def default_tokenizer(
    name: str,
    corpus,
    vocab_size: int = 8192,
    max_bytes: int = 50_000_000,
    text_field: str = "text",
    min_frequency: int = 2,
    on_corrupt: str = "skip",
    max_corrupt_fraction: float = 0.01,
):
    """Train a byte-level BPE tokenizer (``tokenizer.json`` in the step output) on ``corpus``.

    ``on_corrupt="skip"`` leaves corrupt files out (listed in ``tokenizer_info.json``) while at most
    ``max_corrupt_fraction`` of them are corrupt; ``"fail"`` stops on the first one."""
    from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer
    from marin.execution import ExecutorStep, this_output_path

    return ExecutorStep(
        name=name,
        fn=train_tokenizer,
        config=_versioned_config(TrainTokenizerConfig(
            input_path=_data_input(corpus),
            output_path=this_output_path(),
            vocab_size=vocab_size,
            max_bytes=max_bytes,
            text_field=text_field,
            min_frequency=min_frequency,
            on_corrupt=on_corrupt,
            max_corrupt_fraction=max_corrupt_fraction,
        ), keep=("input_path", "output_path")),
        description=f"byte-level BPE, vocab {vocab_size}",
        resources={"num_cpus": 1},
    )


def default_tokenize(
    name: str,
    source,
    tokenizer,
    sources: _Mapping[str, str] | None = None,
    text_field: str = "text",
    max_doc_bytes: int = 8_000_000,
    shard_max_tokens: int = 64 * 1024 * 1024,
    on_corrupt: str = "skip",
    max_corrupt_fraction: float = 0.01,
):
    """Tokenize the documents under ``source`` (a step or a path) with ``tokenizer`` (a step or a
    path to tokenizer.json / its directory) into a token store. ``sources`` maps source names to
    locations under ``source``; None discovers one source per directory (K40 layout: domain/bucket).
    ``on_corrupt="skip"`` leaves corrupt files out of the store (listed in its manifest) while at most
    ``max_corrupt_fraction`` of them are corrupt; ``"fail"`` fails the step on any corrupt file."""
    from marin.data.tokenize import TokenizeConfig, tokenize
    from marin.execution import ExecutorStep, this_output_path

    return ExecutorStep(
        name=name,
        fn=tokenize,
        config=_versioned_config(TokenizeConfig(
            input_path=_data_input(source),
            tokenizer=_data_input(tokenizer),
            output_path=this_output_path(),
            sources=None if sources is None else dict(sources),
            text_field=text_field,
            max_doc_bytes=max_doc_bytes,
            shard_max_tokens=shard_max_tokens,
            on_corrupt=on_corrupt,
            max_corrupt_fraction=max_corrupt_fraction,
        ), keep=TOKENIZE_UNVERSIONED),
        description=f"tokenize {name}",
        resources={"num_cpus": 1},
    )


def default_mixture(
    tokenized: _Sequence,
    domain_weights: _Mapping[str, float] | None = None,
    quality_weights: _Mapping[str, float] | None = None,
    stages: _Sequence = (),
    seed: int = 0,
    validation_fraction: float = 0.01,
    validation_max_documents: int = 1000,
    domain_quality_weights: _Mapping[str, _Mapping[str, float]] | None = None,
):
    """A :class:`marin.data.mixture.MixtureConfig` over tokenize steps (or store paths), for a
    training step's config. Placeholders inside it are resolved by the executor; the weights are
    versioned so changing the mixture changes the training step's hash, never the stores'."""
    from marin.data.mixture import MixtureConfig

    return _versioned_config(MixtureConfig(
        stores=tuple(_data_input(t) for t in tokenized),
        domain_weights=None if domain_weights is None else dict(domain_weights),
        quality_weights=None if quality_weights is None else dict(quality_weights),
        domain_quality_weights={d: dict(w) for d, w in (domain_quality_weights or {}).items()},
        stages=tuple(stages),
        seed=seed,
        validation_fraction=validation_fraction,
        validation_max_documents=validation_max_documents,
    ), keep=("stores",))


def default_mixture_report(name: str, mixture, total_tokens: int | None = None, total_steps: int | None = None):
    """A step writing ``mixture_report.json``: effective shares per stage, held-out sizes, epochs.
    ``total_steps`` places stages that start at fractions of the run."""
    from marin.data.mixture import MixtureReportConfig, mixture_report
    from marin.execution import ExecutorStep, this_output_path, versioned

    return ExecutorStep(
        name=name,
        fn=mixture_report,
        config=MixtureReportConfig(mixture, this_output_path(), versioned(total_tokens), versioned(total_steps)),
        description="effective token shares of a mixture",
        resources={"num_cpus": 1},
    )


# What a data step may leave out of its version: how the work is spread, never what it writes (the
# output is byte-identical with or without Ray, whatever the CPUs per task). batch_docs is versioned:
# shards are cut at batch boundaries, so it changes the files.
TOKENIZE_UNVERSIONED = ("input_path", "tokenizer", "output_path", "num_cpus_per_task", "show_progress", "use_ray")


def _versioned_config(config, keep: _Sequence[str] = ()):
    """``config`` (a dataclass) with every field wrapped in ``versioned`` except those in ``keep``
    (placeholders and settings that do not change what the step writes). Versioning by default means
    a field added to a config later is in the version unless someone decides otherwise. Built
    without ``__init__`` (checks there need plain values); the executor rebuilds the config through
    ``__init__`` when it resolves the placeholders, so each field is its own leaf (``model.n_layers``)."""
    import dataclasses

    from marin.execution import versioned

    out = object.__new__(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        object.__setattr__(out, f.name, value if f.name in keep else versioned(value))
    return out


# --- training track (default_train and friends) ------------------------------------------------
# A training step embeds a MixtureConfig (from default_mixture) and runs marin.training.steps.train
# on a device pool (marin.training.pools.POOLS). What defines the run is versioned: model, data,
# seed, batch and the original schedule. What an operator may change on a live run is not: the
# horizon re-plans (lr_replans), the transport switch step, the pool, checkpoint cadence and
# telemetry, so changing them keeps the output path and the step resumes from its checkpoints.


def default_train(
    name: str,
    *,
    mixture,
    model: str = "tiny-ep",
    model_overrides: _Mapping | None = None,
    train_steps: int = 100,
    tokens_per_step: int = 4096,
    seq_len_phases: _Sequence = ((0.0, 64),),
    peak_lr: float = 3e-3,
    warmup_steps: int = 10,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    compute_dtype: str | None = None,
    beta1: float = 0.9,
    beta2: float = 0.95,
    adam_eps: float = 1e-8,
    final_lr_fraction: float | None = None,
    seed: int = 0,
    pool: str = "local-cpu",
    lr_replans: _Sequence = (),
    transport_switches: _Sequence = (),
    checkpoint_every_steps: int = 100,
    checkpoint_every_minutes: float | None = 30.0,
    keep_last_checkpoints: int = 2,
    keep_every_steps: int | None = None,
    wandb_project: str | None = "marin",
    log_every: int = 1,
    description: str | None = None,
    microbatches: int | None = None,
    memory_check: str = "error",
    eval_every_steps: int | None = None,
    eval_sets: _Sequence = (),
):
    """A training step: ``model`` preset (+ ``model_overrides``) on ``mixture`` over ``pool``.

    ``seq_len_phases`` are ``(fraction of steps, seq_len)`` pairs at constant ``tokens_per_step``
    (the hero: ``((0, 4096), (0.5, 8192), (0.95, 65536))``). ``lr_replans`` are ``(at_step,
    new_total_steps)`` pairs; ``transport_switches`` are ``(step, transport)`` pairs, e.g.
    ``((0, "fixed"), (81716, "dropless"))``. ``mixture`` may also be a
    ``marin.training.SyntheticDataConfig`` for tests. ``microbatches`` splits each step for gradient
    accumulation (default: the smallest count the memory planner says fits; not versioned).
    ``memory_check`` ("error", "warn" or "off"): what to do at declaration time when the planner says
    a phase of the run does not fit its pool's device memory.

    The step's version holds the resolved model (every ``MoEConfig`` field after the preset,
    ``model_overrides`` and ``compute_dtype``; z-loss weight, router-bias update and rate, capacity
    factor, dtype and remat policy are set through ``model_overrides``), so editing a preset re-runs
    the steps that use it. ``final_lr_fraction`` None keeps the schedule's default.

    ``eval_every_steps`` evaluates bits per byte on the mixture's held-out split (plus ``eval_sets``,
    see :func:`default_eval_suite`) every that many steps and at the last step, as ``kind: "eval"``
    records in metrics.jsonl. It is telemetry, not part of the run's identity; named ``eval_sets``
    do add their tokenize steps as dependencies, which are.
    """
    from marin.execution import ExecutorStep, this_output_path, versioned
    from marin.training.config import TrainConfig, resolve_model
    from marin.training.schedule import DEFAULT_FINAL_LR_FRACTION
    from marin.training.pools import get_pool
    from marin.training.steps import train

    from marin.training.config import SyntheticDataConfig

    get_pool(pool)  # fail at declaration time on a typo, not inside a Ray task
    _check_train_memory(memory_check, TrainConfig(
        output_path="", data=None, model=model, model_overrides=dict(model_overrides or {}), pool=pool,
        train_steps=train_steps, tokens_per_step=tokens_per_step, compute_dtype=compute_dtype,
        seq_len_phases=tuple((float(f), int(n)) for f, n in seq_len_phases), microbatches=microbatches,
        transport_switches=tuple((int(s), str(t)) for s, t in transport_switches)))
    # default_mixture versions its own fields; a synthetic stream is versioned whole.
    data = versioned(mixture) if isinstance(mixture, SyntheticDataConfig) else mixture
    phases = tuple((float(f), int(n)) for f, n in seq_len_phases)
    resolved = resolve_model(model, dict(model_overrides or {}), compute_dtype, phases)
    config = TrainConfig(
        output_path=this_output_path(),
        data=data,
        # one versioned leaf per field, so `marin explain` names the field that changed (model.n_layers)
        model=_versioned_config(resolved),
        preset=versioned(model),
        pool=pool,
        seed=versioned(seed),
        train_steps=versioned(train_steps),
        tokens_per_step=versioned(tokens_per_step),
        seq_len_phases=versioned(phases),
        peak_lr=versioned(peak_lr),
        warmup_steps=versioned(warmup_steps),
        final_lr_fraction=versioned(DEFAULT_FINAL_LR_FRACTION if final_lr_fraction is None else final_lr_fraction),
        weight_decay=versioned(weight_decay),
        beta1=versioned(beta1),
        beta2=versioned(beta2),
        adam_eps=versioned(adam_eps),
        grad_clip=versioned(grad_clip),
        lr_replans=tuple((int(a), int(t)) for a, t in lr_replans),
        transport_switches=tuple((int(s), str(t)) for s, t in transport_switches),
        checkpoint_every_steps=checkpoint_every_steps,
        checkpoint_every_minutes=checkpoint_every_minutes,
        keep_last_checkpoints=keep_last_checkpoints,
        keep_every_steps=keep_every_steps,
        wandb_project=wandb_project,
        log_every=log_every,
        microbatches=microbatches,
        eval_every_steps=eval_every_steps,
        eval_sets=tuple(eval_sets),
    )
    return ExecutorStep(
        name=name,
        fn=train,
        config=config,
        description=description or f"train {model} for {train_steps} steps x {tokens_per_step} tokens on {pool}",
        # The step's own task only waits on the pool's placement group; it must not hold a CPU the
        # pool's hosts need.
        resources={"num_cpus": 0},
    )


def _check_train_memory(mode: str, config) -> None:
    """Plan-time memory check of a training step (marin.training.planning): a step that cannot fit
    its pool fails when the experiment file is read (dry runs included), not on 176 hosts."""
    import warnings

    from marin.training.planning import StepDoesNotFit, check_train_config_fits

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


# --- review (health of a run against the seed's healthy ranges) --------------------------------


def default_health_report(name: str, train_step, total_steps: int | None = None, fit=None,
                          plan_mfu: float | None = None, plan_tokens_per_s: float | None = None):
    """A step writing ``health.json`` for ``train_step``: loss falling, drops < 8%, grad-norm peak;
    with ``fit`` (a ``default_ladder_fit`` step), also window by window against its prediction."""
    from marin.execution import ExecutorStep, output_path_of, this_output_path, versioned
    from marin.monitoring.health import HealthReportConfig, health_report_step

    return ExecutorStep(
        name=name,
        fn=health_report_step,
        config=HealthReportConfig(run_path=output_path_of(train_step), output_path=this_output_path(),
                                  total_steps=versioned(total_steps),
                                  fit_path=None if fit is None else output_path_of(fit),
                                  plan_mfu=versioned(plan_mfu), plan_tokens_per_s=versioned(plan_tokens_per_s)),
        description=f"health of {train_step.name}",
        resources={"num_cpus": 1},
    )


def default_report(name: str, steps, description: str | None = None):
    """A step writing ``report.html`` (the ``marin report`` page) for ``steps`` and everything they read.

    It depends on every step it reports, so it runs after them and is made again whenever one of
    them changes (their hashes are part of its version).
    """
    from marin.execution import ExecutorStep, output_path_of, this_output_path
    from marin.review.report import ReportConfig, report_step

    return ExecutorStep(
        name=name,
        fn=report_step,
        config=ReportConfig(name=name, step_paths=[output_path_of(s) for s in steps], output_path=this_output_path(),
                            description=description),
        description=f"report of {', '.join(s.name for s in steps)}",
        resources={"num_cpus": 1},
    )


# --- scaling ladder (fit the rungs, predict the target) -------------------------------------------


def _rung_run(name: str, train_step, eval_step=None, *, with_outputs: bool = True):
    """What a ladder fit needs to know about a training step: its resolved model and schedule
    (read from the step's config at declaration time) and, ``with_outputs``, where its outputs are.
    A target read without outputs is not a dependency of the fit. Every value is versioned: the
    model as it resolves, not the preset's name."""
    import dataclasses

    from marin.execution import output_path_of, versioned
    from marin.execution.step import VersionedValue
    from marin.scaling.ladder import RungRun

    def v(x):
        return x.value if isinstance(x, VersionedValue) else x

    c = train_step.config
    # default_train versions the resolved model field by field; unwrap it to the model itself
    model = dataclasses.replace(c.model, **{f.name: v(getattr(c.model, f.name)) for f in dataclasses.fields(c.model)})
    return RungRun(
        name=versioned(name),
        model=versioned(model),
        train_steps=versioned(int(v(c.train_steps))),
        tokens_per_step=versioned(int(v(c.tokens_per_step))),
        seq_len_phases=versioned(tuple((float(f), int(n)) for f, n in v(c.seq_len_phases))),
        warmup_steps=versioned(int(v(c.warmup_steps))),
        run_path=output_path_of(train_step) if with_outputs else None,
        eval_path=output_path_of(eval_step) if with_outputs and eval_step is not None else None,
    )


def default_ladder_fit(
    name: str,
    rungs: _Sequence,
    target,
    *,
    validation=None,
    fractions: _Sequence[float] = (0.03, 0.1, 0.3, 0.5, 1.0),
    n_boot: int = 400,
    max_validation_rel_error: float | None = None,
):
    """A step writing ``fit.json`` and plots: scaling laws over ``rungs`` (``(train_step, eval_step
    or None)`` pairs) predicting ``target`` (a training step, read for its model and schedule only:
    it need not have run). ``validation`` (a ``(train_step, eval_step or None)`` pair, never fitted)
    adds ``validation_rel_error``; with ``max_validation_rel_error`` the step fails beyond it."""
    from marin.execution import ExecutorStep, this_output_path, versioned
    from marin.scaling.ladder import LadderFitConfig, ladder_fit_step

    runs = tuple(_rung_run(t.name.rsplit("/", 1)[-1], t, e) for t, e in rungs)
    val = None if validation is None else _rung_run(validation[0].name.rsplit("/", 1)[-1], *validation)
    return ExecutorStep(
        name=name,
        fn=ladder_fit_step,
        config=LadderFitConfig(
            rungs=runs,
            target=_rung_run(target.name.rsplit("/", 1)[-1], target, with_outputs=False),
            output_path=this_output_path(),
            validation=val,
            fractions=versioned(tuple(float(f) for f in fractions)),
            n_boot=versioned(n_boot),
            max_validation_rel_error=max_validation_rel_error,
        ),
        description=f"ladder fit over {len(runs)} rungs -> {target.name}",
        resources={"num_cpus": 1},
    )


# --- evaluation (bits per byte of held-out text; see docs/evaluation.md) ----------------------------
# An eval suite is a tuple of marin.evaluation.sets.EvalSet: named text datasets tokenized once with
# the run's tokenizer (default_eval_suite), and/or a mixture's held-out split (default_validation_sets).
# default_eval scores committed checkpoints of a training step on them and writes eval.json.


def default_eval_suite(suite: _Mapping[str, str], tokenizer, text_field: str = "text", prefix: str = "eval"):
    """A Paloma-style suite in one line: ``{set name: path, directory or glob}`` of jsonl / jsonl.gz /
    jsonl.zst / parquet files on any fsspec path, each tokenized once (a tokenize step named
    ``{prefix}/{name}``) with ``tokenizer`` (a step or a path: use the run's)."""
    from marin.evaluation.sets import EvalSet
    from marin.execution import output_path_of, versioned

    out = []
    for name, path in suite.items():
        path = str(path)
        parts = path.rstrip("/").split("/")
        glob_at = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)
        if glob_at is None:  # a file or a directory: the whole location is the one source
            base, loc = path, ""
        else:
            base, loc = "/".join(parts[:glob_at]), "/".join(parts[glob_at:])
        step = default_tokenize(f"{prefix}/{name}", base, tokenizer, sources={name: loc}, text_field=text_field)
        out.append(EvalSet(name=versioned(name), store=output_path_of(step)))
    return tuple(out)


def default_validation_sets(mixture, name: str = "val"):
    """The held-out split of a ``default_mixture`` as eval sets, one per domain (``{name}/{domain}``)."""
    from marin.evaluation.sets import mixture_validation_sets

    return mixture_validation_sets(mixture, name)


def _versioned_eval_set(es):
    """Every field of an EvalSet that is not a placeholder yet becomes versioned (it changes the scores)."""
    import dataclasses

    from marin.execution import versioned
    from marin.execution.step import InputName, OutputName, VersionedValue

    def v(x):
        return x if isinstance(x, (VersionedValue, InputName, OutputName)) else versioned(x)

    return dataclasses.replace(es, **{f.name: v(getattr(es, f.name)) for f in dataclasses.fields(es)})


def default_eval(
    name: str,
    train_step,
    eval_sets: _Sequence = (),
    checkpoint: str | int = "latest",
    pool: str | None = None,
    *,
    held_out: bool = False,
    seq_len: int | None = None,
    stride: int | None = None,
    tasks: _Mapping[str, str] | None = None,
):
    """A step writing ``eval.json``: bits per byte of ``train_step``'s committed checkpoint(s) on
    ``eval_sets`` (and, with ``held_out``, its mixture's held-out split).

    ``checkpoint``: "latest", a step number, or "all" (every retained checkpoint; ``eval.json`` then
    also holds ``checkpoints``, one record each in step order). ``pool``: None runs on the training
    step's pool. Windows are the run's longest training sequence (``seq_len``) and disjoint unless
    ``stride`` is given (then every token has at least ``seq_len - stride`` tokens of context).
    ``tasks``: multiple-choice tasks ``{name: jsonl path}``, scored as accuracy and byte-normalised
    accuracy under ``"tasks"`` in ``eval.json``.
    """
    from marin.evaluation.step import EvalConfig, evaluate
    from marin.execution import (
        ExecutorStep,
        output_path_of,
        this_output_path,
        versioned,
    )
    from marin.training.pools import get_pool

    if pool is not None:
        get_pool(pool)
    if not (checkpoint in ("latest", "all") or isinstance(checkpoint, int)):
        raise ValueError(f"checkpoint must be 'latest', 'all' or a step number, got {checkpoint!r}")
    sets = tuple(_versioned_eval_set(es) for es in eval_sets)
    if not sets and not held_out and not tasks:
        raise ValueError(f"default_eval {name!r}: nothing to evaluate; pass eval_sets, held_out=True or tasks")
    return ExecutorStep(
        name=name,
        fn=evaluate,
        config=EvalConfig(
            run_path=output_path_of(train_step),
            output_path=this_output_path(),
            sets=sets,
            checkpoint=versioned(checkpoint),
            held_out=versioned(held_out),
            pool=pool,
            seq_len=versioned(seq_len),
            stride=versioned(stride),
            tasks=versioned(dict(tasks or {})),
        ),
        description=f"evaluate {train_step.name} ({checkpoint} checkpoint)",
        # Like training, the step's own task only waits on the pool it launches.
        resources={"num_cpus": 0},
    )
