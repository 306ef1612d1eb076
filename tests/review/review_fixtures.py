"""Step directories for review tests, written by the executor's own record-keeping functions.

Running hundreds of real steps through Ray would take minutes on a small machine; the review code
only reads what the executor writes (status, lease, info, experiment record, outputs), so these
fixtures write exactly that with the executor's functions: ``plan_steps``, ``write_status``,
``step_info``, ``try_acquire``/``write_status``/``release`` and ``write_experiment_record``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import traceback

from marin.execution import (
    ExecutorStep,
    output_path_of,
    plan_steps,
    resolve_config,
    this_output_path,
    versioned,
)
from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution.experiment_record import write_experiment_record
from marin.execution.options import RunOptions
from marin.execution.status import StepStatus
from marin.execution.tasks import step_info
from marin.execution.versioning import live


def noop(config):  # the function every fixture step "ran"
    return None


@dataclasses.dataclass(frozen=True)
class TrainLikeConfig:
    data: str
    output_path: str
    train_steps: int
    peak_lr: float
    wandb_api_key: str | None = live("a credential: who logs, not what is written", default=None)
    log_every: int = live("how often it logs, not what it computes", default=1)


def _succeed(ps, plan, holder="fixture-host:1:abc"):
    d = ps.output_path
    os.makedirs(d, exist_ok=True)
    # the held lease records the attempt and what it runs: RUNNING
    lease = leases.try_acquire(d, holder, info=step_info(ps, resolve_config(ps, plan), holder))
    return lease, st.read_status(d)


def _finish(ps, lease, rec):
    st.write_status(ps.output_path, StepStatus.SUCCESS, lease=lease, previous=rec,
                    started=rec["events"][-1]["time"], consume=leases.lease_path(ps.output_path))


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def train_records(n: int, transport_switch: int, seq_switch: int) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        out.append(
            {
                "step": i,
                "loss": 7.0 * math.exp(-i / (n / 3)) + 2.0,
                "ce_loss": 7.0 * math.exp(-i / (n / 3)) + 1.9,
                "grad_norm": 0.5 + (3.5 if i == n // 3 else 0.0),
                "lr": 1e-3 * min(1.0, i / 5),
                "drop_frac_send": 0.02 if i < transport_switch else 0.0,
                "drop_frac_recv": 0.03 if i < transport_switch else 0.0,
                "expert_load_max": 1.4,
                "expert_load_mean": 1.2,
                "tokens_per_s": 30000.0,
                "mfu": 0.07,
                "tokens": 4096 * i,
                "seq_len": 64 if i < seq_switch else 128,
                "transport": "fixed" if i < transport_switch else "dropless",
            }
        )
        if i % 20 == 0:
            out.append({"kind": "eval", "step": i, "eval/web/bpb": 1.5 - i / 1000, "eval/code/bpb": 1.3 - i / 1000,
                        "eval/macro_bpb": 1.4 - i / 1000, "eval/task/k40/acc": 0.25 + i / 200,
                        "eval/task/k40/gold_bpb": 2.0 - i / 100})
    return out


def build_small(prefix: str) -> dict:
    """A 7-step experiment with every kind of section: succeeded, reused, failed, running, interrupted
    and never-run steps; a training step with metrics and eval records; eval, fit and health results."""
    corpus = ExecutorStep("small/corpus", noop, {"out": this_output_path(), "n": versioned(3)})
    tok = ExecutorStep("small/tokenized", noop, {"corpus": output_path_of(corpus), "out": this_output_path()})
    train = ExecutorStep("small/train", noop, TrainLikeConfig(data=output_path_of(tok), output_path=this_output_path(),
                                                              train_steps=versioned(60), peak_lr=versioned(1e-2),
                                                              wandb_api_key="sk-verysecretvalue"))
    evals = ExecutorStep("small/eval", noop, {"run": output_path_of(train), "out": this_output_path()})
    ladder = ExecutorStep("small/ladder-fit", noop, {"run": output_path_of(train), "out": this_output_path()})
    broken = ExecutorStep("small/broken", noop, {"run": output_path_of(tok), "out": this_output_path()})
    live = ExecutorStep(
        "small/live-train",
        noop,
        TrainLikeConfig(
            data=output_path_of(tok),
            output_path=this_output_path(),
            train_steps=versioned(100),
            peak_lr=versioned(2e-2),
        ),
    )
    stopped = ExecutorStep("small/stopped", noop, {"run": output_path_of(tok), "out": this_output_path()})
    never = ExecutorStep("small/never", noop, {"run": output_path_of(broken), "out": this_output_path()})
    roots = [evals, ladder, never, live, stopped]
    plan = plan_steps(roots, prefix)
    p = {s: plan.planned(s) for s in (corpus, tok, train, evals, ladder, broken, live, stopped, never)}

    for s in (corpus, tok, train, evals, ladder):
        lease, rec = _succeed(p[s], plan)
        out = p[s].output_path
        if s is corpus:
            with open(f"{out}/corpus.jsonl", "w") as f:
                f.write('{"text": "hello"}\n' * 100)
        if s is tok:
            json.dump({"totals": {"documents": 97, "tokens": 1000, "bytes": 500, "skipped_bytes": 30, "files": 2,
                                  "skipped": {"invalid_utf8": 2, "empty": 1}},
                       "sources": {"web/q1": {"skipped": {"invalid_utf8": 2}}, "code/q2": {"skipped": {"empty": 1}}}},
                      open(f"{out}/manifest.json", "w"))
        if s is train:
            with open(f"{out}/metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in train_records(60, transport_switch=40, seq_switch=30))
        if s is evals:
            json.dump({"step": 60, "checkpoint": f"{p[train].output_path}/checkpoints/step-60",
                       "sets": {"web": {"documents": 10, "tokens": 900, "bytes": 2000, "loss": 2.1, "perplexity": 8.2,
                                        "bpb": 1.41},
                                "code": {"documents": 5, "tokens": 400, "bytes": 900, "loss": 1.8, "perplexity": 6.0,
                                         "bpb": 1.22}},
                       "macro_bpb": 1.315, "micro_bpb": 1.35}, open(f"{out}/eval.json", "w"))
        if s is ladder:
            json.dump({"target": "hero 535B-A23B", "predictions": {"0.5": {"loss": 2.2, "bpb": 0.9, "low": 0.85,
                                                                          "high": 0.95}},
                       "params": {"a": 1.5, "alpha": 0.3}, "loo_rel_error": 0.012}, open(f"{out}/fit.json", "w"))
            json.dump({"ok": False, "checks": [{"name": "loss_falling", "ok": True, "detail": "loss 6 -> 2"},
                                               {"name": "grad_norm", "ok": False, "detail": "peak 4.5 above 4"}],
                       "summary": {"last_step": 60}}, open(f"{out}/health.json", "w"))
        _finish(p[s], lease, rec)

    # a failed step with its traceback, as the executor records it
    lease, rec = _succeed(p[broken], plan)
    try:
        raise ValueError("shard 3 is corrupt")
    except ValueError as e:
        info = {**lease.info, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    st.write_status(p[broken].output_path, StepStatus.FAILED, lease=lease, previous=rec, info=info)
    leases.release(p[broken].output_path, lease)

    # a live training step: our own (live) process holds its lease
    _succeed(p[live], plan, holder=leases.new_holder_id())
    with open(f"{p[live].output_path}/metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in train_records(40, transport_switch=100, seq_switch=100))

    # an interrupted step: RUNNING (its lease records the attempt), its holder's process is gone
    pid = dead_pid()
    lease, _ = _succeed(p[stopped], plan, holder=f"{socket.gethostname()}:{pid}:dead")
    with open(leases.lease_path(p[stopped].output_path), "w") as f:
        f.write(dataclasses.replace(lease, pid=pid).to_json())

    outcome = {p[s].output_path: "succeeded" for s in (tok, train, evals, ladder)}
    outcome[p[corpus].output_path] = "cached"
    outcome[p[broken].output_path] = "failed"
    outcome[p[never].output_path] = "dep_failed"
    write_experiment_record(plan, RunOptions(prefix=prefix, script="small.py", description="a small review fixture"),
                            outcome)
    return {"plan": plan, "paths": {s.name: p[s].output_path for s in p}}


def build_fanout(prefix: str, n: int) -> None:
    """``n`` succeeded steps in groups of 50 under ``fan/g<k>/``, each read by one per-group summary step."""
    groups = []
    for g in range(max(1, n // 50)):
        members = [ExecutorStep(f"fan/g{g}/s{i}", noop, {"i": versioned(i), "out": this_output_path()})
                   for i in range(50)]
        groups.append(ExecutorStep(f"summary/g{g}", noop, {"ins": [output_path_of(m) for m in members],
                                                           "out": this_output_path()}))
    plan = plan_steps(groups, prefix)
    for ps in plan.steps:
        lease, rec = _succeed(ps, plan)
        with open(f"{ps.output_path}/part.json", "w") as f:
            f.write("{}")
        _finish(ps, lease, rec)
    write_experiment_record(plan, RunOptions(prefix=prefix, script="fan.py"),
                            {s.output_path: "succeeded" for s in plan.steps})


def build_health(prefix: str, run_path: str, total_steps: int) -> str:
    """A succeeded health-report step of the training run at ``run_path`` (its real step function
    writes health.json from the run's metrics); its directory. Its config names the run's horizon
    ``total_steps``, as ``default_health_report`` does."""
    from marin.monitoring.health import HealthReportConfig, health_report_step

    step = ExecutorStep("small/health", health_report_step,
                        HealthReportConfig(run_path=run_path, output_path=this_output_path(),
                                           total_steps=versioned(total_steps)))
    plan = plan_steps([step], prefix)
    ps = plan.planned(step)
    lease, rec = _succeed(ps, plan)
    health_report_step(resolve_config(ps, plan))
    _finish(ps, lease, rec)
    return ps.output_path
