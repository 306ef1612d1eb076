"""EleutherAI's lm-evaluation-harness on marin models: an ``lm_eval`` model class, registered as ``marin``.

:class:`MarinLM` implements the three request types with marin's own scorers, so the harness and
marin agree by construction:

- ``loglikelihood(context, continuation)``: :func:`marin.evaluation.multiple_choice.pair_logliks`,
  the scorer of marin's multiple-choice tasks ([EOS] + context, the pair encoded as the harness
  splits it), plus ``is_greedy``;
- ``loglikelihood_rolling(text)``: [EOS] + the text's tokens in disjoint windows of ``seq_len``,
  the windows ``marin eval`` scores documents with, so bits per byte match ``marin eval``'s;
- ``generate_until(context, gen_kwargs)``: KV-cache decoding (:mod:`marin.models.decode`), greedy
  unless ``do_sample``; the text is cut at the first ``until`` string.

Tasks come from local YAML (``include_path``) and local data files: nothing needs hub access.
lm_eval's stock command line cannot import a third-party model class; ``marin harness`` (or
:func:`evaluate_tasks` from Python) runs lm_eval's own ``simple_evaluate`` with this class.
Importing this module imports lm_eval (the ``eval`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import lm_eval
import lm_eval.evaluator
import numpy as np
import yaml
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.loggers.utils import get_commit_from_path
from lm_eval.utils import make_table

from marin.data.tokenizer import load_tokenizer
from marin.evaluation.multiple_choice import pair_logliks
from marin.evaluation.windows import pack_windows
from marin.models.exported import load_exported
from marin.models.sampling import Sampling

DEFAULT_MAX_GEN_TOKS = 256


class HarnessTaskError(ValueError):
    """A harness task that cannot be run: its directory, YAML or data file is missing or malformed."""


@register_model("marin")
class MarinLM(LM):
    """A marin model (params, router bias, MoEConfig, tokenizer) as an lm_eval LM.

    ``seq_len``: the window (default: the model's context); ``batch_rows``: rows per forward.
    From lm_eval's model registry (``model="marin", model_args="export=DIR"``) it loads an export
    directory (``marin export``) with its tokenizer."""

    def __init__(self, params=None, router_bias=None, cfg=None, tokenizer=None, mesh=None, *, export: str | None = None,
                 seq_len: int | None = None, batch_rows: int = 16, **_lm_eval_options):
        super().__init__()
        if export is not None:
            cfg, params, router_bias = load_exported(export)
            tokenizer = load_tokenizer(os.path.join(export, "tokenizer.json"))
        if params is None or cfg is None or tokenizer is None:
            raise ValueError("MarinLM needs params, router_bias, cfg and tokenizer (or export=DIR)")
        self.params, self.router_bias, self.cfg, self.tok, self.mesh = params, router_bias, cfg, tokenizer, mesh
        self.seq_len = int(seq_len or cfg.max_seq_len)
        n = 1 if mesh is None else mesh.size
        self.batch_rows = max(n, int(batch_rows) // n * n)

    # ---- lm_eval's three request types ----------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        if not requests:
            return []
        pairs = [(str(r.args[0]), str(r.args[1])) for r in requests]
        ll, greedy = pair_logliks(pairs, self.tok, self.params, self.router_bias, self.cfg, self.mesh, self.seq_len,
                                  self.batch_rows, greedy=True)
        return [(float(a), bool(g)) for a, g in zip(ll, greedy)]

    def loglikelihood_rolling(self, requests) -> list[float]:
        return [float(x) for x in self.rolling_logliks([str(r.args[0]) for r in requests])]

    def rolling_logliks(self, texts: list[str]) -> np.ndarray:
        """Summed log-likelihood (nats) of each whole text: [EOS] + its tokens, disjoint windows."""
        from marin.evaluation.evaluator import sequence_nll  # JAX: marin harness sets the pool's devices first

        if not texts:
            return np.zeros(0)
        seqs = [np.array([self.tok.eos_id, *ids], np.int32) for ids in self.tok.encode_batch(texts)]
        rows = pack_windows(seqs, self.seq_len).padded_to(self.batch_rows)
        return -sequence_nll(self.params, self.router_bias, rows, len(seqs), self.cfg, self.mesh, self.batch_rows)

    def generate_until(self, requests) -> list[str]:
        from marin.models.decode import generate_tokens  # JAX: marin harness sets the pool's devices first

        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        for key, idx in groups.items():
            kw = json.loads(key)
            until = kw.get("until") or [self.tok.eos_token]
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(1, min(int(kw.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), self.seq_len - 1))
            if kw.get("do_sample") and float(kw.get("temperature", 1.0)) > 0:
                sampling = Sampling(temperature=float(kw.get("temperature", 1.0)), seed=int(kw.get("seed", 0)))
            else:
                sampling = Sampling(greedy=True)
            budget = min(self.seq_len, self.cfg.max_seq_len) - max_new  # context kept: its last tokens
            prompts = [[self.tok.eos_id, *self.tok.encode_batch([str(requests[i].args[0])])[0]][-budget:] for i in idx]
            for start in range(0, len(idx), self.batch_rows):
                chunk = idx[start:start + self.batch_rows]
                new = generate_tokens(self.params, self.router_bias, self.cfg, prompts[start:start + len(chunk)],
                                      max_new, sampling, stop_ids=(self.tok.eos_id,), mesh=self.mesh)
                for i, ids in zip(chunk, new):
                    text = self.tok.decode([t for t in ids if t != self.tok.eos_id])
                    cut = min([text.find(u) for u in until if u and u in text], default=len(text))
                    out[i] = text[:cut]
        return [o or "" for o in out]


# ---- running tasks ----------------------------------------------------------------------------------
def check_tasks(tasks: list[str], include_path: str | None):
    """A TaskManager that knows every task of ``tasks``, after checking the local task files: the
    directory exists, every YAML parses, and every local data file a task names exists."""
    if not tasks:
        raise HarnessTaskError("no tasks given: pass --tasks NAME[,NAME...]")
    task_files: list[tuple[str, int, int]] = []
    if include_path is not None:
        if not os.path.isdir(include_path):
            raise HarnessTaskError(f"task directory not found: {include_path} (pass --include-path with a directory "
                                   "of task YAML files)")
        for root, _, files in os.walk(include_path):
            for fname in sorted(files):
                if fname.endswith((".yaml", ".yml")):
                    path = os.path.join(root, fname)
                    _check_yaml(path)
                    st = os.stat(path)
                    task_files.append((path, st.st_mtime_ns, st.st_size))
    manager = _task_manager(include_path, tuple(task_files))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"in {include_path}" if include_path else "(no --include-path given)"
        raise HarnessTaskError(f"unknown harness task {unknown[0]!r} {where}: check the task: name in its YAML file")
    return manager


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: str | None, task_files: tuple[tuple[str, int, int], ...]):
    """lm_eval's task index for ``include_path``, built once per state of its task files (``task_files``:
    path, mtime and size of each YAML, so an edited task is indexed again). Building one indexes every
    task lm_eval ships (about 15,000 YAML files, tens of CPU seconds), whatever the local tasks are."""
    from lm_eval.tasks import TaskManager  # lm_eval's task registry: slow to import, only when tasks run

    return TaskManager(include_path=include_path)


def _check_yaml(path: str) -> None:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise HarnessTaskError(f"task file {path}{line} is not valid YAML: fix or remove it") from None
    if not isinstance(doc, dict) or not ("task" in doc or "group" in doc or "include" in doc):
        raise HarnessTaskError(f"task file {path} has no 'task:' name: every task YAML needs one")
    files = ((doc.get("dataset_kwargs") or {}).get("data_files")) or {}
    for split, names in (files.items() if isinstance(files, dict) else [("data", files)]):
        for name in [names] if isinstance(names, str) else list(names):
            full = name if os.path.isabs(name) else os.path.join(os.path.dirname(path), name)
            if "://" not in name and not os.path.exists(full):
                raise HarnessTaskError(f"task file {path}: its {split} data file {name} does not exist")


logger = logging.getLogger(__name__)


def quiet_git_commit_hash() -> str | None:
    """lm_eval's record of the working directory's git commit, asked the same way (``git describe
    --always``, else the ``.git`` folder) but with git's complaint kept off the terminal: outside a
    repository git prints "fatal: not a git repository" on every evaluation, about a directory that
    has nothing to do with the model (marin records its own code fingerprint in the step's record)."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no git on this machine
        return get_commit_from_path(os.getcwd())
    if done.returncode != 0:
        logger.debug("no git commit for lm_eval's record: %s", done.stderr.strip())
        return get_commit_from_path(os.getcwd())
    return done.stdout.strip()


@contextlib.contextmanager
def _quiet_git() -> Iterator[None]:
    """lm_eval's evaluator asks :func:`quiet_git_commit_hash` instead of its own, for this block."""
    own = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = quiet_git_commit_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = own


def evaluate_tasks(lm: MarinLM, tasks: list[str], *, include_path: str | None = None, limit: int | None = None,
                   output_path: str | None = None) -> dict[str, Any]:
    """lm_eval's ``simple_evaluate`` of ``tasks`` on ``lm``; with ``output_path`` its results JSON is
    written there by lm_eval's own EvaluationTracker (``<output_path>/marin/results_<time>.json``)."""
    manager = check_tasks(tasks, include_path)
    with _quiet_git():
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                          log_samples=False, bootstrap_iters=0)
    if output_path:
        from lm_eval.loggers import EvaluationTracker  # slow to import, only when results are written

        tracker = EvaluationTracker(output_path=output_path)
        tracker.general_config_tracker.model_name = "marin"
        tracker.general_config_tracker.model_name_sanitized = "marin"
        tracker.save_results_aggregated(results=results, samples=None)
    return results


def summary(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm_eval results (the ``,none`` filter suffix dropped; stderr out)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        out[task] = {k.split(",")[0]: v for k, v in metrics.items()
                     if "," in k and "stderr" not in k and isinstance(v, (int, float))}
    return out


def format_results(results: dict[str, Any]) -> str:
    return make_table(results)
