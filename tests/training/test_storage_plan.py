"""Checkpoint storage planned before launch (``marin plan``, ``checkpoint.storage_quota``) and kept as
planned: retention keeps what is pinned (a branch's source, a transport handoff, a named step) and
rides out a store that refuses a delete."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from marin.cli import main as marin
from marin.textfmt import parse_bytes
from marin.training.checkpoint import CheckpointManager, CheckpointPolicy, pin_checkpoint
from marin.training.planning import StorageQuotaExceeded, check_storage_quota, handoff_steps, storage_plan

TIB = 2**40


def _kept_by_simulation(policy: CheckpointPolicy, total: int, pins=()) -> tuple[int, int]:
    """(peak, end) checkpoints held, the slow way: save one by one, retention after each commit."""
    held: set[int] = set()
    peak = 0
    saves = [s for s in range(1, total + 1) if s % policy.every_steps == 0 or s == total]
    for s in saves:
        peak = max(peak, len(held) + 1)  # the new one is written beside everything kept
        held.add(s)
        newest = sorted(held)[-policy.keep_last:]
        held = {h for h in held if h in newest or h in pins or (policy.keep_every and h % policy.keep_every == 0)}
    return peak, len(held)


@pytest.mark.parametrize("every,keep_last,keep_every,total,pins", [
    (500, 2, 10_000, 390_139, (60_000, 81_500)), (100, 2, None, 1_000, ()), (7, 3, 21, 200, (14, 50)),
    (10, 1, 30, 95, (95,)), (1, 5, None, 3, ())])
def test_storage_plan_matches_a_save_by_save_simulation(every, keep_last, keep_every, total, pins):
    policy = CheckpointPolicy(every_steps=every, keep_last=keep_last, keep_every=keep_every)
    plan = storage_plan(1000, policy, total, pinned=pins)
    assert (plan["peak_checkpoints"], plan["end_checkpoints"]) == _kept_by_simulation(policy, total, set(pins))
    assert plan["peak_bytes"] == 1000 * plan["peak_checkpoints"] and plan["fits_quota"]


def test_the_heros_storage_exceeds_a_100_tib_quota_and_the_advice_fits():
    size = int(5.86 * TIB)
    policy = CheckpointPolicy(every_steps=500, keep_every=10_000, pinned_steps=(60_000,))
    pins = handoff_steps(((0, "fixed"), (81_716, "ragged_capacity")), 500, 390_139)
    assert pins == (81_500,)
    plan = storage_plan(size, policy, 390_139, pinned=pins, quota="100TiB")
    assert plan["permanent_kept"] == 40  # 39 every 10,000 + the handoff at 81,500 (60,000 is one of the 39)
    assert 229 * TIB < plan["end_bytes"] < plan["peak_bytes"] and not plan["fits_quota"]
    with pytest.raises(StorageQuotaExceeded) as e:
        check_storage_quota(plan, "the hero")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("the hero would hold 246.1 TiB of checkpoints at its peak (42 of 5.9 TiB: 40 permanent, ")
    assert f"raise checkpoint.keep_every to {plan['keep_every_to_fit']:,} or more" in msg
    fixed = storage_plan(size, CheckpointPolicy(every_steps=500, keep_every=plan["keep_every_to_fit"],
                                                pinned_steps=(60_000,)), 390_139, pinned=pins, quota="100TiB")
    assert fixed["fits_quota"] and fixed["peak_bytes"] <= parse_bytes("100TiB")


def test_marin_plan_prints_the_storage_line_and_refuses_a_quota(capsys):
    # the AdamW variant's checkpoints (two moments per parameter)
    assert marin(["plan", "hero", "--pool", "gb200-11racks", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint storage: 246.0 TiB at its peak, 240.1 TiB at the end (40 permanent + 1 rolling" in out
    assert marin(["plan", "hero", "--pool", "gb200-11racks", "--optimizer", "adamw", "--storage-quota", "100TiB"]) == 1
    out = capsys.readouterr().out
    assert "storage quota 100.0 TiB: EXCEEDED (checkpoint.keep_every 33,000 would fit)" in out
    # the main run's, the default: MuonH keeps one momentum buffer for the matrices
    assert marin(["plan", "hero", "--pool", "gb200-11racks", "--storage-quota", "100TiB"]) == 1
    out = capsys.readouterr().out
    assert "checkpoint storage: 164.2 TiB at its peak, 160.3 TiB at the end (40 permanent + 1 rolling of 3.9 TiB" in out
    assert "storage quota 100.0 TiB: EXCEEDED (checkpoint.keep_every 20,000 would fit)" in out
    # the step itself fits: the refusal says the quota is why, not the host's memory
    assert "this step fits with 8 microbatch(es); the run DOES NOT FIT: its checkpoints exceed the storage quota" in out
    assert "DOES NOT FIT in host memory" not in out
    assert marin(["plan", "hero", "--pool", "gb200-11racks", "--storage-quota", "lots"]) == 2
    assert "not a size: 'lots'" in capsys.readouterr().err


def test_a_quota_the_policy_cannot_meet_is_refused_where_the_config_is_built(tmp_path):
    import dataclasses

    from marin.training.config import SyntheticDataConfig, TrainConfig
    from marin.training.planning import check_train_config_storage

    config = TrainConfig(output_path=str(tmp_path), data=SyntheticDataConfig(), model="tiny", pool="local-cpu-1",
                         train_steps=400, tokens_per_step=128, seq_len_phases=((0.0, 16),))
    assert storage_plan(1, config.checkpoint, 400)["peak_checkpoints"] == 3  # 2 kept + 1 being written
    assert check_train_config_storage(config) is None  # no quota: nothing to check
    tight = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, storage_quota="1MiB"))
    with pytest.raises(StorageQuotaExceeded, match=r"over checkpoint.storage_quota 1.0 MiB: lower "
                                                   r"checkpoint.keep_last or the pinned checkpoints, or raise"):
        check_train_config_storage(tight)
    with pytest.raises(ValueError, match="not a size"):
        CheckpointPolicy(storage_quota="100 parsecs")


def _save(mgr, step):
    mgr.save(step, {"w": np.full((4,), step, np.float32)}, {"data_step": step}, blocking=True)


def test_the_storage_plan_counts_what_the_manager_keeps(tmp_path):
    """One retention rule: a real manager saving at the plan's save steps holds, after its last save,
    exactly the checkpoints the plan counts at the end, and before it the plan's peak less the one
    being written."""
    policy = CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=2, keep_every=6, pinned_steps=(4,))
    total, handoffs = 15, {10: "transport handoff to ragged at step 11"}
    plan = storage_plan(1, policy, total, pinned=tuple(handoffs))
    mgr = CheckpointManager(str(tmp_path), policy, handoffs=handoffs)
    saves = sorted(set(range(policy.every_steps, total + 1, policy.every_steps)) | {total})
    for step in saves[:-1]:
        _save(mgr, step)
    assert len(mgr.committed_steps()) + 1 == plan["peak_checkpoints"]
    _save(mgr, saves[-1])
    assert mgr.committed_steps() == sorted(policy.retained(saves, tuple(handoffs))) == [4, 6, 10, 12, 14, 15]
    assert len(mgr.committed_steps()) == plan["end_checkpoints"]


def test_retention_keeps_pinned_checkpoints_and_rides_out_a_refused_delete(tmp_path, monkeypatch, caplog):
    from marin.training.checkpoint import manager as manager_module

    run = tmp_path / "run"
    policy = CheckpointPolicy(every_steps=1, keep_last=1, pinned_steps=(2,))
    mgr = CheckpointManager(str(run), policy, handoffs={3: "transport handoff to ragged at step 3"})
    pin_checkpoint(str(run), 1, by="/store/branch-abc")
    for step in range(1, 6):
        _save(mgr, step)
    assert mgr.committed_steps() == [1, 2, 3, 5]
    plan = mgr.retention_plan()
    assert plan == {1: "keep: pinned by branch /store/branch-abc", 2: "keep: pinned by checkpoint.pinned_steps",
                    3: "keep: pinned by transport handoff to ragged at step 3",
                    5: "keep: newest 1 (checkpoint.keep_last)"}
    real = manager_module.delete_dir

    def refuse(fs, path):
        raise PermissionError(f"AccessDenied: deleting {path} is not allowed by the bucket policy")

    monkeypatch.setattr(manager_module, "delete_dir", refuse)
    with caplog.at_level(logging.WARNING, logger="marin.training.checkpoint.manager"):
        _save(mgr, 6)  # retention cannot delete 5: logged, training goes on
    assert mgr.committed_steps() == [1, 2, 3, 5, 6]
    (line,) = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert "step-00000005 (delete: older than the newest kept): AccessDenied: deleting" in line
    assert line.endswith("retention tries again after the next save")
    monkeypatch.setattr(manager_module, "delete_dir", real)
    _save(mgr, 7)  # the next save's retention deletes it
    assert mgr.committed_steps() == [1, 2, 3, 7]
    assert json.loads(next((run / "checkpoints" / "pins").iterdir()).read_text())["step"] == 1


def test_marin_checkpoints_lists_sizes_pins_and_what_retention_deletes_next(tmp_path, capsys):
    from marin.models.config import get_preset
    from marin.training.config import AdamWConfig, SyntheticDataConfig, TrainConfig
    from marin.training.trainer import run_training

    run = tmp_path / "run"
    config = TrainConfig(output_path=str(run), data=SyntheticDataConfig(vocab_size=64),
                         model=get_preset("tiny", vocab_size=64, n_layers=1),  # one layer: compiles fastest
                         pool="local-cpu-1", train_steps=4, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                         optimizer=AdamWConfig(warmup_steps=1),
                         checkpoint={"every_steps": 1, "every_minutes": None, "keep_last": 3},
                         telemetry={"wandb_project": None, "progress_every_s": 0.0})
    run_training(config, use_ray=False)
    pin_checkpoint(str(run), 2, by="/store/a-branch")
    # the run's own policy keeps the newest 3 (2, 3, 4); with a lowered keep_last (an operator's change)
    # the pinned 2 stays and 3 goes
    assert marin(["checkpoints", str(run)]) == 0
    out = capsys.readouterr().out
    assert "keep: pinned by branch /store/a-branch" in out and "retention deletes next: nothing" in out
    assert out.count("permanent") == 4 and " KiB" in out and "3 permanent checkpoint(s)" in out  # with sizes
    mgr = CheckpointManager(str(run), CheckpointPolicy(every_steps=1, keep_last=1))
    assert mgr.retention_plan() == {2: "keep: pinned by branch /store/a-branch",
                                    3: "delete: older than the newest kept",
                                    4: "keep: newest 1 (checkpoint.keep_last)"}
    (run / "checkpoints" / "step-00000005").mkdir()  # a save that never committed
    assert marin(["checkpoints", str(run), "--prune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "retention deletes next: 5" in out and "dry run: nothing deleted (would delete 1)" in out
    assert (run / "checkpoints" / "step-00000005").exists()
    assert marin(["checkpoints", str(run), "--prune"]) == 0
    assert "deleted 1: 5" in capsys.readouterr().out and not (run / "checkpoints" / "step-00000005").exists()
    # a chunk cut short (a copy killed midway): the listing's sizes against the index's shapes say so
    step_dir = run / "checkpoints" / "step-00000004"
    chunks = [p for p in (step_dir / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json"]
    big = max(chunks, key=lambda p: p.stat().st_size)
    size = big.stat().st_size
    big.write_bytes(big.read_bytes()[:100])
    leaf_dir, *chunk = big.relative_to(step_dir / "arrays").parts  # leaf-00003, c, 0, 0, 0
    key = next(e["key"] for e in json.loads((step_dir / "index.json").read_text())["leaves"]
               if e["array"] == f"arrays/{leaf_dir}")
    assert marin(["checkpoints", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.split()[:2] == ["4", "permanent"])
    assert f"DAMAGED: {key}: chunk {'/'.join(chunk)} 100 bytes, {size:,} expected" in row
    rows = [line.split() for line in out if line.split()[1:2] == ["permanent"] and "checkpoint(s)" not in line]
    assert [r[4] for r in rows] == ["ok", "ok", "DAMAGED:"]  # step, tier, size (2 words), chunks
    assert out[-1] == ("1 damaged: 4 (sample, eval and export skip it and use the newest one that verifies; a resumed "
                       "run moves it aside)")
    assert marin(["checkpoints", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
