"""The operator's commands: the health report (``marin health``) and the LR re-plan helper
(``marin replan-lr``)."""

import json

import jax.numpy as jnp
import pytest

from marin.cli import main as marin
from marin.monitoring import health as health_report
from marin.training.checkpoint import CheckpointManager, CheckpointPolicy


def _records(n=50, drop=0.03, loss0=11.8, gn_peak_at=15):
    return [
        {"step": s, "loss": loss0 / (1 + 0.1 * s), "grad_norm": 1.5 - abs(s - gn_peak_at) * 0.02,
         "drop_frac_send": drop, "drop_frac_recv": drop / 2, "mfu": 0.2, "tokens_per_s": 1e6,
         "seq_len": 4096, "transport": "fixed"}
        for s in range(1, n + 1)
    ]


def test_healthy_run_is_clear():
    report = health_report.health(_records(), total_steps=100)
    assert report["ok"], report
    assert report["summary"]["grad_norm_peak_pct"] == pytest.approx(15.0)
    text = health_report.format_report(report)
    assert "[clear] drop_send" in text and "overall: clear" in text


def test_alerts():
    high_drop = health_report.health(_records(drop=0.104))  # the published run's early 10.43%
    assert not high_drop["ok"]
    # the run's drop check and its one phase's (4K on the fixed transport, 8% threshold)
    assert [c["name"] for c in high_drop["checks"] if not c["ok"]] == ["drop_send", "drop_phase_4096_fixed"]
    rising = _records()
    for r in rising:
        r["loss"] = 1.0 + 0.01 * r["step"]
    assert not health_report.health(rising)["ok"]
    nan = _records()
    nan[-1]["loss"] = "nan"
    assert [c["name"] for c in health_report.health(nan)["checks"] if not c["ok"]][0] == "finite"


def test_a_failed_checkpoint_save_is_flagged_with_where_it_was_first_seen():
    records = _records()
    for r in records[20:]:
        r["checkpoint_failed_saves"] = 1 if r["step"] < 40 else 2
    report = health_report.health(records, total_steps=100)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == ["checkpoint_saves"]
    (check,) = [c for c in report["checks"] if c["name"] == "checkpoint_saves"]
    assert check["detail"].startswith("2 permanent checkpoint save(s) failed (first seen at step 21); ")
    assert "checkpoint_saves" not in [c["name"] for c in health_report.health(_records())["checks"]]


def test_health_cli(tmp_path, capsys):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in _records(drop=0.2):
            f.write(json.dumps(r) + "\n")
    assert marin(["health", str(tmp_path), "--strict"]) == 1
    assert "ALERT" in capsys.readouterr().out
    assert marin(["health", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_replan_helper(tmp_path, capsys):
    config = {"optimizer": {"peak_lr": 1e-3, "warmup_steps": 10, "lr_replans": []}, "train_steps": 1000,
              "tokens_per_step": 4096}
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1))
    mgr.save(200, {"x": jnp.zeros(1)}, {"config": config, "tokens": 0}, blocking=True)
    assert marin(["replan-lr", str(tmp_path), "--new-total-steps", "600", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lr_replans"] == [[200, 600]]
    curve = {row["step"]: row for row in out["curve"]}
    assert curve[200]["new_lr"] == pytest.approx(curve[200]["old_lr"])  # continuous at the switch
    assert curve[600]["new_lr"] == pytest.approx(0.05 * 1e-3)  # still ends at 5% of peak
    assert out["tokens_saved_or_added"] == -400 * 4096
    assert marin(["replan-lr", str(tmp_path), "--new-total-steps", "600"]) == 0
    text = capsys.readouterr().out
    assert "lr_replans=((200, 600),)" in text
    table = [line.split() for line in text.splitlines() if line.startswith("  ")]
    assert table[0] == ["step", "lr", "before", "lr", "after"]
    assert ["600", f"{curve[600]['old_lr']:.4g}", f"{curve[600]['new_lr']:.4g}"] in table  # one row per curve step


def test_replan_helper_messages_for_a_past_horizon_and_a_finished_run(tmp_path, capsys):
    from marin.execution import lease as leases
    from marin.execution import status as st

    config = {"optimizer": {"peak_lr": 1e-3, "warmup_steps": 10, "lr_replans": []}, "train_steps": 1000,
              "tokens_per_step": 4096}
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1))
    mgr.save(200, {"x": jnp.zeros(1)}, {"config": config, "tokens": 0}, blocking=True)
    assert marin(["replan-lr", str(tmp_path), "--new-total-steps", "150"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("marin replan-lr: error: --new-total-steps 150 is not after step 200, where the resumed "
                           "run continues (the latest checkpoint); a new horizon must lie after it: pass "
                           "--new-total-steps greater than 200")
    # the step finished: a rerun would be skipped, and the helper says so instead of advising one
    lease = leases.try_acquire(str(tmp_path), "test-holder")
    st.write_status(str(tmp_path), st.StepStatus.RUNNING, lease=lease)
    st.write_status(str(tmp_path), st.StepStatus.SUCCESS, lease=lease)
    assert marin(["replan-lr", str(tmp_path), "--new-total-steps", "1500"]) == 0
    out = capsys.readouterr().out
    assert "note: this step already finished (SUCCESS): a rerun reuses it and trains nothing more." in out
    assert "then rerun the experiment" not in out
