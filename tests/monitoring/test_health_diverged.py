"""A run stopped by the trainer's NaN/Inf guard reads as diverged in ``marin health`` and ``marin show``,
and its progress is a fraction of its planned steps, not of the last step it logged."""

from __future__ import annotations

import json

import pytest

from marin.cli import main as marin
from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution.status import StepStatus
from marin.models.config import get_preset
from marin.monitoring.health import health, run_outcome
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.metrics import read_metrics
from marin.training.trainer import TrainingDiverged, run_training

PLANNED = 20


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory) -> tuple[str, int]:
    """A real tiny run whose learning rate makes it diverge within a few steps, recorded FAILED with
    the trainer's error as the executor records a failed step; (its directory, the step that diverged)."""
    out = str(tmp_path_factory.mktemp("diverged") / "train")
    config = TrainConfig(output_path=out, data=SyntheticDataConfig(vocab_size=512),
                         model=get_preset("tiny", n_layers=1), pool="local-cpu-1", train_steps=PLANNED,
                         tokens_per_step=512, seq_len_phases=((0.0, 16),),
                         optimizer=AdamWConfig(warmup_steps=0, peak_lr=1e30),
                         checkpoint=CheckpointPolicy(every_steps=1, every_minutes=None),
                         telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))
    lease = leases.try_acquire(out, leases.new_holder_id(), info={"name": "diverged/train"})
    started = st.read_status(out)
    with pytest.raises(TrainingDiverged) as caught:
        run_training(config, use_ray=False)
    error = f"{type(caught.value).__name__}: {caught.value}"
    st.write_status(out, StepStatus.FAILED, lease=lease, previous=started, message=error,
                    info={**lease.info, "error": error, "traceback": ""})
    leases.release(out, lease)
    return out, int(str(caught.value).split("at step ")[1].split(":")[0])


def test_health_of_a_diverged_run_says_diverged_and_measures_progress_against_its_plan(diverged_run, capsys):
    run_dir, bad_step = diverged_run
    logged = [r["step"] for r in read_metrics(run_dir)]
    assert logged == list(range(1, bad_step))  # the step that diverged is never logged
    assert run_outcome(run_dir) == {"planned_steps": PLANNED,
                                    "diverged": next(iter(_diverged_words(run_dir)))}
    assert marin(["health", run_dir]) == 0
    out = capsys.readouterr().out.splitlines()
    last = bad_step - 1
    assert out[0].startswith(f"step {last} ({100 * last / PLANNED:.1f}% of {PLANNED} planned steps), loss ")
    assert out[0].endswith(": DIVERGED, the run stopped")
    finite = next(line for line in out if "] finite:" in line)
    assert finite.startswith(f"  [ALERT] finite: diverged: non-finite training signal at step {bad_step}: loss=")
    assert out[-1] == "overall: DIVERGED (a non-finite loss or grad norm stopped the run)"
    assert marin(["health", run_dir, "--strict", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["diverged"].startswith(f"non-finite training signal at step {bad_step}")
    assert marin(["show", run_dir]) == 0
    shown = capsys.readouterr().out
    assert f"[ALERT] finite: diverged: non-finite training signal at step {bad_step}" in shown


def test_a_run_that_diverged_on_its_first_step_has_no_records_and_still_reads_as_diverged():
    words = "non-finite training signal at step 1: loss=nan grad_norm=nan"
    report = health([], PLANNED, diverged=words)
    assert not report["ok"] and report["checks"][0] == {"name": "finite", "ok": False, "detail": f"diverged: {words}"}


def _diverged_words(run_dir: str) -> list[str]:
    """The trainer's words in the step's recorded error, up to the advice after them."""
    error = st.read_info(run_dir)["error"]
    return [error.removeprefix("TrainingDiverged: ").split(";")[0]]
