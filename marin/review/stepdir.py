"""One step's directory as the notebook API reads it: :class:`Step` (identity, status, config,
metrics, files and outputs; read lazily, cached). Its outputs are the ones of the table in
:mod:`marin.review.outputs`."""

from __future__ import annotations

import json
import os
from typing import Any

from marin.execution import status as st
from marin.execution import storage
from marin.review import outputs as step_outputs
from marin.review.steps import StepState, step_state, train_horizon


class Step:
    """One step's directory: its identity, status, config and outputs (read lazily, cached)."""

    def __init__(self, output_path: str, *, name: str | None = None, hash: str | None = None,
                 outcome: str | None = None, dependencies: list[str] | None = None,
                 version: dict | None = None, planned_config: Any = None) -> None:
        self.output_path = output_path.rstrip("/")
        self._name, self._hash = name, hash
        self.outcome = outcome
        """This run's outcome from the experiment record (cached, succeeded, failed, ...), if any."""
        self._dependencies = dependencies
        self._version = version
        self._planned_config = planned_config
        self._info: dict | None | bool = False
        self._record: dict | None | bool = False
        self._lease: Any = False  # the lease read with the status (False: not read)
        self._state: StepState | None = None

    def __repr__(self) -> str:
        return f"Step({self.name}-{self.hash}, {self.status})"

    # identity ---------------------------------------------------------------------------------- #
    @property
    def info(self) -> dict[str, Any]:
        """What the step is: config, version, lineage, code, host; the error of a failed attempt
        (empty before the step first started)."""
        if self._info is False:
            self._info = st.read_info(self.output_path, self.status_record or {})
        return self._info or {}

    @property
    def name(self) -> str:
        return self._name or self.info.get("name") or self.output_path.rsplit("/", 1)[-1].rpartition("-")[0]

    @property
    def hash(self) -> str:
        return self._hash or self.info.get("hash") or self.output_path.rsplit("/", 1)[-1].rpartition("-")[2]

    @property
    def dependencies(self) -> list[str]:
        """Output paths of the steps this one reads."""
        if self._dependencies is not None:
            return self._dependencies
        return list(self.info.get("dependencies") or [])

    @property
    def fn(self) -> str | None:
        return self.info.get("fn")

    @property
    def description(self) -> str | None:
        return self.info.get("description")

    # status ------------------------------------------------------------------------------------ #
    @property
    def status_record(self) -> dict[str, Any] | None:
        if self._record is False:
            self._record, self._lease = st.read_status_and_lease(self.output_path)
        return self._record or None

    @property
    def state(self) -> StepState:
        if self._state is None:
            self._state = step_state(self.output_path, self.status_record, self.outcome, lease=self._lease)
        return self._state

    @property
    def status(self) -> str:
        """SUCCESS, FAILED, RUNNING, DEP_FAILED, NOT_RUN, or a newer executor's value."""
        return self.state.status

    @property
    def duration_s(self) -> float | None:
        return st.attempt_times(self.status_record)[0]

    @property
    def start_time(self) -> float | None:
        return st.attempt_times(self.status_record)[1]

    @property
    def end_time(self) -> float | None:
        return st.attempt_times(self.status_record)[2]

    @property
    def error(self) -> str | None:
        return self.info.get("error")

    @property
    def traceback(self) -> str | None:
        return self.info.get("traceback")

    # config ------------------------------------------------------------------------------------ #
    @property
    def config(self) -> Any:
        """The resolved config as recorded when the step ran (secrets masked), else as planned."""
        if "config" in self.info:
            return self.info["config"]
        return self._planned_config

    @property
    def version(self) -> dict[str, Any]:
        """What the hash is made of: ``{"config": {field path: value}, "dependencies": {...}, ...}``."""
        return self.info.get("version") or self._version or {}

    @property
    def versioned_fields(self) -> dict[str, Any]:
        return dict(self.version.get("config") or {})

    # outputs ----------------------------------------------------------------------------------- #
    def files(self) -> list[tuple[str, int | None]]:
        """``(relative path, size in bytes)`` of the step's outputs (executor files left out); a
        directory is listed with its total size."""
        out = []
        if not storage.exists(self.output_path):
            return out
        if storage.is_local(self.output_path):
            for entry in sorted(os.scandir(self.output_path), key=lambda e: e.name):
                if entry.name.startswith((".executor", ".tmp-")):
                    continue
                out.append((entry.name + ("/" if entry.is_dir() else ""), _size(entry.path)))
            return out
        for entry in storage.list_dir(self.output_path):
            base = entry.rstrip("/").rsplit("/", 1)[-1]
            if not base.startswith((".executor", ".tmp-")):
                out.append((base, None))
        return out

    def read_json(self, name: str) -> Any:
        """A JSON output of the step, or None when it is absent (or not JSON)."""
        return storage.read_json(f"{self.output_path}/{name}")

    def metric_records(self) -> list[dict[str, Any]]:
        """Every record of the step's ``metrics.jsonl`` (training and eval records), in file order."""
        text = storage.read_text(f"{self.output_path}/metrics.jsonl")
        if not text:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def metrics(self, kind: str | None = "train") -> Any:
        """The step's ``metrics.jsonl`` as a ``pyarrow.Table`` (one row per record, one column per key).

        ``kind="train"`` keeps training records, ``"eval"`` the evaluation records (``"kind": "eval"``),
        None keeps all. Needs pyarrow (``pip install 'marin[data]'``).
        """
        try:
            import pyarrow as pa  # pyarrow: the data extra, only for a table of metrics
        except ImportError:
            raise ImportError("Step.metrics() needs pyarrow: pip install 'marin[data]'") from None
        rows = self.metric_records()
        if kind is not None:
            rows = [r for r in rows if r.get("kind", "train") == kind]
        keys: dict[str, None] = {}
        for r in rows:
            keys.update(dict.fromkeys(r))
        return pa.table({k: [r.get(k) for r in rows] for k in keys})

    def output(self, name: str) -> Any:
        """One of the step's outputs (:data:`marin.review.outputs.OUTPUTS`) by file name or key
        (``"gate.json"`` or ``"gate"``; a key two files share reads the first present), or None
        when the step has none (or the file is not that output: a foreign or damaged file)."""
        kinds = step_outputs.outputs_named(name)
        if not kinds:
            raise KeyError(f"no step output {name!r}; outputs: {', '.join(o.file for o in step_outputs.OUTPUTS)}")
        for o in kinds:
            data = self.read_json(o.file)
            if o.accept(data):
                return data
        return None

    def outputs(self) -> dict[str, Any]:
        """Every output the step has: file name -> its JSON."""
        return {o.file: data for o in step_outputs.OUTPUTS if (data := self.output(o.file)) is not None}

    def health(self) -> dict[str, Any] | None:
        """The health checklist (``health.json``) of a health step, or None."""
        return self.output("health.json")

    def eval_results(self) -> dict[str, Any] | None:
        """Evaluation results (``eval.json``: per-set documents, tokens, loss, bpb; macro/micro bpb), or None."""
        return self.output("eval.json")

    def ladder_fit(self) -> dict[str, Any] | None:
        """A scaling-ladder fit (``fit.json``: target, predictions with bands, parameters), or None."""
        return self.output("fit.json")

    def isoflop_fit(self) -> dict[str, Any] | None:
        """An IsoFLOP fit (``isoflop.json``: parabolas, frontier, loss surface, validation), or None."""
        return self.output("isoflop.json")

    def harness_results(self) -> dict[str, Any] | None:
        """lm-evaluation-harness results (``harness.json``: a summary per task and metric), or None."""
        return self.output("harness.json")

    def gate(self) -> dict[str, Any] | None:
        """A paired gate's verdicts (``gate.json``: the arms, their metrics and each verdict), or None."""
        return self.output("gate")

    def mixture_report(self) -> dict[str, Any] | None:
        return self.output("mixture_report.json")

    def manifest(self) -> dict[str, Any] | None:
        """A token store's ``manifest.json`` (documents, tokens and skipped documents per source), or None."""
        return self.output("manifest.json")

    def corpus_filter(self) -> dict[str, Any] | None:
        """A dedup or decontamination step's manifest (documents and bytes in and out per domain and
        source, removed per reason, clusters or matches per evaluation set, a sample), or None."""
        return self.output("corpus_filter")

    def train_summary(self) -> dict[str, Any] | None:
        return self.output("train_summary.json")

    @property
    def horizon(self) -> int | None:
        """A training step's total steps, from its config (never from how far it got)."""
        return train_horizon(self.config)


def _size(path: str) -> int:
    if not os.path.isdir(path):
        try:
            return os.path.getsize(path)
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total
